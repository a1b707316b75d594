"""Per-rank peak memory and wall time of one long sequence under context parallelism.

    python benchmarks/long_context_memory.py             # quick: 8k tokens, about 3-5 min on 2 CPU cores
    python benchmarks/long_context_memory.py --sweep     # 8k .. 64k tokens, the 32k targets (long)
    python benchmarks/long_context_memory.py --lengths 32768 --cp 1,2 --comm p2p,a2a --modes score
    python benchmarks/long_context_memory.py --attention-only --lengths 32768   # the attention op alone

What a user sees.  Each configuration runs on fresh gloo worker processes (the test harness),
one per CP rank, and each rank measures one sequence through ``run_sequences``:

* ``score``: forward only under ``torch.no_grad`` with the log-prob head, what
  ``megatron-rl score`` and the reference / old-policy passes run;
* ``train``: forward+backward of a log-prob + entropy loss (parameter gradients allocated
  beforehand, so they are not counted).

``peak``: the rank's peak resident memory during the run minus its peak during the same run at
64 tokens (the baseline: weights, buffers, the interpreter), in the same process -- the peak
RSS comes from the kernel (``VmHWM``, reset through ``/proc/self/clear_refs`` before each run;
elsewhere a sampling thread); glibc is told to return freed blocks of 64 KiB and more to the
system at once (``MALLOC_MMAP_THRESHOLD_``), so the RSS follows the live tensors.  On CUDA:
``max_memory_allocated`` above the same baseline.  ``sec``: wall time of the run minus the 64-token
run's.  ``saved`` (train): bytes autograd keeps for backward, parameters excluded.  ``plan``: the
memory planner's prediction of ``peak`` (:func:`megatron_rl.planner.memory.peak_bytes`).

``--attention-only`` times ``context_parallel_attention`` on one rank's shard (forward, and
forward+backward) against ``torch.nn.functional.scaled_dot_product_attention`` (causal, fused)
on the same per-rank shape in one process with the same threads, per *useful* FLOP: causal
attention over ``S`` tokens costs ``4 * heads * d * S^2 / 2`` FLOPs forward (2.5x that backward)
and a CP rank's useful share is ``1/cp`` of it, whatever its kernels compute.

Targets (checked at 32k tokens, or at the longest length run): CP=2 on 2 ranks, scoring, peak
<= 0.6x CP=1 for p2p and a2a (<= 1.0x for all_gather) and wall time <= 0.8x CP=1; CP=4 scoring
peak <= 0.4x CP=1; training peak at CP=4 <= 0.35x CP=1; with ``--attention-only``, the ring
within 1.3x of SDPA's time per useful FLOP.  CP=1 runs torch's fused SDPA.  On 2 cores, CP=4
runs 4 ranks on 2 cores: its times are reported, not judged.  On GPU, CP sizes larger than the
number of visible devices are skipped.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import threading
import time

# Long sequences on shared CPUs can keep a rank inside one collective for a while.
os.environ.setdefault("MEGATRON_RL_TEST_TIMEOUT", "3600")

import torch  # noqa: E402

MiB = 2**20
BASELINE_TOKENS = 64
MODES = ("score", "train")
QUICK_LENGTHS = (8192,)
SWEEP_LENGTHS = (8192, 16384, 32768, 65536)
TARGET_LENGTH = 32768


# ----------------------------------------------------------------------------- peak RSS


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakRss:
    """``with PeakRss() as m: ...; m.peak`` -- the process's peak RSS in bytes during the block.

    Linux: the kernel's high-water mark (``VmHWM``), reset on entry through ``clear_refs``.
    Elsewhere, or without that file: a thread sampling the RSS every millisecond."""

    def __enter__(self):
        self._thread = None
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.start = _status_kib("VmRSS") * 1024
        except OSError:
            import psutil

            proc = psutil.Process()
            self.start = self._sampled = proc.memory_info().rss
            self._stop = threading.Event()

            def sample():
                while not self._stop.is_set():
                    self._sampled = max(self._sampled, proc.memory_info().rss)
                    time.sleep(0.001)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is None:
            self.peak = _status_kib("VmHWM") * 1024
        else:
            self._stop.set()
            self._thread.join()
            self.peak = self._sampled
        return False


# ----------------------------------------------------------------------------- one rank


def _model_config(args_kw: dict):
    from megatron_rl.config.schema import ModelConfig

    return ModelConfig(
        num_layers=args_kw["layers"], hidden_size=args_kw["hidden"], ffn_hidden_size=4 * args_kw["hidden"],
        num_attention_heads=args_kw["heads"], num_query_groups=args_kw["kv_heads"], vocab_size=args_kw["vocab"],
        max_position_embeddings=max(max(args_kw["lengths"]), BASELINE_TOKENS), params_dtype=args_kw["dtype"],
        transformer_impl="local",
    )


def _device() -> torch.device:
    from megatron_rl.distributed.runtime import resolve_device

    return resolve_device()


def _layout_kw(cp: int, comm: str) -> dict:
    kw = dict(cp=cp, cp_comm_type=comm)
    if comm == "a2a+p2p":
        kw["hierarchical_cp"] = (2, cp // 2)
    return kw


def measure_rank(args_kw: dict, cp: int, comm: str, mode: str = "train", track: bool = False) -> list[dict]:
    """On one worker: build the model for this CP layout and measure each sequence length.

    Every row holds ``length``, ``local_tokens``, ``seconds``, ``cpu``, ``rss_peak`` /
    ``rss_start`` and ``base_*`` (the same at 64 tokens); on CUDA ``cuda_peak``; in ``train`` mode
    ``saved``; with ``track``, ``tensor_peak``: the live-tensor high-water mark of the run
    (``track_peak_memory``, which slows it down: the times mean little then)."""
    import contextlib

    from megatron.core import parallel_state as ps

    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.utils.memory import saved_for_backward, track_peak_memory

    layout = use_layout(**_layout_kw(cp, comm))
    device = _device()
    train = mode == "train"
    chunks = build_gpt_chunks(_model_config(args_kw), layout, device)
    params = [p for c in chunks for p in c.parameters()]
    if train:
        for p in params:
            # Gradients exist before measuring: backward accumulates into them, so the peak below
            # is activations and temporaries, not the (sequence-independent) gradient buffers.
            p.grad = torch.zeros_like(p)
    head = LogProbHead(chunk_size=args_kw["logprob_chunk"], with_entropy=True)

    def run(length: int) -> dict:
        g = torch.Generator().manual_seed(length)
        seq = {"tokens": torch.randint(0, args_kw["vocab"], (length,), generator=g), "mask": torch.ones(length)}

        def loss_fn(outs, tensors, mb):
            per_token = (outs["logprob"] + 0.01 * outs["entropy"]) * tensors["mask"]
            return -per_token.sum() / length, {}

        plan = BatchPlan(max_tokens_per_rank=None, micro_batch_size=1)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        stats: dict = {}
        saving = saved_for_backward(exclude=params) if train else contextlib.nullcontext()
        tracking = track_peak_memory() if track else contextlib.nullcontext()
        start, cpu_start = time.perf_counter(), time.process_time()
        with PeakRss() as rss, saving as saved, tracking as tensors, \
                (contextlib.nullcontext() if train else torch.no_grad()):
            run_sequences(chunks, [seq], head, plan, device, loss_fn=loss_fn if train else None,
                          forward_only=not train, stats=stats)
            if device.type == "cuda":
                torch.cuda.synchronize()
        row = {"length": length, "local_tokens": stats["local_tokens"][0], "seconds": time.perf_counter() - start,
               "cpu": time.process_time() - cpu_start, "threads": torch.get_num_threads(), "rss_peak": rss.peak,
               "rss_start": rss.start, "cp_rank": ps.get_context_parallel_rank()}
        if track:
            row["tensor_peak"] = tensors.peak
        if train:
            row["saved"] = saved.bytes
        if device.type == "cuda":
            row["cuda_peak"] = torch.cuda.max_memory_allocated() - base
        return row

    run(BASELINE_TOKENS)  # warm-up: lazily built state (thread pools, RoPE tables) joins the baseline
    results = []
    for length in args_kw["lengths"]:
        base = run(BASELINE_TOKENS)
        row = run(length)
        row.update({f"base_{k}": base[k] for k in ("seconds", "cpu", "rss_peak", "rss_start", "cuda_peak")
                    if k in base})
        results.append(row)
    return results


def measure_logprob_path(tokens: int, hidden: int, vocab: int, chunk: int, device: torch.device) -> dict:
    """Extra peak memory of chunked log-probs vs naive full logits, forward and backward (the logits
    recomputed in backward, ``batch.logprob_keep_logits_gib=0``: the bounded path long contexts take)."""
    from megatron_rl.ops.logprob import naive_logprobs, vocab_parallel_logprobs
    from megatron_rl.utils.memory import track_peak_memory

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, 1, hidden, generator=g) * 0.5).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g).to(device)

    def chunked():
        logp, ent = vocab_parallel_logprobs(h, w, labels, true_vocab_size=vocab, chunk_size=chunk,
                                            keep_logits_bytes=0)
        (logp.sum() + 0.01 * ent.sum()).backward()

    def naive():
        logp, ent = naive_logprobs(h.transpose(0, 1) @ w.t(), labels)
        (logp.sum() + 0.01 * ent.sum()).backward()

    out = {}
    for name, fn in (("chunked", chunked), ("naive", naive)):
        h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with track_peak_memory() as mem:
            fn()
        out[name] = {"peak": mem.peak, "seconds": time.perf_counter() - start}
        if device.type == "cuda":
            torch.cuda.synchronize()
            out[name]["cuda_peak"] = torch.cuda.max_memory_allocated() - base
    return out


# ----------------------------------------------------------------------------- the attention op alone


def _cp_attention_call(q, k, v, length: int, group, scale: float, comm: str):
    """``context_parallel_attention`` on one unpacked row of ``length`` tokens, with either
    signature: global offsets ``cu`` (and the hierarchical groups for a2a+p2p), or the older
    ``positions_of(rank)``."""
    from megatron.core import parallel_state as ps

    from megatron_rl.ops import cp_attention

    fn = cp_attention.context_parallel_attention
    params = list(inspect.signature(fn).parameters)
    if params[3] == "positions_of":
        from megatron_rl.ops.zigzag import local_positions_bshd

        cp = group.size()
        return fn(q, k, v, lambda rank: local_positions_bshd(length, cp, rank), group, scale, comm)
    hierarchy = tuple(ps.get_hierarchical_context_parallel_groups()) if comm == "a2a+p2p" else None
    return fn(q, k, v, (0, length), group, scale, comm, hierarchy)


def attention_rank(length: int, cp: int, comm: str, heads: int, kv_heads: int, head_dim: int, dtype: str,
                   repeats: int) -> dict:
    """Median wall and CPU seconds of the CP op (forward; forward+backward) on this rank's shard
    and of SDPA on the same shape, every rank at once and the four interleaved, so that both meet
    the same machine: ``{name: (wall, cpu)}``."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps

    from megatron_rl.testing.layouts import use_layout

    use_layout(**_layout_kw(cp, comm))
    device = _device()
    group = ps.get_context_parallel_group()
    local = length // cp
    g = torch.Generator().manual_seed(dist.get_rank())
    dt = getattr(torch, dtype)
    q = torch.randn(1, heads, local, head_dim, generator=g).to(device, dt).requires_grad_()
    k, v = (torch.randn(1, kv_heads, local, head_dim, generator=g).to(device, dt).requires_grad_() for _ in range(2))
    do = torch.randn(1, heads, local, head_dim, generator=g).to(device, dt)
    scale = head_dim**-0.5

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def cp_forward():
        with torch.no_grad():
            _cp_attention_call(q, k, v, length, group, scale, comm)
        sync()

    def cp_train():
        _cp_attention_call(q, k, v, length, group, scale, comm).backward(do)
        sync()

    def sdpa_forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=heads != kv_heads)
        sync()

    def sdpa_train():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                       enable_gqa=heads != kv_heads).backward(do)
        sync()

    calls = {"cp_forward": cp_forward, "cp_train": cp_train, "sdpa_forward": sdpa_forward,
             "sdpa_train": sdpa_train}
    times: dict = {name: [] for name in calls}
    for rep in range(repeats + 1):  # the first round warms up
        for name, fn in calls.items():
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            if rep:
                times[name].append((time.perf_counter() - start, time.process_time() - cpu))
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for name, t in times.items()}


