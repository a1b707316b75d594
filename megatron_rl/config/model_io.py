"""A model config to and from the plain dict stored in a checkpoint's ``meta.json``.

The trainer writes it on save; ``convert`` and resume read it back, so a checkpoint names the
architecture it holds without the run's YAML.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.config.schema import ModelConfig, MoEConfig, RecomputeConfig


def model_config_to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def model_config_from_dict(data: dict) -> ModelConfig:
    data = dict(data)
    data["recompute"] = RecomputeConfig(**data.get("recompute", {}))
    data["moe"] = MoEConfig(**data.get("moe", {}))  # checkpoints of dense models written before MoE have none
    return ModelConfig(**data)
