"""Checks that a step's rewards can teach anything, around every reward call.

A wrong answer key or a reward that ignores its input trains on constant rewards: every advantage
is 0, the run looks healthy and learns nothing.  Two checks catch it early:

* a batch in which every sample's answer is missing, for a reward that reads answers, stops the
  run with one line (a :class:`DataError`, exit 2) before the reward function is called;
* when every group's rewards are equal (every reward, for groups of one) in each of the first
  :data:`NO_SIGNAL_BATCHES` scored batches, one warning line says so.  A batch is a step, or one
  draw of dynamic sampling.

In agent mode (``rollout.agent``) a sample whose agent never reached its session (its requests named
no session id, or it sent none) trains nothing and scores 0: :class:`AgentSessions` stops a batch in
which no sample reached its session, as a batch without answers stops, and warns once about one in
which some did not.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

import torch

from megatron_rl.errors import DataError
from megatron_rl.trainer.dynamic_sampling import informative

NO_SIGNAL_BATCHES = 3  # few enough to warn before much compute is spent


class RewardSignal:
    def __init__(self, answer_key: str, needs_answers: bool, log: Callable[[str], None],
                 batches: Optional[int] = None):
        self.answer_key, self.needs_answers, self.log = answer_key, needs_answers, log
        self.batches = batches or NO_SIGNAL_BATCHES
        self.flat_batches = 0  # scored batches so far, while none had a signal; None once one had
        self.means: list[float] = []

    def check_answers(self, answers: Sequence[Optional[str]], prompt_indices: Sequence[int]) -> None:
        """Stop when the reward reads answers and this batch has none at all."""
        if self.needs_answers and answers and all(a is None for a in answers):
            shown = sorted(set(int(i) for i in prompt_indices))[:5]
            raise DataError("data.answer_key", self.answer_key,
                            f"every one of this step's {len(answers)} samples has no answer (prompt indices "
                            f"{shown}...), and the reward function reads answers, so every reward would be 0",
                            "set data.answer_key to the records' answer key (a dotted path for a nested one) "
                            "or give the records answers")

    def observe(self, scores: torch.Tensor, groups: dict[int, list[int]]) -> None:
        """Count a scored batch; warn once if the first ones all had equal rewards in every group."""
        if self.flat_batches is None or not len(scores):
            return
        rows = [r for r in groups.values() if len(r) > 1] or [list(range(len(scores)))]
        if any(informative(scores, r) for r in rows):
            self.flat_batches = None
            return
        self.flat_batches += 1
        self.means.append(float(scores.float().mean()))
        if self.flat_batches == self.batches:
            self.flat_batches = None
            means = ", ".join(f"{m:g}" for m in self.means)
            self.log(f"warning: no learning signal: all groups had equal rewards in each of the first {self.batches} "
                     f"steps (mean rewards {means}), so every advantage is 0; check data.answer_key "
                     f"({self.answer_key}) and the reward function (docs/rewards.md)")


SESSION_FIX = ('pass every request the session id the agent is called with: extra_body={"session_id": session_id} '
               "or user=session_id (both as the openai SDK takes them)")


def stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class AgentSessions:
    """Checks that a batch's agents reached the sessions the trainer trains on (``env_info`` of
    :class:`megatron_rl.envs.agent.AgentRollout`)."""

    def __init__(self, agent: str, warn: Callable[[str], None] = stderr_line):
        self.agent, self.warn = agent, warn
        self.warned = False

    def check(self, env_info: Sequence[dict]) -> None:
        """Stop when no sample reached its session; warn once when some did not."""
        if not self.agent or not env_info:
            return
        missed = sum(int(i.get("agent_no_reply", 0)) for i in env_info)
        if not missed:
            return
        stray = round(sum(float(i.get("agent_stray_sessions", 0)) for i in env_info))
        strays = f" (the endpoint served {stray} sessions that belong to no sample)" if stray else ""
        if missed == len(env_info):
            raise DataError("rollout.agent", self.agent,
                            f"none of this step's {missed} samples reached its session{strays}, so nothing would "
                            "train", SESSION_FIX)
        if not self.warned:
            self.warned = True
            self.warn(f"warning: rollout.agent={self.agent}: {missed} of this step's {len(env_info)} samples never "
                      f"reached their session{strays}, so they train nothing and score 0 (env/agent_no_reply); "
                      f"fix: {SESSION_FIX}")