def useful_flops(length: int, cp: int, heads: int, head_dim: int, train: bool) -> float:
    """A CP rank's share of causal attention over ``length`` tokens: ``4 h d S^2 / 2 / cp``
    forward, 3.5x that for forward+backward (backward = 2.5x forward)."""
    forward = 4 * heads * head_dim * length * length / 2 / cp
    return forward * (3.5 if train else 1.0)


# ----------------------------------------------------------------------------- driver


def _this_module():
    """This file as an importable module, so harness workers can unpickle its functions."""
    from megatron_rl.testing.harness import importable_script

    return importable_script(__file__, __spec__)


MAX_LOAD: list = [None, 0.0]  # (load average to wait for, longest wait in seconds): --max-load, --max-wait


def _wait_for_quiet() -> float:
    """Wait (up to the --max-wait) until the 1-minute load average is at most --max-load; returns
    the load average the run starts at, which the tables print: times on a shared machine vary."""
    limit, longest = MAX_LOAD
    deadline = time.monotonic() + longest
    while limit is not None and os.getloadavg()[0] > limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def _fresh_run(world: int, fn, *args):
    """``fn`` on a fresh pool of ``world`` workers (no state or heap left by an earlier run).  A
    pool whose port another process took meanwhile is started again, up to three times."""
    from megatron_rl.testing.harness import RankError, get_pool

    for attempt in range(3):
        try:
            pool = get_pool(world)
        except RankError as err:
            if "EADDRINUSE" not in str(err) or attempt == 2:
                raise
            continue
        try:
            return pool.run(fn, *args)
        finally:
            pool.close()


