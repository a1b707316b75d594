"""Context parallelism computes what one process computes.

A sequence split over ``cp`` ranks (zigzag, on the host) must give the same per-token log-probs,
entropy, critic values and parameter gradients as the whole sequence on one process, on every
layout that combines CP with TP (+SP) and PP -- including sequences shorter than ``2*cp`` chunks,
which are mostly padding, and packed batches of mixed lengths.  The two CP attention strategies
(ring ``p2p`` and ``all_gather``) must agree with each other and with plain attention, and each
rank must only ever see its ``1/cp`` of the tokens.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.testing.harness import run_distributed
from tests.support.helpers import CP_LENGTHS as LENGTHS
from tests.support.helpers import CP_MODEL as MODEL
from tests.support.helpers import CP_TOL as TOL
from tests.support.helpers import (  # noqa: F401 - ActorCriticHead, build_with_value_head: tests/test_bf16.py uses them
    ActorCriticHead,
    actor_critic_step,
    build_with_value_head,
    check_against_reference,
    cp_reference,
    make_sequences,
)
from tests.support.helpers import max_diff_outputs as _max_diff_outputs
from tests.support.helpers import max_diff_tensors as _max_diff_grads


def train_body(layout_kw: dict, weights, lengths, plan_kw: dict, forward_only: bool = False):
    """One forward+backward of the actor/critic loss through ``run_sequences`` on this layout."""
    return actor_critic_step(layout_kw, weights, lengths, plan_kw, forward_only)


def reference(lengths=LENGTHS):
    """CP=1 on one process, whole sequences."""
    return cp_reference(tuple(lengths))


CP_LAYOUTS = {
    "cp2": (2, dict(cp=2)),
    "cp2_all_gather": (2, dict(cp=2, cp_comm_type="all_gather")),
    "cp4": (4, dict(cp=4)),
    "tp2_cp2_sp": (4, dict(tp=2, cp=2, sp=True)),
    "pp2_cp2": (4, dict(pp=2, cp=2)),
    "dp2_cp2": (4, dict(cp=2)),  # four ranks at cp=2: two data-parallel replicas
}


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_packed_matches_one_process(layout):
    world, layout_kw = CP_LAYOUTS[layout]
    check_against_reference(world, layout_kw, dict(micro_batch_size=3))


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_unpacked_matches_one_process(layout):
    """Padded BSHD rows: each row (not each sequence) is cut into 2*cp chunks."""
    world, layout_kw = CP_LAYOUTS[layout]
    check_against_reference(world, layout_kw, dict(micro_batch_size=2, packed=False))


# ----------------------------------------------------------------------------- against HF transformers


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random Llama (GQA) as a local HF checkpoint, with odd-length inputs and HF's log-probs."""
    import json
    import os

    from tests.support.helpers import COMMON, hf_logprobs, make_hf_model

    path = str(tmp_path_factory.mktemp("hf_cp") / "llama")
    model = make_hf_model("llama", path)
    g = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (45, 1, 2, 3, 16, 29)]
    with open(os.path.join(path, "in.jsonl"), "w") as fh:
        for ids in sequences:
            fh.write(json.dumps({"input_ids": ids}) + "\n")
    return path, [hf_logprobs(model, ids) for ids in sequences]


HF_LAYOUTS = {
    "cp2": (2, ["parallel.cp=2", "batch.micro_batch_size=3"]),
    "cp2_all_gather_unpacked": (2, ["parallel.cp=2", "parallel.cp_comm_type=all_gather", "batch.packing=false",
                                    "batch.micro_batch_size=2"]),
    "tp2_cp2_sp": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true",
                       "batch.max_tokens_per_rank=32"]),
}


@pytest.mark.parametrize("layout", list(HF_LAYOUTS))
def test_score_matches_hf_transformers(hf_llama, layout, tmp_path):
    from tests.support.helpers import scored_gap

    hf_dir, reference_logprobs = hf_llama
    world, overrides = HF_LAYOUTS[layout]
    worst = scored_gap(world, hf_dir, overrides, reference_logprobs, tmp_path)
    print(f"llama {layout}: max |logprob - HF| = {worst:.2e}")
    assert worst <= 1e-4


