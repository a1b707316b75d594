"""The trainer stops with one line instead of failing silently or late: a phase whose every update
was non-finite, a reward function that crashes on rank 0; and the helpers the loop relies on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from megatron_rl.testing.cli_runner import run_cli
from megatron_rl.testing.harness import run_distributed
from megatron_rl.trainer.experience import Samples, response_positions
from megatron_rl.utils.seeds import derive_seed
from megatron_rl.utils.timing import timed
from tests.support.helpers import TINY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_whose_critic_updates_are_all_non_finite_stops_with_one_line(tmp_path):
    """At critic lr 1e30 the first critic update blows the values up; from then on every critic
    gradient is non-finite.  Step 1 still applies one of its two updates; step 2 applies none."""
    proc = run_cli("train", *TINY, "critic.optim.lr=1e30", "trainer.steps=3", f"run.dir={tmp_path}", "run.name=n")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("training error: critic.optim.lr=1e+30: all 2 critic optimizer steps of PPO step 2 "
                           "were skipped (non-finite gradients"), last
    assert "fix: lower critic.optim.lr" in last, last
    with open(tmp_path / "n" / "metrics.jsonl") as fh:
        rows = [json.loads(line) for line in fh]
    assert [r["step"] for r in rows] == [1] and rows[0]["critic/skipped_updates"] == 1


def reward_failure_body():
    """Each rank's outcome of rank-0 rewards that succeed, fail as bad input, and crash."""
    import time

    import torch.distributed as dist

    from megatron_rl.rewards.distributed import rewards_from_rank0
    from megatron_rl.rewards.registry import RewardFunctionError

    def bad_input():
        raise RewardFunctionError("reward.fn", "mine", "returned 3 values for 4 responses", "return 4 numbers")

    def crash():
        raise KeyError("no table entry")

    out = {"scores": rewards_from_rank0(lambda: torch.tensor([0.5, 1.0]) * (dist.get_rank() + 1)).tolist()}
    for name, compute in (("bad_input", bad_input), ("crash", crash)):
        start = time.monotonic()
        try:
            rewards_from_rank0(compute)
            out[name] = None
        except Exception as err:  # noqa: BLE001 - the test records whatever each rank raises
            out[name] = (type(err).__name__, str(err), time.monotonic() - start)
    return out


def test_reward_failure_on_rank_0_is_raised_on_every_rank_at_once():
    rank0, rank1 = run_distributed(2, reward_failure_body)
    assert rank0["scores"] == rank1["scores"] == [0.5, 1.0]
    assert rank0["bad_input"][:2] == rank1["bad_input"][:2]
    assert rank1["bad_input"][0] == "RewardFunctionError" and "returned 3 values" in rank1["bad_input"][1]
    assert rank0["crash"][0] == "KeyError"
    assert rank1["crash"][0] == "RewardsFailedOnRank0" and "KeyError: 'no table entry'" in rank1["crash"][1]
    # Without the broadcast failure, rank 1 would wait for the process-group timeout (minutes).
    assert rank1["crash"][2] < 30


def test_response_positions_place_each_response_token_one_position_before_it():
    samples = Samples(prompt_index=[0, 0], dataset_index=[3, 3], prompt_ids=[[1, 2, 3], [1, 2, 3, 4]],
                      response_ids=[[7, 8], [9]], rollout_logprob=[[-0.5, -0.25], [-1.0]],
                      finish_reason=["stop", "length"])
    assert response_positions(3, 2) == slice(2, 4)  # tokens 3 and 4 are predicted at positions 2 and 3
    per_position = [torch.arange(5.0), torch.arange(5.0) * 10]
    assert samples.pad_responses(per_position).tolist() == [[2.0, 3.0], [30.0, 0.0]]
    assert samples.rollout_logprobs().tolist() == [[-0.5, -0.25], [-1.0, 0.0]]


