"""Generation with megatron's dynamic engine against HF transformers ``generate`` on the same weights.

    python benchmarks/engine_vs_hf.py [--model tiny|qwen2.5-1.5b] [--concurrency 64 256] [--new-tokens 512]

One process, world size 1.  A random HF model (``Qwen2ForCausalLM``; ``qwen2.5-1.5b``: the shape of
Qwen2.5-1.5B in bf16, vocabulary 151,936) is saved and imported into the actor's megatron model, so
both generate from the same weights.  Rows:

* **parity** -- greedy tokens of 8 prompts against HF ``generate``'s (one prompt at a time, no padding)
  and log-probs against HF's teacher-forced ones on the tokens both produced (bf16 on a GPU, fp32 on
  the CPU); the bound it prints is the one the GPU holds;
* **throughput** at each ``--concurrency``: that many requests x ``--new-tokens`` tokens, EOS ignored,
  ours (``rollout.batching=dynamic``, ``rollout.paged_attention=auto``, CUDA graphs on) against HF
  ``generate`` (one left-padded batch, greedy), and the memory-bandwidth bound: (weight bytes + the
  KV bytes a decode step reads at the mean context) / the measured device copy bandwidth;
* **long tail**: sampled at T=1 with 1/128 of the vocabulary as stop ids (geometric lengths, capped);
* **CUDA graphs** on / off at the first concurrency, and the time a resume takes (KV cache rebuilt,
  graphs captured again -- what every rollout after a training step pays);
* **prefix caching** at n=8 with ``--prefix-len``-token prompts: prompt tokens computed and tokens/s,
  caching on against off.

Rows for ``benchmarks/gpu_check.py`` (section h) come from :func:`measure`.  On the CPU it runs the
tiny model through the same code (SDPA stand-in, no graphs): a check of the script, not a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # a GPU machine runs this from a copy of the tree, without installing it
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

HF_MODELS = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1000000.0),
}
PARITY_PROMPTS, PARITY_TOKENS = 8, 32


@dataclasses.dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    hf: object  # the HF model
    model_cfg: object
    chunks: list
    weight_bytes: int
    kv_bytes_per_token: int


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(HF_MODELS), default="qwen2.5-1.5b")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--prefix-prompts", type=int, default=8)
    parser.add_argument("--kv-fraction", type=float, default=0.6, help="rollout.kv_cache_memory (of free memory)")
    parser.add_argument("--skip-hf", action="store_true", help="leave HF generate's throughput out")
    return parser.parse_args(argv)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def build(args, device: torch.device, tmp: str) -> Setup:
    """The HF model (random, saved to ``tmp``) and the actor's megatron model imported from it."""
    import transformers

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.hf_bridge import load_hf_weights
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**HF_MODELS[args.model], torch_dtype=dtype)
    with torch.device(device):
        hf = transformers.Qwen2ForCausalLM(config).to(dtype).eval()
    hf.save_pretrained(tmp)
    base = ModelConfig(params_dtype="bfloat16" if dtype == torch.bfloat16 else "float32", transformer_impl="local")
    model_cfg = model_config_from_hf(read_hf_config(tmp), base)
    chunks = build_gpt_chunks(model_cfg, ParallelLayout(), device)
    load_hf_weights(chunks, tmp)
    weight_bytes = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    head_dim = model_cfg.hidden_size // model_cfg.num_attention_heads
    kv = 2 * model_cfg.num_layers * model_cfg.num_query_groups * head_dim * (2 if dtype == torch.bfloat16 else 4)
    return Setup(device, dtype, hf, model_cfg, chunks, weight_bytes, kv)


def engine(setup: Setup, args, concurrency: int, **overrides):
    from megatron_rl.rollout.megatron import MegatronRolloutEngine

    options = dict(max_batch_size=concurrency, kv_cache_memory=args.kv_fraction, prefill_chunk_tokens=8192,
                   kv_block_tokens=256, batching="dynamic")
    if setup.device.type == "cpu":
        options.update(kv_cache_memory=2**26, prefill_chunk_tokens=256, kv_block_tokens=16)
    options.update(overrides)
    built = MegatronRolloutEngine(setup.model_cfg, str(setup.device), **options)
    built.load_from_chunks(setup.chunks)
    return built


def timed(setup: Setup, fn):
    _sync(setup.device)
    start = time.perf_counter()
    out = fn()
    _sync(setup.device)
    return out, time.perf_counter() - start


