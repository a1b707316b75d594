"""Per-GPU memory of a PPO job, by component, for one parallel layout.

The activation accounting follows what the layers actually keep for backward, counted tensor by
tensor from our local layer spec (checked against measurement in ``tests/test_planner.py``).
Per transformer layer and per token on this rank, in elements:

* ``7 h`` hidden-sized tensors (norm inputs and outputs, attention output, residual branches),
  sharded over TP under sequence parallelism;
* ``4 F / tp`` MLP tensors (fc1 output halves, the SwiGLU input and output);
* ``2 (q + kv) / tp`` attention inputs and output, ``q_heads / tp`` log-sum-exp values;
* ``2 / tp_sp`` norm statistics and ``4 d`` rotary factors.

Full recompute keeps only each layer's input plus one layer's activations while recomputing.
Every context-parallel strategy keeps the same local tensors (``all_gather`` re-gathers K/V in
backward); ``a2a`` keeps its head shard of the whole sequence instead, which is the same size
unless it replicates K/V heads.  No strategy builds a mask: what one layer's attention holds
while it runs is K/V blocks, accumulators and all-to-all buffers
(:func:`attention_transient_bytes`).  Everything outside the layers -- the final norm, the
log-prob path (hidden states plus two ``[chunk, vocab/TP]`` fp32 buffers), labels -- is counted
once.

The peak of a micro-batch (:func:`peak_bytes`) is what is kept plus the largest working set of
one phase: an MLP, an attention (forward; with training, its backward) or the log-prob chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.config.schema import ModelConfig
from megatron_rl.layout.arch import attention_dims, is_moe, padded_vocab_size
from megatron_rl.layout.distill import own_sizes
from megatron_rl.layout.kv import kv_bytes
from megatron_rl.layout.lora import adapter_params, int8_base_saving, lora_on
from megatron_rl.layout.rules import rollout_problems
from megatron_rl.layout.sizes import ParallelLayout, shares_training_weights
from megatron_rl.ops.logits_memory import DEFAULT_KEEP_LOGITS_BYTES, keeps_logits
from megatron_rl.planner import moe
from megatron_rl.planner.option import PlanOption, cp_levels

GiB = 2**30

# Per parameter of a trainable model: fp32 main gradient, and what Adam keeps in fp32 (master
# weight, first and second moment).
GRAD_BYTES_PER_PARAM = 4
ADAM_BYTES_PER_PARAM = 3 * 4
# Per LoRA adapter parameter: the adapters are fp32 (their own master weights), Adam's two moments.
LORA_BYTES_PER_PARAM = 4
LORA_ADAM_BYTES_PER_PARAM = 2 * 4
# Per token, outside the layers: the two fp32 statistics the log-prob op saves for backward (log
# normaliser, mean logit) and two int64 label vectors (the batch's labels on the device and the
# clamped copy the op saves).
LOGPROB_SAVED_BYTES_PER_TOKEN = 2 * 4 + 2 * 8


A2A_COMM_TYPES = ("a2a", "a2a+p2p")


def _kv_heads_after_a2a(kv_local: float, a2a: int) -> float:
    """K/V heads a rank holds after a2a, times ``a2a`` (per local token): ``kv_local`` when they
    split, ``a2a`` when there are fewer than ``a2a`` and each is replicated."""
    return max(kv_local, a2a) if a2a > 1 else kv_local


def sequence_parallel_divisor(layout: PlanOption) -> int:
    """What hidden-sized activations are divided by: TP under sequence parallelism, else 1."""
    return layout.tp if layout.sequence_parallel and layout.tp > 1 else 1


def layer_params(cfg: ModelConfig) -> int:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    nq, nkv, d = attention_dims(cfg)
    qkv = h * (nq + 2 * nkv) * d + ((nq + 2 * nkv) * d if cfg.add_qkv_bias else 0)
    proj = nq * d * h
    mlp = h * f * (2 if cfg.activation == "swiglu" else 1) + f * h
    norms = 2 * h + (2 * d if cfg.qk_layernorm else 0)
    return qkv + proj + mlp + norms


def total_params(cfg: ModelConfig) -> int:
    embed = cfg.vocab_size * cfg.hidden_size
    layers = sum(moe.split_params(cfg, layer_params(cfg))) if is_moe(cfg) else cfg.num_layers * layer_params(cfg)
    return int(layers) + embed * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size


def params_per_gpu(cfg: ModelConfig, layout: PlanOption) -> float:
    """Parameters on the most loaded pipeline stage (the one with the embedding or output layer)."""
    per_stage_layers = cfg.num_layers / layout.pp * layer_params(cfg)
    embed = cfg.vocab_size * cfg.hidden_size
    extra = embed if (layout.pp == 1 and not cfg.tie_word_embeddings) else 0
    if is_moe(cfg):  # experts / (EP x ETP)
        return moe.params_per_gpu(cfg, layout, layer_params(cfg), embed + extra)
    return (per_stage_layers + embed + extra) / layout.tp


def activation_elems_per_token_layer(cfg: ModelConfig, layout: PlanOption) -> float:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    nq, nkv, d = attention_dims(cfg)
    tp = layout.tp
    sp = sequence_parallel_divisor(layout)
    ffn_terms = 4 * f if cfg.activation == "swiglu" else 2 * f
    kv = nkv / tp
    if layout.cp > 1 and layout.cp_comm_type in A2A_COMM_TYPES:
        kv = _kv_heads_after_a2a(kv, cp_levels(layout)[0])
    elems = 7 * h / sp + ffn_terms / tp + (2 * nq / tp + 2 * kv) * d + nq / tp + 2 / sp + 4 * d
    if (layout.cp == 1 or layout.cp_comm_type not in A2A_COMM_TYPES) and layout.recompute != "selective":
        # The attention returns its output in the layout the output projection reads, so the
        # tensor it keeps and the projection's input are one (a2a's all-to-all back makes a copy).
        elems -= nq / tp * d
    return moe.activation_elems_per_token_layer(cfg, layout, elems) if is_moe(cfg) else elems


def activation_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int,
                     seq_len: Optional[int] = None) -> float:
    """Bytes kept for backward by the decoder layers of one stage for ``tokens_local`` tokens.

    Every CP strategy keeps O(local) tensors (all_gather re-gathers K/V in backward), so
    ``seq_len`` matters only to :func:`attention_transient_bytes`."""
    layers = cfg.num_layers / layout.pp
    per_layer = activation_elems_per_token_layer(cfg, layout) * tokens_local * bytes_per
    nq, nkv, d = attention_dims(cfg)
    # 1F1B keeps up to pp micro-batches in flight on the first stage: pp x (L/pp) layers' worth.
    in_flight = layout.pp
    if layout.recompute == "full":
        inputs = cfg.hidden_size / sequence_parallel_divisor(layout) * tokens_local * bytes_per
        return layers * inputs * in_flight + per_layer
    if layout.recompute == "selective":
        per_layer -= (nq * d + nq) / layout.tp * tokens_local * bytes_per  # attention output + lse recomputed
    return layers * per_layer * in_flight


def attention_transient_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int,
                              seq_len: Optional[int] = None, backward: bool = False,
                              training: bool = True) -> float:
    """Memory one layer's attention holds while it runs (forward, or ``backward``), beyond its
    inputs and what it keeps for backward.  No strategy builds a mask or materialises scores;
    softmax statistics and merged partial results are fp32, K/V travel in the model dtype.

    * ``p2p`` (ring): its own K/V and the block in flight, the fp32 output accumulator and one
      block's output; backward adds the fp32 dK/dV of the block and the one in flight, dQ and one
      block's kernel gradients;
    * ``all_gather``: the gathered K/V of the whole sequence, and in backward their fp32 gradients;
    * ``a2a``: the all-to-all buffers (three copies of a q-sized tensor: send, receive,
      reorder) and, when nothing is kept for backward (``training=False``), the head shard of the
      whole sequence (q, k, v, out); backward: the head shard's gradients and two buffers;
    * ``a2a+p2p``: the head shard's inputs (``training=False``) and the larger of the buffers and
      the ring's terms on the head shard.

    Checked against the op alone (``track_peak_memory``, fp32, cp 2 and 4): within 15% (the
    all_gather forward's local K/V copy while gathering, and a2a+p2p's backward, are above)."""
    if layout.cp == 1:
        return 0.0
    nq, nkv, d = attention_dims(cfg)
    s, tp, fp32 = tokens_local, layout.tp, 4
    full = seq_len or s * layout.cp
    q = s * nq / tp * d
    lse = s * nq / tp
    a2a, _ = cp_levels(layout)
    kv_heads = _kv_heads_after_a2a(nkv / tp, a2a) if layout.cp_comm_type in A2A_COMM_TYPES else nkv / tp
    kv = s * kv_heads * d  # one of K or V

    def ring(q, kv, lse):
        if backward:
            return 2 * 2 * kv * bytes_per + 2 * 2 * kv * fp32 + q * fp32 + (q + 2 * kv) * bytes_per
        return 2 * 2 * kv * bytes_per + q * (fp32 + bytes_per) + 2 * lse * fp32

    comm = layout.cp_comm_type
    if comm == "p2p":
        return ring(q, kv, lse)
    if comm == "all_gather":
        gathered = 2 * kv * full / s
        if backward:
            return gathered * (bytes_per + fp32) + q * fp32 + (q + 2 * kv) * bytes_per
        return gathered * bytes_per + q * (fp32 + bytes_per) + 2 * lse * fp32
    # a2a, a2a+p2p: the head shard of the group's sequence has q's and kv's sizes; the all-to-all
    # buffers are gone before the attention (or the ring) runs.
    buffers = (2 if backward else 3) * q * bytes_per
    if backward:
        inner = (q + 2 * kv) * bytes_per if comm == "a2a" else ring(q, kv, lse)
        return max(buffers, inner) if comm == "a2a+p2p" else buffers + inner
    if comm == "a2a":
        return buffers + (0 if training else (2 * q + 2 * kv) * bytes_per)
    return (0 if training else (q + 2 * kv) * bytes_per) + max(buffers, ring(q, kv, lse))


def layer_working_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int,
                        training: bool = True) -> float:
    """The MLP's working set of one layer beyond what is kept, measured on the local spec:
    forward only, the fc1 output and the activation's intermediates (SwiGLU ``5 F / tp``, GELU
    ``2 F / tp``) plus the residual stream (``4 h`` and the rotary factors); with backward, the
    gradients of one layer's MLP (``4 F / tp``)."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    _, _, d = attention_dims(cfg)
    sp = sequence_parallel_divisor(layout)
    if training:
        out = 4 * f / layout.tp * tokens_local * bytes_per
    else:
        ffn = 5 * f if cfg.activation == "swiglu" else 2 * f
        out = (ffn / layout.tp + 4 * h / sp + d) * tokens_local * bytes_per
    return moe.layer_working_bytes(cfg, layout, tokens_local, bytes_per, training, out) if is_moe(cfg) else out


