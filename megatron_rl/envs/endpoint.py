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
(400): the session remembers a digest of every message it was sent and the text of every reply, so
any edited message is caught, not only the last reply.  ``tools`` are rendered into the prompt and
must be the same in every request of a session.

Sampling is the trainer's (temperature, top-p/k, stop strings: the log-probs must be what the
trainer recomputes, and requests generated together share their stops): a request's sampling fields
must equal the trainer's or be absent (:mod:`megatron_rl.envs.chat_request` checks every field); it
may ask for fewer tokens (``max_tokens``).  A reply ends at EOS, at ``</tool_call>`` (then its calls
come back in OpenAI's ``tool_calls`` form, finish reason ``tool_calls``; not with
``tool_choice="none"``) or at its token limit.  Concurrent requests are generated together: a
worker thread takes everything queued and makes one engine call per set of stops.  Sessions are
bounded by ``max_turns`` and ``max_tokens`` (prompt + everything after it): past either, a request
gets an empty reply with finish reason ``length`` and the session records the limit.  The HTTP
layer (limits, errors, streaming) is :mod:`megatron_rl.envs.endpoint_http`.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Optional

from megatron_rl.envs.chat_request import ChatRequest, RequestError, message_digest, parse_request
from megatron_rl.envs.endpoint_http import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT_S, serve_http
from megatron_rl.envs.tool_calls import CLOSE, openai_tool_calls
from megatron_rl.envs.trajectories import MAX_TOKENS, MAX_TURNS, TokenTrace, fitting_calls
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.utils.seeds import derive_seed

SENTINEL = "\ue000served\ue000"  # a private-use character pair no template or message contains
REPLY, MESSAGE = "reply", "message"

__all__ = ["ChatEndpoint", "RequestError", "Session"]


@dataclasses.dataclass
class Session(TokenTrace):
    # Every message of the conversation so far, in order: (MESSAGE, its digest) for what the client
    # sent, (REPLY, its text) for what the endpoint served (empty at a limit).
    sent: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    tools_key: str = "null"  # the tools the prompt holds (ChatRequest.tools_key)
    turns: int = 0  # replies the engine generated
    limit: str = ""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def trajectory(self) -> dict:
        return {"prompt_ids": list(self.prompt), "response_ids": list(self.response), "logprobs": list(self.logprobs),
                "mask": list(self.mask), "turns": self.turns, "final_turn": list(self.final_turn),
                "limit": self.limit}


