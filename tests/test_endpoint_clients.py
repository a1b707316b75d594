"""The OpenAI-compatible endpoint as the official ``openai`` SDK (and a hostile raw client) drives it.

Every SDK test talks to a real :class:`ChatEndpoint` on localhost through ``openai.OpenAI``; the
raw-socket tests send what no SDK would.  The tiny model is random, so replies are short strings of
characters; where a reply must call a tool, :class:`ToolCallingPolicy` writes a fixed call and the
tiny model scores it (its log-probs are the model's, by a full forward).
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.data.tokenizer import CharTokenizer
from megatron_rl.rollout.engine import RolloutBatch, RolloutEngineBase
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.testing.weights import random_canonical
from tests.support.decoder import TorchRolloutEngine
from tests.test_environments import MODEL, TOOL_ALPHABET, _full_forward_logprobs

openai = pytest.importorskip("openai")

CALC = {"type": "function", "function": {"name": "calc", "description": "adds",
                                         "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}}
CALL = '<tool_call>{"name": "calc", "arguments": {"x": 7}}</tool_call>'
QUESTION = [{"role": "user", "content": "what is 3+4?"}]


def _engine(vocab_size: int = 64):
    cfg = ModelConfig(**dict(MODEL, vocab_size=vocab_size, max_position_embeddings=512))
    engine = TorchRolloutEngine(cfg, "cpu")
    engine.load_weights(random_canonical(cfg, 0, std=0.2))
    return engine


def _endpoint(engine=None, tokenizer=None, max_new_tokens=6, **kwargs):
    from megatron_rl.envs.endpoint import ChatEndpoint

    tokenizer = tokenizer or CharTokenizer(TOOL_ALPHABET)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_id,))
    return ChatEndpoint(engine or _engine(), tokenizer, params, seed=5, max_turns=8, **kwargs)


def _client(endpoint):
    return openai.OpenAI(base_url=endpoint.base_url, api_key="x", max_retries=0)


class ToolCallingPolicy(RolloutEngineBase):
    """An engine that answers every context with :data:`CALL` (and, when ``</tool_call>`` does not
    stop it, `` ok`` and EOS), each token's log-prob the tiny model's: a random model never
    writes a tool call on its own."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer

    def generate(self, prompt_ids, params, seed, sample_keys=None):
        call, stop = self.tokenizer.encode(CALL), tuple(self.tokenizer.encode("</tool_call>"))
        reply = call if stop in params.stop_sequences else call + self.tokenizer.encode(" ok") + [self.tokenizer.eos_id]
        reply, finish = reply[:params.max_new_tokens], "stop" if len(reply) <= params.max_new_tokens else "length"
        logprobs = [_full_forward_logprobs(self.engine, list(p), reply, 1.0).tolist() for p in prompt_ids]
        return RolloutBatch(prompt_index=list(range(len(prompt_ids))), prompt_ids=[list(p) for p in prompt_ids],
                            response_ids=[list(reply) for _ in prompt_ids], response_logprobs=logprobs,
                            finish_reason=[finish] * len(prompt_ids))


