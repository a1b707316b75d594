"""Multi-turn rollout: trajectories driven through a rollout engine, token-in-token-out.

:class:`EnvironmentRollout` wraps any rollout engine and has its ``generate``: a trajectory's whole
context (prompt, earlier turns, observations: the exact ids so far) goes to the engine for one
policy turn (ending at EOS, at one of the environment's stop strings or after
``rollout.max_new_tokens``), together with whichever other trajectories are ready; then its
environment answers in a thread pool (tool calls of many trajectories run at once, each in its own
bounded worker) while the engine goes on with the trajectories that are ready, so one waiting on a
slow tool stalls nobody; its observation is tokenized once and appended.  Nothing is ever
re-tokenized from text, so the trainer trains on the ids the engine sampled.  The response of a
trajectory is everything after the prompt; its ``response_mask`` is 1 on the policy's tokens and 0
on observation tokens, whose log-probs are 0 and which carry no loss.

Each turn draws from keys of its own (trajectory, turn: the engine's ``sample_keys``), so
trajectories go on independently and still reproduce from the seed.

Limits (``rollout.max_turns``, ``rollout.max_trajectory_tokens``: prompt + every turn and
observation) end a trajectory where it stands: a turn is cut at the token limit, an observation
that would cross it is not appended; the trajectory is then graded as it is
(``rollout.on_limit=grade``) or scores 0 (``zero``).  Every limit hit is counted per sample in
``env_info`` and logged as ``env/*`` metrics.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable, Optional, Sequence

from megatron_rl.envs.base import Turn, observation_ids
from megatron_rl.rollout.engine import GeneratorPlace, LiveWeights, RolloutBatch, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams, sample_key
from megatron_rl.utils.seeds import derive_seed

# finish_reason of a trajectory that hit a limit (the others end "stop": the environment said done
# or the policy ended with EOS; or "length": a turn ran to rollout.max_new_tokens).
MAX_TURNS, MAX_TOKENS = "max_turns", "max_tokens"
TOOL_THREADS = 8  # environments stepped at once (each tool call runs in its own worker process)


def fitting_calls(lengths: list[int], room: list[int], cap: int,
                  limit: Optional[int]) -> list[tuple[list[int], int]]:
    """``[(members, max_new_tokens)]``: engine calls for contexts of ``lengths`` generated together,
    each allowed ``room[k]`` new tokens (at most ``cap``).  One call, with the largest room, unless a
    context plus that room passes the engine's positions (``limit``, its ``max_sequence_length``):
    megatron's engine refuses such a request even when its reply would be cut shorter.  Then the
    contexts that fit go first and the rest take further calls with the largest room among them;
    each context's call leaves it at least ``min(cap, its room)`` new tokens, as one call would."""
    left = sorted(range(len(lengths)), key=lambda k: -room[k])
    calls = []
    while left:
        max_new = max(1, min(cap, room[left[0]]))
        if limit is not None and lengths[left[0]] + max_new > limit:
            max_new = max(1, limit - lengths[left[0]])
        members = {k for k in left if limit is None or lengths[k] + max_new <= limit} or {left[0]}
        calls.append((sorted(members), max_new))  # in the given order: the same samples as one call
        left = [k for k in left if k not in members]
    return calls


@dataclasses.dataclass(frozen=True)
class TrajectoryLimits:
    max_turns: int
    max_tokens: int  # prompt + all turns and observations
    zero_at_limit: bool = False  # rollout.on_limit=zero


@dataclasses.dataclass
class TokenTrace:
    """One trajectory's ids as the engine saw them: the prompt, then the policy's turns (mask 1, the
    engine's log-probs) and what came between them (mask 0, log-prob 0), and the span of the last
    turn in the response.  Kept alike by environments' trajectories and the endpoint's sessions."""

    prompt: list[int]
    response: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    final_turn: list[int] = dataclasses.field(default_factory=lambda: [0, 0])

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.response)

    def add_turn(self, ids: Sequence[int], logprobs: Sequence[float]) -> None:
        start = len(self.response)
        self.response += ids
        self.logprobs += logprobs
        self.mask += [1] * len(ids)
        self.final_turn = [start, len(self.response)]

    def add_observation(self, ids: Sequence[int]) -> None:
        self.response += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)


