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
from megatron_rl.models.arch import attention_dims, is_moe
from megatron_rl.planner import moe

GiB = 2**30

# Per parameter of a trainable model: fp32 main gradient, and what Adam keeps in fp32 (master
# weight, first and second moment).
GRAD_BYTES_PER_PARAM = 4
ADAM_BYTES_PER_PARAM = 3 * 4
# Per token, outside the layers: the two fp32 statistics the log-prob op saves for backward (log
# normaliser, mean logit) and two int64 label vectors (the batch's labels on the device and the
# clamped copy the op saves).
LOGPROB_SAVED_BYTES_PER_TOKEN = 2 * 4 + 2 * 8


@dataclasses.dataclass(frozen=True)
class PlanOption:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = True
    recompute: Optional[str] = None  # None | "selective" | "full"
    offload: bool = False
    distributed_optimizer: bool = False
    cp_comm_type: str = "p2p"  # p2p | all_gather | a2a | a2a+p2p
    sharded_rollout: bool = False  # rollout.engine=tp_sharded: generation weights and KV cache / TP
    megatron_rollout: bool = False  # rollout.engine=megatron: the actor's own shards, a paged KV cache
    hierarchical_cp: Optional[tuple] = None  # a2a+p2p: (a2a size, ring size); None = (2, cp / 2)
    ep: int = 1  # MoE: expert parallel (planner/moe.py)
    etp: Optional[int] = None  # MoE: expert tensor parallel; None = tp

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def settings(self, with_critic: bool = True) -> dict:
        """The config keys this layout decides, with their values (``None`` = null): every
        memory switch, also when off, so a config can be checked against the plan."""
        out = {"parallel.tp": self.tp, "parallel.pp": self.pp, "parallel.cp": self.cp,
               "parallel.sequence_parallel": self.sequence_parallel and self.tp > 1}
        if self.cp > 1:
            out["parallel.cp_comm_type"] = self.cp_comm_type
            if self.cp_comm_type == "a2a+p2p":
                out["parallel.hierarchical_context_parallel_sizes"] = list(cp_levels(self))
        out["model.recompute.granularity"] = self.recompute
        out["actor.optim.use_distributed_optimizer"] = self.distributed_optimizer
        if with_critic:
            out["critic.optim.use_distributed_optimizer"] = self.distributed_optimizer
        out["trainer.offload"] = self.offload
        out["rollout.engine"] = ("tp_sharded" if self.sharded_rollout else "megatron" if self.megatron_rollout
                                 else "torch")
        out.update(moe.settings(self))
        return out

    def overrides(self, with_critic: bool = True) -> list[str]:
        """:meth:`settings` as command-line overrides; dense layouts leave out the expert sizes."""
        dense = self.ep == 1 and self.etp is None
        return [f"{key}={format_value(value)}" for key, value in self.settings(with_critic).items()
                if not (dense and key in moe.SETTINGS_KEYS)]