def _streamed(client, **request):
    """The SDK's ``stream=True`` reassembled into one completion (and the chunks it came in)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state, chunks = ChatCompletionStreamState(), []
    for chunk in client.chat.completions.create(stream=True, **request):
        chunks.append(chunk)
        state.handle_chunk(chunk)
    return state.current_completion_snapshot, chunks


def _conversation(client, sid: str, stream: bool, **extra):
    """Two replies of one session (the first answered by a tool message); the replies' content,
    finish reasons, usage and log-probs as the client saw them."""
    messages, seen = list(QUESTION), []
    for _ in range(2):
        request = dict(model="megatron_rl", messages=messages, extra_body={"session_id": sid}, logprobs=True, **extra)
        if stream:
            completion, chunks = _streamed(client, stream_options={"include_usage": True}, **request)
            assert chunks[-1].usage is not None and not chunks[-1].choices
            usage = chunks[-1].usage
        else:
            completion = client.chat.completions.create(**request)
            usage = completion.usage
        choice = completion.choices[0]
        seen.append((choice.message.content, choice.finish_reason, usage.prompt_tokens, usage.completion_tokens,
                     [(t.token, t.logprob) for t in choice.logprobs.content]))
        messages = messages + [{"role": "assistant", "content": choice.message.content},
                               {"role": "tool", "content": "7"}]
    return seen


def test_streamed_replies_equal_the_non_streamed_ones_and_the_trajectory_is_token_exact():
    """``stream=True``: the SDK reassembles the same content, finish reason, usage and log-probs as
    without streaming for the same session state; the recorded trajectory is the same ids, and its
    log-probs (the streamed ones) equal a full forward over it."""
    engine = _engine()
    plain, streamed = _endpoint(engine), _endpoint(engine)
    try:
        expected = _conversation(_client(plain), "s", stream=False)
        got = _conversation(_client(streamed), "s", stream=True)
        (want,), (t,) = plain.trajectories(["s"]), streamed.trajectories(["s"])
    finally:
        plain.close()
        streamed.close()
    assert got == expected and t == want
    assert [c for c, *_ in got] != ["", ""]
    ref = _full_forward_logprobs(engine, t["prompt_ids"], t["response_ids"], 1.0)
    policy = torch.tensor(t["mask"], dtype=torch.bool)
    assert torch.allclose(ref[policy], torch.tensor(t["logprobs"])[policy], atol=1e-5)
    served = [lp for *_, logprobs in got for _, lp in logprobs]
    assert served == [lp for lp, m in zip(t["logprobs"], t["mask"]) if m]


def test_a_streamed_tool_call_arrives_as_tool_call_deltas():
    """A reply ending in ``</tool_call>`` streams its calls as OpenAI ``tool_calls`` deltas (index, id,
    type, name, arguments), finish reason ``tool_calls``, then ``[DONE]`` on the wire."""
    tokenizer = CharTokenizer(TOOL_ALPHABET)
    endpoint = _endpoint(ToolCallingPolicy(_engine(), tokenizer), max_new_tokens=80)
    client = _client(endpoint)
    try:
        whole = client.chat.completions.create(model="m", messages=QUESTION, tools=[CALC],
                                               extra_body={"session_id": "a"})
        streamed, chunks = _streamed(client, model="m", messages=QUESTION, tools=[CALC],
                                     extra_body={"session_id": "b"})
        raw = _raw(endpoint, _post_bytes({"messages": QUESTION, "tools": [CALC], "stream": True}))
    finally:
        endpoint.close()
    for completion in (whole, streamed):
        (call,) = completion.choices[0].message.tool_calls
        assert completion.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
        assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "calc", {"x": 7})
        assert completion.choices[0].message.content == CALL
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    status, headers, body = raw
    events = [line[len("data: "):] for line in body.decode().split("\n\n") if line]
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "tool_calls"


def test_tools_reach_the_prompt_and_tool_choice_is_honoured_or_refused():
    """``tools`` are rendered into the prompt (a system turn of the plain template); ``tool_choice=
    "none"`` returns the text as content with no ``tool_calls`` and does not stop at ``</tool_call>``;
    ``required`` / a named function are refused (constrained decoding would change the log-probs);
    a session whose tools change is refused."""
    tokenizer = CharTokenizer(TOOL_ALPHABET)
    endpoint = _endpoint(ToolCallingPolicy(_engine(), tokenizer), max_new_tokens=80)
    client = _client(endpoint)
    try:
        bare = client.chat.completions.create(model="m", messages=QUESTION, extra_body={"session_id": "bare"})
        with_tools = client.chat.completions.create(model="m", messages=QUESTION, tools=[CALC],
                                                    extra_body={"session_id": "tools"})
        none = client.chat.completions.create(model="m", messages=QUESTION, tools=[CALC], tool_choice="none",
                                              extra_body={"session_id": "none"})
        refused = {}
        for choice in ("required", {"type": "function", "function": {"name": "calc"}}):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="m", messages=QUESTION, tools=[CALC], tool_choice=choice)
            refused[json.dumps(choice)] = err.value
        history = QUESTION + [{"role": "assistant", "content": with_tools.choices[0].message.content},
                              {"role": "tool", "content": "7"}]
        with pytest.raises(openai.BadRequestError) as changed:
            client.chat.completions.create(model="m", messages=history, extra_body={"session_id": "tools"})
        (t,) = endpoint.trajectories(["tools"])
    finally:
        endpoint.close()
    rendered = tokenizer.chat_text(QUESTION, tools=[CALC])
    assert rendered.startswith("system: ") and json.dumps(CALC["function"]["parameters"]) in rendered
    assert t["prompt_ids"] == tokenizer.apply_chat_template(QUESTION, tools=[CALC])
    assert with_tools.usage.prompt_tokens == len(t["prompt_ids"]) > bare.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content == CALL + " ok"
    for err in refused.values():
        assert err.param == "tool_choice" and "log-prob" in err.message
    assert changed.value.param == "tools"


HF_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's way with tools, cut down: the definitions go into the system turn, tool results into a user turn.
QWEN_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _hf_tokenizer(path, template: str):
    """A character-level Hugging Face tokenizer with ``template``, saved by transformers itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from megatron_rl.data.tokenizer import HFTokenizer

    vocab = {t: i for i, t in enumerate(HF_SPECIALS)}
    for ch in TOOL_ALPHABET + "[]":
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    tok.save_pretrained(str(path))
    return HFTokenizer(str(path))