@dataclasses.dataclass(kw_only=True)
class _Trajectory(TokenTrace):
    index: int
    prompt_index: int
    env: object
    versions: list[int] = dataclasses.field(default_factory=list)
    finish: str = ""
    cut: bool = False  # the last turn ran to rollout.max_new_tokens
    answered_by_eos: bool = False  # the last turn ended with EOS: the environment answers it once more
    info: dict = dataclasses.field(default_factory=lambda: {"turns": 0, "env_reward": 0.0, "limit": ""})

    def add_policy_turn(self, ids: Sequence[int], logprobs: Sequence[float], versions: Optional[Sequence[int]],
                        version: int) -> None:
        self.add_turn(ids, logprobs)
        self.versions += list(versions) if versions is not None else [version] * len(ids)
        self.info["turns"] += 1

    def add_observation(self, ids: Sequence[int]) -> None:
        self.versions += [self.versions[-1] if self.versions else 0] * len(ids)
        super().add_observation(ids)

    def end(self, finish: str, limit: str = "", zero_at_limit: bool = False) -> None:
        self.finish, self.info["limit"] = finish, limit
        if limit:
            self.info["zero_at_limit"] = zero_at_limit


class EngineWrapper:
    """A rollout engine with a ``generate`` of its own (over trajectories or agent sessions); the
    rest of :class:`~megatron_rl.rollout.engine.RolloutEngine` -- weights, release, refit, where it
    generates -- is the engine's, handed through."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def load_weights(self, canonical: dict) -> None:
        self.engine.load_weights(canonical)

    def load_from_chunks(self, chunks: list) -> None:
        self.engine.load_from_chunks(chunks)

    def release_weights(self) -> None:
        self.engine.release_weights()

    def weight_bytes(self) -> int:
        return self.engine.weight_bytes()

    def generator_of_this_rank(self) -> Optional[GeneratorPlace]:
        return self.engine.generator_of_this_rank()

    @property
    def live_weights(self) -> Optional[LiveWeights]:
        return self.engine.live_weights

    @property
    def last_refit(self):
        return self.engine.last_refit

    @property
    def max_sequence_length(self) -> Optional[int]:
        return self.engine.max_sequence_length


class EnvironmentRollout(EngineWrapper):
    """A rollout engine's ``generate`` over multi-turn trajectories."""

    def __init__(self, engine, make_env: Callable, encode: Callable[[str], list[int]],
                 decode: Callable[[Sequence[int]], str], limits: TrajectoryLimits):
        super().__init__(engine)
        self.make_env, self.encode, self.decode, self.limits = make_env, encode, decode, limits
        env = make_env()
        self.stop_sequences = tuple(tuple(encode(s)) for s in getattr(env, "stop", ()))

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int,
                 records: Optional[list[dict]] = None) -> RolloutBatch:
        """``params.n`` trajectories per prompt; ``records[i]`` is handed to the environments of
        prompt ``i`` (``{}`` when None)."""
        trajectories = []
        for i, prompt in enumerate(prompt_ids):
            for _ in range(params.n):
                env = self.make_env()
                env.reset(dict(records[i]) if records is not None else {})
                trajectories.append(_Trajectory(prompt=list(prompt), index=len(trajectories), prompt_index=i,
                                                env=env))
        turn_params = dataclasses.replace(params, n=1, stop_sequences=params.stop_sequences + self.stop_sequences)
        with ThreadPoolExecutor(TOOL_THREADS) as pool:
            self._advance_independently(trajectories, turn_params, seed, pool)
        return RolloutBatch(
            prompt_index=[t.prompt_index for t in trajectories], prompt_ids=[t.prompt for t in trajectories],
            response_ids=[t.response for t in trajectories], response_logprobs=[t.logprobs for t in trajectories],
            finish_reason=[t.finish for t in trajectories],
            token_versions=[t.versions for t in trajectories] if self.engine.live_weights is not None else None,
            response_mask=[t.mask for t in trajectories],
            env_info=[dict(t.info, final_turn=t.final_turn) for t in trajectories],
        )

    def _advance_independently(self, trajectories: list[_Trajectory], params: SamplingParams, seed: int,
                               pool: ThreadPoolExecutor) -> None:
        """Each trajectory goes on as soon as its environment answered: the engine generates the next
        turns of whichever are ready while others wait on slow tools.  Every turn draws from keys of
        its own (trajectory, turn), so what a trajectory samples does not depend on which others
        share an engine call, and the same seed gives the same trajectories however the calls fall."""
        ready, pending, calls = list(trajectories), {}, 0
        while ready or pending:
            if ready:
                keys = [sample_key(derive_seed(seed, "trajectory", t.index, "turn", t.info["turns"])) for t in ready]
                self._policy_turn(ready, params, derive_seed(seed, "call", calls), keys)
                calls += 1
                for t in ready:
                    if not t.finish or t.answered_by_eos:
                        pending[pool.submit(self._step, t)] = t
                ready = []
            if pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: pending[f].index):
                    t = pending.pop(future)
                    self._observe(t, future.result(), last=t.info["turns"] >= self.limits.max_turns)
                    if not t.finish:
                        ready.append(t)

    def _turn_calls(self, active: list[_Trajectory], room: list[int], cap: int) -> list[tuple[list[int], int]]:
        """The engine calls of one policy turn (:func:`fitting_calls`)."""
        return fitting_calls([t.length for t in active], room, cap, self.engine.max_sequence_length)

    def _policy_turn(self, active: list[_Trajectory], params: SamplingParams, seed: int, keys: list[int]) -> None:
        room = [self.limits.max_tokens - t.length for t in active]
        calls = self._turn_calls(active, room, params.max_new_tokens)
        outs: dict[int, tuple] = {}
        for c, (members, max_new) in enumerate(calls):
            call_params = dataclasses.replace(params, max_new_tokens=max_new)
            out = self.engine.generate([active[k].prompt + active[k].response for k in members], call_params,
                                       seed=seed if c == 0 else derive_seed(seed, "call", c),
                                       sample_keys=[keys[k] for k in members])
            for i, k in enumerate(members):
                outs[k] = (out.response_ids[i], out.response_logprobs[i], out.finish_reason[i],
                           out.token_versions[i] if out.token_versions is not None else None)
        live = self.engine.live_weights
        for k, (t, left) in enumerate(zip(active, room)):
            response_ids, response_logprobs, finish_reason, token_versions = outs[k]
            ids, logprobs = response_ids[:left], response_logprobs[:left]
            versions = token_versions[:left] if token_versions is not None else None
            t.add_policy_turn(ids, logprobs, versions, live.version if live is not None else 0)
            t.cut = finish_reason == "length"  # the turn ran to rollout.max_new_tokens
            t.answered_by_eos = False
            if len(response_ids) > left:
                t.end("length", MAX_TOKENS, self.limits.zero_at_limit)  # cut at the trajectory's token limit
            elif ids and ids[-1] in params.stop_token_ids:
                t.end("stop")  # EOS: the policy is done (its environment still answers, for the reward)
                t.answered_by_eos = True

    def _step(self, t: _Trajectory) -> Turn:
        start, end = t.final_turn
        turn = t.response[start:end]
        answer = t.env.step(self.decode(turn), list(turn))
        if not isinstance(answer, Turn):
            raise TypeError(f"{type(t.env).__name__}.step returned {type(answer).__name__}, not envs.base.Turn")
        return answer

    def _observe(self, t: _Trajectory, answer: Turn, last: bool) -> None:
        """Take the environment's answer; after the last turn allowed, its observation would train
        nothing, so the trajectory ends there (at rollout.max_turns) without it."""
        t.info["env_reward"] += float(answer.reward)
        for key, value in answer.info.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                t.info[key] = t.info.get(key, 0) + value
        if t.finish:  # ended by EOS: the answer counts for the reward only
            return
        if answer.done:
            t.end("length" if t.cut else "stop")
            return
        if last:
            t.end(MAX_TURNS, MAX_TURNS, self.limits.zero_at_limit)
            return
        ids = observation_ids(answer.observation, self.encode)
        if t.length + len(ids) >= self.limits.max_tokens:  # no room left for the policy after it
            t.end(MAX_TOKENS, MAX_TOKENS, self.limits.zero_at_limit)
            return
        t.add_observation(ids)


