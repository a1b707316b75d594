"""Trajectories driven by an outside agent through the OpenAI-compatible endpoint (``rollout.agent``).

Each step, every sample is one call of the user's agent function, ``agent(base_url, session_id,
record)``: it talks to ``base_url`` (``POST {base_url}/chat/completions`` with ``session_id`` in the
body, e.g. an ``openai.OpenAI(base_url=...)`` client passing ``extra_body={"session_id": ...}``), runs
whatever tools it likes, and may return a float added to the sample's score.  The endpoint
(:mod:`megatron_rl.envs.endpoint`) serves it with the rollout engine and records the exact ids and
log-probs of each session; those are what the trainer trains on, as for ``rollout.env``.

Agents run at once, each in a worker process of its own (:mod:`megatron_rl.rewards.bounded`, not
sandboxed: an agent needs the endpoint), bounded by ``rollout.agent_timeout_s``: an agent past it is
killed, its session keeps what was served (counted in ``env/agent_timeouts``).  A session the agent
never started is trained on as a one-token trajectory with no loss (counted in
``env/agent_no_reply``) and scores 0.  Sessions the endpoint served that belong to no sample (a
request without the sample's session id is a session of its own) are counted in
``env/agent_stray_sessions``, spread evenly over the step's samples (stray sessions per sample), so
any share of the samples reports the step's rate.  The trainer warns about both once and stops a
step in which no sample reached its session (:class:`megatron_rl.trainer.reward_signal.AgentSessions`).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from megatron_rl.envs.endpoint import ChatEndpoint
from megatron_rl.envs.trajectories import EngineWrapper, TrajectoryLimits
from megatron_rl.rewards.bounded import GraderError, Worker
from megatron_rl.rollout.engine import RolloutBatch
from megatron_rl.rollout.sampling import SamplingParams

AGENT_THREADS = 32  # agents run at once per generator (each in its own process)


def stray_sessions(endpoint: ChatEndpoint, sample_ids: list[str]) -> int:
    """Sessions the endpoint served that belong to no sample: requests that named no session id
    (each is a session of its own) or a wrong one.  Nothing of theirs is trained on."""
    samples = set(sample_ids)
    return sum(sid not in samples for sid in list(endpoint.sessions))


class AgentRollout(EngineWrapper):
    """A rollout engine's ``generate`` over sessions an outside agent drives."""

    def __init__(self, engine, tokenizer, agent_spec: str, limits: TrajectoryLimits, timeout_s: float):
        super().__init__(engine)
        self.tokenizer, self.agent_spec, self.limits, self.timeout_s = tokenizer, agent_spec, limits, timeout_s
        self.endpoint: Optional[ChatEndpoint] = None
        self._local = threading.local()

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int,
                 records: Optional[list[dict]] = None) -> RolloutBatch:
        turn_params = dataclasses.replace(params, n=1)
        if self.endpoint is None:
            self.endpoint = ChatEndpoint(self.engine, self.tokenizer, turn_params, seed=seed,
                                         max_turns=self.limits.max_turns, max_tokens=self.limits.max_tokens)
        self.endpoint.params = turn_params
        self.endpoint.reset(seed)
        samples = [(i, f"{seed}-{i}-{j}") for i in range(len(prompt_ids)) for j in range(params.n)]
        records = records or [{} for _ in prompt_ids]
        with ThreadPoolExecutor(min(AGENT_THREADS, len(samples))) as pool:
            outcomes = list(pool.map(lambda s: self._run_agent(s[1], records[s[0]]), samples))
        batch = dict(prompt_index=[], prompt_ids=[], response_ids=[], response_logprobs=[], finish_reason=[],
                     response_mask=[], env_info=[])
        served = self.endpoint.trajectories([sid for _, sid in samples])
        stray_rate = stray_sessions(self.endpoint, [sid for _, sid in samples]) / len(samples)
        for (i, _), (reward, timed_out), t in zip(samples, outcomes, served):
            info = {"turns": 0, "env_reward": reward, "limit": "", "final_turn": [0, 0],
                    "agent_timeouts": int(timed_out), "agent_no_reply": 0, "agent_stray_sessions": stray_rate}
            if t is None or not t["turns"]:  # no reply served: nothing to train on
                t = {"prompt_ids": list(prompt_ids[i]), "response_ids": [self.tokenizer.eos_id], "logprobs": [0.0],
                     "mask": [0], "turns": 0, "final_turn": [0, 0], "limit": ""}
                info.update(agent_no_reply=1, env_reward=0.0)
            info.update(turns=t["turns"], limit=t["limit"], final_turn=t["final_turn"])
            if t["limit"]:
                info["zero_at_limit"] = self.limits.zero_at_limit
            batch["prompt_index"].append(i)
            batch["prompt_ids"].append(t["prompt_ids"])
            batch["response_ids"].append(t["response_ids"])
            batch["response_logprobs"].append(t["logprobs"])
            batch["response_mask"].append(t["mask"])
            batch["finish_reason"].append(t["limit"] or "stop")
            batch["env_info"].append(info)
        return RolloutBatch(**batch)

    def _run_agent(self, session_id: str, record: dict) -> tuple[float, bool]:
        """``(the agent's reward, whether it ran out of time)``."""
        worker = getattr(self._local, "worker", None)
        if worker is None:
            worker = self._local.worker = Worker()
        try:
            values, late = worker.grade(self.agent_spec, [(self.endpoint.base_url, session_id, dict(record))], {},
                                        self.timeout_s, result="text")
        except GraderError as err:
            raise RuntimeError(f"rollout.agent={self.agent_spec} failed on session {session_id}: {err}") from None
        if late:
            return 0.0, True
        value = values[0]
        try:
            return (float(value) if value not in (None, "None", "") else 0.0), False
        except ValueError:
            raise RuntimeError(f"rollout.agent={self.agent_spec} returned {value!r}, not a number or None") from None