def test_derived_seeds_are_stable_and_separate_streams():
    # The same in another process with another string-hash salt (resume and every rank rely on it).
    other = subprocess.run([sys.executable, "-c", "from megatron_rl.utils.seeds import derive_seed; "
                            "print(derive_seed(1234, 'rollout', 3, 0))"], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONHASHSEED="7"), check=True)
    assert int(other.stdout) == derive_seed(1234, "rollout", 3, 0)
    seeds = {derive_seed(1234, "rollout", 1, 12), derive_seed(1234, "rollout", 11, 2),
             derive_seed(1235, "rollout", 1, 12),
             derive_seed(1234, "mini_batches", 1, 12)}
    assert len(seeds) == 4 and all(0 <= s < 2**63 for s in seeds)


def test_timed_adds_up_repeated_blocks_under_the_metric_key():
    timings: dict = {}
    for _ in range(2):
        with timed("actor_update", timings):
            pass
    assert list(timings) == ["timing/actor_update_s"] and timings["timing/actor_update_s"] >= 0.0



def non_finite_body(root: str):
    """A tiny model: an optimizer step at an infinite learning rate, then a save of NaN weights."""
    import torch

    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.engine import checkpoint
    from megatron_rl.engine.pipeline import run_microbatches
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.errors import CheckpointError
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.tools.smoke import lm_forward_step, lm_microbatches, synthetic_sequences

    layout = use_layout()
    model = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64)
    chunks = build_gpt_chunks(model, layout, torch.device("cpu"))
    trainable = make_trainable(chunks, OptimConfig(lr=float("inf")), total_steps=2)  # a library caller: no validation
    before = [p.detach().clone() for p in chunks[0].parameters()]
    trainable.zero_grad()
    run_microbatches(trainable.chunks, lm_microbatches(synthetic_sequences(0, 2, 16, 64, 1), 2, 1, 0),
                     lm_forward_step(torch.device("cpu")), forward_only=False, seq_length=16)
    result = trainable.step()
    unchanged = all(torch.equal(a, b) for a, b in zip(before, chunks[0].parameters()))
    with torch.no_grad():
        next(chunks[0].parameters()).view(-1)[0] = float("nan")
    try:
        checkpoint.save_checkpoint(root, 1, {"actor": checkpoint.ModelPart(trainable.chunks)})
        refused = None
    except CheckpointError as err:
        refused = str(err)
    return {"ok": result.ok, "reason": result.reason, "unchanged": unchanged, "refused": refused,
            "written": sorted(os.listdir(root)) if os.path.isdir(root) else []}


def test_infinite_learning_rate_applies_no_update_and_nan_weights_are_never_saved(tmp_path):
    out = run_distributed(1, non_finite_body, str(tmp_path / "ckpt"))[0]
    assert not out["ok"] and out["reason"].startswith("learning rate inf is not finite"), out
    assert out["unchanged"], "the weights moved at an infinite learning rate"
    assert out["refused"] and "the actor weights hold NaN or infinite values; nothing was written" in out["refused"]
    assert not any(name.startswith("step_") for name in out["written"]), out["written"]


def test_plain_reward_that_never_returns_stops_the_job_with_one_line(tmp_path):
    """A plain batch reward stuck on every rank used to hold the job until SIGKILL (launcher signals
    did nothing); it now gets reward.timeout_s per response, then the run stops with exit 2."""
    import time

    start = time.monotonic()
    proc = run_cli("train", "--nproc", "2", *TINY, "reward.fn=tests.support.helpers:never_returns",
                   "reward.timeout_s=0.5", "distributed.timeout_s=30", "trainer.steps=3", f"run.dir={tmp_path}",
                   "run.name=h", timeout=240)
    print(f"job ended after {time.monotonic() - start:.1f} s")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "reward error: reward.fn=tests.support.helpers:never_returns: did not return within 2 s " \
           "(reward.timeout_s=0.5 per response, 4 responses" in proc.stderr, proc.stderr[-3000:]