# Counts an environment may report per turn (Turn.info) that become env/* metrics (per sample, mean).
_COUNTED = ("tool_calls", "tool_errors", "tool_timeouts", "tool_parse_errors", "agent_timeouts", "agent_no_reply",
            "agent_stray_sessions")


def env_metrics(samples) -> dict:
    """``env/*`` of a step's multi-turn samples (``{}`` for single-turn ones): mean turns, the
    fraction that hit each limit, observation tokens, and the tool counts per sample."""
    infos = samples.env_info
    if not infos:
        return {}
    n = len(infos)
    out = {"env/turns_mean": sum(i["turns"] for i in infos) / n,
           "env/max_turns_frac": sum(i["limit"] == MAX_TURNS for i in infos) / n,
           "env/max_tokens_frac": sum(i["limit"] == MAX_TOKENS for i in infos) / n,
           "env/reward_mean": sum(i["env_reward"] for i in infos) / n,
           "env/observation_tokens_mean": sum(len(m) - sum(m) for m in samples.loss_mask) / n}
    for key in _COUNTED:
        if any(key in i for i in infos):
            out[f"env/{key}"] = sum(i.get(key, 0) for i in infos) / n
    return out


def trajectory_scores(samples, graded):
    """The scores of multi-turn samples (``Samples`` or a ``RolloutBatch``): ``reward.fn``'s grade
    of the last turn plus the environment's rewards; 0 for a trajectory that hit a limit under
    ``rollout.on_limit=zero``."""
    import torch

    infos = samples.env_info
    if not infos:
        return graded
    env_reward = torch.tensor([float(i["env_reward"]) for i in infos], dtype=graded.dtype)
    zeroed = torch.tensor([bool(i["limit"]) and bool(i.get("zero_at_limit")) for i in infos])
    return torch.where(zeroed, torch.zeros_like(graded), graded + env_reward)