class ChatEndpoint:
    """``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{id}`` on ``host:port``
    (0: any free port).  ``max_body_bytes`` bounds a request body, ``read_timeout_s`` how long a
    client may take to send one."""

    def __init__(self, engine, tokenizer, params: SamplingParams, *, seed: int = 0, max_turns: int = 16,
                 max_tokens: int = 1 << 30, host: str = "127.0.0.1", port: int = 0, model_name: str = "megatron_rl",
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout_s: float = DEFAULT_READ_TIMEOUT_S):
        self.engine, self.tokenizer, self.params, self.seed = engine, tokenizer, params, seed
        self.max_turns, self.max_tokens, self.model_name = max_turns, max_tokens, model_name
        self.created = int(time.time())
        self.tool_stop = tuple(tokenizer.encode(CLOSE))
        self.sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._queue: "queue.Queue" = queue.Queue()
        self._calls = 0
        self.server = serve_http(self, host, port, max_body_bytes, read_timeout_s)
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

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "megatron_rl"}

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
        limit it hit ('' if none).  A session never started is None."""
        out = []
        for sid in session_ids:
            session = self.sessions.get(sid)
            out.append(session.trajectory() if session is not None else None)
        return out

    def complete(self, body: dict) -> tuple[str, dict]:
        """``(session id, chat.completion)`` for one request body (the HTTP handler's work, callable directly)."""
        session_id, completion, _ = self.serve(body)
        return session_id, completion

    def serve(self, body: dict) -> tuple[str, dict, ChatRequest]:
        """``(session id, chat.completion, the request as read)``; a :class:`RequestError` for a request
        the endpoint refuses (nothing of the session changes then)."""
        request = parse_request(body, self.params, self.tokenizer.encode)
        sid = request.session_id or uuid.uuid4().hex
        with self._sessions_lock:
            session = self.sessions.get(sid)
            started = session is None
            if started:
                session = self.sessions[sid] = self._start(request)
        with session.lock:
            if not started:
                self._append_messages(session, request)
            ids, logprobs, finish = self._reply(session, request)
        return sid, self._completion(session, request, ids, logprobs, finish), request

    def _start(self, request: ChatRequest) -> Session:
        """A session whose prompt is the request's messages (and tools) through the chat template."""
        messages, tools = request.messages, request.tools
        prompt = self._render(lambda: self.tokenizer.apply_chat_template(messages, tools=tools))
        if tools and self._render(lambda: self.tokenizer.chat_text(messages, tools=tools) ==
                                  self.tokenizer.chat_text(messages)):
            raise RequestError("the model's chat template ignores tools, so the model would never see them; use a "
                               "template that renders tools (Qwen, Hermes, Llama 3) or describe them in a message",
                               param="tools")
        return Session(prompt=prompt, sent=[(MESSAGE, message_digest(m)) for m in messages],
                       tools_key=request.tools_key)

    @staticmethod
    def _render(render):
        try:
            return render()
        except Exception as err:  # noqa: BLE001 - a template raises what its author wrote (jinja2 errors, ...)
            raise RequestError(f"the chat template cannot render these messages ({type(err).__name__}: {err})",
                               param="messages") from None

    def _append_messages(self, session: Session, request: ChatRequest) -> None:
        """The messages after the last served reply, rendered once and appended (mask 0)."""
        messages, served = request.messages, len(session.sent)
        if request.tools_key != session.tools_key:
            raise RequestError("tools differ from the ones this session's prompt holds; send the same tools with "
                               "every request of a session", param="tools")
        if len(messages) <= served:
            raise RequestError(f"the session already holds {served} messages; send the conversation with the new "
                               "ones after the last reply", param="messages")
        self._check_history(session, messages)
        history = list(messages)
        history[served - 1] = {"role": "assistant", "content": SENTINEL}  # no tool_calls: the reply holds them
        rendered = self._render(lambda: self.tokenizer.chat_text(history, tools=request.tools))
        if rendered.count(SENTINEL) != 1:
            raise RequestError("the chat template did not render the conversation as sent", param="messages")
        session.add_observation(self.tokenizer.encode(rendered.split(SENTINEL, 1)[1]))
        session.sent += [(MESSAGE, message_digest(m)) for m in messages[served:]]

    @staticmethod
    def _check_history(session: Session, messages: list[dict]) -> None:
        """Every message the session already holds must come back unchanged: an edited history is
        not one the engine generated."""
        for i, (kind, value) in enumerate(session.sent):
            message = messages[i]
            if kind == REPLY and (message["role"] != "assistant" or message["content"] not in ("", value)):
                raise RequestError(f"messages[{i}] must be the assistant reply this session was served, unchanged",
                                   param=f"messages[{i}]")
            if kind == MESSAGE and message_digest(message) != value:
                raise RequestError(f"messages[{i}] must be the message this session was sent, unchanged: an edited "
                                   "history is not one the engine generated", param=f"messages[{i}]")

    def _reply(self, session: Session, request: ChatRequest) -> tuple[list[int], list[float], str]:
        room = self.max_tokens - session.length
        if session.turns >= self.max_turns or room <= 0:
            session.limit = session.limit or (MAX_TURNS if session.turns >= self.max_turns else MAX_TOKENS)
            session.sent.append((REPLY, ""))  # an empty reply is still a message of the conversation
            return [], [], "length"
        wanted = min(request.max_tokens or self.params.max_new_tokens, self.params.max_new_tokens, room)
        stops = self.params.stop_sequences + ((self.tool_stop,) if request.tool_choice != "none" else ())
        future: Future = Future()
        self._queue.put((session.prompt + session.response, wanted, stops, future))
        ids, logprobs, finish = future.result()
        session.add_turn(ids, logprobs)
        session.sent.append((REPLY, self.tokenizer.decode(ids)))
        session.turns += 1
        if finish == "length" and len(ids) == room:
            session.limit = MAX_TOKENS
        return ids, logprobs, finish

    def _completion(self, session: Session, request: ChatRequest, ids: list[int], logprobs: list[float],
                    finish: str) -> dict:
        """The OpenAI ``chat.completion`` of one reply."""
        text = self.tokenizer.decode(ids)
        message: dict = {"role": "assistant", "content": text}
        calls = openai_tool_calls(text) if request.tool_choice != "none" and finish == "stop" else []
        if calls:
            message["tool_calls"], finish = calls, "tool_calls"
        choice: dict = {"index": 0, "message": message, "finish_reason": finish}
        if request.logprobs:
            choice["logprobs"] = {"content": self._token_logprobs(ids, logprobs), "refusal": None}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": session.length - len(ids), "completion_tokens": len(ids),
                          "total_tokens": session.length}}

    def _token_logprobs(self, ids: list[int], logprobs: list[float]) -> list[dict]:
        """Each sampled token with the log-prob the engine sampled it at (the one the trainer trains on)."""
        out = []
        for token_id, logprob in zip(ids, logprobs):
            token = self.tokenizer.decode([token_id])
            out.append({"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []})
        return out

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
        """One engine call per set of stops (``tool_choice=none`` does not stop at ``</tool_call>``), split
        where one call would ask the engine for more positions than it has (:func:`fitting_calls`)."""
        groups: dict[tuple, list] = {}
        for item in batch:
            groups.setdefault(item[2], []).append(item)
        limit = self.engine.max_sequence_length
        for stops, same_stops in groups.items():
            for members, max_new in fitting_calls([len(ctx) for ctx, *_ in same_stops],
                                                  [wanted for _, wanted, _, _ in same_stops],
                                                  self.params.max_new_tokens, limit):
                self._call([same_stops[k] for k in members], max_new, stops)

    def _call(self, items: list, max_new: int, stops: tuple) -> None:
        """One engine call; each request cut to its own token limit."""
        params = dataclasses.replace(self.params, n=1, max_new_tokens=max_new, stop_sequences=stops)
        self._calls += 1
        out = self.engine.generate([ctx for ctx, *_ in items], params, seed=derive_seed(self.seed, self._calls))
        for k, (_, wanted, _, future) in enumerate(items):
            ids, logprobs = out.response_ids[k], out.response_logprobs[k]
            stopped = out.finish_reason[k] == "stop" and len(ids) <= wanted
            future.set_result((ids[:wanted], logprobs[:wanted], "stop" if stopped else "length"))
