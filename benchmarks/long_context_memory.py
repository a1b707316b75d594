"""Per-rank activation memory of one long sequence under context parallelism, and of the log-prob path.

    python benchmarks/long_context_memory.py

runs in about three minutes on 2 CPU cores (2 layers, hidden 256, 4 heads, vocab 32000; one
sequence of 2k and 4k tokens; CP = 1, 2, 4 with the ``p2p`` ring and ``all_gather`` attention;
log-prob path vs naive full logits at 16k tokens, which briefly needs ~10 GB of host memory for
the naive side).  To go bigger:

    python benchmarks/long_context_memory.py --max-len 8192 --logprob-tokens 0   # ~4 min on 2 cores
    python benchmarks/long_context_memory.py --max-len 32768            # 2k .. 32k tokens, see below
    python benchmarks/long_context_memory.py --lengths 16384 --cp 1,4 --comm p2p
    python benchmarks/long_context_memory.py --layers 4 --hidden 512 --heads 8 --kv-heads 2

Why these numbers: context parallelism is the knob that makes a sequence fit that does not fit
one device, and it only helps if every sequence-proportional tensor a rank keeps shrinks by
``1/cp``.  Each CP configuration runs on its own group of gloo worker processes (the test
harness); each rank measures, for one forward+backward of one sequence through
``run_sequences`` with a log-prob loss:

* ``saved``: bytes autograd keeps for backward (``saved_for_backward``), parameters excluded --
  the activation memory that grows with sequence length;
* ``peak``: the high-water mark of tensors created during forward+backward
  (``track_peak_memory``), which adds transient buffers (attention score blocks, log-prob
  chunks, gradient temporaries) to the saved activations; parameter gradients are allocated
  beforehand so they are not counted;
* on CUDA, also ``torch.cuda.max_memory_allocated`` over the same window.

The log-prob comparison measures, on one process, the peak memory that the chunked
vocab-parallel log-prob/entropy op adds on top of the hidden states versus the naive
``log_softmax(h @ W.T)`` in fp32, forward and backward.  Targets checked at the end, on the
activation memory (``saved``) at the longest length: CP=4 per rank <= 0.3x CP=1 (best strategy);
ring (p2p) at CP=4 <= 0.35x CP=1 (all_gather is reported too); log-prob path extra memory <= 1/8
of naive at 16k tokens with a 32k vocabulary.  Peak ratios are printed, not judged: they include
per-rank transients that do not shrink with CP (see the note the script prints).
On GPU, CP sizes larger than the number of visible devices are skipped.  The local ring tiles
its queries so that one transient score block stays under 64 MiB at any length.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

# Long sequences on shared CPUs can keep a rank inside one collective for a while.
os.environ.setdefault("MEGATRON_RL_TEST_TIMEOUT", "3600")

import torch  # noqa: E402

MiB = 2**20


def _model_config(args_kw: dict):
    from megatron_rl.config.schema import ModelConfig

    return ModelConfig(
        num_layers=args_kw["layers"], hidden_size=args_kw["hidden"], ffn_hidden_size=4 * args_kw["hidden"],
        num_attention_heads=args_kw["heads"], num_query_groups=args_kw["kv_heads"], vocab_size=args_kw["vocab"],
        max_position_embeddings=max(args_kw["lengths"]), params_dtype=args_kw["dtype"],
        transformer_impl="local",
    )


def _device() -> torch.device:
    from megatron_rl.distributed.runtime import resolve_device

    return resolve_device()


def measure_rank(args_kw: dict, cp: int, comm: str) -> list[dict]:
    """On one worker: build the model for this CP layout and measure each sequence length."""
    from megatron.core import parallel_state as ps

    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.utils.memory import saved_for_backward, track_peak_memory

    layout = use_layout(cp=cp, cp_comm_type=comm)
    device = _device()
    chunks = build_gpt_chunks(_model_config(args_kw), layout, device)
    params = [p for c in chunks for p in c.parameters()]
    for p in params:
        # Gradients exist before measuring: backward accumulates into them, so the peak below
        # is activations and temporaries, not the (sequence-independent) gradient buffers.
        p.grad = torch.zeros_like(p)
    param_storages = {p.untyped_storage().data_ptr(): p.element_size() for p in params}
    head = LogProbHead(chunk_size=args_kw["logprob_chunk"], with_entropy=True)
    results = []
    for length in args_kw["lengths"]:
        g = torch.Generator().manual_seed(length)
        seq = {"tokens": torch.randint(0, args_kw["vocab"], (length,), generator=g), "mask": torch.ones(length)}

        def loss_fn(outs, tensors, mb, length=length):
            per_token = (outs["logprob"] + 0.01 * outs["entropy"]) * tensors["mask"]
            return -per_token.sum() / length, {}

        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        stats: dict = {}
        with saved_for_backward() as saved, track_peak_memory() as mem:
            run_sequences(chunks, [seq], head, BatchPlan(max_tokens_per_rank=None, micro_batch_size=1), device,
                          loss_fn=loss_fn, forward_only=False, stats=stats)
        seconds = time.perf_counter() - start
        # saved_for_backward counts weights that layers keep for their backward too; drop them.
        param_bytes = sum(_numel(shape) * param_storages[ptr] for ptr, _, shape in saved._seen
                          if ptr in param_storages)
        row = {"length": length, "local_tokens": stats["local_tokens"][0], "saved": saved.bytes - param_bytes,
               "peak": mem.peak, "seconds": seconds, "cp_rank": ps.get_context_parallel_rank()}
        if device.type == "cuda":
            torch.cuda.synchronize()
            row["cuda_peak"] = torch.cuda.max_memory_allocated() - base
        results.append(row)
    return results


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def measure_logprob_path(tokens: int, hidden: int, vocab: int, chunk: int, device: torch.device) -> dict:
    """Extra peak memory of chunked log-probs vs naive full logits, forward and backward."""
    from megatron_rl.ops.logprob import naive_logprobs, vocab_parallel_logprobs
    from megatron_rl.utils.memory import track_peak_memory

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, 1, hidden, generator=g) * 0.5).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).to(device).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g).to(device)

    def chunked():
        logp, ent = vocab_parallel_logprobs(h, w, labels, true_vocab_size=vocab, chunk_size=chunk)
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


def _this_module():
    """This file as an importable module, so harness workers can unpickle its functions."""
    if __spec__ is not None and __spec__.name != "__main__":
        return importlib.import_module(__spec__.name)
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(os.path.splitext(os.path.basename(__file__))[0])


def _lengths(args) -> list[int]:
    if args.lengths:
        return [int(x) for x in args.lengths.split(",")]
    out, n = [], args.min_len
    while n <= args.max_len:
        out.append(n)
        n *= 2
    return out


def _fmt_mib(x: float) -> str:
    return f"{x / MiB:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-len", type=int, default=2048)
    parser.add_argument("--max-len", type=int, default=4096, help="lengths double from --min-len up to this")
    parser.add_argument("--lengths", default=None, help="comma-separated lengths (overrides min/max)")
    parser.add_argument("--cp", default="1,2,4", help="context-parallel sizes (1 is the baseline)")
    parser.add_argument("--comm", default="p2p,all_gather", help="CP attention strategies")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--logprob-chunk", type=int, default=1024, help="tokens per chunk of the log-prob op")
    parser.add_argument("--logprob-tokens", type=int, default=16384, help="tokens of the log-prob comparison; 0 = skip")
    args = parser.parse_args()

    from megatron_rl.compat import cuda_available, quiet_optional_dependency_warnings

    quiet_optional_dependency_warnings()
    from megatron_rl.testing.harness import run_distributed

    me = _this_module()
    lengths = _lengths(args)
    cps = sorted({int(x) for x in args.cp.split(",")} | {1})
    comms = [c for c in args.comm.split(",") if c]
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
          f"{args.vocab}, {'bf16' if on_gpu else 'fp32'} on {device}; one sequence per forward+backward; "
          f"log-prob chunk {args.logprob_chunk}; torch {torch.__version__}, {os.cpu_count()} CPUs")

    rows = {}  # (cp, comm) -> per-length dict, the max over ranks
    configs = [(1, "-")] + [(cp, comm) for cp in cps if cp > 1 for comm in comms]
    for cp, comm in configs:
        per_rank = run_distributed(cp, me.measure_rank, args_kw, cp, "p2p" if comm == "-" else comm)
        merged = []
        for i in range(len(lengths)):
            entries = [r[i] for r in per_rank]
            merged.append({k: max(e[k] for e in entries) for k in entries[0] if k != "cp_rank"})
        rows[(cp, comm)] = merged

    cuda_col = on_gpu
    header = (f"{'tokens':>7} {'cp':>3} {'comm':<11}{'local':>7}{'saved MiB':>11}{'x cp1':>7}"
              f"{'peak MiB':>10}{'x cp1':>7}" + (f"{'cuda MiB':>10}{'x cp1':>7}" if cuda_col else "") + f"{'sec':>7}")
    print()
    print("per-rank memory of one forward+backward (max over ranks; saved = activations kept for backward,")
    print("parameters excluded; peak = high-water mark of tensors created during forward+backward)")
    print(header)
    for i, length in enumerate(lengths):
        base = rows[(1, "-")][i]
        for (cp, comm), merged in rows.items():
            r = merged[i]
            line = (f"{length:>7} {cp:>3} {comm:<11}{r['local_tokens']:>7}{_fmt_mib(r['saved']):>11}"
                    f"{r['saved'] / base['saved']:>7.3f}{_fmt_mib(r['peak']):>10}{r['peak'] / base['peak']:>7.3f}")
            if cuda_col:
                line += f"{_fmt_mib(r['cuda_peak']):>10}{r['cuda_peak'] / base['cuda_peak']:>7.3f}"
            print(line + f"{r['seconds']:>7.1f}")

    verdicts = []
    longest = len(lengths) - 1
    base = rows[(1, "-")][longest]
    if 4 in cps:
        print()
        print(f"at {lengths[longest]} tokens, CP=4 vs CP=1 per rank:")
        best = None
        for comm in comms:
            r = rows[(4, comm)][longest]
            saved_ratio, peak_ratio = r["saved"] / base["saved"], r["peak"] / base["peak"]
            print(f"  {comm:<11} activations (saved) {saved_ratio:.3f}x, peak {peak_ratio:.3f}x")
            best = saved_ratio if best is None else min(best, saved_ratio)
            if comm == "p2p":
                verdicts.append(("ring (p2p) CP=4 activation memory per rank <= 0.35x CP=1", saved_ratio, 0.35))
            else:
                verdicts.append((f"{comm} CP=4 activation memory per rank <= 0.35x CP=1 (reported)", saved_ratio, 0.35))
        verdicts.insert(0, ("CP=4 activation memory per rank <= 0.3x CP=1", best, 0.3))
        from megatron_rl.ops import cp_attention

        chunk_bytes = 2 * args.logprob_chunk * args.vocab * 4
        block_bytes = min(args.heads * (lengths[longest] // 4) ** 2, cp_attention._MAX_BLOCK_ELEMENTS) * 4
        print(f"  peak also holds per-rank transients that do not shrink with CP: two fp32 [chunk, vocab] "
              f"buffers of the log-prob op ({chunk_bytes / MiB:.0f} MiB here) and, for p2p, the fp32 "
              f"score block of one query tile in a ring step ({block_bytes / MiB:.0f} MiB per copy here, "
              f"capped at {cp_attention._MAX_BLOCK_ELEMENTS * 4 / MiB:.0f} MiB)")

    if args.logprob_tokens:
        lp = measure_logprob_path(args.logprob_tokens, args.hidden, args.vocab, args.logprob_chunk,
                                  torch.device(device))
        print()
        naive_logits = args.logprob_tokens * args.vocab * 4
        print(f"log-prob path at {args.logprob_tokens} tokens x {args.vocab} vocab, hidden {args.hidden}, "
              f"forward+backward (one fp32 [tokens, vocab] copy = {naive_logits / MiB:.0f} MiB):")
        for name in ("chunked", "naive"):
            extra = f", cuda {_fmt_mib(lp[name]['cuda_peak'])} MiB" if "cuda_peak" in lp[name] else ""
            print(f"  {name:<8} extra peak {_fmt_mib(lp[name]['peak']):>9} MiB{extra}  ({lp[name]['seconds']:.1f} s)")
        ratio = lp["chunked"]["peak"] / lp["naive"]["peak"]
        print(f"  ratio chunked / naive: {ratio:.4f}" + (f" (1/{1 / ratio:.0f})" if ratio < 1 else ""))
        verdicts.append((f"log-prob path extra memory <= 1/8 of naive at {args.logprob_tokens} tokens, "
                         f"{args.vocab} vocab", ratio, 1 / 8))

    print()
    print("targets:")
    for text, value, limit in verdicts:
        print(f"  [{'met' if value <= limit else 'NOT met'}] {text}: {value:.3f} (limit {limit:.3f})")


if __name__ == "__main__":
    main()
