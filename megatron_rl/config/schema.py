"""The typed configuration schema (omegaconf structured configs).

One dataclass per node.  Every field has a default and a one-line ``help`` in its metadata; the
config reference in ``docs/config.md`` is generated from these, so a key documented there always
exists here.  Parallel sizes live in :class:`ParallelConfig` only; the data-parallel size is
derived from the world size and never configured.

A field may also declare what it accepts, and validation enforces it for every field alike:
``Literal`` choices from ``config/choices.py`` (omegaconf refuses other values while loading),
``choices=`` naming a registry that plugins may extend (checked by ``config/rules.py``), and numeric
bounds (``ge``/``gt``/``le``/``lt``).  Every int and float field declares an upper bound the runtime
can take (the ``MAX_*`` limits below; ``tests/test_config_bounds.py`` walks the schema for them), and
no float field takes NaN or infinity.
"""

from __future__ import annotations

import dataclasses
import operator
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megatron_rl.config.choices import (
    ACTIVATION_NAMES,
    BACKENDS,
    CP_COMM_TYPES,
    DEVICES,
    DISTILL_BASELINES,
    KL_CONTROLLERS,
    LORA_BASE_QUANTIZATIONS,
    LR_SCHEDULE_NAMES,
    MOE_DISPATCHERS,
    MOE_DROP_POLICIES,
    MOE_LOAD_BALANCING,
    MOE_ROUTER_DTYPES,
    MOE_SCORE_FUNCTIONS,
    NORMALIZATIONS,
    OLD_LOGPROB_SOURCES,
    ON_LIMIT,
    PAGED_ATTENTION,
    PARAMS_DTYPES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    REWARD_CONVENTIONS,
    ROLLOUT_BATCHING,
    ROLLOUT_CORRECTION_LEVELS,
    ROPE_SCALING_TYPES,
    SFT_TARGETS,
    TRAINER_MODES,
    TRANSFORMER_IMPL_CHOICES,
)

BOUNDS = ("ge", "gt", "le", "lt")
_BOUND_SIGNS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_BOUND_OPS = {"ge": operator.ge, "gt": operator.gt, "le": operator.le, "lt": operator.lt}

# What the runtime can take: a value past these, let through, would fail only in the ranks (an
# OverflowError from datetime.timedelta, "Overflow when unpacking long" from a seed, a checkpoint
# the resume cannot find).
INT64_MAX = 2**63 - 1  # any int: torch takes ints as int64 at most
C_INT_MAX = 2**31 - 1  # sizes, counts, token lengths, ranks: C ints in torch, megatron-core and the kernels
MAX_SEED = 2**32 - 1  # numpy's seeds; torch's (< 2**64) even with megatron-core's per-rank offsets added
MAX_STEPS = 10**8 - 1  # checkpoints are step_XXXXXXXX directories: 8 digits
MAX_TIMEOUT_S = 7 * 24 * 3600  # datetime.timedelta, torch's stores and the workers' pipes (32-bit ms) take it
MAX_LOCAL_PROCS = 4096  # processes one machine starts
MAX_FLOAT = 3e38  # below float32's largest (3.4e38): the value fits the float32 tensors it reaches
MAX_BYTES = 2**50  # a byte count (1 PiB): an exact float, and an int64 after any per-rank sum


def bounds_text(bounds: dict) -> str:
    """``{"gt": 0, "le": 1}`` -> ``"> 0 and <= 1"`` (for errors and the config reference)."""
    return " and ".join(f"{_BOUND_SIGNS[op]} {bound}" for op, bound in bounds.items())


def field_bounds(field, tp) -> dict:
    """The bounds a field of type ``tp`` is checked against: its declared ones, and for an int
    without an upper bound the largest int64 (what torch takes), so no integer reaches the runtime
    unbounded."""
    bounds = dict(field.metadata.get("bounds", {}))
    if int in (tp, *typing.get_args(tp)) and not {"le", "lt"} & set(bounds):
        bounds["le"] = INT64_MAX
    return bounds


def within(value, bounds: dict) -> bool:
    """``value`` satisfies every bound (False for NaN)."""
    return all(_BOUND_OPS[op](value, bound) for op, bound in bounds.items())


