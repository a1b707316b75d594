"""Hand-computed checks of the RL math (advantages, KL, losses) and of loss-sharding invariance."""

import math

import pytest
import torch
from torch.testing import assert_close

from megatron_rl.algorithms import advantages, kl, losses

TOL = dict(rtol=1e-5, atol=1e-6)
NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------- GAE / whitening

REWARDS, VALUES = t([[1.0, 0.0, 2.0]]), t([[0.5, 1.0, 1.5]])


def test_gae_gamma1_lam1_is_reward_to_go_minus_value():
    # returns = reward-to-go = [1+0+2, 0+2, 2] = [3, 2, 2]; adv = returns - V = [2.5, 1.0, 0.5]
    adv, ret = advantages.compute_gae(REWARDS, VALUES, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert_close(adv, t([[2.5, 1.0, 0.5]]), **TOL)
    assert_close(ret, t([[3.0, 2.0, 2.0]]), **TOL)


def test_gae_discounted():
    # gamma*lam = 0.72
    # t=2: delta = 2 + 0.9*0   - 1.5 = 0.5 ; A2 = 0.5
    # t=1: delta = 0 + 0.9*1.5 - 1.0 = 0.35; A1 = 0.35 + 0.72*0.5  = 0.71
    # t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4 ; A0 = 1.4  + 0.72*0.71 = 1.9112
    # returns = A + V = [2.4112, 1.71, 2.0]
    adv, ret = advantages.compute_gae(REWARDS, VALUES, torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert_close(adv, t([[1.9112, 0.71, 0.5]]), **TOL)
    assert_close(ret, t([[2.4112, 1.71, 2.0]]), **TOL)
    assert not adv.requires_grad


def test_gae_masked_tail_and_gap_do_not_leak():
    expected_adv = t([[1.9112, 0.71, 0.5]])
    # masked tail with garbage rewards / values
    r = t([[1.0, 0.0, 2.0, 50.0, -7.0]])
    v = t([[0.5, 1.0, 1.5, 9.0, 3.0]])
    m = t([[1, 1, 1, 0, 0]])
    adv, ret = advantages.compute_gae(r, v, m, gamma=0.9, lam=0.8)
    assert_close(adv[:, :3], expected_adv, **TOL)
    assert_close(adv[:, 3:], torch.zeros(1, 2), **TOL)
    assert_close(ret[:, 3:], torch.zeros(1, 2), **TOL)
    # a masked gap in the middle is skipped: next value / advantage carried across it
    r = t([[1.0, 99.0, 0.0, 2.0]])
    v = t([[0.5, -4.0, 1.0, 1.5]])
    m = t([[1, 0, 1, 1]])
    adv, ret = advantages.compute_gae(r, v, m, gamma=0.9, lam=0.8)
    assert_close(adv, t([[1.9112, 0.0, 0.71, 0.5]]), **TOL)
    assert_close(ret, t([[2.4112, 0.0, 1.71, 2.0]]), **TOL)


def test_gae_rows_are_independent():
    r = torch.cat([REWARDS, t([[0.0, 0.0, 0.0]])])
    v = torch.cat([VALUES, t([[1.0, 1.0, 1.0]])])
    m = t([[1, 1, 1], [1, 0, 0]])
    adv, _ = advantages.compute_gae(r, v, m, gamma=1.0, lam=1.0)
    assert_close(adv, t([[2.5, 1.0, 0.5], [-1.0, 0.0, 0.0]]), **TOL)


def test_whiten_population_variance():
    # valid [1, 2, 3]: mean 2, population var 2/3, std 0.8164966
    x, m = t([[1.0, 2.0, 3.0, 100.0]]), t([[1, 1, 1, 0]])
    s = 1 / math.sqrt(2 / 3)
    assert_close(advantages.whiten(x, m), t([[-s, 0.0, s, 0.0]]), **TOL)
    assert_close(advantages.whiten(x, m, shift_mean=False), t([[2 - s, 2.0, 2 + s, 0.0]]), **TOL)


# ---------------------------------------------------------------- GRPO / RLOO

def test_grpo_two_groups_and_singleton():
    # group 0: scores 1, 2, 3 -> mean 2, unbiased var (1+0+1)/2 = 1 -> adv -1, 0, 1
    # group 1: scores 4, 10   -> mean 7, unbiased var (9+9)/1 = 18, std 4.2426407 -> adv -/+0.7071068
    # group 2: a single sample -> 0
    scores = t([1.0, 4.0, 2.0, 10.0, 3.0, 5.0])
    groups = torch.tensor([0, 1, 0, 1, 0, 2])
    mask = t([[1, 1], [1, 0], [1, 1], [1, 1], [0, 0], [1, 1]])
    adv = advantages.compute_grpo(scores, groups, mask, eps=0.0)
    per_seq = t([-1.0, -3 / math.sqrt(18), 0.0, 3 / math.sqrt(18), 1.0, 0.0])
    assert_close(adv, per_seq[:, None] * mask, **TOL)
    assert torch.isfinite(adv).all()
    adv = advantages.compute_grpo(scores, groups, mask, norm_by_std=False)
    assert_close(adv, t([-1.0, -3.0, 0.0, 3.0, 1.0, 0.0])[:, None] * mask, **TOL)


def test_grpo_equal_scores_and_default_eps():
    adv = advantages.compute_grpo(t([2.0, 2.0, 1.0, 3.0]), torch.tensor([5, 5, 9, 9]), torch.ones(4, 1))
    # group 9: mean 2, unbiased std sqrt(2) -> -/+ 1/(sqrt(2)+1e-6)
    a = 1 / (math.sqrt(2) + 1e-6)
    assert_close(adv, t([[0.0], [0.0], [-a], [a]]), **TOL)


def test_rloo_hand_case():
    # group 0: 1 - (2+3)/2 = -1.5 ; 2 - (1+3)/2 = 0 ; 3 - (1+2)/2 = 1.5
    # group 1: 4 - 10 = -6 ; 10 - 4 = 6
    scores = t([1.0, 4.0, 2.0, 10.0, 3.0])
    groups = torch.tensor([0, 1, 0, 1, 0])
    mask = t([[1, 1, 0]] * 5)
    adv = advantages.compute_rloo(scores, groups, mask)
    assert_close(adv, t([-1.5, -6.0, 0.0, 6.0, 1.5])[:, None] * mask, **TOL)


def test_rloo_singleton_group_raises():
    with pytest.raises(ValueError, match=r"n >= 2.*\[5\]"):
        advantages.compute_rloo(t([1.0, 2.0, 3.0]), torch.tensor([0, 0, 5]), torch.ones(3, 2))


def test_estimator_names():
    assert tuple(advantages.ADVANTAGE_ESTIMATORS)[:3] == ("gae", "grpo", "rloo")
    assert advantages.needs_critic("gae")
    assert not advantages.needs_critic("grpo") and not advantages.needs_critic("rloo")
    assert advantages.needs_groups("grpo") and advantages.needs_groups("rloo") and not advantages.needs_groups("gae")
    with pytest.raises(ValueError, match="gae, grpo, rloo"):
        advantages.needs_critic("ppo")


# ---------------------------------------------------------------- KL

LOGP, REF = t([-1.0, -2.0]), t([-1.5, -1.0])


def test_kl_kinds_hand_values():
    # k1 = logp - ref = [0.5, -1.0]; k2 = 0.5 * k1^2 = [0.125, 0.5]
    # k3: r = ref - logp = [-0.5, 1.0]; exp(-0.5) + 0.5 - 1 = 0.1065307; e - 2 = 0.7182818
    assert_close(kl.estimate(LOGP, REF, "k1"), t([0.5, -1.0]), **TOL)
    assert_close(kl.estimate(LOGP, REF, "k2"), t([0.125, 0.5]), **TOL)
    k3 = t([math.exp(-0.5) - 0.5, math.e - 2.0])
    assert_close(kl.estimate(LOGP, REF, "k3"), k3, **TOL)
    assert_close(kl.estimate(LOGP, REF, "low_var_kl"), k3, **TOL)
    assert_close(kl.estimate(LOGP, REF, "mse"), t([0.125, 0.5]), **TOL)
    assert tuple(kl.KL_ESTIMATORS)[:3] == ("k1", "k2", "k3")


def test_k3_nonnegative_and_finite():
    g = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(64, 32, generator=g) * 10, torch.randn(64, 32, generator=g) * 10
    logp[0, 0], ref[0, 0] = -200.0, 0.0  # exp(200) would overflow without the clamp
    k3 = kl.estimate(logp, ref, "k3")
    assert (k3 >= 0).all() and torch.isfinite(k3).all()
    assert_close(kl.estimate(ref, ref, "k3"), torch.zeros_like(ref), **TOL)


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="k1, kl, k2, mse, k3, low_var_kl"):
        kl.estimate(LOGP, REF, "k4")


def test_adaptive_controller_update_and_state():
    c = kl.AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    # error = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2 ; coef = 0.1 * (1 + 0.2*256/10000) = 0.100512
    c.update(9.0, n_steps=256)
    assert c.value == pytest.approx(0.100512, rel=1e-12)
    # error = 6.6/6 - 1 = 0.1 (inside the clip) ; coef *= 1 + 0.1*100/10000 = 1.001
    c.update(torch.tensor(6.6), n_steps=100)
    assert c.value == pytest.approx(0.100512 * 1.001, rel=1e-6)
    # error clipped at -0.2 ; coef *= 1 - 0.2*500/10000 = 0.99
    before = c.value
    c.update(0.0, n_steps=500)
    assert c.value == pytest.approx(before * 0.99, rel=1e-12)
    fresh = kl.make_kl_controller("adaptive", 0.5, target=6.0, horizon=10000)
    fresh.load_state_dict(c.state_dict())
    assert fresh.value == c.value
    fresh.update(9.0, 256)
    c.update(9.0, 256)
    assert fresh.value == c.value


def test_fixed_controller_and_factory():
    c = kl.make_kl_controller("fixed", 0.05)
    c.update(100.0, 1000)
    assert c.value == 0.05
    other = kl.FixedKLController(0.3)
    other.load_state_dict(c.state_dict())
    assert other.value == 0.05
    with pytest.raises(ValueError):
        kl.make_kl_controller("adaptive", 0.1)  # target / horizon missing
    with pytest.raises(ValueError):
        kl.make_kl_controller("pid", 0.1)
    with pytest.raises(ValueError):
        kl.AdaptiveKLController(0.1, 6.0, 100).load_state_dict(c.state_dict())


def test_apply_kl_penalty():
    rewards = t([[0.0, 0.0, 1.0, 5.0]])
    logp, ref = t([[-1.0, -2.0, -0.5, -9.0]]), t([[-1.5, -1.0, -0.5, 0.0]])
    mask = t([[1, 1, 1, 0]])
    # k1 on valid tokens = [0.5, -1.0, 0.0]; rewards - 0.1*kl = [-0.05, 0.1, 1.0]; masked reward unchanged
    out, k = kl.apply_kl_penalty(rewards, logp, ref, mask, coef=0.1)
    assert_close(k, t([[0.5, -1.0, 0.0, 0.0]]), **TOL)
    assert_close(out, t([[-0.05, 0.1, 1.0, 5.0]]), **TOL)


# ---------------------------------------------------------------- policy / value loss

def _policy_batch():
    # ratios [1.5, 1.1, 4.0, 0.5] and a masked 5th token; advantages [1, 1, -1, -1]
    ratios = t([[1.5, 1.1, 4.0, 0.5, 1.0]])
    old = t([[-1.0, -2.0, -0.3, -0.7, -1.0]])
    logp = (old + ratios.log()).requires_grad_(True)
    adv = t([[1.0, 1.0, -1.0, -1.0, 123.0]])
    mask = t([[1, 1, 1, 1, 0]])
    return logp, old, adv, mask


def test_policy_loss_clip_active_and_inactive():
    # ratio 1.5, A = 1, clip 0.2: pg1 = -1.5, pg2 = -1.2 -> max = -1.2 (clipped, zero gradient)
    logp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss, m = losses.policy_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.2)
    assert_close(loss, torch.tensor(-1.2), **TOL)
    assert_close(m["clipfrac"], torch.tensor(1.0), **TOL)
    loss.backward()
    assert_close(logp.grad, torch.zeros(1, 1), **TOL)
    # clip_high 0.28 -> -1.28
    loss, _ = losses.policy_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28)
    assert_close(loss, torch.tensor(-1.28), **TOL)
    # ratio 1.1 inside the range: loss -1.1, d/dlogp = -A * ratio = -1.1
    logp = torch.tensor([[math.log(1.1)]], requires_grad=True)
    loss, m = losses.policy_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.2)
    assert_close(loss, torch.tensor(-1.1), **TOL)
    assert_close(m["clipfrac"], torch.tensor(0.0), **TOL)
    loss.backward()
    assert_close(logp.grad, t([[-1.1]]), **TOL)


