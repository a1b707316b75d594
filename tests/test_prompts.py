"""Tokenizers, prompt loading and filtering, and the resumable prompt sampler."""

import importlib.util
import json
import logging

import pytest

from megatron_rl.data import CharTokenizer, HFTokenizer, PromptSampler, PromptSet, load_prompts, load_tokenizer
from megatron_rl.errors import DataError, UserInputError

HAVE_PYARROW = importlib.util.find_spec("pyarrow") is not None

needs_pyarrow = pytest.mark.skipif(not HAVE_PYARROW, reason="pyarrow is not installed (pip install pyarrow)")

CHAR = CharTokenizer()


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ---------------------------------------------------------------- tokenizers


def test_char_tokenizer_round_trip_and_ids():
    text = "what is 12 + 30?\n#### 42 (ok), 3/4 = 0.75: yes*2 -1"
    ids = CHAR.encode(text)
    assert len(ids) == len(text) and min(ids) >= 4
    assert CHAR.decode(ids) == text
    assert (CHAR.pad_id, CHAR.eos_id, CHAR.bos_id) == (0, 1, 2)
    assert CHAR.vocab_size == 4 + len(set(text) | set(CHAR.alphabet)) < 128
    assert CHAR.encode_prompt("ab") == [CHAR.bos_id] + CHAR.encode("ab")
    assert CHAR.decode([CHAR.bos_id] + CHAR.encode("ab") + [CHAR.eos_id, CHAR.pad_id]) == "ab"


def test_char_tokenizer_unknown_characters():
    ids = CHAR.encode("Hi!")
    assert ids[0] == ids[2] == CHAR.unk_id and ids[1] == CHAR.encode("i")[0]
    assert CHAR.decode(ids) == "\ufffdi\ufffd"
    assert CHAR.decode([CHAR.vocab_size + 5]) == "\ufffd"  # ids from a padded model vocabulary


def test_char_tokenizer_is_deterministic_and_custom_alphabet():
    assert CharTokenizer().encode("abc 123") == CHAR.encode("abc 123")
    tok = load_tokenizer("char:ab")
    assert tok.vocab_size == 6 and tok.encode("abc") == [4, 5, 3]
    with pytest.raises(DataError, match="repeats"):
        load_tokenizer("char:aba")
    with pytest.raises(DataError, match="empty"):
        load_tokenizer("char:")


def test_load_tokenizer_bad_spec(tmp_path):
    assert isinstance(load_tokenizer("char"), CharTokenizer)
    for spec in ("gpt2", str(tmp_path / "missing"), ""):
        with pytest.raises(DataError) as info:
            load_tokenizer(spec)
        assert isinstance(info.value, UserInputError)
        assert str(info.value).startswith("data error: data.tokenizer") and "fix:" in str(info.value)
    with pytest.raises(DataError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))  # a directory without tokenizer files


def test_char_chat_template():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]
    text = "system: be brief\nuser: 1+1?\nassistant: "
    assert CHAR.chat_text(messages) == text
    assert CHAR.apply_chat_template(messages) == [CHAR.bos_id] + CHAR.encode(text)


def _save_word_level_tokenizer(path, chat_template=None):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<pad>", "<s>", "</s>", "<unk>", "what", "is", "1", "2", "user:", "assistant:", "[u]", "[a]"]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = tokenizers.decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return path


def test_hf_tokenizer_from_local_directory(tmp_path):
    tok = load_tokenizer(str(_save_word_level_tokenizer(tmp_path / "plain")))
    assert isinstance(tok, HFTokenizer) and not tok.has_chat_template
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 12)
    assert tok.encode("what is 2") == [4, 5, 7]
    assert tok.encode_prompt("what is 2") == [1, 4, 5, 7]
    assert tok.decode([1, 4, 5, 7, 2]) == "what is 2"
    # No chat template: the plain "role: content" fallback.
    assert tok.chat_text([{"role": "user", "content": "what is 1"}]) == "user: what is 1\nassistant: "
    assert tok.apply_chat_template([{"role": "user", "content": "what is 1"}]) == [1, 8, 4, 5, 6, 9]

    template = "{% for m in messages %}[u] {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}[a]{% endif %}"
    tok = HFTokenizer(str(_save_word_level_tokenizer(tmp_path / "chat", template)))
    assert tok.has_chat_template
    assert tok.chat_text([{"role": "user", "content": "what is 1"}]) == "[u] what is 1 [a]"
    assert tok.apply_chat_template([{"role": "user", "content": "what is 1"}]) == [10, 4, 5, 6, 11]