def _comm_ok(comm: str, cp: int, heads: int, kv_heads: int) -> str | None:
    """Why ``comm`` cannot run at this ``cp`` on this model (None when it can)."""
    if comm == "a2a+p2p" and (cp < 4 or cp % 2):
        return "a2a+p2p needs cp >= 4 (a2a pairs)"
    a2a = 2 if comm == "a2a+p2p" else cp
    if comm in ("a2a", "a2a+p2p") and (heads % a2a or (kv_heads % a2a and a2a % kv_heads)):
        return f"a2a over {a2a} ranks needs heads % {a2a} == 0 and kv_heads split or replicated"
    return None


def _planned_peak(args_kw: dict, cp: int, comm: str, mode: str, local: int, length: int) -> float | None:
    try:
        from megatron_rl.planner.memory import peak_bytes
        from megatron_rl.planner.option import PlanOption
    except ImportError:  # a planner without it (older trees)
        return None
    layout = PlanOption.of(cp=cp, cp_comm_type=comm if cp > 1 else "p2p", sequence_parallel=False)
    bytes_per = torch.empty((), dtype=_dtype(args_kw)).element_size()
    return peak_bytes(_model_config(args_kw), layout, local, bytes_per, seq_len=length, training=mode == "train",
                      chunk=args_kw["logprob_chunk"])


