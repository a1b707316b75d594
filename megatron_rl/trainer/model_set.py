"""The models a PPO run trains and reads -- actor, frozen reference, critic, distillation teachers
-- and where they live.

Built once by the trainer; the step's phases (experience, update) and checkpoints take them from
here.  With ``trainer.offload`` only the running phase's model stays on the device.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

from megatron_rl.config.schema import Config
from megatron_rl.distributed.runtime import active_groups, layout_active, own_layout_groups
from megatron_rl.engine import checkpoint
from megatron_rl.engine.forward import BatchPlan
from megatron_rl.engine.offload import Offloader
from megatron_rl.engine.trainable import Trainable, freeze, make_trainable
from megatron_rl.layout.lora import lora_on
from megatron_rl.models.builder import build_gpt_chunks
from megatron_rl.models.heads import attach_value_head
from megatron_rl.models.lora.adapters import adapters_disabled, attach_lora, layer_adapters
from megatron_rl.trainer.update import scheduled_updates


@dataclasses.dataclass
class ModelSet:
    """``reference`` without a KL term and ``critic`` without a value-based estimator are None;
    ``plan`` and ``device``: how every forward over them is cut into micro-batches, and where.
    ``reference_is_base``: the actor trains LoRA adapters, so the reference is the actor itself with
    its adapters off (no second copy; ``reference`` is None)."""

    actor: Trainable
    reference: Optional[list]
    critic: Optional[Trainable]
    plan: BatchPlan
    device: object
    offloaders: dict = dataclasses.field(default_factory=dict)
    reference_is_base: bool = False
    # On-policy distillation: each teacher's frozen chunks (on the training layout or teacher_layout),
    # by its name (:class:`megatron_rl.engine.teachers.TeacherSource`), with where it came from.
    teachers: dict = dataclasses.field(default_factory=dict)
    teacher_sources: tuple = ()
    # algorithm.distill.layout: the teachers' own layout (a ParallelLayout) and its process groups;
    # None: they run on the training layout.
    teacher_layout: Optional[object] = None
    teacher_groups: Optional[object] = None

    @property
    def actor_lora(self) -> bool:
        return bool(layer_adapters(self.actor.chunks))

    @property
    def critic_lora(self) -> bool:
        return self.critic is not None and bool(layer_adapters(self.critic.chunks))

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or self.reference_is_base

    @contextlib.contextmanager
    def reference_pass(self):
        """The reference's chunks, on the device, for the block: the frozen copy, or the actor's
        chunks with every adapter off."""
        if self.reference_is_base:
            self.phase("actor")
            with adapters_disabled(self.actor.chunks) as chunks:
                yield chunks
        else:
            self.phase("reference")
            yield self.reference

    def start_offloading(self) -> None:
        """From now on models wait in host memory outside their phase (built from the actor as it is
        now: the SFT warm-up replaces its optimizer)."""
        self.offloaders = {"actor": Offloader(self.actor.chunks, self.actor.optimizer)}
        if self.critic is not None:
            self.offloaders["critic"] = Offloader(self.critic.chunks, self.critic.optimizer)
        if self.reference is not None:
            self.offloaders["reference"] = Offloader(self.reference)
        for name, chunks in self.teachers.items():
            self.offloaders[teacher_phase(name)] = Offloader(chunks)

    def phase(self, active: Optional[str]) -> None:
        """Keep ``active`` on the device and the other models in host memory (None: all on device)."""
        for name, offloader in self.offloaders.items():
            if active is None or name == active:
                offloader.onload()
            else:
                offloader.offload()

    def checkpoint_parts(self) -> dict:
        """What a checkpoint holds of each model, by name."""
        only = {True: checkpoint.ONLY_TRAINED, False: None}
        parts = {"actor": checkpoint.ModelPart(self.actor.chunks, self.actor.optimizer, self.actor.scheduler,
                                               only=only[self.actor_lora])}
        if self.critic is not None:
            parts["critic"] = checkpoint.ModelPart(self.critic.chunks, self.critic.optimizer, self.critic.scheduler,
                                                   only=only[self.critic_lora])
        if self.reference is not None:
            parts["reference"] = checkpoint.ModelPart(self.reference)
        return parts

    @contextlib.contextmanager
    def teacher_pass(self, name: str):
        """The chunks of teacher ``name``, on the device, for the block (on the teachers' own layout,
        when they have one, its groups active)."""
        self.phase(teacher_phase(name))
        if self.teacher_layout is None:
            yield self.teachers[name]
            return
        with layout_active(self.teacher_layout, self.teacher_groups):
            yield self.teachers[name]

    def built_line(self) -> str:
        reference = "reference (the actor's base, adapters off)" if self.reference_is_base else "reference"
        where = "" if self.teacher_layout is None else \
            f", on its own {self.teacher_layout.name()} x{self.teacher_layout.dp} layout"
        teachers = [f"teacher {s.name} ({s.kind} {s.path}: {s.model.num_layers} layers, hidden {s.model.hidden_size}"
                    f"{where})" for s in self.teacher_sources]
        return ", ".join([name for name, on in (("actor", True), (reference, self.has_reference),
                                                ("critic", self.critic is not None)) if on] + teachers)


def teacher_phase(name: str) -> str:
    """The phase (and offloader) name of teacher ``name``."""
    return f"teacher:{name}"


def teacher_groups(own) -> object:
    """The process groups of the teachers' own layout ``own`` (a ParallelLayout) on this world."""
    import torch.distributed as dist

    return own_layout_groups(own.tp, own.pp, own.cp, dist.get_world_size())


