"""Measure tensor memory on any device, CPU included.

CUDA has allocator statistics; the CPU does not.  :class:`TensorMemoryTracker` is a
``TorchDispatchMode`` that sees every tensor an operator creates, counts the bytes of each new
storage while any tensor still refers to it, and records the peak -- the live-tensor high-water
mark of the code inside the ``with`` block (tensors that existed before are not counted).
:func:`saved_for_backward_bytes` counts what autograd keeps for the backward pass.  Both are
what the memory benchmarks, the memory planner checks and the log-prob op tests report.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._refs: dict[int, list] = {}  # storage key -> [nbytes, live tensor count]

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                if id(t.untyped_storage()) in inputs and t.untyped_storage().data_ptr() not in self._refs:
                    continue  # a view or in-place result on a tensor from before the block
                self._track(t)
        return out


@contextlib.contextmanager
def track_peak_memory():
    """``with track_peak_memory() as mem: ...; mem.peak`` -- peak bytes of new live tensors."""
    tracker = TensorMemoryTracker()
    with tracker:
        yield tracker


def held_bytes(t: torch.Tensor) -> int:
    """Bytes of storage ``t`` spans: its shape's for a dense tensor, far less for an expanded view
    (stride 0 repeats the same elements: an index expanded to the hidden size holds one column)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 1)
    return min(span, t.numel()) * t.element_size()


def _add_interval(intervals: list, start: int, end: int) -> int:
    """Add ``[start, end)`` to ``intervals`` (disjoint, unsorted); return the bytes not yet in them."""
    new = end - start
    for a, b in intervals:
        new -= max(0, min(b, end) - max(a, start))
    intervals.append((start, end))
    # Overlaps among earlier intervals were subtracted once each: merge to keep them disjoint.
    intervals.sort()
    merged = [intervals[0]]
    for a, b in intervals[1:]:
        if a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    intervals[:] = merged
    return max(new, 0)


@contextlib.contextmanager
def saved_for_backward(exclude=()):
    """``with saved_for_backward() as saved: loss = f(x)`` -- ``saved.bytes`` kept for backward:
    the storage each saved tensor spans, counted once, leaving out the storages of the tensors
    in ``exclude`` (a model's parameters, which layers also keep for their backward).

    Only the forward's saves count: a function that recomputes in its backward (checkpointing,
    all_gather CP attention) saves tensors there that live for that one step; they show in the
    peak, not here."""
    skipped = {t.untyped_storage().data_ptr() for t in exclude}

    class Saved:
        bytes = 0
        _held: dict = {}  # storage -> byte intervals already counted (views of one tensor count once)

    in_backward = getattr(torch._C, "_current_graph_task_id", lambda: -1)

    def pack(t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if in_backward() != -1 or ptr in skipped:
            return t
        start = t.storage_offset() * t.element_size()
        Saved.bytes += _add_interval(Saved._held.setdefault(ptr, []), start, start + held_bytes(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield Saved