def format_value(value) -> str:
    """A config value as an override writes it: true/false, null, [a,b]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


A2A_COMM_TYPES = ("a2a", "a2a+p2p")


def cp_levels(layout: PlanOption) -> tuple[int, int]:
    """``(a2a size, ring size)`` of the CP group: ``(cp, 1)`` for a2a, ``(1, cp)`` for p2p and
    all_gather, the hierarchical sizes (default ``(2, cp / 2)``) for a2a+p2p."""
    if layout.cp_comm_type == "a2a":
        return layout.cp, 1
    if layout.cp_comm_type == "a2a+p2p":
        if layout.hierarchical_cp:
            return int(layout.hierarchical_cp[0]), int(layout.hierarchical_cp[1])
        return 2, max(layout.cp // 2, 1)
    return 1, layout.cp


def a2a_heads_ok(cfg: ModelConfig, tp: int, a2a: int) -> bool:
    """Whether a2a over ``a2a`` ranks can split this model's heads at ``tp``: query heads per TP
    rank divisible by it, K/V heads divisible by it (split) or dividing it (replicated)."""
    nq, nkv, _ = attention_dims(cfg)
    q_local, kv_local = nq // tp, max(nkv // tp, 1)
    return q_local % a2a == 0 and (kv_local % a2a == 0 or a2a % kv_local == 0)


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


def head_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int, chunk: int = 1024) -> dict:
    """Outside the layers: saved for backward, and the log-prob path's transient chunk buffers."""
    sp = sequence_parallel_divisor(layout)
    h = cfg.hidden_size
    saved = tokens_local * bytes_per * (2 * h / sp + h + 1 / sp) + tokens_local * LOGPROB_SAVED_BYTES_PER_TOKEN
    vocab_local = -(-cfg.vocab_size // layout.tp)
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


def kv_cache_bytes(cfg: ModelConfig, sequences: int, length: int, bytes_per: int = 2) -> float:
    """Keys and values of every layer for ``sequences`` sequences of ``length`` tokens (whole model)."""
    _, nkv, d = attention_dims(cfg)
    return 2 * cfg.num_layers * nkv * d * sequences * length * bytes_per


# rollout.kv_block_tokens' default: megatron's engine allocates its KV cache in pages of this many tokens.
KV_BLOCK_TOKENS = 256


def engine_kv_bytes_per_token(cfg: ModelConfig, layout: PlanOption, bytes_per: int = 2) -> float:
    """K and V of one token in megatron's inference engine on one rank: the layers of its pipeline
    stage, its TP share of the KV heads (2 x layers/PP x kv_heads/TP x head_dim x bytes)."""
    _, nkv, d = attention_dims(cfg)
    return 2 * cfg.num_layers / layout.pp * nkv / layout.tp * d * bytes_per


def engine_kv_cache_bytes(cfg: ModelConfig, layout: PlanOption, sequences: int, seq_len: int, bytes_per: int = 2,
                          block_tokens: int = KV_BLOCK_TOKENS) -> float:
    """The ``rollout.kv_cache_memory`` (bytes per rank) that holds ``sequences`` sequences of
    ``seq_len`` tokens at once in megatron's engine: whole pages of ``block_tokens`` per sequence
    plus the one page the engine reserves."""
    pages = sequences * -(-seq_len // block_tokens) + 1
    return engine_kv_bytes_per_token(cfg, layout, bytes_per) * block_tokens * pages


@dataclasses.dataclass
class Breakdown:
    components: dict
    total: float
    rollout_batch: int = 0  # sequences the rollout can generate together within the budget
    kv_cache_memory: float = 0.0  # megatron's engine: the rollout.kv_cache_memory (bytes) of that batch
    train_peak: float = 0.0  # the training phase's peak (resident models + one micro-batch); total adds generation

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
) -> Breakdown:
    """Peak per-GPU bytes over the phases of a PPO step (bf16 weights, fp32 grads and Adam).

    The rollout generates as many sequences at once as the memory left beside the resident
    models allows (up to ``max_rollout_batch``); ``rollout_batch`` says how many."""
    p_gpu = params_per_gpu(cfg, layout)
    shard = layout.dp * layout.cp if layout.distributed_optimizer else 1
    weights = p_gpu * param_bytes
    grads = p_gpu * GRAD_BYTES_PER_PARAM
    optim = p_gpu * ADAM_BYTES_PER_PARAM / shard
    if is_moe(cfg):  # the experts' state sharded over the expert data-parallel ranks
        optim = moe.optimizer_params(cfg, layout, p_gpu, layer_params(cfg)) * ADAM_BYTES_PER_PARAM
    trainable = weights + grads + optim
    seq_len = prompt_len + response_len
    kept = activation_bytes(cfg, layout, tokens_per_microbatch, param_bytes, seq_len=seq_len)
    head = head_bytes(cfg, layout, tokens_per_microbatch, param_bytes)
    peak = peak_bytes(cfg, layout, tokens_per_microbatch, param_bytes, seq_len=seq_len)
    models = {"actor weights": weights, "actor grads": grads, "actor optimizer": optim}
    if with_critic:
        models.update({"critic weights": weights, "critic grads": grads, "critic optimizer": optim})
    if with_reference:
        models["reference weights"] = weights
    # With offload only the running phase's model stays on the GPU; the others wait in host memory.
    resident = trainable if layout.offload else sum(models.values())
    # Activations: what is kept plus the larger of one layer's MLP and attention working sets.  The
    # training peak adds the larger of those and the log-prob chunks, which never coexist.
    acts = kept + max(layer_working_bytes(cfg, layout, tokens_per_microbatch, param_bytes),
                      _attention_phase_bytes(cfg, layout, tokens_per_microbatch, param_bytes, seq_len, True))
    train = resident + peak
    # Generation: the actor's weights gathered into one full copy per rank, plus the KV cache;
    # the TP-sharded engine holds 1/TP of both; megatron's engine (MoE models: the only engine)
    # runs on the actor's own shards with a paged cache of this stage's layers.
    gen_split = layout.tp if layout.sharded_rollout else 1
    full_weights = total_params(cfg) * param_bytes / gen_split
    per_seq = kv_cache_bytes(cfg, 1, seq_len, param_bytes) / gen_split
    reserved = 0.0
    paged = is_moe(cfg) or layout.megatron_rollout
    if paged:
        full_weights = 0.0
        reserved = engine_kv_cache_bytes(cfg, layout, 0, seq_len, param_bytes)
        per_seq = engine_kv_cache_bytes(cfg, layout, 1, seq_len, param_bytes) - reserved
    gen_resident = (weights if layout.offload else resident) + full_weights
    room = budget_bytes - gen_resident - reserved
    batch = int(max(0, min(max_rollout_batch, room // per_seq))) if room > 0 else 0
    kv = reserved + max(batch, 1) * per_seq
    rollout = full_weights + kv
    components = dict(models)
    components.update({
        "activations": acts, "log-prob path": head["saved"] + head["logprob_chunks"],
        "rollout (weights + KV cache)": rollout,
    })
    total = max(train, gen_resident + kv)
    return Breakdown(components, total, batch, kv if paged else 0.0, train)