def _f(default: Any, help: str, *, choices: Optional[str] = None, **bounds):  # noqa: A002 - reads best here
    """A schema field: default, one-line help, and optionally a registry (``"module:NAME"``) or bounds."""
    unknown = set(bounds) - set(BOUNDS)
    if unknown:
        raise TypeError(f"unknown bound(s) {sorted(unknown)}; use {BOUNDS}")
    metadata = {"help": help, "bounds": bounds}
    if choices:
        metadata["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class RunConfig:
    name: str = _f("megatron_rl", "Run name; the run directory is <dir>/<name>.")
    dir: str = _f("runs", "Parent directory of run directories.")
    seed: int = _f(1234, "Seed for weights, data order, sampling and dropout-free RNG streams.", ge=0, le=MAX_SEED)
    allow_untested_megatron_core: bool = _f(
        False, "Start with a megatron-core release outside the tested range (>=0.19.2,<0.20): one warning "
        "instead of stopping before launch. Run make test on that stack before trusting it.")


@dataclass
class ParallelConfig:
    tp: int = _f(1, "Tensor-parallel size.", ge=1, le=C_INT_MAX)
    pp: int = _f(1, "Pipeline-parallel size.", ge=1, le=C_INT_MAX)
    vpp: Optional[int] = _f(None, "Virtual pipeline stages per pipeline rank (interleaved 1F1B); null = off.",
                            ge=1, le=C_INT_MAX)
    cp: int = _f(1, "Context-parallel size: each sequence is split over this many ranks (zigzag).", ge=1, le=C_INT_MAX)
    sequence_parallel: bool = _f(False, "Shard activations outside attention/MLP over the TP group (needs tp>1).")
    cp_comm_type: Literal[CP_COMM_TYPES] = _f(
        "p2p", "CP attention communication: p2p (ring), all_gather, a2a (Ulysses: heads split over CP), "
        "a2a+p2p (a2a inside groups, ring across them)."
    )
    batch_p2p_comm: Optional[bool] = _f(
        None, "Batch pipeline send/recv; null = auto (off for PP=2 with VPP, where megatron-core is wrong)."
    )
    hierarchical_context_parallel_sizes: Optional[list] = _f(
        None, "With cp_comm_type=a2a+p2p: CP sizes per level, a2a (inner) first, product = cp, e.g. [2, 4]; null "
              "otherwise."
    )
    ep: int = _f(1, "Expert-parallel size (MoE): the routed experts are split over this many ranks, drawn from the "
                 "data- and context-parallel ranks (world size divisible by etp*ep*pp).", ge=1, le=C_INT_MAX)
    etp: Optional[int] = _f(None, "Expert tensor-parallel size (MoE): each expert's FFN split over this many ranks; "
                            "null = tp.", ge=1, le=C_INT_MAX)


@dataclass
class DistributedConfig:
    backend: Literal[BACKENDS] = _f("auto", "torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl, gloo.")
    timeout_s: int = _f(600, "Collective timeout; a hung or dead rank ends the job after this long.",
                        gt=0, le=MAX_TIMEOUT_S)
    nproc: int = _f(1, "Processes to start on this machine when not launched by torchrun or srun.",
                    ge=1, le=MAX_LOCAL_PROCS)
    device: Literal[DEVICES] = _f("auto", "auto (cuda if available), cuda, cpu.")


@dataclass
class RecomputeConfig:
    granularity: Optional[Literal[RECOMPUTE_GRANULARITIES]] = _f(None, "Activation recompute: null, full, selective.")
    method: Literal[RECOMPUTE_METHODS] = _f("uniform", "With full recompute: uniform or block.")
    num_layers: int = _f(1, "With full recompute: layers per recompute unit (uniform) or per stage (block).",
                         ge=1, le=C_INT_MAX)
    modules: list = _f(["core_attn"], "With selective recompute: core_attn, mlp, layernorm, moe_act.")


@dataclass
class RopeScalingConfig:
    """HF ``rope_scaling`` (read from config.json with model.hf_path, written back on export)."""

    type: Literal[ROPE_SCALING_TYPES] = _f(
        "none", "RoPE scaling: none, llama3 (Llama-3.1, megatron-core's fixed frequency factors 1/4 and original "
        "length 8192), yarn (Qwen2.5/Qwen3 past their native window; docs/long_context.md). HF linear/dynamic are "
        "not supported.")
    factor: Optional[float] = _f(None, "Scaling factor (needed by llama3 and yarn); yarn: the model then takes "
                                 "factor x original_max_position_embeddings positions.", gt=0, le=MAX_FLOAT)
    original_max_position_embeddings: Optional[int] = _f(
        None, "yarn: the window the model was pretrained on; null = model.max_position_embeddings.", ge=1, le=C_INT_MAX)
    beta_fast: float = _f(32.0, "yarn: rotations per window above which a frequency is kept (HF beta_fast).",
                          gt=0, le=MAX_FLOAT)
    beta_slow: float = _f(1.0, "yarn: rotations per window below which a frequency is divided by factor (HF "
                          "beta_slow).", gt=0, le=MAX_FLOAT)
    mscale: Optional[float] = _f(None, "yarn: HF mscale; with mscale_all_dim the attention factor is "
                                 "mscale(factor, mscale) / mscale(factor, mscale_all_dim), else 0.1 ln(factor) + 1.",
                                 ge=-MAX_FLOAT, le=MAX_FLOAT)
    mscale_all_dim: Optional[float] = _f(None, "yarn: HF mscale_all_dim (see mscale).", ge=-MAX_FLOAT, le=MAX_FLOAT)
    truncate: bool = _f(True, "yarn: round the correction range to whole dimensions (HF truncate).")


@dataclass
class MoEConfig:
    num_experts: Optional[int] = _f(None, "Routed experts per MoE layer; null = a dense model.", ge=1, le=C_INT_MAX)
    router_topk: int = _f(2, "Experts each token is routed to.", ge=1, le=C_INT_MAX)
    ffn_hidden_size: Optional[int] = _f(None, "Hidden units of one routed expert; null = model.ffn_hidden_size.",
                                        ge=1, le=C_INT_MAX)
    shared_expert_ffn_hidden_size: Optional[int] = _f(
        None, "Hidden units of the shared experts (all of them together), run on every token; null = none.",
        ge=1, le=C_INT_MAX)
    shared_expert_gate: bool = _f(False, "Scale the shared experts' output by sigmoid(x . w) (Qwen2-MoE).")
    score_function: Literal[MOE_SCORE_FUNCTIONS] = _f("softmax", "Router score function: softmax or sigmoid.")
    topk_norm: bool = _f(True, "Renormalise the chosen experts' scores to sum to 1 (HF norm_topk_prob); false = "
                         "softmax over all experts, the top-k kept as they are (softmax only).")
    topk_scaling_factor: Optional[float] = _f(None, "Multiply the routing weights by this; null = 1.",
                                              gt=0, le=MAX_FLOAT)
    router_dtype: Literal[MOE_ROUTER_DTYPES] = _f(
        "float32", "Dtype of the router's logits, scores and the weighted sum of expert outputs: float32, float64, "
        "model (params_dtype).")
    load_balancing: Literal[MOE_LOAD_BALANCING] = _f(
        "aux_loss", "Load-balancing loss: aux_loss (per micro-batch), seq_aux_loss (per sequence), none. Reported "
        "as actor/moe_aux_loss; in the loss only with aux_loss_coeff > 0.")
    aux_loss_coeff: float = _f(0.0, "Load-balancing loss coefficient per MoE layer; 0 = not in the loss.",
                               ge=0, le=MAX_FLOAT)
    z_loss_coeff: float = _f(0.0, "Router z-loss coefficient per MoE layer (reported as actor/moe_z_loss); 0 = "
                             "not in the loss.", ge=0, le=MAX_FLOAT)
    token_dispatcher: Literal[MOE_DISPATCHERS] = _f(
        "alltoall", "Token dispatcher: alltoall (tokens travel to their experts' EP ranks), allgather.")
    capacity_factor: Optional[float] = _f(
        None, "Expert capacity as a multiple of the even share; tokens over it are dropped. null = no dropping "
        "(keep for RL: a dropped token changes its log-prob).", gt=0, le=MAX_FLOAT)
    token_drop_policy: Literal[MOE_DROP_POLICIES] = _f(
        "probs", "With capacity_factor: drop the lowest-scored tokens (probs) or the last ones (position).")
    layer_freq: int = _f(1, "Every layer_freq-th layer, from layer 0, has experts; the others a dense MLP.",
                         ge=1, le=C_INT_MAX)
    dense_layers: list = _f([], "Layer indices with a dense MLP of model.ffn_hidden_size (HF mlp_only_layers).")


@dataclass
class ModelConfig:
    hf_path: Optional[str] = _f(None, "Local Hugging Face model directory to import (config + safetensors).")
    num_layers: int = _f(2, "Transformer layers.", ge=1, le=C_INT_MAX)
    hidden_size: int = _f(64, "Hidden size.", ge=1, le=C_INT_MAX)
    ffn_hidden_size: int = _f(128, "MLP intermediate size.", ge=1, le=C_INT_MAX)
    num_attention_heads: int = _f(4, "Attention heads.", ge=1, le=C_INT_MAX)
    num_query_groups: Optional[int] = _f(None, "KV heads for GQA; null = num_attention_heads.", ge=1, le=C_INT_MAX)
    kv_channels: Optional[int] = _f(None, "Head dimension; null = hidden_size / num_attention_heads.",
                                    ge=1, le=C_INT_MAX)
    vocab_size: int = _f(128, "Vocabulary size (padded internally for TP; padding never reaches log-probs).",
                         ge=1, le=C_INT_MAX)
    make_vocab_size_divisible_by: int = _f(128, "Pad the vocabulary to a multiple of this times tp.",
                                           ge=1, le=C_INT_MAX)
    max_position_embeddings: int = _f(
        4096, "The model's native window (HF max_position_embeddings); data.max_prompt_tokens + "
        "rollout.max_new_tokens must fit it, or YaRN's factor x original_max_position_embeddings (model.rope_scaling).",
        ge=1, le=C_INT_MAX)
    normalization: Literal[NORMALIZATIONS] = _f("RMSNorm", "RMSNorm or LayerNorm.")
    norm_epsilon: float = _f(1e-6, "Norm epsilon.", gt=0, le=1)
    activation: Literal[ACTIVATION_NAMES] = _f("swiglu", "MLP activation: swiglu, gelu.")
    add_bias_linear: bool = _f(False, "Biases in all linear layers.")
    add_qkv_bias: bool = _f(False, "Bias in the QKV projection only (Qwen2).")
    qk_layernorm: bool = _f(False, "RMSNorm on queries and keys per head (Qwen3).")
    tie_word_embeddings: bool = _f(False, "Share input embedding and output layer weights.")
    rotary_base: float = _f(10000.0, "RoPE theta.", gt=0, le=MAX_FLOAT)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    params_dtype: Literal[PARAMS_DTYPES] = _f(
        "auto", "Parameter dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16."
    )
    transformer_impl: Literal[TRANSFORMER_IMPL_CHOICES] = _f(
        "auto", "Layer implementation: auto (TransformerEngine with CUDA, else local), transformer_engine, local."
    )
    init_method_std: float = _f(0.02, "Std of the random weight init (when no checkpoint is loaded).",
                                ge=0, le=MAX_FLOAT)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class BatchConfig:
    max_tokens_per_rank: Optional[int] = _f(
        None, "Token budget per micro-batch per rank (micro-batches are filled up to it); takes precedence over "
        "micro_batch_size. null with micro_batch_size null = derived: room for 64 sequences of "
        "data.max_prompt_tokens + rollout.max_new_tokens, at most what 4 GiB of activations hold for this model "
        "and layout, at least one such sequence; at least pp micro-batches (docs/quickstart.md).", ge=1, le=C_INT_MAX
    )
    micro_batch_size: Optional[int] = _f(
        None, "Fixed sequences per micro-batch, used when max_tokens_per_rank is null; null = the token budget.",
        ge=1, le=C_INT_MAX
    )
    packing: bool = _f(True, "Pack sequences into one THD row (no padding waste); false = padded BSHD rows.")
    logprob_chunk_size: int = _f(1024, "Tokens per chunk of the vocab-parallel log-prob/entropy computation.",
                                 ge=1, le=C_INT_MAX)
    logprob_keep_logits_gib: float = _f(
        1.0, "Keep a training micro-batch's fp32 logits ([tokens, vocab/TP] x 4 bytes per rank) for the backward "
        "pass when they take at most this many GiB, instead of running the output projection again; "
        "0 = always recompute (least memory). Same numbers either way.", ge=0, le=1024)


@dataclass
class OptimConfig:
    lr: float = _f(1e-5, "Peak learning rate.", ge=0, le=MAX_FLOAT)
    min_lr: float = _f(0.0, "Final learning rate of a decaying schedule (linear, cosine).", ge=0, le=MAX_FLOAT)
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0, le=MAX_FLOAT)
    adam_beta1: float = _f(0.9, "Adam beta1.", ge=0, lt=1)
    adam_beta2: float = _f(0.999, "Adam beta2.", ge=0, lt=1)
    adam_eps: float = _f(1e-8, "Adam epsilon.", gt=0, le=MAX_FLOAT)
    clip_grad: float = _f(1.0, "Global gradient-norm clip; 0 = off.", ge=0, le=MAX_FLOAT)
    warmup_steps: int = _f(0, "Linear warm-up steps.", ge=0, le=MAX_STEPS)
    schedule: Literal[LR_SCHEDULE_NAMES] = _f("constant", "LR schedule after warm-up: constant, linear, cosine.")
    use_distributed_optimizer: bool = _f(False, "Shard optimizer state over data-parallel ranks.")
    overlap_grad_reduce: bool = _f(True, "On CUDA, reduce gradients bucket by bucket while the backward pass runs; the "
                                         "CPU reduces once after it.")
    grad_reduce_bucket_size: Optional[int] = _f(None, "Parameters per gradient-reduce bucket when overlapping; null = "
                                                      "megatron-core's max(40M, 1M x DP).", ge=1, le=INT64_MAX)
    grad_reduce_dtype: Literal["float32", "bfloat16"] = _f("float32", "Dtype gradients are accumulated and reduced in: "
                                                                      "bfloat16 halves the reduce traffic of a bf16 "
                                                                      "model, at bf16 rounding of the sums.")


