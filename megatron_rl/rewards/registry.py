"""Reward functions: lookup by name, import path or file path, and a checked batched call.

A reward function is user code, so the trainer never trusts what it returns: every value is
checked before it reaches the advantage computation, and any failure is reported as a one-line
:class:`RewardFunctionError` that names the function and the prompt it failed on.  A bad reward
found here costs one error message; found later it costs a diverged run.

The contract: ``fn(prompts, responses, answers, **kwargs)`` takes three equal-length lists
(``answers`` items may be ``None``) and returns one number per response, as a list, a 1-D
``torch.Tensor`` or a 1-D numpy array.

A *grader* is the per-sample form, ``score(response, answer, **kwargs) -> float`` at module level;
:func:`grader`, :func:`register_grader` or :func:`batch_reward` turns it into a batch reward that grades each
sample in a worker process bounded by ``reward.timeout_s`` (:mod:`megatron_rl.rewards.bounded`).
The built-in math rewards are graders; a plain batch function is called as written, unbounded.
verl's and TRL's forms are wrapped into this contract (:mod:`megatron_rl.rewards.conventions`), and
every form gets the dataset columns its parameters name (:mod:`megatron_rl.rewards.columns`).
"""

from __future__ import annotations

import contextlib
import importlib
import numbers
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np

from megatron_rl.errors import UserInputError

if TYPE_CHECKING:
    import torch

from megatron_rl.rewards import columns
from megatron_rl.rewards.conventions import Misfit, as_batch_reward
from megatron_rl.rewards.locations import import_file, is_file_location
from megatron_rl.rewards.registration import (  # noqa: F401 - resolved and listed here
    _NAMES,
    _REWARDS,
    RewardFn,
    _qualified,
    batch_reward,
    grader,
    register_grader,
    register_reward,
    reward_name,
)

KEY = "reward.fn"
VERL_DEFAULT_NAME = "compute_score"  # the function of a reward file named without one, as verl defaults

class RewardFunctionError(UserInputError):
    def one_line(self) -> str:
        return "reward error: " + super().one_line()


def _load_builtins() -> None:
    import megatron_rl.rewards.format  # noqa: F401  (registers on import)
    import megatron_rl.rewards.math_answer  # noqa: F401
    import megatron_rl.rewards.tasks  # noqa: F401


def list_rewards() -> list[str]:
    """Every registered name, aliases included, sorted."""
    _load_builtins()
    return sorted(_REWARDS)


def get_reward_fn(spec: str, convention: str = "auto", kwargs: Optional[dict] = None) -> RewardFn:
    """Resolve a registered name (``"math_answer"``) or an import path (``"pkg.mod:fn"``) to a batch
    reward, called as ``convention`` says (:mod:`megatron_rl.rewards.conventions`); ``kwargs``
    (``reward.kwargs``) may fill required parameters of its signature."""
    try:
        return as_batch_reward(_resolve(spec), convention, spec, tuple(kwargs or ()))
    except Misfit as err:
        raise RewardFunctionError(err.key, err.value, err.problem, err.fix) from None


def detected_convention(spec: str) -> str:
    """The calling convention ``reward.convention=auto`` gives the function ``spec`` names."""
    from megatron_rl.rewards.conventions import detect

    return detect(_resolve(spec))


def _resolve(spec: str) -> RewardFn:
    _load_builtins()
    if not isinstance(spec, str) or not spec.strip():
        raise RewardFunctionError(KEY, spec, "must be a reward name or 'package.module:function'",
                                  f"use one of {list_rewards()} or an import path")
    spec = spec.strip()
    if spec in _REWARDS:
        return _REWARDS[spec]
    if is_file_location(spec.rpartition(":")[0] if ":" in spec else spec):
        return _resolve_file(spec)
    if ":" not in spec:
        hint = f" or write it as '{spec.rpartition('.')[0]}:{spec.rpartition('.')[2]}'" if "." in spec else ""
        raise RewardFunctionError(KEY, spec, "unknown reward function",
                                  f"use one of {list_rewards()}{hint} or 'package.module:function'")
    module_name, _, attr_path = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - a user module may fail on import in any way
        raise RewardFunctionError(KEY, spec, f"cannot import module {module_name!r} ({type(err).__name__}: {err})",
                                  "check the module name and that its package is installed or on PYTHONPATH") from err
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise RewardFunctionError(KEY, spec, f"module {module_name!r} has no attribute {attr_path!r}",
                                      f"check the function name after ':' (it must be defined in {module_name})")
        obj = getattr(obj, attr)
    return _callable(obj, spec, attr_path)


