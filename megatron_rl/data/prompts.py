"""Prompt data: load, tokenize and filter it once, then draw batches deterministically.

All checking happens at load time, before any rank starts generating: a malformed record stops
the run with its file and line, instead of failing an hour in.  Before launch,
:func:`check_prompt_file` parses every record the same way (:func:`parse_record`) and, given the
tokenizer, measures each prompt as training does (:func:`encoded_prompt`, :class:`PromptLengths`),
reading files up to :data:`FULL_CHECK_BYTES` whole and the first that many bytes of larger ones, so
``validate`` and the launcher stop a bad line, or a file with no prompt short enough, before any
rank starts.  Prompts longer than the prompt budget are dropped (not truncated, which would change
the question) and the count is logged.

:class:`PromptSampler` makes the data order a pure function of ``(seed, epoch, position)``, so a
run resumed from a checkpoint draws exactly the batches the uninterrupted run would have drawn.

Record keys may be dotted paths into nested objects, so verl's Parquet schema reads as it is:
``data.answer_key=reward_model.ground_truth`` is ``record["reward_model"]["ground_truth"]``.  A
literal top-level key that contains the dot wins over the path (it is what the file says).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Callable, Iterator, Optional

import torch

from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.errors import DataError

logger = logging.getLogger("megatron_rl.data")

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")

# The check before launch reads a JSON-lines file whole up to this size (1 GiB), and the lines
# starting in the first this many bytes of a larger one, saying so: parsing (and tokenizing) no more
# than the ranks will, it stays within the time they take to load the file.
FULL_CHECK_BYTES = 1 << 30


_MISSING = object()


# verl's Parquet schema keeps the reference answer here: read it when data.answer_key is left at its
# default and the records have only verl's, so a verl data file needs no key set.
DEFAULT_ANSWER_KEY, VERL_ANSWER_KEY = "answer", "reward_model.ground_truth"


@dataclasses.dataclass
class PromptSet:
    """Tokenized prompts.  ``source_index[i]``: file line (JSONL, 1-based) or row (Parquet, 0-based).

    ``fields[i]`` holds every column of the record (empty for built-in tasks): reward functions get
    the columns they name (TRL passes its dataset's columns, verl a record's ``data_source`` and
    ``extra_info``)."""

    prompt_ids: list[list[int]]
    prompts: list[str]
    answers: list[Optional[str]]
    source_index: list[int]
    num_dropped: int = 0
    path: str = ""
    fields: list[dict] = dataclasses.field(default_factory=list)
    answer_key: str = DEFAULT_ANSWER_KEY  # the key the answers were read with (:func:`answer_key_of`)
    # Per prompt, the policy turns of a multi-turn solution (built-in tool tasks); empty when none.
    demonstrations: list = dataclasses.field(default_factory=list)
    # Per prompt of a chat record: its messages before the demonstration (None for a text prompt),
    # and the demonstration (:func:`split_demonstration`; empty when none).
    chats: list = dataclasses.field(default_factory=list)
    chat_demonstrations: list = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def records(self, indices) -> list[dict]:
        """What the environments of the prompts at ``indices`` start from: text, answer, record fields,
        and a chat's ``messages`` (what an agent sends the endpoint)."""
        return [dict(fields, prompt=self.prompts[i], answer=self.answers[i], **self._chat(i))
                for i, fields in zip(indices, self.record_fields(indices))]

    def _chat(self, i: int) -> dict:
        chat = self.chats[i] if i < len(self.chats) else None
        return {} if chat is None else {"messages": [dict(m) for m in chat]}

    def record_fields(self, indices) -> list[dict]:
        """Every column of the records of the prompts at ``indices`` (``{}`` for a built-in task)."""
        return [self.fields[i] if i < len(self.fields) else {} for i in indices]


def lookup(record: dict, key: str):
    """``record[key]``, else the dotted path ``key`` into nested objects; ``_MISSING`` when neither exists."""
    if key in record:
        return record[key]
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def record_keys(record: dict, depth: int = 2) -> list[str]:
    """The record's keys, nested objects' keys as dotted paths (what ``data.*_key`` can name)."""
    out = []
    for key, value in record.items():
        if isinstance(value, dict) and value and depth > 1:
            out.extend(f"{key}.{sub}" for sub in record_keys(value, depth - 1))
        else:
            out.append(str(key))
    return sorted(out)