def test_hf_chat_templates_render_tools_as_transformers_does(tmp_path):
    """With a Hugging Face tokenizer the prompt is transformers' ``apply_chat_template(tools=...)``,
    and the tool message after a reply is appended as that template renders it, token-exact; a
    template that ignores ``tools`` is refused rather than dropping them."""
    from transformers import AutoTokenizer

    tokenizer = _hf_tokenizer(tmp_path / "qwen", QWEN_TOOLS_TEMPLATE)
    engine = _engine(vocab_size=72)
    endpoint = _endpoint(engine, tokenizer)
    client = _client(endpoint)
    try:
        first = client.chat.completions.create(model="m", messages=QUESTION, tools=[CALC],
                                               extra_body={"session_id": "s"})
        history = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                              {"role": "tool", "content": "7"}]
        client.chat.completions.create(model="m", messages=history, tools=[CALC], extra_body={"session_id": "s"})
        (t,) = endpoint.trajectories(["s"])
    finally:
        endpoint.close()
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "qwen"), local_files_only=True)
    want = list(hf.apply_chat_template(QUESTION, tools=[CALC], add_generation_prompt=True, tokenize=True,
                                       return_dict=False))
    assert t["prompt_ids"] == want and len(want) > len(tokenizer.apply_chat_template(QUESTION)) + 50
    end = t["mask"].index(0)  # the first reply, then the tool message as the template renders it after a reply
    observation = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
                   "<|im_start|>assistant\n")
    assert t["response_ids"][end:t["final_turn"][0]] == hf.encode(observation, add_special_tokens=False)
    assert tokenizer.decode(t["response_ids"][:end]) == first.choices[0].message.content

    no_tools = _hf_tokenizer(tmp_path / "plain", "{% for m in messages %}{{ m.content }}{% endfor %}")
    endpoint = _endpoint(engine, no_tools)
    try:
        with pytest.raises(openai.BadRequestError) as err:
            _client(endpoint).chat.completions.create(model="m", messages=QUESTION, tools=[CALC])
    finally:
        endpoint.close()
    assert err.value.param == "tools" and "template" in err.value.message