def _callable(obj, spec: str, attr_path: str) -> RewardFn:
    if not callable(obj):
        raise RewardFunctionError(KEY, spec, f"{attr_path!r} is a {type(obj).__name__}, not a function",
                                  "point reward.fn at a function fn(prompts, responses, answers, **kwargs)")
    return getattr(obj, "batch_reward", obj)  # a grader registered with register_grader


def _resolve_file(spec: str) -> RewardFn:
    """``path.py:name`` (``path.py`` alone: verl's default name ``compute_score``), the file imported by
    its path, relative to the working directory (the grading worker imports it the same way)."""
    path, _, name = spec.rpartition(":") if ":" in spec else (spec, ":", VERL_DEFAULT_NAME)
    try:
        module = import_file(path)
    except FileNotFoundError:
        raise RewardFunctionError(KEY, spec, f"no such file {os.path.abspath(path)}",
                                  "give the path of a Python file (absolute, or relative to the working "
                                  "directory) and the function after ':'") from None
    except Exception as err:  # noqa: BLE001 - a user file may fail on import in any way
        raise RewardFunctionError(KEY, spec, f"cannot import the file {path} ({type(err).__name__}: {err})",
                                  "fix the error in the file") from err
    if not hasattr(module, name):
        raise RewardFunctionError(KEY, spec, f"the file {path} has no function {name!r}",
                                  f"name a function defined in {path} after ':' (path.py:function)")
    return _callable(getattr(module, name), spec, name)