def _records_jsonl(path: str, key: str, max_bytes: Optional[int] = None) -> Iterator[tuple[int, str, object]]:
    """Every record, or (``max_bytes``) those of the lines that start within the first ``max_bytes``."""
    with open(path, "rb") as f:
        if f.read(4) == b"PAR1":
            raise DataError(key, path, "is a Parquet file with a JSON-lines name",
                            f"rename it to end in {PARQUET_SUFFIXES[0]}")
        f.seek(0)
        offset = 0
        for lineno, raw in enumerate(f, start=1):
            if max_bytes is not None and offset >= max_bytes:
                return
            offset += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{lineno}", None, f"line {lineno} is not UTF-8 (byte 0x{raw[err.start]:02x} "
                                f"at column {err.start + 1})", f"save {path} as UTF-8") from None
            if not line.strip():
                continue
            try:
                yield lineno, f"{path}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}", None, f"line {lineno} is not valid JSON ({err.msg} at column "
                                f"{err.colno})", f"fix or delete line {lineno} of {path}") from err


def _records_parquet(path: str) -> Iterator[tuple[int, str, object]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataError(path, None, "reading Parquet needs pyarrow, which is not installed",
                        "pip install pyarrow (or pip install 'megatron_rl[parquet]'), "
                        "or convert the file to JSONL") from err
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # noqa: BLE001 - pyarrow raises its own error types
        raise DataError(path, None, f"cannot read Parquet ({type(err).__name__}: {err})",
                        "check that the file is a complete Parquet file") from err
    for row, record in enumerate(rows):
        yield row, f"{path} row {row}", record


def _text(record: dict, key: str, where: str) -> str:
    value = lookup(record, key)
    if not isinstance(value, str):
        raise DataError(where, None, f"'{key}' must be a string, got {type(value).__name__} {str(value)[:60]!r}",
                        f"store the {key} as a string")
    if not value.strip():
        raise DataError(where, None, f"'{key}' is empty", "remove the record or give it a prompt")
    return value


def _messages(record: dict, key: str, where: str) -> list[dict]:
    value = lookup(record, key)
    fix = f"make '{key}' a list of {{\"role\": ..., \"content\": ...}} objects with string values"
    if not isinstance(value, list) or not value:
        raise DataError(where, None, f"'{key}' must be a non-empty list, got {type(value).__name__}", fix)
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(where, None, f"'{key}'[{i}] is not a message with string role and content: "
                            f"{str(message)[:60]!r}", fix)
    return [{"role": m["role"], "content": m["content"]} for m in value]


def split_demonstration(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """``(prompt, demonstration)`` of a chat: a chat that ends with an assistant message holds its
    solution from the first assistant message after the last user message on (the assistant's turns
    and the tool results between them); the prompt is what comes before.  Other chats are all prompt."""
    if not messages or messages[-1]["role"] != "assistant":
        return messages, []
    last_user = max((k for k, m in enumerate(messages) if m["role"] == "user"), default=-1)
    start = next(k for k in range(last_user + 1, len(messages)) if messages[k]["role"] == "assistant")
    if start == 0:
        return messages, []
    return messages[:start], messages[start:]


def _answer(record: dict, key: str, where: str) -> Optional[str]:
    value = lookup(record, key)
    if value is _MISSING:
        return None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(where, None, f"'{key}' must be a string or a number, got {type(value).__name__}",
                    f"store the {key} as a string, or leave it out")


def _records(path: str, key: str = "data.train_path",
             max_bytes: Optional[int] = None) -> Iterator[tuple[int, str, object]]:
    """``(source index, location, record)`` for every record of a JSONL or Parquet file (of a JSONL
    file, with ``max_bytes``, the lines that start within its first ``max_bytes``); errors about the
    file itself name ``key``, the config key that points at it."""
    if not os.path.isfile(path):
        raise DataError(key, path, "no such file", "check the prompt data path (or use task:<name>)")
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return _records_jsonl(path, key, max_bytes)
    if lower.endswith(PARQUET_SUFFIXES):
        return _records_parquet(path)
    raise DataError(key, path, "unknown prompt file type",
                    f"use JSON lines ({', '.join(JSONL_SUFFIXES)}) or Parquet ({', '.join(PARQUET_SUFFIXES)})")


def _prompt_of(record, where: str, prompt_key: str, messages_key: str):
    """``("text", str)`` or ``("messages", list)``; a :class:`DataError` naming the key to set otherwise."""
    if not isinstance(record, dict):
        raise DataError(where, None, f"the record is a {type(record).__name__}, not an object",
                        f"write one JSON object per line with a '{prompt_key}' or '{messages_key}' key")
    prompt = lookup(record, prompt_key)
    if isinstance(prompt, list):  # verl's schema: the prompt is a chat
        return "messages", _messages(record, prompt_key, where)
    if prompt is not None and prompt is not _MISSING:
        return "text", _text(record, prompt_key, where)
    messages = lookup(record, messages_key)
    if messages is not None and messages is not _MISSING:
        return "messages", _messages(record, messages_key, where)
    text_keys = [k for k, v in record.items() if isinstance(v, str) and v.strip()]
    hint = f"set data.prompt_key={text_keys[0]}" if text_keys else f"add a '{prompt_key}' string"
    raise DataError(where, None, f"the record has neither '{prompt_key}' nor '{messages_key}' "
                    f"(keys: {sorted(record)[:8]})",
                    f"{hint}, or give each record a '{prompt_key}' string or a '{messages_key}' list")


ANSWER_NAMES = ("ground_truth", "answer", "solution", "target", "label", "reference")


def answer_key_of(record, answer_key: str) -> str:
    """``answer_key``, or :data:`VERL_ANSWER_KEY` when ``answer_key`` is the default and ``record``
    has verl's instead (decided on the first record, used for all)."""
    if (answer_key == DEFAULT_ANSWER_KEY and isinstance(record, dict) and lookup(record, answer_key) is _MISSING
            and lookup(record, VERL_ANSWER_KEY) is not _MISSING):
        return VERL_ANSWER_KEY
    return answer_key


def _check_answer_present(record: dict, answer_key: str, where: str) -> None:
    """A reward that reads answers gets ``None`` for every one when the key is wrong: refuse it here."""
    if lookup(record, answer_key) is not _MISSING:
        return
    keys = record_keys(record)
    names = [k.rpartition(".")[2].lower() for k in keys]
    guesses = sorted((ANSWER_NAMES.index(n), k) for n, k in zip(names, keys) if n in ANSWER_NAMES)
    fix = (f"set data.answer_key={guesses[0][1]}" if guesses
           else "set data.answer_key to the key of the reference answer (a dotted path for a nested one)")
    raise DataError("data.answer_key", answer_key, f"is not a key of the first record ({where}; keys: {keys[:12]}), "
                    "so every answer would be None and the reward function reads answers",
                    f"{fix}, or use a reward function that needs no answers")


def parse_record(record, where: str, prompt_key: str, messages_key: str, answer_key: str):
    """``(kind, prompt, answer)`` of one record, as training reads it (:func:`_prompt_of`,
    :func:`_answer`); a :class:`DataError` naming ``where`` for a record that does not parse.  The
    one path both :func:`load_prompts` and :func:`check_prompt_file` take."""
    kind, prompt = _prompt_of(record, where, prompt_key, messages_key)
    return kind, prompt, _answer(record, answer_key, where)


def encoded_prompt(kind: str, prompt, tokenizer: Tokenizer) -> tuple[str, list[int]]:
    """The text and ids of a parsed prompt (:func:`parse_record`) as training sees them: a string
    encoded as a prompt (BOS included), a chat without the demonstration it ends with, rendered
    with the chat template.  The check before launch measures prompts with this too."""
    if kind == "text":
        return prompt, tokenizer.encode_prompt(prompt)
    chat = split_demonstration(prompt)[0]
    return tokenizer.chat_text(chat), tokenizer.apply_chat_template(chat)


@dataclasses.dataclass
class PromptLengths:
    """Prompt lengths against the prompt budget (``data.max_prompt_tokens``): the one rule by which
    training drops a prompt and stops when none is left, applied alike before launch, so
    ``validate`` says what training will do."""

    budget: int
    total: int = 0
    dropped: int = 0
    longest: int = 0
    shortest_dropped: int = 0

    def keeps(self, length: int) -> bool:
        """Count a prompt of ``length`` tokens; whether training keeps it."""
        self.total += 1
        self.longest = max(self.longest, length)
        if length <= self.budget:
            return True
        self.dropped += 1
        self.shortest_dropped = min(self.shortest_dropped or length, length)
        return False

    def refuse_when_none_fit(self, path: str) -> None:
        """Training has nothing to sample when every prompt is too long: one line with the lengths."""
        if self.total and self.dropped == self.total:
            raise DataError("data.max_prompt_tokens", self.budget,
                            f"all {self.total} prompts in {path} are longer than {self.budget} tokens (the longest "
                            f"has {self.longest}, the shortest {self.shortest_dropped})",
                            f"raise data.max_prompt_tokens to {self.shortest_dropped} or more ({self.longest} keeps "
                            "every prompt), or shorten the prompts")

    def dropped_line(self) -> str:
        """What training logs when it drops prompts."""
        return f"dropped {self.dropped} of {self.total} prompts longer than {self.budget} tokens"

    def training_note(self, key: str, path: str, first: bool = False) -> Optional[str]:
        """The line ``validate`` says when training will drop prompts (of the ``first`` records read);
        None when it drops none."""
        if not self.dropped:
            return None
        of = "the first " if first else ""
        return (f"{key}: training drops {self.dropped} of {of}{self.total} prompts in {path}: longer than "
                f"data.max_prompt_tokens={self.budget} (the longest has {self.longest} tokens)")


def check_prompt_file(path: str, prompt_key: str = "prompt", answer_key: str = "answer",
                      messages_key: str = "messages", key: str = "data.train_path",
                      needs_answers: bool = False, max_bytes: int = FULL_CHECK_BYTES,
                      note: Optional[Callable[[str], None]] = None, tokenizer: Optional[Tokenizer] = None,
                      max_prompt_tokens: Optional[int] = None) -> str:
    """Parse every record as :func:`load_prompts` will (:func:`parse_record`; no tokenizing), before
    any launch: a JSON-lines file whole up to ``max_bytes``, beyond that the lines that start within
    its first ``max_bytes``, and ``note`` gets one line saying so (Parquet files are read whole, as
    pyarrow reads them).  Errors name the file and line, or ``key`` for the file itself.  Returns the
    answer key the records are read with (:func:`answer_key_of`).

    With ``needs_answers`` (the reward function reads answers) the answer key must be in the first
    record.  With ``tokenizer`` the prompts are also measured against ``max_prompt_tokens`` as
    training measures them (:class:`PromptLengths`): refused when none fits (of a file read
    whole), ``note`` told how many training drops."""
    path = os.fspath(path)
    records = 0
    lengths = PromptLengths(max_prompt_tokens) if tokenizer is not None else None
    for _, where, record in _records(path, key, max_bytes):
        if records == 0:
            answer_key = answer_key_of(record, answer_key)
        kind, prompt, _ = parse_record(record, where, prompt_key, messages_key, answer_key)
        if needs_answers and records == 0:
            _check_answer_present(record, answer_key, where)
        if lengths is not None:
            lengths.keeps(len(encoded_prompt(kind, prompt, tokenizer)[1]))
        records += 1
    if records == 0:
        raise DataError(key, path, "the file holds no records", "give a prompt file with at least one record")
    size = os.path.getsize(path)
    partly = path.lower().endswith(JSONL_SUFFIXES) and size > max_bytes
    if lengths is not None and not partly:
        lengths.refuse_when_none_fit(path)
    if partly and note is not None:
        note(f"{key}: checked the first {_mb(_first_line_at(path, max_bytes))} ({records} records) of {path} "
             f"({_mb(size)} in all; files up to {_mb(max_bytes)} are checked whole); a bad line after them stops "
             "the run when the ranks load it")
    dropping = lengths.training_note(key, path, first=partly) if lengths is not None else None
    if dropping and note is not None:
        note(dropping)
    return answer_key


def servable_demonstration(demonstration: list[dict]) -> bool:
    """A demonstration the endpoint can serve: some assistant turns, each but the first after a message
    that is not one (a request's new messages come after the last reply)."""
    roles = [m["role"] for m in demonstration]
    return "assistant" in roles and not any(a == b == "assistant" for a, b in zip(roles, roles[1:]))


def first_without_demonstration(path: str, prompt_key: str = "prompt", messages_key: str = "messages",
                                key: str = "data.train_path", max_bytes: int = FULL_CHECK_BYTES) -> Optional[str]:
    """Where the first record (of a JSON-lines file, within its first ``max_bytes``) is not a chat
    ending in a servable demonstration (:func:`split_demonstration`); None when every one is."""
    for _, where, record in _records(os.fspath(path), key, max_bytes):
        kind, prompt = _prompt_of(record, where, prompt_key, messages_key)
        if kind != "messages" or not servable_demonstration(split_demonstration(prompt)[1]):
            return where
    return None


def first_missing_column(path: str, columns, key: str = "data.train_path",
                         max_bytes: int = FULL_CHECK_BYTES) -> Optional[tuple[str, str, list]]:
    """``(location, column, the record's columns)`` of the first record (of a JSON-lines file, within
    its first ``max_bytes``) that lacks one of ``columns``; None when every one has them all."""
    for _, where, record in _records(os.fspath(path), key, max_bytes):
        present = record if isinstance(record, dict) else {}
        for column in columns:
            if column not in present:
                return where, column, sorted(present)
    return None


def _first_line_at(path: str, offset: int) -> int:
    """Where the first line starting at or after byte ``offset`` (> 0) of ``path`` starts."""
    with open(path, "rb") as f:
        f.seek(offset - 1)
        f.readline()
        return f.tell()


def _mb(size: int) -> str:
    return f"{size / 2**30:.1f} GB" if size >= 2**30 else f"{size / 2**20:.1f} MB" if size >= 2**20 else f"{size} bytes"


def load_prompts(path: str, tokenizer: Tokenizer, max_prompt_tokens: int, prompt_key: str = "prompt",
                 answer_key: str = "answer", messages_key: str = "messages", key: str = "data.train_path") -> PromptSet:
    """Read a JSONL or Parquet prompt file, tokenize it, drop prompts over ``max_prompt_tokens``.

    A record has ``prompt_key`` (a string, encoded with ``tokenizer.encode_prompt``) or
    ``messages_key`` (a chat, rendered with the tokenizer's chat template; a demonstration it ends
    with is not part of the prompt, :func:`split_demonstration`); ``prompt_key`` wins
    when both are present, and a chat stored under ``prompt_key`` (verl's schema) is a chat.  Keys
    may be dotted paths (:func:`lookup`).  ``answer_key`` is optional (at its default, verl's
    ``reward_model.ground_truth`` is read where the records have that instead).  Raises
    :class:`DataError` on bad input; errors about the file itself name ``key``.
    """
    path = os.fspath(path)
    if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
        raise DataError("data.max_prompt_tokens", max_prompt_tokens, "must be a positive integer",
                        "set the prompt token budget to at least 1")
    records = _records(path, key)
    lengths = PromptLengths(max_prompt_tokens)

    out = PromptSet([], [], [], [], path=path)
    total = 0
    for index, where, record in records:
        if total == 0:
            answer_key = out.answer_key = answer_key_of(record, answer_key)
        kind, prompt, answer = parse_record(record, where, prompt_key, messages_key, answer_key)
        chat, demonstration = split_demonstration(prompt) if kind == "messages" else (None, [])
        text, ids = encoded_prompt(kind, prompt, tokenizer)
        total += 1
        if not lengths.keeps(len(ids)):
            out.num_dropped += 1
            continue
        out.prompt_ids.append(list(ids))
        out.prompts.append(text)
        out.answers.append(answer)
        out.source_index.append(index)
        out.fields.append(record)
        out.chats.append(chat)
        out.chat_demonstrations.append(demonstration)

    if out.num_dropped:
        logger.warning(lengths.dropped_line())
    if total == 0:
        raise DataError(key, path, "the file holds no records",
                        "give a prompt file with at least one record")
    lengths.refuse_when_none_fit(path)
    return out


class PromptSampler:
    """Deterministic, resumable batches of prompt indices (positions in the :class:`PromptSet`).

    Epoch ``e`` visits every prompt once, in the order ``torch.randperm(n)`` gives with seed
    ``seed + e`` (or in file order when ``shuffle=False``).  Batches are cut from the endless
    sequence epoch 0, epoch 1, ...: at an epoch boundary a batch takes the last prompts of epoch
    ``e`` and fills up with the first prompts of epoch ``e + 1``.  So every batch is full, no
    prompt is skipped, and each one is drawn exactly once per epoch (a batch larger than the
    prompt set necessarily repeats prompts).  The state is ``(epoch, position)`` in that sequence.
    """

    def __init__(self, prompt_set, batch_size: int, seed: int, shuffle: bool = True):
        self.num_prompts = len(prompt_set)
        if self.num_prompts < 1:
            raise ValueError("PromptSampler needs at least one prompt")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: Optional[list[int]] = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.num_prompts, generator=gen).tolist()
            else:
                self._order = list(range(self.num_prompts))
        return self._order

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` prompt indices."""
        batch: list[int] = []
        while len(batch) < self.batch_size:
            order = self._epoch_order()
            take = min(self.batch_size - len(batch), self.num_prompts - self.position)
            batch.extend(order[self.position:self.position + take])
            self.position += take
            if self.position == self.num_prompts:
                self.epoch, self.position, self._order = self.epoch + 1, 0, None
        return batch

    def state_dict(self) -> dict:
        """Everything needed to continue the same sequence of batches."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_prompts": self.num_prompts, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the prompt set, seed and shuffle flag must match the saved run."""
        for key in ("num_prompts", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(f"sampler.{key}", getattr(self, key),
                                f"differs from the checkpoint ({state[key]}), so resuming would draw other batches",
                                "resume with the same prompt data, seed and shuffle setting, or start a new run")
        if not 0 <= int(state["position"]) < self.num_prompts:
            raise DataError("sampler.position", state["position"], f"is outside 0..{self.num_prompts - 1}",
                            "resume with the prompt data the checkpoint was made with")
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