def test_each_request_field_is_honoured_or_refused_by_name():
    """``logprobs`` returns the sampled log-probs; ``max_tokens`` lowers the limit; sampling fields
    equal to the trainer's pass; any other value, ``n>1``, ``top_logprobs``, ``seed``, a JSON
    response format and unknown fields are refused with a 400 naming the field."""
    endpoint = _endpoint()
    client = _client(endpoint)
    ask = dict(model="m", messages=QUESTION)
    try:
        short = client.chat.completions.create(max_tokens=2, logprobs=True, extra_body={"session_id": "short"}, **ask)
        same = client.chat.completions.create(temperature=1.0, top_p=1.0, stop=None, frequency_penalty=0,
                                              presence_penalty=0.0, n=1, top_logprobs=0, parallel_tool_calls=True,
                                              extra_body={"top_k": 0}, **ask)
        (t,) = endpoint.trajectories(["short"])
        refused = {}
        for field, value, needle in (("temperature", 0.7, "rollout.temperature"), ("top_p", 0.9, "rollout.top_p"),
                                     ("top_k", 5, "rollout.top_k"), ("stop", ["x"], "rollout.stop"),
                                     ("n", 2, "session"), ("top_logprobs", 2, "sampled"), ("seed", 3, "run.seed"),
                                     ("frequency_penalty", 0.5, "penalt"), ("presence_penalty", 1.0, "penalt"),
                                     ("logit_bias", {"5": 10}, "log-prob"),
                                     ("response_format", {"type": "json_object"}, "log-prob"),
                                     ("max_tokens", 0, ">= 1"), ("best_of", 2, "unknown")):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(**ask, extra_body={field: value})
            refused[field] = (err.value.param, err.value.message, needle)
    finally:
        endpoint.close()
    assert short.usage.completion_tokens <= 2 and short.choices[0].finish_reason == "length"
    assert [c.logprob for c in short.choices[0].logprobs.content] == t["logprobs"]
    assert "".join(c.token for c in short.choices[0].logprobs.content) == short.choices[0].message.content
    assert same.choices[0].message.role == "assistant" and isinstance(same.created, int)
    for field, (param, message, needle) in refused.items():
        assert param == field and needle in message, (field, message)


def test_the_docs_table_names_every_request_field():
    """docs/environments.md's request-field table lists every field the endpoint takes."""
    import os

    from megatron_rl.envs.chat_request import KNOWN_FIELDS

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "environments.md")) as fh:
        rows = [line.split("|")[1] for line in fh if line.startswith("| `")]
    missing = [field for field in KNOWN_FIELDS if not any(f"`{field}`" in row for row in rows)]
    assert not missing


# ----------------------------------------------------------------------------------- a hostile raw client

def _post_bytes(body, content_length=None, path="/v1/chat/completions") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    length = len(data) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
            ).encode() + data


def _raw(endpoint, request: bytes, timeout: float = 20.0) -> tuple[int, dict, bytes]:
    """``(status, headers, body)`` of one raw request, read until the server closes."""
    host, port = endpoint.server.server_address[:2]
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def _error(endpoint, request: bytes, timeout: float = 20.0) -> tuple[int, dict]:
    status, headers, body = _raw(endpoint, request, timeout)
    assert headers["content-type"] == "application/json", body
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return status, error


