"""bfloat16 end to end on CPU: PPO, checkpoints, the distributed optimizer, score and CP."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.testing.harness import run_distributed
from tests.support.helpers import ppo_body, read_metrics
from tests.test_context_parallel import hf_llama  # noqa: F401 - the fixture

BF16 = ["model.params_dtype=bfloat16"]


def test_bf16_ppo_saves_its_first_checkpoint(tmp_path):
    """The critic's fp32 value head next to bf16 weights broke megatron's optimizer checkpoint."""
    run_distributed(2, ppo_body, BF16 + ["parallel.tp=2", "parallel.sequence_parallel=true", "trainer.steps=2",
                                         f"run.dir={tmp_path}", "run.name=r"])
    rows = read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "r" / "checkpoints" / "step_00000002" / "meta.json").is_file()


# ----------------------------------------------------------------------------- parity with fp32


def actor_critic_body(layout_kw: dict, weights, dtype: str, plan_kw: dict):
    """One forward+backward of the actor/critic loss of test_context_parallel in ``dtype``.

    Returns (rank 0) the per-sequence log-probs, entropy and values, the loss and the canonical
    gradients; ``weights`` (fp32 canonical, None = this model's own) are loaded first."""
    import torch
    import torch.distributed as dist

    from megatron_rl.config.schema import OptimConfig
    from megatron_rl.distributed.metrics import reduce_sums
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.testing.layouts import use_layout
    from tests.test_context_parallel import LENGTHS, ActorCriticHead, build_with_value_head, make_sequences

    layout = use_layout(**layout_kw)
    chunks, weights = build_with_value_head(layout, weights, params_dtype=dtype)
    trainable = make_trainable(chunks, OptimConfig(), total_steps=1)
    seqs = make_sequences(LENGTHS)
    total = float(sum(LENGTHS))

    def loss_fn(outs, t, mb):
        per_token = (outs["logprob"] * t["coef_logp"] + outs["entropy"] * t["coef_entropy"]
                     + t["mask"] * (outs["value"] - t["target"]) ** 2)
        loss = per_token.sum() / total
        return loss, {"loss": loss.detach()}

    trainable.zero_grad()
    outs, logs = run_sequences(trainable.chunks, seqs, ActorCriticHead(), BatchPlan(**plan_kw),
                               torch.device("cpu"), loss_fn=loss_fn, forward_only=False)
    result = {"outs": outs, "loss": reduce_sums(logs, ["loss"])["loss"], "weights": weights,
              "grads": gather_canonical(trainable.chunks, "grad"),
              "dtype": str(next(p for p in trainable.chunks[0].parameters()).dtype)}
    return result if dist.get_rank() == 0 else None


_REFERENCE: dict = {}


def fp32_reference() -> dict:
    """The fp32 one-process run every bf16 layout is compared with."""
    if not _REFERENCE:
        _REFERENCE.update(run_distributed(1, actor_critic_body, {}, None, "float32", dict(micro_batch_size=3))[0])
    return _REFERENCE


def errors(got: dict, ref: dict) -> dict:
    """Largest absolute error of log-probs, entropy and loss; value and gradient errors relative to
    the largest reference value and gradient."""
    out = {}
    for a, b in zip(got["outs"], ref["outs"], strict=True):
        for name in b:
            assert a[name].shape == b[name].shape and a[name].dtype == torch.float32, name
            out[name] = max(out.get(name, 0.0), float((a[name] - b[name]).abs().max()))
    out["value_rel"] = out.pop("value") / max(float(o["value"].abs().max()) for o in ref["outs"])
    out["loss"] = abs(got["loss"] - ref["loss"])
    assert got["grads"].keys() == ref["grads"].keys()
    scale = max(float(g.abs().max()) for g in ref["grads"].values())
    out["grad_rel"] = max(float((got["grads"][k] - ref["grads"][k]).abs().max()) for k in ref["grads"]) / scale
    return out


# The largest bf16 error allowed against the fp32 one-process run, per quantity.  bf16 keeps 8 bits
# of mantissa (a relative rounding of 2^-9 per operation); measured on every layout below:
# log-prob <= 2.6e-3 (values near -4.6), entropy <= 4.9e-5, value <= 5e-3 of max|value| (4.6),
# loss <= 1.7e-3 (of 2.84), gradients <= 8.3e-3 of the largest gradient.  The CP layouts stay
# within the one-process bf16 error: splitting the sequence adds no error of its own.
BF16_TOL = {"logprob": 1e-2, "entropy": 5e-4, "value_rel": 1.5e-2, "loss": 5e-3, "grad_rel": 2.5e-2}

BF16_LAYOUTS = {
    "one_process": (1, dict()),
    "cp2": (2, dict(cp=2)),
    "cp2_all_gather": (2, dict(cp=2, cp_comm_type="all_gather")),
    "cp4": (4, dict(cp=4)),
    "tp2_cp2_sp": (4, dict(tp=2, cp=2, sp=True)),
}


@pytest.mark.parametrize("layout", list(BF16_LAYOUTS))
def test_bf16_matches_fp32_one_process(layout):
    """bf16 on each layout against fp32 on one process, packed micro-batches of mixed lengths."""
    ref = fp32_reference()
    world, layout_kw = BF16_LAYOUTS[layout]
    got = run_distributed(world, actor_critic_body, layout_kw, ref["weights"], "bfloat16", dict(micro_batch_size=3))[0]
    assert got["dtype"] == "torch.bfloat16"
    err = errors(got, ref)
    print(f"bf16 {layout}: " + " ".join(f"{k} {v:.2e}" for k, v in err.items()))
    assert all(err[k] <= BF16_TOL[k] for k in BF16_TOL), err
    # bf16 is not fp32: the comparison has something to measure.
    assert err["logprob"] > 1e-5 and err["grad_rel"] > 1e-5


# ----------------------------------------------------------------------------- PPO, resume, DistOpt

VOLATILE = ("timing/", "throughput/", "memory/")


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def test_bf16_ppo_with_context_parallelism_trains(tmp_path):
    """Actor, critic and reference in bf16 on CP2: finite metrics, a moving reward, and the
    recomputed old log-probs close to what the (bf16) rollout sampled with."""
    run_distributed(2, ppo_body, BF16 + ["parallel.cp=2", "trainer.steps=3", f"run.dir={tmp_path}", "run.name=c"])
    rows = read_metrics(tmp_path / "c")
    print("bf16 cp2 PPO:", [(r["actor/pg_loss"], r["critic/vf_loss"], r["rollout/logprob_mismatch_max"]) for r in rows])
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(v is None or math.isfinite(v) for r in rows for v in r.values() if isinstance(v, float))
    assert all(r["actor/grad_norm"] > 0 and r["critic/grad_norm"] > 0 for r in rows)
    assert rows[0]["rollout/logprob_mismatch_max"] < 5e-2


def test_bf16_resume_same_layout_is_bit_identical(tmp_path):
    """TP2 with a critic (fp32 value head next to bf16 weights): stopping after step 1 and resuming
    gives exactly the metrics of the straight run."""
    common = BF16 + ["parallel.tp=2", "parallel.sequence_parallel=true", "trainer.save_every=1",
                     f"run.dir={tmp_path}"]
    run_distributed(2, ppo_body, common + ["trainer.steps=3", "run.name=a"])
    run_distributed(2, ppo_body, common + ["trainer.steps=1", "run.name=b"])
    run_distributed(2, ppo_body, common + ["trainer.steps=3", "run.name=b"])
    straight, resumed = _stable(read_metrics(tmp_path / "a")), _stable(read_metrics(tmp_path / "b"))
    assert straight == resumed
    assert len({r["reward/mean"] for r in straight}) > 1


def test_bf16_distributed_optimizer_resumes_exactly_and_matches_plain_adam(tmp_path):
    """bf16 weights with fp32 Adam state sharded over DP2: an exact resume, and the run of the
    plain optimizer within bf16 rounding."""
    dist_opt = ["actor.optim.use_distributed_optimizer=true", "critic.optim.use_distributed_optimizer=true"]
    common = BF16 + ["trainer.save_every=1", f"run.dir={tmp_path}"]
    run_distributed(2, ppo_body, common + ["trainer.steps=3", "run.name=plain"])
    run_distributed(2, ppo_body, common + dist_opt + ["trainer.steps=3", "run.name=sharded"])
    run_distributed(2, ppo_body, common + dist_opt + ["trainer.steps=1", "run.name=resumed"])
    run_distributed(2, ppo_body, common + dist_opt + ["trainer.steps=3", "run.name=resumed"])
    plain, sharded = _stable(read_metrics(tmp_path / "plain")), _stable(read_metrics(tmp_path / "sharded"))
    assert _stable(read_metrics(tmp_path / "resumed")) == sharded
    worst = max(abs(a[k] - b[k]) for a, b in zip(plain, sharded) for k in a
                if isinstance(a[k], float) and k.startswith(("actor/pg_loss", "critic/vf_loss", "actor/kl")))
    print(f"bf16 DistOpt vs plain Adam: max |d| of pg_loss, vf_loss, kl = {worst:.2e}")
    assert worst <= 1e-3
    assert [r["reward/mean"] for r in plain] == [r["reward/mean"] for r in sharded]


def reshard_body(ckpt_dir: str):
    """Train one step on TP2 in bf16 (critic: fp32 value head), save, load into PP2; return the
    canonical weights, fp32 master weights and Adam moments seen on both sides."""
    import torch
    import torch.distributed as dist

    from megatron_rl.engine import checkpoint
    from megatron_rl.testing.layouts import use_layout

    before = _train_and_state(dict(tp=2, sp=True), step=True)
    checkpoint.save_checkpoint(ckpt_dir, 1, {"critic": checkpoint.ModelPart(*before.pop("part"))})
    after = _train_and_state(dict(pp=2), step=False, load=f"{ckpt_dir}/step_00000001")
    after.pop("part")
    use_layout()
    if dist.get_rank() != 0:
        return None
    return {kind: {name: bool(torch.equal(before[kind][name], after[kind][name])) for name in before[kind]}
            for kind in before}


def _train_and_state(layout_kw: dict, step: bool, load: str | None = None, distributed: bool = False) -> dict:
    """Build the bf16 critic on this layout (loading ``load``), train a step if asked; return its
    canonical weights and optimizer state (DistributedOptimizer: the flat DP-gathered state)."""
    import torch

    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.engine import checkpoint
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models import canonical
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.heads import ValueOutput, attach_value_head
    from megatron_rl.testing.layouts import use_layout
    from tests.test_context_parallel import LENGTHS, MODEL, make_sequences

    layout = use_layout(**layout_kw)
    chunks = attach_value_head(build_gpt_chunks(ModelConfig(**dict(MODEL, params_dtype="bfloat16")), layout,
                                                torch.device("cpu")))
    trainable = make_trainable(chunks, OptimConfig(lr=1e-2, use_distributed_optimizer=distributed), total_steps=4)
    part = (trainable.chunks, trainable.optimizer, trainable.scheduler)
    if load:
        checkpoint.load_checkpoint(load, {"critic": checkpoint.ModelPart(*part)})
    if step:
        seqs = make_sequences(LENGTHS)

        def loss_fn(outs, t, mb):
            return (t["mask"] * (outs["value"] - t["target"]) ** 2).sum() / sum(LENGTHS), {}

        trainable.zero_grad()
        run_sequences(trainable.chunks, seqs, ValueOutput(), BatchPlan(micro_batch_size=3), torch.device("cpu"),
                      loss_fn=loss_fn, forward_only=False)
        assert trainable.step().ok
    if distributed:
        from megatron_rl.compat.megatron_fixes import _distributed_optimizers

        flat = {}
        for i, dist_opt in enumerate(_distributed_optimizers(trainable.optimizer)):
            state = dist_opt.get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)
            for b, per_dtype in enumerate(v for k, v in sorted(state.items(), key=str) if isinstance(k, int)):
                for dtypes, tensors in per_dtype.items():
                    for key in ("param", "exp_avg", "exp_avg_sq"):
                        flat[f"{i}.{b}.{dtypes}.{key}"] = tensors[key].clone()
        return {"param": canonical.gather_canonical(trainable.chunks), "flat": flat, "part": part}
    inner = [o.optimizer for o in getattr(trainable.optimizer, "chained_optimizers", [trainable.optimizer])]

    def main_of(param):
        return getattr(param, "main_param", param)

    def fetch(param, attr):
        if not param.requires_grad:
            return None
        if attr == "param":
            return param.detach()
        if attr == "main":
            return main_of(param).detach()
        state = next(o.state[main_of(param)] for o in inner if main_of(param) in o.state)
        return state[attr]

    original = canonical._value
    canonical._value = fetch
    try:
        state = {kind: canonical.gather_canonical(trainable.chunks, kind)
                 for kind in ("param", "main", "exp_avg", "exp_avg_sq")}
    finally:
        canonical._value = original
    state["part"] = part
    return state