def test_policy_loss_batch_with_dual_clip():
    logp, old, adv, mask = _policy_batch()
    # no dual clip: pg = [max(-1.5,-1.2), max(-1.1,-1.1), max(4,1.2), max(0.5,0.8)] = [-1.2, -1.1, 4, 0.8]
    loss, m = losses.policy_loss(logp, old, adv, mask, 0.2, 0.2)
    assert_close(loss, torch.tensor((-1.2 - 1.1 + 4.0 + 0.8) / 4), **TOL)
    assert_close(m["dual_clipfrac"], torch.tensor(0.0), **TOL)
    # dual clip 3: token 2 has A < 0 and pg 4 > 3 -> 3 ; mean = (-1.2 - 1.1 + 3 + 0.8)/4 = 0.375
    loss, m = losses.policy_loss(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0)
    assert_close(loss, torch.tensor(0.375), **TOL)
    # clipfrac: pg2 > pg1 on tokens 0 and 3 -> 2/4 ; dual clip on token 2 -> 1/4
    assert_close(m["clipfrac"], torch.tensor(0.5), **TOL)
    assert_close(m["dual_clipfrac"], torch.tensor(0.25), **TOL)
    assert_close(m["ratio_mean"], torch.tensor((1.5 + 1.1 + 4.0 + 0.5) / 4), **TOL)
    kl_k2 = sum(0.5 * math.log(r) ** 2 for r in (1.5, 1.1, 4.0, 0.5)) / 4
    assert_close(m["approx_kl"], torch.tensor(kl_k2), **TOL)
    assert all(not v.requires_grad for v in m.values())
    loss.backward()
    # only token 1 is unclipped: d/dlogp = -A * ratio / 4 = -0.275; clipped and masked tokens get 0
    assert_close(logp.grad, t([[0.0, -0.275, 0.0, 0.0, 0.0]]), **TOL)


