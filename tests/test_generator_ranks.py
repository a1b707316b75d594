"""Generation on ranks of its own (``rollout.ranks``): the last ranks of the job generate, the
others train; ``trainer.mode`` says how far generation runs ahead.  Real jobs through the command
line (two torch.distributed worlds joined by the job's store)."""

from __future__ import annotations

import collections
import json
import os
import re

import pytest

from tests.support.helpers import TINY, read_metrics
from tests.test_cli import cli

# Keys that differ by placement or by the clock, not by what was trained.
VOLATILE = ("timing/", "memory/", "throughput/", "rollout/weights_gb", "rollout/generate_s", "rollout/generator_",
            "rollout/trainer_wait_s", "rollout/refit_bytes", "rollout/generator_shard_bytes")


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _train(tmp_path, name: str, nproc: int, *overrides: str, env=None):
    proc, seconds = cli("train", "--nproc", str(nproc), *TINY, "actor.optim.lr=0.01", f"run.dir={tmp_path}",
                        f"run.name={name}", *overrides, env=env)
    print(f"{name}: {seconds:.1f} s")
    return proc


def test_one_step_off_on_generator_ranks_trains_what_the_colocated_mode_trains(tmp_path):
    """One trainer and one generator rank: the generator gets the weights after every update and
    the request for batch k+2 after update k, so it generates batch k+2 while step k+1 trains, with
    the weights the colocated mode would use: the same samples, rewards, losses, step by step."""
    common = ("trainer.mode=one_step_off", "trainer.steps=4")
    colocated = _train(tmp_path, "colocated", 1, *common)
    assert colocated.returncode == 0, colocated.stderr[-3000:]
    separate = _train(tmp_path, "separate", 2, *common, "rollout.ranks=1")
    assert separate.returncode == 0, separate.stderr[-3000:]
    assert "generators: 1 rank(s), layout tp=1 pp=1 ep=1 dp=1" in separate.stdout
    rows, reference = read_metrics(tmp_path / "separate"), read_metrics(tmp_path / "colocated")
    assert _stable(rows) == _stable(reference)
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1]
    assert [r["rollout/policy_version"] for r in rows] == [0, 0, 1, 2]
    # The generator side reports its work; the trainer side how long it waited for it.
    assert all(r["rollout/generate_s"] > 0 and r["rollout/generator_tokens_per_s"] > 0 for r in rows)
    # Each push filled the generator's shard (here the whole model), nothing more.
    assert all(r["rollout/refit_bytes"] == r["rollout/generator_shard_bytes"] > 0 for r in rows)
    assert all(r["timing/refit_s"] > 0 for r in rows)


