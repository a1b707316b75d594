"""Advantage estimators, policy losses and loss aggregations, each against a formula written out here.

Every check has a hand-derived case (the arithmetic in the comments) and a random case in float64
(masks with gaps, odd lengths, empty rows, all-equal and singleton groups) against a plain-Python
loop.  The last tests check layout invariance: the pieces of a batch cut into rows or CP shards
add up to the whole (pure tensors), and the real engine gives the same gradients for micro-batches,
DP and CP (as ``tests/test_ppo.py::test_gradients_do_not_depend_on_how_the_batch_is_cut``).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from megatron_rl.algorithms import kl, losses, rollout_correction, shaping
from megatron_rl.algorithms.advantages import AdvantageBatch, compute
from megatron_rl.testing.harness import run_distributed

TOL = dict(rtol=1e-5, atol=1e-6)
EXACT = dict(rtol=1e-10, atol=1e-12)  # float64 against float64 formulas


def t(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype)


def opts(**kw):
    base = dict(gamma=1.0, lam=1.0, whiten_advantages=False, norm_by_std=True, clip_low=0.2, clip_high=0.2,
                dual_clip=None)
    base.update(kw)
    return SimpleNamespace(**base)


def estimator(name, token_rewards, mask, groups=None, **kw):
    groups = torch.zeros(mask.shape[0], dtype=torch.long) if groups is None else groups
    adv, ret = compute(name, AdvantageBatch(token_rewards, mask, groups), opts(**kw))
    assert ret is None
    return adv


def random_batch(seed, b=9, width=7, dtype=torch.float64):
    """Odd lengths, an empty row, a masked gap; groups of 3, 3, 2 and a singleton."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 0, 5, 1, 6, 2, 7, 4])[:b]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).to(dtype)
    mask[0, 2] = 0.0  # a gap inside a row
    groups = torch.tensor([4, 4, 4, 9, 9, 9, 2, 2, 7])[:b]
    rewards = torch.randn(b, width, generator=g, dtype=dtype) * mask
    return g, mask, groups, rewards


def valid_positions(mask, i):
    return [j for j in range(mask.shape[1]) if mask[i, j] > 0]


def whiten_list(values):
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_against_formula():
    # gamma 0.5: row 0 rewards [0, 0, 1] -> G = [0.25, 0.5, 1]; row 1 [0, 1] (third masked) -> [0.5, 1]
    # whitened over the 5 valid tokens: mean 0.65, population var 0.09 (std 0.3)
    rewards, mask = t([[0.0, 0.0, 1.0], [0.0, 1.0, 9.0]]), t([[1, 1, 1], [1, 1, 0]])
    adv = estimator("reinforce_plus_plus", rewards, mask, gamma=0.5)
    s = math.sqrt(0.09 + 1e-8)
    expected = t([[-0.4 / s, -0.15 / s, 0.35 / s], [-0.15 / s, 0.35 / s, 0.0]])
    assert_close(adv, expected, **TOL)
    # random: discounted reward-to-go over valid tokens (a gap is skipped), then batch whitening
    for seed in range(3):
        _, mask, groups, rewards = random_batch(seed)
        adv = estimator("reinforce_plus_plus", rewards, mask, groups, gamma=0.9)
        returns, where = [], []
        for i in range(mask.shape[0]):
            g_t = 0.0
            row = []
            for j in reversed(valid_positions(mask, i)):
                g_t = float(rewards[i, j]) + 0.9 * g_t
                row.append((j, g_t))
            for j, v in reversed(row):
                returns.append(v)
                where.append((i, j))
        expected = torch.zeros_like(mask, dtype=torch.float32)
        for (i, j), v in zip(where, whiten_list(returns)):
            expected[i, j] = v
        assert_close(adv, expected, **TOL)
        assert (adv[mask == 0] == 0).all()