@dataclass
class DataConfig:
    train_path: str = _f("task:digit_sum", "Prompt file (JSONL/Parquet) or a built-in task (task:digit_sum).")
    tokenizer: Optional[str] = _f(None, "'char', or a local HF tokenizer dir; null = model.hf_path, else 'char'.")
    max_prompt_tokens: int = _f(512, "Longer prompts are dropped (and counted in the log).", ge=1, le=C_INT_MAX)
    prompt_key: str = _f("prompt", "Record key of the prompt text, or of a chat-message list (verl's schema).")
    answer_key: str = _f("answer", "Record key of the reference answer (for verifiable rewards); dotted for a "
                                   "nested one, e.g. reward_model.ground_truth.")
    messages_key: str = _f("messages", "Record key of chat messages (rendered with the chat template).")
    shuffle: bool = _f(True, "Shuffle prompts each epoch (seeded, resumable).")
    val_path: Optional[str] = _f(None, "Evaluation prompts, graded every trainer.eval_every steps: a file "
                                       "(JSONL/Parquet, the same keys as train_path) or a built-in task; null = no "
                                       "evaluation.")


@dataclass
class RolloutLayoutConfig:
    """The inference model's own layout (CP is always 1; data-parallel replicas are the rest of the
    ranks).  Unset sizes are the training layout's; when all four equal it and the actor has one
    chunk per rank, the engine generates with the actor's own shards and nothing is copied, else a
    second model on this layout is refit from the training shards before every rollout
    (docs/rollout.md)."""

    tp: Optional[int] = _f(None, "Tensor-parallel size of generation; null = parallel.tp.", ge=1, le=C_INT_MAX)
    pp: Optional[int] = _f(None, "Pipeline stages of generation; null = parallel.pp.", ge=1, le=C_INT_MAX)
    ep: Optional[int] = _f(None, "Expert-parallel size of generation (MoE); null = parallel.ep.", ge=1, le=C_INT_MAX)
    etp: Optional[int] = _f(None, "Expert tensor-parallel size of generation (MoE); null = parallel.etp.",
                            ge=1, le=C_INT_MAX)