@pytest.mark.slow
def test_async_staleness_stays_bounded_and_a_killed_job_resumes_exactly(tmp_path):
    """trainer.mode=async, max_staleness=2, weights pushed every 2 updates: batch k is requested as
    soon as its staleness cannot exceed 2, so the versions follow the push schedule exactly.  The
    job SIGKILLed during step 5 (checkpoint after step 4, which holds batches 5 and 6, generated
    and not yet trained) and resumed logs every step once, with what the straight job logged, and
    trains every sample id once: the same samples, under the same ids, as the straight job."""
    common = ("trainer.mode=async", "trainer.max_staleness=2", "trainer.push_weights_every=2", "trainer.steps=6",
              "trainer.save_every=2", "rollout.ranks=1", "trainer.log_samples=true")
    straight = _train(tmp_path, "straight", 2, *common)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _train(tmp_path, "resumed", 2, *common, env={"MEGATRON_RL_FAULT": "kill@rank=0:step=5"})
    assert killed.returncode != 0
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3, 4]
    resumed = _train(tmp_path, "resumed", 2, *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed after step 4" in resumed.stdout
    rows, reference = read_metrics(tmp_path / "resumed"), read_metrics(tmp_path / "straight")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert _stable(rows) == _stable(reference)
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 1, 2, 1]
    assert [r["rollout/policy_version"] for r in rows] == [0, 0, 0, 2, 2, 4]
    # The checkpoint after step 4 held batches 5 and 6: the ids of what the job trained after it.
    from megatron_rl.engine.checkpoint import load_trainer_state

    state = load_trainer_state(str(tmp_path / "resumed" / "checkpoints" / "step_00000004"))
    assert [b["step"] for b in state["rollout_buffer"]] == [5, 6]
    assert [b["version"] for b in state["rollout_buffer"]] == [2, 4]
    # Every sample once, under its id: the resumed job's trained samples are the straight job's, and
    # those of steps 5 and 6 are the batches the checkpoint held, ids included.
    trained, straight_samples = _trained_samples(tmp_path / "resumed"), _trained_samples(tmp_path / "straight")
    ids, per_step = [r["id"] for r in trained], collections.Counter(r["step"] for r in trained)
    assert len(ids) == len(set(ids)) and sorted(per_step) == [1, 2, 3, 4, 5, 6] and len(set(per_step.values())) == 1
    assert trained == straight_samples
    assert sorted({r["step"]: r["version"] for r in trained}.items()) == list(enumerate([0, 0, 0, 2, 2, 4], 1))
    buffered = [i for b in state["rollout_buffer"] for i in b["samples"]["sample_id"]]
    assert buffered == [r["id"] for r in trained if r["step"] in (5, 6)] and buffered[0] == "5-0"


def _trained_samples(run_dir) -> list[dict]:
    """The samples a run trained (trainer.log_samples), in step order."""
    rows = []
    for path in sorted((run_dir / "samples").glob("step_*.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    return rows


PUSH_CFG = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                vocab_size=50, params_dtype="float32", transformer_impl="local", max_position_embeddings=64)
PUSH_PROMPTS = [[5, 17, 3], [9, 2, 44, 30, 7]]


def push_during_rollout_body(at: int) -> tuple:
    """``(straight, pushed, swaps)``: the same seed's rollout without and with version 1's weights
    arriving before token ``at`` (``swaps``: pushes the engine took mid-rollout)."""
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.rollout.megatron import MegatronRolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams
    from megatron_rl.testing.weights import random_canonical

    cfg = ModelConfig(**PUSH_CFG)
    weights = {v: random_canonical(cfg, v, std=0.2) for v in (0, 1)}
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)

    class PushBefore:
        """Weights of version 1 arrive before token ``at`` is drawn."""

        def __init__(self, engine):
            self.engine, self.polls, self.version = engine, 0, 0

        def poll(self) -> bool:
            self.polls += 1
            if self.polls != at + 1:
                return False
            self.engine.load_weights(weights[1])
            self.version = 1
            return True

    from megatron_rl.testing.layouts import use_layout

    use_layout()
    # dynamic: what rollout.batching=auto runs for partial rollouts, here for the straight rollout too
    engine = MegatronRolloutEngine(cfg, "cpu", max_batch_size=8, kv_cache_memory=2**22,
                                   prefill_chunk_tokens=64, kv_block_tokens=16, batching="dynamic")
    engine.load_weights(weights[0])
    straight = engine.generate(PUSH_PROMPTS, params, seed=3)
    engine.live_weights = PushBefore(engine)
    pushed = engine.generate(PUSH_PROMPTS, params, seed=3)
    return straight, pushed, engine.weight_swaps