# ---------------------------------------------------------------- load_prompts


def test_load_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "what is 1+1?", "answer": "2"},
        "",  # blank lines are skipped but still counted as lines
        {"prompt": "what is 2+2?", "answer": 4, "extra": [1, 2]},
        {"prompt": "no answer here"},
    ])
    ps = load_prompts(path, CHAR, max_prompt_tokens=64)
    assert isinstance(ps, PromptSet) and len(ps) == 3 and ps.num_dropped == 0
    assert ps.prompts == ["what is 1+1?", "what is 2+2?", "no answer here"]
    assert ps.answers == ["2", "4", None]
    assert ps.source_index == [1, 3, 4]
    assert ps.prompt_ids[0] == CHAR.encode_prompt("what is 1+1?")


def test_load_custom_keys(tmp_path):
    path = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q1", "solution": "x\n#### 3"}])
    ps = load_prompts(str(path), CHAR, 64, prompt_key="question", answer_key="solution")
    assert ps.prompts == ["q1"] and ps.answers == ["x\n#### 3"]


def test_chat_messages_with_fallback_template(tmp_path):
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2"}]
    records = [{"messages": messages, "answer": "3"}, {"prompt": "p", "messages": []}]
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    ps = load_prompts(path, CHAR, 64)
    assert ps.prompts[0] == "system: add\nuser: 1+2\nassistant: "
    assert ps.prompt_ids[0] == CHAR.apply_chat_template(messages)
    assert ps.prompts[1] == "p"  # prompt wins when both are present


def test_long_prompts_dropped_and_logged(tmp_path, caplog):
    records = [{"prompt": "x" * n} for n in (3, 10, 4, 20, 9)]  # + BOS: 4, 11, 5, 21, 10 tokens
    path = write_jsonl(tmp_path / "p.jsonl", records)
    with caplog.at_level(logging.INFO, logger="megatron_rl.data"):
        ps = load_prompts(path, CHAR, max_prompt_tokens=10)
    assert ps.num_dropped == 2 and ps.source_index == [1, 3, 5]
    assert all(len(ids) <= 10 for ids in ps.prompt_ids)
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_rl.data"]
    assert lines == ["dropped 2 of 5 prompts longer than 10 tokens"]
    with pytest.raises(DataError, match="all 5 prompts .* longer than"):
        load_prompts(path, CHAR, max_prompt_tokens=3)


