"""Per-GPU memory of a PPO job, by component, for one parallel layout.

The activation accounting follows what the layers actually keep for backward, counted tensor by
tensor from our local layer spec (checked against measurement in ``tests/test_planner.py``).
Per transformer layer and per token on this rank, in elements:

* ``7 h`` hidden-sized tensors (norm inputs and outputs, attention output, residual branches),
  sharded over TP under sequence parallelism;
* ``4 F / tp`` MLP tensors (fc1 output halves, the SwiGLU input and output);
* ``2 (q + kv) / tp`` attention inputs and output, ``q_heads / tp`` log-sum-exp values;
* ``2 / tp_sp`` norm statistics and ``4 d`` rotary factors.

Full recompute keeps only each layer's input plus one layer's activations while recomputing;
``all_gather`` context parallelism keeps no more than the ring (it re-gathers K/V in backward),
but while one layer runs it holds the whole sequence's K/V and a ``[local, full]`` mask.
Everything outside the layers -- the final norm, the log-prob path (hidden states plus two
``[chunk, vocab/TP]`` fp32 buffers), labels -- is counted once.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.arch import attention_dims

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
    cp_comm_type: str = "p2p"
    sharded_rollout: bool = False  # rollout.engine=tp_sharded: generation weights and KV cache / TP

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def overrides(self) -> list[str]:
        out = [f"parallel.tp={self.tp}", f"parallel.pp={self.pp}", f"parallel.cp={self.cp}",
               f"parallel.sequence_parallel={'true' if self.sequence_parallel and self.tp > 1 else 'false'}"]
        if self.cp > 1:
            out.append(f"parallel.cp_comm_type={self.cp_comm_type}")
        if self.recompute:
            out.append(f"model.recompute.granularity={self.recompute}")
        if self.distributed_optimizer:
            out += ["actor.optim.use_distributed_optimizer=true", "critic.optim.use_distributed_optimizer=true"]
        if self.offload:
            out.append("trainer.offload=true")
        if self.sharded_rollout:
            out.append("rollout.engine=tp_sharded")
        return out


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
    return cfg.num_layers * layer_params(cfg) + embed * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size


def params_per_gpu(cfg: ModelConfig, layout: PlanOption) -> float:
    """Parameters on the most loaded pipeline stage (the one with the embedding or output layer)."""
    per_stage_layers = cfg.num_layers / layout.pp * layer_params(cfg)
    embed = cfg.vocab_size * cfg.hidden_size
    extra = embed if (layout.pp == 1 and not cfg.tie_word_embeddings) else 0
    return (per_stage_layers + embed + extra) / layout.tp


def activation_elems_per_token_layer(cfg: ModelConfig, layout: PlanOption) -> float:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    nq, nkv, d = attention_dims(cfg)
    tp = layout.tp
    sp = sequence_parallel_divisor(layout)
    ffn_terms = 4 * f if cfg.activation == "swiglu" else 2 * f
    return 7 * h / sp + ffn_terms / tp + (2 * nq * d + 2 * nkv * d + nq) / tp + 2 / sp + 4 * d


def activation_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int,
                     seq_len: Optional[int] = None) -> float:
    """Bytes kept for backward by the decoder layers of one stage for ``tokens_local`` tokens.

    Both CP strategies keep only local tensors (all_gather re-gathers K/V in backward), so
    ``seq_len`` matters only to :func:`attention_transient_bytes`."""
    layers = cfg.num_layers / layout.pp
    per_layer = activation_elems_per_token_layer(cfg, layout) * tokens_local * bytes_per
    nq, nkv, d = attention_dims(cfg)
    if layout.cp > 1 and layout.cp_comm_type == "all_gather":
        per_layer -= (nq * d + nq) / layout.tp * tokens_local * bytes_per  # no output / lse: recomputed
    # 1F1B keeps up to pp micro-batches in flight on the first stage: pp x (L/pp) layers' worth.
    in_flight = layout.pp
    if layout.recompute == "full":
        inputs = cfg.hidden_size / sequence_parallel_divisor(layout) * tokens_local * bytes_per
        return layers * inputs * in_flight + per_layer
    if layout.recompute == "selective":
        per_layer -= (nq * d + nq) / layout.tp * tokens_local * bytes_per  # attention output + lse recomputed
    return layers * per_layer * in_flight


def attention_transient_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int,
                              seq_len: Optional[int] = None) -> float:
    """Memory one layer's attention holds while it runs (not kept for backward).

    ``all_gather`` CP: the gathered K/V of the whole sequence and the ``[local, full]`` additive
    mask (cached across layers).  The ring's query tiles cap its score blocks near 64 MiB."""
    if layout.cp == 1 or layout.cp_comm_type != "all_gather":
        return 0.0
    _, nkv, d = attention_dims(cfg)
    full = seq_len or tokens_local * layout.cp
    return (2 * nkv * d / layout.tp) * full * bytes_per + tokens_local * full * bytes_per


