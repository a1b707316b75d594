"""Which weights the engine generates with: the actor's own chunk in place where the inference
layout is the training layout, else a model of its own on ``rollout.layout``, refit from the
actor's chunks before every rollout (:mod:`megatron_rl.rollout.refit`) and freed after it.

With LoRA (``lora``: the actor's LoRAConfig) the model of its own carries the same adapters; the
base is frozen, so the first refit from a set of chunks moves everything and later ones the
adapters alone, and releasing it frees the adapters only (the base stays for the next rollout)."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.layout.lora import is_adapter_param, lora_on


class EngineWeights:
    """The model the engine generates with, and the models and chunks it builds for that."""

    def __init__(self, model_cfg: ModelConfig, device: torch.device, layout=None, lora=None):
        self.model_cfg = model_cfg
        self.lora = lora if lora_on(lora) else None
        self._base_from: Optional[list] = None  # the chunks whose frozen base the model of its own holds
        self.device = device
        # rollout.layout (a RolloutLayoutConfig; unset sizes are the training layout's)
        self.layout = layout
        self.model = None  # the RLGPTModel generating: the actor's (this rank's TP/PP shard) or its own
        self.own_chunks: Optional[list] = None  # built by load_canonical (tests, the generate command)
        self.inference_model = None  # the model of its own on rollout.layout, once built
        self.last_refit = None  # RefitStats of the latest refit; None while generating in place

    def inference_layout(self):
        """The :class:`~megatron_rl.layout.sizes.ParallelLayout` the engine generates on (the
        training layout's sizes where ``rollout.layout`` leaves them unset)."""
        from megatron_rl.distributed.runtime import active_layout
        from megatron_rl.layout.sizes import ParallelLayout

        train = active_layout()
        if train is None:
            raise RuntimeError("rollout.engine=megatron needs megatron's parallel groups (init_model_parallel)")
        return ParallelLayout.for_rollout(self.layout, train)

    def place(self, chunks: list) -> bool:
        """Generate with the actor's chunk itself where the inference layout is the training layout;
        else refit the actor's weights into the model of its own.  Whether the model changed."""
        from megatron_rl.distributed.runtime import active_layout
        from megatron_rl.layout.sizes import shares_training_weights
        from megatron_rl.models.canonical import unwrap

        infer = self.inference_layout()
        if not shares_training_weights(infer, active_layout()):
            return self._refit(chunks, infer)
        self.last_refit = None
        if len(chunks) != 1:
            raise ValueError(
                f"rollout.engine=megatron needs one model chunk per rank, got {len(chunks)} (virtual "
                f"pipeline stages): megatron-core's inference refuses interleaved chunks; the engine "
                f"generates on a model of its own there (rollout.layout)"
            )
        model = unwrap(chunks[0])
        changed = model is not self.model
        self.model = model
        if self.own_chunks is not None and unwrap(self.own_chunks[0]) is not model:
            self.own_chunks = None
        return changed

    def _refit(self, chunks: list, infer) -> bool:
        from megatron_rl.distributed.runtime import active_layout
        from megatron_rl.models.canonical import unwrap
        from megatron_rl.rollout.refit import build_inference_model, refit

        if self.inference_model is None:
            self.inference_model = build_inference_model(self.model_cfg, infer, active_layout(), self.device,
                                                         lora=self.lora)
        self._materialize_inference_weights()
        source = [unwrap(c) for c in chunks]
        adapters_only = self.lora is not None and self._base_from is not None and \
            len(source) == len(self._base_from) and all(a is b for a, b in zip(source, self._base_from))
        self.last_refit = refit(chunks, self.inference_model, "nccl" if self.device.type == "cuda" else "gloo",
                                adapters_only=adapters_only)
        self._base_from = source if self.lora is not None else None
        changed = self.model is not self.inference_model
        self.model = self.inference_model
        return changed

    def own_chunks_for_canonical(self) -> Optional[list]:
        """The chunks a canonical state dict loads into: built for the active layout on the first
        call (then the list, to place), None once built."""
        from megatron_rl.distributed.runtime import active_layout
        from megatron_rl.models.builder import build_gpt_chunks

        if self.own_chunks is not None:
            return None
        layout = active_layout()
        if layout is None:
            raise RuntimeError("rollout.engine=megatron needs megatron's parallel groups (init_model_parallel)")
        self.own_chunks = build_gpt_chunks(self.model_cfg, layout, self.device)
        return self.own_chunks

    def release(self) -> None:
        """Free the model of its own's weights (refit again before the next rollout); the actor's
        own shards stay.  With LoRA only the adapters go: the next refit restores them alone."""
        if self.inference_model is not None:
            for name, tensor in self.inference_model.named_parameters():
                if self.lora is None or is_adapter_param(name):
                    tensor.untyped_storage().resize_(0)

    def _materialize_inference_weights(self) -> None:
        """Give released weights their storage back (the refit overwrites every value)."""
        for tensor in self.inference_model.parameters():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(tensor.numel() * tensor.element_size())

    def own_layout_groups(self):
        """megatron's process groups of the model of its own while the engine generates on it; None
        while it generates in place."""
        if self.model is None or self.model is not self.inference_model:
            return None
        return self.model.pg_collection

    def weight_bytes(self) -> int:
        """Bytes of the shard this rank generates with (the actor's: shared with training, not a copy)."""
        if self.model is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.model.parameters())