@dataclass
class RolloutConfig:
    # The only engine; both values name it, so configs that say either keep loading.
    engine: Literal["auto", "megatron"] = _f("auto", help="Generation engine, the only one: megatron-core's "
                                                          "inference (auto and megatron both name it) on the actor's "
                                                          "own TP/PP shards, or on a model of its own refit before "
                                                          "every rollout (rollout.layout; VPP); how it batches: "
                                                          "rollout.batching (docs/rollout.md).")
    n: int = _f(4, "Samples per prompt (the group for GRPO/RLOO).", ge=1, le=C_INT_MAX)
    max_new_tokens: int = _f(64, "Longest response.", ge=1, le=C_INT_MAX)
    temperature: float = _f(
        1.0, "Sampling temperature (also used to recompute log-probs); 0 = greedy, with log-probs at temperature 1.",
        ge=0, le=MAX_FLOAT,
    )
    top_p: float = _f(1.0, "Nucleus sampling; 1 = off.", gt=0, le=1)
    top_k: int = _f(0, "Top-k sampling; 0 = off.", ge=0, le=C_INT_MAX)
    stop: list = _f([], "Extra stop strings (EOS always stops).")
    max_batch_size: Optional[int] = _f(None, "Sequences generated together per rank (megatron engine: most requests in "
                                             "flight at once); null = the step's whole batch on this rank "
                                             "(prompts_per_step x n / dp), at most what 4 GiB of full-length KV cache "
                                             "holds.", ge=1, le=C_INT_MAX)
    kv_cache_memory: float = _f(0.4, "rollout.engine=megatron: KV-cache budget per rank: a fraction of the memory free "
                                     "when each rollout starts (<= 1), or bytes (> 1); freed while the actor "
                                     "trains.", gt=0, le=MAX_BYTES)
    prefill_chunk_tokens: int = _f(4096, "rollout.engine=megatron: most tokens one forward step takes (longer prompts "
                                         "are prefilled in chunks).", ge=1, le=C_INT_MAX)
    kv_block_tokens: int = _f(256, "rollout.engine=megatron: tokens per KV-cache page.", ge=1, le=C_INT_MAX)
    prefix_caching: bool = _f(True, "rollout.engine=megatron: requests whose prompts share whole KV pages share "
                                    "those pages, so the n samples of a prompt prefill it once (each other sample "
                                    "computes only the tokens after its last whole page); samples are the same on "
                                    "or off.  Off while MoE routing is recorded (algorithm.routing_replay).")
    batching: Literal[ROLLOUT_BATCHING] = _f(
        "auto", help="rollout.engine=megatron: dynamic (megatron's DynamicInferenceEngine: paged KV cache, continuous "
                     "batching) or static (its static-batching API: distinct prompts left-padded and prefilled once, "
                     "one KV cache per layer); auto: dynamic on CUDA with flash-attn and for MoE and partial rollouts, "
                     "static elsewhere (the CPU).")
    paged_attention: Literal[PAGED_ATTENTION] = _f(
        "auto", help="rollout.batching=dynamic: the kernels of the engine's paged attention -- flash_attn (flash-attn "
                     ">= 2.7.3 on CUDA), triton (the project's Triton kernel: CUDA, or Triton's interpreter on the "
                     "CPU, for checking) or sdpa (SDPA over each request's pages; no CUDA graphs); auto: flash_attn "
                     "where it imports on CUDA, else triton on CUDA, sdpa on the CPU.")
    cuda_graphs: Optional[bool] = _f(None, "rollout.batching=dynamic: decode steps replayed from CUDA graphs captured "
                                           "for batch sizes up to the rollout's requests (recaptured each rollout, "
                                           "after the KV cache is rebuilt); null = on with CUDA, off on the CPU.")
    layout: RolloutLayoutConfig = field(default_factory=RolloutLayoutConfig)
    ranks: int = _f(0, "Ranks of the job that only generate (the last ones), with rollout.layout as their layout; "
                       "the others train, and trainer.mode says how far generation runs ahead of the updates; "
                       "0 = every rank trains and generates, one after the other (docs/rollout.md, Generator ranks).",
                    ge=0, le=C_INT_MAX)
    env: str = _f("", "Multi-turn environment: a built-in name (tool_calling) or 'package.module:Class'; each "
                      "trajectory alternates policy turns and the environment's observations, trained "
                      "token-in-token-out with the loss on the policy's tokens only; '' = single-turn prompt -> "
                      "response (docs/environments.md).")
    env_kwargs: dict = _f({}, "Keyword arguments for the environment class (e.g. tools: [calculator]).")
    agent: str = _f("", "Multi-turn trajectories driven by an outside agent: 'package.module:function' called as "
                        "fn(base_url, session_id, record) per sample, talking to the rollout engine's "
                        "OpenAI-compatible endpoint at base_url; trained on the exact ids it was served; '' = off "
                        "(docs/environments.md).")
    agent_timeout_s: float = _f(120.0, "Seconds one agent call (one trajectory) may run in its worker process; past "
                                       "it the agent is killed and its session kept as served "
                                       "(env/agent_timeouts).", gt=0, le=MAX_TIMEOUT_S)
    max_turns: int = _f(4, "Most policy turns of a multi-turn trajectory (each up to rollout.max_new_tokens).",
                        ge=1, le=C_INT_MAX)
    max_trajectory_tokens: Optional[int] = _f(
        None, "Most tokens of a multi-turn trajectory: prompt + every turn and observation (the sequence length the "
              "planner and token budgets use); null = data.max_prompt_tokens + rollout.max_turns x "
              "rollout.max_new_tokens.", ge=2, le=C_INT_MAX)
    tool_timeout_s: float = _f(5.0, "Seconds one tool call may run (in a sandboxed worker process without network); "
                                    "past it the call is killed and answered with an error observation, counted in "
                                    "env/tool_timeouts.  Handed to environments whose constructor takes timeout_s.",
                               gt=0, le=MAX_TIMEOUT_S)
    @property
    def multi_turn(self) -> bool:
        """Trajectories of several turns: an environment or an outside agent drives them."""
        return bool(self.env or self.agent)

    on_limit: Literal[ON_LIMIT] = _f("grade", "A trajectory that hit rollout.max_turns or "
                                              "rollout.max_trajectory_tokens: graded as it stands (grade) or "
                                              "scored 0 (zero); counted either way.")


