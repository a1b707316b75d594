"""Tool calls in the Hermes / Qwen format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

What Qwen2.5 / Qwen3 chat templates (and Hermes-style models) emit.  A call that does not parse is
returned as an error the environment shows the policy as its observation: a malformed call is
something the policy should learn from, never a crash.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Optional

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str = ""
    arguments: dict = dataclasses.field(default_factory=dict)
    error: Optional[str] = None  # why the call could not be read (then name/arguments are empty)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>`` block of ``text`` in order (an unclosed last block is read to the end)."""
    calls = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        try:
            data = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(error=f"tool call is not JSON ({err.msg} at {err.pos})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall(error='tool call needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = data.get("arguments", {})
        if isinstance(arguments, str):  # some templates emit the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                calls.append(ToolCall(error="tool call arguments are not JSON"))
                continue
        if not isinstance(arguments, dict):
            calls.append(ToolCall(error="tool call arguments must be an object"))
            continue
        calls.append(ToolCall(data["name"], arguments))
    return calls


def openai_tool_calls(text: str) -> list[dict]:
    """The calls of ``text`` that parse, in OpenAI's ``tool_calls`` form (arguments as a JSON string);
    a call that does not parse stays in the text, where the agent sees it."""
    return [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            for call in parse_tool_calls(text) if call.error is None]
