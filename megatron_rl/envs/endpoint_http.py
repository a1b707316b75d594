"""The chat endpoint's HTTP layer: routes, bounded request bodies, OpenAI-shaped errors, streaming.

Whatever a client sends gets an HTTP answer, never a closed connection or a traceback: a body that
is not a UTF-8 JSON object, a bad ``Content-Length`` or a refused field is a 400 with OpenAI's
error object (``{"error": {"message", "type", "param", "code"}}``, which the ``openai`` SDK raises
as ``BadRequestError``); a body over ``max_body_bytes`` is refused (413) before it is read; one that
stops arriving is answered (408) after ``read_timeout_s``.  ``stream=true`` is served as OpenAI's
server-sent events, cut from the reply the engine generated whole (requests are batched).
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator, Optional
from urllib.parse import unquote, urlsplit

from megatron_rl.envs.chat_request import RequestError

DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_READ_TIMEOUT_S = 30.0
_BYTE_COUNT = re.compile(r"[0-9]{1,18}")


class ChatHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that went away is no error of the endpoint's; anything else is printed."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def serve_http(endpoint, host: str, port: int, max_body_bytes: int, read_timeout_s: float) -> ChatHTTPServer:
    """The HTTP server of ``endpoint`` (not started)."""
    return ChatHTTPServer((host, port), make_handler(endpoint, max_body_bytes, read_timeout_s))


def parse_json_body(data: bytes) -> dict:
    """The request body as a JSON object, or a :class:`RequestError` saying why it is not one."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(f"the body is not UTF-8 (byte {err.start})") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise RequestError(f"the body is not JSON ({err.msg} at {err.pos})") from None
    except RecursionError:
        raise RequestError("the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, not a {type(body).__name__}")
    return body


def _refuse_constant(name: str):
    raise RequestError(f"the body holds {name}, which is not JSON")


def stream_chunks(completion: dict, include_usage: bool) -> Iterator[dict]:
    """A ``chat.completion`` as OpenAI streams it: the role, the content (with its log-probs), each
    tool call's id and name then its arguments, the finish reason, and the usage if asked for."""
    head = {key: completion[key] for key in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"
    choice, extra = completion["choices"][0], {"usage": None} if include_usage else {}
    message, logprobs = choice["message"], choice.get("logprobs")

    def chunk(delta: dict, finish: Optional[str] = None, token_logprobs: Optional[dict] = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": token_logprobs,
                                     "finish_reason": finish}], **extra}

    yield chunk({"role": "assistant", "content": ""})
    if message["content"] or (logprobs and logprobs["content"]):
        yield chunk({"content": message["content"]}, token_logprobs=logprobs)
    for index, call in enumerate(message.get("tool_calls", [])):
        function = call["function"]
        yield chunk({"tool_calls": [{"index": index, "id": call["id"], "type": call["type"],
                                     "function": {"name": function["name"], "arguments": ""}}]})
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]})
    yield chunk({}, finish=choice["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": completion["usage"]}


def _route(path: str) -> str:
    return urlsplit(path).path.rstrip("/")


def _no_route(path: str) -> RequestError:
    return RequestError(f"no route {_route(path) or '/'}: this endpoint serves POST /v1/chat/completions, "
                        "GET /v1/models and GET /v1/models/{id}", status=404)


class ChatHandler(BaseHTTPRequestHandler):
    """One connection's requests; :func:`make_handler` binds it to an endpoint and its limits."""

    endpoint = None
    max_body_bytes = DEFAULT_MAX_BODY_BYTES
    timeout = DEFAULT_READ_TIMEOUT_S  # on every read of the connection: a client that stops sending is answered

    def log_message(self, *args):  # quiet: a training log is not an access log
        pass

    def send_error(self, code: int, message: Optional[str] = None, explain: Optional[str] = None) -> None:
        """The server's own refusals (a request line or headers it cannot read) in OpenAI's shape."""
        if self.request_version == "HTTP/0.9":  # the request line was unreadable: answer in HTTP/1.0 anyway
            self.request_version = "HTTP/1.0"
        self._refuse(RequestError(message or HTTPStatus(code).phrase, status=code))

    def do_GET(self):
        path = _route(self.path)
        if path == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [self.endpoint.model_card()]})
        if path.startswith("/v1/models/"):
            name = unquote(path[len("/v1/models/"):])
            if name == self.endpoint.model_name:
                return self._send_json(200, self.endpoint.model_card())
            return self._refuse(RequestError(f"the model {name!r} does not exist; this endpoint serves "
                                             f"{self.endpoint.model_name!r}", param="model", status=404,
                                             code="model_not_found"))
        self._refuse(_no_route(self.path))

    def do_POST(self):
        if _route(self.path) != "/v1/chat/completions":
            return self._refuse(_no_route(self.path))
        try:
            session_id, completion, request = self.endpoint.serve(parse_json_body(self._read_body()))
        except RequestError as err:
            return self._refuse(err)
        except TimeoutError:
            return self._refuse(RequestError(f"the body did not arrive within {self.timeout:g} s of its "
                                             "Content-Length", status=408))
        except Exception as err:  # noqa: BLE001 - the engine failed: the client is told, the log shows why
            traceback.print_exc()
            return self._refuse(RequestError(f"the endpoint failed: {type(err).__name__}: {err}", status=500))
        if request.stream:
            return self._send_stream(session_id, completion, request.include_usage)
        self._send_json(200, completion, {"X-Session-Id": session_id})

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            raise RequestError("chunked request bodies are not read; send the body with a Content-Length",
                               status=411)
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("Content-Length is required", status=411)
        if not _BYTE_COUNT.fullmatch(length.strip()):
            raise RequestError(f"Content-Length {length!r} is not a byte count")
        size = int(length)
        if size > self.max_body_bytes:
            raise RequestError(f"the body is {size} bytes, over this endpoint's limit of {self.max_body_bytes} bytes "
                               "(ChatEndpoint(max_body_bytes=...))", status=413)
        data = self.rfile.read(size)
        if len(data) < size:
            raise RequestError(f"the body ended after {len(data)} of its {size} bytes (Content-Length)")
        return data

    def _refuse(self, err: RequestError) -> None:
        self.close_connection = True  # an unread body may follow
        self._send_json(err.status, err.body())

    def _send_json(self, code: int, payload: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_stream(self, session_id: str, completion: dict, include_usage: bool) -> None:
        self.close_connection = True  # the end of the stream is the end of the connection
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Session-Id", session_id)
        self.end_headers()
        for chunk in stream_chunks(completion, include_usage):
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")


def make_handler(endpoint, max_body_bytes: int, read_timeout_s: float) -> type:
    """The request handler class of ``endpoint``."""
    return type("Handler", (ChatHandler,), {"endpoint": endpoint, "max_body_bytes": max_body_bytes,
                                            "timeout": read_timeout_s})
