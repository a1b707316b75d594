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


def _sync_counter(functions=SYNC_FUNCTIONS):
    """A context manager counting value reads (the Python-level ``functions`` and the operators of
    ``SYNC_OPS``) by (kind, name, first megatron frame)."""
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
            if name in functions:
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


def update_pass_body(num_seqs: int):
    """Counts during the actor update's pass over one micro-batch of ``num_seqs`` sequences: the
    trainer's data path (``run_sequences``) with the PPO loss, forward and backward, outputs collected."""
    import torch

    from megatron_rl.config.schema import AlgorithmConfig, ModelConfig
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.trainer.update import actor_loss_fn

    layout = use_layout()
    model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                        num_query_groups=2, vocab_size=100, params_dtype="float32")
    chunk = build_gpt_chunks(model, layout, torch.device("cpu"))[0]
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(num_seqs):
        n = 6 + i % 5
        mask = torch.zeros(n)
        mask[2 : n - 1] = 1.0
        seqs.append({"tokens": torch.randint(0, 100, (n,), generator=g), "loss_mask": mask,
                     "advantages": torch.randn(n, generator=g) * mask,
                     "old_logprob": -torch.rand(n, generator=g) * mask})
    lengths = [int(s["loss_mask"].sum()) for s in seqs]
    loss_fn = actor_loss_fn(AlgorithmConfig(), float(sum(lengths)), lengths, 0.0)
    plan = BatchPlan(max_tokens_per_rank=1024, micro_batch_size=None, packed=True)
    with _sync_counter(SYNC_FUNCTIONS + ("cpu",))() as counts:  # a copy to the host waits like a read
        outs, _ = run_sequences([chunk], seqs, LogProbHead(with_entropy=False), plan, torch.device("cpu"),
                                loss_fn=loss_fn, forward_only=False)
    assert len(outs) == num_seqs
    return dict(counts)


def test_the_update_reads_back_once_per_micro_batch_not_once_per_sequence():
    """On a GPU each copy to the host waits for the device.  A micro-batch's per-token outputs came
    back one sequence at a time (``.cpu()`` per sequence, 64 waits for a micro-batch of 64); now one
    copy per output per micro-batch, whatever its number of sequences."""
    four, twelve = (run_distributed(1, update_pass_body, n)[0] for n in (4, 12))
    for key in sorted(set(four) | set(twelve)):
        print(f"  {key}: 4 sequences {four.get(key, 0)}, 12 sequences {twelve.get(key, 0)}")
    assert _total(four) == _total(twelve), (_total(four), _total(twelve))
