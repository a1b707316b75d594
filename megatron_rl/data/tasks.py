"""Built-in prompt tasks (``data.train_path=task:<name>``), for the CPU demo and tests.

``digit_sum``: prompts ``"a+b="`` for digits a, b; the answer is the decimal sum (100 prompts).
``add_small``: the same with b in {1, 2} (20 prompts) -- small enough that RL alone teaches a
tiny model the table in a few minutes on a CPU.  Both are verifiable with ``reward.fn=digit_sum``;
a model that only knows the answer format scores about 1/12 on ``add_small``.
``tool_mul``: ``"a*b="`` for two-digit a, b (8100 prompts): beyond a tiny model without a tool, and
easy with the calculator of ``rollout.env=tool_calling``.  Each prompt carries a demonstration, the
policy turns that solve it (a Hermes tool call, then the answer): a supervised warm-up
(``trainer.sft_warmup_steps``) steps the environment through them, so it trains on the trajectory
the environment would produce, its observations masked (:mod:`megatron_rl.trainer.sft`).
"""

from __future__ import annotations

import json

from megatron_rl.data.prompts import PromptLengths, PromptSet
from megatron_rl.errors import DataError


def _digit_sum() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


def _add_small() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(1, 3)]


def _max_digit() -> list[tuple[str, str]]:
    return [(f"max {a}{b}=", str(max(a, b))) for a in range(10) for b in range(10)]


def tool_call_text(name: str, arguments: dict) -> str:
    """A Hermes / Qwen tool call, as ``rollout.env=tool_calling`` reads it."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def _tool_mul() -> list[tuple[str, str, list[str]]]:
    return [(f"{a}*{b}=", str(a * b), [tool_call_text("calculator", {"expression": f"{a}*{b}"}), str(a * b)])
            for a in range(10, 100) for b in range(10, 100)]


# name -> rows of (prompt, answer) or (prompt, answer, demonstration: the policy turns that solve it)
TASKS = {"digit_sum": _digit_sum, "add_small": _add_small, "max_digit": _max_digit, "tool_mul": _tool_mul}
TASK_PREFIX = "task:"


def check_task(name: str, key: str = "data.train_path") -> None:
    if name not in TASKS:
        raise DataError(key, f"{TASK_PREFIX}{name}", "unknown built-in task",
                        f"use one of {', '.join(TASK_PREFIX + t for t in TASKS)}, or a JSONL/Parquet file")


def load_task(name: str, tokenizer, max_prompt_tokens: int, key: str = "data.train_path",
              lengths: PromptLengths | None = None) -> PromptSet:
    """The task's prompts within ``max_prompt_tokens`` (``lengths`` counts them, as for a file);
    a :class:`DataError` when none is."""
    check_task(name, key)
    lengths = PromptLengths(max_prompt_tokens) if lengths is None else lengths
    out = PromptSet([], [], [], [], path=f"{TASK_PREFIX}{name}")
    for index, (prompt, answer, *demonstration) in enumerate(TASKS[name]()):
        ids = tokenizer.encode_prompt(prompt)
        if not lengths.keeps(len(ids)):
            out.num_dropped += 1
            continue
        out.prompt_ids.append(ids)
        out.prompts.append(prompt)
        out.answers.append(answer)
        out.source_index.append(index)
        if demonstration:
            out.demonstrations.append(demonstration[0])
    lengths.refuse_when_none_fit(out.path)
    return out
