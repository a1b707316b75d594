"""No host syncs in the hot path: the forward+backward of a packed CP2 micro-batch asks the device
for a value (``item``, ``tolist``, ``__bool__``, ``nonzero``...) a fixed number of times per
micro-batch, never once per layer.

On a GPU each such call waits for the device; on CPU they cost nothing, so the test counts them:
Python-level calls through a ``TorchFunctionMode`` and the operators that read a tensor's value
back (``aten._local_scalar_dense``, ``aten.nonzero``...) through a ``TorchDispatchMode``.  The
counts must be the same for 2 and 4 layers.
"""

from __future__ import annotations

import pytest

from megatron_rl.testing.harness import run_distributed

# Python-level reads of a tensor's value, and the operators they (and boolean indexing) end in.
SYNC_FUNCTIONS = ("item", "tolist", "__bool__", "nonzero", "__int__", "__float__", "__index__", "argwhere")
SYNC_OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "masked_select", "equal")
LENGTHS = (13, 1, 30, 7)


def _sync_counter():
    """A context manager counting value reads by (kind, name, first megatron frame)."""
    import collections
    import contextlib
    import sys

    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter = collections.Counter()

    def where() -> str:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            ours = "megatron_rl" in name or "megatron/core" in name
            if ours and not name.endswith(("test_host_syncs.py", "compat/cpu.py")):
                return f"{name.split('site-packages/')[-1].split('main/')[-1]}:{frame.f_lineno}"
            frame = frame.f_back
        return "?"

    class Functions(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in SYNC_FUNCTIONS:
                counts[("function", name, where())] += 1
            return func(*args, **(kwargs or {}))

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in SYNC_OPS:
                counts[("op", name, where())] += 1
            return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting():
        with Functions(), Ops():
            yield counts

    return counting


def count_body(num_layers: int, packed: bool = True):
    """Counts during one forward+backward of this rank's CP2 shard of a micro-batch."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.microbatch import alignment, build_microbatch
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(cp=2)
    model = ModelConfig(num_layers=num_layers, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                        num_query_groups=2, vocab_size=100, params_dtype="float32")
    chunk = build_gpt_chunks(model, layout, torch.device("cpu"))[0]
    g = torch.Generator().manual_seed(0)
    seqs = [{"tokens": torch.randint(0, 100, (n,), generator=g)} for n in LENGTHS]
    mb = build_microbatch(seqs, list(range(len(seqs))), cp_size=2, cp_rank=ps.get_context_parallel_rank(),
                          align=alignment(2, 1, False), packed=packed)
    device = torch.device("cpu")
    with _sync_counter()() as counts:
        inputs = mb.to(device, ["tokens", "position_ids"])
        params = mb.packed_seq_params(device)
        hidden = chunk(inputs["tokens"], inputs["position_ids"], None, packed_seq_params=params)
        out = LogProbHead(chunk_size=16)(chunk, hidden, mb.to(device, ["labels"]))
        (out["logprob"].sum() + out["entropy"].sum()).backward()
    assert all(p.grad is not None and float(p.grad.abs().max()) > 0 for p in chunk.parameters())
    return dict(counts)


def _total(counts: dict) -> dict:
    totals: dict = {}
    for (kind, name, _), n in counts.items():
        totals[(kind, name)] = totals.get((kind, name), 0) + n
    return totals


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_value_reads_do_not_grow_with_the_number_of_layers(packed):
    two = run_distributed(2, count_body, 2, packed)
    four = run_distributed(2, count_body, 4, packed)
    for rank, (a, b) in enumerate(zip(two, four)):
        print(f"rank {rank} {'packed' if packed else 'unpacked'}: 2 layers {sum(a.values())} reads, "
              f"4 layers {sum(b.values())} reads")
        for key in sorted(set(a) | set(b)):
            print(f"  {key}: 2 layers {a.get(key, 0)}, 4 layers {b.get(key, 0)}")
        assert _total(a) == _total(b), (_total(a), _total(b))