def test_a_push_during_a_rollout_continues_it_with_the_new_weights():
    """A push before token 3 (partial rollouts): tokens 0-2 are the old policy's (the same tokens
    and log-probs as a rollout without the push), tokens 3-7 the new one's, and every token's
    log-prob is what the version it records gives it after the whole sample so far (the running
    samples' KV cache is recomputed with the new weights) -- on the KV-cache decoder and on
    megatron's engine (whose requests are suspended and re-prefilled), both scored by the decoder."""
    import torch

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.testing.harness import run_distributed
    from megatron_rl.testing.weights import random_canonical
    from tests.support.decoder import TorchRolloutEngine

    straight, pushed, swaps = run_distributed(1, push_during_rollout_body, 3)[0]
    assert swaps == 1
    assert straight.token_versions is None
    assert pushed.token_versions == [[0, 0, 0, 1, 1, 1, 1, 1]] * 4
    for k in range(4):
        assert pushed.response_ids[k][:3] == straight.response_ids[k][:3]
        assert pushed.response_logprobs[k][:3] == straight.response_logprobs[k][:3]
    cfg = ModelConfig(**PUSH_CFG)
    scorers = {}
    for version in (0, 1):
        scorers[version] = TorchRolloutEngine(cfg, "cpu")
        scorers[version].load_weights(random_canonical(cfg, version, std=0.2))

    def logprob(version: int, k: int, t: int) -> float:
        prefix = pushed.prompt_ids[k] + pushed.response_ids[k][:t]
        with torch.inference_mode():
            logits = scorers[version]._prefill([prefix], 1)[0][0].float()
        return float(torch.log_softmax(logits, -1)[pushed.response_ids[k][t]])

    worst, moved = 0.0, 0.0
    for k in range(4):
        for t, version in enumerate(pushed.token_versions[k]):
            worst = max(worst, abs(pushed.response_logprobs[k][t] - logprob(version, k, t)))
            if version == 1:
                moved = max(moved, abs(pushed.response_logprobs[k][t] - logprob(0, k, t)))
    print(f"megatron: behaviour log-prob vs its version's: max {worst:.2g}; "
          f"vs the old version after the push: {moved:.2g}")
    assert worst < 1e-5
    assert moved > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("engine_name", ["megatron"])
def test_partial_rollouts_mix_versions_within_the_bound_in_an_async_job(tmp_path, engine_name):
    """Decode slowed to 50 ms a token (the test's own workload shaping) so every push lands while
    the generator is mid-batch: samples then hold tokens of two versions, each sample's staleness
    (its oldest token's) stays within max_staleness, and its newer tokens make the token-mean
    staleness lower than the sample maximum -- on the KV-cache decoder and on megatron's engine."""
    from megatron_rl.testing.workload import job_env

    proc = _train(tmp_path, "partial", 2, "trainer.mode=async", "trainer.max_staleness=1",
                  "trainer.partial_rollouts=true", "rollout.ranks=1", "rollout.max_new_tokens=16", "trainer.steps=5",
                  f"rollout.engine={engine_name}", env=job_env(decode_floor_s=0.05))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "partial")
    print("partial share per step:", [r["rollout/partial_frac"] for r in rows],
          "token staleness:", [round(r["rollout/token_staleness_mean"], 3) for r in rows])
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    mixed = [r for r in rows if r["rollout/partial_frac"] > 0]
    assert len(mixed) >= 2, rows
    assert all(r["rollout/token_staleness_mean"] < r["rollout/staleness_max"] for r in mixed)


def test_two_training_ranks_and_a_tp2_generator_on_megatrons_engine(tmp_path):
    """Both worlds with parallel groups of their own: data-parallel trainers, and generators that
    split the model over TP2 with megatron's inference engine (each loading its TP shard from the
    pushed copy).  The staleness follows the async schedule."""
    proc = _train(tmp_path, "tp2", 4, "trainer.mode=async", "trainer.max_staleness=1", "trainer.steps=3",
                  "rollout.ranks=2", "rollout.layout.tp=2", "rollout.engine=megatron")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layout: tp=1 pp=1 cp=1 dp=2" in proc.stdout
    assert "generators: 2 rank(s), layout tp=2 pp=1 ep=1 dp=1, MegatronRolloutEngine" in proc.stdout
    rows = read_metrics(tmp_path / "tp2")
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1]
    # Generator rank 0 received exactly its TP shard from the two trainers: less than the whole
    # model, which the two data-parallel trainers each hold.
    assert all(0 < r["rollout/refit_bytes"] == r["rollout/generator_shard_bytes"] for r in rows)
    assert all(0 < r["reward/mean"] <= 1 for r in rows)


