"""The weights a fresh run starts from (a resumed run takes its checkpoint's instead)."""

from __future__ import annotations

from typing import Callable

from megatron_rl.config.model_io import model_config_to_dict
from megatron_rl.config.schema import Config
from megatron_rl.data.prompts import PromptSet
from megatron_rl.engine import checkpoint
from megatron_rl.envs.trajectories import EnvironmentRollout
from megatron_rl.layout.lora import int8_base
from megatron_rl.models.canonical import gather_canonical, load_canonical
from megatron_rl.models.hf_bridge import load_hf_weights
from megatron_rl.models.lora.quantized_base import quantize_base
from megatron_rl.models.seeded_init import seeded_init
from megatron_rl.trainer.model_set import ModelSet
from megatron_rl.trainer.sft import sft_warmup
from megatron_rl.utils import phase


def load_base_weights(models: ModelSet, cfg: Config, critic_base: bool = False) -> None:
    """The actor's weights before any training: HF, a checkpoint, or a seeded draw that is the same
    on every layout (:mod:`megatron_rl.models.seeded_init`).  With LoRA this is the frozen base
    (a checkpoint of a LoRA run holds only adapters, so a resume loads the base here first).
    ``critic_base`` (a resume): a LoRA critic's base too, the actor's (or ``critic.hf_path``); a
    fresh run starts the critic from the warmed-up actor in :func:`init_weights` instead."""
    if cfg.actor.init_checkpoint:
        only = checkpoint.ONLY_BASE if models.actor_lora else None
        checkpoint.load_checkpoint(cfg.actor.init_checkpoint,
                                   {"actor": checkpoint.ModelPart(models.actor.chunks, only=only)},
                                   with_optimizer=False, load_rng=False,
                                   model_config=model_config_to_dict(cfg.model))
    elif cfg.model.hf_path:
        load_hf_weights(models.actor.chunks, cfg.model.hf_path)
    else:
        seeded_init(models.actor.chunks, cfg.run.seed)
    models.actor.weights_replaced()
    quantize_bases(models, cfg, "actor")
    if critic_base and models.critic is not None and models.critic_lora:
        _critic_from(models, cfg, gather_canonical(models.actor.chunks))  # quantized once its adapters are in


def quantize_bases(models: ModelSet, cfg: Config, *parts: str) -> None:
    """The frozen bases ``lora.quantize_base`` holds in int8, quantized once their weights are in
    (:mod:`megatron_rl.models.lora.quantized_base`; the actor's reads as its dequantized weights to
    whoever copies it, the critic at its start)."""
    for part in parts:
        trainable = models.actor if part == "actor" else models.critic
        if trainable is not None and int8_base(getattr(cfg, part).lora):
            quantize_base(trainable.chunks)


def _critic_from(models: ModelSet, cfg: Config, initial: dict) -> None:
    load_canonical(models.critic.chunks, initial, strict=False)
    if cfg.critic.hf_path:
        load_hf_weights(models.critic.chunks, cfg.critic.hf_path)
    models.critic.weights_replaced()


def init_weights(models: ModelSet, cfg: Config, prompts: PromptSet, tokenizer, engine,
                 log: Callable[[str], None], base_loaded: bool = False) -> None:
    """The base (:func:`load_base_weights`, unless ``base_loaded``), then the SFT warm-up; reference
    and critic start from the (warmed-up) actor.  A LoRA actor's reference is its own base (the
    weights before the warm-up, which trains only adapters)."""
    if not base_loaded:
        load_base_weights(models, cfg)
    if cfg.trainer.sft_warmup_steps:
        # rollout.env's environments replay the demonstrations (agent sessions and single turns have none)
        make_env = engine.make_env if isinstance(engine, EnvironmentRollout) else None
        with phase.entered("SFT warm-up"):
            models.actor = sft_warmup(models.actor, prompts, tokenizer, cfg, models.plan, models.device,
                                      log, make_env=make_env)
    if models.reference is None and models.critic is None:
        return
    initial = gather_canonical(models.actor.chunks)
    if models.reference is not None:
        load_canonical(models.reference, initial)
    if models.critic is not None:
        _critic_from(models, cfg, initial)
        quantize_bases(models, cfg, "critic")
