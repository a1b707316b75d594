"""Environments the multi-turn tests name as ``rollout.env=tests.support.envs:<Class>``."""

from __future__ import annotations

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
