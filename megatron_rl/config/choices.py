"""The closed choices of the configuration: every value a key with a fixed set of options accepts.

This module is the bottom of the package: it imports nothing of megatron_rl, the schema declares
its ``Literal`` types from it, and the modules that implement the choices import their names
from here (each checks at import that what it implements is exactly this set).  Choices that
plugins extend (advantage estimators, policy losses, loss aggregations, KL estimators, reward
functions, rollout-correction modes) are open registries instead: the schema names them by
string (``choices="module:NAME"``) and validation reads the registry.
"""

from __future__ import annotations

AUTO = "auto"

# --- machine and runtime
TRANSFORMER_IMPLS = ("local", "transformer_engine")  # megatron-core layer specs
TRANSFORMER_IMPL_CHOICES = (AUTO,) + TRANSFORMER_IMPLS
DEVICES = (AUTO, "cuda", "cpu")
BACKENDS = (AUTO, "nccl", "gloo")

# --- model
ACTIVATION_NAMES = ("swiglu", "gelu")
NORMALIZATIONS = ("RMSNorm", "LayerNorm")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
PARAMS_DTYPES = (AUTO,) + DTYPE_NAMES
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe_act")
ROPE_SCALING_TYPES = ("none", "llama3", "yarn")  # HF rope_scaling types megatron-core reproduces
LORA_BASE_QUANTIZATIONS = ("none", "int8")  # how a LoRA model stores its frozen base

# --- mixture of experts (megatron-core's router and dispatchers)
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "none")
MOE_DISPATCHERS = ("alltoall", "allgather")
MOE_DROP_POLICIES = ("probs", "position")
MOE_ROUTER_DTYPES = ("float32", "float64", "model")

# --- long context
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")

# --- optimisation
LR_SCHEDULE_NAMES = ("constant", "linear", "cosine")
KL_CONTROLLERS = ("fixed", "adaptive")
OLD_LOGPROB_SOURCES = (AUTO, "recompute", "training_forward", "rollout")
SFT_TARGETS = ("true", "shuffled")
# algorithm.distill.baseline: what is subtracted from teacher_logp - student_logp (algorithms/distill.py)
DISTILL_BASELINES = ("batch_mean", "none")
# sync: generate, then train on it; one_step_off: train on the batch generated one update earlier;
# async: generator ranks of their own keep up to trainer.max_staleness batches ahead.
SYNC, ONE_STEP_OFF, ASYNC = "sync", "one_step_off", "async"
TRAINER_MODES = (SYNC, ONE_STEP_OFF, ASYNC)

# --- rollout
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
# rollout.batching: how megatron's engine batches -- its dynamic engine (paged KV cache, continuous
# batching) or its static-batching API (one KV cache per layer, prompts left-padded).
ROLLOUT_BATCHING = (AUTO, "dynamic", "static")
# rollout.paged_attention: the kernels behind the dynamic engine's paged attention
# (megatron_rl/compat/paged_attention.py:KERNELS).
PAGED_ATTENTION = (AUTO, "flash_attn", "triton", "sdpa")

# rollout.on_limit: what a multi-turn trajectory that hit rollout.max_turns or
# rollout.max_trajectory_tokens scores: graded as it stands, or 0.
ON_LIMIT_GRADE, ON_LIMIT_ZERO = "grade", "zero"
ON_LIMIT = (ON_LIMIT_GRADE, ON_LIMIT_ZERO)

# --- rewards
REWARD_CONVENTIONS = (AUTO, "batch", "verl", "trl")  # how reward.fn is called (megatron_rl/rewards/conventions.py)


def require_same(implemented, declared: tuple, what: str) -> None:
    """For the implementing module: refuse to import when what it implements (names of a dict, a
    tuple) is not exactly the declared choice set, so the schema cannot offer a value nothing
    implements."""
    if tuple(implemented) != tuple(declared):
        raise ImportError(f"{what}: implemented {tuple(implemented)} != declared in config/choices.py {declared}")
