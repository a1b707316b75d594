"""Move a model's device memory to host memory between the phases that use it, and back.

A PPO step holds up to three models (actor, critic, reference) but runs one phase at a time.
With ``trainer.offload=true`` every model not needed by the current phase waits in host memory:
its parameters, megatron DDP gradient buffers and optimizer state.  The device storages are
freed with ``untyped_storage().resize_(0)`` and refilled in place later, so every view into them
(megatron's ``main_grad`` views into the gradient buffer, optimizer references) stays valid.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def _storages(tensors: Iterable[torch.Tensor]) -> list:
    seen, out = set(), []
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in seen:
            continue
        seen.add(key)
        out.append(storage)
    return out


def model_tensors(chunks: list, optimizer=None) -> list[torch.Tensor]:
    """Parameters, DDP gradient buffers and optimizer state tensors of a model."""
    tensors: list[torch.Tensor] = []
    for chunk in chunks:
        tensors += [p.data for p in chunk.parameters()]
        ddp_buffers = getattr(chunk, "buffers", None)  # megatron DDP's list (nn.Module has a method of that name)
        if isinstance(ddp_buffers, (list, tuple)):
            for buffer in ddp_buffers:
                tensors += [getattr(buffer, "grad_data", None), getattr(buffer, "param_data", None)]
    if optimizer is not None:
        inner = getattr(optimizer, "chained_optimizers", [optimizer])
        for opt in inner:
            torch_opt = getattr(opt, "optimizer", None)
            if torch_opt is None:
                continue
            for state in torch_opt.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
            for group in torch_opt.param_groups:
                tensors += [p.data for p in group["params"]]  # fp32 master copies under bf16 training
    return tensors


class Offloader:
    """Holds the host copies of one model's device storages while it is offloaded."""

    def __init__(self, chunks: list, optimizer=None):
        self.chunks, self.optimizer = chunks, optimizer
        self._host: Optional[list] = None
        self.bytes = 0

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    @torch.no_grad()
    def offload(self) -> int:
        if self._host is not None:
            return 0
        self._host = []
        self.bytes = 0
        for storage in _storages(model_tensors(self.chunks, self.optimizer)):
            nbytes = storage.nbytes()
            view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(view, non_blocking=False)
            storage.resize_(0)
            self._host.append((storage, host))
            self.bytes += nbytes
        return self.bytes

    @torch.no_grad()
    def onload(self) -> None:
        if self._host is None:
            return
        for storage, host in self._host:
            storage.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host)
        self._host = None
