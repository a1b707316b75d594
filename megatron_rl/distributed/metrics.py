"""Reduce per-micro-batch ``(sum, count)`` logs to job-wide means on every rank."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from megatron_rl.distributed import collectives
from megatron_rl.distributed.runtime import active_groups


def _to_host(logs: Iterable[Mapping[str, torch.Tensor]], names: list[str], width: int) -> tuple[list, torch.Tensor]:
    """The name index of every log's named entries, and their values as ``[entries, width]`` float64
    (``width`` 1: each entry summed), brought to the host in one copy (one wait for the device, not
    one per entry)."""
    where, values = [], []
    for log in logs:
        for i, name in enumerate(names):
            if name in log:
                where.append(i)
                values.append(log[name].detach().reshape(-1).double().sum(0, keepdim=True) if width == 1
                              else log[name].detach().double().reshape(width))
    if not values:
        return where, torch.zeros(0, width, dtype=torch.float64)
    return where, torch.stack(values).cpu()


def reduce_sum_count(logs: Iterable[Mapping[str, torch.Tensor]], names: Iterable[str]) -> dict[str, float]:
    """``logs``: what loss functions returned on this rank, each ``name -> tensor([sum, count])``.

    Tensor-parallel ranks hold identical copies, so only TP rank 0 contributes; data- and
    context-parallel ranks hold disjoint parts and all contribute.  Returns ``sum / count``.
    """
    names = list(names)
    totals = torch.zeros(len(names), 2, dtype=torch.float64)
    if active_groups().tp.rank() == 0:
        where, values = _to_host(logs, names, 2)
        for i, value in zip(where, values):  # host tensors: in order, as before
            totals[i] += value
    totals = collectives.all_reduce(totals)
    return {n: float(totals[i, 0] / totals[i, 1]) if totals[i, 1] > 0 else float("nan") for i, n in enumerate(names)}


def reduce_sums(logs: Iterable[Mapping[str, torch.Tensor]], names: Iterable[str]) -> dict[str, float]:
    """Job-wide sums of scalar logs (e.g. loss pieces already divided by a global denominator)."""
    names = list(names)
    totals = torch.zeros(len(names), dtype=torch.float64)
    if active_groups().tp.rank() == 0:
        where, values = _to_host(logs, names, 1)
        for i, value in zip(where, values):
            totals[i] += float(value[0])
    totals = collectives.all_reduce(totals)
    return {n: float(totals[i]) for i, n in enumerate(names)}