def test_policy_loss_parts_and_denominator():
    logp, old, adv, mask = _policy_batch()
    num, count, stats = losses.policy_loss_parts(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0)
    assert_close(num, torch.tensor(1.5), **TOL)
    assert_close(count, torch.tensor(4.0), **TOL)
    assert_close(stats["clipfrac"], t([2.0, 4.0]), **TOL)
    loss, _ = losses.policy_loss(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0, denominator=10.0)
    assert_close(loss, torch.tensor(0.15), **TOL)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.policy_loss(logp, old, adv, mask, 0.2, 0.2, dual_clip=1.0)


def test_value_loss_clipped_and_unclipped():
    values = torch.tensor([[1.0, 2.0, 0.0, 7.0]], requires_grad=True)
    old, ret, mask = t([[0.5, 2.0, 0.5, 0.0]]), t([[2.0, 1.0, 0.0, 0.0]]), t([[1, 1, 1, 0]])
    # token 0: v_c = 0.5 + 0.2 = 0.7; max((1-2)^2, (0.7-2)^2) = max(1, 1.69) -> 0.845 (clipped)
    # token 1: v_c = 2.0;             max(1, 1)                   -> 0.5   (not clipped)
    # token 2: v_c = 0.5 - 0.2 = 0.3; max(0, 0.09)               -> 0.045 (clipped)
    loss, m = losses.value_loss(values, old, ret, mask, clip=0.2)
    assert_close(loss, torch.tensor((0.845 + 0.5 + 0.045) / 3), **TOL)
    assert_close(m["vf_clipfrac"], torch.tensor(2 / 3), **TOL)
    assert_close(m["vpred_mean"], torch.tensor(1.0), **TOL)
    loss.backward()
    # clipped tokens get no gradient; token 1: d/dv 0.5 (v-R)^2 / 3 = (2-1)/3
    assert_close(values.grad, t([[0.0, 1 / 3, 0.0, 0.0]]), **TOL)
    # unclipped: 0.5 * [1, 1, 0] -> mean 1/3
    loss, m = losses.value_loss(values, old, ret, mask, clip=None)
    assert_close(loss, torch.tensor(1 / 3), **TOL)
    assert_close(m["vf_clipfrac"], torch.tensor(0.0), **TOL)


