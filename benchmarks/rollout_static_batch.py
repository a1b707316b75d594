"""megatron-core's static-batching inference API against its dynamic engine and the KV-cache decoder,
on ``benchmarks/vs_trl.py``'s rollout shape, CPU.

    python benchmarks/rollout_static_batch.py [--rounds 15]

Whether megatron's own inference API can generate as fast as the hand-written decoder on the CPU,
so that the decoder can leave the package (one implementation of the model's math).  The shape is
vs_trl's: 16 prompts of 4-6 tokens x 8 samples, 4 new tokens at temperature 1, the TRL workload's
model (2 layers, hidden 64, 4 heads / 2 KV heads, a 20-token vocabulary), one thread.  Three ways
to generate, each timed as the trainer pays for it (the weights loaded, then one rollout), rounds
interleaved; the figure is CPU milliseconds per rollout (median and fastest):

* ``decoder``  -- ``rollout.engine=torch`` (the CPU default): a full copy of the weights gathered,
  the project's KV-cache decoder;
* ``dynamic``  -- ``rollout.engine=megatron``: megatron's ``DynamicInferenceEngine`` on the actor's
  shards (paged KV cache, continuous batching) through the CPU stand-ins for its kernels;
* ``static``   -- megatron's ``StaticInferenceContext`` and ``GPTInferenceWrapper`` on the same
  shards, driven by the loop below with the project's sampler and keyed noise: every row prefills
  the shortest prompt's length, then all rows step one position at a time (rows still inside their
  prompt take the prompt's token, as megatron's static controller does);
* ``padded``   -- the same, with the prompts left-padded to the longest and a boolean attention
  mask (no real query sees a pad key): one prefill, then one step per new token.  RoPE is
  relative, so a row's shift by its padding leaves its attention scores unchanged.

It also checks that both static ways give the dynamic engine's samples (greedy and sampled, same
keys) and prints how many forward steps each took.  A measurement of a route, not a product path:
the static loop lives here.
"""

from __future__ import annotations

import argparse
import time

import torch

# benchmarks/trl_workload.py's model and vocabulary (a character tokenizer of 20 ids)
MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             vocab_size=20, params_dtype="float32", transformer_impl="local", max_position_embeddings=1024)
PROMPTS, SAMPLES, NEW_TOKENS = 16, 8, 4


def static_generate(model, vocab: int, prompt_ids: list[list[int]], params, seed: int,
                    left_padded: bool = False) -> tuple[list, list, int]:
    """``(responses, log-probs, forward steps)`` through megatron's static-batching inference."""
    from megatron.core.inference.contexts.static_context import StaticInferenceContext
    from megatron.core.inference.utils import InferenceMode

    from megatron_rl.rollout.engine import stopped
    from megatron_rl.rollout.megatron_engine import _clear_rope_cache, _drop_inference_buffers, _make_wrapper_class
    from megatron_rl.rollout.sampling import keyed_exponentials, sample, sample_key
    from megatron_rl.utils.seeds import derive_seed

    samples = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]
    rows = len(samples)
    lengths = torch.tensor([len(prompt_ids[i]) for i, _ in samples])
    longest = int(lengths.max())
    width = longest + params.max_new_tokens
    pad = longest - lengths if left_padded else torch.zeros_like(lengths)
    tokens = torch.zeros(rows, width, dtype=torch.long)
    for r, (i, _) in enumerate(samples):
        tokens[r, int(pad[r]) : int(pad[r]) + len(prompt_ids[i])] = torch.tensor(prompt_ids[i])
    columns = torch.arange(width)
    positions = (columns.unsqueeze(0) - pad.unsqueeze(1)).clamp(min=0)
    mask = None
    if left_padded:  # True = hidden: later keys, and pad keys from a real query (a pad query sees pads)
        q, k, p = columns.view(1, width, 1), columns.view(1, 1, width), pad.view(rows, 1, 1)
        mask = ((k > q) | ((k < p) & (q >= p))).unsqueeze(1)
    prompt_end = pad + lengths  # the column of each row's first new token
    keys = torch.tensor([sample_key(derive_seed(seed, i, j)) for i, j in samples])
    context = StaticInferenceContext(rows, width)
    wrapper = _make_wrapper_class()(model, context)
    responses: list[list[int]] = [[] for _ in range(rows)]
    logprobs: list[list[float]] = [[] for _ in range(rows)]
    done = torch.zeros(rows, dtype=torch.bool)
    was_training = model.training
    model.eval()
    start, end, steps = 0, int(prompt_end.min()), 0
    try:
        with torch.inference_mode(), InferenceMode.active():
            while True:
                if start:
                    context.enable_decode_mode()
                window = {"tokens": tokens[:, start:end], "position_ids": positions[:, start:end],
                          "attention_mask": None if mask is None else mask[:, :, start:end, :end]}
                logits = wrapper.run_one_forward_step(window)
                steps += 1
                noise = None if params.is_greedy else keyed_exponentials(keys, (end - prompt_end).clamp(min=0), vocab)
                drawn, logp = sample(logits[:, -1, :vocab], params, None, noise=noise)
                generating = (prompt_end <= end) & ~done
                if end < width:
                    tokens[:, end] = torch.where(prompt_end <= end, drawn, tokens[:, end])
                for r in generating.nonzero().flatten().tolist():
                    responses[r].append(int(drawn[r]))
                    logprobs[r].append(float(logp[r]))
                    if stopped(responses[r], params) or len(responses[r]) >= params.max_new_tokens:
                        done[r] = True
                if bool(done.all()) or end >= width:
                    break
                start, end = end, end + 1
    finally:
        InferenceMode.unset_active()
        model.train(was_training)
        _clear_rope_cache()
        _drop_inference_buffers()
    return responses, logprobs, steps


