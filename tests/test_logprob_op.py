"""The chunked vocab-parallel log-prob / entropy op against the naive full-logits computation."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.ops.logprob import naive_logprobs, vocab_parallel_logprobs
from megatron_rl.testing.harness import run_distributed
from megatron_rl.utils.memory import track_peak_memory


def _case(tokens=96, hidden=32, vocab=101, padded=128, batch=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    # float64 so that the comparison measures the algorithm, not fp32 rounding.
    h = torch.randn(tokens, batch, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(padded, hidden, generator=g, dtype=torch.float64) * 0.3
    w[vocab:] = 0.0  # TP padding rows
    labels = torch.randint(0, vocab, (batch, tokens), generator=g)
    coef = (torch.randn(batch, tokens, generator=g, dtype=torch.float64),
            torch.randn(batch, tokens, generator=g, dtype=torch.float64))
    return h, w, labels, coef


def _naive(h, w, labels, vocab, temperature):
    logits = (h.transpose(0, 1) @ w[:vocab].t())
    return naive_logprobs(logits, labels, temperature)


@pytest.mark.parametrize("temperature,chunk", [(1.0, 7), (0.7, 1000)])
def test_matches_naive_forward_and_gradients(temperature, chunk):
    h, w, labels, (a, b) = _case()
    vocab = 101
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(h1, w1, labels, true_vocab_size=vocab, temperature=temperature,
                                        chunk_size=chunk)
    ((logp * a).sum() + (ent * b).sum()).backward()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_logp, ref_ent = _naive(h2, w2, labels, vocab, temperature)
    ((ref_logp * a).sum() + (ref_ent * b).sum()).backward()
    diffs = {
        "logp": (logp - ref_logp).abs().max().item(),
        "entropy": (ent - ref_ent).abs().max().item(),
        "grad_hidden": (h1.grad - h2.grad).abs().max().item(),
        "grad_weight": (w1.grad - w2.grad).abs().max().item(),
    }
    print(diffs)
    assert diffs["logp"] <= 1e-6 and diffs["entropy"] <= 1e-6
    assert diffs["grad_hidden"] <= 1e-6 and diffs["grad_weight"] <= 1e-6
    # Padded vocabulary rows get no gradient and no probability mass.
    assert float(w1.grad[vocab:].abs().max()) == 0.0


def test_padded_vocab_never_leaks():
    h, w, labels, _ = _case()
    w[101:] = 5.0  # padding rows that would dominate the softmax if they were not masked
    logp, ent = vocab_parallel_logprobs(h, w, labels, true_vocab_size=101)
    ref_logp, ref_ent = _naive(h, w, labels, 101, 1.0)
    assert (logp - ref_logp).abs().max() <= 1e-5 and (ent - ref_ent).abs().max() <= 1e-5


def _tp_body(temperature):
    from megatron_rl.distributed.runtime import active_groups
    from megatron_rl.testing.layouts import use_layout

    use_layout(tp=2)
    tp = active_groups().tp
    h, w, labels, (a, b) = _case(vocab=101, padded=128)
    shard = w.chunk(2)[tp.rank()].clone().requires_grad_()
    hh = h.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(hh, shard, labels, true_vocab_size=101, temperature=temperature,
                                        chunk_size=17, tp_group=tp)
    ((logp * a).sum() + (ent * b).sum()).backward()
    return logp.detach(), ent.detach(), hh.grad, shard.grad


def test_tensor_parallel_shards_match_naive():
    results = run_distributed(2, _tp_body, 0.9)
    h, w, labels, (a, b) = _case(vocab=101, padded=128)
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_logp, ref_ent = _naive(h2, w2, labels, 101, 0.9)
    ((ref_logp * a).sum() + (ref_ent * b).sum()).backward()
    for logp, ent, grad_h, _ in results:
        assert (logp - ref_logp).abs().max() <= 1e-5 and (ent - ref_ent).abs().max() <= 1e-5
        # copy_to_tensor_model_parallel_region sums the partial hidden grads over TP.
        assert (grad_h - h2.grad).abs().max() <= 1e-6
    grad_w = torch.cat([r[3] for r in results])
    assert (grad_w - w2.grad).abs().max() <= 1e-6


def test_a_vocabulary_shard_without_its_group_is_refused():
    """A caller that forgets the tensor-parallel group would score one shard as the whole
    vocabulary; the op refuses instead of returning wrong log-probs."""
    h, w, labels, _ = _case(vocab=101, padded=128)
    with pytest.raises(ValueError, match="tp_group"):
        vocab_parallel_logprobs(h, w.chunk(2)[0], labels, true_vocab_size=101)


def _peak(fn) -> int:
    with track_peak_memory() as mem:
        fn()
    return mem.peak


def test_extra_memory_below_a_quarter_of_naive_at_2k_tokens():
    tokens, hidden, vocab = 2048, 64, 16384
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, 1, hidden, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g)

    def op():  # the logits recomputed in backward (batch.logprob_keep_logits_gib=0)
        logp, ent = vocab_parallel_logprobs(h, w, labels, true_vocab_size=vocab, chunk_size=256,
                                            keep_logits_bytes=0)
        (logp.sum() + ent.sum()).backward()

    def naive():
        logp, ent = naive_logprobs(h.transpose(0, 1) @ w.t(), labels)
        (logp.sum() + ent.sum()).backward()

    op_bytes, naive_bytes = _peak(op), _peak(naive)
    ratio = op_bytes / naive_bytes
    print(f"peak extra memory at {tokens} tokens x {vocab} vocab: op {op_bytes / 2**20:.1f} MiB, "
          f"naive {naive_bytes / 2**20:.1f} MiB, ratio {ratio:.3f}")
    assert naive_bytes > tokens * vocab * 4  # the naive path really holds [tokens, vocab] fp32
    assert ratio < 0.25


def _keep_or_recompute(dtype, temperature: float, with_entropy: bool, keep_bytes: float, tp=None):
    h, w, labels, (a, b) = _case(tokens=40, vocab=101, padded=128)
    if tp is not None:
        w = w.chunk(2)[tp.rank()]
    hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    logp, ent = vocab_parallel_logprobs(hh, ww, labels, true_vocab_size=101, temperature=temperature, chunk_size=17,
                                        with_entropy=with_entropy, keep_logits_bytes=keep_bytes, tp_group=tp)
    loss = (logp.double() * a).sum() + ((ent.double() * b).sum() if with_entropy else 0.0)
    loss.backward()
    return [t.detach().clone() for t in (logp, ent, hh.grad, ww.grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature,with_entropy", [(1.0, True), (0.7, True), (1.0, False)])
def test_kept_logits_give_the_recomputed_bits(dtype, temperature, with_entropy):
    """Keeping the logits for backward (batch.logprob_keep_logits_gib) saves the second output
    projection and changes no bit of the log-probs, the entropy or either gradient."""
    kept = _keep_or_recompute(dtype, temperature, with_entropy, 2**30)
    recomputed = _keep_or_recompute(dtype, temperature, with_entropy, 0)
    for x, y in zip(kept, recomputed):
        assert torch.equal(x, y)


def _keep_tp_body():
    from megatron_rl.distributed.runtime import active_groups
    from megatron_rl.testing.layouts import use_layout

    use_layout(tp=2)
    return [_keep_or_recompute(torch.float32, 0.9, True, keep, active_groups().tp) for keep in (2**30, 0)]


def test_kept_logits_give_the_recomputed_bits_on_tensor_parallel_shards():
    for kept, recomputed in run_distributed(2, _keep_tp_body):
        for x, y in zip(kept, recomputed):
            assert torch.equal(x, y)


def test_logits_are_kept_only_within_the_bound():
    """At 2048 tokens x 16384 vocabulary the fp32 logits are 128 MiB: kept under a 256 MiB bound (the
    peak grows by about their size), recomputed under a 64 MiB one (the chunked op's peak)."""
    from megatron_rl.ops.logits_memory import keeps_logits

    tokens, hidden, vocab = 2048, 64, 16384
    logits = tokens * vocab * 4
    assert keeps_logits(tokens, vocab, 2 * logits) and not keeps_logits(tokens, vocab, logits // 2)
    assert not keeps_logits(tokens, vocab, 0)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, 1, hidden, generator=g) * 0.5).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.1).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=g)

    def op(keep):
        logp, ent = vocab_parallel_logprobs(h, w, labels, true_vocab_size=vocab, chunk_size=256, keep_logits_bytes=keep)
        (logp.sum() + ent.sum()).backward()

    kept, recomputed, under = _peak(lambda: op(2 * logits)), _peak(lambda: op(0)), _peak(lambda: op(logits // 2))
    print(f"peak: kept {kept / 2**20:.1f} MiB, recomputed {recomputed / 2**20:.1f} MiB, "
          f"over the bound {under / 2**20:.1f} MiB")
    assert under == recomputed
    # About their size: less a chunk's [256, vocab] buffer that the backward no longer rebuilds.
    assert 0.85 * logits <= kept - recomputed <= 1.1 * logits


def _tp_bf16_body():
    from megatron_rl.distributed.runtime import active_groups
    from megatron_rl.testing.layouts import use_layout

    use_layout(tp=2)
    tp = active_groups().tp
    h, w, labels, (a, b) = _case(vocab=101, padded=128)
    shard = w.bfloat16().chunk(2)[tp.rank()].clone().requires_grad_()
    hh = h.bfloat16().requires_grad_()
    logp, ent = vocab_parallel_logprobs(hh, shard, labels, true_vocab_size=101, chunk_size=17, tp_group=tp)
    ((logp.double() * a).sum() + (ent.double() * b).sum()).backward()
    return logp.detach(), ent.detach(), hh.grad, shard.grad


def test_bf16_tensor_parallel_shards_against_float64():
    """bf16 weights on two TP ranks (the second one mostly padding) against float64 on the same
    bf16 values: log-probs and entropy within 2 * 2^-8 * max|logit| (the bf16 rounding of the
    logits), gradients within 3% of their largest entry."""
    results = run_distributed(2, _tp_bf16_body)
    h, w, labels, (a, b) = _case(vocab=101, padded=128)
    h2 = h.bfloat16().double().requires_grad_()
    w2 = w.bfloat16().double().requires_grad_()
    ref_logp, ref_ent = _naive(h2, w2, labels, 101, 1.0)
    ((ref_logp * a).sum() + (ref_ent * b).sum()).backward()
    bound = 2 * 2**-8 * float((h2.detach().transpose(0, 1) @ w2.detach()[:101].t()).abs().max())
    for logp, ent, grad_h, _ in results:
        assert logp.dtype == torch.float32 and grad_h.dtype == torch.bfloat16
        assert (logp.double() - ref_logp).abs().max() <= bound and (ent.double() - ref_ent).abs().max() <= bound
        assert (grad_h.double() - h2.grad).abs().max() <= 0.03 * h2.grad.abs().max()
    grad_w = torch.cat([r[3] for r in results]).double()
    assert (grad_w - w2.grad).abs().max() <= 0.03 * w2.grad.abs().max()
    assert float(grad_w[101:].abs().max()) == 0.0
