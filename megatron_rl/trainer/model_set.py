"""The models a PPO run trains and reads -- actor, frozen reference, critic -- and where they live.

Built once by the trainer; the step's phases (experience, update) and checkpoints take them from
here.  With ``trainer.offload`` only the running phase's model stays on the device.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_rl.config.schema import Config
from megatron_rl.engine import checkpoint
from megatron_rl.engine.forward import BatchPlan
from megatron_rl.engine.offload import Offloader
from megatron_rl.engine.trainable import Trainable, freeze, make_trainable
from megatron_rl.models.builder import build_gpt_chunks
from megatron_rl.models.heads import attach_value_head
from megatron_rl.trainer.update import scheduled_updates


@dataclasses.dataclass
class ModelSet:
    """``reference`` without a KL term and ``critic`` without a value-based estimator are None;
    ``plan`` and ``device``: how every forward over them is cut into micro-batches, and where."""

    actor: Trainable
    reference: Optional[list]
    critic: Optional[Trainable]
    plan: BatchPlan
    device: object
    offloaders: dict = dataclasses.field(default_factory=dict)

    def start_offloading(self) -> None:
        """From now on models wait in host memory outside their phase (built from the actor as it is
        now: the SFT warm-up replaces its optimizer)."""
        self.offloaders = {"actor": Offloader(self.actor.chunks, self.actor.optimizer)}
        if self.critic is not None:
            self.offloaders["critic"] = Offloader(self.critic.chunks, self.critic.optimizer)
        if self.reference is not None:
            self.offloaders["reference"] = Offloader(self.reference)

    def phase(self, active: Optional[str]) -> None:
        """Keep ``active`` on the device and the other models in host memory (None: all on device)."""
        for name, offloader in self.offloaders.items():
            if active is None or name == active:
                offloader.onload()
            else:
                offloader.offload()

    def checkpoint_parts(self) -> dict:
        """What a checkpoint holds of each model, by name."""
        parts = {"actor": checkpoint.ModelPart(self.actor.chunks, self.actor.optimizer, self.actor.scheduler)}
        if self.critic is not None:
            parts["critic"] = checkpoint.ModelPart(self.critic.chunks, self.critic.optimizer, self.critic.scheduler)
        if self.reference is not None:
            parts["reference"] = checkpoint.ModelPart(self.reference)
        return parts

    def built_line(self) -> str:
        return ", ".join(name for name, on in (("actor", True), ("reference", self.reference is not None),
                                               ("critic", self.critic is not None)) if on)


def build_models(cfg: Config, layout, device, plan: BatchPlan, use_ref: bool, use_critic: bool) -> ModelSet:
    """Actor, then reference, then critic, each on ``layout`` (weights are loaded afterwards)."""
    updates = scheduled_updates(cfg)

    def build() -> list:
        return build_gpt_chunks(cfg.model, layout, device)

    actor = make_trainable(build(), cfg.actor.optim, updates)
    reference = freeze(build()) if use_ref else None
    critic = make_trainable(attach_value_head(build()), cfg.critic.optim, updates) if use_critic else None
    return ModelSet(actor, reference, critic, plan, device)