@dataclass
class RewardConfig:
    fn: str = _f("digit_sum", "Registered reward name, 'package.module:function' or 'path/to/file.py:function' "
                              "(a file alone: its compute_score).")
    kwargs: dict = _f({}, "Keyword arguments passed to the reward function.")
    convention: Literal[REWARD_CONVENTIONS] = _f(
        "auto", "How reward.fn is called: batch fn(prompts, responses, answers, **kwargs), verl "
        "compute_score(data_source, solution_str, ground_truth, extra_info) per sample, trl fn(completions, "
        "**kwargs) by keyword with the dataset columns, or auto (verl when it has solution_str and ground_truth "
        "parameters, trl when it has completions); docs/rewards.md.")
    timeout_s: float = _f(
        5.0, "Seconds per response: a built-in grader that spends longer on one sample scores it 0 (counted in "
        "reward/timeouts); a plain reward function gets this times its batch's responses, past which the run stops.",
        gt=0, le=MAX_TIMEOUT_S)


@dataclass
class EvalConfig:
    """How the evaluation set (data.val_path) is sampled and graded: by the rollout engine and the
    reward function of training, with sampling settings of its own (greedy by default, so the
    figures do not move with the sampling noise)."""

    temperature: float = _f(0.0, "Sampling temperature of the evaluation; 0 = greedy.", ge=0, le=MAX_FLOAT)
    top_p: float = _f(1.0, "Nucleus sampling of the evaluation; 1 = off.", gt=0, le=1)
    top_k: int = _f(0, "Top-k sampling of the evaluation; 0 = off.", ge=0, le=C_INT_MAX)
    n: int = _f(1, "Samples per evaluation prompt; > 1 also reports eval/pass@k (k = 2, 4, ... and n).",
                ge=1, le=C_INT_MAX)
    max_new_tokens: Optional[int] = _f(None, "Longest evaluation response; null = rollout.max_new_tokens.",
                                       ge=1, le=C_INT_MAX)
    max_prompts: Optional[int] = _f(None, "Evaluate the first this many prompts of data.val_path (file order); null = "
                                          "all.", ge=1, le=C_INT_MAX)
    correct_threshold: float = _f(0.5, "A sample counts as correct (eval/accuracy, eval/pass@k) when its reward is at "
                                       "least this: 0/1 rewards, format-shaped ones (0.1 well-formed, >= 0.9 correct) "
                                       "and -1/+1 ones alike.", ge=-MAX_FLOAT, le=MAX_FLOAT)


