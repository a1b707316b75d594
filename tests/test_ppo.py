"""The PPO trainer end to end on parallel layouts, loss normalisation, exact resume, safe saves."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from megatron_rl.testing.harness import run_distributed
from tests.support.helpers import TINY, ppo_body, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("step", "reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl", "actor/entropy",
            "actor/clipfrac", "actor/grad_norm", "critic/vf_loss", "critic/explained_var",
            "timing/rollout_s", "timing/actor_update_s", "throughput/generated_tokens_per_s",
            "throughput/total_tokens_per_s", "memory/rss_gb")


LAYOUTS = {
    "tp2": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "cp2": (2, ["parallel.cp=2"]),
    "tp2_cp2": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true"]),
    "pp2_cp2": (4, ["parallel.pp=2", "parallel.cp=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ppo_two_steps_on_parallel_layouts(layout, tmp_path):
    world, overrides = LAYOUTS[layout]
    run_distributed(world, ppo_body, overrides + ["trainer.steps=2", f"run.dir={tmp_path}", "run.name=r"])
    rows = read_metrics(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        assert all(v is None or math.isfinite(v) for v in row.values() if isinstance(v, float))
    # The freshly recomputed old log-probs match what the rollout engine sampled with.
    assert rows[0]["rollout/logprob_mismatch_max"] < 1e-4
    assert (tmp_path / "r" / "checkpoints" / "step_00000002" / "meta.json").is_file()


def test_grpo_runs_without_a_critic(tmp_path):
    run_distributed(2, ppo_body, ["algorithm.advantage=grpo", "rollout.n=4", "trainer.steps=2",
                                  f"run.dir={tmp_path}", "run.name=g"])
    rows = read_metrics(tmp_path / "g")
    assert len(rows) == 2 and not any(k.startswith("critic/") for k in rows[0])
    meta = json.loads((tmp_path / "g" / "checkpoints" / "step_00000002" / "meta.json").read_text())
    assert meta["parts"] == ["actor", "reference"]


# ----------------------------------------------------------------------------- default batching


def one_step_body(config, overrides: list[str]):
    """One PPO step of ``config`` (None: the schema defaults) + ``overrides``: the sequences in each
    micro-batch the trainer built -- training (with a loss mask) and forward-only passes apart --,
    its batch plan and rollout batch."""
    import torch.distributed as dist

    from megatron_rl.config.loader import load_config
    from megatron_rl.engine import forward
    from megatron_rl.trainer.ppo import PPOTrainer
    from megatron_rl.validation import validate

    cfg = load_config(config, overrides)
    validate(cfg, dist.get_world_size())
    seen = {"train": [], "forward_only": []}
    original = forward.build_microbatch

    def recording(seqs, seq_indices, **kw):
        seen["train" if "loss_mask" in seqs[0] else "forward_only"].append(len(seqs))
        return original(seqs, seq_indices, **kw)

    forward.build_microbatch = recording
    try:
        trainer = PPOTrainer(cfg, log=lambda line: None)
        metrics = trainer.train_step(1)
    finally:
        forward.build_microbatch = original
    return {"seen": seen, "budget": trainer.plan.max_tokens_per_rank, "derived": trainer.plan.derived,
            "rollout_batch": trainer.cfg.rollout.max_batch_size, "metrics": metrics,
            "samples": len(trainer.prompts), "prompt_len": len(trainer.prompts.prompt_ids[0])}


def test_default_configs_train_on_micro_batches_of_many_sequences(tmp_path):
    """Neither the schema defaults nor configs/demo_cpu.yaml set a micro-batch size: the derived
    token budget packs many sequences into every micro-batch the update runs."""
    run = [f"run.dir={tmp_path}", "trainer.resume=never"]
    defaults = run_distributed(1, one_step_body, None, run + ["run.name=defaults"])[0]
    # 64 sequences of data.max_prompt_tokens + rollout.max_new_tokens = 512 + 64; the 4 GiB cap
    # is far above that for this model.  All 16 x 4 samples are generated in one pass.
    assert defaults["derived"] and defaults["budget"] == 64 * (512 + 64)
    assert defaults["rollout_batch"] == 16 * 4
    print(f"schema defaults: sequences per training micro-batch {defaults['seen']['train']}")
    assert defaults["seen"]["train"] and min(defaults["seen"]["train"]) > 1
    # One epoch, one mini-batch: the old log-probs come from the training forward (no extra pass);
    # the critic's value pass and the two updates (actor, critic) run one micro-batch each.
    assert defaults["seen"]["train"] == [64, 64] and defaults["seen"]["forward_only"] == [64]

    demo = run_distributed(4, one_step_body, os.path.join(ROOT, "configs", "demo_cpu.yaml"),
                           run + ["run.name=demo", "trainer.sft_warmup_steps=0"])[0]
    # TP2 with sequence parallelism pads sequences to even lengths: 64 x align(16 + 3, 2) tokens.
    assert demo["derived"] and demo["budget"] == 64 * 20
    assert demo["rollout_batch"] == 16 * 8
    print(f"demo_cpu.yaml: sequences per training micro-batch {demo['seen']['train']}")
    # Two mini-batches of 64 samples, each cut into pp=2 micro-batches (the pipeline needs two),
    # for the actor and for the critic: 8 micro-batches holding each of the 128 samples twice.
    assert len(demo["seen"]["train"]) == 8 and sum(demo["seen"]["train"]) == 2 * 128
    assert min(demo["seen"]["train"]) > 16
    assert min(demo["seen"]["forward_only"]) > 1


def test_throughput_metrics_count_generated_and_total_tokens(tmp_path):
    out = run_distributed(1, one_step_body, None, TINY + [f"run.dir={tmp_path}", "run.name=t"])[0]
    m, samples = out["metrics"], 4 * 2  # prompts_per_step x rollout.n
    generated = m["throughput/generated_tokens_per_s"] * m["timing/step_s"]
    total = m["throughput/total_tokens_per_s"] * m["timing/step_s"]
    assert generated == pytest.approx(m["response_length/mean"] * samples, rel=1e-9)
    assert total - generated == pytest.approx(out["prompt_len"] * samples, rel=1e-9)  # add_small prompts: one length


# ----------------------------------------------------------------------------- old log-probs


def old_logprob_body(source: str, overrides: list[str]):
    """Two steps of the TINY run (critic + KL loss to a reference) with one mini-batch and
    ``algorithm.old_logprobs=source``: the actor's gradients before each optimizer step, the second
    step's metrics (the reference differs from the actor only after the first), and how many
    forward passes the actor's model ran in the second step."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, TINY + ["batch.micro_batch_size=null", "algorithm.mini_batches=1",
                                    f"algorithm.old_logprobs={source}", "trainer.resume=never"] + overrides)
    trainer = PPOTrainer(cfg, log=lambda line: None)
    forwards, grads = [0], []
    step = trainer.actor.step

    def recording_step():
        grads.append(gather_canonical(trainer.actor.chunks, "grad"))
        return step()

    trainer.actor.step = recording_step
    trainer.train_step(1)

    def count(*_):
        forwards[0] += 1

    hook = trainer.actor.chunks[0].register_forward_pre_hook(count)
    try:
        metrics = trainer.train_step(2)
    finally:
        hook.remove()
    return {"grads": grads, "metrics": metrics, "forwards": forwards[0], "source": trainer.old_logprobs.name}


