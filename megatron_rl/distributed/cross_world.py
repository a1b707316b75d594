"""Weight copies between the training and the generating world of one job (``rollout.ranks``).

The trainers and the generators are two torch.distributed worlds (:mod:`placement`).  megatron-core
0.19's resharding (``swap_model_weights``) plans a copy across two worlds when it is given one
process group over all their ranks and each world's rank offset in it: every generator rank then
receives exactly the slices of its own shard from the trainer ranks that hold them, instead of a
full copy through one rank.

:func:`joint_group` is that group (gloo, over the job's TCP store, ranks numbered as in the job:
trainers first): megatron builds its plan over it.  The bytes travel on :func:`data_group`: on GPUs
a second group over the same ranks with NCCL, device to device; on the CPU the gloo group itself.
:class:`CrossWorldCopyService` is the copy service megatron's plan runs on.
megatron's own services cannot: its gloo and NCCL services post ``torch.distributed.P2POp``\\ s,
whose constructor resolves the peer through the default world's table of groups, which a group
spanning two worlds is not in (``ValueError: Group ... is not registered``), and its executor's
closing ``dist.barrier`` asks the same table.  Ours sends through the group itself, and packs
every slice one rank sends another into one message: both sides order them by the plan's task ids,
which megatron derives identically on every rank.
"""

from __future__ import annotations

import datetime
import functools
from collections import defaultdict

import torch
import torch.distributed as dist


def joint_group(timeout_s: float):
    """A gloo group over every rank of the job, numbered as in the job; made once per process, by
    every rank of the job (its construction is a rendezvous)."""
    from megatron_rl.distributed.runtime import job_placement, job_store

    where = job_placement()
    return _joint_group(job_store(), where.global_rank, where.trainers + where.generators, timeout_s)


@functools.lru_cache(maxsize=None)
def _joint_group(store, rank: int, world_size: int, timeout_s: float):
    return dist.ProcessGroupGloo(dist.PrefixStore("joint", store), rank, world_size,
                                 datetime.timedelta(seconds=timeout_s))


def data_group(group, timeout_s: float, device: torch.device):
    """The group the weights' bytes travel on between the two worlds: NCCL over the same ranks when
    they run on GPUs (device to device; its communicators are made at the first transfer between
    two ranks, so making the group is no rendezvous), else ``group`` itself (gloo, through the host)."""
    if device.type != "cuda":
        return group
    from megatron_rl.distributed.runtime import job_placement, job_store

    where = job_placement()
    return _nccl_joint_group(job_store(), where.global_rank, where.trainers + where.generators, timeout_s)


@functools.lru_cache(maxsize=None)
def _nccl_joint_group(store, rank: int, world_size: int, timeout_s: float):
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore("joint_nccl", store), rank, world_size, options)


def copy_service(group, data=None):
    """The copy service megatron's ``swap_model_weights`` runs on: its plan is made over ``group``
    (gloo), the bytes go over ``data`` (:func:`data_group`; ``group`` when None)."""
    from megatron.core.resharding.copy_services.base import CopyService

    data = group if data is None else data
    on_device = data is not group  # NCCL: packed and received on the GPU

    class CrossWorldCopyService(CopyService):
        # run() returns only when every message this rank sends or receives is through.
        requires_process_group_barrier = False

        def __init__(self):
            super().__init__(group=group)
            self.sends: dict[int, list] = defaultdict(list)  # peer -> [(task id, tensor)]
            self.recvs: dict[int, list] = defaultdict(list)

        def submit_send(self, src_tensor, dest_rank, task_id=None):
            self.sends[dest_rank].append((task_id, src_tensor))

        def submit_recv(self, dest_tensor, src_rank, task_id=None):
            self.recvs[src_rank].append((task_id, dest_tensor))

        def run(self):
            works, landing = [], []
            for peer, ops in self.sends.items():
                works.append(data.send([_packed(ops, to_host=not on_device)], peer, 0))
            for peer, ops in self.recvs.items():
                ops.sort(key=lambda op: op[0])
                where = ops[0][1].device if on_device else torch.device("cpu")
                buffer = torch.empty(sum(t.numel() * t.element_size() for _, t in ops), dtype=torch.uint8,
                                     device=where)
                works.append(data.recv([buffer], peer, 0))
                landing.append((buffer, ops))
            for work in works:
                work.wait()
            for buffer, ops in landing:
                _unpack(buffer, ops)
            self.sends.clear()
            self.recvs.clear()

    return CrossWorldCopyService()


def _packed(ops: list, to_host: bool = True) -> torch.Tensor:
    """The bytes of every tensor in ``ops`` (``(task id, tensor)``), in task-id order, on the host
    (``to_host``) or where the tensors are."""
    ops = sorted(ops, key=lambda op: op[0])
    pieces = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in ops]
    return torch.cat([p.cpu() for p in pieces] if to_host else pieces)


def _unpack(buffer: torch.Tensor, ops: list) -> None:
    """Write ``buffer`` (packed by :func:`_packed` on the sender) into the tensors of ``ops``."""
    offset = 0
    with torch.no_grad():
        for _, target in ops:
            nbytes = target.numel() * target.element_size()
            chunk = buffer[offset:offset + nbytes]
            if offset % target.element_size():  # after a piece of odd length: viewing needs alignment
                chunk = chunk.clone()
            chunk = chunk.view(target.dtype).reshape(target.shape)
            target.copy_(chunk.to(target.device))
            offset += nbytes