def test_value_clipfrac_counts_clipping_not_rounding_noise():
    """A value inside the clip range is not clipped, whatever ``old + (v - old)`` rounds to.

    In fp32 ``old + (v - old)`` differs from ``v`` by an ulp for some tokens; comparing the two
    squared errors then counted those tokens as clipped at random, so ``vf_clipfrac`` moved when
    another layout rounded a value differently (resuming TP2 -> PP2 counted 4/48 instead of 1/48).
    """
    g = torch.Generator().manual_seed(0)
    values = torch.randn(1, 10000, generator=g)
    old = values + 0.05 * torch.randn(1, 10000, generator=g)
    ret, mask = torch.randn(1, 10000, generator=g), torch.ones(1, 10000)
    assert bool(((values - old).abs() < 0.2).all())
    loss, m = losses.value_loss(values, old, ret, mask, clip=0.2)
    assert float(m["vf_clipfrac"]) == 0.0
    assert_close(loss, (0.5 * (values - ret) ** 2).mean(), **TOL)
    # One value pushed out of the range is counted, and only it.
    values[0, 0] = old[0, 0] + 1.0
    ret[0, 0] = old[0, 0] + 5.0
    _, m = losses.value_loss(values, old, ret, mask, clip=0.2)
    assert float(m["vf_clipfrac"]) * 10000 == pytest.approx(1.0)


