"""The lines a PPO run prints while it starts: what it resolved, built and will run on."""

from __future__ import annotations

import torch

from megatron_rl.config.schema import Config
from megatron_rl.layout.lora import adapter_params, int8_base, lora_on, target_names
from megatron_rl.layout.sizes import ParallelLayout
from megatron_rl.planner.memory import total_params
from megatron_rl.resolve import AUTO_ORIGIN, DERIVED, Resolution


def layout_line(layout: ParallelLayout, world_size: int, device) -> str:
    """The start-up line naming every parallel size, expert parallelism included (etp only
    when it is not TP, its default)."""
    vpp = f" vpp={layout.vpp}" if layout.vpp else ""
    etp = f" etp={layout.etp}" if layout.etp else ""
    sp = " (sequence parallel)" if layout.sequence_parallel else ""
    return (f"layout: tp={layout.tp} pp={layout.pp}{vpp} cp={layout.cp} dp={layout.dp} ep={layout.ep}{etp}{sp}, "
            f"world size {world_size}, {torch.device(device).type}")


def model_source(cfg: Config) -> str:
    if cfg.actor.init_checkpoint:
        return cfg.actor.init_checkpoint
    if cfg.model.hf_path:
        return cfg.model.hf_path
    return f"random init (seed {cfg.run.seed})"


def model_line(cfg: Config, built: str) -> str:
    return (f"model: {model_source(cfg)}: {total_params(cfg.model):,} parameters ({cfg.model.num_layers} layers, "
            f"hidden {cfg.model.hidden_size}); built {built}")


def lora_lines(cfg: Config) -> list[str]:
    """One line per model that trains LoRA adapters: their size against the base's."""
    lines = []
    for name, part in (("actor", cfg.actor), ("critic", cfg.critic)):
        lora = part.lora
        if not lora_on(lora):
            continue
        adapters, total = adapter_params(cfg.model, lora), total_params(cfg.model)
        lines.append(f"lora: {name} trains rank-{lora.rank} adapters (alpha {lora.alpha:g}) on "
                     f"{', '.join(target_names(cfg.model, lora.target_modules))}: {adapters:,} parameters "
                     f"({100 * adapters / total:.2f}% of the base's {total:,}, which stays frozen"
                     + (", its transformer-layer projections in int8)" if int8_base(lora) else ")"))
    return lines


def rollout_line(resolution: Resolution) -> str:
    """Engine, batching and generation pass size, each with where its value came from."""
    engine, batch = resolution.get("rollout.engine"), resolution.get("rollout.max_batch_size")
    batching = resolution.get("rollout.batching")
    how = f" (auto: {batching.why})" if batching.origin == AUTO_ORIGIN else ""
    return (f"rollout: {engine.value} engine, {batching.value} batching{how}, up to {batch.value} sequences "
            "per generation pass per rank "
            f"({'derived' if batch.origin == DERIVED else 'rollout.max_batch_size'})")


def old_logprobs_line(resolution: Resolution, source_name: str) -> str:
    auto = resolution.get("algorithm.old_logprobs").origin == AUTO_ORIGIN
    return f"old log-probs: {source_name}" + (" (auto)" if auto else "")
