"""Training steps of a small actor/critic model on any parallel layout, for comparing with one process.

One body serves the layout parity tests and ``megatron-rl check-layouts``: a fixed batch of
mixed-length sequences, a loss that reaches every output (log-probs, entropy, values), and the
canonical (layout-independent) gradients and weights, so any two layouts compare tensor by tensor.
"""

from __future__ import annotations

import dataclasses

# The actor-critic model and sequences the layout tests compare with one process.
CP_MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                num_query_groups=2, vocab_size=100, params_dtype="float32")
# Odd lengths, several shorter than 2*cp chunks (1..3 tokens), so padding and empty chunks occur.
CP_LENGTHS = (13, 1, 30, 2, 7, 3, 21)
# Largest |difference| from one process of any output, gradient or weight, in fp32.
CP_TOL = 1e-5
# With an optimizer step: adam_eps well above the gradients' rounding noise (Adam's first step
# divides by |g| + eps, so a tiny gradient would turn a 1e-16 layout difference into a 1e-5 update).
CP_STEP_OPTIM = dict(lr=1e-2, adam_eps=1e-4)


def make_sequences(lengths=CP_LENGTHS, vocab=CP_MODEL["vocab_size"], seed=11) -> list[dict]:
    """Token ids plus per-token loss coefficients; fields pad with 0, which masks the padding."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [{"tokens": torch.randint(0, vocab, (n,), generator=g),
             "coef_logp": torch.randn(n, generator=g),
             "coef_entropy": torch.randn(n, generator=g),
             "target": torch.randn(n, generator=g),
             "mask": torch.ones(n)} for n in lengths]


@dataclasses.dataclass(frozen=True)
class ActorCriticHead:
    """Log-probs, entropy and values from one forward, so one run checks all three."""

    outputs = ("logprob", "entropy", "value")

    def __call__(self, model, hidden, tensors):
        from megatron_rl.models.heads import LogProbHead, ValueOutput

        out = LogProbHead(chunk_size=16)(model, hidden, tensors)
        out.update(ValueOutput()(model, hidden, tensors))
        return out


def model_config(model_kw=None, params_dtype: str = "auto"):
    """``model_kw`` itself when it is a ModelConfig, else :data:`CP_MODEL` updated by it."""
    from megatron_rl.config.schema import ModelConfig, MoEConfig, RecomputeConfig

    if isinstance(model_kw, ModelConfig):
        return model_kw
    kw = dict(CP_MODEL, params_dtype=params_dtype)
    kw.update(model_kw or {})
    if isinstance(kw.get("recompute"), dict):
        kw["recompute"] = RecomputeConfig(**kw["recompute"])
    if isinstance(kw.get("moe"), dict):
        kw["moe"] = MoEConfig(**kw["moe"])
    return ModelConfig(**kw)


def seed_value_head(chunks, hidden_size: int):
    """Give the last stage's value head fixed non-zero weights and let the LM output layer (which the
    value head freezes) keep its gradient: parity comparisons want both."""
    import torch

    for chunk in chunks:
        if chunk.post_process:
            chunk.output_layer.weight.requires_grad_(True)
            g = torch.Generator().manual_seed(5)
            with torch.no_grad():
                chunk.value_head.linear.weight.copy_(torch.randn(1, hidden_size, generator=g) * 0.2)
                chunk.value_head.linear.bias.fill_(0.3)
    return chunks


def build_with_value_head(layout, weights, params_dtype: str = "auto", model_kw=None):
    """The model of :func:`model_config` with a non-zero value head; canonical ``weights`` loaded,
    or gathered if None.  Returns ``(chunks, weights)``."""
    import torch

    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical, load_canonical
    from megatron_rl.models.heads import attach_value_head

    model = model_config(model_kw, params_dtype)
    chunks = seed_value_head(attach_value_head(build_gpt_chunks(model, layout, torch.device("cpu"))),
                             model.hidden_size)
    if weights is None:
        weights = gather_canonical(chunks)
    else:
        load_canonical(chunks, weights, strict=False)
    return chunks, weights


def sequence_loss(outs: list[dict], seqs: list[dict], total: float):
    """The actor/critic loss of the step: every output of every token, normalised by ``total`` tokens."""
    import torch

    per_seq = [(o["logprob"] * s["coef_logp"] + o["entropy"] * s["coef_entropy"]
                + s["mask"] * (o["value"] - s["target"]) ** 2).sum() / total for o, s in zip(outs, seqs)]
    return torch.stack(per_seq).sum()


def actor_critic_step(layout_kw: dict, weights, lengths, plan_kw: dict, forward_only: bool = False,
                      model_kw=None, optim_kw: dict | None = None, do_step: bool = False, steps: int = 1,
                      lora_kw: dict | None = None):
    """Harness body: forward+backward of the actor/critic loss through ``run_sequences`` (and, with
    ``do_step``, an optimizer step after each of ``steps`` such passes).

    Rank 0 returns the first pass's per-sequence outputs and canonical gradients, the canonical
    weights, the per-rank token counts, per pass its outputs, loss and gradient norm (``steps``),
    and (``do_step``) the canonical parameters after the last step; the other ranks return their
    local token counts.  ``lora_kw`` (``LoRAConfig`` fields): the base frozen, LoRA adapters with
    seeded non-zero A and B (so every adapter path carries a gradient) and the value head train."""
    import torch
    import torch.distributed as dist

    from megatron_rl.config.schema import OptimConfig
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(**layout_kw)
    chunks, weights = build_with_value_head(layout, weights, model_kw=model_kw)
    if lora_kw:
        from megatron_rl.config.schema import LoRAConfig
        from megatron_rl.layout.lora import int8_base
        from megatron_rl.models.lora.adapters import attach_lora
        from megatron_rl.testing.weights import load_random_adapters

        lora = LoRAConfig(**lora_kw)
        attach_lora(chunks, model_config(model_kw), lora, seed=3, train_also=("value_head",))
        load_random_adapters(chunks, model_config(model_kw), lora, seed=4)
        if int8_base(lora):
            from megatron_rl.models.lora.quantized_base import quantize_base

            quantize_base(chunks)
    trainable = make_trainable(chunks, OptimConfig(**(optim_kw or {})), total_steps=max(steps, 1))
    vocab = model_kw.vocab_size if hasattr(model_kw, "vocab_size") else CP_MODEL["vocab_size"]
    seqs = make_sequences(lengths, vocab=vocab)
    total = float(sum(lengths))

    def loss_fn(outs, tensors, mb):
        per_token = (outs["logprob"] * tensors["coef_logp"] + outs["entropy"] * tensors["coef_entropy"]
                     + tensors["mask"] * (outs["value"] - tensors["target"]) ** 2)
        return per_token.sum() / total, {}

    result: dict = {"weights": weights, "steps": []}
    for index in range(steps if do_step and not forward_only else 1):
        trainable.zero_grad()
        stats: dict = {}
        outs, _ = run_sequences(trainable.chunks, seqs, ActorCriticHead(), BatchPlan(**plan_kw), torch.device("cpu"),
                                loss_fn=None if forward_only else loss_fn, forward_only=forward_only, stats=stats)
        record = {"outs": outs, "loss": float(sequence_loss(outs, seqs, total))}
        if index == 0:
            result.update(outs=outs, local_tokens=stats["local_tokens"])
            if not forward_only:
                result["grads"] = gather_canonical(trainable.chunks, "grad")
        if do_step and not forward_only:
            update = trainable.step()
            assert update.ok, update.reason
            record["grad_norm"] = update.grad_norm
        result["steps"].append(record)
    if do_step and not forward_only:
        result["params"] = gather_canonical(trainable.chunks)
    return result if dist.get_rank() == 0 else result["local_tokens"]


def max_diff_outputs(got: list[dict], ref: list[dict]) -> dict:
    """Largest |got - ref| per output name over all sequences (shapes must match)."""
    worst: dict = {}
    for a, b in zip(got, ref, strict=True):
        for name in b:
            assert a[name].shape == b[name].shape, name
            worst[name] = max(worst.get(name, 0.0), float((a[name] - b[name]).abs().max()))
    return worst


def max_diff_tensors(got: dict, ref: dict) -> float:
    """Largest |got - ref| over two dicts of canonical tensors with the same keys."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    return max(float((got[k] - ref[k]).abs().max()) for k in ref)