def test_explained_variance():
    # R = [1,2,3,4]: var 1.25 ; R - V = [0,0,0,1]: var 3/16 ; ev = 1 - 0.1875/1.25 = 0.85
    ret, val, mask = t([[1.0, 2.0, 3.0, 4.0, 50.0]]), t([[1.0, 2.0, 3.0, 3.0, -50.0]]), t([[1, 1, 1, 1, 0]])
    assert_close(losses.explained_variance(val, ret, mask), torch.tensor(0.85), **TOL)
    assert torch.isnan(losses.explained_variance(val, t([[2.0] * 5]), mask))


# ---------------------------------------------------------------- aggregation

RAGGED_LOSS = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, NAN, 0.0], [9.0, 9.0, 9.0, 9.0]])
RAGGED_MASK = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "agg, num, count",
    [
        ("token-mean", 17.0, 5.0),  # (1+2+3+5+6) over 5 tokens = 3.4
        ("seq-mean-token-sum", 17.0, 2.0),  # row sums 6, 11 over 2 non-empty rows = 8.5
        ("seq-mean-token-mean", 7.5, 2.0),  # 6/3 + 11/2 = 7.5 over 2 rows = 3.75
    ],
)
def test_aggregation_modes_hand_values(agg, num, count):
    n, c = losses.aggregate_parts(RAGGED_LOSS, RAGGED_MASK, agg)
    assert_close(n, torch.tensor(num), **TOL)
    assert_close(c, torch.tensor(count), **TOL)
    assert c.dtype == torch.float32
    assert_close(losses.aggregate(RAGGED_LOSS, RAGGED_MASK, agg), torch.tensor(num / count), **TOL)
    assert_close(losses.aggregate(RAGGED_LOSS, RAGGED_MASK, agg, denominator=10.0), torch.tensor(num / 10), **TOL)