# ----------------------------------------------------------------------------- ring vs all_gather


# (batch, query heads, kv heads, head dim, sequence lengths); one length = an unpacked [b, n, s, d]
# batch, several = a packed THD row of those (padded) sequences.  Lengths are multiples of 16 so
# the same case splits over 2, 4 and 8 ranks; 8 heads over 2 KV heads lets a2a run at CP=8 with
# K/V heads replicated.
ATTENTION_CASES = {
    "bshd_gqa": (2, 4, 2, 8, (32,)),
    "bshd_mha": (1, 2, 2, 16, (16,)),
    "bshd_8_heads": (1, 8, 2, 8, (32,)),
    "thd_gqa": (1, 6, 2, 8, (16, 48, 16, 32)),
    "thd_mqa": (1, 4, 1, 8, (32, 16)),
}


def _attention_case(name: str, seed: int = 0):
    b, n, kv, d, lengths = ATTENTION_CASES[name]
    total = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(b, n, total, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, kv, total, d, generator=g, dtype=torch.float64) for _ in range(2))
    cu = [0]
    for n_tokens in lengths:
        cu.append(cu[-1] + n_tokens)
    return q, k, v, do, cu


def _local(x: torch.Tensor, cu: list[int], cp: int, rank: int) -> torch.Tensor:
    """This rank's zigzag shard of every sequence of a packed (or single-sequence) row, dim 2."""
    from megatron_rl.ops import zigzag

    return torch.cat([zigzag.shard(x[:, :, s:e], cp, rank, dim=2) for s, e in zip(cu[:-1], cu[1:])], dim=2)


def _reference_attention(q, k, v, cu: list[int], scale: float) -> torch.Tensor:
    """Plain float64 causal attention per sequence on the whole (unsplit) tensors."""
    out = []
    group = q.size(1) // k.size(1)
    for s, e in zip(cu[:-1], cu[1:]):
        kk = k[:, :, s:e].repeat_interleave(group, dim=1)
        vv = v[:, :, s:e].repeat_interleave(group, dim=1)
        scores = q[:, :, s:e] @ kk.transpose(-1, -2) * scale
        causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
        out.append(torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ vv)
    return torch.cat(out, dim=2)


