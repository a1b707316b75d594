"""Collectives on host values -- metrics, counters, agreed sizes, Python objects -- for any group.

A process group serves the device types its backend was registered for: gloo serves CPU (and
CUDA) tensors, NCCL only CUDA ones.  An all-reduce of a CPU tensor on an NCCL group fails with
"No backend type associated with device type cpu", so a host value must travel on a device the
group serves.  Every host-side collective of the package goes through this module, which picks
that device from the group's backend (CPU whenever the group serves it: no copy, no sync) and
hands the result back on the host.  Device tensors inside the model (attention, log-probs,
weight gathers) are already where their group needs them and use ``torch.distributed`` directly.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

CPU = "cpu"


def served_device_types(backend_config: str) -> tuple[str, ...]:
    """The device types a backend configuration serves.

    ``backend_config`` is what :func:`torch.distributed.get_backend_config` returns: a list of
    ``device:backend`` pairs (``"cpu:gloo,cuda:nccl"``) or one backend name (``"nccl"``), whose
    devices come from torch's registry of backend capabilities."""
    types: list[str] = []
    for entry in backend_config.replace(" ", "").lower().split(","):
        if not entry:
            continue
        if ":" in entry:
            device_type, _ = entry.split(":", 1)
            found = [device_type]
        else:
            found = list(dist.Backend.backend_capability.get(entry, [CPU]))
        types += [t for t in found if t not in types]
    return tuple(types)


def transfer_device_type(served: Sequence[str]) -> str:
    """Where a host value travels for a group serving ``served``: the CPU if it can (no copy),
    else the group's device (CUDA for NCCL)."""
    if not served or CPU in served:
        return CPU
    return served[0]


def group_device_type(group: Optional[dist.ProcessGroup] = None) -> str:
    """The device type host values travel on over ``group`` (None: the default group)."""
    return transfer_device_type(served_device_types(dist.get_backend_config(group)))


def group_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device host values travel on over ``group``: this rank's GPU for an NCCL group."""
    kind = group_device_type(group)
    if kind == CPU:
        return torch.device(CPU)
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _active(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce(values: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
    """``values`` reduced over ``group``, returned on the device they came from (a new tensor)."""
    if not _active(group):
        return values.clone()
    device = group_device(group)
    buffer = values.detach().to(device, copy=True)
    dist.all_reduce(buffer, op=op, group=group)
    return buffer.to(values.device)


def agree_max(value: int, group=None) -> int:
    """The largest ``value`` over ``group``, on every rank."""
    return int(all_reduce(torch.tensor([value], dtype=torch.int64), dist.ReduceOp.MAX, group)[0])


def agree_any(flag: bool, group=None) -> bool:
    """Whether any rank of ``group`` passed True, on every rank."""
    return agree_max(1 if flag else 0, group) > 0


def all_gather_object(obj: Any, group=None) -> list:
    """``obj`` of every rank of ``group``, in group-rank order, on every rank."""
    if not _active(group):
        return [obj]
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_varlen(values: torch.Tensor, group=None) -> list[torch.Tensor]:
    """A 1-D tensor of any length from every rank of ``group``, in group-rank order, on the
    device ``values`` came from: two tensor all-gathers (sizes, then the padded values), where
    :func:`all_gather_object` would pickle every tensor it carries."""
    values = values.reshape(-1)
    if not _active(group):
        return [values.clone()]
    device = group_device(group)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([values.numel()], dtype=torch.int64, device=device), group=group)
    sizes = [int(n) for n in torch.cat(sizes).tolist()]
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=values.dtype, device=device)
    mine[: values.numel()] = values.to(device)
    parts = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    return [part[:n].to(values.device) for part, n in zip(parts, sizes)]


def broadcast_object(obj: Any, src: int, group=None) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group``."""
    if not _active(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group=None) -> None:
    if _active(group):
        dist.barrier(group=group)
