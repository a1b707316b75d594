"""The building blocks of the feature registry: statuses, :class:`Feature`, constraints and the
helpers the area modules share."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from packaging.version import Version

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from megatron_rl.algorithms.old_logprobs import resolve_old_logprob_source
from megatron_rl.capabilities import resolve_transformer_impl, te_version
from megatron_rl.config.rules import config_value
from megatron_rl.layout.arch import attention_dims
from megatron_rl.layout.rules import a2a_heads_ok

TESTED_CPU = "tested on CPU"
TESTED_GPU = "tested on GPU"
GPU_UNTESTED = "GPU-only, not yet tested"
PLANNED = "planned"
UNSUPPORTED = "unsupported"
STATUSES = (TESTED_CPU, TESTED_GPU, GPU_UNTESTED, PLANNED, UNSUPPORTED)

# check(cfg, world_size) -> None when fine, else (key, value, problem, fix)
Check = Callable[[object, Optional[int]], Optional[tuple]]


@dataclasses.dataclass(frozen=True)
class Constraint:
    text: str  # shown in the matrix
    check: Check
    key: str = ""  # the config key its error names
    generation: bool = False  # a limit of generating: checked for train and generate, not score / convert
    reads_job: bool = False  # check(cfg, world, job): reads what the command knows (resolve.Job), too


@dataclasses.dataclass(frozen=True)
class Measured:
    """A figure quoted in the matrix, with the command that prints it (so it can be re-measured)."""

    figure: str
    command: str


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    area: str
    status: str
    summary: str  # what it does; figures go in ``measured``
    evidence: tuple[str, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    config: str = ""  # the keys that turn it on
    in_use: Optional[Callable[[object], bool]] = None  # planned/unsupported features refuse configs using them
    measured: tuple[Measured, ...] = ()


def need(key: str, ok: Callable, problem: str, fix: str, text: str, when: Callable = lambda c: True,
         generation: bool = False, ranks: Optional[Callable] = None) -> Constraint:
    """``ranks(cfg, world)``: the ranks the rule is about when not the training world (``ok``,
    ``problem`` and ``fix`` see them as ``w``)."""
    def check(cfg, world):
        if not when(cfg):
            return None
        if ranks is not None:
            world = ranks(cfg, world)
        if ok(cfg, world):
            return None
        return key, config_value(cfg, key), problem.format(c=cfg, w=world), fix.format(c=cfg, w=world)

    return Constraint(f"{text} (when generating)" if generation else text, check, key, generation)


def training_rule(rule) -> Constraint:
    """A training-layout rule of :mod:`megatron_rl.layout.rules` as a check of ``parallel`` before launch."""
    return need(rule.key, lambda c, w: rule.holds(c.model, c.parallel, c.parallel, w), rule.problem, rule.fix,
                rule.text, when=lambda c: rule.applies(c.model, c.parallel))


def model_parallel_size(cfg) -> int:
    p = cfg.parallel
    return p.tp * p.pp * p.cp


def _vpp_pass_sequences(cfg, world) -> int:
    """Fewest sequences a data-parallel rank gets in one training pass: an RL mini-batch, or a
    supervised warm-up batch (one sequence per prompt).  Unknown world size: no limit."""
    if world is None:
        return 1 << 30
    dp = max(1, world // model_parallel_size(cfg))
    per_step = cfg.trainer.prompts_per_step * cfg.rollout.n
    passes = [per_step // (dp * cfg.algorithm.mini_batches)]
    if cfg.trainer.sft_warmup_steps:
        passes.append(cfg.trainer.prompts_per_step // dp)
    return min(passes)


def _heads_kv(cfg) -> int:
    return attention_dims(cfg.model)[1]


def _te_at_least(version: str) -> bool:
    found = te_version()
    return found is not None and Version(Version(found).base_version) >= Version(version)


def _product(sizes) -> int:
    out = 1
    for size in sizes or ():
        out *= int(size)
    return out if sizes else 0


def _a2a_size(cfg) -> int:
    """The group a2a splits heads over: the first hierarchical size with a2a+p2p, else all of CP."""
    p = cfg.parallel
    hierarchical = getattr(p, "hierarchical_context_parallel_sizes", None)
    if p.cp_comm_type == "a2a+p2p" and hierarchical:
        return int(hierarchical[0])
    return p.cp


def _a2a_heads_fit(cfg) -> bool:
    """The local a2a path's head rule (it replicates K/V heads when the a2a size is a multiple)."""
    return a2a_heads_ok(cfg.model, cfg.parallel.tp, _a2a_size(cfg))


def _uses_te(cfg) -> bool:
    """Rules that depend on TransformerEngine read what ``auto`` resolves to on this machine."""
    return resolve_transformer_impl(cfg.model.transformer_impl) == "transformer_engine"


def _needs_groups() -> Constraint:
    """rollout.n >= 2 for every estimator the registry declares ``needs_groups`` (plugins included)."""
    names = ", ".join(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.needs_groups)
    return need("rollout.n", lambda c, w: c.rollout.n >= 2,
                "algorithm.advantage={c.algorithm.advantage} takes its baseline from the other samples of a prompt",
                "set rollout.n >= 2", f"rollout.n >= 2 for group estimators ({names})",
                when=lambda c: ADVANTAGE_ESTIMATORS[c.algorithm.advantage].needs_groups)


def _old_logprob_source(cfg) -> str:
    return resolve_old_logprob_source(cfg.algorithm)


def _registry_names(registry) -> str:
    return ", ".join(f"`{name}`" for name in registry)
