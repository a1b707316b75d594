"""A config as the planner sees it: the lengths and models it plans for, and the keys where the
config differs from what the plan decides (``megatron-rl plan --config``)."""

from __future__ import annotations

import dataclasses

from megatron_rl.algorithms.advantages import needs_critic
from megatron_rl.config.rules import config_value
from megatron_rl.config.schema import Config


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    prompt_len: int
    response_len: int
    with_critic: bool
    with_reference: bool


def plan_inputs(cfg: Config) -> PlanInputs:
    """The longest prompt and response, and which models the trainer builds: a critic for
    estimators that need one, a reference whenever there is a KL term (as the trainer does)."""
    return PlanInputs(prompt_len=cfg.data.max_prompt_tokens, response_len=cfg.rollout.max_new_tokens,
                      with_critic=needs_critic(cfg.algorithm.advantage), with_reference=cfg.algorithm.kl_coef > 0)


def _normalised(cfg: Config, key: str, value):
    if key == "parallel.etp" and value == cfg.parallel.tp:  # ETP equal to TP is the default, null
        return None
    if isinstance(value, tuple):
        return list(value)
    return value


def differences(cfg: Config, settings: dict) -> list[tuple[str, object, object]]:
    """``(key, config value, planned value)`` for every planned key the config sets otherwise."""
    out = []
    for key, planned in settings.items():
        have = _normalised(cfg, key, config_value(cfg, key))
        if have != _normalised(cfg, key, planned):
            out.append((key, have, planned))
    return out
