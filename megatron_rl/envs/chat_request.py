"""What a ``POST /v1/chat/completions`` body may ask of the endpoint, checked field by field.

The trainer trains on the log-probs the engine sampled, so a request cannot change how it samples:
a sampling field is accepted when it equals what the trainer samples with (or is absent / null)
and refused otherwise, naming the config key that sets it.  Fields the endpoint honours
(``logprobs``, ``max_tokens``, ``stream``, ``tools``, ``tool_choice`` auto / none) are read into a
:class:`ChatRequest`; unknown fields are refused, never dropped.  docs/environments.md has the table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Callable, Optional

from megatron_rl.rollout.sampling import SamplingParams

# Fields that change nothing the trainer trains on; accepted with any value.
HARMLESS = ("model", "user", "session_id", "metadata", "store", "service_tier", "prompt_cache_key",
            "safety_identifier", "parallel_tool_calls")
_STREAM_OPTIONS = ("include_usage", "include_obfuscation")  # no obfuscation padding is sent: nothing to hide
CONSTRAINED = "constrained decoding would change the log-probs the trainer trains on"


class RequestError(Exception):
    """A request the endpoint refuses: HTTP ``status`` with an OpenAI error object naming ``param``."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict:
        error_type = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # normalized: content as text, null fields dropped
    session_id: Optional[str] = None
    max_tokens: Optional[int] = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tools: Optional[list] = None
    tool_choice: str = "auto"  # or "none"

    @property
    def tools_key(self) -> str:
        """The tools as one string, to tell whether two requests of a session sent the same ones."""
        return json.dumps(self.tools, sort_keys=True)


def parse_request(body: dict, params: SamplingParams, encode: Callable[[str], list[int]]) -> ChatRequest:
    """The request ``body`` asks for, or a :class:`RequestError` naming the first field refused."""
    for field in body:
        if field not in _CHECKS and field not in _READ and field not in HARMLESS and body[field] is not None:
            raise RequestError(f"unknown field {field}: this endpoint does not take it (the fields it takes are in "
                               "docs/environments.md)", param=field)
    for field, check in _CHECKS.items():
        if body.get(field) is not None:
            check(field, body[field], params, encode)
    stream = _flag(body, "stream")
    return ChatRequest(messages=normalize_messages(body.get("messages")), session_id=_session_id(body),
                       max_tokens=_max_tokens(body), stream=stream, include_usage=_include_usage(body, stream),
                       logprobs=_flag(body, "logprobs"), tools=_tools(body.get("tools")),
                       tool_choice=_tool_choice(body.get("tool_choice")))


# ------------------------------------------------------------------------------------------- messages

