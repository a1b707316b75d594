"""The workload ``benchmarks/vs_trl.py`` gives to megatron_rl and to TRL's ``GRPOTrainer``.

Everything both trainers read is built here, once, into one directory:

* ``model/`` -- a tiny random-init Qwen2 (``save_pretrained``) with a character-level
  ``PreTrainedTokenizerFast`` saved beside it (no BOS, ``<eos>`` ends a response);
* ``prompts.jsonl`` -- ``{"prompt": "12+7=", "answer": "19"}`` addition problems.

:func:`addition_reward` is the reward both trainers call: megatron_rl as
``reward.fn=trl_workload:addition_reward`` (this directory on ``PYTHONPATH``), TRL through
:func:`trl_addition_reward`, which only renames TRL's arguments.  It imports nothing heavy, so the
rank processes import it cheaply.
"""

from __future__ import annotations

import json
import os
import random

# Ids 0-2 are the special tokens; every character a prompt or an answer can hold follows.
SPECIALS = ("<pad>", "<eos>", "<unk>")
CHARS = "0123456789+="
MAX_OPERAND = 49  # answers of at most 2 digits: an answer and its <eos> fit in 4 new tokens

# 1024 positions: room for megatron_rl's default data.max_prompt_tokens (512) plus the new tokens,
# which validation checks against the model's positions (RoPE itself does not depend on it).
MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


def addition_reward(prompts, responses, answers, **kwargs) -> list[float]:
    """1 for the exact answer, else half the share of digits in the response (0 when empty).

    The partial credit gives a random-init model a signal from the first step (it learns to write
    digits within a few steps); the exact-answer term is what rises slowly after that.
    """
    out = []
    for response, answer in zip(responses, answers):
        text = response.strip()
        if text == str(answer):
            out.append(1.0)
        else:
            out.append(0.5 * sum(c.isdigit() for c in text) / len(text) if text else 0.0)
    return out


def trl_addition_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """:func:`addition_reward` with TRL's argument names (dataset columns arrive as keyword lists)."""
    return addition_reward(prompts, completions, answer)


def make_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def make_tokenizer():
    """A character-level fast tokenizer: one token per character, no BOS, ``<eos>`` / ``<pad>``."""
    import tokenizers
    import transformers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + tuple(CHARS))}
    # A BPE without merges splits text into single characters; Fuse joins them back on decode.
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def build_workload(root: str, num_prompts: int = 512, seed: int = 0) -> dict:
    """Write ``model/`` and ``prompts.jsonl`` under ``root``; returns their paths and sizes."""
    import torch
    import transformers

    model_dir = os.path.join(root, "model")
    os.makedirs(model_dir, exist_ok=True)
    tokenizer = make_tokenizer()
    tokenizer.save_pretrained(model_dir)
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=False, rope_theta=10000.0,
                                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                      bos_token_id=None, torch_dtype="float32", **MODEL)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(model_dir)
    prompts_path = os.path.join(root, "prompts.jsonl")
    with open(prompts_path, "w") as fh:
        for row in make_prompts(num_prompts, seed):
            fh.write(json.dumps(row) + "\n")
    params = sum(p.numel() for p in model.parameters())
    return {"model_dir": model_dir, "prompts": prompts_path, "num_prompts": num_prompts, "params": params,
            "vocab_size": len(tokenizer)}
