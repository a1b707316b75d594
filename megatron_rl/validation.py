"""Config validation before any process group: field rules, then what this machine resolves
``auto`` to, then every constraint of every feature in the registry.  It sits above ``config/``
(which imports nothing of the package but its errors) and the feature registry.

Raises :class:`ConfigError` (one line: key, value, problem, fix, feature-matrix row).  What the
config points at (prompt file, reward function, tokenizer) is checked by
:mod:`megatron_rl.tools.preflight`.
"""

from __future__ import annotations

from typing import Optional

from megatron_rl.config.rules import check_field_rules
from megatron_rl.config.schema import Config
from megatron_rl.distributed.placement import training_world
from megatron_rl.errors import ConfigError
from megatron_rl.features import FEATURES, PLANNED, UNSUPPORTED
from megatron_rl.resolve import Job, Resolution, resolve


def validate(cfg: Config, world_size: Optional[int] = None, generates: bool = True,
             job: Optional[Job] = None) -> Resolution:
    """Raises on the first problem; returns the resolution the checks ran on.  ``generates=False``
    (``score``, ``convert``) leaves out the limits of generating; ``job``: what the command knows
    beyond the config (``generate``: the prompts it read), which the rules that read it check."""
    check_field_rules(cfg)
    job = job or Job()
    world_size = _training_world(cfg, world_size)
    # Every rule reads the values the run will use: ``auto`` and derived values resolved for this
    # machine and world size (TransformerEngine, the device, the rollout engine, ...).
    resolution = resolve(cfg, world_size, job)
    cfg = resolution.config
    for feat in FEATURES:
        if feat.status in (PLANNED, UNSUPPORTED) and feat.in_use is not None and feat.in_use(cfg):
            raise ConfigError(feat.config or feat.name, None, f"'{feat.name}' is {feat.status}",
                              "turn it off; see docs/feature_matrix.md", row=feat.name)
        for constraint in feat.constraints:
            if constraint.generation and not generates:
                continue
            problem = (constraint.check(cfg, world_size, job) if constraint.reads_job
                       else constraint.check(cfg, world_size))
            if problem is not None:
                key, value, text, fix = problem
                raise ConfigError(key, value, text, fix, row=feat.name)
    return resolution


def _training_world(cfg: Config, world_size: Optional[int]) -> Optional[int]:
    """The ranks that train: all but ``rollout.ranks`` (every rule about the training layout reads
    this; the generator ranks' own rules read ``rollout.ranks``)."""
    generators = cfg.rollout.ranks
    if generators and world_size is not None and generators >= world_size:
        raise ConfigError("rollout.ranks", generators, f"leaves no training rank in a world of {world_size}",
                          f"use fewer generator ranks than the {world_size} the job has, or start more ranks")
    return training_world(world_size, generators)
