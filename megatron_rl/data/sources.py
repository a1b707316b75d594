"""``data.train_path`` / ``data.val_path`` -> prompts: a built-in task (``task:<name>``) or a
JSONL/Parquet file.

The one place that tells the two apart, for the trainer (load everything) and for the check before
launch (parse every record, up to a size).  ``key`` names the config key the path came from, for the errors.
"""

from __future__ import annotations

from typing import Callable, Optional

from megatron_rl.config.schema import DataConfig
from megatron_rl.data.prompts import FULL_CHECK_BYTES, PromptLengths, PromptSet, check_prompt_file, load_prompts
from megatron_rl.data.tasks import TASK_PREFIX, check_task, load_task
from megatron_rl.data.tokenizer import Tokenizer

TRAIN_KEY, VAL_KEY = "data.train_path", "data.val_path"


def load_prompt_source(data: DataConfig, tokenizer: Tokenizer, key: str = TRAIN_KEY) -> PromptSet:
    path = _path(data, key)
    if path.startswith(TASK_PREFIX):
        return load_task(path[len(TASK_PREFIX):], tokenizer, data.max_prompt_tokens, key)
    return load_prompts(path, tokenizer, data.max_prompt_tokens, data.prompt_key, data.answer_key,
                        data.messages_key, key)


def check_prompt_source(data: DataConfig, key: str = TRAIN_KEY, needs_answers: bool = False,
                        max_bytes: int = FULL_CHECK_BYTES, note: Optional[Callable[[str], None]] = None,
                        tokenizer: Optional[Tokenizer] = None) -> str:
    """Raise a one-line error for a task that does not exist or a file with a record that does not
    parse (of a file over ``max_bytes``, within its first ``max_bytes``, said to ``note``; with
    ``needs_answers``, also a first record without ``data.answer_key``); with ``tokenizer``, also
    when no prompt fits ``data.max_prompt_tokens``, and ``note`` hears how many training drops.
    Returns the answer key the records are read with."""
    path = _path(data, key)
    if path.startswith(TASK_PREFIX):
        check_task(path[len(TASK_PREFIX):], key)
        if tokenizer is not None:
            _check_task_lengths(path, data.max_prompt_tokens, tokenizer, key, note)
        return data.answer_key
    return check_prompt_file(path, data.prompt_key, data.answer_key, data.messages_key, key, needs_answers,
                             max_bytes, note, tokenizer, data.max_prompt_tokens)


def _check_task_lengths(path: str, max_prompt_tokens: int, tokenizer: Tokenizer, key: str,
                        note: Optional[Callable[[str], None]]) -> None:
    """A built-in task measured as training loads it (it is small): refused when no prompt fits."""
    lengths = PromptLengths(max_prompt_tokens)
    load_task(path[len(TASK_PREFIX):], tokenizer, max_prompt_tokens, key, lengths)
    dropping = lengths.training_note(key, path)
    if dropping and note is not None:
        note(dropping)


def _path(data: DataConfig, key: str) -> Optional[str]:
    return data.val_path if key == VAL_KEY else data.train_path


def tokenizer_spec(data: DataConfig, hf_path: str | None) -> str:
    """``data.tokenizer``, else the model's HF directory, else the built-in character tokenizer."""
    return data.tokenizer or hf_path or "char"
