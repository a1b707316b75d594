"""The memory accounting the planner is checked against: ``saved_for_backward``."""

import torch

from megatron_rl.utils.memory import saved_for_backward


def test_saved_for_backward_counts_the_memory_a_view_holds_not_its_shape():
    """An expanded index (stride 0 along the hidden size, as megatron's MoE unpermute saves for its
    scatter_add) holds one row of storage however wide it looks; a plain tensor holds all of it."""
    x = torch.randn(8, 4, requires_grad=True)
    index = torch.arange(8).unsqueeze(1).expand(8, 1024)  # looks like 8 x 1024 int64, holds 8 values
    with saved_for_backward() as saved:
        y = torch.zeros(8, 1024).scatter_add(0, index, x.repeat(1, 256))
    scatter = saved.bytes
    assert scatter == 8 * 8, scatter  # the index: 8 int64 values
    with saved_for_backward() as saved:
        (x * x).sum()
    assert saved.bytes == 8 * 4 * 4  # x, once
    with saved_for_backward() as saved:  # two views of one tensor, as [s, 1, h] and [s, h]
        ((x.view(8, 1, 4) * 2).sum() + (x.view(8, 4) * x.view(8, 4)[:, :1]).sum())
    assert saved.bytes == 8 * 4 * 4
    del y
