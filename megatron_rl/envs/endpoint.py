"""An OpenAI-compatible chat endpoint served by the rollout engine, recording what it served.

An outside agent harness (anything that speaks ``POST /v1/chat/completions``) drives trajectories
against :class:`ChatEndpoint`; the endpoint keeps, per session, the exact token ids the engine saw
and sampled, with their log-probs, so the trainer trains on those ids and never on the text the
agent sends back.  A session is named by the request's ``session_id`` (or OpenAI's ``user`` field;
a request naming none is a session of its own, returned in the ``X-Session-Id`` header).

Token-in-token-out across turns: the first request's messages become the prompt through the chat
template.  A later request of the session must repeat the conversation so far; of its messages only
the ones after the last reply the endpoint served are new.  Those are rendered once, as the chat
template renders them after that reply (the reply itself is replaced by a sentinel while rendering,
so neither its text nor any ``tool_calls`` field the client attached is tokenized again), encoded,
and appended with loss mask 0.  A request whose history differs from what was served is refused
(400): a trajectory with an edited history is not one the engine generated.

Sampling is the trainer's (temperature, top-p/k, stop strings: the log-probs must be what the
trainer recomputes, and requests generated together share their stops); a request may ask for
fewer tokens (``max_tokens``); its own ``temperature`` and ``stop`` are not applied.  A reply
ends at EOS, at ``</tool_call>`` (then its calls come back in OpenAI's ``tool_calls`` form, finish
reason ``tool_calls``) or at its token limit.  Concurrent requests are generated together: a worker
thread takes everything queued and makes one engine call.  Sessions are bounded by
``max_turns`` and ``max_tokens`` (prompt + everything after it): past either, a request gets an
empty reply with finish reason ``length`` and the session records the limit.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import uuid
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from megatron_rl.envs.tool_calls import CLOSE, parse_tool_calls
from megatron_rl.envs.trajectories import MAX_TOKENS, MAX_TURNS, TokenTrace
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.utils.seeds import derive_seed

SENTINEL = "\ue000served\ue000"  # a private-use character pair no template or message contains


class RequestError(Exception):
    """A request the endpoint refuses (HTTP 400, with this message)."""


@dataclasses.dataclass
class Session(TokenTrace):
    messages: int = 0  # messages of the conversation already in the ids (the served replies included)
    replies: list[str] = dataclasses.field(default_factory=list)  # the text of every reply (empty at a limit)
    turns: int = 0  # replies the engine generated
    limit: str = ""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def trajectory(self) -> dict:
        return {"prompt_ids": list(self.prompt), "response_ids": list(self.response), "logprobs": list(self.logprobs),
                "mask": list(self.mask), "turns": self.turns, "final_turn": list(self.final_turn),
                "limit": self.limit}


class ChatEndpoint:
    """``POST /v1/chat/completions`` and ``GET /v1/models`` on ``host:port`` (0: any free port)."""

    def __init__(self, engine, tokenizer, params: SamplingParams, *, seed: int = 0, max_turns: int = 16,
                 max_tokens: int = 1 << 30, host: str = "127.0.0.1", port: int = 0, model_name: str = "megatron_rl"):
        self.engine, self.tokenizer, self.params, self.seed = engine, tokenizer, params, seed
        self.max_turns, self.max_tokens, self.model_name = max_turns, max_tokens, model_name
        self.tool_stop = tuple(tokenizer.encode(CLOSE))
        self.sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._queue: "queue.Queue" = queue.Queue()
        self._calls = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet: a training log is not an access log
                pass

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models":
                    return self._send(200, {"object": "list", "data": [{"id": endpoint.model_name, "object": "model"}]})
                self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                    session_id, reply = endpoint.complete(body)
                except RequestError as err:
                    return self._send(400, {"error": {"message": str(err), "type": "invalid_request_error"}})
                self._send(200, reply, {"X-Session-Id": session_id})

            def _send(self, code: int, payload: dict, headers: Optional[dict] = None):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self._threads = [threading.Thread(target=self.server.serve_forever, daemon=True, name="endpoint-http"),
                         threading.Thread(target=self._generate_loop, daemon=True, name="endpoint-generate")]
        for thread in self._threads:
            thread.start()

    @property
    def base_url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._queue.put(None)

    # ------------------------------------------------------------------ sessions

    def reset(self, seed: Optional[int] = None) -> None:
        """Forget every session (a new step); ``seed`` for the samples from now on."""
        with self._sessions_lock:
            self.sessions.clear()
        if seed is not None:
            self.seed, self._calls = seed, 0

    def trajectories(self, session_ids) -> list[dict]:
        """What was served to each session: prompt ids, response ids (replies and the messages between
        them), log-probs (0 on messages), loss mask (1 on replies), turns, the last reply's span, the
        limit it hit ('' if none).  A session never started is an empty trajectory of turns 0."""
        out = []
        for sid in session_ids:
            session = self.sessions.get(sid)
            out.append(session.trajectory() if session is not None else None)
        return out

    def complete(self, body: dict) -> tuple[str, dict]:
        """The chat completion for one request body (the HTTP handler's work, callable directly)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("messages must be a non-empty list of {role, content} objects")
        sid = str(body.get("session_id") or body.get("user") or uuid.uuid4().hex)
        with self._sessions_lock:
            session = self.sessions.get(sid)
            if session is None:
                session = self.sessions[sid] = Session(prompt=self.tokenizer.apply_chat_template(messages))
                session.messages = len(messages)
                new = None
            else:
                new = messages
        with session.lock:
            if new is not None:
                self._append_messages(session, new)
            ids, finish = self._reply(session, body)
        text = self.tokenizer.decode(ids)
        message: dict = {"role": "assistant", "content": text}
        calls = [c for c in parse_tool_calls(text) if c.error is None]
        if calls and finish == "stop":
            message["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                     for c in calls]
            finish = "tool_calls"
        prompt_tokens = session.length - len(ids)
        return sid, {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "model": self.model_name,
                     "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                               "total_tokens": session.length}}

    def _append_messages(self, session: Session, messages: list) -> None:
        """The messages after the last served reply, rendered once and appended (mask 0)."""
        served = session.messages
        if len(messages) <= served:
            raise RequestError(f"the session already holds {served} messages; send the conversation with the new "
                               "ones after the last reply")
        reply = messages[served - 1]
        if reply.get("role") != "assistant" or (reply.get("content") or "") not in ("", session.replies[-1]):
            raise RequestError(f"message {served - 1} must be the assistant reply this session was served, unchanged")
        history = [dict(m) for m in messages]
        history[served - 1] = {"role": "assistant", "content": SENTINEL}  # no tool_calls: the reply holds them
        rendered = self.tokenizer.chat_text(history)
        if rendered.count(SENTINEL) != 1:
            raise RequestError("the chat template did not render the conversation as sent")
        session.add_observation(self.tokenizer.encode(rendered.split(SENTINEL, 1)[1]))
        session.messages = len(messages)

    def _reply(self, session: Session, body: dict) -> tuple[list[int], str]:
        room = self.max_tokens - session.length
        if session.turns >= self.max_turns or room <= 0:
            session.limit = session.limit or (MAX_TURNS if session.turns >= self.max_turns else MAX_TOKENS)
            session.replies.append("")  # an empty reply is still a message of the conversation
            session.messages += 1
            return [], "length"
        wanted = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or self.params.max_new_tokens),
                     self.params.max_new_tokens, room)
        future: Future = Future()
        self._queue.put((session.prompt + session.response, wanted, future))
        ids, logprobs, finish = future.result()
        session.add_turn(ids, logprobs)
        session.replies.append(self.tokenizer.decode(ids))
        session.messages += 1
        session.turns += 1
        if finish == "length" and len(ids) == room:
            session.limit = MAX_TOKENS
        return ids, finish

    # ------------------------------------------------------------------ the engine's thread

    def _generate_loop(self) -> None:
        """Everything queued, in one engine call; each request cut to its own token limit."""
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            try:
                self._generate(batch)
            except Exception as err:  # noqa: BLE001 - every waiting request gets the error
                for *_, future in batch:
                    if not future.done():
                        future.set_exception(err)

    def _generate(self, batch: list) -> None:
        params = dataclasses.replace(self.params, n=1, max_new_tokens=max(w for _, w, _ in batch),
                                     stop_sequences=self.params.stop_sequences + (self.tool_stop,))
        self._calls += 1
        out = self.engine.generate([ctx for ctx, _, _ in batch], params, seed=derive_seed(self.seed, self._calls))
        for k, (_, wanted, future) in enumerate(batch):
            ids, logprobs = out.response_ids[k], out.response_logprobs[k]
            stopped = out.finish_reason[k] == "stop" and len(ids) <= wanted
            future.set_result((ids[:wanted], logprobs[:wanted], "stop" if stopped else "length"))
