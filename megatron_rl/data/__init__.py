"""Prompt data for PPO: tokenizers, prompt files and the resumable prompt sampler."""

from megatron_rl.data.prompts import PromptSampler, PromptSet, load_prompts
from megatron_rl.data.tokenizer import (
    DEFAULT_ALPHABET,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    plain_chat_text,
)

__all__ = [
    "PromptSampler", "PromptSet", "load_prompts",
    "DEFAULT_ALPHABET", "CharTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer", "plain_chat_text",
]