@pytest.mark.parametrize("line,expected", [
    ('{"prompt": "ok"', "line 2 is not valid JSON"),
    ('["a list"]', "the record is a list, not an object"),
    ('{"question": "q"}', "neither 'prompt' nor 'messages'"),
    ('{"prompt": 42}', "'prompt' must be a string, got int"),
    ('{"prompt": "  "}', "'prompt' is empty"),
    ('{"messages": "hi"}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', "'messages'[0] is not a message"),
    ('{"prompt": "p", "answer": {"x": 1}}', "'answer' must be a string or a number"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n" + '{"prompt": "also fine"}\n')
    with pytest.raises(DataError) as info:
        load_prompts(path, CHAR, 64)
    msg = str(info.value)
    assert isinstance(info.value, UserInputError) and "\n" not in msg
    assert msg.startswith(f"data error: {path}:2:") and expected in msg and "fix:" in msg


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_prompts(tmp_path / "missing.jsonl", CHAR, 64)
    (tmp_path / "p.csv").write_text("prompt\n")
    with pytest.raises(DataError, match="unknown prompt file type"):
        load_prompts(tmp_path / "p.csv", CHAR, 64)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no records"):
        load_prompts(tmp_path / "empty.jsonl", CHAR, 64)
    with pytest.raises(DataError, match="max_prompt_tokens=0"):
        load_prompts(tmp_path / "empty.jsonl", CHAR, 0)


@needs_pyarrow
def test_load_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["what is 1+1?", "x" * 50, "what is 2+2?"], "answer": ["2", "0", None]}), path)
    ps = load_prompts(path, CHAR, max_prompt_tokens=20)
    assert ps.prompts == ["what is 1+1?", "what is 2+2?"] and ps.answers == ["2", None]
    assert ps.source_index == [0, 2] and ps.num_dropped == 1

    messages = [[{"role": "user", "content": "1+1"}], [{"role": "user", "content": "2+2"}]]
    pq.write_table(pa.table({"messages": messages, "answer": [2, 4]}), tmp_path / "chat.parquet")
    ps = load_prompts(tmp_path / "chat.parquet", CHAR, 64)
    assert ps.prompts[1] == "user: 2+2\nassistant: " and ps.answers == ["2", "4"]

    pq.write_table(pa.table({"prompt": ["ok", None], "messages": [None, None]}), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="bad.parquet row 1: the record has neither"):
        load_prompts(tmp_path / "bad.parquet", CHAR, 64)


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name == "pyarrow" or name.startswith("pyarrow."):
            raise ImportError("No module named 'pyarrow'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"pip install pyarrow .*megatron_rl\[parquet\]"):
        load_prompts(tmp_path / "p.parquet", CHAR, 64)


# ---------------------------------------------------------------- sampler


def draw(sampler, n):
    return [sampler.next_batch() for _ in range(n)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_sampler_exact_resume(shuffle):
    full = draw(PromptSampler(range(7), batch_size=3, seed=11, shuffle=shuffle), 5)
    first = PromptSampler(range(7), batch_size=3, seed=11, shuffle=shuffle)
    head = draw(first, 2)
    state = first.state_dict()
    resumed = PromptSampler(range(7), batch_size=3, seed=11, shuffle=shuffle)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # the state survives a JSON checkpoint
    assert head + draw(resumed, 3) == full


def test_sampler_epochs_and_boundary():
    sampler = PromptSampler(range(7), batch_size=3, seed=0)
    batches = draw(sampler, 7)  # 21 draws = exactly 3 epochs
    assert all(len(b) == 3 for b in batches)
    flat = [i for b in batches for i in b]
    epochs = [flat[0:7], flat[7:14], flat[14:21]]
    assert all(sorted(e) == list(range(7)) for e in epochs)  # each prompt once per epoch
    assert len({tuple(e) for e in epochs}) == 3  # reshuffled every epoch
    assert sampler.state_dict()["epoch"] == 3 and sampler.state_dict()["position"] == 0
    # Deterministic: the same seed draws the same, another seed draws differently.
    assert draw(PromptSampler(range(7), 3, seed=0), 7) == batches
    assert draw(PromptSampler(range(7), 3, seed=1), 7) != batches
    assert draw(PromptSampler(range(7), 3, seed=0, shuffle=False), 3) == [[0, 1, 2], [3, 4, 5], [6, 0, 1]]


def test_sampler_batch_larger_than_set():
    assert PromptSampler(range(2), batch_size=5, seed=0, shuffle=False).next_batch() == [0, 1, 0, 1, 0]


def test_sampler_state_mismatch():
    state = PromptSampler(range(7), 3, seed=11).state_dict()
    with pytest.raises(DataError, match="sampler.num_prompts=8"):
        PromptSampler(range(8), 3, seed=11).load_state_dict(state)
    with pytest.raises(DataError, match="sampler.seed=12"):
        PromptSampler(range(7), 3, seed=12).load_state_dict(state)
