"""Rollout engines on a long-tail response-length workload: tokens/s and peak memory.

Compares, on the CPU, one process each:

* ``torch``    -- the project's KV-cache decoder (static batches of ``--batch`` rows, a row that
                  stops stays until half the batch has stopped);
* ``megatron`` -- megatron-core's dynamic inference engine on the actor's megatron model
                  (paged KV cache, continuous batching of ``--batch`` requests, chunked prefill),
                  through the CPU shims of ``megatron_rl/compat/inference_cpu.py``;
* ``hf``       -- Hugging Face ``generate`` on the same weights (a ``LlamaForCausalLM``), batches of
                  ``--batch`` rows, stopping per row on the same stop ids.

The model is random with near-uniform next-token distributions, and ``--stop-ids`` token ids end
a response: response lengths are then geometric (mean about vocab / stop ids) and capped at
``--max-new``, so a few samples run many times longer than the median -- the tail a static batch
waits for.  Prompts are 16..96 tokens.  Each engine runs in a fresh process on one thread; the rate
per CPU-second (process time) is the figure to compare on a shared machine, the wall-clock rate is
printed beside it.  "Peak memory" is the rise of the process's resident memory during generation
(sampled every 2 ms), next to the KV cache each engine allocates.

    python benchmarks/rollout_engines.py                       # 64 samples, up to 512 new tokens
    python benchmarks/rollout_engines.py --engines torch megatron --samples 32 --max-new 256

On a 2-core CPU the megatron engine's per-step host work (scheduling, bookkeeping, the SDPA
stand-in for flash-attn's paged kernels) dominates; the figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.config.schema import ModelConfig  # noqa: E402

MiB = 2**20


class PeakRSS:
    """Highest resident set size of this process while active, sampled on a thread."""

    def __init__(self, period_s: float = 0.002):
        import psutil

        self.process, self.period_s = psutil.Process(), period_s
        self.base = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def rise(self) -> int:
        return self.peak - self.base


def workload(vocab: int, samples: int, n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(samples // n):
        length = int(torch.randint(16, 97, (1,), generator=gen))
        prompts.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
    return prompts


def _hf_model(cfg: ModelConfig, canonical: dict):
    import transformers

    from megatron_rl.models.hf_bridge import canonical_to_hf

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon, rope_theta=float(cfg.rotary_base), tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.load_state_dict(canonical_to_hf(canonical, cfg), strict=True)
    return model


def _hf_generate(model, prompts, params, batch: int, pad_id: int):
    """HF ``generate`` in batches of ``batch`` left-padded rows; responses cut after their stop id."""
    from megatron_rl.rollout.decoder import left_pad

    rows = [p for p in prompts for _ in range(params.n)]
    responses = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        ids, mask, _ = left_pad(chunk)
        ids = ids.masked_fill(~mask, pad_id)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=params.max_new_tokens,
                                 eos_token_id=list(params.stop_token_ids), pad_token_id=pad_id)
        for row in out[:, ids.size(1):].tolist():
            ends = [k + 1 for k, t in enumerate(row) if t in params.stop_token_ids]
            responses.append(row[: ends[0]] if ends else row)
    return responses


def run_engine(name: str, cfg: ModelConfig, prompts: list[list[int]], params, batch: int, threads: int,
               kv_fraction: float) -> dict:
    """In a fresh one-rank worker: build the model, generate once, report speed and memory."""
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import load_canonical
    from megatron_rl.planner.memory import kv_cache_bytes
    from megatron_rl.rollout.decoder import random_canonical
    from megatron_rl.rollout.engine import make_engine
    from megatron_rl.testing.layouts import use_layout

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    canonical = random_canonical(cfg, seed=0, std=0.02)
    longest = max(map(len, prompts)) + params.max_new_tokens
    static_kv = kv_cache_bytes(cfg, batch, longest, 4)  # what one full static batch preallocates
    kv = static_kv
    if name == "hf":
        model = _hf_model(cfg, canonical)
    else:
        chunks = build_gpt_chunks(cfg, use_layout(), torch.device("cpu"))
        load_canonical(chunks, canonical)
        options = {}
        if name == "megatron":
            kv = max(int(kv_fraction * static_kv), 1)
            options = dict(kv_cache_memory=float(kv), prefill_chunk_tokens=512, kv_block_tokens=64)
        engine = make_engine(name, cfg, "cpu", max_batch_size=batch, **options)
        engine.load_from_chunks(chunks)
    with PeakRSS() as rss:
        t0, c0 = time.perf_counter(), time.process_time()
        if name == "hf":
            responses = _hf_generate(model, prompts, params, batch, pad_id=0)
        else:
            responses = engine.generate(prompts, params, seed=1).response_ids
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    in_order = [len(r) for r in responses]
    lengths = sorted(in_order)
    out = dict(engine=name, seconds=seconds, tokens=sum(lengths), tokens_per_s=sum(lengths) / seconds,
               cpu_seconds=cpu_seconds, tokens_per_cpu_s=sum(lengths) / cpu_seconds,
               peak_rss_rise_mib=rss.rise / MiB, kv_cache_mib=kv / MiB,
               median_len=lengths[len(lengths) // 2], max_len=lengths[-1])
    # A static batch (torch, hf) decodes until its longest sample ends.
    out["steps"] = sum(max(in_order[k : k + batch]) for k in range(0, len(in_order), batch))
    out["evictions"] = 0
    if name == "megatron":
        out["steps"] = engine._engine.step_count
        out["evictions"] = engine._engine.evicted_request_count
        out["kv_cache_mib"] = engine._kv_bytes / MiB
    return out


def _this_module():
    """This file as an importable module, so harness workers can unpickle its functions."""
    if __spec__ is not None and __spec__.name != "__main__":
        return importlib.import_module(__spec__.name)
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(os.path.splitext(os.path.basename(__file__))[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=["torch", "megatron", "hf"])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--n", type=int, default=2, help="samples per prompt")
    parser.add_argument("--batch", type=int, default=16, help="rows (torch, hf) or requests in flight (megatron)")
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--stop-ids", type=int, default=12)
    parser.add_argument("--kv-fraction", type=float, default=0.5,
                        help="megatron's KV cache as a fraction of one full static batch's")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from megatron_rl.rollout.sampling import SamplingParams
    from megatron_rl.testing.harness import get_pool

    cfg = ModelConfig(num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=8, num_query_groups=4,
                      vocab_size=2048, make_vocab_size_divisible_by=128, max_position_embeddings=1024,
                      params_dtype="float32", transformer_impl="local")
    prompts = workload(cfg.vocab_size, args.samples, args.n)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, n=args.n,
                            stop_token_ids=tuple(range(4, 4 + args.stop_ids)))
    print(f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, fp32; "
          f"{len(prompts)} prompts x n={args.n}, prompts 16-96 tokens, up to {args.max_new} new tokens, "
          f"{args.stop_ids} stop ids; batch {args.batch}; {args.threads} thread(s)")
    results = []
    for name in args.engines:
        pool = get_pool(1)
        results.append(pool.run(_this_module().run_engine, name, cfg, prompts, params, args.batch, args.threads,
                                args.kv_fraction)[0])
        pool.close()  # a fresh process for the next engine: its memory figures start clean
        r = results[-1]
        extra = f", {r['steps']} steps" + (f", {r['evictions']} evictions" if r["engine"] == "megatron" else "")
        print(f"{r['engine']:9s} {r['tokens_per_cpu_s']:7.1f} tokens/CPU-s, {r['tokens_per_s']:7.1f} tokens/s  "
              f"({r['tokens']} tokens in {r['cpu_seconds']:.1f} CPU-s, {r['seconds']:.1f} s; "
              f"lengths median {r['median_len']}, max {r['max_len']})  peak RSS +{r['peak_rss_rise_mib']:.1f} MiB, "
              f"KV cache {r['kv_cache_mib']:.1f} MiB{extra}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