def test_on_policy_shortcut_gives_the_recompute_gradients_with_one_forward_fewer(tmp_path):
    runs = {s: run_distributed(1, old_logprob_body, s, [f"run.dir={tmp_path}", f"run.name={s}"])[0]
            for s in ("recompute", "training_forward", "rollout", "auto")}
    rec, fwd = runs["recompute"], runs["training_forward"]
    assert runs["auto"]["source"] == "training_forward"  # one epoch, one mini-batch: exactly on-policy
    assert len(rec["grads"]) == len(fwd["grads"]) == 2
    assert min(max(float(g.abs().max()) for g in step.values()) for step in rec["grads"]) > 1e-3
    worst = _max_grad_diff(fwd["grads"], rec["grads"])
    print(f"training_forward vs recompute: max |dgrad| {worst:.2e}; actor forwards "
          f"{ {s: r['forwards'] for s, r in runs.items()} }")
    assert worst <= 1e-6
    # The same step in every number (loss, clip fraction, KL, entropy, grad norm, critic ...).
    volatile = ("timing/", "throughput/", "memory/")
    keys = [k for k in rec["metrics"] if not k.startswith(volatile)]
    assert set(keys) == {k for k in fwd["metrics"] if not k.startswith(volatile)}
    for key in keys:
        assert fwd["metrics"][key] == pytest.approx(rec["metrics"][key], abs=1e-6), key
    assert rec["metrics"]["actor/kl_loss"] > 1e-4 and rec["metrics"]["actor/kl"] > 1e-4
    # One forward fewer: the recompute pass (one micro-batch under the derived budget) is gone.
    assert rec["forwards"] - fwd["forwards"] == 1 and "timing/old_logprob_s" not in fwd["metrics"]
    assert runs["rollout"]["forwards"] == fwd["forwards"] == runs["auto"]["forwards"]
    # The engine's log-probs differ from the trainer's by rounding only, and so do the gradients.
    worst_rollout = _max_grad_diff(runs["rollout"]["grads"], rec["grads"])
    print(f"rollout vs recompute: max |dgrad| {worst_rollout:.2e}")
    assert worst_rollout <= 1e-4