def test_bf16_checkpoint_reshards_weights_master_weights_and_adam_state_exactly(tmp_path):
    """Saved on TP2+SP, loaded on PP2: every bf16 weight, fp32 master weight and Adam moment is
    bit for bit the one saved, the fp32 value head's included."""
    got = run_distributed(2, reshard_body, str(tmp_path))[0]
    assert "value_head.linear.weight" in got["main"] and len(got["main"]) > 10
    mismatched = {kind: [n for n, same in names.items() if not same] for kind, names in got.items()}
    assert not any(mismatched.values()), mismatched


def dist_opt_reshard_body(root: str):
    """DistributedOptimizer over DP2: step, save; load into TP2+SP (DP1) and save again; load that
    back into DP2.  Returns whether weights and the whole fp32 state survived the round trip."""
    import torch
    import torch.distributed as dist

    from megatron_rl.engine import checkpoint
    from megatron_rl.testing.layouts import use_layout

    before = _train_and_state({}, step=True, distributed=True)
    checkpoint.save_checkpoint(f"{root}/a", 1, {"critic": checkpoint.ModelPart(*before.pop("part"))})
    retiled = _train_and_state(dict(tp=2, sp=True), step=False, load=f"{root}/a/step_00000001", distributed=True)
    checkpoint.save_checkpoint(f"{root}/b", 1, {"critic": checkpoint.ModelPart(*retiled.pop("part"))})
    after = _train_and_state({}, step=False, load=f"{root}/b/step_00000001", distributed=True)
    after.pop("part")
    use_layout()
    if dist.get_rank() != 0:
        return None
    same = {"retiled weights": all(torch.equal(before["param"][k], retiled["param"][k]) for k in before["param"]),
            "weights": all(torch.equal(before["param"][k], after["param"][k]) for k in before["param"]),
            "state": before["flat"].keys() == after["flat"].keys()
            and all(torch.equal(before["flat"][k], after["flat"][k]) for k in before["flat"])}
    moved = max(float(t.abs().max()) for k, t in before["flat"].items() if k.endswith("exp_avg"))
    return same, len(before["flat"]), moved