def generate(setup: Setup, eng, batch, params, seed: int = 0):
    """``(rollout batch, seconds, tokens generated)`` of one ``eng.generate``."""
    out, seconds = timed(setup, lambda: eng.generate(batch, params, seed=seed))
    return out, seconds, sum(len(r) for r in out.response_ids)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    numel = (1 << 28) if device.type == "cuda" else (1 << 24)
    src = torch.empty(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _, seconds = timed(Setup(device, None, None, None, [], 0, 0), lambda: [dst.copy_(src) for _ in range(10)])
    return 10 * 2 * src.numel() * src.element_size() / seconds


def hf_greedy(setup: Setup, batch: list[list[int]], new_tokens: int) -> list[list[int]]:
    config = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                  eos_token_id=None)
    out = []
    with torch.no_grad():
        for prompt in batch:
            ids = torch.tensor([prompt], device=setup.device)
            row = setup.hf.generate(ids, attention_mask=torch.ones_like(ids), **config)
            out.append(row[0, len(prompt):].tolist())
    return out


def hf_teacher_forced(setup: Setup, batch, responses) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for prompt, response in zip(batch, responses):
            logits = setup.hf(torch.tensor([prompt + response], device=setup.device)).logits[0].float()
            logp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
            out.append(logp.gather(-1, torch.tensor(response, device=setup.device)[:, None])[:, 0].tolist())
    return out


def hf_batch_generate(setup: Setup, batch: list[list[int]], new_tokens: int, stop_ids=None) -> int:
    """HF generate on one left-padded batch; the tokens it generated (up to each row's stop)."""
    longest = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    sample = stop_ids is not None
    config = dict(do_sample=sample, max_new_tokens=new_tokens, pad_token_id=0,
                  eos_token_id=list(stop_ids) if sample else None, min_new_tokens=0 if sample else new_tokens)
    if sample:
        config.update(temperature=1.0, top_k=0, top_p=1.0)
    with torch.no_grad():
        out = setup.hf.generate(ids.to(setup.device), attention_mask=mask.to(setup.device), **config)
    generated = out[:, longest:]
    if not sample:
        return generated.numel()
    stops = torch.isin(generated, torch.tensor(list(stop_ids), device=generated.device))
    first = torch.where(stops.any(1), stops.int().argmax(1) + 1, torch.full_like(stops[:, 0], generated.size(1),
                                                                                 dtype=torch.long))
    return int(first.sum())


