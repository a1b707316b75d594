"""Greedy rollouts (temperature 0) and the log-prob head in the model's dtype.

Temperature 0 means greedy decoding with log-probs at temperature 1, for the sampler and the head
alike, so a greedy PPO run trains.  In bf16 the head multiplies in bf16 (fp32 accumulation, no
fp32 copy of the output weight) and keeps the softmax statistics in fp32: its only error is the
bf16 rounding of the logits, which the bounds below state.
"""

from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch

from megatron_rl.ops.logprob import logprob_temperature, naive_logprobs, vocab_parallel_logprobs
from megatron_rl.testing.harness import run_distributed
from tests.support.helpers import TINY

VOCAB, PADDED = 1000, 1024


def test_one_temperature_rule():
    assert logprob_temperature(0) == 1.0
    assert logprob_temperature(0.7) == 0.7
    assert logprob_temperature(1.0) == 1.0
    with pytest.raises(ValueError, match=">= 0"):
        logprob_temperature(-0.5)


def _head_inputs(dtype=torch.float32, tokens=24, hidden=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, 1, hidden, generator=g).to(dtype)
    w = (torch.randn(64, hidden, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, 60, (1, tokens), generator=g)
    return h, w, labels


def test_head_at_temperature_zero_scores_at_temperature_one():
    from megatron_rl.models.heads import LogProbHead

    h, w, labels = _head_inputs()
    model = types.SimpleNamespace(output_weight=lambda: w, true_vocab_size=60,
                                  config=types.SimpleNamespace(sequence_parallel=False))
    greedy = LogProbHead(temperature=0.0, chunk_size=5)(model, h, {"labels": labels})
    plain = LogProbHead(temperature=1.0, chunk_size=5)(model, h, {"labels": labels})
    assert torch.isfinite(greedy["logprob"]).all() and torch.isfinite(greedy["entropy"]).all()
    assert torch.equal(greedy["logprob"], plain["logprob"])
    assert torch.equal(greedy["entropy"], plain["entropy"])
    ref_logp, ref_ent = naive_logprobs(h.transpose(0, 1) @ w[:60].t(), labels)
    assert float((greedy["logprob"] - ref_logp).abs().max()) <= 1e-5
    assert float((greedy["entropy"] - ref_ent).abs().max()) <= 1e-5


def test_sampling_at_temperature_zero_is_argmax_with_temperature_one_logprobs():
    from megatron_rl.rollout.sampling import SamplingParams, sample

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=g) * 3
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5)
    tokens, logp = sample(logits, params, torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.isfinite(logp).all()
    assert float((logp - expected).abs().max()) <= 1e-6
    assert params.logprob_temperature == logprob_temperature(0.0) == 1.0


# ----------------------------------------------------------------------------- bf16 head


def _bf16_case(tokens=256, hidden=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, 2, hidden, generator=g).bfloat16()
    w = (torch.randn(PADDED, hidden, generator=g) * 0.3).bfloat16()
    w[VOCAB:] = 0.0  # TP padding rows
    labels = torch.randint(0, VOCAB, (2, tokens), generator=g)
    coef = (torch.randn(2, tokens, generator=g, dtype=torch.float64),
            torch.randn(2, tokens, generator=g, dtype=torch.float64))
    return h, w, labels, coef


def _run(h, w, labels, coef, fn):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = fn(h, w)
    ((logp.double() * coef[0]).sum() + (ent.double() * coef[1]).sum()).backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_bf16_head_against_float64(temperature):
    """Reference: float64 on the same bf16 inputs.  Rounding a logit z to bf16 moves it by at
    most 2^-8 |z|, so log-prob (z_label - logsumexp z) and entropy (logsumexp z - E_p z) move by
    at most 2 * 2^-8 * max|z| / T; the gradients stay within 3% of their largest entry."""
    h, w, labels, coef = _bf16_case()

    def op(hh, ww):
        return vocab_parallel_logprobs(hh, ww, labels, true_vocab_size=VOCAB, temperature=temperature,
                                       chunk_size=100)

    def reference(hh, ww):
        return naive_logprobs(hh.double().transpose(0, 1) @ ww.double()[:VOCAB].t(), labels, temperature)

    logp, ent, grad_h, grad_w = _run(h, w, labels, coef, op)
    ref_logp, ref_ent, ref_h, ref_w = _run(h, w, labels, coef, reference)
    assert logp.dtype == ent.dtype == torch.float32
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16
    max_logit = float((h.double().transpose(0, 1) @ w.double()[:VOCAB].t()).abs().max())
    bound = 2 * 2**-8 * max_logit / temperature
    errors = {"logp": float((logp.double() - ref_logp).abs().max()),
              "entropy": float((ent.double() - ref_ent).abs().max()),
              "grad_hidden": float((grad_h.double() - ref_h).abs().max() / ref_h.abs().max()),
              "grad_weight": float((grad_w.double() - ref_w).abs().max() / ref_w.abs().max())}
    print(f"bf16 head T={temperature}, max|logit| {max_logit:.1f}, bound {bound:.3f}: {errors}")
    assert errors["logp"] <= bound and errors["entropy"] <= bound
    assert errors["grad_hidden"] <= 0.03 and errors["grad_weight"] <= 0.03
    assert float(grad_w[VOCAB:].abs().max()) == 0.0


def test_bf16_head_error_is_only_the_rounding_of_the_logits():
    """Against fp32 softmax statistics of the same bf16 logits (what megatron's output layer and
    the rollout decoder compute), chunking and fp32 statistics add nothing beyond fp32 rounding."""
    h, w, labels, _ = _bf16_case()
    logp, ent = vocab_parallel_logprobs(h, w, labels, true_vocab_size=VOCAB, chunk_size=100)
    ref_logp, ref_ent = naive_logprobs((h.transpose(0, 1) @ w[:VOCAB].t()).float(), labels)
    assert float((logp - ref_logp).abs().max()) <= 1e-5
    assert float((ent - ref_ent).abs().max()) <= 1e-5


def test_bf16_forward_makes_no_fp32_copy_of_the_weight():
    from megatron_rl.utils.memory import track_peak_memory

    g = torch.Generator().manual_seed(0)
    hidden, vocab, tokens = 1024, 8192, 64
    h = torch.randn(tokens, 1, hidden, generator=g).bfloat16()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).bfloat16()
    labels = torch.randint(0, vocab, (1, tokens), generator=g)
    with torch.no_grad(), track_peak_memory() as mem:
        vocab_parallel_logprobs(h, w, labels, true_vocab_size=vocab, chunk_size=16)
    fp32_weight = vocab * hidden * 4
    print(f"bf16 forward peak {mem.peak / 2**20:.2f} MiB; an fp32 weight copy is {fp32_weight / 2**20:.0f} MiB")
    # Two fp32 [16, 8192] buffers plus a bf16 one and per-token vectors: about 1.3 MiB.
    assert mem.peak < 2 * 2**20 < fp32_weight


