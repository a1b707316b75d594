"""Generation on the actor's own tensor-parallel shards, so no rank holds the whole model.

The plain engine gathers the full canonical weights onto every rank: simple, but a 7B actor
costs every GPU a second 14 GB copy, and a model larger than one GPU cannot generate at all.
This engine keeps megatron's TP split instead.  Each rank builds a
:class:`~megatron_rl.rollout.decoder.TorchDecoder` for its TP shard, copies its own pipeline
stage's shards straight out of the megatron parameters (megatron's shard *is* the decoder's
shard: no reshuffling), and receives the other stages' layers of the same TP rank over the
pipeline group, one tensor at a time.  Per rank: weights / TP (norms replicated) and KV cache / TP.

The TP ranks of one data-parallel replica generate the same prompts together; the token TP rank 0
draws is broadcast, so every shard continues with the same sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.config.schema import ModelConfig
from megatron_rl.distributed import collectives
from megatron_rl.models.arch import ACTIVATIONS, local_norm_name, padded_vocab_size
from megatron_rl.models.canonical import global_named_parameters, tp_shard
from megatron_rl.rollout.decoder import TensorParallel
from megatron_rl.rollout.engine import TorchRolloutEngine


def current_tensor_parallel(model_cfg: ModelConfig) -> TensorParallel:
    """This rank's place in megatron's TP group, with megatron's padded vocabulary."""
    size = ps.get_tensor_model_parallel_world_size()
    return TensorParallel(
        size=size, rank=ps.get_tensor_model_parallel_rank(), group=ps.get_tensor_model_parallel_group(),
        padded_vocab=padded_vocab_size(model_cfg.vocab_size, model_cfg.make_vocab_size_divisible_by, size),
    )


def _split_dim(full: torch.Tensor, local_shape: torch.Size) -> int | None:
    """A decoder parameter has no megatron split attributes: its TP split dimension is the one
    whose size differs from the canonical tensor's (``None``: replicated)."""
    return next((d for d, (a, b) in enumerate(zip(full.shape, local_shape)) if a != b), None)


class TPShardedRolloutEngine(TorchRolloutEngine):
    """``rollout.engine=tp_sharded``: the KV-cache decoder on this rank's TP shard of the actor."""

    def __init__(self, model_cfg: ModelConfig, device="cpu", max_batch_size: int = 64, dtype=None):
        super().__init__(model_cfg, device, max_batch_size, dtype, tp=current_tensor_parallel(model_cfg))

    @property
    def tp(self) -> TensorParallel:
        return self.model.tp

    @torch.no_grad()
    def load_weights(self, canonical: dict[str, torch.Tensor]) -> None:
        """Load from a full canonical dict (tests, benchmarks): each rank keeps its slice."""
        self._materialize()
        target = self.model.state_dict()
        gated = ACTIVATIONS[self.model.cfg.activation][0]
        state = {}
        for name, full in canonical.items():
            name = local_norm_name(name)
            if name not in target:  # passed through, so load_canonical reports it
                state[name] = full
                continue
            shape = target[name].shape
            state[name] = tp_shard(full, name, dim=_split_dim(full, shape), local_rows=shape[0],
                                   tp_rank=self.tp.rank, tp_size=self.tp.size, gated=gated)
        self.model.load_canonical(state)
        self._loaded = True

    @torch.no_grad()
    def load_from_chunks(self, chunks: list) -> None:
        """Take this TP rank's shards from the actor's megatron chunks; the layers of other
        pipeline stages arrive by broadcast within the pipeline group."""
        self._materialize()
        target = self.model.state_dict()
        local: dict[str, torch.Tensor] = {}
        for chunk in chunks:
            for name, param in global_named_parameters(chunk):
                if name in target:  # a tied output layer on the last stage is the embedding again
                    local.setdefault(name, param.detach())
        # Pipeline stages hold different layers: each tensor comes from the stage that has it.
        pp_size = ps.get_pipeline_model_parallel_world_size()
        owners: list = [sorted(local)]
        if pp_size > 1:
            group = ps.get_pipeline_model_parallel_group()
            owners = collectives.all_gather_object(sorted(local), group=group)
            stage_ranks = dist.get_process_group_ranks(group)
        me = ps.get_pipeline_model_parallel_rank()
        for name in sorted(target):
            owner = next((s for s, names in enumerate(owners) if name in names), None)
            if owner is None:
                raise KeyError(f"no pipeline stage holds {name!r} for the sharded rollout engine")
            if owner == me:
                target[name].copy_(local[name])
            if pp_size > 1:
                dist.broadcast(target[name], src=stage_ranks[owner], group=group)
        self._loaded = True