def _max_grad_diff(steps_a: list[dict], steps_b: list[dict]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for a, b in zip(steps_a, steps_b) for k in b)


def test_old_logprob_source_keeps_the_recompute_pass_where_the_update_needs_it():
    from megatron_rl.algorithms.old_logprobs import resolve_old_logprob_source
    from megatron_rl.config.loader import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.resolve import resolve
    from megatron_rl.validation import validate

    cases = [
        ([], "training_forward"),
        (["algorithm.mini_batches=2"], "recompute"),
        (["algorithm.ppo_epochs=2"], "recompute"),
        (["algorithm.rollout_correction.mode=tis"], "recompute"),  # its weights need them before the update
        (["algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"], "recompute"),  # the KL changes the advantages
        (["algorithm.kl_coef=0.1"], "training_forward"),  # a KL loss reads the update's own log-probs
        (["algorithm.old_logprobs=recompute"], "recompute"),
        (["algorithm.old_logprobs=rollout", "algorithm.mini_batches=4"], "rollout"),
    ]
    for overrides, want in cases:
        cfg = load_config(None, overrides)
        validate(cfg, 1)
        resolved = resolve(cfg, 1).config  # rollout_correction.mode=auto depends on trainer.mode
        assert resolve_old_logprob_source(resolved.algorithm) == want, overrides
        assert resolved.algorithm.old_logprobs == want, overrides
    for overrides in (["algorithm.old_logprobs=training_forward", "algorithm.mini_batches=2"],
                      ["algorithm.old_logprobs=training_forward", "algorithm.rollout_correction.mode=mis"],
                      ["algorithm.old_logprobs=rollout", "algorithm.rollout_correction.mode=tis"]):
        with pytest.raises(ConfigError, match=r"^config error: algorithm.old_logprobs="):
            validate(load_config(None, overrides), 1)