# ----------------------------------------------------------------------------- a greedy PPO run


def greedy_ppo_body(overrides: list[str]):
    import torch.distributed as dist

    from megatron_rl.config.loader import load_config
    from megatron_rl.trainer.ppo import run_ppo
    from megatron_rl.validation import validate

    cfg = load_config(None, TINY + overrides)
    validate(cfg, dist.get_world_size())
    run_ppo(cfg, log=lambda line: None)
    return True


def test_greedy_ppo_trains(tmp_path):
    """Greedy responses of a tiny random model earn no reward; the entropy bonus still gives the
    actor a gradient, through the head's log-softmax at temperature 1."""
    run_distributed(1, greedy_ppo_body, ["rollout.temperature=0", "algorithm.entropy_coef=0.01", "trainer.steps=2",
                                         f"run.dir={tmp_path}", "run.name=greedy"])
    with open(os.path.join(tmp_path, "greedy", "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["actor/skipped_updates"] == 0 and row["critic/skipped_updates"] == 0
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl", "critic/vf_loss", "actor/grad_norm"):
            assert row[key] is not None and math.isfinite(row[key]), (key, row[key])
        assert row["actor/grad_norm"] > 0
    # The trainer scores the greedy tokens at temperature 1, as the sampler reported them.
    assert rows[0]["rollout/logprob_mismatch_max"] < 1e-4