def _dtype(args_kw: dict) -> torch.dtype:
    return torch.bfloat16 if args_kw["dtype"] == "auto" else getattr(torch, args_kw["dtype"])


def _merge(per_rank: list[list[dict]]) -> list[dict]:
    """Per length, the worst rank: the largest peak and the longest time."""
    merged = []
    for i in range(len(per_rank[0])):
        rows = [r[i] for r in per_rank]
        out = dict(rows[0])
        for key in ("seconds", "saved", "cuda_peak"):
            if key in out:
                out[key] = max(r[key] for r in rows)
        worst = max(rows, key=lambda r: r["rss_peak"] - r["base_rss_peak"])
        out.update({k: worst[k] for k in ("rss_peak", "base_rss_peak", "rss_start", "base_rss_start")})
        out["peak"] = worst["rss_peak"] - worst["base_rss_peak"]
        if "cuda_peak" in out:
            out["peak"] = max(r["cuda_peak"] - r.get("base_cuda_peak", 0) for r in rows)
        out["sec"] = max(r["seconds"] - r["base_seconds"] for r in rows)
        # CPU seconds per thread: the wall time of an idle machine if the threads scale (it leaves
        # out waiting for a peer), which a loaded machine's wall clock no longer shows.
        out["cpu_thr"] = max((r["cpu"] - r["base_cpu"]) / r["threads"] for r in rows)
        merged.append(out)
    return merged