def _short(obj, limit: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(out) -> str:
    import torch

    if isinstance(out, (torch.Tensor, np.ndarray)):
        return f"{type(out).__name__} of shape {tuple(out.shape)} and dtype {out.dtype}"
    return f"{type(out).__name__} {_short(out)}"


def _as_floats(out, name: str, indices: Sequence[int]) -> torch.Tensor:
    """Check one batch of returned rewards; return them as float32 ``[B]``."""
    import torch  # here, not at import: the grading worker imports this package and must start fast

    n = len(indices)

    def fail(problem: str, fix: str):
        raise RewardFunctionError(KEY, name, problem, fix)

    if isinstance(out, (torch.Tensor, np.ndarray)) and out.ndim != 1:
        fail(f"returned a {_describe(out)} for {n} responses, expected shape ({n},)",
             "return one number per response (squeeze or flatten the result)")
    if isinstance(out, np.ndarray):
        # Numeric arrays convert directly; object/string/complex arrays are checked item by item below.
        out = torch.from_numpy(out.astype(np.float64)) if out.dtype.kind in "biuf" else list(out)
    if isinstance(out, torch.Tensor):
        if out.is_complex():
            fail(f"returned a complex {_describe(out)}", "return real numbers")
        out = out.detach().to("cpu", torch.float64)
    if not isinstance(out, (torch.Tensor, list, tuple)):
        fail(f"returned {_describe(out)}, expected a list of {n} numbers", "return one number per response")
    if len(out) != n:
        where = f"; prompt index {indices[len(out)]} and later got none" if len(out) < n else ""
        fail(f"returned {len(out)} values for {n} responses{where}", "return exactly one number per response")
    if not isinstance(out, torch.Tensor):
        for i, value in enumerate(out):
            numeric = (isinstance(value, numbers.Real)
                       or (isinstance(value, np.generic) and value.dtype.kind in "biuf")
                       or (isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex()))
            if not numeric:
                fail(f"returned a non-numeric value {_short(value)} ({type(value).__name__}) for prompt index "
                     f"{indices[i]} (position {i})", "return an int or float for every response")
        out = torch.tensor([float(v) for v in out], dtype=torch.float64)
    out = out.to(torch.float32)
    bad = (~torch.isfinite(out)).nonzero()
    if bad.numel():
        i = int(bad[0])
        fail(f"returned a non-finite value {out[i].item()} for prompt index {indices[i]} (position {i})",
             "return finite numbers (guard divisions and logs in the reward function)")
    return out


@contextlib.contextmanager
def hard_deadline(seconds: Optional[float], error: Optional[BaseException]):
    """End this process with ``error`` reported (exit 2) if the body runs longer than ``seconds``.

    A plain reward function runs in this process (it may hold a reward model in memory), and
    nothing can interrupt Python code stuck in C or in a blocking call; so a watchdog thread reports
    the overrun the way any rank failure is reported and exits the process, and the launcher ends
    the job.  ``seconds=None`` does nothing."""
    if seconds is None:
        yield
        return
    done = threading.Event()

    # reward.timeout_s x the batch's responses can pass what a thread may wait (~292 years): capped.
    seconds = min(seconds, threading.TIMEOUT_MAX)

    def watch() -> None:
        if not done.wait(seconds):
            from megatron_rl.distributed.guard import exit_with_error

            exit_with_error(error)

    threading.Thread(target=watch, name="reward-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _call(fn, prompts, responses, answers, fields, completion_ids, kwargs):
    """One call of ``fn`` with what its convention takes besides the three lists: the records
    (``takes_fields``: verl's, TRL's, graders') or the dataset columns its parameters name, as lists
    (a plain batch function), and the response token ids (``takes_completion_ids``: TRL's)."""
    extra: dict = {}
    if getattr(fn, "takes_fields", False):
        extra["fields"] = list(fields) if fields is not None else [{} for _ in responses]
    elif fields is not None:
        params = columns.parameters(fn)
        extra = columns.as_lists(params, fields, set(columns.positional_names(params or [], 3)) | set(kwargs))
    if getattr(fn, "takes_completion_ids", False) and completion_ids is not None:
        extra["completion_ids"] = list(completion_ids)
    return fn(prompts, responses, answers, **extra, **kwargs)


def _first_failing_item(fn, prompts, responses, answers, fields, completion_ids,
                        kwargs) -> tuple[Optional[int], Optional[BaseException]]:
    for i in range(len(responses)):
        try:
            _call(fn, [prompts[i]], [responses[i]], [answers[i]], None if fields is None else [fields[i]],
                  None if completion_ids is None else [completion_ids[i]], kwargs)
        except Exception as err:  # noqa: BLE001
            return i, err
    return None, None


def _check_columns(fn, name: str, fields: Optional[Sequence[dict]], n: int, indices: Sequence[int]) -> None:
    """A dataset column the function requires by name and a record lacks: one line, before the call."""
    required = getattr(fn, "required_columns", ())
    records = list(fields) if fields is not None else [{}] * n
    gap = columns.missing(required, records) if required else None
    if gap is not None:
        i, column = gap
        raise missing_column_error(name, column, f"of prompt index {indices[i]}", records[i])


def missing_column_error(name: str, column: str, where: str, record: dict) -> RewardFunctionError:
    """The one line for a record (``where``: which) lacking a column reward.fn=``name`` requires; the
    same before launch (tools/preflight.py) and at a step."""
    return RewardFunctionError(
        KEY, name, f"requires the dataset column {column!r}, which the record {where} lacks (its columns: "
        f"{_short(sorted(record), 60)})", f"add a '{column}' column to every record, or give the parameter "
        f"{column} a default")


@dataclass
class Graded:
    """Checked rewards of one batch, how many of its samples ran out of time (scored 0) and how many
    the function gave no reward (None, TRL's form: scored 0)."""

    scores: torch.Tensor
    timed_out: int = 0
    no_reward: int = 0


def grade_batch(
    fn: Union[RewardFn, str],
    prompts: Sequence[str],
    responses: Sequence[str],
    answers: Sequence[Optional[str]],
    prompt_indices: Optional[Sequence[int]] = None,
    timeout_s: Optional[float] = None,
    fields: Optional[Sequence[dict]] = None,
    completion_ids: Optional[Sequence[Sequence[int]]] = None,
    **kwargs,
) -> Graded:
    """Call ``fn`` once on the batch; return checked rewards and the timed-out count.

    ``timeout_s`` (``reward.timeout_s``) reaches rewards built from graders (they bound each
    sample by it); a plain batch function never sees it.  ``fields`` (each sample's record, every
    dataset column: ``PromptSet.record_fields``) reach a function with ``takes_fields`` (verl's,
    TRL's, graders') whole, and a plain batch function as the columns its parameters name (all of
    them for ``**kwargs``), one list each; ``completion_ids`` (the responses' token ids) reach TRL's
    functions.  ``prompt_indices``
    (default ``0..B-1``) are what error messages call "prompt index": pass the prompt's line in the data file
    (``PromptSet.source_index``) so users can find it.  If the batch call raises, the items are
    retried one by one to name the first prompt that fails alone.
    """
    if isinstance(fn, str):
        fn = get_reward_fn(fn)
    if timeout_s is not None and getattr(fn, "bounded", False):
        kwargs = {**kwargs, "timeout_s": timeout_s}
    indices = list(range(len(responses))) if prompt_indices is None else [int(i) for i in prompt_indices]
    if not len(prompts) == len(responses) == len(answers) == len(indices):
        raise ValueError(f"compute_rewards: lengths differ: {len(prompts)} prompts, {len(responses)} responses, "
                         f"{len(answers)} answers, {len(indices)} prompt indices")
    name = reward_name(fn)
    prompts, responses, answers = list(prompts), list(responses), list(answers)
    _check_columns(fn, name, fields, len(responses), indices)
    bound = None
    if timeout_s is not None and not getattr(fn, "bounded", False) and responses:
        bound = timeout_s * len(responses)
        late = RewardFunctionError(
            KEY, name, f"did not return within {bound:g} s (reward.timeout_s={timeout_s:g} per response, "
            f"{len(responses)} responses; prompt indices {_short(indices, 60)})",
            "make the reward function return (or raise) in time, raise reward.timeout_s, or build it from "
            "@grader functions, which score a sample that overruns 0 instead of stopping the run")
    try:
        with hard_deadline(bound, late if bound else None):
            out = _call(fn, prompts, responses, answers, fields, completion_ids, kwargs)
    except SystemExit as err:  # would end this rank with the function's exit code and no message
        raise RewardFunctionError(KEY, name, f"called sys.exit({err.code!r}) on a batch of {len(responses)} responses",
                                  "return a reward for every response; raise an exception to report a "
                                  "failure") from None
    except Exception as err:  # noqa: BLE001 - user code
        i, item_err = _first_failing_item(fn, prompts, responses, answers, fields, completion_ids, kwargs)
        if i is None:
            raise RewardFunctionError(
                KEY, name, f"raised {type(err).__name__}: {err} on a batch of {len(responses)} responses "
                f"(prompt indices {_short(indices, 60)}); no single response fails alone",
                "fix the reward function; it fails on the batch as a whole") from err
        raise RewardFunctionError(
            KEY, name, f"raised {type(item_err).__name__}: {item_err} on prompt index {indices[i]} "
            f"(response {_short(responses[i], 60)}, answer {_short(answers[i], 40)})",
            f"fix the reward function or the data for prompt index {indices[i]}") from err
    return Graded(_as_floats(out, name, indices), int(getattr(out, "timed_out", 0)), int(getattr(out, "no_reward", 0)))


def compute_rewards(
    fn: Union[RewardFn, str],
    prompts: Sequence[str],
    responses: Sequence[str],
    answers: Sequence[Optional[str]],
    prompt_indices: Optional[Sequence[int]] = None,
    timeout_s: Optional[float] = None,
    **kwargs,
) -> torch.Tensor:
    """:func:`grade_batch`'s rewards alone: a float32 tensor ``[B]``."""
    return grade_batch(fn, prompts, responses, answers, prompt_indices, timeout_s, **kwargs).scores