def test_malformed_requests_get_openai_shaped_errors_and_nothing_on_stderr(capfd):
    """Bad JSON, bytes that are not UTF-8, a body that is not an object, bad ``max_tokens`` and
    ``Content-Length`` values, a body over the size limit (refused unread), a body shorter than its
    ``Content-Length`` (answered at the read timeout): each gets an OpenAI-shaped error, none a
    closed connection or a traceback."""
    endpoint = _endpoint(max_body_bytes=1 << 20, read_timeout_s=0.5)
    ok = {"messages": QUESTION}
    try:
        cases = {
            "json": _post_bytes(b'{"messages": ['),
            "utf8": _post_bytes(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
            "array": _post_bytes(b"[1, 2]"),
            "nan": _post_bytes(b'{"messages": [{"role": "user", "content": "a"}], "temperature": NaN}'),
            "minus": _post_bytes(dict(ok, max_tokens=-1)),
            "text": _post_bytes(dict(ok, max_tokens="abc")),
            "huge": _post_bytes(b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 1e999}'),
            "length-text": _post_bytes(ok, content_length="abc"),
            "length-negative": _post_bytes(ok, content_length=-5),
            "no-messages": _post_bytes({"model": "m"}),
            "role": _post_bytes({"messages": [{"content": "a"}]}),
            "image": _post_bytes({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
        }
        answers = {name: _error(endpoint, request) for name, request in cases.items()}
        start = time.monotonic()
        too_large = _error(endpoint, _post_bytes(b"", content_length=50 << 20))
        short = _error(endpoint, _post_bytes(b'{"messages": []}', content_length=1000))
        waited = time.monotonic() - start
        missing = _error(endpoint, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
        bad_line = _error(endpoint, b"NONSENSE\r\n\r\n")
        route = _error(endpoint, b"GET /v1/other HTTP/1.1\r\nHost: x\r\n\r\n")
    finally:
        endpoint.close()
    for name, (status, error) in answers.items():
        assert status == 400 and error["type"] == "invalid_request_error", (name, error)
    assert answers["minus"][1]["param"] == answers["text"][1]["param"] == answers["huge"][1]["param"] == "max_tokens"
    assert answers["image"][1]["param"] == "messages[0].content[0].type"
    assert too_large[0] == 413 and "1048576" in too_large[1]["message"]
    assert short[0] == 408 and waited < 5
    assert missing[0] == 411 and bad_line[0] == 400 and route[0] == 404
    assert capfd.readouterr().err == ""


def test_content_parts_models_and_an_edited_history():
    """Content as text parts is the joined text; any edited earlier message (not only the last
    reply) is refused; ``created`` / ``owned_by`` are set and ``GET /v1/models/{id}`` answers."""
    endpoint = _endpoint()
    client = _client(endpoint)
    try:
        parts = [{"role": "user", "content": [{"type": "text", "text": "what is"}, {"type": "text", "text": "3+4?"}]}]
        client.chat.completions.create(model="m", messages=parts, extra_body={"session_id": "parts"})
        messages = list(QUESTION)
        for _ in range(2):
            reply = client.chat.completions.create(model="m", messages=messages, extra_body={"session_id": "s"})
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "tool", "content": "7"}]
        refused = []
        for i, edit in ((0, {"role": "user", "content": "what is 3+5?"}), (2, {"role": "tool", "content": "8"}),
                        (0, {"role": "user", "content": "what is 3+4?", "name": "bob"})):
            edited = [dict(edit) if k == i else m for k, m in enumerate(messages)]
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="m", messages=edited, extra_body={"session_id": "s"})
            refused.append((err.value.param, err.value.message))
        resent = [dict(m) for m in messages]
        resent[0] = {"role": "user", "content": [{"type": "text", "text": "what is 3+4?"}]}  # the same text as parts
        client.chat.completions.create(model="m", messages=resent, extra_body={"session_id": "s"})
        models = client.models.list()
        model = client.models.retrieve("megatron_rl")
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4")
        (p,) = endpoint.trajectories(["parts"])
    finally:
        endpoint.close()
    assert p["prompt_ids"] == endpoint.tokenizer.apply_chat_template([{"role": "user", "content": "what is\n3+4?"}])
    assert [param for param, _ in refused] == ["messages[0]", "messages[2]", "messages[0]"]
    assert all("unchanged" in message for _, message in refused)
    assert [m.id for m in models.data] == ["megatron_rl"] and model.owned_by == "megatron_rl"
    assert isinstance(model.created, int) and model.created > 1_600_000_000


def test_requests_batched_together_never_ask_the_engine_for_more_positions_than_it_has():
    """Sessions of different lengths queued together: one call with the largest room would put the
    longest context past the model's positions (megatron's engine refuses it, a 500 for the agent);
    the batch takes a call per group that fits and each request still gets the tokens it may have."""
    from concurrent.futures import Future

    from tests.test_environments import PositionLimitedEngine

    engine = PositionLimitedEngine(_engine(), positions=40)
    endpoint = _endpoint(engine, max_new_tokens=20, max_tokens=40)
    try:
        short, long = [2, 5, 6, 7], [2] + list(range(5, 30))  # 4 and 26 tokens: 20 and 14 of room
        futures = [Future(), Future()]
        endpoint._generate([(short, 20, (), futures[0]), (long, 14, (), futures[1])])
        results = [f.result(timeout=60) for f in futures]
    finally:
        endpoint.close()
    assert engine.calls == [([4], 20), ([26], 14)]
    assert [len(ids) <= room for (ids, _, _), room in zip(results, (20, 14))] == [True, True]