def normalize_messages(messages) -> list[dict]:
    """Each message with its content as text (OpenAI's text parts joined by newlines) and null
    fields dropped, so a message reads the same however a client spells it."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages")
    return [_normalize_message(i, m) for i, m in enumerate(messages)]


def _normalize_message(i: int, message) -> dict:
    if not isinstance(message, dict):
        raise RequestError(f"messages[{i}] must be an object with role and content", param=f"messages[{i}]")
    if not isinstance(message.get("role"), str) or not message["role"]:
        raise RequestError(f"messages[{i}].role must be a non-empty string", param=f"messages[{i}].role")
    out = {key: value for key, value in message.items() if value is not None}
    out["content"] = _content_text(i, message.get("content"))
    return out


def _content_text(i: int, content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts",
                           param=f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"messages[{i}].content[{j}] is a {kind!r} part: the model reads text only, "
                               'send {"type": "text", "text": ...} parts', param=f"messages[{i}].content[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def message_digest(message: dict) -> str:
    """A normalized message's fingerprint: what a session remembers of each message it was sent."""
    return hashlib.sha256(json.dumps(message, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------ fields read into the request

def _flag(body: dict, field: str) -> bool:
    value = body.get(field)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{field} must be true or false", param=field)
    return bool(value)


def _session_id(body: dict) -> Optional[str]:
    for field in ("session_id", "user"):
        value = body.get(field)
        if value is not None and value != "":
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise RequestError(f"{field} must be a string naming the session", param=field)
            return str(value)
    return None


def _max_tokens(body: dict) -> Optional[int]:
    limits = [_positive_int(field, body[field]) for field in ("max_tokens", "max_completion_tokens")
              if body.get(field) is not None]
    return min(limits) if limits else None


def _positive_int(field: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestError(f"{field}={json.dumps(value)}: must be an integer >= 1", param=field)
    return value


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options is only allowed with stream=true", param="stream_options")
    if not isinstance(options, dict) or any(k not in _STREAM_OPTIONS and v is not None for k, v in options.items()):
        raise RequestError('stream_options takes {"include_usage": true|false} (and include_obfuscation, unused)',
                           param="stream_options")
    return _flag(options, "include_usage")


def _tools(tools) -> Optional[list]:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of function tools", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool["type"] != "function" or not isinstance(function.get("name"), str):
            raise RequestError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}',
                               param=f"tools[{i}]")
    return tools


def _tool_choice(choice) -> str:
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    shown = choice if isinstance(choice, str) else json.dumps(choice)
    raise RequestError(f"tool_choice={shown}: forcing a tool call needs constrained decoding, which would change the "
                       "log-probs the trainer trains on; send auto or none", param="tool_choice")


# -------------------------------------------------------------- fields checked against the trainer's sampling

def _number(field: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise RequestError(f"{field} must be a finite number", param=field)
    return float(value)


def _trainer_value(field: str, value, want: float, key: str) -> None:
    if abs(_number(field, value) - want) > 1e-9:
        raise RequestError(f"{field}={value}: the trainer samples with {key}={want:g} and trains on those "
                           f"log-probs; leave {field} unset or send {want:g}", param=field)


def _temperature(field, value, params, encode) -> None:
    if params.is_greedy and _number(field, value) == 0.0:
        return
    _trainer_value(field, value, params.temperature, "rollout.temperature")


def _top_p(field, value, params, encode) -> None:
    _trainer_value(field, value, params.top_p, "rollout.top_p")


def _top_k(field, value, params, encode) -> None:
    if value == -1 and params.top_k == 0:  # vLLM's spelling of "off"
        return
    _trainer_value(field, value, params.top_k, "rollout.top_k")


def _neutral(neutral: float, what: str):
    def check(field, value, params, encode) -> None:
        if _number(field, value) != neutral:
            raise RequestError(f"{field}={value}: the trainer samples with no {what} and trains on those log-probs; "
                               f"leave {field} unset or send {neutral:g}", param=field)
    return check


def _stop(field, value, params, encode) -> None:
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) and s for s in strings):
        raise RequestError("stop must be a string or a list of non-empty strings", param=field)
    if {tuple(encode(s)) for s in strings} != set(params.stop_sequences):
        raise RequestError(f"stop={json.dumps(value)}: replies stop where the trainer's rollout.stop says (requests "
                           "generated together share their stops); leave stop unset or send rollout.stop", param=field)


def _seed(field, value, params, encode) -> None:
    raise RequestError(f"seed={value}: samples are drawn from run.seed (a seed per step and engine call), so a "
                       "run reproduces; leave seed unset", param=field)


def _logit_bias(field, value, params, encode) -> None:
    if value != {}:
        raise RequestError("logit_bias: biasing tokens would change the log-probs the trainer trains on; leave it "
                           "unset", param=field)


def _response_format(field, value, params, encode) -> None:
    if value != {"type": "text"}:
        raise RequestError(f"response_format={json.dumps(value)}: {CONSTRAINED}; leave it unset or send "
                           '{"type": "text"}', param=field)


def _n(field, value, params, encode) -> None:
    if _positive_int(field, value) != 1:
        raise RequestError(f"n={value}: a session is one trajectory and its next request repeats one history; for "
                           "n samples start n sessions (one session_id each)", param=field)


def _top_logprobs(field, value, params, encode) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError(f"{field} must be an integer >= 0", param=field)
    if value:
        raise RequestError(f"top_logprobs={value}: the engine returns only the sampled token's log-prob (logprobs="
                           "true); leave top_logprobs unset or 0", param=field)


def _max_tokens_check(field, value, params, encode) -> None:
    _positive_int(field, value)


# Checked against the trainer's sampling (absent or null: the trainer's own).
_CHECKS = {
    "temperature": _temperature, "top_p": _top_p, "top_k": _top_k, "stop": _stop, "seed": _seed,
    "frequency_penalty": _neutral(0.0, "frequency penalty"), "presence_penalty": _neutral(0.0, "presence penalty"),
    "repetition_penalty": _neutral(1.0, "repetition penalty"), "min_p": _neutral(0.0, "min-p filter"),
    "logit_bias": _logit_bias, "response_format": _response_format, "n": _n, "top_logprobs": _top_logprobs,
    "max_tokens": _max_tokens_check, "max_completion_tokens": _max_tokens_check,
}
# Read into the ChatRequest.
_READ = ("messages", "stream", "stream_options", "logprobs", "tools", "tool_choice")
# Every field a request may hold (the table of docs/environments.md lists each).
KNOWN_FIELDS = _READ + tuple(_CHECKS) + HARMLESS
