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
    """Holds the host copies of one model's device storages while it is offloaded.

    On CUDA the host copies live in pinned buffers kept for the next offload (a fresh pinned
    allocation per phase would grow the caching host allocator), and both directions copy
    without blocking the host per storage: one stream synchronisation before the device storages
    are freed.  On the CPU every copy is an ordinary synchronous one."""

    def __init__(self, chunks: list, optimizer=None):
        self.chunks, self.optimizer = chunks, optimizer
        self._host: Optional[list] = None
        self._pinned: list[torch.Tensor] = []  # the i-th CUDA storage's pinned host buffer
        self.bytes = 0

    @property
    def offloaded(self) -> bool:
        return self._host is not None

    def _host_buffer(self, index: int, storage) -> torch.Tensor:
        """Storages come in the same order every offload (their addresses change on refill)."""
        nbytes = storage.nbytes()
        if storage.device.type != "cuda":
            return torch.empty(nbytes, dtype=torch.uint8)
        if index >= len(self._pinned):
            self._pinned.append(torch.empty(0, dtype=torch.uint8))
        if self._pinned[index].numel() != nbytes:
            self._pinned[index] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return self._pinned[index]

    @torch.no_grad()
    def offload(self) -> int:
        if self._host is not None:
            return 0
        self._host = []
        self.bytes = 0
        on_cuda = False
        for index, storage in enumerate(_storages(model_tensors(self.chunks, self.optimizer))):
            view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = self._host_buffer(index, storage)
            on_cuda |= storage.device.type == "cuda"
            host.copy_(view, non_blocking=storage.device.type == "cuda")
            self._host.append((storage, host))
            self.bytes += storage.nbytes()
        if on_cuda:
            torch.cuda.current_stream().synchronize()  # every copy landed before its storage is freed
        for storage, _ in self._host:
            storage.resize_(0)
        return self.bytes

    @torch.no_grad()
    def onload(self) -> None:
        if self._host is None:
            return
        for storage, host in self._host:
            storage.resize_(host.numel())
            device_view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            # Pinned sources copy asynchronously on the current stream, ahead of any kernel that
            # reads them; the buffers are only written again by the next offload, on that stream.
            device_view.copy_(host, non_blocking=storage.device.type == "cuda")
        self._host = None
