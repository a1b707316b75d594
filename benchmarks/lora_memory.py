"""Model-state bytes of one rank, full fine-tuning against LoRA, measured and as planned.

    python benchmarks/lora_memory.py                  # full, LoRA rank 8 and 64 on all-linear; about 1 min on 2 cores
    python benchmarks/lora_memory.py --ranks 8,16 --targets q_proj,v_proj --int8-ranks 8,16

The model: 4 layers, hidden 512, MLP 1408, 8 heads, 4 KV heads, vocabulary 2048, bf16 parameters
(:data:`megatron_rl.testing.lora_memory.MEMORY_MODEL`), on one CPU rank.  Each configuration is
built as the trainer builds it (``build_models``: the actor in megatron DDP with megatron's
optimizer; full fine-tuning with the frozen reference copy a KL term keeps, LoRA with none: its
reference is the base), runs one forward/backward and one optimizer step, then counts every
storage it holds once -- parameters, DDP grad buffers, Adam's state and fp32 master copies
(:func:`megatron_rl.testing.lora_memory.census`).  ``plan``: what ``megatron-rl plan`` counts for
the same job (:func:`megatron_rl.planner.memory.model_state`); ``ratio``: measured bytes over full
fine-tuning's.
"""

from __future__ import annotations

import argparse

MiB = 2**20


def main() -> None:
    from megatron_rl.testing.harness import run_distributed
    from megatron_rl.testing.lora_memory import CATEGORIES, measure_body, planned_bytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,64", help="LoRA ranks to measure beside full fine-tuning")
    parser.add_argument("--targets", default="all-linear", help="comma-separated target_modules")
    parser.add_argument("--int8-ranks", default="8", help="LoRA ranks to measure on an int8 base too "
                                                          "(lora.quantize_base=int8); empty for none")
    args = parser.parse_args()
    targets = tuple(args.targets.split(","))
    header = f"{'config':<10} {'trained':>10} " + " ".join(f"{c + ' MiB':>14}" for c in CATEGORIES)
    print(f"{'config':<14}" + header[10:] + f" {'total bytes':>12} {'plan bytes':>12} {'plan/meas':>9} {'ratio':>6}")
    full_total = None
    runs = [(0, "none")] + [(int(r), "none") for r in args.ranks.split(",")] + \
        [(int(r), "int8") for r in args.int8_ranks.split(",") if r]
    for rank, quantize in runs:
        measured = run_distributed(1, measure_body, rank, targets, None, quantize)[0]
        planned = planned_bytes(rank, targets, quantize_base=quantize)
        full_total = full_total or measured["total"]
        name = (f"lora r{rank}" + (" int8" if quantize == "int8" else "")) if rank else "full"
        cells = " ".join(f"{measured[c] / MiB:>14.2f}" for c in CATEGORIES)
        print(f"{name:<14} {measured['trained_params']:>10} {cells} {measured['total']:>12} "
              f"{planned['total']:>12.0f} {planned['total'] / measured['total']:>9.4f} "
              f"{measured['total'] / full_total:>6.3f}")


if __name__ == "__main__":
    main()