def _judge(verdicts: list, text: str, value: float, limit: float) -> None:
    verdicts.append((text, value, limit))


def run_model(args, args_kw: dict, me, lengths: list[int], cps: list[int], comms: list[str], modes: list[str],
              verdicts: list) -> None:
    rows: dict = {}  # (mode, cp, comm) -> per-length merged rows
    for mode in modes:
        for cp, comm in [(1, "-")] + [(cp, comm) for cp in cps if cp > 1 for comm in comms]:
            why = _comm_ok(comm, cp, args.heads, args.kv_heads) if cp > 1 else None
            if why:
                print(f"skipping {mode} cp={cp} {comm}: {why}")
                continue
            load = _wait_for_quiet()
            started = time.perf_counter()
            try:
                per_rank = _fresh_run(cp, me.measure_rank, args_kw, cp, "p2p" if comm == "-" else comm, mode)
            except Exception as err:  # noqa: BLE001 - an unavailable comm type on this tree: reported
                print(f"{mode} cp={cp} {comm}: failed: {str(err).strip().splitlines()[-1][:200]}")
                continue
            rows[(mode, cp, comm)] = merged = _merge(per_rank)
            for row in merged:
                row["load"] = load
            print(f"  measured {mode} cp={cp} {comm} in {time.perf_counter() - started:.0f} s (load {load:.1f})",
                  flush=True)

    print()
    print("per-rank memory and time of one sequence (worst rank; peak = peak RSS above the same run at "
          f"{BASELINE_TOKENS} tokens,")
    print("sec = wall time above it; cpu/thr = the rank's CPU seconds above it per thread (the wall time of")
    print("an idle machine if threads scale); saved = activations kept for backward; plan = the planner's")
    print("peak; load = the machine's 1-minute load average when the configuration started)")
    print(f"{'tokens':>7} {'mode':<6}{'cp':>3} {'comm':<11}{'local':>7}{'peak MiB':>10}{'x cp1':>7}"
          f"{'sec':>8}{'x cp1':>7}{'cpu/thr':>8}{'x cp1':>7}{'saved MiB':>11}{'plan MiB':>10}{'plan/peak':>10}"
          f"{'load':>6}")
    for i, length in enumerate(lengths):
        for mode in modes:
            base = rows.get((mode, 1, "-"))
            for (m, cp, comm), merged in rows.items():
                if m != mode:
                    continue
                r = merged[i]
                b = base[i] if base else None
                mem_x = f"{r['peak'] / b['peak']:>7.3f}" if b and b["peak"] > 0 else f"{'':>7}"
                sec_x = f"{r['sec'] / b['sec']:>7.3f}" if b and b["sec"] > 0 else f"{'':>7}"
                thr_x = f"{r['cpu_thr'] / b['cpu_thr']:>7.3f}" if b and b["cpu_thr"] > 0 else f"{'':>7}"
                saved = f"{r['saved'] / MiB:>11.1f}" if "saved" in r else f"{'':>11}"
                planned = _planned_peak(args_kw, cp, comm, mode, r["local_tokens"], length)
                plan = (f"{planned / MiB:>10.1f}{planned / r['peak']:>10.2f}" if planned and r["peak"] > 0
                        else f"{'':>20}")
                print(f"{length:>7} {mode:<6}{cp:>3} {comm:<11}{r['local_tokens']:>7}{r['peak'] / MiB:>10.1f}"
                      f"{mem_x}{r['sec']:>8.1f}{sec_x}{r['cpu_thr']:>8.1f}{thr_x}{saved}{plan}{r['load']:>6.1f}")

    at = TARGET_LENGTH if TARGET_LENGTH in lengths else lengths[-1]
    i = lengths.index(at)

    def ratio(mode, cp, comm, key):
        a, b = rows.get((mode, cp, comm)), rows.get((mode, 1, "-"))
        if not a or not b or b[i][key] <= 0:
            return None
        return a[i][key] / b[i][key]

    def loaded(mode, cp, comm):
        return any(rows[k][i]["load"] > 1.5 * (os.cpu_count() or 1) for k in ((mode, cp, comm), (mode, 1, "-"))
                   if k in rows)

    for comm in comms:
        busy = loaded("score", 2, comm)
        for text, value, limit in (
            (f"score CP=2 {comm} peak <= {'1.0' if comm == 'all_gather' else '0.6'}x CP=1",
             ratio("score", 2, comm, "peak"), 1.0 if comm == "all_gather" else 0.6),
            (f"score CP=2 {comm} {'CPU time per thread (loaded machine)' if busy else 'wall time'} <= 0.8x CP=1",
             ratio("score", 2, comm, "cpu_thr" if busy else "sec"), 0.8),
            (f"score CP=4 {comm} peak <= 0.4x CP=1", ratio("score", 4, comm, "peak"), 0.4),
            (f"train CP=4 {comm} peak <= 0.35x CP=1", ratio("train", 4, comm, "peak"), 0.35),
        ):
            if value is not None:
                _judge(verdicts, f"{text}, {at} tokens", value, limit)