def _attention_phase_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int,
                           seq_len: Optional[int], training: bool) -> float:
    """Forward only: the attention's inputs and output with the residual stream, plus its
    transient; with backward, the attention backward's transient and its input gradients."""
    nq, nkv, d = attention_dims(cfg)
    sp = sequence_parallel_divisor(layout)
    qkv = (2 * nq + 2 * nkv) * d / layout.tp * tokens_local * bytes_per
    if training:
        return qkv + attention_transient_bytes(cfg, layout, tokens_local, bytes_per, seq_len, backward=True)
    residual = 2 * cfg.hidden_size / sp * tokens_local * bytes_per
    return residual + qkv + attention_transient_bytes(cfg, layout, tokens_local, bytes_per, seq_len,
                                                      training=False)


def head_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int, chunk: int = 1024,
               keep_logits_bytes: float = DEFAULT_KEEP_LOGITS_BYTES) -> dict:
    """Outside the layers: saved for backward (with the fp32 logits where a micro-batch keeps them,
    ``batch.logprob_keep_logits_gib``), and the log-prob path's transient chunk buffers."""
    sp = sequence_parallel_divisor(layout)
    h = cfg.hidden_size
    saved = tokens_local * bytes_per * (2 * h / sp + h + 1 / sp) + tokens_local * LOGPROB_SAVED_BYTES_PER_TOKEN
    vocab_local = -(-cfg.vocab_size // layout.tp)
    # Kept logits span the padded vocabulary (megatron's rows), not only the real tokens.
    rows_local = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, layout.tp) // layout.tp
    if keeps_logits(tokens_local, rows_local, keep_logits_bytes):
        saved += tokens_local * rows_local * 4
    # Two fp32 [chunk, vocab/TP] buffers, the fp32 output-weight gradient, the hidden gradient.
    transient = 2 * min(chunk, tokens_local) * vocab_local * 4 + vocab_local * h * 4 + tokens_local * h * bytes_per
    return {"saved": saved, "logprob_chunks": transient}