def test_generator_ranks_under_torchrun_share_the_agents_store(tmp_path):
    """Under torchrun (as the sbatch script runs it) the agent serves the store at MASTER_PORT:
    every rank joins it as a client, none tries to serve a second one on the same port."""
    import subprocess
    import sys

    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone",
                           "--nproc-per-node", "2", "-m", "megatron_rl.tools.cli", "train", *TINY,
                           "rollout.ranks=1", "trainer.mode=async", "trainer.steps=2", f"run.dir={tmp_path}",
                           "run.name=torchrun"], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FAULT"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generators: 1 rank(s)" in proc.stdout
    assert "failed to bind" not in proc.stderr, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "torchrun")] == [1, 2]


def test_sigterm_checkpoints_the_generated_batches_and_exits_0(tmp_path):
    """A stop signal reaches every rank: the generators keep serving, the trainers finish the
    step, take every requested batch into the checkpoint, stop the generators and exit 0; the
    resumed job trains those batches and logs each step once, staleness within the bound."""
    common = ("trainer.mode=async", "trainer.max_staleness=2", "trainer.steps=4", "rollout.ranks=1")
    stopped = _train(tmp_path, "stopped", 2, *common, env={"MEGATRON_RL_FAULT": "sigterm@rank=0:step=2"})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert "checkpoint after step 2" in stopped.stdout
    from megatron_rl.engine.checkpoint import load_trainer_state

    state = load_trainer_state(str(tmp_path / "stopped" / "checkpoints" / "step_00000002"))
    assert [b["step"] for b in state["rollout_buffer"]] == [3, 4]
    resumed = _train(tmp_path, "stopped", 2, *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(tmp_path / "stopped")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 2]


@pytest.mark.slow
def test_a_stop_signal_that_reaches_only_a_generator_rank_checkpoints_and_exits_0(tmp_path):
    """A preemption notice can reach any node of a job: SIGTERM to generator rank 0 alone (the
    launcher never sees it; it used to be ignored and the job ran to its last step) stops the job
    as one to the launcher does: checkpoint at the trainers' next step boundary, exit 0; the
    resumed job finishes the run."""
    common = ("trainer.mode=async", "trainer.max_staleness=2", "trainer.steps=6", "rollout.ranks=1")
    stopped = _train(tmp_path, "gen_signal", 2, *common,
                     env={"MEGATRON_RL_FAULT": "sigterm@role=generator:rank=0:step=2"})
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    found = re.search(r"signal 15 on generator rank 0 \(job rank 1\): checkpoint after step (\d+) at (\S+); exiting",
                      stopped.stdout)
    assert found, stopped.stdout[-3000:]
    step = int(found.group(1))
    assert step < 6 and os.path.isdir(found.group(2))
    assert [r["step"] for r in read_metrics(tmp_path / "gen_signal")] == list(range(1, step + 1))
    resumed = _train(tmp_path, "gen_signal", 2, *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "gen_signal")] == list(range(1, 7))