def head_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int, bytes_per: int, chunk: int = 1024) -> dict:
    """Outside the layers: saved for backward, and the log-prob path's transient chunk buffers."""
    sp = sequence_parallel_divisor(layout)
    h = cfg.hidden_size
    saved = tokens_local * bytes_per * (2 * h / sp + h + 1 / sp) + tokens_local * LOGPROB_SAVED_BYTES_PER_TOKEN
    vocab_local = -(-cfg.vocab_size // layout.tp)
    # Two fp32 [chunk, vocab/TP] buffers, the fp32 output-weight gradient, the hidden gradient.
    transient = 2 * min(chunk, tokens_local) * vocab_local * 4 + vocab_local * h * 4 + tokens_local * h * bytes_per
    return {"saved": saved, "logprob_chunks": transient}


def naive_logits_bytes(cfg: ModelConfig, layout: PlanOption, tokens_local: int) -> float:
    """What the full-logits path holds at its peak: five fp32 [tokens, vocab/TP] tensors (logits,
    log-softmax, probabilities, the entropy product, the logits gradient), as measured."""
    vocab_local = -(-cfg.vocab_size // layout.tp)
    return 5 * tokens_local * vocab_local * 4


def kv_cache_bytes(cfg: ModelConfig, sequences: int, length: int, bytes_per: int = 2) -> float:
    """Keys and values of every layer for ``sequences`` sequences of ``length`` tokens (whole model)."""
    _, nkv, d = attention_dims(cfg)
    return 2 * cfg.num_layers * nkv * d * sequences * length * bytes_per


@dataclasses.dataclass
class Breakdown:
    components: dict
    total: float
    rollout_batch: int = 0  # sequences the rollout can generate together within the budget

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
    trainable = weights + grads + optim
    seq_len = prompt_len + response_len
    acts = activation_bytes(cfg, layout, tokens_per_microbatch, param_bytes, seq_len=seq_len)
    head = head_bytes(cfg, layout, tokens_per_microbatch, param_bytes)
    models = {"actor weights": weights, "actor grads": grads, "actor optimizer": optim}
    if with_critic:
        models.update({"critic weights": weights, "critic grads": grads, "critic optimizer": optim})
    if with_reference:
        models["reference weights"] = weights
    # With offload only the running phase's model stays on the GPU; the others wait in host memory.
    resident = trainable if layout.offload else sum(models.values())
    acts += attention_transient_bytes(cfg, layout, tokens_per_microbatch, param_bytes, seq_len=seq_len)
    train = resident + acts + head["saved"] + head["logprob_chunks"]
    # Generation: the actor's weights gathered into one full copy per rank, plus the KV cache;
    # the TP-sharded engine holds 1/TP of both.
    gen_split = layout.tp if layout.sharded_rollout else 1
    full_weights = total_params(cfg) * param_bytes / gen_split
    gen_resident = (weights if layout.offload else resident) + full_weights
    per_seq = kv_cache_bytes(cfg, 1, seq_len, param_bytes) / gen_split
    room = budget_bytes - gen_resident
    batch = int(max(0, min(max_rollout_batch, room // per_seq))) if room > 0 else 0
    rollout = full_weights + max(batch, 1) * per_seq
    components = dict(models)
    components.update({
        "activations": acts, "log-prob path": head["saved"] + head["logprob_chunks"],
        "rollout (weights + KV cache)": rollout,
    })
    total = max(train, gen_resident + max(batch, 1) * per_seq)
    return Breakdown(components, total, batch)