@dataclass
class RolloutCorrectionConfig:
    mode: str = _f("auto", "Correct for rollout-engine vs trainer log-prob mismatch: off, is (plain IS: with "
                           "old_logprobs=recompute the decoupled PPO objective), tis (truncated IS), mis (masked IS); "
                           "auto = decoupled PPO for stale batches: is for trainer.mode=one_step_off (and async "
                           "with max_staleness 1), tis for async with max_staleness > 1; off for sync.",
                   choices="megatron_rl.algorithms.rollout_correction:MODES")
    level: Literal[ROLLOUT_CORRECTION_LEVELS] = _f(
        "token", "Importance weight per token, or per sequence (product over its tokens).")
    threshold: float = _f(2.0, "Weights above this are truncated to it (tis) or masked to 0 (mis); is: only "
                                 "counted (rollout_correction/above_threshold_frac).", ge=1, le=MAX_FLOAT)


@dataclass
class DistillLayoutConfig:
    """The teachers' own layout on the training ranks (docs/distillation.md): a teacher larger than
    the student may want more tensor- or pipeline-parallel ranks than the student's layout has.
    Unset sizes are the training layout's; data-parallel replicas are the rest of the ranks."""

    tp: Optional[int] = _f(None, "Tensor-parallel size of the teachers; null = parallel.tp.", ge=1, le=C_INT_MAX)
    pp: Optional[int] = _f(None, "Pipeline stages of the teachers; null = parallel.pp.", ge=1, le=C_INT_MAX)
    cp: Optional[int] = _f(None, "Context-parallel size of the teachers; null = parallel.cp.", ge=1, le=C_INT_MAX)


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): a frozen teacher scores every token the
    student sampled, and the student's per-token advantage becomes
    ``coef * (teacher_logp - student_logp) + reward_coef * task advantage``."""

    teachers: dict = _f({}, "Teacher per data_source: {default: PATH} for every prompt, or {SOURCE: PATH, ...} "
                            "(a record's data_source picks its teacher; `default` takes the rest).  PATH: a Hugging "
                            "Face model directory or a megatron_rl checkpoint step directory, with the student's "
                            "vocabulary; {} = off.")
    coef: float = _f(1.0, "Weight of the per-token reverse-KL advantage teacher_logp - student_logp.", gt=0,
                     le=MAX_FLOAT)
    reward_coef: float = _f(0.0, "Weight of the task advantage (algorithm.advantage over the reward); 0 = pure "
                                 "distillation.", ge=0, le=MAX_FLOAT)
    layout: DistillLayoutConfig = field(default_factory=DistillLayoutConfig)
    baseline: Literal[DISTILL_BASELINES] = _f(
        "batch_mean", "Subtracted from teacher_logp - student_logp: batch_mean = its mean over the batch's response "
                      "tokens (a control variate: same expected gradient, less variance; learns faster, "
                      "docs/distillation.md), none = the plain per-token estimator.")


@dataclass
class AlgorithmConfig:
    advantage: str = _f("gae", "Advantage estimator (docs/algorithms.md): gae needs a critic; grpo, rloo, drgrpo, "
                        "reinforce_plus_plus_baseline need rollout.n >= 2.",
                        choices="megatron_rl.algorithms.advantages:ADVANTAGE_ESTIMATORS")
    policy_loss: str = _f("ppo", "Policy loss (docs/algorithms.md): ppo (clipped surrogate), gspo (sequence ratio), "
                          "cispo (clipped IS weight x log-prob).",
                          choices="megatron_rl.algorithms.losses:POLICY_LOSSES")
    gamma: float = _f(1.0, "Discount (GAE, REINFORCE++).", ge=0, le=1)
    lam: float = _f(0.95, "GAE lambda.", ge=0, le=1)
    whiten_advantages: bool = _f(True, "Whiten GAE advantages over the batch.")
    norm_by_std: bool = _f(True, "GRPO: divide by the group's std.")
    clip_low: float = _f(0.2, "Ratio clip below 1 (ppo, gspo, cispo).", ge=0, lt=1)
    clip_high: float = _f(0.2, "Ratio clip above 1 (asymmetric clipping / DAPO clip-higher when != clip_low).",
                          ge=0, le=MAX_FLOAT)
    dual_clip: Optional[float] = _f(None, "Dual-clip bound for negative advantages (e.g. 3; policy_loss=ppo); "
                                          "null = off.",
                                    gt=1, le=MAX_FLOAT)
    value_clip: Optional[float] = _f(0.2, "Critic value clipping around the old values; null = off.",
                                     gt=0, le=MAX_FLOAT)
    loss_agg: str = _f("token-mean", "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm "
                       "(token sums / rollout.max_new_tokens, Dr.GRPO).",
                       choices="megatron_rl.algorithms.losses:AGG_MODES")
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient.", ge=0, le=MAX_FLOAT)
    kl_coef: float = _f(0.0, "KL(actor || reference) coefficient; 0 = no reference model.", ge=0, le=MAX_FLOAT)
    kl_kind: str = _f("k3", "KL estimator: k1 (kl), k2 (mse), k3 (low_var_kl, bounded to 10), abs, k3+ (k3's value, "
                      "k2's gradient).", choices="megatron_rl.algorithms.kl:KL_NAMES")
    kl_in_reward: bool = _f(False, "Subtract the KL from the token rewards instead of adding it to the loss "
                            "(outcome estimators use the penalised sum).")
    kl_controller: Literal[KL_CONTROLLERS] = _f("fixed", "fixed or adaptive (in-reward KL only).")
    kl_target: Optional[float] = _f(None, "Adaptive controller target KL.", gt=0, le=MAX_FLOAT)
    kl_horizon: Optional[float] = _f(None, "Adaptive controller horizon.", gt=0, le=MAX_FLOAT)
    ppo_epochs: int = _f(1, "Passes over each rollout batch.", ge=1, le=C_INT_MAX)
    mini_batches: int = _f(1, "Optimizer steps per pass (the batch is cut into this many mini-batches).",
                           ge=1, le=C_INT_MAX)
    dynamic_sampling: bool = _f(False, "DAPO dynamic sampling: drop prompts whose samples all got the same reward and "
                                "sample more prompts until the batch is full.")
    dynamic_sampling_max_rounds: int = _f(4, "Dynamic sampling: most generation rounds per step (the first included); "
                                          "short of groups after them, the batch is filled with dropped ones.",
                                          ge=1, le=C_INT_MAX)
    overlong_buffer: int = _f(0, "DAPO overlong shaping: tokens before rollout.max_new_tokens over which the penalty "
                              "grows to overlong_penalty; 0 = off.", ge=0, le=C_INT_MAX)
    overlong_penalty: float = _f(1.0, "DAPO overlong shaping: the penalty at rollout.max_new_tokens.",
                                 ge=0, le=MAX_FLOAT)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    old_logprobs: Literal[OLD_LOGPROB_SOURCES] = _f(
        "auto", "Old log-probs of the PPO ratio: recompute (a forward before the update), training_forward (the "
        "update's own forward, detached: same loss and gradients, one forward fewer; needs ppo_epochs=1, "
        "mini_batches=1, no rollout correction, no KL in the reward, no distillation), rollout (the rollout "
        "engine's); auto = training_forward when allowed, else recompute."
    )
    routing_replay: bool = _f(
        False, "MoE: record each token's experts while rollout.engine=megatron generates (else in the old-log-prob "
        "pass) and route the old-log-prob and update forwards the same way (actor/routing_replay_mismatch: share of "
        "tokens whose recomputed top-k differs from the recorded one).")


@dataclass
class LoRAConfig:
    rank: int = _f(0, "LoRA rank r: train low-rank adapters (peft's r) on the frozen base instead of every weight; "
                      "0 = full fine-tuning.", ge=0, le=C_INT_MAX)
    alpha: float = _f(16.0, "LoRA alpha: adapter outputs are scaled by alpha / rank (peft's lora_alpha).", gt=0,
                      le=MAX_FLOAT)
    dropout: float = _f(0.0, "Dropout on each adapter's input (peft's lora_dropout).", ge=0, lt=1)
    target_modules: list = _f(["all-linear"], "Projections that get adapters, by their Hugging Face names: q_proj, "
                                              "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or all-linear "
                                              "(every one of them; not the output layer, as peft).")
    quantize_base: Literal[LORA_BASE_QUANTIZATIONS] = _f(
        "none", "How the frozen base's transformer-layer projections are held: none (the model's dtype) or int8 "
        "(8-bit weights with one fp32 scale per output row, dequantized to the model's dtype in each matmul: "
        "about half a bf16 base's memory, QLoRA-style; the embedding and output layer stay in the model's dtype).")


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    init_checkpoint: Optional[str] = _f(None, "megatron_rl checkpoint (step dir) to start from instead of "
                                              "model.hf_path.")
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class CriticConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    hf_path: Optional[str] = _f(None, "Reward-model / value checkpoint for the critic; null = start from the "
                                      "actor's weights.")
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class TrainerConfig:
    steps: int = _f(20, "PPO steps (rollout + update).", ge=1, le=MAX_STEPS)
    prompts_per_step: int = _f(16, "Prompts per step (each sampled rollout.n times).", ge=1, le=C_INT_MAX)
    sft_warmup_steps: int = _f(0, "Supervised steps on prompt+answer before RL (teaches a tiny model the format).",
                               ge=0, le=MAX_STEPS)
    sft_lr: float = _f(1e-3, "Learning rate of the supervised warm-up.", ge=0, le=MAX_FLOAT)
    sft_answers: Literal[SFT_TARGETS] = _f(
        "true", "Warm-up targets: true (the answers), shuffled (other prompts' answers: format only)."
    )
    mode: Literal[TRAINER_MODES] = _f(
        "sync", "sync: each step trains on what it generated; one_step_off: each step trains on the batch "
        "generated one update earlier (with the weights before the previous update) and generates the next one; "
        "async (rollout.ranks > 0): the generator ranks keep up to trainer.max_staleness batches ahead of the "
        "updates (docs/algorithms.md, One step off; Generator ranks and asynchronous training).")
    max_staleness: int = _f(2, "trainer.mode=async: most policy versions between the weights a batch was generated "
                               "with and the weights it trains from; the generators wait rather than exceed it.",
                            ge=0, le=MAX_STEPS)
    push_weights_every: int = _f(1, "trainer.mode=async: send the actor's weights to the generator ranks after "
                                    "every N updates.", ge=1, le=MAX_STEPS)
    partial_rollouts: bool = _f(False, "trainer.mode=async: a weight push reaches the requests in flight: their "
                                       "samples go on with the new weights (KV cache recomputed), each token "
                                       "recording the version that drew it; off = each request is generated whole "
                                       "with the weights it started with.")
    save_every: int = _f(0, "Checkpoint every N steps (0 = only at the end and on SIGTERM/SIGUSR1).",
                         ge=0, le=MAX_STEPS)
    keep_last: int = _f(2, "Checkpoints kept.", ge=1, le=MAX_STEPS)
    resume: str = _f("auto", "auto (latest checkpoint in the run dir), never, or a checkpoint path.")
    log_every: int = _f(1, "Console progress every N steps.", ge=1, le=MAX_STEPS)
    eval_every: int = _f(0, "Evaluate on data.val_path before the first step, every N steps and after the last one "
                            "(eval/* metrics); 0 = off.", ge=0, le=MAX_STEPS)
    plot: bool = _f(True, "Write plot.png (reward, KL, losses) at the end; needs matplotlib.")
    offload: bool = _f(False, "Keep models not used by the running phase (weights, grads, optimizer) in host memory.")
    tensorboard: bool = _f(False, "Also log to TensorBoard (<run_dir>/tb).")
    log_samples: bool = _f(False, "Write every trained sample (id, step, policy version, prompt, response, reward, "
                                  "advantage) to <run_dir>/samples/step_<k>.jsonl.")
    wandb: bool = _f(False, "Also log to Weights & Biases.")


@dataclass
class SmokeConfig:
    """The smoke job trains with actor.optim."""

    steps: int = _f(8, "Optimizer steps of the smoke job.", ge=1, le=MAX_STEPS)
    seq_length: int = _f(64, "Tokens per sequence.", ge=2, le=C_INT_MAX)
    micro_batch_size: int = _f(2, "Sequences per micro-batch.", ge=1, le=C_INT_MAX)
    num_microbatches: int = _f(4, "Micro-batches per step (per data-parallel rank).", ge=1, le=C_INT_MAX)


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    smoke: SmokeConfig = field(default_factory=SmokeConfig)


def iter_fields(cls=Config, prefix: str = ""):
    """Yield ``(dotted_key, field, default)`` for every leaf of the schema."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            yield from iter_fields(type(default), key + ".")
        else:
            yield key, f, default


def leaf_types(cls=Config, prefix: str = "") -> dict[str, Any]:
    """``{dotted_key: resolved type}`` for every leaf (``Literal[...]`` with its values, not a string)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            out.update(leaf_types(type(default), f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = hints[f.name]
    return out


def literal_choices(tp) -> Optional[tuple]:
    """The allowed values of a ``Literal`` (or ``Optional[Literal]``) type, else None."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:
        for arg in typing.get_args(tp):
            if typing.get_origin(arg) is Literal:
                return typing.get_args(arg)
    return None
