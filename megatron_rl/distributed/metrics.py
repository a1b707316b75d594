"""Reduce per-micro-batch ``(sum, count)`` logs to job-wide means on every rank."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from megatron.core import parallel_state as ps

from megatron_rl.distributed import collectives


def reduce_sum_count(logs: Iterable[Mapping[str, torch.Tensor]], names: Iterable[str]) -> dict[str, float]:
    """``logs``: what loss functions returned on this rank, each ``name -> tensor([sum, count])``.

    Tensor-parallel ranks hold identical copies, so only TP rank 0 contributes; data- and
    context-parallel ranks hold disjoint parts and all contribute.  Returns ``sum / count``.
    """
    names = list(names)
    totals = torch.zeros(len(names), 2, dtype=torch.float64)
    if ps.get_tensor_model_parallel_rank() == 0:
        for log in logs:
            for i, name in enumerate(names):
                if name in log:
                    totals[i] += log[name].detach().double().cpu().reshape(2)
    totals = collectives.all_reduce(totals)
    return {n: float(totals[i, 0] / totals[i, 1]) if totals[i, 1] > 0 else float("nan") for i, n in enumerate(names)}


def reduce_sums(logs: Iterable[Mapping[str, torch.Tensor]], names: Iterable[str]) -> dict[str, float]:
    """Job-wide sums of scalar logs (e.g. loss pieces already divided by a global denominator)."""
    names = list(names)
    totals = torch.zeros(len(names), dtype=torch.float64)
    if ps.get_tensor_model_parallel_rank() == 0:
        for log in logs:
            for i, name in enumerate(names):
                if name in log:
                    totals[i] += float(log[name].detach().double().sum())
    totals = collectives.all_reduce(totals)
    return {n: float(totals[i]) for i, n in enumerate(names)}