def test_old_policy_is_assembled_the_same_way_for_every_source():
    """The experience is never edited after the update: the old policy combines it with what the
    update's first forward measured, by the resolved source's strategy."""
    from megatron_rl.algorithms.kl import estimate
    from megatron_rl.algorithms.old_logprobs import SOURCES, old_logprob_source
    from megatron_rl.trainer.experience import Experience, Samples
    from megatron_rl.trainer.old_policy import PolicyPass, old_policy

    assert {n: (s.recompute, s.loss_reads_old, s.measured_in_update) for n, s in SOURCES.items()} == {
        "recompute": (True, True, False), "training_forward": (False, False, True), "rollout": (False, True, True)}
    with pytest.raises(ValueError, match="not resolved"):
        old_logprob_source("auto")
    samples = Samples([0, 0], [0, 0], [[1, 2], [1, 2, 3]], [[4, 5, 6], [7]], [[-1.0, -2.0, -3.0], [-0.5]],
                      ["stop", "length"])
    mask = samples.response_mask()
    outs = [{"logprob": torch.arange(5.0) * -0.1, "entropy": torch.full((5,), 0.7)},
            {"logprob": torch.arange(4.0) * -0.2, "entropy": torch.full((4,), 0.3)}]
    ref = torch.tensor([[-1.1, -2.2, -2.9], [-0.4, 0.0, 0.0]]) * mask
    exp = Experience(samples, torch.tensor([1.0, 0.0]), mask, None, ref, None, torch.zeros_like(mask),
                     torch.zeros_like(mask), None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        exp.old_logprob = ref
    # training_forward: the update's first forward (every sample) is the old policy, KL from it.
    every = PolicyPass.from_outputs(samples, mask, outs)
    torch.testing.assert_close(every.logprob, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0.0, 0.0]]))
    pol = old_policy(exp, every, "k1")
    assert pol.logprob is every.logprob and pol.measured is None
    torch.testing.assert_close(pol.kl, estimate(every.logprob, ref, "k1") * mask)
    # rollout, two mini-batches: the loss read the engine's; the trainer measured sample 1 only.
    rollout = dataclasses.replace(exp, old_logprob=samples.rollout_logprobs() * mask)
    part = PolicyPass.from_outputs(samples, mask, outs[1:], [1])
    pol = old_policy(rollout, part, "k1")
    assert pol.measured.tolist() == [False, True] and pol.trainer_logprob[0].abs().sum() == 0
    assert pol.entropy[1, 0] == pytest.approx(0.3) and pol.logprob is rollout.old_logprob
    assert pol.kl[0].tolist() == pytest.approx([0.1, 0.2, -0.1])  # k1: old - ref, from the engine's


# ----------------------------------------------------------------------------- exact resume

VOLATILE = ("timing/", "throughput/", "memory/")
# Per-rank figures of the layout itself: generation runs on the actor's shard of this rank.
LAYOUT_DEPENDENT = ("rollout/weights_gb",)


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _across_layouts(rows: list[dict]) -> list[dict]:
    """What two runs on different layouts must agree on."""
    return [{k: v for k, v in r.items() if k not in LAYOUT_DEPENDENT} for r in _stable(rows)]


