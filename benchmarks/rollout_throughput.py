"""Rollout throughput and KV-cache sizing: megatron's engine batching statically and dynamically, HF ``generate``.

The same random model and prompts, on the CPU, one fresh process per engine and workload:

* ``static``   -- megatron-core's static-batching inference (``rollout.batching=static``, the CPU
                  default): chunks of ``--batch`` rows, each chunk's KV cache preallocated for its
                  longest prompt + ``max_new_tokens``, a group's prompt prefilled once; once half
                  of a chunk has stopped, the finished rows are dropped;
* ``dynamic``  -- megatron-core's dynamic inference engine (``rollout.batching=dynamic``: paged KV
                  cache, continuous batching of ``--batch`` requests, chunked prefill), through
                  the CPU shims of ``megatron_rl/compat/inference_cpu.py``;
* ``hf``       -- Hugging Face ``generate`` on the same weights (a ``LlamaForCausalLM``): batches of
                  ``--batch`` left-padded rows, a cache that grows by one token per step for every
                  row until the batch's last row stops.

Three workloads:

* ``uniform``  -- no stop ids: every sample runs to ``--uniform-max-new`` tokens;
* ``longtail`` -- ``--stop-ids`` of the vocabulary's ids end a response: with near-uniform
                  next-token distributions the lengths are geometric (mean about vocab / stop
                  ids), capped at ``--max-new``, so a few samples run many times longer than the
                  median -- the tail a static batch waits for;
* ``prefix``   -- GRPO groups: ``--prefix-prompts`` prompts of ``--prefix-len`` tokens, ``--prefix-n``
                  samples each, ``--prefix-max-new`` new tokens each, megatron only, with
                  ``rollout.prefix_caching`` off and on (runs interleaved).  It also reports the
                  prompt tokens the forwards computed: with caching a prompt is prefilled once
                  and each other sample computes the tokens after its last whole page (>= 2:
                  a prompt ending on a page boundary recomputes its last page).

The dynamic engine's cache is ``--uniform-kv-fraction`` / ``--kv-fraction`` of the planner's budget for
``--batch`` whole sequences of the longest prompt + ``max_new_tokens`` in pages of
``--kv-block-tokens`` (:func:`megatron_rl.planner.memory.engine_kv_cache_bytes`): all of it for
the uniform workload, 0.3 of it for the long tail, whose requests mostly end early.

Prompts are 16..96 tokens.  Throughput is tokens per CPU-second of the generating process (one
thread; the figure to compare on a shared machine), the wall-clock rate beside it.

KV cache, per engine: *allocated* is the most cache memory it holds at once (dynamic: its whole
paged buffer, ``rollout.kv_cache_memory``; static: the largest chunk's preallocation; HF:
the largest batch's grown cache, batch x (longest prompt + longest response)).  *Needed* is the
KV of the tokens actually live at the busiest step of that engine's own run: the sum, over the
sequences in flight that have not finished, of (prompt + tokens so far), times the per-token KV
bytes (2 x layers x KV heads x head dim x dtype bytes).  ``allocated / needed`` is then the
overhead of the engine's allocation policy (1.0: nothing held for finished or not-yet-written
tokens).

Targets (PASS/FAIL printed for each, per batching): long tail >= 1.5x HF ``generate``'s tokens per
CPU-second; uniform >= 1x HF ``generate``'s; every engine's KV allocated <= 1.25x needed; prefix,
caching on computes <= 1/n of the group's prompt tokens (the dynamic engine also judged with one
page per extra sample allowed, the least it computes) and >= 1.5x the tokens per second of caching
off.

    python benchmarks/rollout_throughput.py        # 32 prompts x 2, about 2 minutes on 2 idle cores
    python benchmarks/rollout_throughput.py --samples 32 --max-new 256 --engines static dynamic
    python benchmarks/rollout_throughput.py --workloads prefix    # 4 prompts of 512 tokens x 8

On a 2-core CPU the dynamic engine's per-step host work (scheduling, bookkeeping, the SDPA
stand-in for flash-attn's paged kernels) dominates; the figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from megatron_rl.config.schema import ModelConfig

MiB = 2**20
TARGETS = {"longtail_vs_hf": 1.5, "uniform_vs_hf": 1.0, "kv_allocated_over_needed": 1.25, "prefix_speedup": 1.5}
BATCHINGS = ("static", "dynamic")  # megatron's engine, rollout.batching
# The prefix workload's runs of megatron's engine: (label, rollout.batching, rollout.prefix_caching).
PREFIX_ENGINES = tuple((f"{b}-cache-{'on' if on else 'off'}", b, on) for b in BATCHINGS for on in (False, True))


def workload(vocab: int, samples: int, n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(samples // n):
        length = int(torch.randint(16, 97, (1,), generator=gen))
        prompts.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
    return prompts


def prefix_workload(vocab: int, prompts: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(prompts)]


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int = 4) -> int:
    """Keys and values of every layer for one token."""
    head_dim = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_layers * (cfg.num_query_groups or cfg.num_attention_heads) * head_dim * dtype_bytes


def static_batches(prompt_lens: list[int], response_lens: list[int], batch: int):
    """The rows of each static batch: ``[(prompt length, response length), ...]``."""
    rows = list(zip(prompt_lens, response_lens))
    return [rows[k : k + batch] for k in range(0, len(rows), batch)]


def live_tokens_peak(batches) -> int:
    """Most tokens live at once in static batches: at decode step t the rows still generating
    (response length >= t) hold prompt + t tokens each."""
    return max(sum(p + t for p, r in rows if r >= t) for rows in batches for t in range(1, max(r for _, r in rows) + 1))


def _hf_model(cfg: ModelConfig, canonical: dict):
    import transformers

    from megatron_rl.models.hf_bridge import canonical_to_hf

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon, rope_theta=float(cfg.rotary_base), tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(canonical_to_hf(canonical, cfg), strict=True)
    model.generation_config.eos_token_id = None  # only the workload's stop ids end a row
    return model


def _hf_generate(model, prompts, params, batch: int, pad_id: int):
    """HF ``generate`` in batches of ``batch`` left-padded rows; responses cut after their stop id."""
    rows = [p for p in prompts for _ in range(params.n)]
    responses = []
    stop_ids = list(params.stop_token_ids) or None
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        longest = max(map(len, chunk))
        ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.bool)
        for r, p in enumerate(chunk):  # left-padded: every row's last token is real
            ids[r, longest - len(p):] = torch.tensor(p)
            mask[r, longest - len(p):] = True
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=params.max_new_tokens,
                                 eos_token_id=stop_ids, pad_token_id=pad_id)
        for row in out[:, ids.size(1):].tolist():
            ends = [k + 1 for k, t in enumerate(row) if t in params.stop_token_ids]
            responses.append(row[: ends[0]] if ends else row)
    return responses


def _watch_live_tokens(engine) -> list[int]:
    """Record, at every step of megatron's engine, the tokens its KV pages hold for the requests in
    its context (running and paused): KV offset + this step's query tokens."""
    controller, ctx = engine.dynamic.engine.controller, engine.dynamic.engine.context
    sample_logits, peak = controller._dynamic_step_sample_logits, [0]

    def watched(*args, **kwargs):  # megatron-core 0.19.2 passes nothing (the logits are on the controller)
        held = (ctx.request_kv_length_offsets + ctx.request_query_lengths)[: ctx.total_request_count]
        peak[0] = max(peak[0], int(held.sum()))
        return sample_logits(*args, **kwargs)

    controller._dynamic_step_sample_logits = watched
    return peak