def build_teachers(sources: tuple, layout, device, own=None) -> dict:
    """Each teacher frozen on the training layout ``layout`` or on its own ``own`` (built, loaded and
    run with that layout's groups active), its weights loaded from its directory (they are never
    trained, so never checkpointed: a resumed run loads them again from the same place)."""
    from megatron_rl.config.model_io import model_config_to_dict
    from megatron_rl.engine.teachers import HF
    from megatron_rl.models.hf_bridge import load_hf_weights

    def build(source) -> list:
        if own is None:
            return freeze(build_gpt_chunks(source.model, layout, device))
        groups = active_groups()
        return freeze(build_gpt_chunks(source.model, own, device, pg_collection=groups, pp_rank=groups.pp.rank()))

    teachers = {}
    active = contextlib.nullcontext() if own is None else layout_active(own, teacher_groups(own))
    with active:
        for source in sources:
            chunks = build(source)
            if source.kind == HF:
                load_hf_weights(chunks, source.path)
            else:
                checkpoint.load_checkpoint(source.path, {"actor": checkpoint.ModelPart(chunks)}, with_optimizer=False,
                                           load_rng=False, model_config=model_config_to_dict(source.model))
            teachers[source.name] = chunks
    return teachers


def build_models(cfg: Config, layout, device, plan: BatchPlan, use_ref: bool, use_critic: bool,
                 teachers: tuple = ()) -> ModelSet:
    """Actor, then reference, then critic, each on ``layout`` (weights are loaded afterwards).  With
    ``actor.lora`` / ``critic.lora`` that model's base is frozen and only its adapters (and the
    critic's value head) train; a LoRA actor is its own reference."""
    updates = scheduled_updates(cfg)

    def build(lora=None, head: bool = False) -> list:
        chunks = build_gpt_chunks(cfg.model, layout, device)
        if head:
            chunks = attach_value_head(chunks)
        if lora_on(lora):
            attach_lora(chunks, cfg.model, lora, cfg.run.seed, train_also=("value_head",))
        return chunks

    actor = make_trainable(build(cfg.actor.lora), cfg.actor.optim, updates)
    base_reference = use_ref and lora_on(cfg.actor.lora)
    reference = freeze(build()) if use_ref and not base_reference else None
    critic = make_trainable(build(cfg.critic.lora, head=True), cfg.critic.optim, updates) if use_critic else None
    own = teacher_layout_of(cfg)
    return ModelSet(actor, reference, critic, plan, device, reference_is_base=base_reference,
                    teachers=build_teachers(teachers, layout, device, own), teacher_sources=tuple(teachers),
                    teacher_layout=own, teacher_groups=teacher_groups(own) if own is not None else None)


def teacher_layout_of(cfg: Config):
    """``algorithm.distill.layout`` as a ParallelLayout on the training world (None: the training layout)."""
    import torch.distributed as dist

    from megatron_rl.layout.distill import teacher_parallel
    from megatron_rl.layout.sizes import ParallelLayout

    own = teacher_parallel(cfg) if cfg.algorithm.distill.teachers else None
    return None if own is None else ParallelLayout.from_config(own, dist.get_world_size())