def test_reinforce_plus_plus_baseline_against_formula():
    # returns 1, 0 (group 0) and 1 (a singleton), one token each: minus group mean -> 0.5, -0.5, 0;
    # whitened: mean 0, population var 1/6
    rewards, mask = t([[1.0], [0.0], [1.0]]), t([[1], [1], [1]])
    adv = estimator("reinforce_plus_plus_baseline", rewards, mask, torch.tensor([0, 0, 1]))
    s = math.sqrt(1 / 6 + 1e-8)
    assert_close(adv, t([[0.5 / s], [-0.5 / s], [0.0]]), **TOL)
    for seed in range(3):
        _, mask, groups, rewards = random_batch(seed)
        adv = estimator("reinforce_plus_plus_baseline", rewards, mask, groups)
        ret = [float(rewards[i].sum()) for i in range(mask.shape[0])]
        members = {int(gi): [i for i in range(len(ret)) if groups[i] == gi] for gi in groups.tolist()}
        centred = [ret[i] - sum(ret[k] for k in members[int(groups[i])]) / len(members[int(groups[i])])
                   for i in range(len(ret))]
        tokens = [(i, j) for i in range(len(ret)) for j in valid_positions(mask, i)]
        expected = torch.zeros_like(mask, dtype=torch.float32)
        for (i, j), v in zip(tokens, whiten_list([centred[i] for i, _ in tokens])):
            expected[i, j] = v
        assert_close(adv, expected, **TOL)


# ---------------------------------------------------------------- Dr.GRPO and its aggregation


def test_drgrpo_against_formula():
    # group 0: [1, 0, 0, 1] -> mean 0.5 -> +-0.5 (no division by the std); group 1 all equal -> 0;
    # group 2 a singleton -> 0
    scores = t([1.0, 0.0, 0.0, 1.0, 0.7, 0.7, 0.7, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    mask = torch.ones(8, 2)
    rewards = torch.zeros(8, 2)
    rewards[:, -1] = scores
    adv = estimator("drgrpo", rewards, mask, groups)
    assert_close(adv[:, 0], t([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]), **TOL)
    assert torch.equal(adv[4:], torch.zeros(4, 2))
    for seed in range(3):
        _, mask, groups, rewards = random_batch(seed)
        adv = estimator("drgrpo", rewards, mask, groups)
        ret = [float(rewards[i].sum()) for i in range(mask.shape[0])]
        for i in range(len(ret)):
            members = [k for k in range(len(ret)) if groups[k] == groups[i]]
            expected = ret[i] - sum(ret[k] for k in members) / len(members)
            assert_close(adv[i], (expected * mask[i]).float(), **TOL)


def test_seq_mean_token_sum_norm_against_formula():
    # rows [1, 2, 3] and [5, 6] valid, one empty row; L = 4: (6/4 + 11/4) / 2 rows = 2.125
    loss = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, float("nan"), 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    num, count = losses.aggregate_parts(loss, mask, "seq-mean-token-sum-norm", horizon=4)
    assert_close(num, torch.tensor(17 / 4), **TOL)
    assert_close(count, torch.tensor(2.0), **TOL)
    assert losses.global_denominator("seq-mean-token-sum-norm", [3, 2, 0]) == 2.0
    with pytest.raises(ValueError, match="horizon"):
        losses.aggregate_parts(loss, mask, "seq-mean-token-sum-norm")
    g, mask, _, _ = random_batch(5)
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64).requires_grad_(True)
    got = losses.aggregate(x, mask, "seq-mean-token-sum-norm", horizon=16)
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    expected = sum(float(x.detach()[i][mask[i] > 0].sum()) / 16 for i in rows) / len(rows)
    assert got.item() == pytest.approx(expected, rel=1e-12)
    (grad,) = torch.autograd.grad(got, x)
    assert_close(grad, mask / (16 * len(rows)), **EXACT)


# ---------------------------------------------------------------- GSPO


def _terms(name, logp, old, adv, mask, agg, **kw):
    o = opts(**{k: kw.pop(k) for k in list(kw) if k in ("clip_low", "clip_high", "dual_clip")})
    num, count, metrics = losses.policy_loss_terms(name, logp, old, adv, mask, o, agg=agg, **kw)
    return num / count, {k: float(v[0] / v[1]) for k, v in metrics.items()}


def test_gspo_hand_case():
    # Token ratios 2.0 and 0.5: s = exp(mean(log 2, log 0.5)) = 1, inside the clip: each token's loss
    # -A s = -1, seq-mean-token-mean -> -1; gradient per token -A s / 2 = -0.5.  Token-level PPO
    # would clip the first token instead (ratio 2 > 1.2, zero gradient there).
    old = t([[-1.0, -2.0]])
    logp = (old + t([[math.log(2.0), math.log(0.5)]])).requires_grad_(True)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    loss, m = _terms("gspo", logp, old, adv, mask, "seq-mean-token-mean")
    assert_close(loss, torch.tensor(-1.0), **TOL)
    assert m["clipfrac"] == 0.0 and m["ratio_mean"] == pytest.approx(1.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, t([[-0.5, -0.5]]), **TOL)
    ppo, _ = _terms("ppo", logp, old, adv, mask, "seq-mean-token-mean")
    (grad,) = torch.autograd.grad(ppo, logp)
    assert_close(grad, t([[0.0, -0.25]]), **TOL)
    # Both ratios 1.5: s = 1.5 > 1.2.  A = +1: clipped -> loss -1.2, no gradient.  A = -1: pg = max(1.5,
    # 1.2) = 1.5, gradient +1.5 / 2 per token.
    logp = (old + math.log(1.5)).requires_grad_(True)
    loss, m = _terms("gspo", logp, old, adv, mask, "seq-mean-token-mean")
    assert_close(loss, torch.tensor(-1.2), **TOL)
    assert m["clipfrac"] == 1.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, torch.zeros(1, 2), **TOL)
    loss, _ = _terms("gspo", logp, old, -adv, mask, "seq-mean-token-mean")
    assert_close(loss, torch.tensor(1.5), **TOL)
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, t([[0.75, 0.75]]), **TOL)
    # A masked third token changes neither the length normalisation nor the result.
    old3, mask3 = t([[-1.0, -2.0, -0.3]]), t([[1, 1, 0]])
    logp3 = (old3 + t([[math.log(2.0), math.log(0.5), 5.0]])).requires_grad_(True)
    loss, _ = _terms("gspo", logp3, old3, torch.ones(1, 3), mask3, "seq-mean-token-mean")
    assert_close(loss, torch.tensor(-1.0), **TOL)


