"""The copy service weight pushes between the training and the generating world run on
(:mod:`megatron_rl.distributed.cross_world`): megatron's plan is made over one group, the bytes go
over another (NCCL on GPUs), packed one message per pair of ranks in task-id order whatever order
the plan submits them in."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.testing.harness import run_distributed


def _tensors(device: str) -> dict[int, torch.Tensor]:
    """Task id -> a tensor rank 0 sends rank 1 (dtypes and shapes of a model's weights)."""
    return {
        7: torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3) + 0.5,
        2: torch.linspace(-1, 1, 10, device=device).to(torch.bfloat16),
        5: torch.arange(4, dtype=torch.int64, device=device) * 1000,
        3: torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)).to(device).transpose(0, 2),
    }


class CountingGroup:
    """A process group that counts the bytes and messages it carries."""

    def __init__(self, group):
        self.group, self.bytes, self.messages = group, 0, 0

    def __getattr__(self, name):  # rank(), size(), ...: the group's
        return getattr(self.group, name)

    def send(self, tensors, peer, tag):
        self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        self.messages += 1
        return self.group.send(tensors, peer, tag)

    def recv(self, tensors, peer, tag):
        self.messages += 1
        return self.group.recv(tensors, peer, tag)


def copy_body(device: str, data_kind: str) -> dict:
    import torch.distributed as dist

    from megatron_rl.distributed.cross_world import copy_service

    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(rank)
    plan = dist.new_group(backend="gloo")
    if data_kind == "nccl":
        from megatron_rl.distributed.cross_world import _nccl_joint_group

        data = _nccl_joint_group(dist.distributed_c10d._get_default_store(), rank, 2, 60.0)
    else:
        data = plan if data_kind == "same" else dist.new_group(backend="gloo")
    counting = CountingGroup(data)
    service = copy_service(counting) if data_kind == "same" else copy_service(plan, counting)
    sent = _tensors(device)
    received = {k: torch.zeros_like(t) for k, t in sent.items()}
    if rank == 0:
        for task in (5, 7, 2, 3):  # not in task order: both sides sort by task id
            service.submit_send(sent[task], 1, task_id=task)
    else:
        for task in (3, 2, 7, 5):
            service.submit_recv(received[task], 0, task_id=task)
    service.run()
    return {"received": {k: t.cpu() for k, t in received.items()}, "bytes": counting.bytes,
            "messages": counting.messages}


def _check(out: list[dict]) -> None:
    sender, receiver = out
    want = _tensors("cpu")
    for task, tensor in want.items():
        assert torch.equal(receiver["received"][task], tensor), task
    assert sender["bytes"] == sum(t.numel() * t.element_size() for t in want.values())
    assert sender["messages"] == receiver["messages"] == 1  # one packed message for the pair


@pytest.mark.parametrize("data_kind", ["same", "other"])
def test_packed_weights_land_bit_for_bit(data_kind):
    """Plan and bytes on one gloo group (the CPU's path), and the CPU form of the GPU path: the
    bytes over a second group, packed where the tensors are.  Every tensor lands bit for bit,
    also one that starts at an odd byte offset of the message (after a bf16 tensor of odd length),
    which could not be viewed in place."""
    _check(run_distributed(2, copy_body, "cpu", data_kind))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL between two ranks needs a GPU for each")
def test_weights_travel_over_nccl_between_gpus():
    _check(run_distributed(2, copy_body, "cuda", "nccl"))