def test_a_dead_generator_rank_ends_the_job_with_its_name(tmp_path):
    proc = _train(tmp_path, "dies", 2, "trainer.mode=async", "trainer.steps=4", "rollout.ranks=1",
                  env={"MEGATRON_RL_FAULT": "kill@role=generator:rank=0:step=2"})
    assert proc.returncode != 0
    assert "rank 1 (generator rank 0) died (signal 9)" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("overrides,nproc,key", [
    (["trainer.mode=async"], 2, "trainer.mode"),
    (["rollout.ranks=2"], 2, "rollout.ranks"),
    (["rollout.ranks=1", "algorithm.advantage=grpo", "algorithm.dynamic_sampling=true"], 2,
     "algorithm.dynamic_sampling"),
    (["rollout.ranks=1", "trainer.mode=async", "algorithm.old_logprobs=rollout"], 2, "algorithm.old_logprobs"),
    (["rollout.ranks=3", "rollout.layout.tp=2"], 4, "rollout.layout.tp"),
])
def test_generator_ranks_refuse_what_they_cannot_run_before_launch(overrides, nproc, key):
    from megatron_rl.config.loader import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.validation import validate

    cfg = load_config(None, TINY + overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, nproc)
    assert str(err.value).startswith(f"config error: {key}="), str(err.value)


# Seeds of the learning comparison: one seed's 30-step trajectory rides on the CPU's kernels.
LEARNING_SEEDS = (1234, 1, 2)


@pytest.mark.slow
def test_grpo_learns_the_demo_task_in_async_mode(tmp_path):
    """configs/grpo_cpu.yaml (add_small), the same 30 steps and seeds: colocated sync on one rank, and
    async with one generator and one trainer rank, batches up to two versions stale (decoupled PPO,
    behaviour weight truncated at 2).  The bound is on the mean over three seeds, from the spread
    measured on one AVX-512 machine under torch's three CPU kernel sets (``ATEN_CPU_CAPABILITY``;
    reward rise, first 5 -> last 5 steps, seeds 1234 / 1 / 2, mean):

    ============  =========================  =========================
    kernels       sync                       async
    ============  =========================  =========================
    avx2          0.300 0.306 0.377 (0.328)  0.209 0.223 0.267 (0.233)
    avx512        0.306 0.375 0.375 (0.352)  0.125 0.186 0.253 (0.188)
    default       0.320 0.361 0.409 (0.363)  0.306 0.138 0.283 (0.242)
    ============  =========================  =========================

    One seed's async rise ranges over 0.125-0.306 with the kernels and the seed (seed 1234 alone:
    0.125 / 0.209 / 0.306), so a bound on one seed failed on one kernel set and passed on another.
    Async gains less than sync in 30 steps on every seed and kernel set (0.53-0.71x on the means).
    Not through the lag of its batches: against the policy version that generated each batch
    (versions 0-4 -> 23-27) its mean rise is the same (0.238 / 0.195 / 0.247), so an update on a
    batch two versions old gains less here (docs/algorithms.md).  Asserted: the async mean rise
    >= 0.12 and >= 0.4x the sync mean (measured 0.71x / 0.53x / 0.67x)."""
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "grpo_cpu.yaml")
    modes = {"sync": ("--nproc", "1"),
             "async": ("--nproc", "2", "rollout.ranks=1", "trainer.mode=async", "trainer.max_staleness=2")}
    rises: dict = {mode: [] for mode in modes}
    for seed in LEARNING_SEEDS:
        for mode, args in modes.items():
            name = f"{mode}_{seed}"
            proc, seconds = cli("train", "--config", config, *args, "trainer.steps=30", f"run.dir={tmp_path}",
                                f"run.name={name}", f"run.seed={seed}", timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            rows = read_metrics(tmp_path / name)
            rewards = [r["reward/mean"] for r in rows]
            first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
            rises[mode].append(last - first)
            staleness = [r["rollout/staleness_max"] for r in rows]
            print(f"GRPO {mode} seed {seed}: reward {first:.3f} (first 5 steps) -> {last:.3f} (last 5 of "
                  f"{len(rewards)}) in {seconds:.0f} s; staleness {json.dumps(staleness)}")
            if mode == "async":
                assert staleness == [0, 1] + [2] * 28
    mean = {mode: sum(r) / len(r) for mode, r in rises.items()}
    print(f"mean rise over seeds {LEARNING_SEEDS}: {mean}")
    assert mean["async"] >= 0.12 and mean["async"] >= 0.4 * mean["sync"], rises