def gspo_formula(logp, old, adv, mask, cl, ch):
    """(loss, grad) of GSPO with seq-mean-token-mean, written out per sequence."""
    rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
    grad = torch.zeros_like(logp)
    total = 0.0
    for i in rows:
        pos = valid_positions(mask, i)
        s = math.exp(sum(float(logp[i, j] - old[i, j]) for j in pos) / len(pos))
        for j in pos:
            a = float(adv[i, j])
            total += max(-a * s, -a * min(max(s, 1 - cl), 1 + ch)) / len(pos)
            clipped = (a > 0 and s > 1 + ch) or (a < 0 and s < 1 - cl)
            grad[i, j] = 0.0 if clipped else -a * s / len(pos) / len(rows)
    return total / len(rows), grad


def test_gspo_against_formula():
    for seed in range(4):
        g, mask, groups, _ = random_batch(seed)
        old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2
        logp = (old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
        adv = torch.randn(mask.shape[0], 1, generator=g, dtype=torch.float64).expand_as(mask) * mask
        loss, _ = _terms("gspo", logp, old, adv, mask, "seq-mean-token-mean", clip_low=0.1, clip_high=0.15)
        (grad,) = torch.autograd.grad(loss, logp)
        expected, expected_grad = gspo_formula(logp.detach(), old, adv, mask, 0.1, 0.15)
        assert loss.item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
        assert_close(grad, expected_grad, **EXACT)


# ---------------------------------------------------------------- CISPO


def test_cispo_hand_case():
    # clip [0.8, 1.28].  Token 0: r = 1.5 -> w = 1.28, A = 1, logp = -1 + log 1.5 = -0.594535:
    # loss -1.28 * -0.594535 = 0.761005, gradient -A w = -1.28 (PPO: clipped, 0).  Token 1: r = 0.5 ->
    # w = 0.8, A = -1, logp = -2 + log 0.5: loss 0.8 * logp, gradient 0.8.  token-mean halves both.
    old = t([[-1.0, -2.0]])
    logp = (old + t([[math.log(1.5), math.log(0.5)]])).requires_grad_(True)
    adv, mask = t([[1.0, -1.0]]), torch.ones(1, 2)
    loss, m = _terms("cispo", logp, old, adv, mask, "token-mean", clip_low=0.2, clip_high=0.28)
    lp = logp.detach()[0].tolist()
    assert_close(loss, torch.tensor((-1.28 * lp[0] + 0.8 * lp[1]) / 2), **TOL)
    assert m["clipfrac"] == 1.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert_close(grad, t([[-0.64, 0.4]]), **TOL)
    ppo, _ = _terms("ppo", logp, old, adv, mask, "token-mean", clip_low=0.2, clip_high=0.28)
    (grad,) = torch.autograd.grad(ppo, logp)
    assert_close(grad, torch.zeros(1, 2), **TOL)  # PPO drops both tokens' gradients


def test_cispo_against_formula():
    for seed in range(3):
        g, mask, _, _ = random_batch(seed)
        old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2
        logp = (old + 0.5 * torch.randn(mask.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
        adv = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
        for agg in ("token-mean", "seq-mean-token-mean"):
            loss, _ = _terms("cispo", logp, old, adv, mask, agg, clip_low=0.3, clip_high=0.5)
            (grad,) = torch.autograd.grad(loss, logp)
            per_tok = torch.zeros_like(mask)
            dgrad = torch.zeros_like(mask)
            lp = logp.detach()
            for i in range(mask.shape[0]):
                for j in valid_positions(mask, i):
                    w = min(max(math.exp(float(lp[i, j] - old[i, j])), 0.7), 1.5)
                    per_tok[i, j] = -float(adv[i, j]) * w * float(lp[i, j])
                    dgrad[i, j] = -float(adv[i, j]) * w
            if agg == "token-mean":
                n = mask.sum()
                expected, expected_grad = per_tok.sum() / n, dgrad / n
            else:
                rows = [i for i in range(mask.shape[0]) if mask[i].sum() > 0]
                lens = mask.sum(-1).clamp(min=1)
                expected = sum(per_tok[i].sum() / lens[i] for i in rows) / len(rows)
                expected_grad = dgrad / lens[:, None] / len(rows)
            assert loss.item() == pytest.approx(float(expected), rel=1e-10)
            assert_close(grad, expected_grad, **EXACT)


# ---------------------------------------------------------------- KL estimators


def test_kl_estimators_against_formula():
    g = torch.Generator().manual_seed(3)
    logp = (torch.randn(40, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ref = torch.randn(40, generator=g, dtype=torch.float64) * 3
    d = (logp - ref).detach()
    r = (-d).clamp(-20, 20)
    k3 = (torch.exp(r) - r - 1).clamp(0, 10)
    inside = (torch.exp(r) - r - 1 < 10).double()
    expect = {
        "k1": (d, torch.ones_like(d)), "kl": (d, torch.ones_like(d)),
        "k2": (0.5 * d * d, d), "mse": (0.5 * d * d, d),
        "k3": (k3, (1 - torch.exp(r)) * inside), "low_var_kl": (k3, (1 - torch.exp(r)) * inside),
        "abs": (d.abs(), torch.sign(d)),
        "k3+": (k3, d), "low_var_kl+": (k3, d),
    }
    assert set(expect) == set(kl.KL_NAMES)
    for name, (value, grad) in expect.items():
        est = kl.estimate(logp, ref, name)
        assert_close(est.detach(), value, **EXACT)
        (got,) = torch.autograd.grad(est.sum(), logp)
        assert_close(got, grad, **EXACT)


# ---------------------------------------------------------------- rollout correction, overlong shaping


def test_rollout_correction_tis_and_mis_token_and_sequence():
    # token log-weights old - rollout = [0.5, -0.5, 0] (row 0) and [1, 0, masked] (row 1)
    old = t([[-1.0, -1.0, -2.0], [-1.0, -1.0, 7.0]])
    rollout = t([[-1.5, -0.5, -2.0], [-2.0, -1.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    e5, e, em5 = math.exp(0.5), math.e, math.exp(-0.5)
    w, m = rollout_correction.correction_weights(old, rollout, mask, "tis", "token", threshold=1.5)
    assert_close(w, t([[1.5, em5, 1.0], [1.5, 1.0, 0.0]]), **TOL)
    assert m["rollout_correction/truncated_frac"] == pytest.approx(2 / 5)
    assert m["rollout_correction/weight_max"] == pytest.approx(e)
    assert m["rollout_correction/weight_mean"] == pytest.approx((e5 + em5 + 1 + e + 1) / 5)
    w, m = rollout_correction.correction_weights(old, rollout, mask, "mis", "token", threshold=1.5)
    assert_close(w, t([[0.0, em5, 1.0], [0.0, 1.0, 0.0]]), **TOL)
    assert m["rollout_correction/masked_frac"] == pytest.approx(2 / 5)
    w, m = rollout_correction.correction_weights(old, rollout, mask, "is", "token", threshold=1.5)
    assert_close(w, t([[e5, em5, 1.0], [e, 1.0, 0.0]]), **TOL)
    assert m["rollout_correction/above_threshold_frac"] == pytest.approx(2 / 5)
    assert m["rollout_correction/applied_mean"] == pytest.approx((e5 + em5 + 1 + e + 1) / 5)
    # sequence level: row 0 sums to 0 (w = 1), row 1 to 1 (w = e)
    w, m = rollout_correction.correction_weights(old, rollout, mask, "tis", "sequence", threshold=2.0)
    assert_close(w, t([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]), **TOL)
    assert m["rollout_correction/truncated_frac"] == pytest.approx(0.5)
    assert m["rollout_correction/weight_mean"] == pytest.approx((1 + e) / 2)
    w, m = rollout_correction.correction_weights(old, rollout, mask, "mis", "sequence", threshold=2.0)
    assert_close(w, t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), **TOL)
    assert m["rollout_correction/applied_mean"] == pytest.approx(0.5)
    # random: against the formula, and weights multiply the per-token policy loss
    g, mask, _, _ = random_batch(1, dtype=torch.float32)
    old = -torch.rand(mask.shape, generator=g) * 3
    rollout = old + 0.4 * torch.randn(mask.shape, generator=g)
    for mode in ("is", "tis", "mis"):
        for level in ("token", "sequence"):
            w, _ = rollout_correction.correction_weights(old, rollout, mask, mode, level, threshold=1.3)
            for i in range(mask.shape[0]):
                pos = valid_positions(mask, i)
                seq = math.exp(sum(float(old[i, j] - rollout[i, j]) for j in pos))
                for j in range(mask.shape[1]):
                    raw = seq if level == "sequence" else math.exp(float(old[i, j] - rollout[i, j]))
                    cut = {"is": raw, "tis": min(raw, 1.3), "mis": raw if raw <= 1.3 else 0.0}[mode]
                    want = cut if j in pos else 0.0
                    assert float(w[i, j]) == pytest.approx(want, rel=1e-5, abs=1e-7)
    logp = (old + 0.1).requires_grad_(True)
    adv = torch.randn(mask.shape, generator=g) * mask
    w, _ = rollout_correction.correction_weights(old, rollout, mask, "tis", "token", threshold=1.3)
    plain, _, _ = losses.policy_loss_terms("ppo", logp, old, adv, mask, opts())
    weighted, _, _ = losses.policy_loss_terms("ppo", logp, old, adv, mask, opts(), weights=w)
    per_tok = -adv * math.exp(0.1)  # every ratio is e^0.1, inside the clip
    assert_close(weighted, (per_tok * w * mask).sum(), **TOL)
    assert_close(plain, (per_tok * mask).sum(), **TOL)


def test_decoupled_ppo_is_ppo_against_the_proximal_policy_times_the_behaviour_weight():
    """``rollout_correction.mode=is`` with the recomputed ``old`` log-probs: the ratio is clipped
    against the proximal policy and the loss weighted by pi_prox / pi_behaviour, by hand."""
    behaviour = t([[-1.0, -0.5]])
    proximal = t([[-0.8, -0.8]])
    logp = t([[-0.5, -1.1]]).requires_grad_(True)
    adv, mask = t([[1.0, -1.0]]), t([[1, 1]])
    w, _ = rollout_correction.correction_weights(proximal, behaviour, mask, "is", "token", threshold=2.0)
    loss, _, _ = losses.policy_loss_terms("ppo", logp, proximal, adv, mask, opts(), weights=w)
    # token 0: r = e^0.3 > 1.2 with A > 0 -> clipped at 1.2, weight e^0.2;
    # token 1: r = e^-0.3 < 0.8 with A < 0 -> clipped at 0.8 (the larger loss), weight e^-0.3.
    want = -1.2 * math.exp(0.2) + 0.8 * math.exp(-0.3)
    assert float(loss) == pytest.approx(want, rel=1e-6)
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros_like(logp))  # both clipped: no gradient
    # Inside the clip the gradient is the weighted policy gradient: d/dlogp (-w r A) = -w r A.
    logp = t([[-0.75, -0.8]]).requires_grad_(True)
    loss, _, _ = losses.policy_loss_terms("ppo", logp, proximal, adv, mask, opts(), weights=w)
    loss.backward()
    want_grad = t([[-math.exp(0.2) * math.exp(0.05), math.exp(-0.3)]])
    assert_close(logp.grad, want_grad, **TOL)


def test_overlong_penalty_hand_values():
    # L = 10, buffer 4, factor 0.5: free up to 6 tokens, then -0.5 * (n - 6) / 4, capped at -0.5
    got = shaping.overlong_penalty([3, 6, 7, 8, 10, 12], max_new_tokens=10, buffer=4, factor=0.5)
    assert_close(got, t([0.0, 0.0, -0.125, -0.25, -0.5, -0.5]), **TOL)
    assert torch.equal(shaping.overlong_penalty([3, 10], 10, 0, 1.0), torch.zeros(2))
    with pytest.raises(ValueError, match="buffer"):
        shaping.overlong_penalty([3], 10, 11, 1.0)


# ---------------------------------------------------------------- layout invariance


NEW_LOSSES = [("gspo", "seq-mean-token-mean", False), ("cispo", "token-mean", True),
              ("ppo", "seq-mean-token-sum-norm", True), ("gspo", "token-mean", True)]


@pytest.mark.parametrize("name,agg,weighted", NEW_LOSSES)
def test_loss_pieces_split_invariance(name, agg, weighted):
    """Rows cut into pieces (micro-batches, DP) and CP shards of every row add up to the whole batch."""
    g, mask, _, _ = random_batch(7, width=8)
    mask[0, 2] = 1.0
    old = -torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2
    logp = (old + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    weights = torch.rand(mask.shape, generator=g, dtype=torch.float64) * 2 if weighted else None
    full_len = mask.sum(-1)
    o = opts(clip_low=0.1, clip_high=0.2)

    def piece(rows, cols, full_row_sum):
        w = None if weights is None else weights[rows][:, cols]
        return losses.policy_loss_terms(name, logp[rows][:, cols], old[rows][:, cols], adv[rows][:, cols],
                                        mask[rows][:, cols], o, agg=agg, seq_lengths=full_len[rows], horizon=8,
                                        weights=w, row_sum=lambda x: full_row_sum[rows])

    full_sum = torch.where(mask > 0, logp.detach() - old, torch.zeros_like(old)).sum(-1)
    all_cols = torch.arange(8)
    num, count, _ = piece(torch.arange(9), all_cols, full_sum)
    whole = num / count
    (whole_grad,) = torch.autograd.grad(whole, logp)
    row_cuts = [torch.arange(0, 4), torch.arange(4, 9)]
    cp_cuts = [torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])]  # zigzag shards of CP2
    for cut in ([(r, all_cols) for r in row_cuts], [(torch.arange(9), c) for c in cp_cuts],
                [(r, c) for r in row_cuts for c in cp_cuts]):
        parts = [piece(r, c, full_sum) for r, c in cut]
        total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
        assert_close(total, whole, **EXACT)
        (grad,) = torch.autograd.grad(total, logp)
        assert_close(grad, whole_grad, **EXACT)


def layout_body(layout_kw: dict, micro_batch_size: int, name: str, agg: str, weighted: bool, weights):
    """Actor loss of policy loss ``name`` on a fixed batch; returns canonical gradients (and the weights)."""
    from megatron_rl.config.schema import AlgorithmConfig
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.trainer.update import actor_loss_fn, loss_denominator
    from tests.support.helpers import CUT_BATCH_LENGTHS, response_mask, small_actor

    trainable, weights = small_actor(layout_kw, weights)
    g = torch.Generator().manual_seed(11)
    seqs, lengths = [], []
    for n_prompt, n_resp in CUT_BATCH_LENGTHS:
        n = n_prompt + n_resp
        mask = response_mask(n_prompt, n_resp)
        # old log-probs near the untrained model's (about -log 64), so ratios stay near 1 and clips act on some
        seq = {"tokens": torch.randint(0, 64, (n,), generator=g), "loss_mask": mask,
               "old_logprob": (-4.16 + 0.3 * torch.randn(n, generator=g)) * mask,
               "advantages": torch.randn(n_resp, generator=g).mean() * mask + 0.5 * torch.randn(n, generator=g) * mask}
        if weighted:
            seq["rollout_weight"] = torch.rand(n, generator=g) * 2 * mask
        seqs.append(seq)
        lengths.append(n_resp)
    alg = AlgorithmConfig(policy_loss=name, loss_agg=agg, clip_low=0.1, clip_high=0.15)
    trainable.zero_grad()
    run_sequences(trainable.chunks, seqs, LogProbHead(with_entropy=False), BatchPlan(micro_batch_size=micro_batch_size),
                  torch.device("cpu"), loss_fn=actor_loss_fn(alg, loss_denominator(agg, lengths), lengths, 0.0, 16),
                  forward_only=False)
    return {"grads": gather_canonical(trainable.chunks, "grad"), "weights": weights}


@pytest.mark.parametrize("name,agg,weighted", NEW_LOSSES[:3])
def test_loss_gradients_do_not_depend_on_how_the_batch_is_cut(name, agg, weighted):
    ref = run_distributed(1, layout_body, {}, 8, name, agg, weighted, None)[0]
    assert max(float(g.abs().max()) for g in ref["grads"].values()) > 1e-4
    for world, layout, mbs in [(1, {}, 2), (2, {}, 1), (2, dict(cp=2), 2), (4, dict(cp=2), 1)]:
        got = run_distributed(world, layout_body, layout, mbs, name, agg, weighted, ref["weights"])[0]
        worst = max(float((got["grads"][k] - ref["grads"][k]).abs().max()) for k in ref["grads"])
        print(f"{name} {agg} weighted={weighted} world={world} {layout} micro_batch_size={mbs}: "
              f"max |dgrad| {worst:.2e}")
        assert worst <= 1e-6, (name, agg, world, layout, mbs, worst)
