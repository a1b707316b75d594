"""The tokenizer interface the trainer sees, and its two implementations.

The trainer needs only a handful of operations (encode, decode, the chat prompt, eos/pad ids and
the vocabulary size), so it is written against :class:`Tokenizer` rather than against
``transformers``.  That keeps the CPU demo and the tests free of any model download:
:class:`CharTokenizer` is a fixed character-level vocabulary that fits a tiny model, while
:class:`HFTokenizer` wraps a tokenizer saved in a local Hugging Face model directory.

Prompts are encoded with :meth:`Tokenizer.encode_prompt` or :meth:`Tokenizer.apply_chat_template`,
which add what the model expects in front of a prompt (BOS); :meth:`Tokenizer.encode` adds
nothing, so it is safe for pieces of text such as responses.
"""

from __future__ import annotations

import json
import os
import string
from typing import Optional, Protocol, Sequence, runtime_checkable

from megatron_rl.errors import DataError

KEY = "data.tokenizer"

Messages = Sequence[dict]
Tools = Optional[Sequence[dict]]  # OpenAI's tool definitions, [{"type": "function", "function": {...}}]

# The files of a Hugging Face tokenizer, as transformers 4 and 5 write them: the chat template
# is ``chat_template.jinja`` (transformers 5) or a key of ``tokenizer_config.json`` (4).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                      "chat_template.json")
# Further chat templates by name (``apply_chat_template(chat_template="tool_use")``), transformers 5.
HF_TOKENIZER_DIRS = ("additional_chat_templates",)
# Any of these means the directory holds a tokenizer (the rest only add to one).
_TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")

DEFAULT_ALPHABET = string.digits + string.ascii_lowercase + " +-*/=#.,:?()\n"
GENERATION_PROMPT = "assistant: "
# The first line of the system turn the plain template renders tool definitions in (one JSON per line after it).
TOOLS_HEADER = 'tools, called one per reply as <tool_call>{"name": ..., "arguments": {...}}</tool_call>:'