def run_engine(name: str, cfg: ModelConfig, prompts: list[list[int]], params, batch: int, threads: int,
               kv_fraction: float, block_tokens: int = 16, prefix_caching: bool = False) -> dict:
    """In a fresh one-rank worker: build the model, generate once, report speed and KV sizes."""
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import load_canonical
    from megatron_rl.planner.memory import engine_kv_cache_bytes
    from megatron_rl.planner.option import PlanOption
    from megatron_rl.rollout.megatron import MegatronRolloutEngine
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.testing.weights import random_canonical

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    canonical = random_canonical(cfg, seed=0, std=0.02)
    per_token = kv_bytes_per_token(cfg)
    longest = max(map(len, prompts)) + params.max_new_tokens
    # The planner's budget for `batch` whole sequences of the longest length, in the engine's pages.
    full_kv = engine_kv_cache_bytes(cfg, PlanOption(), batch, longest, 4, block_tokens)
    if name == "hf":
        model = _hf_model(cfg, canonical)
    else:
        chunks = build_gpt_chunks(cfg, use_layout(), torch.device("cpu"))
        load_canonical(chunks, canonical)
        kv = float(max(int(kv_fraction * full_kv), 2)) if name == "dynamic" else float(2**40)
        engine = MegatronRolloutEngine(cfg, "cpu", max_batch_size=batch, kv_cache_memory=kv,
                                       prefill_chunk_tokens=512, kv_block_tokens=block_tokens,
                                       prefix_caching=prefix_caching, batching=name)
        engine.load_from_chunks(chunks)
        if name == "dynamic":
            engine.dynamic.build(engine.weights.model)  # now, so the step hook is in place before the first step
            live_peak = _watch_live_tokens(engine)
    t0, c0 = time.perf_counter(), time.process_time()
    if name == "hf":
        responses = _hf_generate(model, prompts, params, batch, pad_id=0)
    else:
        responses = engine.generate(prompts, params, seed=1).response_ids
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    prompt_lens = [len(p) for p in prompts for _ in range(params.n)]
    response_lens = [len(r) for r in responses]
    batches = static_batches(prompt_lens, response_lens, batch)
    lengths = sorted(response_lens)
    tokens = sum(lengths)
    out = dict(engine=name, seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds, cpu_seconds=cpu_seconds,
               tokens_per_cpu_s=tokens / cpu_seconds, median_len=lengths[len(lengths) // 2], max_len=lengths[-1],
               evictions=0, prompt_tokens=sum(prompt_lens), prefill_tokens=None)
    # A static batch decodes until its longest sample ends.
    out["steps"] = sum(max(r for _, r in rows) for rows in batches)
    if name == "static":
        out["prefill_tokens"] = engine.prefill_tokens
        out["kv_allocated"] = max(len(rows) * (max(p for p, _ in rows) + params.max_new_tokens)
                                  for rows in batches) * per_token
        out["kv_needed"] = live_tokens_peak(batches) * per_token
    elif name == "hf":
        out["kv_allocated"] = max(len(rows) * (max(p for p, _ in rows) + max(r for _, r in rows))
                                  for rows in batches) * per_token
        out["kv_needed"] = live_tokens_peak(batches) * per_token
    else:
        out["steps"] = engine.dynamic.engine.context.step_count  # megatron-core 0.19 counts steps on the context
        out["evictions"] = engine.dynamic.engine.evicted_request_count
        out["kv_allocated"] = engine.dynamic.kv_bytes
        out["kv_needed"] = live_peak[0] * per_token
        out["prefill_tokens"] = engine.prefill_tokens  # prompt tokens its forwards computed
    out["ms_per_step_cpu"] = 1e3 * cpu_seconds / out["steps"]
    return out


def _this_module():
    """This file as an importable module, so harness workers can unpickle its functions."""
    from megatron_rl.testing.harness import importable_script

    return importable_script(__file__, __spec__)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def verdicts(results: dict) -> list[str]:
    """One line per target that the measured engines allow checking."""
    lines = []

    def rate(workload, engine):
        return results.get(workload, {}).get(engine, {}).get("tokens_per_cpu_s")

    for batching in BATCHINGS:
        for workload, other, key in (("longtail", "hf", "longtail_vs_hf"), ("uniform", "hf", "uniform_vs_hf")):
            mine, theirs = rate(workload, batching), rate(workload, other)
            if mine and theirs:
                ratio, target = mine / theirs, TARGETS[key]
                lines.append(f"{workload}: {batching} / {other} tokens per CPU-s = {ratio:.2f}x (target >= "
                             f"{target:g}x) {_verdict(ratio >= target)}")
    prefix = results.get("prefix", {})
    for batching in BATCHINGS:
        off, on = (prefix.get(f"{batching}-cache-{state}") for state in ("off", "on"))
        if not (off and on):
            continue
        n, prompts = on["n"], on["prompt_tokens"]
        share = on["prefill_tokens"] / prompts
        lines.append(f"prefix: {batching} cache on computes {on['prefill_tokens']} of {prompts} prompt tokens = "
                     f"{share:.3f} (target <= 1/n = {1 / n:.3f}) {_verdict(share <= 1 / n)}")
        if batching == "dynamic":
            allowed = prompts / n + (n - 1) * on["block_tokens"] * on["prompts"]
            lines.append(f"prefix: ... with one page per extra sample allowed (<= {allowed:.0f} tokens, the least "
                         f"the dynamic engine computes) {_verdict(on['prefill_tokens'] <= allowed)}")
        target = TARGETS["prefix_speedup"]
        for key, what in (("tokens_per_s", "tokens / s (wall)"), ("tokens_per_cpu_s", "tokens / CPU-s")):
            ratio = on[key] / off[key]
            lines.append(f"prefix: {batching} cache on / off {what} = {ratio:.2f}x (target >= {target:g}x) "
                         f"{_verdict(ratio >= target)}")
    target = TARGETS["kv_allocated_over_needed"]
    for workload, rows in results.items():
        for name, r in rows.items():
            ratio = r["kv_allocated"] / r["kv_needed"]
            lines.append(f"{workload}: {name} KV allocated / needed = {ratio:.2f}x (target <= {target:g}x) "
                         f"{_verdict(ratio <= target)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=["static", "dynamic", "hf"],
                        choices=["static", "dynamic", "hf"])
    parser.add_argument("--workloads", nargs="+", default=["uniform", "longtail"],
                        choices=["uniform", "longtail", "prefix"])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--n", type=int, default=2, help="samples per prompt")
    parser.add_argument("--batch", type=int, default=16, help="rows (static, hf) or requests in flight (dynamic)")
    parser.add_argument("--max-new", type=int, default=512, help="long tail: the length cap")
    parser.add_argument("--uniform-max-new", type=int, default=128, help="uniform: every response's length")
    parser.add_argument("--stop-ids", type=int, default=12, help="long tail: how many token ids stop a response")
    parser.add_argument("--kv-fraction", type=float, default=0.3,
                        help="long tail: the dynamic engine's KV cache as a fraction of what --batch whole "
                             "sequences need")
    parser.add_argument("--uniform-kv-fraction", type=float, default=1.0,
                        help="uniform: the dynamic engine's KV cache as a fraction of what --batch whole "
                             "sequences need")
    parser.add_argument("--kv-block-tokens", type=int, default=16,
                        help="the dynamic engine's page size (tokens): small pages waste less of each "
                             "sequence's last page")
    parser.add_argument("--prefix-prompts", type=int, default=4, help="prefix: prompts (GRPO groups)")
    parser.add_argument("--prefix-len", type=int, default=512, help="prefix: tokens per prompt")
    parser.add_argument("--prefix-n", type=int, default=8, help="prefix: samples per prompt")
    parser.add_argument("--prefix-max-new", type=int, default=32, help="prefix: every response's length")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every (workload, engine), interleaved; the table keeps each one's fastest "
                             "(per-step costs on a shared machine move by 15-30%% between runs)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from megatron_rl.rollout.sampling import SamplingParams
    from megatron_rl.testing.harness import get_pool

    cfg = ModelConfig(num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=8, num_query_groups=4,
                      vocab_size=2048, make_vocab_size_divisible_by=128, max_position_embeddings=1024,
                      params_dtype="float32", transformer_impl="local")
    prompts = workload(cfg.vocab_size, args.samples, args.n)
    longtail = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, n=args.n,
                              stop_token_ids=tuple(range(4, 4 + args.stop_ids)))
    settings = {"uniform": (dataclasses.replace(longtail, max_new_tokens=args.uniform_max_new, stop_token_ids=()),
                            args.uniform_kv_fraction),
                "longtail": (longtail, args.kv_fraction),
                "prefix": (dataclasses.replace(longtail, max_new_tokens=args.prefix_max_new, n=args.prefix_n,
                                               stop_token_ids=()), args.uniform_kv_fraction)}
    group_prompts = prefix_workload(cfg.vocab_size, args.prefix_prompts, args.prefix_len)
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_query_groups} KV heads, vocab "
          f"{cfg.vocab_size}, fp32 ({kv_bytes_per_token(cfg)} KV bytes per token); {len(prompts)} prompts x "
          f"n={args.n}, prompts 16-96 tokens; batch {args.batch}; {args.threads} thread(s)")
    print(f"uniform: {args.uniform_max_new} new tokens each, dynamic KV = {args.uniform_kv_fraction:g} x what "
          f"{args.batch} whole sequences need; longtail: up to {args.max_new} new tokens, {args.stop_ids} stop ids, "
          f"dynamic KV = {args.kv_fraction:g} x that")
    if "prefix" in args.workloads:
        print(f"prefix: {args.prefix_prompts} prompts of {args.prefix_len} tokens x n={args.prefix_n}, "
              f"{args.prefix_max_new} new tokens each, static and dynamic with prefix caching off / on, pages of "
              f"{args.kv_block_tokens} tokens")

    def runs(workload_name):
        if workload_name == "prefix":
            return list(PREFIX_ENGINES)
        return [(name, name, False) for name in args.engines]

    results: dict = {}
    for repeat, workload_name, (name, engine, caching) in ((k, w, e) for k in range(args.repeats)
                                                           for w in args.workloads for e in runs(w)):
        params, kv_fraction = settings[workload_name]
        pool = get_pool(1)
        r = pool.run(_this_module().run_engine, engine, cfg, group_prompts if workload_name == "prefix" else prompts,
                     params, args.batch, args.threads, kv_fraction, args.kv_block_tokens, caching)[0]
        pool.close()  # a fresh process for the next engine
        r.update(n=params.n, block_tokens=args.kv_block_tokens, prompts=args.prefix_prompts)
        best = results.setdefault(workload_name, {}).get(name)
        if best is None or r["tokens_per_cpu_s"] > best["tokens_per_cpu_s"]:
            results[workload_name][name] = r
        extra = f", {r['evictions']} evictions" if engine == "dynamic" else ""
        if r["prefill_tokens"] is not None:
            extra += f", {r['prefill_tokens']} of {r['prompt_tokens']} prompt tokens computed"
        print(f"run {repeat + 1}/{args.repeats} {workload_name:8s} {name:9s} {r['tokens_per_cpu_s']:7.1f} tokens/CPU-s "
              f"{r['tokens_per_s']:7.1f} "
              f"tokens/s ({r['tokens']} tokens, {r['cpu_seconds']:.1f} CPU-s, {r['seconds']:.1f} s; lengths "
              f"median {r['median_len']}, max {r['max_len']}); {r['steps']} steps, "
              f"{r['ms_per_step_cpu']:.1f} CPU-ms/step{extra}; KV allocated {r['kv_allocated'] / MiB:.2f} MiB, "
              f"needed {r['kv_needed'] / MiB:.2f} MiB", flush=True)
    print(f"\nfastest of {args.repeats} run(s) each:")
    print("| workload | engine | tokens / CPU-s | tokens / s (wall) | prompt tokens computed | decode steps "
          "| CPU-ms / step | KV allocated | KV needed | allocated / needed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for workload_name, rows in results.items():
        for name, r in rows.items():
            computed = "-" if r["prefill_tokens"] is None else f"{r['prefill_tokens']} / {r['prompt_tokens']}"
            print(f"| {workload_name} | `{name}` | {r['tokens_per_cpu_s']:.0f} | {r['tokens_per_s']:.0f} "
                  f"| {computed} | {r['steps']} "
                  f"| {r['ms_per_step_cpu']:.1f} | {r['kv_allocated'] / MiB:.2f} MiB | {r['kv_needed'] / MiB:.2f} MiB "
                  f"| {r['kv_allocated'] / r['kv_needed']:.2f}x |")
    print()
    for line in verdicts(results):
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
