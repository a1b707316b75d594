"""Fixtures shared by several test modules: the tiny PPO run, its reward, and tiny HF checkpoints.

Kept out of the ``test_*`` modules so that importing one never collects or runs another, and so
that ``reward.fn`` names a plugin module rather than a test module.  Importing this module is
cheap (torch and transformers are imported by the functions that need them): ``test_slurm.py``
reads ``TINY`` at collection time.
"""

from __future__ import annotations

import json
import os

# A PPO run small enough for a few steps on CPU in seconds; tests append layout and run overrides.
TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.vocab_size=64", "model.max_position_embeddings=64",
    "data.train_path=task:add_small", "data.tokenizer=char", "data.max_prompt_tokens=16",
    "reward.fn=tests._helpers:digit_share", "rollout.n=2", "rollout.max_new_tokens=3",
    "trainer.prompts_per_step=4", "trainer.plot=false", "actor.optim.lr=0.003", "critic.optim.lr=0.003",
    "batch.micro_batch_size=2", "algorithm.kl_coef=0.05", "algorithm.mini_batches=2",
]


def digit_share(prompts, responses, answers, **kwargs) -> list[float]:
    """Share of digits in the response: a tiny random model scores 0.1-0.2 from the first step, so
    every metric moves (an exact-answer reward would stay 0 and leave nothing to compare)."""
    return [sum(ch.isdigit() for ch in r) / max(len(r), 1) for r in responses]


def train_body(config, overrides: list[str]):
    """Harness body: validate and run PPO from ``config`` (a YAML path or None) and ``overrides``."""
    import torch.distributed as dist

    from megatron_rl.config.loader import load_config
    from megatron_rl.config.validate import validate
    from megatron_rl.trainer.ppo import run_ppo

    cfg = load_config(config, overrides)
    validate(cfg, dist.get_world_size())
    run_ppo(cfg, log=lambda line: None)
    return True


def ppo_body(overrides: list[str]):
    """Harness body: the :data:`TINY` PPO run with ``overrides`` appended."""
    return train_body(None, TINY + overrides)


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


# ----------------------------------------------------------------------------- batch-cut invariance

# (prompt, response) lengths of the fixed batch the "gradients do not depend on how the batch is
# cut" tests train on: odd lengths, a one-token response, more sequences than micro-batches.
CUT_BATCH_LENGTHS = ((5, 3), (3, 9), (7, 1), (4, 6), (2, 11), (6, 4), (3, 2), (8, 5))


def small_actor(layout_kw: dict, weights):
    """``(trainable, canonical weights)`` of a tiny actor on ``layout_kw``; ``weights`` None = its own."""
    import torch

    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical, load_canonical
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(**layout_kw)
    model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64)
    chunks = build_gpt_chunks(model, layout, torch.device("cpu"))
    if weights is None:
        weights = gather_canonical(chunks)
    else:
        load_canonical(chunks, weights)
    return make_trainable(chunks, OptimConfig(), 1), weights


def response_mask(n_prompt: int, n_resp: int):
    """1 at the positions that predict the response tokens (position t predicts token t+1)."""
    import torch

    mask = torch.zeros(n_prompt + n_resp)
    mask[n_prompt - 1 : n_prompt + n_resp - 1] = 1.0
    return mask


# ----------------------------------------------------------------------------- tiny HF checkpoints

COMMON = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
ARCHS = {
    "llama": dict(rope_theta=10000.0),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(head_dim=32, rope_theta=1e6),
    "mistral": dict(sliding_window=None),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                        max_position_embeddings=16384),
}


def make_hf_model(kind: str, path: str, seed: int = 0):
    """A random tiny HF model of ``kind`` (a key of ``ARCHS``), saved to ``path``; returns it."""
    import torch
    import transformers

    classes = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "llama3_rope": "Llama"}
    name = classes[kind]
    config_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(seed)
    kwargs = dict(COMMON)
    kwargs.update(ARCHS[kind])
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.1)  # non-trivial norms catch a missing or misplaced norm
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return model


def hf_logprobs(model, ids: list[int]):
    """HF's log-prob of each token after the first, in fp32."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def score_body(hf_dir: str, overrides: list[str], output: str):
    """Worker body: ``megatron-rl score`` of ``hf_dir/in.jsonl`` into ``output`` on this layout."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.tools.score import run_score

    cfg = load_config(None, overrides)
    cfg.model = model_config_from_hf(read_hf_config(hf_dir), cfg.model)
    cfg.model.hf_path = hf_dir
    run_score(cfg, hf_dir, os.path.join(hf_dir, "in.jsonl"), output)


def read_scores(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def check_scores(path: str, reference: list) -> float:
    """Largest |log-prob - reference| over the scored file; checks the row and token counts."""
    import torch

    rows = read_scores(path)
    assert len(rows) == len(reference)
    worst = 0.0
    for row, ref in zip(rows, reference):
        assert len(row["logprobs"]) == len(ref) == len(row["entropy"])
        if len(ref):
            worst = max(worst, float((torch.tensor(row["logprobs"]) - ref).abs().max()))
    return worst
