"""The built-in tool-calling environment (``rollout.env=tool_calling``).

Each policy turn ends at EOS or at ``</tool_call>``.  A turn without a tool call is the policy's
answer: the trajectory is done (``reward.fn`` grades that last turn).  Otherwise every call of the
turn runs (bounded, sandboxed: :mod:`megatron_rl.envs.tools`) and the results come back as one
observation in the chat template's format (``observation_format``); a call that does not parse, an
unknown tool, a tool that raises or overruns its time bound each come back as an ``error: ...``
result the policy reads, and are counted.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_rl.envs.base import Turn
from megatron_rl.envs.tool_calls import CLOSE, parse_tool_calls
from megatron_rl.envs.tools import ToolTimeout, call_tool, resolve_tools
from megatron_rl.rewards.bounded import GraderError

# How tool results are shown to the policy, per chat template: {results} is the results joined
# by newlines.  "plain" continues megatron_rl's plain template (role: content lines), "qwen" the
# Qwen2.5 / Qwen3 (Hermes) template after a turn cut at </tool_call>.
OBSERVATION_FORMATS = {
    "plain": "\ntool: {results}\nassistant: ",
    "qwen": ("<|im_end|>\n<|im_start|>user\n<tool_response>\n{results}\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n"),
}


class ToolCallingEnv:
    """Parses Hermes-format tool calls in the policy's turn and answers with the tools' results."""

    stop = (CLOSE,)

    def __init__(self, tools: Sequence[str] | dict = ("calculator",), timeout_s: Optional[float] = 5.0,
                 observation_format: str = "plain", max_calls_per_turn: int = 4):
        if observation_format not in OBSERVATION_FORMATS:
            raise TypeError(f"observation_format must be one of {sorted(OBSERVATION_FORMATS)}, "
                            f"got {observation_format!r}")
        self.tools = resolve_tools(tools)
        self.timeout_s = timeout_s
        self.template = OBSERVATION_FORMATS[observation_format]
        self.max_calls_per_turn = max_calls_per_turn
        self.record: dict = {}

    def reset(self, record: dict) -> None:
        self.record = record

    def step(self, turn_text: str, turn_ids: Sequence[int]) -> Turn:
        calls = parse_tool_calls(turn_text)
        if not calls:
            return Turn(done=True)
        counts = {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_parse_errors": 0}
        results = []
        for call in calls[: self.max_calls_per_turn]:
            counts["tool_calls"] += 1
            results.append(self._run(call, counts))
        if len(calls) > self.max_calls_per_turn:
            results.append(f"error: at most {self.max_calls_per_turn} tool calls per turn")
            counts["tool_errors"] += 1
        return Turn(observation=self.template.format(results="\n".join(results)), info=counts)

    def _run(self, call, counts: dict) -> str:
        if call.error is not None:
            counts["tool_parse_errors"] += 1
            return f"error: {call.error}"
        if call.name not in self.tools:
            counts["tool_errors"] += 1
            return f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}"
        try:
            return call_tool(self.tools[call.name], call.arguments, self.timeout_s)
        except ToolTimeout as err:
            counts["tool_timeouts"] += 1
            return f"error: {call.name} {err}"
        except GraderError as err:
            counts["tool_errors"] += 1
            return f"error: {err.detail}"
        except (TypeError, ValueError, ArithmeticError) as err:  # run in this process (timeout_s=None)
            counts["tool_errors"] += 1
            return f"error: {err}"