# Every comm type on the local path, with the layout kwargs it needs at a CP size.
def _comm_layouts(cp: int) -> dict:
    layouts = {"p2p": {}, "all_gather": {}, "a2a": {}}
    if cp >= 4:
        layouts["a2a+p2p"] = dict(hierarchical_cp=[2, cp // 2])
    return layouts


def attention_body(case: str, dtype_name: str = "float64"):
    """Every comm type on this rank's shards; returns {comm: (out, dq, dk, dv)} and the reference
    (float64 causal attention of the whole tensors in one process, cut to this rank's shard)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.ops.cp_attention import context_parallel_attention
    from megatron_rl.testing.layouts import use_layout

    cp = dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    q, k, v, do, cu = _attention_case(case)
    scale = q.size(-1) ** -0.5
    rank = dist.get_rank()
    results = {}
    for comm, extra in _comm_layouts(cp).items():
        if comm.startswith("a2a") and (q.size(1) % 2 or (comm == "a2a" and q.size(1) % cp)):
            continue
        use_layout(cp=cp, cp_comm_type=comm, **extra)
        hierarchy = tuple(ps.get_hierarchical_context_parallel_groups()) if comm == "a2a+p2p" else None
        leaves = [_local(x, cu, cp, rank).to(dtype).requires_grad_() for x in (q, k, v)]
        global_cu = cu if len(cu) > 2 else (0, cu[-1])
        out = context_parallel_attention(*leaves, global_cu, ps.get_context_parallel_group(), scale, comm, hierarchy)
        out.backward(_local(do, cu, cp, rank).to(dtype))
        results[comm] = (out.detach(), *(x.grad for x in leaves))
    # The reference sees the same (rounded) inputs, so the comparison measures the kernels alone.
    full = [x.to(dtype).double().requires_grad_() for x in (q, k, v)]
    ref_out = _reference_attention(*full, cu, scale)
    ref_out.backward(do.to(dtype).double())
    results["reference"] = tuple(_local(x, cu, cp, rank) for x in (ref_out.detach(), *(f.grad for f in full)))
    return results


# float64 all the way: every strategy equals the reference to rounding.  bfloat16: outputs and
# gradients are rounded to bfloat16 (8 bits of mantissa) at the end of each kernel call and the
# merges accumulate in float32, so errors stay within ~2.5 bfloat16 ulps (2**-7 each) of the largest value.
DTYPE_TOL = {"float64": 1e-10, "bfloat16": 2e-2}


@pytest.mark.parametrize("dtype", list(DTYPE_TOL))
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_cp_attention_matches_one_process(cp, case, dtype):
    """p2p, all_gather, a2a and a2a+p2p on fused kernels: outputs and q/k/v gradients equal
    plain attention of the whole sequence in one process."""
    if dtype == "bfloat16" and cp == 8:
        pytest.skip("bfloat16 is covered at CP 2 and 4; CP 8 adds only rank count")
    names = ("out", "dq", "dk", "dv")
    ran = set()
    for rank, res in enumerate(run_distributed(cp, attention_body, case, dtype)):
        ref = res.pop("reference")
        for comm, got in res.items():
            ran.add(comm)
            for name, x, r in zip(names, got, ref):
                assert x.dtype == getattr(torch, dtype)
                err = float((x.double() - r).abs().max())
                scale = float(r.abs().max())
                print(f"cp={cp} {case} {dtype} {comm} rank {rank} {name}: max|d| {err:.1e} (|ref| {scale:.1f})")
                assert err <= DTYPE_TOL[dtype] * max(1.0, scale), (comm, name, err)
    assert {"p2p", "all_gather"} <= ran


VARLEN_CALLS: list[int] = []  # blocks per varlen forward call, in this process


def _cpu_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """flash-attention's varlen call, one CPU kernel call per block: stands in for the CUDA kernel
    so the packing around it (row gathers, offsets, merge and scatter) runs here."""
    from megatron_rl.ops.attention_kernels import attention_forward

    VARLEN_CALLS.append(len(cu_q) - 1)
    outs, lses = [], []
    for a, e, ka, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        assert e - a <= max_q and ke - ka <= max_k
        out, lse = attention_forward(*(x[None].transpose(1, 2) for x in (q[a:e], k[ka:ke], v[ka:ke])), causal, scale)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def _cpu_varlen_backward(do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    from megatron_rl.ops.attention_kernels import attention_backward

    grads = []
    for a, e, ka, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        rows = [x[None].transpose(1, 2) for x in (do[a:e], q[a:e], k[ka:ke], v[ka:ke], out[a:e])]
        grads.append([g[0].transpose(0, 1) for g in attention_backward(*rows, lse[None, :, a:e], causal, scale)])
    return tuple(torch.cat(parts) for parts in zip(*grads))


def packed_varlen_body(case: str):
    """The attention of :func:`attention_body` with the packed-blocks path switched on."""
    from megatron_rl.ops import attention_kernels

    names = ("varlen_ready", "varlen_forward", "varlen_backward")
    saved = {name: getattr(attention_kernels, name) for name in names}
    stand_ins = (lambda q: True, _cpu_varlen_forward, _cpu_varlen_backward)
    try:  # workers are reused by later tests: put the real functions back
        for name, fn in zip(names, stand_ins):
            setattr(attention_kernels, name, fn)
        VARLEN_CALLS.clear()
        return dict(attention_body(case), varlen_calls=list(VARLEN_CALLS))
    finally:
        for name, fn in saved.items():
            setattr(attention_kernels, name, fn)


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_rows_as_one_varlen_call_per_ring_step(cp):
    """On CUDA in half precision a packed row's blocks of one ring step are one variable-length
    flash call: gathered rows, block offsets, the merge and the scatter back give what the
    per-sequence calls give (here with a per-block CPU kernel in the varlen call's place; the
    CUDA kernel itself runs in the GPU check)."""
    from megatron_rl.ops.cp_attention import block_pairs, packed_blocks

    cu = (0, 16, 24, 56)
    blocks = packed_blocks(block_pairs(cu, 2, 1, 0), torch.device("cpu"))  # rank 1 against rank 0's keys
    assert blocks.q_index.tolist() == list(range(28)) and not blocks.causal
    assert blocks.k_index.tolist() == [0, 1, 2, 3, 8, 9] + list(range(12, 20))
    assert blocks.cu_q.tolist() == [0, 8, 12, 28] and blocks.cu_k.tolist() == [0, 4, 6, 14]
    per_sequence = run_distributed(cp, attention_body, "thd_gqa")
    packed = run_distributed(cp, packed_varlen_body, "thd_gqa")
    for a, b in zip(per_sequence, packed):
        # each ring step of each strategy (p2p, all_gather, a2a, ...) is one call over the 4 sequences
        calls = b.pop("varlen_calls")
        assert len(calls) >= 2 * cp and set(calls) == {4}, calls
        for comm in ("p2p", "all_gather"):
            worst = max(float((x - y).abs().max()) for x, y in zip(a[comm], b[comm]))
            ref = max(float((x - r).abs().max()) for x, r in zip(b[comm], b["reference"]))
            print(f"cp={cp} {comm}: packed vs per-sequence {worst:.1e}, vs reference {ref:.1e}")
            assert worst <= 1e-12 and ref <= 1e-10


# ----------------------------------------------------------------------------- host-side sharding


def test_zigzag_layout_by_hand():
    """Rank r keeps chunks r and 2cp-1-r; shard/unshard round-trip."""
    from megatron_rl.ops import zigzag

    x = torch.arange(16)
    assert zigzag.shard(x, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag.shard(x, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag.shard(x, 4, 1).tolist() == [2, 3, 12, 13]
    assert zigzag.shard(x, 4, 3).tolist() == [6, 7, 8, 9]
    for cp in (2, 4, 8):
        assert torch.equal(zigzag.unshard([zigzag.shard(x, cp, r) for r in range(cp)]), x)
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        zigzag.zigzag_index(10, 4, 0)


def sharding_body(layout_kw: dict, plan_kw: dict):
    """Record what reaches this rank's embedding and what ``Microbatch.to`` puts on the device."""
    from megatron.core import parallel_state as ps

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.microbatch import Microbatch
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(**layout_kw)
    chunks = build_gpt_chunks(ModelConfig(**MODEL), layout, torch.device("cpu"))
    embedded: list[torch.Tensor] = []
    moved: list[tuple[int, int, dict]] = []

    def record_embedding(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        embedded.append(ids.detach().clone())

    hooks = [c.embedding.register_forward_pre_hook(record_embedding, with_kwargs=True)
             for c in chunks if c.pre_process]
    original_to = Microbatch.to

    def recording_to(self, device, names=None):
        out = original_to(self, device, names)
        moved.append((sum(self.padded_lengths), self.cp_size, {n: t.numel() for n, t in out.items()}))
        return out

    Microbatch.to = recording_to
    try:
        with torch.no_grad():
            run_sequences(chunks, make_sequences(), LogProbHead(), BatchPlan(**plan_kw), torch.device("cpu"))
    finally:
        Microbatch.to = original_to
        for h in hooks:
            h.remove()
    return {"embedded": embedded, "moved": moved, "cp_rank": ps.get_context_parallel_rank(),
            "first_stage": any(c.pre_process for c in chunks)}


@pytest.mark.parametrize("world,layout_kw", [(2, dict(cp=2)), (4, dict(cp=4)), (4, dict(tp=2, cp=2, sp=True)),
                                             (4, dict(pp=2, cp=2))], ids=["cp2", "cp4", "tp2_cp2_sp", "pp2_cp2"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_each_rank_receives_one_cp_th_of_the_tokens(world, layout_kw, packed):
    from megatron_rl.data.batching import plan_microbatches
    from megatron_rl.data.microbatch import align_to, alignment
    from megatron_rl.ops import zigzag

    cp, tp = layout_kw["cp"], layout_kw.get("tp", 1)
    align = alignment(cp, tp, layout_kw.get("sp", False))
    plan_kw = dict(micro_batch_size=3, packed=packed)
    seqs = make_sequences()
    results = run_distributed(world, sharding_body, layout_kw, plan_kw)
    groups = plan_microbatches(LENGTHS, range(len(LENGTHS)), max_tokens_per_rank=None, micro_batch_size=3,
                               cp=cp, align=align, packed=packed)
    if packed:
        padded_total = sum(align_to(n, align) for n in LENGTHS)
    else:  # each row is padded to the longest sequence of its micro-batch
        padded_total = sum(align_to(max(LENGTHS[i] for i in g), align) * len(g) for g in groups)
    for res in results:
        # Every tensor a rank moves to its device is its shard: 1/cp of the micro-batch's padded tokens.
        assert res["moved"]
        for mb_padded, mb_cp, sizes in res["moved"]:
            assert mb_cp == cp
            assert set(sizes.values()) == {mb_padded // cp}, sizes
        if not res["first_stage"]:
            assert not res["embedded"]
            continue
        seen = sum(t.numel() for t in res["embedded"])
        assert seen * cp == padded_total, (seen, padded_total)
        # ... and exactly the zigzag chunks r and 2cp-1-r of each (padded) sequence.
        if packed:
            tokens = torch.cat([t.reshape(-1) for t in res["embedded"]])
            order = [i for g in groups for i in g]
            expected = torch.cat([zigzag.shard(_pad(seqs[i]["tokens"], align_to(LENGTHS[i], align)), cp,
                                               res["cp_rank"]) for i in order])
            assert torch.equal(tokens, expected)


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(n - x.numel())])


# ----------------------------------------------------------------------------- token budgets


BUDGET_PLANS = [dict(max_tokens_per_rank=16), dict(max_tokens_per_rank=24), dict(max_tokens_per_rank=40),
                dict(max_tokens_per_rank=4096), dict(micro_batch_size=1), dict(micro_batch_size=7)]


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "dp2_cp2"])
def test_token_budget_does_not_change_logprobs_or_gradients(world):
    ref = reference()
    counts = []
    for plan_kw in BUDGET_PLANS:
        results = run_distributed(world, train_body, dict(cp=2), ref["weights"], LENGTHS, plan_kw)
        got = results[0]
        outs = _max_diff_outputs(got["outs"], ref["outs"])
        grad = _max_diff_grads(got["grads"], ref["grads"])
        assert all(v <= TOL for v in outs.values()) and grad <= TOL, (plan_kw, outs, grad)
        budget = plan_kw.get("max_tokens_per_rank")
        local = [got["local_tokens"]] + results[1:]
        if budget:
            assert all(n <= budget for per_rank in local for n in per_rank), (plan_kw, local)
        counts.append(len(got["local_tokens"]))
    print(f"micro-batches per rank for {BUDGET_PLANS}: {counts}")
    assert len(set(counts)) > 2  # the plans really cut the batch differently


def test_sequences_up_to_budget_times_cp_fit():
    """At cp=2 a 16-token budget takes a 32-token sequence: each rank holds 16 of its tokens."""
    lengths = (32, 3, 17, 32)
    ref = reference(lengths)
    results = run_distributed(2, train_body, dict(cp=2), ref["weights"], lengths, dict(max_tokens_per_rank=16))
    got = results[0]
    assert max(got["local_tokens"]) == 16 and max(results[1]) == 16
    assert all(v <= TOL for v in _max_diff_outputs(got["outs"], ref["outs"]).values())
    assert _max_diff_grads(got["grads"], ref["grads"]) <= TOL


def over_budget_body(lengths, budget):
    from megatron_rl.errors import DataError

    try:
        train_body(dict(cp=2), None, lengths, dict(max_tokens_per_rank=budget), forward_only=True)
    except DataError as err:
        return str(err)
    return None


def test_sequence_longer_than_budget_times_cp_is_a_data_error():
    messages = run_distributed(2, over_budget_body, (5, 33), 16)
    for message in messages:
        assert message is not None
        assert message.startswith("data error: batch.max_tokens_per_rank=16:"), message
        assert "33 tokens" in message and "cp=2" in message
        assert "raise batch.max_tokens_per_rank to >= 18" in message
