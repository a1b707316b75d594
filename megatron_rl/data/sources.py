"""``data.train_path`` -> prompts: a built-in task (``task:<name>``) or a JSONL/Parquet file.

The one place that tells the two apart, for the trainer (load everything) and for the check before
launch (read one record).
"""

from __future__ import annotations

from megatron_rl.config.schema import DataConfig
from megatron_rl.data.prompts import PromptSet, check_prompt_file, load_prompts
from megatron_rl.data.tasks import TASK_PREFIX, check_task, load_task
from megatron_rl.data.tokenizer import Tokenizer


def load_prompt_source(data: DataConfig, tokenizer: Tokenizer) -> PromptSet:
    if data.train_path.startswith(TASK_PREFIX):
        return load_task(data.train_path[len(TASK_PREFIX):], tokenizer, data.max_prompt_tokens)
    return load_prompts(data.train_path, tokenizer, data.max_prompt_tokens, data.prompt_key, data.answer_key,
                        data.messages_key)


def check_prompt_source(data: DataConfig, needs_answers: bool = False) -> None:
    """Raise a one-line error for a task that does not exist or a file whose first record is bad
    (with ``needs_answers``, also one without ``data.answer_key``)."""
    if data.train_path.startswith(TASK_PREFIX):
        check_task(data.train_path[len(TASK_PREFIX):])
    else:
        check_prompt_file(data.train_path, data.prompt_key, data.answer_key, data.messages_key, needs_answers)


def tokenizer_spec(data: DataConfig, hf_path: str | None) -> str:
    """``data.tokenizer``, else the model's HF directory, else the built-in character tokenizer."""
    return data.tokenizer or hf_path or "char"
