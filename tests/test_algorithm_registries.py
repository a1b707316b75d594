"""The algorithm registries: what the schema accepts, what validation enforces, what the docs list.

Adding an estimator or a loss is one decorated function in ``megatron_rl/algorithms/``: the tests
below register one, check that config validation, the trainer's helpers and the generated config
reference pick it up without any other edit, and remove it again.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rl.algorithms import advantages, kl, losses, rollout_correction
from megatron_rl.config.loader import load_config
from megatron_rl.config.rules import registry_choices
from megatron_rl.config.schema import iter_fields
from megatron_rl.errors import ConfigError
from megatron_rl.validation import validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REGISTRY_OF_KEY = {
    "algorithm.advantage": advantages.ADVANTAGE_ESTIMATORS,
    "algorithm.policy_loss": losses.POLICY_LOSSES,
    "algorithm.kl_kind": kl.KL_NAMES,
    "algorithm.loss_agg": losses.AGG_MODES,
    "algorithm.rollout_correction.mode": rollout_correction.MODES,
}


def _choices_spec(key: str) -> str:
    return next(f.metadata["choices"] for k, f, _ in iter_fields() if k == key)


def test_every_registry_is_what_the_schema_accepts():
    for key, registry in REGISTRY_OF_KEY.items():
        assert registry_choices(_choices_spec(key)) == tuple(registry), key
    est = advantages.ADVANTAGE_ESTIMATORS
    assert {"gae", "grpo", "rloo", "drgrpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"} <= set(est)
    assert [n for n, e in est.items() if e.needs_critic] == ["gae"]
    assert {n for n, e in est.items() if e.needs_groups} >= {"grpo", "rloo", "drgrpo", "reinforce_plus_plus_baseline"}
    assert not est["reinforce_plus_plus"].needs_groups
    assert tuple(kl.KL_NAMES) == ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "k3+", "low_var_kl+")
    assert tuple(kl.KL_ESTIMATORS) == ("k1", "k2", "k3", "abs", "k3+")
    assert tuple(losses.AGG_MODES) == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                       "seq-mean-token-sum-norm")
    assert {"ppo", "gspo", "cispo"} <= set(losses.POLICY_LOSSES)
    assert [n for n, p in losses.POLICY_LOSSES.items() if p.uses_dual_clip] == ["ppo"]
    # docs/algorithms.md gives a formula and the config for every entry of every registry
    with open(os.path.join(ROOT, "docs", "algorithms.md")) as fh:
        doc = fh.read()
    for registry in (est, losses.POLICY_LOSSES, kl.KL_NAMES, losses.AGG_MODES, rollout_correction.CORRECTIONS):
        missing = [name for name in registry if f"`{name}`" not in doc]
        assert not missing, f"docs/algorithms.md does not describe {missing}"
    # the feature matrix lists them
    from megatron_rl.features import FEATURES

    row = next(f for f in FEATURES if f.name == "Algorithm registries")
    for name in list(est) + list(losses.POLICY_LOSSES) + list(kl.KL_ESTIMATORS) + list(losses.AGG_MODES):
        assert f"`{name}`" in row.summary, name


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        advantages.register_advantage("grpo")(lambda batch, opts: None)
    with pytest.raises(ValueError, match="already registered"):
        losses.register_policy_loss("ppo")(lambda inp, opts: None)
    with pytest.raises(ValueError, match="already registered"):
        kl.register_kl("new_name", "mse")(lambda a, b: a)
    assert "new_name" not in kl.KL_NAMES
    with pytest.raises(ValueError, match="already registered"):
        losses.register_aggregation("token-mean", losses.TOKENS)(lambda rows, horizon: None)


def _validate(overrides, world=1):
    validate(load_config(None, overrides), world)


def test_new_estimator_is_a_one_file_change():
    from megatron_rl.tools.docs_gen import config_markdown
    from megatron_rl.trainer.experience import compute_advantages

    @advantages.register_advantage("test_sign", needs_groups=True)
    def _sign(batch, opts):
        """sign(R) on every valid token."""
        return torch.sign(batch.sequence_returns())[:, None] * batch.mask, None

    try:
        with pytest.raises(ConfigError, match=r"algorithm.advantage=test_sign takes its baseline.*rollout.n >= 2"):
            _validate(["algorithm.advantage=test_sign", "rollout.n=1"])
        _validate(["algorithm.advantage=test_sign", "rollout.n=2"])
        assert not advantages.needs_critic("test_sign") and advantages.needs_groups("test_sign")
        mask = torch.ones(3, 2)
        rewards = torch.tensor([[0.0, 2.0], [0.0, -1.0], [0.0, 0.0]])
        adv, ret = compute_advantages("test_sign", rewards.sum(-1), torch.tensor([0, 0, 1]), mask, rewards, None)
        assert torch.equal(adv, torch.tensor([[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]])) and ret is None
        assert "`test_sign`" in config_markdown()
    finally:
        del advantages.ADVANTAGE_ESTIMATORS["test_sign"]
    with pytest.raises(ConfigError, match="unknown choice"):
        _validate(["algorithm.advantage=test_sign", "rollout.n=2"])


def test_new_policy_loss_is_a_one_file_change():
    from megatron_rl.config.schema import AlgorithmConfig
    from megatron_rl.trainer.update import actor_metric_names

    @losses.register_policy_loss("test_reinforce", metrics=("approx_kl",))
    def _reinforce(inp, opts):
        """-A log pi (vanilla policy gradient)."""
        return -inp.advantages * inp.logprob, {"approx_kl": inp.approx_kl()}

    try:
        _validate(["algorithm.policy_loss=test_reinforce"])
        with pytest.raises(ConfigError, match="has no dual clip"):
            _validate(["algorithm.policy_loss=test_reinforce", "algorithm.dual_clip=3"])
        assert actor_metric_names(AlgorithmConfig(policy_loss="test_reinforce")) == ["actor/approx_kl"]
        logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        num, count, metrics = losses.policy_loss_terms("test_reinforce", logp, logp.detach(), torch.ones(1, 2),
                                                       torch.ones(1, 2), AlgorithmConfig())
        assert float((num / count).detach()) == pytest.approx(1.5) and set(metrics) == {"approx_kl"}
    finally:
        del losses.POLICY_LOSSES["test_reinforce"]


@pytest.mark.parametrize("overrides,key,text", [
    (["algorithm.policy_loss=gspo", "algorithm.dual_clip=3"], "algorithm.dual_clip", "no dual clip"),
    (["algorithm.advantage=drgrpo", "rollout.n=1"], "rollout.n", "takes its baseline"),
    (["algorithm.dynamic_sampling=true", "rollout.n=1"], "rollout.n", "dynamic sampling"),
    (["algorithm.overlong_buffer=100", "rollout.max_new_tokens=64"], "algorithm.overlong_buffer", "longer than"),
    (["algorithm.policy_loss=ppo2"], "algorithm.policy_loss", "ppo, gspo, cispo"),
    (["algorithm.rollout_correction.mode=ips"], "algorithm.rollout_correction.mode", "off, is, tis, mis"),
    (["algorithm.rollout_correction.level=batch"], "algorithm.rollout_correction.level", "token, sequence"),
    (["algorithm.rollout_correction.threshold=0.5"], "algorithm.rollout_correction.threshold", ">= 1"),
])
def test_algorithm_configs_that_cannot_work_are_refused(overrides, key, text):
    with pytest.raises(ConfigError) as err:
        _validate(overrides)
    assert err.value.key == key and text in str(err.value), str(err.value)
