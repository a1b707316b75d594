"""A model config to and from the plain dict stored in a checkpoint's ``meta.json``.

The trainer writes it on save; ``convert`` and resume read it back, so a checkpoint names the
architecture it holds without the run's YAML.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.config.schema import ModelConfig, MoEConfig, RecomputeConfig, RopeScalingConfig


def model_config_to_dict(cfg: ModelConfig) -> dict:
    return dataclasses.asdict(cfg)


def model_config_from_dict(data: dict) -> ModelConfig:
    data = dict(data)
    data["recompute"] = RecomputeConfig(**data.get("recompute", {}))
    data["moe"] = MoEConfig(**data.get("moe", {}))  # checkpoints of dense models written before MoE have none
    data["rope_scaling"] = RopeScalingConfig(**data.get("rope_scaling", {}))
    legacy_factor = data.pop("rope_scaling_factor", None)  # written before YaRN: Llama-3 scaling only
    if legacy_factor is not None:
        data["rope_scaling"] = RopeScalingConfig(type="llama3", factor=legacy_factor)
    return ModelConfig(**data)
