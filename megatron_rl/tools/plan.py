"""``megatron-rl plan``: which layout fits a PPO job, per GPU and by component.

    megatron-rl plan --model qwen2.5-7b --prompt-len 1024 --response-len 32768 \\
        --nodes 1 --gpus-per-node 8 --gpu-memory 80

``--model`` is a preset name (``megatron-rl plan --list-models``) or a local HF model directory.
Prints per-GPU memory of candidate layouts (weights, grads and optimizer states of actor, critic
and reference; activations with and without recompute; the log-prob path; the rollout's weights
and KV cache, a full copy or 1/TP with the sharded engine), marks which fit, recommends one with the overrides to paste,
and when nothing fits
names the smallest node count that does.
"""

from __future__ import annotations

import argparse
import os

from megatron_rl.errors import ConfigError
from megatron_rl.planner.memory import total_params
from megatron_rl.planner.search import PRESETS, Candidate, plan, preset


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="preset name or local HF model directory")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=8192)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU")
    p.add_argument("--max-tokens-per-rank", type=int, help="token budget per micro-batch (default: one sequence)")
    p.add_argument("--rollout-batch", type=int, default=256, help="most sequences to generate together (KV cache)")
    p.add_argument("--no-critic", action="store_true", help="GRPO/RLOO: no critic")
    p.add_argument("--no-reference", action="store_true", help="no KL: no reference model")
    p.add_argument("--show", type=int, default=12, help="candidate layouts to print")
    p.add_argument("--list-models", action="store_true")


def _model(spec: str):
    if spec in PRESETS:
        return preset(spec)
    if spec and os.path.isdir(spec):
        from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

        return model_config_from_hf(read_hf_config(spec))
    raise ConfigError("--model", spec, "neither a preset nor a directory",
                      f"use one of {', '.join(PRESETS)} or a local HF model directory")


def _row(c: Candidate) -> str:
    lay, parts = c.layout, c.breakdown.gib()
    name = f"tp{lay.tp} pp{lay.pp} cp{lay.cp} dp{lay.dp}"
    if lay.ep > 1 or (lay.etp or lay.tp) != lay.tp:  # MoE
        name += f" ep{lay.ep}" + (f" etp{lay.etp}" if (lay.etp or lay.tp) != lay.tp else "")
    flags = ",".join(f for f, on in (("sp", lay.sequence_parallel and lay.tp > 1),
                                     (f"rc-{lay.recompute}", bool(lay.recompute)), ("offload", lay.offload),
                                     ("distopt", lay.distributed_optimizer),
                                     ("shard-gen", lay.sharded_rollout)) if on)
    weights = sum(v for k, v in parts.items() if k.endswith("weights"))
    grads = sum(v for k, v in parts.items() if k.endswith("grads"))
    optim = sum(v for k, v in parts.items() if k.endswith("optimizer"))
    return (f"  {name:<18} {flags:<34} {c.tokens_per_rank:>8} {weights:>8.1f} {grads:>7.1f} {optim:>7.1f} "
            f"{parts['activations']:>7.1f} {parts['log-prob path']:>7.1f} "
            f"{parts['rollout (weights + KV cache)']:>8.1f} {c.breakdown.rollout_batch:>5} {c.total_gib:>7.1f}  "
            f"{'yes' if c.fits else 'no'}")


def run_plan(args) -> int:
    if args.list_models:
        for name in PRESETS:
            print(f"{name:<14} {total_params(preset(name)) / 1e9:.1f}B parameters")
        return 0
    if not args.model:
        raise ConfigError("--model", None, "missing", "give a preset (--list-models) or an HF model directory")
    cfg = _model(args.model)
    result = plan(cfg, prompt_len=args.prompt_len, response_len=args.response_len, nodes=args.nodes,
                  gpus_per_node=args.gpus_per_node, gpu_memory_gib=args.gpu_memory,
                  max_tokens_per_rank=args.max_tokens_per_rank, rollout_batch=args.rollout_batch,
                  with_critic=not args.no_critic, with_reference=not args.no_reference)
    print(f"model {args.model}: {total_params(cfg) / 1e9:.2f}B parameters; sequence {args.prompt_len} + "
          f"{args.response_len} tokens; {args.nodes} node(s) x {args.gpus_per_node} GPUs x {args.gpu_memory:g} GiB")
    print("per-GPU memory in GiB (bf16 weights, fp32 grads, fp32 Adam + master weights; actor"
          + (", critic" if not args.no_critic else "") + (", reference" if not args.no_reference else "") + ")")
    print(f"  {'layout':<18} {'options':<34} {'tok/rank':>8} {'weights':>8} {'grads':>7} {'optim':>7} "
          f"{'acts':>7} {'logprob':>7} {'rollout':>8} {'gen':>5} {'total':>7}  fits")
    shown = [c for c in result.candidates if c.fits][: args.show]
    shown += [c for c in result.candidates if not c.fits][: max(0, args.show - len(shown))]
    for cand in shown:
        print(_row(cand))
    if result.recommended is None:
        where = (f"the smallest cluster that fits is {result.min_nodes} node(s) of {args.gpus_per_node} GPUs"
                 if result.min_nodes else "no cluster up to 64 nodes fits: shorten the sequence or use bigger GPUs")
        print(f"\nnot possible on {args.nodes} node(s): {where}")
        return 1
    best = result.recommended
    overrides = best.layout.overrides() + [f"batch.max_tokens_per_rank={best.tokens_per_rank}",
                                           f"rollout.max_batch_size={best.breakdown.rollout_batch}"]
    if best.breakdown.kv_cache_memory > 0:  # megatron's engine: its paged KV budget for that batch, in bytes
        overrides.append(f"rollout.kv_cache_memory={int(best.breakdown.kv_cache_memory)}")
    print(f"\nrecommended: {_row(best).strip()}")
    print("overrides:   " + " ".join(overrides))
    return 0
