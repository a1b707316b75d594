"""A config as the planner sees it: the lengths and models it plans for, and the keys where the
config differs from what the plan decides (``megatron-rl plan --config``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.algorithms.advantages import needs_critic
from megatron_rl.algorithms.distill import uses_task_advantage
from megatron_rl.config.rules import config_value
from megatron_rl.config.schema import Config, LoRAConfig
from megatron_rl.layout.lora import lora_on


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    prompt_len: int
    response_len: int
    with_critic: bool
    with_reference: bool
    rollout_concurrency: Optional[int] = None  # sequences per replica megatron's engine must hold (max_batch_size)
    rollout_layout: Optional[dict] = None  # the rollout.layout sizes the config sets (None: the plan chooses)
    generators: int = 0  # rollout.ranks: GPUs that only generate
    actor_lora: Optional[LoRAConfig] = None  # actor.lora when its rank is > 0: adapters on a frozen base
    critic_lora: Optional[LoRAConfig] = None  # critic.lora likewise
    teachers: tuple = ()  # the ModelConfig of each algorithm.distill teacher (frozen)
    teacher_sizes: Optional[dict] = None  # algorithm.distill.layout's sizes (None where unset: the training's)


def plan_inputs(cfg: Config, teachers: tuple = ()) -> PlanInputs:
    """The longest prompt and response, and which models the trainer builds: a critic for
    estimators that need one (none for pure distillation), a reference whenever there is a KL term
    (as the trainer does), each model's LoRA (a LoRA actor is its own reference: the planner counts
    no copy), and ``teachers`` (their ``ModelConfig``s, read by the caller)."""
    asked = dataclasses.asdict(cfg.rollout.layout)
    return PlanInputs(prompt_len=cfg.data.max_prompt_tokens, response_len=cfg.rollout.max_new_tokens,
                      with_critic=needs_critic(cfg.algorithm.advantage) and uses_task_advantage(cfg.algorithm),
                      with_reference=cfg.algorithm.kl_coef > 0,
                      rollout_concurrency=cfg.rollout.max_batch_size,
                      rollout_layout=asked if any(v is not None for v in asked.values()) else None,
                      generators=cfg.rollout.ranks,
                      actor_lora=cfg.actor.lora if lora_on(cfg.actor.lora) else None,
                      critic_lora=cfg.critic.lora if lora_on(cfg.critic.lora) else None, teachers=tuple(teachers),
                      teacher_sizes=dataclasses.asdict(cfg.algorithm.distill.layout))


def _rollout_size(cfg: Config, key: str, value):
    """A ``rollout.layout`` size as it resolves: null is the training layout's (expert-TP: then the
    inference TP's)."""
    if value is not None:
        return value
    name, asked, train = key.rsplit(".", 1)[1], cfg.rollout.layout, cfg.parallel
    if name == "etp":
        return asked.etp or train.etp or asked.tp or train.tp
    return getattr(train, name)


def _normalised(cfg: Config, key: str, value):
    if key == "parallel.etp" and value == cfg.parallel.tp:  # ETP equal to TP is the default, null
        return None
    if key.startswith("rollout.layout."):
        return _rollout_size(cfg, key, value)
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


def planned_rollout_layout(cfg: Config, world: int, gpu_memory_bytes: float, param_bytes: int = 2,
                           teachers: tuple = ()):
    """``rollout.layout`` for a config that leaves it unset, on ``world`` GPUs of
    ``gpu_memory_bytes``: :func:`megatron_rl.planner.memory.choose_rollout_layout` with what the
    config's training state leaves during rollout, for rollout.max_batch_size sequences per replica
    (default :data:`~megatron_rl.planner.memory.ROLLOUT_CONCURRENCY`).  With ``rollout.ranks`` the
    layout is the generator ranks' (``world``: the training ranks), which hold nothing else.
    ``teachers``: the distillation teachers' ``ModelConfig``s (resident beside the actor unless
    offloaded).  Returns ``(RolloutMemory, why)``."""
    from megatron_rl.planner.memory import (
        ROLLOUT_CONCURRENCY,
        choose_rollout_layout,
        model_state,
        rollout_resident_bytes,
        teacher_option,
    )
    from megatron_rl.planner.option import PlanOption
    from megatron_rl.planner.search import HEADROOM

    p, inputs = cfg.parallel, plan_inputs(cfg, teachers)
    train = PlanOption.of(tp=p.tp, pp=p.pp, cp=p.cp, dp=max(world // (p.tp * p.pp * p.cp), 1),
                          sequence_parallel=p.sequence_parallel, offload=cfg.trainer.offload,
                          distributed_optimizer=cfg.actor.optim.use_distributed_optimizer, ep=p.ep, etp=p.etp)
    models = model_state(cfg.model, train, inputs.with_critic, inputs.with_reference, param_bytes,
                         inputs.actor_lora, inputs.critic_lora, inputs.teachers,
                         teacher_option(train, inputs.teacher_sizes))
    generators = cfg.rollout.ranks or None
    return choose_rollout_layout(cfg.model, train, seq_len=inputs.prompt_len + inputs.response_len,
                                 resident=0.0 if generators else rollout_resident_bytes(models, train.offload),
                                 budget_bytes=HEADROOM * gpu_memory_bytes,
                                 concurrency=cfg.rollout.max_batch_size or ROLLOUT_CONCURRENCY,
                                 param_bytes=param_bytes, block_tokens=cfg.rollout.kv_block_tokens,
                                 generators=generators)
