"""LoRA generation: adapter-aware layers (forward hooks) against adapters merged into the base.

One process on the CPU, one small model with LoRA adapters on every projection, megatron's engine
generating greedily in place, two ways: the adapters as the actor holds them (each targeted layer
adds ``scaling * B (A x)`` through its forward hook), and a copy whose base weights hold
``W + scaling * B @ A`` with the hooks removed.  Repeats are interleaved, the order alternating;
printed: tokens per second of each (median), whether both generate the same tokens, and what a
refit per step would move for each (the adapters, or every targeted base weight).  Tokens are
counted per wall second and per CPU second of the process (``--threads`` torch threads, 1 by
default): on a CPU shared with other work the CPU seconds are the steadier measure.

    python benchmarks/lora_generation.py              # 4 layers, hidden 512, rank 16, 8 prompts x 32 tokens, 5 repeats
    python benchmarks/lora_generation.py --repeats 9 --rank 64 --threads 2

A GPU would prefer adapter-aware layers in RL: merged saves the extra matmuls per token but needs a
full refit of every targeted weight each step, adapter-aware adds two thin rank-r matmuls (small
beside decode's memory-bound base GEMMs) and refits only the adapters.
"""

from __future__ import annotations

import argparse
import statistics
import time

MiB = 2**20


def merge_adapters(chunks) -> None:
    """Write each adapter's ``scaling * B @ A`` into its base weight and remove the hooks (one
    process, TP1).  A layer's delta is its hook's output on the identity: the hook places the q/k/v
    and gate/up rows as the fused layer holds them."""
    import torch

    from megatron_rl.models.lora.adapters import LoRAAdapter

    for chunk in chunks:
        for layer in chunk.decoder.layers:
            adapters = layer.lora
            for hook in adapters._hooks:
                hook.remove()
            by_path: dict[str, list[str]] = {}
            for name, child in adapters.named_children():
                if isinstance(child, LoRAAdapter):
                    by_path.setdefault(_layer_of(name), []).append(name)
            for path, names in by_path.items():
                linear = layer.get_submodule(path)
                weight = linear.weight
                out_features, in_features = weight.shape
                eye = torch.eye(in_features, dtype=weight.dtype).unsqueeze(1)  # [in, 1, in]: each basis vector
                zeros = torch.zeros(in_features, 1, out_features, dtype=weight.dtype)
                hook = adapters._row_hook if path.endswith(("linear_proj", "linear_fc2")) else adapters._column_hook
                with torch.no_grad():
                    delta, _ = hook(tuple(names), path, linear, (eye,), (zeros, None))
                    weight.add_(delta.squeeze(1).t().to(weight.dtype))
            adapters.enabled = False


def _layer_of(projection: str) -> str:
    from megatron_rl.layout.lora import LAYER_OF

    return LAYER_OF[projection]


def measure(model_kw: dict, lora_kw: dict, prompts: int, prompt_len: int, new_tokens: int, repeats: int,
            threads: int) -> dict:
    """On one rank: both variants' greedy generation, interleaved; tokens/s, agreement, refit bytes."""
    import torch

    torch.set_num_threads(threads)

    from megatron_rl.config.schema import LoRAConfig, ModelConfig
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import load_canonical
    from megatron_rl.models.lora.adapters import adapter_parameters, attach_lora
    from megatron_rl.rollout.megatron import MegatronRolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.testing.weights import random_adapters, random_canonical

    cfg, lora = ModelConfig(**model_kw), LoRAConfig(**lora_kw)
    layout = use_layout()
    state = {**random_canonical(cfg, 0, std=0.05), **random_adapters(cfg, lora, 1, std=0.05)}
    variants = {}
    for name in ("adapter-aware", "merged"):
        chunks = build_gpt_chunks(cfg, layout, torch.device("cpu"))
        attach_lora(chunks, cfg, lora, seed=0)
        load_canonical(chunks, state)
        for chunk in chunks:
            chunk.eval().requires_grad_(False)
        if name == "merged":
            merge_adapters(chunks)
        engine = MegatronRolloutEngine(cfg, "cpu", max_batch_size=prompts, kv_cache_memory=2**26,
                                       kv_block_tokens=16, batching="dynamic")
        engine.load_from_chunks(chunks)
        variants[name] = (chunks, engine)
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    greedy = SamplingParams(greedy=True, max_new_tokens=new_tokens)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    cpu_rates: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list] = {}
    for name, (_, engine) in variants.items():  # warm-up: engine state, allocator
        tokens[name] = engine.generate(batch, greedy, seed=0).response_ids
    for r in range(repeats):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            start, cpu_start = time.perf_counter(), time.process_time()
            out = variants[name][1].generate(batch, greedy, seed=0)
            count = sum(len(x) for x in out.response_ids)
            rates[name].append(count / (time.perf_counter() - start))
            cpu_rates[name].append(count / (time.process_time() - cpu_start))
    chunks = variants["adapter-aware"][0]
    targeted = {f"{n.rsplit('.lora.', 1)[0]}.{_layer_of(n.split('.lora.')[1].split('.')[0])}.weight"
                for n, _ in adapter_parameters(chunks)}
    params = dict(chunks[0].named_parameters())
    return dict(tok_s={n: statistics.median(v) for n, v in rates.items()}, runs=rates,
                tok_cpu_s={n: statistics.median(v) for n, v in cpu_rates.items()}, cpu_runs=cpu_rates,
                same_tokens=tokens["adapter-aware"] == tokens["merged"],
                adapter_bytes=sum(p.numel() * p.element_size() for _, p in adapter_parameters(chunks)),
                targeted_bytes=sum(params[n].numel() * params[n].element_size() for n in targeted))


def _this_module():
    from megatron_rl.testing.harness import importable_script

    return importable_script(__file__, __spec__)


def main(argv=None) -> int:
    from megatron_rl.testing.harness import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    a = parser.parse_args(argv)
    model_kw = dict(num_layers=a.layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn, num_attention_heads=a.heads,
                    num_query_groups=a.kv_heads, vocab_size=a.vocab, params_dtype="float32", transformer_impl="local",
                    max_position_embeddings=a.prompt_len + a.new_tokens + 16)
    lora_kw = dict(rank=a.rank, alpha=2.0 * a.rank, target_modules=["all-linear"])
    r = run_distributed(1, _this_module().measure, model_kw, lora_kw, a.prompts, a.prompt_len, a.new_tokens,
                        a.repeats, a.threads)[0]
    for name, rate in r["tok_s"].items():
        print(f"{name:>14}: {rate:7.1f} tokens/s, {r['tok_cpu_s'][name]:7.1f} tokens/CPU-s (medians of {a.repeats}; "
              f"per CPU-s: {', '.join(f'{x:.1f}' for x in r['cpu_runs'][name])})")
    ratio = r["tok_cpu_s"]["merged"] / r["tok_cpu_s"]["adapter-aware"]
    print(f"merged / adapter-aware: {r['tok_s']['merged'] / r['tok_s']['adapter-aware']:.2f}x per wall second, "
          f"{ratio:.2f}x per CPU second; same greedy tokens: {r['same_tokens']}")
    print(f"refit per step: adapter-aware {r['adapter_bytes'] / MiB:.2f} MiB (adapters), merged "
          f"{r['targeted_bytes'] / MiB:.2f} MiB (every targeted weight)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
