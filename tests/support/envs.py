"""Environments the multi-turn tests name as ``rollout.env=tests.support.envs:<Class>``."""

from __future__ import annotations

import json
import time

from megatron_rl.envs.base import Turn

# Observation ids of ScriptedEnv: characters of the char tokenizer ("tool: ok\n" would do; fixed ids
# make the check independent of the tokenizer).
OBSERVATION = [40, 41, 42]


class ScriptedEnv:
    """Answers every turn with :data:`OBSERVATION` and is done after ``turns`` turns; a reward of
    0.25 per turn (so the environment's reward is visible in the score)."""

    stop = ()

    def __init__(self, turns: int = 3, observation: list | str | None = None):
        self.turns, self.observation = turns, OBSERVATION if observation is None else observation
        self.seen = 0

    def reset(self, record: dict) -> None:
        self.seen = 0
        self.record = record

    def step(self, turn_text: str, turn_ids) -> Turn:
        self.seen += 1
        return Turn(observation=self.observation, reward=0.25, done=self.seen >= self.turns)


def slow_tool(seconds: float = 30.0) -> str:
    time.sleep(float(seconds))
    return "late"


def network_tool() -> str:
    import socket

    socket.create_connection(("127.0.0.1", 9), timeout=1)
    return "connected"


def where_tool() -> str:
    import os

    return os.getcwd()


def two_tool_turns(base_url: str, session_id: str, record: dict) -> float:
    """An outside agent: asks the prompt, answers two replies with tool results, takes a third; 0.5."""
    import json
    import urllib.request

    def ask(messages):
        body = json.dumps({"model": "megatron_rl", "messages": messages, "session_id": session_id}).encode()
        request = urllib.request.Request(base_url + "/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["choices"][0]["message"]["content"]

    messages = [{"role": "user", "content": record["prompt"]}]
    for result in ("7", "8"):
        messages += [{"role": "assistant", "content": ask(messages)}, {"role": "tool", "content": result}]
    ask(messages)
    return 0.5


def silent_agent(base_url: str, session_id: str, record: dict) -> None:
    """An agent that never asks: its samples have no reply."""
    return None


def sleeping_agent(base_url: str, session_id: str, record: dict) -> float:
    """Asks once, then never returns (the agent time bound ends it)."""
    import json
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": record["prompt"]}], "session_id": session_id})
    request = urllib.request.Request(base_url + "/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=60).read()
    time.sleep(600)
    return 1.0


class SlowFirstStepEnv(ScriptedEnv):
    """:class:`ScriptedEnv` whose first step sleeps ``record["sleep"]`` seconds (a slow tool); every
    step's end time goes to :data:`STEP_TIMES` as (record["name"], step, time)."""

    def step(self, turn_text: str, turn_ids) -> Turn:
        if self.seen == 0 and self.record.get("sleep"):
            time.sleep(self.record["sleep"])
        answer = super().step(turn_text, turn_ids)
        STEP_TIMES.append((self.record.get("name"), self.seen, time.monotonic()))
        return answer


STEP_TIMES: list = []


def _sdk_ask(base_url: str, record: dict, **session) -> None:
    """One request through the official openai SDK (what agents are written with)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    client.chat.completions.create(model="megatron_rl", messages=[{"role": "user", "content": record["prompt"]}],
                                   **session)


def sdk_agent_without_session_id(base_url: str, session_id: str, record: dict) -> None:
    """Plain SDK use: no ``user=`` and no ``extra_body``, so the request is a session of its own."""
    _sdk_ask(base_url, record)


def sdk_agent_reaching_half(base_url: str, session_id: str, record: dict) -> None:
    """Names its session (``user=``) for the first sample of each prompt only."""
    _sdk_ask(base_url, record, **({"user": session_id} if session_id.endswith("-0") else {}))


CALCULATOR = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}


def _streamed_reply(stream) -> tuple[str, list[dict], str]:
    """``(content, tool calls, finish reason)`` put back together from the chunks, as agents do."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or ():
                slot = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                if call.function is not None:
                    slot["name"] += call.function.name or ""
                    slot["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def sdk_streaming_tool_agent(base_url: str, session_id: str, record: dict) -> None:
    """An agent as users write it with the openai SDK: streamed replies, the record's tools offered
    (``tools=``), every tool call run and answered (``role: tool``) until a reply calls none."""
    from openai import OpenAI

    from megatron_rl.envs.tools import calculator

    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages = [dict(m) for m in record["messages"]]
    for _ in range(4):
        stream = client.chat.completions.create(model="megatron_rl", messages=messages, tools=record["tools"],
                                                stream=True, user=session_id)
        content, calls, finish = _streamed_reply(stream)
        messages.append({"role": "assistant", "content": content, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]} if calls else {"role": "assistant", "content": content})
        if finish != "tool_calls":
            return None
        for call in calls:
            try:
                result = calculator(**json.loads(call["arguments"]))
            except (TypeError, ValueError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return None