@pytest.mark.slow
def test_resume_gives_identical_metrics(tmp_path):
    common = ["parallel.tp=2", "trainer.save_every=2", "algorithm.ppo_epochs=2"]
    run_distributed(2, ppo_body, common + ["trainer.steps=4", f"run.dir={tmp_path}", "run.name=straight"])
    run_distributed(2, ppo_body, common + ["trainer.steps=2", f"run.dir={tmp_path}", "run.name=resumed"])
    # A different layout for the second half: weights and optimizer state reshard on load.
    run_distributed(2, ppo_body, ["parallel.pp=2", "trainer.save_every=2", "algorithm.ppo_epochs=2",
                                  "trainer.steps=4", f"run.dir={tmp_path}", "run.name=resumed"])
    straight = _across_layouts(read_metrics(tmp_path / "straight"))
    resumed = _across_layouts(read_metrics(tmp_path / "resumed"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        for key in a:
            if isinstance(a[key], float):
                assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)
            else:
                assert a[key] == b[key], (a["step"], key)


def test_resume_same_layout_is_bit_identical(tmp_path):
    common = ["trainer.save_every=1"]
    run_distributed(1, ppo_body, common + ["trainer.steps=3", f"run.dir={tmp_path}", "run.name=a"])
    run_distributed(1, ppo_body, common + ["trainer.steps=1", f"run.dir={tmp_path}", "run.name=b"])
    run_distributed(1, ppo_body, common + ["trainer.steps=3", f"run.dir={tmp_path}", "run.name=b"])
    assert _stable(read_metrics(tmp_path / "a")) == _stable(read_metrics(tmp_path / "b"))


@pytest.mark.slow
def test_distributed_optimizer_matches_plain_adam_and_resumes_exactly(tmp_path):
    """Adam state sharded over two DP ranks: the same run as plain Adam, and an exact resume; then
    a resume from DP2xTP2 onto DP2xPP2, where each rank's shard of the state is a different slice
    of different parameters, continues the same run."""
    dist_opt = ["actor.optim.use_distributed_optimizer=true", "critic.optim.use_distributed_optimizer=true"]
    common = ["trainer.save_every=1", f"run.dir={tmp_path}"]
    run_distributed(2, ppo_body, common + ["trainer.steps=3", "run.name=plain"])
    run_distributed(2, ppo_body, common + dist_opt + ["trainer.steps=3", "run.name=sharded"])
    run_distributed(2, ppo_body, common + dist_opt + ["trainer.steps=1", "run.name=resumed"])
    run_distributed(2, ppo_body, common + dist_opt + ["trainer.steps=3", "run.name=resumed"])
    plain, sharded = _stable(read_metrics(tmp_path / "plain")), _stable(read_metrics(tmp_path / "sharded"))
    assert _stable(read_metrics(tmp_path / "resumed")) == sharded
    _assert_close(plain, sharded, 1e-5)
    assert len({r["reward/mean"] for r in sharded}) > 1  # the run moves: there is something to compare

    tp2, pp2 = ["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.pp=2"]
    run_distributed(4, ppo_body, common + dist_opt + tp2 + ["trainer.steps=3", "run.name=tp2"])
    run_distributed(4, ppo_body, common + dist_opt + tp2 + ["trainer.steps=1", "run.name=retiled"])
    run_distributed(4, ppo_body, common + dist_opt + pp2 + ["trainer.steps=3", "run.name=retiled"])
    # Clip fractions count values on either side of a threshold; after resharding, rounding at the
    # 1e-7 level may move one value across it, so they are left out of this comparison.
    _assert_close(_across_layouts(read_metrics(tmp_path / "tp2")), _across_layouts(read_metrics(tmp_path / "retiled")),
                  1e-5, skip="clipfrac")


def _assert_close(rows_a: list[dict], rows_b: list[dict], tol: float, skip: str = "") -> None:
    assert len(rows_a) == len(rows_b)
    for a, b in zip(rows_a, rows_b):
        for key in a:
            if isinstance(a[key], float) and not (skip and key.endswith(skip)):
                assert b[key] == pytest.approx(a[key], abs=tol), (a["step"], key, a[key], b[key])





# ----------------------------------------------------------------------------- safe saves


def failing_save_body(run_dir: str, errno_code: int):
    """Save step 1, then fail in the middle of saving step 2 (as a crash or a full disk would)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.config.loader import load_config
    from megatron_rl.engine import checkpoint as ckpt
    from megatron_rl.errors import StorageError
    from megatron_rl.trainer.ppo import PPOTrainer

    cfg = load_config(None, TINY + ["trainer.steps=2", f"run.dir={run_dir}", "run.name=f", "trainer.resume=never"])
    trainer = PPOTrainer(cfg, log=lambda line: None)
    trainer.train_step(1)
    trainer.save(1)
    trainer.train_step(2)
    original = dist_checkpointing.save

    def broken(state, path, *args, **kwargs):
        original(state, path, *args, **kwargs)
        with open(os.path.join(path, "__0_0.distcp"), "r+b") as fh:
            fh.truncate(10)  # half-written data
        raise OSError(errno_code, os.strerror(errno_code))

    dist_checkpointing.save = broken
    try:
        trainer.save(2)
        raised = None
    except OSError as err:
        raised = err.errno
    except StorageError as err:  # a full disk: one line, not the OSError
        raised = err.one_line()
    finally:
        dist_checkpointing.save = original
    root = os.path.join(run_dir, "f", "checkpoints")
    latest = ckpt.find_latest(root)
    # A fresh trainer resumes from the last good checkpoint.
    cfg2 = load_config(None, TINY + ["trainer.steps=2", f"run.dir={run_dir}", "run.name=f"])
    resumed = PPOTrainer(cfg2, log=lambda line: None)
    dist.barrier()
    return {"raised": raised, "latest": os.path.basename(latest), "start": resumed.start_step,
            "entries": sorted(os.listdir(root))}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO], ids=["ENOSPC", "EIO"])  # full disk, crash mid-write
def test_failed_save_leaves_previous_checkpoint_loadable(tmp_path, code):
    out = run_distributed(1, failing_save_body, str(tmp_path), code)[0]
    if code == errno.ENOSPC:  # a full disk is named in one line and leaves nothing behind
        assert out["raised"].startswith("storage error: ") and "disk is full" in out["raised"], out["raised"]
        assert "step_00000002.tmp" not in out["entries"]
    else:
        assert out["raised"] == code
    assert out["latest"] == "step_00000001" and out["start"] == 1
    assert "step_00000002" not in out["entries"]  # at most a .tmp leftover, never a bad final dir


def test_truncated_checkpoint_is_detected_and_previous_used(tmp_path):
    from megatron_rl.engine import checkpoint as ckpt
    from megatron_rl.errors import CheckpointError

    run_distributed(1, ppo_body, ["trainer.steps=2", "trainer.save_every=1", "trainer.keep_last=3",
                                  f"run.dir={tmp_path}", "run.name=t"])
    root = tmp_path / "t" / "checkpoints"
    victim = root / "step_00000002" / "actor" / "__0_0.distcp"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        ckpt.check_checkpoint(str(root / "step_00000002"))
    assert os.path.basename(ckpt.find_latest(str(root))) == "step_00000001"


# ----------------------------------------------------------------------------- normalisation


def normalisation_body(layout_kw: dict, micro_batch_size: int, agg: str, weights):
    """Actor loss on a fixed batch; returns canonical gradients (and the weights used)."""
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
        seqs.append({"tokens": torch.randint(0, 64, (n,), generator=g), "loss_mask": mask,
                     "old_logprob": -torch.rand(n, generator=g) * 3 * mask,
                     "advantages": torch.randn(n, generator=g) * mask})
        lengths.append(n_resp)
    alg = AlgorithmConfig(loss_agg=agg)
    trainable.zero_grad()
    run_sequences(trainable.chunks, seqs, LogProbHead(with_entropy=False), BatchPlan(micro_batch_size=micro_batch_size),
                  torch.device("cpu"), loss_fn=actor_loss_fn(alg, loss_denominator(agg, lengths), lengths, 0.0),
                  forward_only=False)
    return {"grads": gather_canonical(trainable.chunks, "grad"), "weights": weights}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradients_do_not_depend_on_how_the_batch_is_cut(agg):
    ref = run_distributed(1, normalisation_body, {}, 8, agg, None)[0]
    assert max(float(g.abs().max()) for g in ref["grads"].values()) > 1e-4
    cases = [(1, {}, 2), (2, {}, 1), (2, dict(cp=2), 2), (4, dict(cp=2), 1)]  # 4 mbs, DP2, CP2, DP2xCP2
    for world, layout, mbs in cases:
        got = run_distributed(world, normalisation_body, layout, mbs, agg, ref["weights"])[0]
        worst = max(float((got["grads"][k] - ref["grads"][k]).abs().max()) for k in ref["grads"])
        print(f"{agg} world={world} {layout} micro_batch_size={mbs}: max |dgrad| {worst:.2e}")
        assert worst <= 1e-6, (agg, world, layout, mbs, worst)


# ----------------------------------------------------------------------------- reward errors


def test_reward_function_that_raises_stops_the_run_with_the_prompt_index(tmp_path):
    from megatron_rl.data.tasks import TASKS

    # The message names the dataset index of the failing prompt (all 20 add_small prompts in one step).
    index = [prompt for prompt, _ in TASKS["add_small"]()].index("7+2=")
    module = tmp_path / "bad_reward.py"
    module.write_text("def reward(prompts, responses, answers, **kw):\n"
                      "    if any(p.startswith('7+2') for p in prompts):\n"
                      "        raise KeyError('no table entry')\n"
                      "    return [0.0] * len(responses)\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.tools.cli", "train", *TINY, "reward.fn=bad_reward:reward",
                           "trainer.prompts_per_step=20", "trainer.steps=1", f"run.dir={tmp_path}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("reward error: reward.fn=bad_reward:reward") and f"prompt index {index}" in last, last


# ----------------------------------------------------------------------------- preemption


def _cli(args, env=None, timeout=600):
    from megatron_rl.testing.cli_runner import run_cli

    return run_cli(*args, env=dict(os.environ, **(env or {})), timeout=timeout)


@pytest.mark.slow
def test_sigterm_checkpoints_then_resume_continues(tmp_path):
    args = ["train", *TINY, "--nproc", "2", "parallel.tp=2", "trainer.steps=4", f"run.dir={tmp_path}", "run.name=p"]
    first = _cli(args, env={"MEGATRON_RL_FAULT": "sigterm@rank=1:step=2"})
    assert first.returncode == 0, first.stderr
    assert "checkpoint after step 2" in first.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "p")] == [1, 2]
    second = _cli(args)
    assert second.returncode == 0, second.stderr
    assert "resumed after step 2" in second.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "p")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_run_ppo_sh_demo_learns(tmp_path):
    """The README's first command: the CPU demo's reward must rise by >= 0.3.

    One seed (the README's), its bound far below every rise measured on one AVX-512 machine (first
    5 -> last 10 of 100 steps): seed 1234 0.523 / 0.620 / 0.620 under ``ATEN_CPU_CAPABILITY`` avx2 /
    avx512 / default, seed 1 0.677 (avx512), seed 2 0.409 (avx2).

    The time is reported, not asserted: about 5 minutes on an idle 2-core machine, 5-9 minutes
    on a loaded CI machine.  The subprocess timeout only catches a hang."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.testing.harness import close_all_pools

    steps = load_config(os.path.join(ROOT, "configs", "demo_cpu.yaml")).trainer.steps
    close_all_pools()  # idle test workers would share the two cores with the demo's four ranks
    start = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FORK_RANKS"}  # ranks start as users' do
    proc = subprocess.run(["./run_ppo.sh", f"run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, env=env)
    minutes = (time.monotonic() - start) / 60
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "demo_cpu")
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    print(f"demo: reward {first:.3f} (first 5 steps) -> {last:.3f} (last 10 steps) in {minutes:.1f} min")
    assert len(rows) == steps and last - first >= 0.3
    assert (tmp_path / "demo_cpu" / "plot.png").is_file()
    assert (tmp_path / "demo_cpu" / "checkpoints" / "latest").is_file()


def test_offload_between_phases_changes_no_number(tmp_path):
    """Moving inactive models to host memory and back must leave every metric unchanged."""
    common = ["parallel.tp=2", "trainer.steps=2", f"run.dir={tmp_path}"]
    run_distributed(2, ppo_body, common + ["run.name=on", "trainer.offload=true"])
    run_distributed(2, ppo_body, common + ["run.name=off"])
    assert _stable(read_metrics(tmp_path / "on")) == _stable(read_metrics(tmp_path / "off"))


def offloader_body():
    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.engine.offload import Offloader
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(tp=2)
    chunks = build_gpt_chunks(ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, vocab_size=64),
                              layout, torch.device("cpu"))
    trainable = make_trainable(chunks, OptimConfig(), 1)
    for chunk in trainable.chunks:
        for p in chunk.parameters():
            p.main_grad.copy_(torch.randn_like(p.main_grad))
    trainable.step()  # creates Adam state
    before = [p.detach().clone() for c in trainable.chunks for p in c.parameters()]
    grads = [p.main_grad.clone() for c in trainable.chunks for p in c.parameters()]
    off = Offloader(trainable.chunks, trainable.optimizer)
    moved = off.offload()
    freed = all(p.untyped_storage().nbytes() == 0 for c in trainable.chunks for p in c.parameters())
    off.onload()
    after = [p.detach() for c in trainable.chunks for p in c.parameters()]
    grads_after = [p.main_grad for c in trainable.chunks for p in c.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(before, after)) and all(
        torch.equal(a, b) for a, b in zip(grads, grads_after))
    return moved, freed, same


def test_offloader_frees_device_storage_and_restores_it_in_place():
    for moved, freed, same in run_distributed(2, offloader_body):
        assert moved > 0 and freed and same
