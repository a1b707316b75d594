"""Rewards over the world: every rank grades a share, every rank gets all the scores.

Grading is per sample and every rank holds the whole batch after the rollout, so rank ``r``
grades samples ``r, r + world, ...`` (round-robin, so long responses spread evenly) and one
``all_gather_object`` assembles the scores everywhere; no rank idles while another grades.  A
reward function that needs the whole batch at once (one that normalises over it, say) sets
``fn.whole_batch = True`` and runs on rank 0 alone (:func:`rewards_from_rank0`).

When grading fails on some rank, the failure is gathered instead of its scores: every rank raises
the failure of the lowest failing rank at once, rather than waiting in a collective until the
process-group timeout.  Exceptions travel as plain fields, never pickled: user exception types
need not be picklable.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.distributed import collectives
from megatron_rl.errors import UserInputError
from megatron_rl.rewards.registry import Graded, RewardFn, grade_batch, reward_name

logger = logging.getLogger("megatron_rl.rewards")

_SCORES, _USER_ERROR, _CRASH = "scores", "user_error", "crash"


class RewardsFailedOnRank0(RuntimeError):
    """What ranks other than 0 raise when rank 0's reward computation crashed (rank 0 raises the original)."""


class RewardsFailedOnRank(RuntimeError):
    """What the other ranks raise when a rank's share of the rewards crashed (that rank raises the original)."""


def _outcome(compute: Callable[[], object]) -> tuple[tuple, Optional[BaseException]]:
    """``(message for the other ranks, exception to raise here)`` of running ``compute``."""
    try:
        return (_SCORES, compute()), None
    except UserInputError as err:
        return (_USER_ERROR, (type(err), err.key, err.value, err.problem, err.fix, err.row)), err
    except Exception as err:  # noqa: BLE001 - user code may fail in any way; every rank must learn of it
        return (_CRASH, f"{type(err).__name__}: {err}"), err


def rewards_from_rank0(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Call ``compute()`` on rank 0 and return its scores on every rank (a collective: call on all ranks).

    A :class:`UserInputError` is raised as the same one-line error on every rank; any other
    exception is re-raised on rank 0 and reported as :class:`RewardsFailedOnRank0` elsewhere.
    """
    box: list = [None]
    failure = None
    if dist.get_rank() == 0:
        box[0], failure = _outcome(compute)
    box[0] = collectives.broadcast_object(box[0], src=0)
    if failure is not None:
        raise failure
    kind, payload = box[0]
    if kind == _USER_ERROR:
        error_type, *fields = payload
        raise error_type(*fields)
    if kind == _CRASH:
        raise RewardsFailedOnRank0(f"rank 0 failed computing rewards ({payload}); see rank 0's traceback")
    return payload


def rewards_on_every_rank(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str],
                          answers: Sequence[Optional[str]], prompt_indices: Sequence[int],
                          timeout_s: Optional[float] = None, fields: Optional[Sequence[dict]] = None,
                          completion_ids: Optional[Sequence[Sequence[int]]] = None, **kwargs) -> Graded:
    """The checked rewards of the whole batch on every rank, each rank grading every world-th sample.

    A collective: call it on all ranks with the same batch.  Only this rank's share of
    ``responses`` is read (by index), so a lazily decoding sequence decodes a share only.
    ``timeout_s`` bounds each sample of a grader (:func:`megatron_rl.rewards.registry.grade_batch`);
    ``Graded.timed_out`` and ``Graded.no_reward`` are counted over all ranks.  ``fields``: each
    sample's record (its dataset columns).  ``completion_ids``: the responses' token ids (default:
    the ``response_ids`` of a lazily decoding ``responses``), for functions that take them (TRL's).
    """
    n = len(responses)
    if completion_ids is None:
        completion_ids = getattr(responses, "response_ids", None)
    if getattr(fn, "whole_batch", False):
        graded = rewards_from_rank0(lambda: grade_batch(fn, list(prompts), [responses[i] for i in range(n)],
                                                        list(answers), list(prompt_indices), timeout_s, fields,
                                                        completion_ids, **kwargs))
        _report_no_reward(fn, graded.no_reward, n)
        return graded
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = range(rank, n, world)

    def share(values):
        return [values[i] for i in mine] if values is not None else None

    def grade_share() -> tuple[list[float], int, int]:
        if not mine:
            return [], 0, 0
        graded = grade_batch(fn, share(prompts), share(responses), share(answers), share(prompt_indices),
                             timeout_s, share(fields), share(completion_ids), **kwargs)
        return graded.scores.tolist(), graded.timed_out, graded.no_reward

    box, failure = _outcome(grade_share)
    boxes = collectives.all_gather_object(box)
    failed = [r for r, (kind, _) in enumerate(boxes) if kind != _SCORES]
    if failed:
        first = failed[0]
        if first == rank:
            raise failure
        kind, payload = boxes[first]
        if kind == _USER_ERROR:
            error_type, *fields = payload
            raise error_type(*fields)
        raise RewardsFailedOnRank(f"rank {first} failed computing rewards ({payload}); see rank {first}'s traceback")
    scores = torch.empty(n, dtype=torch.float32)
    for r, (_, (values, _, _)) in enumerate(boxes):
        scores[r::world] = torch.tensor(values, dtype=torch.float32)
    no_reward = sum(none for _, (_, _, none) in boxes)
    _report_no_reward(fn, no_reward, n)
    return Graded(scores, sum(timed_out for _, (_, timed_out, _) in boxes), no_reward)


_REPORTED: set = set()  # reward functions whose None scores were reported (once per process)


def _report_no_reward(fn: RewardFn, count: int, n: int) -> None:
    """One warning line (rank 0, first time) when a TRL function returned None for some samples."""
    name = reward_name(fn)
    if not count or name in _REPORTED:
        return
    _REPORTED.add(name)
    if dist.get_rank() == 0:
        logger.warning(f"warning: reward.fn={name} returned None for {count} of {n} samples of a batch: each is "
                       "scored 0, as TRL's sum over reward functions scores a sample no function rewards; return "
                       "0.0 to say so (reported once)")