def test_bf16_distributed_optimizer_state_reshards_exactly(tmp_path):
    """Adam state sharded over DP2, resharded onto TP2 and back: every fp32 master weight and
    moment returns bit for bit."""
    same, tensors, moved = run_distributed(2, dist_opt_reshard_body, str(tmp_path))[0]
    assert same == {"retiled weights": True, "weights": True, "state": True}
    assert tensors >= 6 and moved > 0  # a bf16 and an fp32 buffer, with state that moved


# ----------------------------------------------------------------------------- score vs HF


@pytest.mark.parametrize("layout", ["cp2", "tp2_cp2_sp"])
def test_bf16_score_matches_hf_transformers(hf_llama, layout, tmp_path):  # noqa: F811 - the fixture
    """``megatron-rl score`` in bf16 against HF transformers in fp32 on the same random Llama (GQA,
    non-trivial norms): the 90 log-probs of six sequences agree to bf16 rounding."""
    from tests.support.helpers import check_scores, score_body
    from tests.test_context_parallel import HF_LAYOUTS

    hf_dir, reference_logprobs = hf_llama
    world, overrides = HF_LAYOUTS[layout]
    out = str(tmp_path / "out.jsonl")
    run_distributed(world, score_body, hf_dir, overrides + BF16, out)
    worst = check_scores(out, reference_logprobs)
    print(f"bf16 score {layout}: max |logprob - HF fp32| = {worst:.2e}")
    assert 1e-4 < worst <= 5e-2
