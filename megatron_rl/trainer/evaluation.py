"""The evaluation set (``data.val_path``): held-out prompts sampled by the training rollout engine
with sampling settings of their own (``eval.*``, greedy by default) and graded by the training
reward function, so ``eval/*`` shows progress on prompts the policy never trains on.

When: before the first step (step 0: the weights training starts from), after every
``trainer.eval_every``-th step and after the last step of the run; each evaluation is of the
weights after that step and its metrics go into that step's record (step 0 gets a record of its
own).  A resumed run continues the schedule: its start was evaluated, if due, before that
checkpoint was saved, so it is not evaluated again.

Every generator (data-parallel rank) samples a share of the prompts and every rank grades a share
of the responses (:func:`megatron_rl.rollout.dp.generate_data_parallel`,
:func:`megatron_rl.rewards.distributed.rewards_on_every_rank`); both gather the whole set on every
rank, so the metrics below are computed from the same numbers everywhere.  Greedy decoding makes
them independent of the layout; sampled evaluation (``eval.temperature > 0``) draws with each
generator's own seed, as training rollouts do, so its samples depend on the data-parallel size.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional

import torch

from megatron_rl.config.schema import Config
from megatron_rl.data.prompts import PromptSet
from megatron_rl.data.sources import VAL_KEY, load_prompt_source
from megatron_rl.envs.trajectories import trajectory_scores
from megatron_rl.rewards.distributed import rewards_on_every_rank
from megatron_rl.rewards.registry import RewardFn
from megatron_rl.rollout.dp import generate_data_parallel
from megatron_rl.rollout.engine import RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.trainer.experience import graded_responses
from megatron_rl.utils.seeds import derive_seed


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Chance that at least one of ``k`` samples drawn without replacement from ``n``, ``correct``
    of them correct, is correct (the unbiased pass@k estimator of Chen et al., 2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def pass_ks(n: int) -> list[int]:
    """The k reported for ``n`` samples per prompt: 2, 4, 8, ... below n, and n (none for n = 1)."""
    ks = [2**i for i in range(1, n.bit_length()) if 2**i < n]
    return ks + [n] if n > 1 else []


def evaluation_metrics(scores: torch.Tensor, response_lengths: list[int], n: int, threshold: float) -> dict:
    """``eval/*`` of ``scores`` (sample ``j`` of prompt ``i`` at ``i * n + j``): mean reward, the
    share of samples scoring at least ``threshold`` (accuracy, i.e. pass@1), mean response length in
    tokens, and pass@k over each prompt's ``n`` samples."""
    correct = (scores >= threshold).view(-1, n)
    out = {"eval/reward_mean": float(scores.mean()), "eval/accuracy": float(correct.float().mean()),
           "eval/response_len": sum(response_lengths) / len(response_lengths), "eval/prompts": correct.size(0)}
    counts = correct.sum(-1).tolist()
    for k in pass_ks(n):
        out[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in counts) / len(counts)
    return out


class Evaluator:
    """Runs the evaluation when it is due; inert (never due) without ``data.val_path`` or with
    ``trainer.eval_every=0``."""

    def __init__(self, cfg: Config, tokenizer, engine: RolloutEngine, reward_fn: RewardFn,
                 training_sampling: SamplingParams, load_weights: Callable[[], None],
                 log: Callable[[str], None] = print):
        self.cfg, self.tokenizer, self.engine, self.reward_fn = cfg, tokenizer, engine, reward_fn
        self.load_weights, self.log = load_weights, log
        self.every = cfg.trainer.eval_every if cfg.data.val_path else 0
        self.prompts: Optional[PromptSet] = None
        if not self.every:
            if cfg.data.val_path:
                log(f"evaluation: off (trainer.eval_every=0); data.val_path={cfg.data.val_path} is not used")
            return
        ev = cfg.eval
        self.prompts = _first(load_prompt_source(cfg.data, tokenizer, VAL_KEY), ev.max_prompts)
        # Stop tokens and sequences as in training; the rest from eval.*.
        self.sampling = dataclasses.replace(training_sampling, temperature=ev.temperature, top_p=ev.top_p,
                                            top_k=ev.top_k, n=ev.n, max_new_tokens=ev.max_new_tokens)
        dropped = (f"; dropped {self.prompts.num_dropped} longer than {cfg.data.max_prompt_tokens} tokens"
                   if self.prompts.num_dropped else "")
        how = "greedy" if self.sampling.is_greedy else f"temperature {ev.temperature}"
        log(f"evaluation: {len(self.prompts)} prompts from {cfg.data.val_path}{dropped}, {how}, n={ev.n}, "
            f"before the first step, every {self.every} steps and after the last")

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.cfg.trainer.steps)

    def run(self, step: int) -> dict:
        """Sample, grade and summarise the evaluation set with the actor's current weights (a
        collective: every rank calls it)."""
        start = time.perf_counter()
        prompts, ev = self.prompts, self.cfg.eval
        self.load_weights()
        # The environments / agent of multi-turn training start from the records.
        records = prompts.records(range(len(prompts))) if self.cfg.rollout.multi_turn else None
        rollout = generate_data_parallel(self.engine, prompts.prompt_ids, self.sampling,
                                         seed=derive_seed(self.cfg.run.seed, "eval", step), records=records)
        self.engine.release_weights()
        index = rollout.prompt_index
        responses = graded_responses(rollout.response_ids, rollout.env_info)
        graded = rewards_on_every_rank(
            self.reward_fn, [prompts.prompts[i] for i in index], [self.tokenizer.decode(r) for r in responses],
            [prompts.answers[i] for i in index], [prompts.source_index[i] for i in index],
            timeout_s=self.cfg.reward.timeout_s, fields=prompts.record_fields(index), completion_ids=responses,
            **dict(self.cfg.reward.kwargs),
        )
        scores = trajectory_scores(rollout, graded.scores)
        out = evaluation_metrics(scores, [len(r) for r in rollout.response_ids], ev.n, ev.correct_threshold)
        out["eval/reward_timeouts"] = graded.timed_out
        out["timing/eval_s"] = time.perf_counter() - start
        self.log(f"eval after step {step}: reward {out['eval/reward_mean']:.4g}  accuracy {out['eval/accuracy']:.4g}  "
                 f"resp_len {out['eval/response_len']:.3g}  {out['timing/eval_s']:.1f}s")
        return out


def _first(prompts: PromptSet, count: Optional[int]) -> PromptSet:
    if count is None or count >= len(prompts):
        return prompts
    return dataclasses.replace(prompts, prompt_ids=prompts.prompt_ids[:count], prompts=prompts.prompts[:count],
                               answers=prompts.answers[:count], source_index=prompts.source_index[:count],
                               fields=prompts.fields[:count], demonstrations=prompts.demonstrations[:count])