def peak_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int,
               seq_len: Optional[int] = None, training: bool = True, chunk: int = 1024) -> float:
    """Peak bytes of one micro-batch of ``tokens_local`` tokens on a rank, above its weights (and
    gradient buffers): what is kept for backward (``training``) plus the largest phase -- one
    layer's MLP, one layer's attention, or the log-prob path's chunks.  Forward only (scoring,
    reference and old-policy passes) keeps nothing, and the hidden states stay for the head."""
    head = head_bytes(cfg, layout, tokens_local, bytes_per, chunk=chunk)
    if training:
        logprob = head["logprob_chunks"]
    else:  # the chunk buffers beside the final hidden states; no gradients
        logprob = 2 * min(chunk, tokens_local) * -(-cfg.vocab_size // layout.tp) * 4
        logprob += tokens_local * cfg.hidden_size * bytes_per
    phases = (layer_working_bytes(cfg, layout, tokens_local, bytes_per, training),
              _attention_phase_bytes(cfg, layout, tokens_local, bytes_per, seq_len, training), logprob)
    if training:
        kept = activation_bytes(cfg, layout, tokens_local, bytes_per, seq_len=seq_len) + head["saved"]
    else:
        kept = 0.0
    return kept + max(phases)


def naive_logits_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int) -> float:
    """What the full-logits path holds at its peak: five fp32 [tokens, vocab/TP] tensors (logits,
    log-softmax, probabilities, the entropy product, the logits gradient), as measured."""
    vocab_local = -(-cfg.vocab_size // layout.tp)
    return 5 * tokens_local * vocab_local * 4


# rollout.kv_block_tokens' default: megatron's engine allocates its KV cache in pages of this many tokens.
KV_BLOCK_TOKENS = 256


def engine_kv_cache_bytes(cfg: ModelConfig, layout: PlanOption, sequences: int, seq_len: int, bytes_per: int = 2,
                          block_tokens: int = KV_BLOCK_TOKENS) -> float:
    """The ``rollout.kv_cache_memory`` (bytes per rank) that holds ``sequences`` sequences of
    ``seq_len`` tokens at once in megatron's engine: whole pages of ``block_tokens`` per sequence
    plus the one page the engine reserves."""
    pages = sequences * -(-seq_len // block_tokens) + 1
    return kv_bytes(cfg, block_tokens * pages, bytes_per, layout.tp, layout.pp)


def teacher_option(layout: PlanOption, sizes: Optional[dict]) -> PlanOption:
    """The layout the distillation teachers run on: ``layout`` (the training one), or the sizes
    ``algorithm.distill.layout`` sets (``sizes``: tp / pp / cp, None where unset) on its ranks."""
    own = own_sizes(sizes, layout)
    if own is None:
        return layout
    tp, pp, cp = own
    return PlanOption.of(tp=tp, pp=pp, cp=cp, dp=max(layout.world // (tp * pp * cp), 1),
                         sequence_parallel=layout.sequence_parallel and tp > 1, offload=layout.offload)


def model_state(cfg: ModelConfig, layout: PlanOption, with_critic: bool = True, with_reference: bool = True,
                param_bytes: int = 2, actor_lora=None, critic_lora=None, teachers: tuple = (),
                teacher_layout: Optional[PlanOption] = None) -> dict:
    """Per-rank bytes of each model's weights, gradients and optimizer state (bf16 weights, fp32
    grads and Adam).  A model with LoRA (``actor_lora`` / ``critic_lora``, a ``LoRAConfig``):
    its frozen base in the model dtype or int8 (``quantize_base``; no grads, no optimizer state)
    and :func:`lora_state` for its adapters; a LoRA actor is its own reference (its base, adapters
    off): no reference copy.
    ``teachers``: the ``ModelConfig`` of each distillation teacher, frozen (weights only) on
    ``teacher_layout`` (:func:`teacher_option`; None: the training layout)."""
    p_gpu = params_per_gpu(cfg, layout)
    shard = layout.dp * layout.cp if layout.distributed_optimizer else 1
    weights = p_gpu * param_bytes
    grads = p_gpu * GRAD_BYTES_PER_PARAM
    optim = p_gpu * ADAM_BYTES_PER_PARAM / shard
    if is_moe(cfg):  # the experts' state sharded over the expert data-parallel ranks
        optim = moe.optimizer_params(cfg, layout, p_gpu, layer_params(cfg)) * ADAM_BYTES_PER_PARAM

    def trained(name: str, lora) -> dict:
        if not lora_on(lora):
            return {f"{name} weights": weights, f"{name} grads": grads, f"{name} optimizer": optim}
        base = weights - int8_base_saving(cfg, lora, layout.tp, param_bytes) / layout.pp
        return {f"{name} weights": base, **lora_state(cfg, layout, lora, name)}

    models = trained("actor", actor_lora)
    if with_critic:
        models.update(trained("critic", critic_lora))
    if with_reference and not lora_on(actor_lora):
        models["reference weights"] = weights
    for i, teacher in enumerate(teachers):
        models[f"{teacher_name(i, len(teachers))} weights"] = \
            params_per_gpu(teacher, teacher_layout or layout) * param_bytes
    return models


def teacher_name(index: int, count: int) -> str:
    """How the plan names a teacher's lines: ``teacher``, or ``teacher 1``, ``teacher 2``, ... with several."""
    return "teacher" if count == 1 else f"teacher {index + 1}"


def teacher_phase_bytes(teachers: tuple, layout: PlanOption, models: dict, tokens_local: int, bytes_per: int,
                        seq_len: int, teacher_layout: Optional[PlanOption] = None) -> float:
    """The peak of the teacher-scoring phase (0 without teachers): a forward-only pass of each teacher
    (:func:`peak_bytes` with ``training=False``) on ``teacher_layout`` (None: ``layout``, the
    training one; its micro-batch holds the same sequences, split over its own CP) above what stays
    resident -- the teacher's own weights with ``trainer.offload`` (the other models wait in host
    memory), else every model."""
    own_layout = teacher_layout or layout
    tokens = tokens_local * layout.cp // own_layout.cp
    peak = 0.0
    for i, teacher in enumerate(teachers):
        own = models[f"{teacher_name(i, len(teachers))} weights"]
        resident = own if layout.offload else sum(models.values())
        peak = max(peak, resident + peak_bytes(teacher, own_layout, tokens, bytes_per, seq_len=seq_len,
                                               training=False))
    return peak


def lora_state(cfg: ModelConfig, layout: PlanOption, lora, name: str = "actor") -> dict:
    """Per-rank bytes of one model's LoRA adapters: fp32 weights (no master copy: they are fp32),
    their fp32 gradients and Adam's two moments (sharded over DP x CP with the distributed
    optimizer); each TP rank's share of every layer (:func:`megatron_rl.layout.lora.adapter_params`),
    divided over the pipeline stages."""
    adapters = adapter_params(cfg, lora, layout.tp) / layout.pp
    shard = layout.dp * layout.cp if layout.distributed_optimizer else 1
    return {f"{name} LoRA weights": adapters * LORA_BYTES_PER_PARAM,
            f"{name} LoRA grads": adapters * GRAD_BYTES_PER_PARAM,
            f"{name} LoRA optimizer": adapters * LORA_ADAM_BYTES_PER_PARAM / shard}


def model_bytes(models: dict, name: str) -> float:
    """Everything :func:`model_state` counts for model ``name`` (``actor``: its LoRA lines too)."""
    return sum(v for k, v in models.items() if k.startswith(f"{name} "))


def rollout_resident_bytes(models: dict, offload: bool) -> float:
    """What the training state leaves on the GPU while generating: with ``trainer.offload`` the
    actor's weights alone (grads, optimizer states and the other models wait in host memory), else
    everything of :func:`model_state`."""
    if offload:
        return models["actor weights"] + models.get("actor LoRA weights", 0.0)
    return sum(models.values())


@dataclasses.dataclass
class Breakdown:
    components: dict
    total: float
    rollout_batch: int = 0  # sequences the rollout can generate together within the budget
    kv_cache_memory: float = 0.0  # the rollout.kv_cache_memory (bytes) of that batch
    train_peak: float = 0.0  # the training phase's peak (resident models + one micro-batch); total adds generation
    rollout_peak: float = 0.0  # the rollout phase's: the training state left resident, generation's weights and KV
    rollout: Optional["RolloutMemory"] = None  # the rollout.layout it generates on and its memory
    rollout_why: str = ""  # why that layout (one line)
    rollout_kv: float = 0.0  # generation's KV cache per rank
    teacher_peak: float = 0.0  # distillation: the teacher-scoring phase's peak (in train_peak too)

    def gib(self) -> dict:
        return {k: v / GiB for k, v in self.components.items()}


def estimate(
    cfg: ModelConfig,
    layout: PlanOption,
    *,
    prompt_len: int,
    response_len: int,
    tokens_per_microbatch: int,
    budget_bytes: float,
    max_rollout_batch: int = 256,
    with_critic: bool = True,
    with_reference: bool = True,
    param_bytes: int = 2,
    rollout_concurrency: Optional[int] = None,
    actor_lora=None,
    critic_lora=None,
    teachers: tuple = (),
    teacher_sizes: Optional[dict] = None,
) -> Breakdown:
    """Peak per-GPU bytes over the phases of a PPO step (bf16 weights, fp32 grads and Adam).

    The rollout generates as many sequences at once as the memory left beside the resident
    models allows (up to ``max_rollout_batch``); ``rollout_batch`` says how many.  On megatron's
    engine it runs on ``layout.rollout_layout``, or on the layout :func:`choose_rollout_layout`
    picks for ``rollout_concurrency`` sequences per replica when that is None.  ``actor_lora`` /
    ``critic_lora``: LoRA's model state (:func:`model_state`); ``teachers``: distillation teachers'
    ``ModelConfig``s, whose scoring phase (:func:`teacher_phase_bytes`) is one more peak, on the
    ``teacher_sizes`` of ``algorithm.distill.layout`` (:func:`teacher_option`)."""
    rollout_concurrency = rollout_concurrency or ROLLOUT_CONCURRENCY
    taught = teacher_option(layout, teacher_sizes)
    models = model_state(cfg, layout, with_critic, with_reference, param_bytes, actor_lora, critic_lora, teachers,
                         taught)
    trainable = model_bytes(models, "actor")
    seq_len = prompt_len + response_len
    kept = activation_bytes(cfg, layout, tokens_per_microbatch, param_bytes, seq_len=seq_len)
    head = head_bytes(cfg, layout, tokens_per_microbatch, param_bytes)
    peak = peak_bytes(cfg, layout, tokens_per_microbatch, param_bytes, seq_len=seq_len)
    # With offload only the running phase's model stays on the GPU; the others wait in host memory.
    resident = trainable if layout.offload else sum(models.values())
    # Activations: what is kept plus the larger of one layer's MLP and attention working sets.  The
    # training peak adds the larger of those and the log-prob chunks, which never coexist.
    acts = kept + max(layer_working_bytes(cfg, layout, tokens_per_microbatch, param_bytes),
                      _attention_phase_bytes(cfg, layout, tokens_per_microbatch, param_bytes, seq_len, True))
    teacher_peak = teacher_phase_bytes(teachers, layout, models, tokens_per_microbatch, param_bytes, seq_len, taught)
    train = max(resident + peak, teacher_peak)
    # Generation: megatron's engine on rollout.layout, the actor's shards or a second copy refit from them.
    train_state = rollout_resident_bytes(models, layout.offload)
    apart = layout.generators
    rollout_mem, why = _rollout_phase(cfg, layout, seq_len=seq_len, train_state=train_state,
                                      budget_bytes=budget_bytes, max_rollout_batch=max_rollout_batch,
                                      param_bytes=param_bytes, concurrency=rollout_concurrency)
    batch, kv, extra_weights = rollout_mem.sequences, rollout_mem.kv, rollout_mem.extra_weights
    rollout_peak = rollout_mem.peak if apart else train_state + extra_weights + kv
    components = dict(models)
    components.update({
        "activations": acts, "log-prob path": head["saved"] + head["logprob_chunks"],
        "rollout (weights + KV cache)": 0.0 if apart else extra_weights + kv,
    })
    total = train if apart else max(train, rollout_peak)
    return Breakdown(components, total, batch, kv, train, rollout_peak, rollout_mem, why, kv, teacher_peak)


def _rollout_phase(cfg: ModelConfig, layout: PlanOption, *, seq_len: int, train_state: float, budget_bytes: float,
                   max_rollout_batch: int, param_bytes: int, concurrency: int) -> tuple["RolloutMemory", str]:
    """The rollout's memory on ``layout.rollout_layout`` as the config sets it, else on the layout
    :func:`choose_rollout_layout` picks.  With ``rollout.ranks`` (``layout.generators``) generation
    runs on GPUs of its own, which hold the inference shard and its KV cache alone."""
    apart = layout.generators
    seq_kw = dict(seq_len=seq_len, resident=0.0 if apart else train_state, budget_bytes=budget_bytes,
                  param_bytes=param_bytes, generators=apart or None)
    if layout.rollout_layout is not None:
        mem = rollout_memory(cfg, layout, layout.rollout_layout, max_sequences=max_rollout_batch, **seq_kw)
        shared = "the actor's shards" if mem.shares else "a copy refit from the training shards"
        why = (f"{layout.rollout_layout.name()} x {mem.replicas} replicas: as the config sets it" if apart
               else f"{layout.rollout_layout.name()}: as the config sets it ({shared})")
    else:
        mem, why = choose_rollout_layout(cfg, layout, concurrency=concurrency, max_sequences=max_rollout_batch,
                                         **seq_kw)
    return mem, (f"on the {apart} generator rank(s): {why}" if apart else why)


# ----------------------------------------------------------------------------- rollout.layout
# Tensor-parallel sizes tried for generation (one NVLink domain at most).
ROLLOUT_TP_SIZES = (1, 2, 4, 8)
ROLLOUT_PP_SIZES = (1, 2, 4, 8, 16)
# Sequences each inference replica must hold at once when the planner chooses rollout.layout and
# nothing says how many (rollout.max_batch_size, ``megatron-rl plan --rollout-concurrency``).
ROLLOUT_CONCURRENCY = 16


def rollout_option(infer: ParallelLayout, world: int) -> PlanOption:
    """``infer`` on ``world`` ranks as the memory model's :class:`PlanOption` (no CP, no sequence parallelism)."""
    return PlanOption(sizes=infer.on_world(world))


@dataclasses.dataclass(frozen=True)
class RolloutMemory:
    """Per-rank memory of the rollout phase on megatron's engine with ``layout``."""

    layout: ParallelLayout
    replicas: int
    shares: bool  # generates on the actor's shards: no second copy
    weights: float  # bf16 weights of the inference shard (the actor's own when ``shares``)
    extra_weights: float  # what the inference model adds: 0 when it shares, else ``weights`` (freed after each rollout)
    resident: float  # the training state that stays on the GPU during rollout
    reserved: float  # the KV page the engine reserves
    kv_per_sequence: float
    sequences: int  # sequences each replica holds at once (rollout.max_batch_size)
    kv: float  # the KV budget per rank for them (rollout.kv_cache_memory)

    @property
    def peak(self) -> float:
        return self.resident + self.extra_weights + self.kv

    @property
    def concurrency(self) -> int:
        """Sequences generated at once over the world."""
        return self.sequences * self.replicas


def rollout_memory(cfg: ModelConfig, train: PlanOption, infer: ParallelLayout, *, seq_len: int, resident: float,
                   budget_bytes: float, max_sequences: int = 256, param_bytes: int = 2,
                   block_tokens: int = KV_BLOCK_TOKENS, generators: Optional[int] = None) -> RolloutMemory:
    """What generating with ``infer`` holds per rank: ``resident`` (the training state left on the
    GPU), the inference shard's weights unless it shares the actor's, and the paged KV cache of its
    stage's layers and KV heads / its TP for as many sequences as the rest of ``budget_bytes``
    holds (up to ``max_sequences``).  ``generators``: generation on that many ranks of its own
    (``rollout.ranks``), which hold the inference shard and never the actor's."""
    world = generators or train.world
    opt = rollout_option(infer, world)
    shares = not generators and shares_training_weights(infer, train)
    weights = params_per_gpu(cfg, opt) * param_bytes
    extra = 0.0 if shares else weights
    reserved = engine_kv_cache_bytes(cfg, opt, 0, seq_len, param_bytes, block_tokens)
    per_seq = engine_kv_cache_bytes(cfg, opt, 1, seq_len, param_bytes, block_tokens) - reserved
    room = budget_bytes - resident - extra - reserved
    sequences = int(max(0, min(max_sequences, room // per_seq))) if room > 0 else 0
    kv = reserved + max(sequences, 1) * per_seq
    return RolloutMemory(infer, infer.replicas(world), shares, weights, extra, resident, reserved, per_seq,
                         sequences, kv)


def rollout_layout_options(cfg: ModelConfig, train: PlanOption, generators: Optional[int] = None
                           ) -> list[ParallelLayout]:
    """Inference layouts worth trying beside ``train`` (or on ``generators`` ranks of their own):
    every TP and PP that divide what they must, with the training layout's expert parallelism
    (expert-TP: the training one's)."""
    out = []
    for tp in ROLLOUT_TP_SIZES:
        for pp in ROLLOUT_PP_SIZES:
            infer = ParallelLayout(tp=tp, pp=pp, ep=train.ep, etp=(train.etp or train.tp) if is_moe(cfg) else None)
            if infer.etp == infer.tp:
                infer = dataclasses.replace(infer, etp=None)
            if generators and infer.ep > 1 and infer.pp > 1:  # never the actor's shards there
                continue
            if not rollout_problems(cfg, infer, train, generators or train.world):
                out.append(infer)
    return out


def choose_rollout_layout(cfg: ModelConfig, train: PlanOption, *, seq_len: int, resident: float,
                          budget_bytes: float, concurrency: int = ROLLOUT_CONCURRENCY, max_sequences: int = 256,
                          param_bytes: int = 2, block_tokens: int = KV_BLOCK_TOKENS,
                          generators: Optional[int] = None) -> tuple[RolloutMemory, str]:
    """``rollout.layout`` when the config leaves it unset: the smallest TP, then PP, whose weights
    and a KV cache for ``concurrency`` sequences per replica fit what the training state leaves of
    ``budget_bytes`` during rollout (smaller TP x PP: more replicas).  When none holds that many,
    the one that holds the most over the world (then the smaller).  Returns the layout's rollout
    memory (its KV budget: what fits, up to ``max_sequences`` per replica) and one line saying why.
    ``generators``: the layout of that many generator ranks of their own (``rollout.ranks``)."""
    options = [rollout_memory(cfg, train, infer, seq_len=seq_len, resident=resident, budget_bytes=budget_bytes,
                              max_sequences=max(concurrency, max_sequences), param_bytes=param_bytes,
                              block_tokens=block_tokens, generators=generators)
               for infer in rollout_layout_options(cfg, train, generators)]
    if not options and generators:
        raise ValueError(f"no rollout.layout divides this model over {generators} generator rank(s)")
    if not options:  # nothing else divides: the training layout
        mem = rollout_memory(cfg, train, ParallelLayout.for_rollout(None, train), seq_len=seq_len, resident=resident,
                             budget_bytes=budget_bytes, max_sequences=max_sequences, param_bytes=param_bytes,
                             block_tokens=block_tokens)
        return mem, f"{mem.layout.name()}: the training layout's sizes (no other layout divides this model and world)"
    fitting = [m for m in options if m.sequences >= concurrency]
    if fitting:
        mem = min(fitting, key=lambda m: (m.layout.tp, m.layout.pp))
        how = "the actor's own shards" if mem.shares else f"a second copy, {mem.extra_weights / GiB:.1f} GiB per rank"
        why = (f"{mem.layout.name()} x {mem.replicas} replicas: the smallest TP, then PP, whose weights ({how}) and a "
               f"KV cache for {concurrency} sequences per replica fit during rollout")
    else:
        mem = max(options, key=lambda m: (m.concurrency, -m.layout.tp, -m.layout.pp))
        why = (f"{mem.layout.name()} x {mem.replicas} replicas: no layout holds {concurrency} sequences per replica "
               f"during rollout; this one holds the most over the {'generator ranks' if generators else 'world'} "
               f"({mem.concurrency})")
    if mem.sequences > max_sequences:
        mem = dataclasses.replace(mem, sequences=max_sequences, kv=mem.reserved + max_sequences * mem.kv_per_sequence)
    return mem, why


def activation_bytes_per_token(model, layout, dtype_bytes: int) -> float:
    """Bytes a rank keeps for backward per local token of a micro-batch: the decoder layers of its
    pipeline stage (pp micro-batches in flight) and the log-prob path, as the planner counts them."""
    option = PlanOption.of(tp=layout.tp, pp=layout.pp, cp=layout.cp, dp=layout.dp,
                           sequence_parallel=layout.sequence_parallel, recompute=model.recompute.granularity,
                           cp_comm_type=layout.cp_comm_type)
    # Kept logits are bounded by batch.logprob_keep_logits_gib on their own, not a cost per token.
    return (activation_bytes(model, option, 1, dtype_bytes)
            + head_bytes(model, option, 1, dtype_bytes, keep_logits_bytes=0)["saved"])


def derived_token_budget(batch, model, layout, max_seq_len: int, dtype_bytes: int) -> Optional[int]:
    """The micro-batch token budget per rank when the config sets neither ``max_tokens_per_rank``
    nor ``micro_batch_size`` (else None): derived from ``max_seq_len`` (the longest sequence the job
    makes) and the model's activation memory per token on ``layout``
    (:func:`megatron_rl.data.batching.default_token_budget`).  Resolved before launch, without megatron-core
    (``batch.token_budget`` in :mod:`megatron_rl.resolve`)."""
    from megatron_rl.data.batching import default_token_budget
    from megatron_rl.data.microbatch import alignment

    if batch.max_tokens_per_rank or batch.micro_batch_size:
        return None
    align = alignment(layout.cp, layout.tp, layout.sequence_parallel)
    return default_token_budget(max_seq_len, activation_bytes_per_token(model, layout, dtype_bytes),
                                cp=layout.cp, align=align)