def run_attention(args, me, lengths: list[int], cps: list[int], comms: list[str], verdicts: list) -> None:
    print()
    print(f"attention op alone: {args.heads} heads ({args.kv_heads} kv), head dim {args.hidden // args.heads}, "
          f"{args.attention_dtype}; median of {args.repeats}, every rank at once, CP op and SDPA interleaved;")
    print("GF/s = useful causal GFLOP/s per rank from wall time; x sdpa = time per useful FLOP over SDPA's, from")
    print("wall time and from the rank's CPU seconds (what the kernels spend: on a loaded machine the wall")
    print("clock also counts waiting for a core)")
    print(f"{'tokens':>7}{'cp':>3} {'comm':<11}{'local':>7}  {'fwd s':>7}{'GF/s':>6}{'sdpa s':>7}{'GF/s':>6}"
          f"{'x wall':>7}{'x cpu':>7}  {'f+b s':>7}{'GF/s':>6}{'sdpa s':>7}{'GF/s':>6}{'x wall':>7}{'x cpu':>7}"
          f"{'load':>6}")
    d = args.hidden // args.heads
    for length in lengths:
        for cp in cps:
            if cp == 1:
                continue
            for comm in comms:
                why = _comm_ok(comm, cp, args.heads, args.kv_heads)
                if why:
                    continue
                load = _wait_for_quiet()
                try:
                    res = _fresh_run(cp, me.attention_rank, length, cp, comm, args.heads, args.kv_heads, d,
                                     args.attention_dtype, args.repeats)
                except Exception as err:  # noqa: BLE001 - an unavailable comm type on this tree: reported
                    print(f"{length:>7}{cp:>3} {comm:<11} failed: {str(err).strip().splitlines()[-1][:160]}")
                    continue
                # The slowest rank, wall and CPU separately.
                t = {k: tuple(max(r[k][i] for r in res) for i in range(2)) for k in res[0]}
                line = f"{length:>7}{cp:>3} {comm:<11}{length // cp:>7}  "
                for phase, train in (("forward", False), ("train", True)):
                    mine = useful_flops(length, cp, args.heads, d, train)
                    sdpa = useful_flops(length // cp, 1, args.heads, d, train)
                    (w_cp, c_cp), (w_sd, c_sd) = t[f"cp_{phase}"], t[f"sdpa_{phase}"]
                    by_wall = (w_cp / mine) / (w_sd / sdpa)
                    by_cpu = (c_cp / mine) / (c_sd / sdpa)
                    line += (f"{w_cp:>7.2f}{mine / w_cp / 1e9:>6.1f}{w_sd:>7.2f}{sdpa / w_sd / 1e9:>6.1f}"
                             f"{by_wall:>7.2f}{by_cpu:>7.2f}  ")
                    if comm == "p2p" and length == lengths[-1] and cp == 2:
                        _judge(verdicts, f"ring ({phase}, CP=2, {length} tokens) CPU time per useful FLOP <= 1.3x "
                               f"SDPA's (wall: {by_wall:.2f}x)", by_cpu, 1.3)
                print(line.rstrip() + f"{load:>6.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=None, help="comma-separated lengths (default 8192; --sweep: 8k..64k)")
    parser.add_argument("--sweep", action="store_true", help=f"lengths {', '.join(map(str, SWEEP_LENGTHS))}")
    parser.add_argument("--cp", default="1,2,4", help="context-parallel sizes (1 is the baseline)")
    parser.add_argument("--comm", default="p2p,all_gather,a2a", help="CP attention strategies")
    parser.add_argument("--modes", default="score,train", help="score (forward only), train (forward+backward)")
    parser.add_argument("--attention-only", action="store_true", help="time the attention op alone, no model")
    parser.add_argument("--attention", action="store_true", help="also time the attention op alone")
    parser.add_argument("--attention-dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of the attention op")
    parser.add_argument("--max-load", type=float, default=None,
                        help="before each configuration, wait until the 1-minute load average is at most this")
    parser.add_argument("--max-wait", type=float, default=600, help="longest wait for --max-load, seconds")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--logprob-chunk", type=int, default=1024, help="tokens per chunk of the log-prob op")
    parser.add_argument("--logprob-tokens", type=int, default=0,
                        help="also compare the chunked log-prob op with naive logits at this many tokens (16384: "
                             "~10 GB for the naive side)")
    args = parser.parse_args()
    MAX_LOAD[:] = [args.max_load, args.max_wait]

    # Freed blocks of 64 KiB and more go back to the system at once, so the RSS follows the live
    # tensors (glibc reads this when a worker starts; workers start after this line).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    from megatron_rl.compat import cuda_available, quiet_optional_dependency_warnings

    quiet_optional_dependency_warnings()
    me = _this_module()
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    else:
        lengths = list(SWEEP_LENGTHS if args.sweep else QUICK_LENGTHS)
    cps = sorted({int(x) for x in args.cp.split(",")} | {1})
    comms = [c for c in args.comm.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    on_gpu = cuda_available()
    if on_gpu:
        skipped = [c for c in cps if c > torch.cuda.device_count()]
        cps = [c for c in cps if c <= torch.cuda.device_count()]
        if skipped:
            print(f"skipping cp={skipped}: only {torch.cuda.device_count()} CUDA device(s)")
    args_kw = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                   vocab=args.vocab, lengths=lengths, logprob_chunk=args.logprob_chunk,
                   dtype="auto" if on_gpu else "float32")
    device = "cuda" if on_gpu else "cpu"
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} kv), vocab "
          f"{args.vocab}, {'bf16' if on_gpu else 'fp32'} on {device}; one sequence; log-prob chunk "
          f"{args.logprob_chunk}; torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)

    verdicts: list = []
    if not args.attention_only:
        run_model(args, args_kw, me, lengths, cps, comms, modes, verdicts)
    if args.attention or args.attention_only:
        run_attention(args, me, lengths, cps, comms, verdicts)

    if args.logprob_tokens:
        lp = measure_logprob_path(args.logprob_tokens, args.hidden, args.vocab, args.logprob_chunk,
                                  torch.device(device))
        print()
        naive_logits = args.logprob_tokens * args.vocab * 4
        print(f"log-prob path at {args.logprob_tokens} tokens x {args.vocab} vocab, hidden {args.hidden}, "
              f"forward+backward (one fp32 [tokens, vocab] copy = {naive_logits / MiB:.0f} MiB):")
        for name in ("chunked", "naive"):
            extra = f", cuda {lp[name]['cuda_peak'] / MiB:.1f} MiB" if "cuda_peak" in lp[name] else ""
            print(f"  {name:<8} extra peak {lp[name]['peak'] / MiB:>9.1f} MiB{extra}  ({lp[name]['seconds']:.1f} s)")
        ratio = lp["chunked"]["peak"] / lp["naive"]["peak"]
        print(f"  ratio chunked / naive: {ratio:.4f}" + (f" (1/{1 / ratio:.0f})" if ratio < 1 else ""))
        _judge(verdicts, f"log-prob path extra memory <= 1/8 of naive at {args.logprob_tokens} tokens, "
               f"{args.vocab} vocab", ratio, 1 / 8)

    print()
    print("targets" + ("" if any(f"{TARGET_LENGTH} tokens" in v[0] for v in verdicts) or not verdicts
                       else f" (set at {TARGET_LENGTH} tokens: run --sweep or --lengths {TARGET_LENGTH})") + ":")
    for text, value, limit in verdicts:
        print(f"  {'PASS' if value <= limit else 'FAIL'}  {text}: {value:.3f} (limit {limit:.2f})")


if __name__ == "__main__":
    main()