def measure(rounds: int) -> dict:
    """In a one-rank worker: build the model once, then time the three ways interleaved."""
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import load_canonical
    from megatron_rl.rollout.decoder import random_canonical
    from megatron_rl.rollout.engine import make_engine
    from megatron_rl.rollout.sampling import SamplingParams
    from megatron_rl.testing.layouts import use_layout

    torch.set_num_threads(1)
    cfg = ModelConfig(**MODEL)
    chunks = build_gpt_chunks(cfg, use_layout(), torch.device("cpu"))
    load_canonical(chunks, random_canonical(cfg, 0, std=0.2))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg.vocab_size - 1, (int(torch.randint(4, 7, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(PROMPTS)]
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, n=SAMPLES)
    greedy = SamplingParams(greedy=True, max_new_tokens=NEW_TOKENS, n=1)
    decoder = make_engine("torch", cfg, "cpu", max_batch_size=PROMPTS * SAMPLES)
    dynamic = make_engine("megatron", cfg, "cpu", max_batch_size=PROMPTS * SAMPLES, kv_cache_memory=float(2**26),
                          prefill_chunk_tokens=4096, kv_block_tokens=256)
    dynamic.load_from_chunks(chunks)

    def run_static(seed, p=params, left_padded=False):
        return static_generate(chunks[0], cfg.vocab_size, prompts, p, seed, left_padded)

    def run_padded(seed, p=params):
        return run_static(seed, p, left_padded=True)

    def run_dynamic(seed, p=params):
        dynamic.load_from_chunks(chunks)
        batch = dynamic.generate(prompts, p, seed=seed)
        dynamic.release_weights()
        return batch

    def run_decoder(seed):
        decoder.load_from_chunks(chunks)
        decoder.generate(prompts, params, seed=seed)
        decoder.release_weights()

    checks = {}
    for way, fn in (("static", run_static), ("padded", run_padded)):
        for name, p, seed in (("greedy", greedy, 0), ("sampled", params, 3)):
            responses, logprobs, steps = fn(seed, p)
            batch = run_dynamic(seed, p)
            checks[f"{way} {name}"] = (responses == batch.response_ids, max(
                abs(a - b) for x, y in zip(logprobs, batch.response_logprobs) for a, b in zip(x, y)))
        checks[f"{way} steps"] = steps
    ways = {"decoder": run_decoder, "dynamic": run_dynamic, "static": run_static, "padded": run_padded}
    for fn in ways.values():  # warm-up
        fn(0)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(rounds):
        for name, fn in ways.items():
            c0 = time.process_time()
            fn(r + 1)
            times[name].append(time.process_time() - c0)
    return {"times": times, "checks": checks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    from megatron_rl.testing.harness import get_pool, importable_script

    module = importable_script(__file__, __spec__)
    result = get_pool(1).run(module.measure, args.rounds, timeout=1800)[0]
    checks = result["checks"]
    print(f"{PROMPTS} prompts of 4-6 tokens x {SAMPLES} samples, {NEW_TOKENS} new tokens, temperature 1; "
          f"2 layers, hidden 64, vocab 20; one thread; {args.rounds} interleaved rounds")
    for way in ("static", "padded"):
        greedy, sampled = checks[f"{way} greedy"], checks[f"{way} sampled"]
        print(f"{way} == dynamic engine: greedy tokens {greedy[0]} (log-probs within {greedy[1]:.1e}), sampled "
              f"tokens {sampled[0]} (within {sampled[1]:.1e}); forward steps per rollout: {checks[f'{way} steps']}")
    print("| way | CPU ms per rollout, median | fastest | vs decoder (median) |")
    print("|---|---|---|---|")
    base = sorted(result["times"]["decoder"])[len(result["times"]["decoder"]) // 2]
    for name, values in result["times"].items():
        values = sorted(values)
        median = values[len(values) // 2]
        print(f"| {name} | {median * 1e3:.1f} | {values[0] * 1e3:.1f} | {median / base:.2f}x |")


if __name__ == "__main__":
    main()