def measure(args, log=print) -> list[tuple[str, str]]:
    """Every row as ``(name, result)``."""
    from megatron_rl.compat.paged_attention import installed_paged_attention
    from megatron_rl.rollout.sampling import SamplingParams

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="engine_vs_hf_") as tmp:
        setup, seconds = timed(Setup(device, None, None, None, [], 0, 0), lambda: build(args, device, tmp))
    m = setup.model_cfg
    rows.append(("model", f"{m.num_layers} layers, hidden {m.hidden_size}, heads {m.num_attention_heads}:"
                          f"{m.num_query_groups}, vocab {m.vocab_size}, {setup.dtype}; "
                          f"{setup.weight_bytes / 2**30:.2f} GiB of weights; built and imported in {seconds:.1f} s"))
    vocab = m.vocab_size

    # -- parity
    batch = prompts(PARITY_PROMPTS, 24, vocab, seed=1)
    eng = engine(setup, args, PARITY_PROMPTS)
    ours = eng.generate(batch, SamplingParams(greedy=True, max_new_tokens=PARITY_TOKENS), seed=0)
    kernels = installed_paged_attention()
    theirs = hf_greedy(setup, batch, PARITY_TOKENS)
    agree = []
    for a, b in zip(ours.response_ids, theirs):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        agree.append(same)
    shared = [r[:n] for r, n in zip(ours.response_ids, agree)]
    reference = hf_teacher_forced(setup, batch, [r or [0] for r in shared])
    worst = max((abs(x - y) for lp, ref, n in zip(ours.response_logprobs, reference, agree)
                 for x, y in zip(lp[:n], ref[:n])), default=0.0)
    rows.append(("parity: greedy tokens = HF generate's",
                 f"{sum(n == PARITY_TOKENS for n in agree)}/{PARITY_PROMPTS} prompts all {PARITY_TOKENS} tokens "
                 f"(first divergence at {min(agree)}); paged attention {kernels}"))
    rows.append(("parity: max abs(log-prob - HF teacher-forced) on the shared tokens",
                 f"{worst:.2e} ({str(setup.dtype).replace('torch.', '')})"))
    eng.release_weights()

    # -- throughput
    bandwidth = copy_bandwidth(device)
    rows.append(("device copy bandwidth", f"{bandwidth / 1e9:.0f} GB/s (read + write)"))
    warm, one = SamplingParams(greedy=True, max_new_tokens=4), SamplingParams(greedy=True, max_new_tokens=1)
    greedy = SamplingParams(greedy=True, max_new_tokens=args.new_tokens)
    graphs = {}
    for concurrency in args.concurrency:
        batch = prompts(concurrency, args.prompt_len, vocab, seed=2)
        eng = engine(setup, args, concurrency)
        generate(setup, eng, batch[:2], warm)  # build, capture
        _, seconds, tokens = generate(setup, eng, batch, greedy)
        ours_tps = tokens / seconds
        mean_context = args.prompt_len + args.new_tokens / 2
        step_bytes = setup.weight_bytes + concurrency * mean_context * setup.kv_bytes_per_token
        bound = concurrency * bandwidth / step_bytes
        graphed = eng.dynamic.graphs is not None
        text = (f"ours {ours_tps:.0f} tokens/s ({tokens} in {seconds:.2f} s, CUDA graphs "
                f"{'on' if graphed else 'off'}); bound {bound:.0f} tokens/s -> {100 * ours_tps / bound:.1f}% of it")
        if not args.skip_hf:
            hf_tokens, hf_s = timed(setup, lambda: hf_batch_generate(setup, batch, args.new_tokens))
            text += f"; HF generate {hf_tokens / hf_s:.0f} tokens/s -> ours {ours_tps * hf_s / hf_tokens:.2f}x"
        rows.append((f"throughput: {concurrency} requests x {args.new_tokens} new tokens", text))
        if concurrency == args.concurrency[0]:
            key = "on" if graphed else "off"
            graphs[key] = ours_tps
            eng.release_weights()  # what the trainer does after a rollout: the next one resumes
            graphs[f"resume_{key}"] = generate(setup, eng, batch[:1], one)[1]
            # -- long tail
            stop_ids = tuple(range(0, vocab, 128))
            tail = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=stop_ids)
            out, seconds, tokens = generate(setup, eng, batch, tail, seed=3)
            text = f"ours {tokens / seconds:.0f} tokens/s ({tokens} tokens, longest {max(map(len, out.response_ids))})"
            if not args.skip_hf:
                hf_tokens, hf_s = timed(setup, lambda: hf_batch_generate(setup, batch, args.new_tokens, stop_ids))
                ratio = tokens / seconds * hf_s / hf_tokens
                text += f"; HF generate {hf_tokens / hf_s:.0f} tokens/s -> ours {ratio:.2f}x"
            rows.append((f"long tail: {concurrency} requests, stop ids 1/128 of the vocabulary, <= {args.new_tokens}",
                         text))
        eng.release_weights()
        eng = None
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # -- CUDA graphs off, for the comparison
    if device.type == "cuda":
        concurrency = args.concurrency[0]
        batch = prompts(concurrency, args.prompt_len, vocab, seed=2)
        eng = engine(setup, args, concurrency, cuda_graphs=False)
        generate(setup, eng, batch[:2], warm)
        _, seconds, tokens = generate(setup, eng, batch, greedy)
        graphs["off"] = tokens / seconds
        eng.release_weights()
        graphs["resume_off"] = generate(setup, eng, batch[:1], one)[1]
        eng.release_weights()
        eng = None
        rows.append((f"CUDA graphs on / off: {concurrency} requests",
                     f"{graphs.get('on', 0):.0f} / {graphs['off']:.0f} tokens/s = "
                     f"{graphs.get('on', 0) / graphs['off']:.2f}x; resume after a release (KV rebuilt, graphs "
                     f"captured): {graphs.get('resume_on', 0):.2f} s / {graphs['resume_off']:.2f} s"))

    # -- prefix caching at n=8
    n = 8
    batch = prompts(args.prefix_prompts, args.prefix_len, vocab, seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=64, n=n)
    results = {}
    for caching in (False, True):
        eng = engine(setup, args, args.prefix_prompts * n, prefix_caching=caching)
        generate(setup, eng, batch[:1], SamplingParams(greedy=True, max_new_tokens=2))
        _, seconds, tokens = generate(setup, eng, batch, params, seed=5)
        results[caching] = (tokens / seconds, eng.prefill_tokens)
        eng.release_weights()
        eng = None
    total = args.prefix_prompts * args.prefix_len * n
    rows.append((f"prefix caching: {args.prefix_prompts} prompts of {args.prefix_len} tokens x n={n}, 64 new tokens",
                 f"prompt tokens computed {results[True][1]} / {results[False][1]} of {total} (on / off); "
                 f"{results[True][0]:.0f} / {results[False][0]:.0f} tokens/s = "
                 f"{results[True][0] / results[False][0]:.2f}x"))
    for name, text in rows:
        log(f"| {name} | {text} |")
    return rows


def main(argv=None) -> int:
    args = parse(argv)
    from megatron_rl.compat import enable_compat

    enable_compat()
    import update_vs_plain as uvp

    uvp.init_world(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    measure(args)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