def test_aggregate_all_masked_and_unknown_mode():
    zero = torch.zeros(2, 3)
    for agg in losses.AGG_MODES:
        assert_close(losses.aggregate(torch.ones(2, 3), zero, agg, horizon=5), torch.tensor(0.0), **TOL)
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        losses.aggregate_parts(RAGGED_LOSS, RAGGED_MASK, "mean")


def _ragged_batch(seed=0, b=6, tlen=8):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, tlen, generator=g, dtype=torch.float64).requires_grad_(True)
    lengths = torch.tensor([8, 3, 0, 5, 1, 6])
    mask = (torch.arange(tlen)[None, :] < lengths[:, None]).double()
    return loss, mask


@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_row_split_invariance(agg):
    loss, mask = _ragged_batch()
    whole = losses.aggregate(loss, mask, agg, horizon=8)
    parts = [losses.aggregate_parts(loss[s], mask[s], agg, horizon=8) for s in (slice(0, 3), slice(3, 6))]
    total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert_close(total, whole, rtol=1e-12, atol=1e-12)


def _cp_shards(tlen, cp):
    """Contiguous halves, and Megatron's load-balanced layout (rank i holds chunks i and 2cp-1-i)."""
    chunk = tlen // (2 * cp)
    halves = [torch.arange(r * tlen // cp, (r + 1) * tlen // cp) for r in range(cp)]
    balanced = [
        torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                   torch.arange((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)])
        for r in range(cp)
    ]
    return [halves, balanced]


@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_context_parallel_split_invariance(agg):
    loss, mask = _ragged_batch()
    full_lengths = mask.sum(-1)
    whole = losses.aggregate(loss, mask, agg, horizon=8)
    (whole_grad,) = torch.autograd.grad(whole, loss)
    for layout in _cp_shards(loss.shape[1], cp=2):
        parts = [losses.aggregate_parts(loss[:, idx], mask[:, idx], agg, seq_lengths=full_lengths, horizon=8)
                 for idx in layout]
        count = sum(p[1] for p in parts)
        total = sum(p[0] for p in parts) / count
        assert_close(total, whole, rtol=1e-6, atol=1e-6)
        assert_close(count, torch.tensor(5.0 if agg != "token-mean" else 23.0), rtol=1e-6, atol=1e-6)
        (grad,) = torch.autograd.grad(total, loss)
        assert_close(grad, whole_grad, rtol=1e-6, atol=1e-6)


def test_entropy_bonus_shares_the_policy_denominator():
    logp, old, adv, mask = _policy_batch()
    entropy = t([[0.5, 1.0, 1.5, 2.0, 99.0]])
    pg_num, pg_count, _ = losses.policy_loss_parts(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0)
    ent_num, ent_count = losses.entropy_bonus_parts(entropy, mask, "token-mean")
    assert_close(ent_count, pg_count, **TOL)
    # (1.5 - 0.01 * 5.0) / 4
    assert_close((pg_num - 0.01 * ent_num) / pg_count, torch.tensor(1.45 / 4), **TOL)


# ---------------------------------------------------------------- defects found against verl


def test_kl_in_reward_reaches_grpo_and_rloo_advantages():
    """With kl_in_reward the penalty must reach outcome advantages: R = score - coef * sum_t KL_t."""
    from megatron_rl.trainer.experience import compute_advantages, token_rewards_from_scores

    scores = t([1.0, 1.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    logp = t([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0], [-1.0, 0.0, 0.0], [-0.2, -0.2, -0.2]])
    ref = t([[-1.5, -1.0, -0.5], [-0.1, -1.0, 0.0], [-2.0, 0.0, 0.0], [-0.2, -0.2, -0.2]])
    coef = 0.5
    rewards, k = kl.apply_kl_penalty(token_rewards_from_scores(scores, mask), logp, ref, mask, coef, "k1")
    # k1 row sums over valid tokens: [0.5 - 1.0 + 0, 0 - 2.0, 1.0, 0] -> R = score - 0.5 * sum
    returns = [1.0 - 0.5 * -0.5, 1.0 - 0.5 * -2.0, 0.0 - 0.5 * 1.0, 1.0]  # [1.25, 2.0, -0.5, 1.0]
    opts = dict(gamma=1.0, lam=1.0, whiten=False, norm_by_std=True)
    grpo, _ = compute_advantages("grpo", scores, groups, mask, rewards, None, **opts)
    # group 0: mean 1.625, unbiased std |2.0 - 1.25| / sqrt(2); group 1: mean 0.25, std 1.5 / sqrt(2)
    s0, s1 = 0.75 / math.sqrt(2), 1.5 / math.sqrt(2)
    per_seq = t([(1.25 - 1.625) / (s0 + 1e-6), (2.0 - 1.625) / (s0 + 1e-6),
                 (-0.5 - 0.25) / (s1 + 1e-6), (1.0 - 0.25) / (s1 + 1e-6)])
    assert_close(grpo, per_seq[:, None] * mask, **TOL)
    rloo, _ = compute_advantages("rloo", scores, groups, mask, rewards, None, **opts)
    loo = t([returns[0] - returns[1], returns[1] - returns[0], returns[2] - returns[3], returns[3] - returns[2]])
    assert_close(rloo, loo[:, None] * mask, **TOL)
    # Without the penalty the sum of the token rewards is the score itself, bit for bit.
    plain, _ = compute_advantages("grpo", scores, groups, mask, token_rewards_from_scores(scores, mask), None, **opts)
    assert torch.equal(plain, advantages.compute_grpo(scores, groups, mask))


@pytest.mark.parametrize("value", [0.7, 9.320004, 0.1, 123.456, -3.3])
def test_all_equal_group_of_16_gets_exactly_zero_advantage_in_fp32(value):
    # Rounding in (s - mean) / (std + 1e-6) used to give up to 0.64 here instead of 0.
    scores = torch.cat([torch.full((16,), value, dtype=torch.float32), torch.arange(16, dtype=torch.float32)])
    groups = torch.cat([torch.zeros(16, dtype=torch.long), torch.ones(16, dtype=torch.long)])
    mask = torch.ones(32, 3)
    for norm in (True, False):
        adv = advantages.compute_grpo(scores, groups, mask, norm_by_std=norm)
        assert torch.equal(adv[:16], torch.zeros(16, 3)), float(adv[:16].abs().max())
        assert adv[16:].abs().max() > 0.1  # the varied group is untouched
    assert torch.equal(advantages.compute_rloo(scores, groups, mask)[:16], torch.zeros(16, 3))


def test_k3_is_bounded_to_ten_like_verl_and_its_gradient():
    # r = ref - logp = 20 (clamped): e^20 - 21 = 4.85e8 unbounded; verl bounds the estimate to [-10, 10].
    logp = torch.tensor([-30.0, -3.0, -1.0, -1.0, 2.0], requires_grad=True)
    ref = torch.tensor([0.0, 0.0, -1.5, -0.5, -20.0])
    k3 = kl.estimate(logp, ref, "k3")
    r = (ref - logp.detach()).clamp(-20, 20)
    inside = [min(math.exp(x) - x - 1, 10.0) for x in r.tolist()]
    assert_close(k3.detach(), t(inside), **TOL)
    assert float(k3.detach().max()) == 10.0 and float(k3.detach().min()) >= 0.0
    # gradient: 1 - pi_ref/pi = 1 - e^r inside the bound, 0 where the bound is active (tokens 0, 1 and 4)
    (grad,) = torch.autograd.grad(k3.sum(), logp)
    expected = [0.0 if v >= 10.0 else 1.0 - math.exp(x) for v, x in zip(inside, r.tolist())]
    assert_close(grad, t(expected), **TOL)
    # k3+: the same (bounded) value, k2's gradient d = logp - ref everywhere
    logp2 = logp.detach().clone().requires_grad_(True)
    plus = kl.estimate(logp2, ref, "k3+")
    assert_close(plus.detach(), k3.detach(), **TOL)
    (grad,) = torch.autograd.grad(plus.sum(), logp2)
    assert_close(grad, logp2.detach() - ref, **TOL)
