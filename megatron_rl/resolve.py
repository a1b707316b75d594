"""Every ``auto`` and every value derived from other settings, resolved in one place.

:func:`resolve` takes the config as the user wrote it, the world size and what this machine can
do, and returns the resolved config (a copy; the user's is never edited) with each resolved
value's origin.  Validation checks the resolved config, before any process starts; the trainer
reads resolved values only and prints them with their origin at start-up; ``config.yaml`` in
the run directory holds what was asked, with what it resolved to as comments.

Resolving a resolved config changes nothing, so a rank that loads the saved config and resolves
it again gets the same values on the same machine.  Order matters: the device comes first
(the backend, the dtype and the rollout engine depend on it).  Values that are not config keys
(``batch.token_budget``) are resolved the same way and read from the :class:`Resolution`.
Commands that know more than the config says (``score``: the longest input sequence;
``generate``: the prompts it was given) pass it as a :class:`Job`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from megatron_rl.config.choices import AUTO
from megatron_rl.config.schema import Config

SET, AUTO_ORIGIN, DERIVED = "set", "auto", "derived"
# A derived rollout.max_batch_size generates at most this much full-length KV cache at once per rank.
ROLLOUT_KV_BUDGET_BYTES = 4 * 2**30


@dataclasses.dataclass(frozen=True)
class Resolved:
    key: str
    value: Any
    origin: str  # "set" (the user's value), "auto" or "derived"
    why: str = ""

    def line(self) -> str:
        why = f": {self.why}" if self.why else ""
        value = self.value
        if dataclasses.is_dataclass(value):  # a config section: its keys, as the YAML would say them
            value = "{" + ", ".join(f"{k}: {'null' if v is None else v}"
                                    for k, v in dataclasses.asdict(value).items()) + "}"
        return f"{self.key}={value} ({self.origin}{why})"


@dataclasses.dataclass(frozen=True)
class PromptsRead:
    """The longest of the prompts a command read (``generate``'s input): what its positions hold."""

    key: str       # where they came from, as the error names it (``--input``)
    path: str
    line: int      # the longest prompt's line
    tokens: int    # its length


@dataclasses.dataclass(frozen=True)
class Job:
    """What a command knows that the config does not say (None: read the config)."""

    max_seq_len: Optional[int] = None   # the longest prompt + response (default: data + rollout lengths)
    prompts: Optional[int] = None       # prompts per generation step (default: trainer.prompts_per_step)
    prompts_read: Optional[PromptsRead] = None  # the prompts themselves, in place of data.max_prompt_tokens


@dataclasses.dataclass(frozen=True)
class Resolution:
    config: Config
    values: tuple[Resolved, ...]

    def get(self, key: str) -> Resolved:
        return next(v for v in self.values if v.key == key)

    def lines(self) -> list[str]:
        """One line per value that was not set by the user."""
        return [v.line() for v in self.values if v.origin != SET]


def _replace(cfg: Config, key: str, value) -> Config:
    if key in NOT_IN_CONFIG:
        return cfg
    return _replace_path(cfg, key.split("."), value)


def _replace_path(node, path: list[str], value):
    """``node`` (a dataclass) with the field at ``path`` (``["algorithm", "rollout_correction", "mode"]``)
    set to ``value``."""
    head, *rest = path
    return dataclasses.replace(node, **{head: _replace_path(getattr(node, head), rest, value) if rest else value})


# ----------------------------------------------------------------------------- the resolvers
# Each takes (config so far, world size, job) and returns (value, origin, why); the value is written
# into the config before the next resolver runs.

def _device(cfg: Config, world: Optional[int], job: Job):
    from megatron_rl.compat import cuda_available

    if cfg.distributed.device != AUTO:
        return cfg.distributed.device, SET, ""
    return ("cuda", AUTO_ORIGIN, "CUDA is available") if cuda_available() else ("cpu", AUTO_ORIGIN, "no CUDA")


def _backend(cfg: Config, world: Optional[int], job: Job):
    if cfg.distributed.backend != AUTO:
        return cfg.distributed.backend, SET, ""
    return ("nccl", AUTO_ORIGIN, "CUDA") if cfg.distributed.device == "cuda" else ("gloo", AUTO_ORIGIN, "CPU")


def _params_dtype(cfg: Config, world: Optional[int], job: Job):
    if cfg.model.params_dtype != AUTO:
        return cfg.model.params_dtype, SET, ""
    if cfg.distributed.device == "cuda":
        return "bfloat16", AUTO_ORIGIN, "CUDA"
    return "float32", AUTO_ORIGIN, "CPU"


def _transformer_impl(cfg: Config, world: Optional[int], job: Job):
    from megatron_rl.capabilities import resolve_transformer_impl

    impl = resolve_transformer_impl(cfg.model.transformer_impl)
    if cfg.model.transformer_impl != AUTO:
        return impl, SET, ""
    why = "TransformerEngine and CUDA present" if impl == "transformer_engine" else "no TransformerEngine with CUDA"
    return impl, AUTO_ORIGIN, why


def _rollout_engine(cfg: Config, world: Optional[int], job: Job):
    """``auto`` names megatron-core's inference, the only engine."""
    if cfg.rollout.engine != AUTO:
        return cfg.rollout.engine, SET, ""
    return "megatron", AUTO_ORIGIN, "megatron-core's inference generates on every layout"


def _rollout_batching(cfg: Config, world: Optional[int], job: Job):
    from megatron_rl.rollout.choice import batching_facts, batching_reason, pick_batching

    if cfg.rollout.batching != AUTO:
        return cfg.rollout.batching, SET, ""
    facts = batching_facts(cfg, cfg.distributed.device == "cuda")
    batching = pick_batching(AUTO, **facts)
    return batching, AUTO_ORIGIN, batching_reason(batching, **facts)


def _rollout_paged_attention(cfg: Config, world: Optional[int], job: Job):
    from megatron_rl.compat.paged_attention import paged_attention_reason, pick_paged_attention

    if cfg.rollout.paged_attention != AUTO:
        return cfg.rollout.paged_attention, SET, ""
    cuda = cfg.distributed.device == "cuda"
    picked = pick_paged_attention(AUTO, cuda)
    return picked, AUTO_ORIGIN, paged_attention_reason(picked, cuda)


def _rollout_cuda_graphs(cfg: Config, world: Optional[int], job: Job):
    """Read after rollout.batching and rollout.paged_attention are resolved."""
    from megatron_rl.layout.arch import is_moe
    from megatron_rl.rollout.choice import pick_cuda_graphs

    on, why = pick_cuda_graphs(cfg.rollout.cuda_graphs, cuda=cfg.distributed.device == "cuda",
                               batching=cfg.rollout.batching, kernels=cfg.rollout.paged_attention,
                               moe=is_moe(cfg.model))
    return on, (SET if cfg.rollout.cuda_graphs is not None else AUTO_ORIGIN), why


def _rollout_layout(cfg: Config, world: Optional[int], job: Job):
    """The inference model's layout.  Unset on CUDA with megatron's engine, a known world size and
    GPU memory: the planner's choice (:func:`megatron_rl.planner.recipe.planned_rollout_layout`);
    elsewhere (the CPU) each unset size is the training layout's, so nothing is copied."""
    from megatron_rl.compat.devices import cuda_memory_bytes
    from megatron_rl.config.schema import RolloutLayoutConfig
    from megatron_rl.layout.lora import int8_base
    from megatron_rl.layout.sizes import ParallelLayout, shares_training_weights

    asked, train = cfg.rollout.layout, cfg.parallel
    unset = all(v is None for v in dataclasses.asdict(asked).values())
    memory = cuda_memory_bytes() if cfg.distributed.device == "cuda" else None
    if unset and world and memory and not int8_base(cfg.actor.lora):  # an int8 base generates in place
        from megatron_rl.layout.arch import resolve_dtype
        from megatron_rl.planner.recipe import planned_rollout_layout

        dtype_bytes = resolve_dtype(cfg.model.params_dtype, cfg.distributed.device).itemsize
        from megatron_rl.engine.teachers import read_teachers

        teachers = tuple(t.model for t in read_teachers(cfg.algorithm.distill.teachers, cfg.model))
        mem, why = planned_rollout_layout(cfg, world, memory, dtype_bytes, teachers)
        chosen = mem.layout
        return (RolloutLayoutConfig(tp=chosen.tp, pp=chosen.pp, ep=chosen.ep, etp=chosen.etp), DERIVED,
                f"{memory / 2**30:.0f} GiB GPUs: {why}")
    filled = ParallelLayout.for_rollout(asked, train)
    layout = RolloutLayoutConfig(tp=filled.tp, pp=filled.pp, ep=filled.ep, etp=filled.etp)
    shares = shares_training_weights(filled, train)
    why = ("generates with the actor's own shards, nothing copied" if shares
           else "a model of its own, refit from the training shards before every rollout")
    if None not in (asked.tp, asked.pp, asked.ep):
        return layout, SET, why
    return layout, DERIVED, "the training layout's sizes; " + why


def _rollout_correction(cfg: Config, world: Optional[int], job: Job):
    """``one_step_off`` and ``async`` train on batches generated by older weights (one version, up
    to ``trainer.max_staleness``): there the default is decoupled PPO, the ratio clipped against
    the recomputed proximal policy and weighted by proximal / behaviour -- plain (``is``) for
    batches at most one version old, truncated at ``threshold`` (``tis``, as AReaL caps it) where
    they may be older, whose weights spread further: on the async benchmark (docs/algorithms.md,
    6 seeds) truncation raised async's reward per trained sample from 0.438 to 0.494, sync's being
    0.490, and left one_step_off's where it was.  ``sync`` samples from the weights it trains."""
    from megatron_rl.config.choices import ASYNC, ONE_STEP_OFF

    mode = cfg.algorithm.rollout_correction.mode
    if mode != AUTO:
        return mode, SET, ""
    if cfg.trainer.mode in (ASYNC, ONE_STEP_OFF) and cfg.algorithm.old_logprobs != "rollout":
        bound = cfg.trainer.max_staleness if cfg.trainer.mode == ASYNC else 1
        if bound > 1:
            return "tis", AUTO_ORIGIN, (
                f"trainer.mode={cfg.trainer.mode} with batches up to {bound} versions old: decoupled PPO, the ratio "
                "clipped against the recomputed proximal policy, weighted by proximal / behaviour truncated at "
                f"algorithm.rollout_correction.threshold={cfg.algorithm.rollout_correction.threshold:g}")
        return "is", AUTO_ORIGIN, (f"trainer.mode={cfg.trainer.mode}: decoupled PPO, the ratio clipped against the "
                                   "recomputed proximal policy, weighted by proximal / behaviour")
    return "off", AUTO_ORIGIN, f"trainer.mode={cfg.trainer.mode}"


def _old_logprobs(cfg: Config, world: Optional[int], job: Job):
    from megatron_rl.algorithms.old_logprobs import resolve_old_logprob_source, training_forward_blockers

    if cfg.algorithm.old_logprobs != AUTO:
        return cfg.algorithm.old_logprobs, SET, ""
    blockers = training_forward_blockers(cfg.algorithm)
    why = "needed before the update: " + "; ".join(blockers) if blockers else "exactly on-policy"
    return resolve_old_logprob_source(cfg.algorithm), AUTO_ORIGIN, why


def trajectory_token_limit(cfg: Config) -> int:
    """A multi-turn trajectory's most tokens: ``rollout.max_trajectory_tokens``, or room for the
    longest prompt and ``rollout.max_turns`` full turns."""
    r = cfg.rollout
    return r.max_trajectory_tokens or cfg.data.max_prompt_tokens + r.max_turns * r.max_new_tokens


def max_sequence_length(cfg: Config, job: Job = Job()) -> int:
    """The longest prompt + response a run can make (a whole trajectory with an environment)."""
    if job.max_seq_len is not None:
        return job.max_seq_len
    if cfg.rollout.multi_turn:
        return trajectory_token_limit(cfg)
    return cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens


def _max_trajectory_tokens(cfg: Config, world: Optional[int], job: Job):
    if not cfg.rollout.multi_turn or cfg.rollout.max_trajectory_tokens is not None:
        return cfg.rollout.max_trajectory_tokens, SET, ""
    return trajectory_token_limit(cfg), DERIVED, "data.max_prompt_tokens + rollout.max_turns x rollout.max_new_tokens"


def _rollout_batch(cfg: Config, world: Optional[int], job: Job):
    """Every sample a rank generates in a step in one pass, at most what
    :data:`ROLLOUT_KV_BUDGET_BYTES` of full-length KV cache holds on a rank (at least 1): a rank of
    rollout.layout holds its stage's layers and its TP share of the KV heads."""
    from megatron_rl.layout.arch import resolve_dtype
    from megatron_rl.layout.kv import kv_bytes
    from megatron_rl.layout.sizes import ParallelLayout

    if cfg.rollout.max_batch_size is not None:
        return cfg.rollout.max_batch_size, SET, ""
    if world is None:
        return None, DERIVED, "at launch, from the world size"
    dp = ParallelLayout.from_config(cfg.parallel, world).dp
    own = cfg.rollout.layout
    if (own.tp, own.pp) != (cfg.parallel.tp, cfg.parallel.pp):  # replicas of rollout.layout generate
        dp = max(1, world // (own.tp * own.pp))
    prompts = job.prompts if job.prompts is not None else cfg.trainer.prompts_per_step
    per_rank = -(-prompts // dp) * cfg.rollout.n
    dtype_bytes = resolve_dtype(cfg.model.params_dtype, cfg.distributed.device).itemsize
    per_seq = kv_bytes(cfg.model, max_sequence_length(cfg, job), dtype_bytes, own.tp, own.pp)
    batch = max(1, min(per_rank, int(ROLLOUT_KV_BUDGET_BYTES // per_seq)))
    return batch, DERIVED, (f"every sample of the rank's share of a step, within {ROLLOUT_KV_BUDGET_BYTES >> 30} GiB "
                            "of KV cache")


def _token_budget(cfg: Config, world: Optional[int], job: Job):
    """Tokens per micro-batch per rank when the config sets neither a budget nor a micro-batch size."""
    from megatron_rl.layout.arch import resolve_dtype
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.planner.memory import derived_token_budget

    if cfg.batch.max_tokens_per_rank or cfg.batch.micro_batch_size:
        return None, SET, "batch.max_tokens_per_rank / batch.micro_batch_size"
    if world is None:
        return None, DERIVED, "at launch, from the world size"
    layout = ParallelLayout.from_config(cfg.parallel, world)
    dtype_bytes = resolve_dtype(cfg.model.params_dtype, cfg.distributed.device).itemsize
    budget = derived_token_budget(cfg.batch, cfg.model, layout, max_sequence_length(cfg, job), dtype_bytes)
    return budget, DERIVED, "the longest sequence and the model's activation memory per token on this layout"


# Resolved values that are not config keys: read from the Resolution.
NOT_IN_CONFIG = frozenset({"batch.token_budget"})

def _reward_convention(cfg: Config, world: Optional[int], job: Job):
    """How reward.fn is called: told apart by its parameter names (verl's ``solution_str`` and
    ``ground_truth``).  A reward.fn that does not resolve stays ``auto`` here; the check of what the
    config points at reports it before launch."""
    from megatron_rl.errors import UserInputError
    from megatron_rl.rewards.registry import detected_convention

    if cfg.reward.convention != AUTO:
        return cfg.reward.convention, SET, ""
    try:
        return detected_convention(cfg.reward.fn), AUTO_ORIGIN, "from reward.fn's parameter names"
    except UserInputError:
        return AUTO, AUTO_ORIGIN, "reward.fn does not resolve (reported before launch)"


def _eval_max_new_tokens(cfg: Config, world: Optional[int], job: Job):
    if cfg.eval.max_new_tokens is not None:
        return cfg.eval.max_new_tokens, SET, ""
    return cfg.rollout.max_new_tokens, DERIVED, "rollout.max_new_tokens"


RESOLVERS: tuple[tuple[str, Callable], ...] = (
    ("distributed.device", _device),
    ("distributed.backend", _backend),
    ("model.params_dtype", _params_dtype),
    ("model.transformer_impl", _transformer_impl),
    ("rollout.engine", _rollout_engine),
    ("rollout.batching", _rollout_batching),
    ("rollout.paged_attention", _rollout_paged_attention),
    ("rollout.cuda_graphs", _rollout_cuda_graphs),
    ("rollout.layout", _rollout_layout),
    ("algorithm.rollout_correction.mode", _rollout_correction),
    ("algorithm.old_logprobs", _old_logprobs),
    ("rollout.max_trajectory_tokens", _max_trajectory_tokens),
    ("rollout.max_batch_size", _rollout_batch),
    ("batch.token_budget", _token_budget),
    ("eval.max_new_tokens", _eval_max_new_tokens),
    ("reward.convention", _reward_convention),
)


def resolve(cfg: Config, world_size: Optional[int] = None, job: Job = Job()) -> Resolution:
    """``cfg`` with every ``auto`` and derived value resolved for ``world_size`` ranks on this
    machine, for ``job`` (what the command knows beyond the config)."""
    values = []
    for key, resolver in RESOLVERS:
        value, origin, why = resolver(cfg, world_size, job)
        cfg = _replace(cfg, key, value)
        values.append(Resolved(key, value, origin, why))
    return Resolution(cfg, tuple(values))