@runtime_checkable
class Tokenizer(Protocol):
    eos_id: int
    pad_id: int
    bos_id: Optional[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def chat_text(self, messages: Messages, tools: Tools = None) -> str: ...

    def apply_chat_template(self, messages: Messages, tools: Tools = None) -> list[int]: ...


def plain_tools_turn(tools: Tools) -> str:
    """The system turn that shows the model its tools in the plain template ('' without tools), so a
    character vocabulary sees them as a Hugging Face template would."""
    if not tools:
        return ""
    return f"system: {TOOLS_HEADER}\n" + "".join(json.dumps(tool) + "\n" for tool in tools)


def plain_chat_text(messages: Messages, tools: Tools = None) -> str:
    """The fallback chat template: the tools' system turn, ``role: content`` lines, then ``assistant: ``."""
    return plain_tools_turn(tools) + "".join(f"{m['role']}: {m['content']}\n" for m in messages) + GENERATION_PROMPT


class CharTokenizer:
    """Deterministic character-level tokenizer: ``<pad>``=0, ``<eos>``=1, ``<bos>``=2, ``<unk>``=3.

    Characters of ``alphabet`` get ids 4, 5, ... in order; any other character encodes to
    ``<unk>``, and ids the vocabulary does not know decode as U+FFFD.  The default alphabet is
    lowercase-only, so uppercase text encodes to ``<unk>``: lowercase demo data first.
    """

    SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
    pad_id, eos_id, bos_id, unk_id = 0, 1, 2, 3
    UNKNOWN_CHAR = "\ufffd"

    def __init__(self, alphabet: str = DEFAULT_ALPHABET):
        if not alphabet:
            raise DataError(KEY, "char:", "the character alphabet is empty", "use 'char' or 'char:<characters>'")
        duplicates = sorted({c for c in alphabet if alphabet.count(c) > 1})
        if duplicates:
            raise DataError(KEY, f"char:{alphabet}", f"the alphabet repeats {duplicates}",
                            "list every character once")
        self.alphabet = alphabet
        self._ids = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}
        self._chars = {i: c for c, i in self._ids.items()}
        self.vocab_size = len(self.SPECIALS) + len(alphabet)

    def encode(self, text: str) -> list[int]:
        """One id per character, no special tokens."""
        return [self._ids.get(c, self.unk_id) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        """Characters for ``ids``; pad/eos/bos are skipped, ``<unk>`` and unknown ids become U+FFFD."""
        skip = (self.pad_id, self.eos_id, self.bos_id)
        return "".join(self._chars.get(int(i), self.UNKNOWN_CHAR) for i in ids if int(i) not in skip)

    def encode_prompt(self, text: str) -> list[int]:
        """``<bos>`` followed by the characters of ``text``."""
        return [self.bos_id] + self.encode(text)

    def chat_text(self, messages: Messages, tools: Tools = None) -> str:
        """The plain ``role: content`` rendering (a character vocabulary has no chat template)."""
        return plain_chat_text(messages, tools)

    def apply_chat_template(self, messages: Messages, tools: Tools = None) -> list[int]:
        """Prompt ids for a chat, generation prompt included."""
        return self.encode_prompt(self.chat_text(messages, tools))

    def tokens(self) -> list[str]:
        """Every token, in id order."""
        return list(self.SPECIALS) + list(self.alphabet)


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local model directory (never from the Hub)."""

    def __init__(self, path: str):
        if not os.path.isdir(path):
            raise DataError(KEY, path, "is not a directory", "give a local model directory containing tokenizer files")
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise DataError(KEY, path, f"transformers is not installed ({err})",
                            "pip install 'megatron_rl[hf]' or use data.tokenizer=char") from err
        try:
            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as err:  # noqa: BLE001 - transformers raises many types for bad directories
            raise DataError(KEY, path, f"cannot load a tokenizer ({type(err).__name__}: {err})",
                            "point it at a model directory with tokenizer.json or tokenizer_config.json") from err
        if self.tok.eos_token_id is None:
            raise DataError(KEY, path, "the tokenizer defines no eos token",
                            "set eos_token in tokenizer_config.json; generation needs it to stop")
        self.path = path
        self.eos_id = int(self.tok.eos_token_id)
        self.pad_id = int(self.tok.pad_token_id) if self.tok.pad_token_id is not None else self.eos_id
        self.bos_id = int(self.tok.bos_token_id) if self.tok.bos_token_id is not None else None
        self.vocab_size = len(self.tok)
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens removed."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a plain prompt, with the special tokens the tokenizer adds in front (BOS)."""
        return list(self.tok.encode(text, add_special_tokens=True))

    def chat_text(self, messages: Messages, tools: Tools = None) -> str:
        """The model's chat template with the generation prompt (``tools`` as transformers hands them
        to the template), or the plain fallback."""
        if not self.has_chat_template:
            return plain_chat_text(messages, tools)
        return self.tok.apply_chat_template(list(messages), tools=list(tools) if tools else None, tokenize=False,
                                            add_generation_prompt=True)

    def apply_chat_template(self, messages: Messages, tools: Tools = None) -> list[int]:
        """Prompt ids for a chat, generation prompt included."""
        if not self.has_chat_template:
            return self.encode_prompt(plain_chat_text(messages, tools))
        # The rendered template already holds BOS and every marker, so add nothing more.
        return self.encode(self.chat_text(messages, tools))

    def tokens(self) -> list[str]:
        """Every token, in id order."""
        return [str(t) for t in self.tok.convert_ids_to_tokens(list(range(len(self.tok))))]


def vocabulary_digest(tokenizer) -> dict:
    """The vocabulary's size and the sha256 of its tokens in id order: two tokenizers with the same
    digest map every id to the same token (what a teacher and its student must share)."""
    import hashlib

    tokens = tokenizer.tokens()
    return {"size": len(tokens), "sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()}


def has_tokenizer_files(path: str) -> bool:
    """Whether the directory ``path`` holds a Hugging Face tokenizer (a model saved without one does not)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_MARKERS)


def load_tokenizer(spec: str) -> Tokenizer:
    """``"char"``, ``"char:<alphabet>"`` or a local Hugging Face model directory."""
    if not isinstance(spec, str) or not spec:
        raise DataError(KEY, spec, "is empty", "use 'char', 'char:<alphabet>' or a local model directory")
    if spec == "char":
        return CharTokenizer()
    if spec.startswith("char:"):
        return CharTokenizer(spec[len("char:"):])
    if os.path.isdir(spec):
        return HFTokenizer(spec)
    raise DataError(KEY, spec, "is neither 'char', 'char:<alphabet>' nor an existing local directory",
                    "use 'char' for the built-in character tokenizer or the path of a downloaded model directory")
