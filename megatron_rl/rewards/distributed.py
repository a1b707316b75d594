"""Rewards on rank 0, scores on every rank.

The reward function is user code (it may be slow, call a service, or not be deterministic), so it
runs once per step, on rank 0, and every rank trains on the scores rank 0 broadcasts.  When it
fails, the failure is broadcast instead of the scores: every rank raises at once rather than
waiting in the broadcast until the process-group timeout.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megatron_rl.errors import UserInputError

_SCORES, _USER_ERROR, _CRASH = "scores", "user_error", "crash"


class RewardsFailedOnRank0(RuntimeError):
    """What ranks other than 0 raise when rank 0's reward computation crashed (rank 0 raises the original)."""


def rewards_from_rank0(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Call ``compute()`` on rank 0 and return its scores on every rank (a collective: call on all ranks).

    A :class:`UserInputError` is raised as the same one-line error on every rank; any other
    exception is re-raised on rank 0 and reported as :class:`RewardsFailedOnRank0` elsewhere.
    Exceptions are sent as plain fields, never pickled: user exception types need not be picklable.
    """
    box: list = [None]
    failure = None
    if dist.get_rank() == 0:
        try:
            box[0] = (_SCORES, compute())
        except UserInputError as err:
            failure = err
            box[0] = (_USER_ERROR, (type(err), err.key, err.value, err.problem, err.fix, err.row))
        except Exception as err:  # noqa: BLE001 - user code may fail in any way; every rank must learn of it
            failure = err
            box[0] = (_CRASH, f"{type(err).__name__}: {err}")
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    kind, payload = box[0]
    if kind == _USER_ERROR:
        error_type, *fields = payload
        raise error_type(*fields)
    if kind == _CRASH:
        raise RewardsFailedOnRank0(f"rank 0 failed computing rewards ({payload}); see rank 0's traceback")
    return payload
