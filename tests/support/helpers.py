"""Fixtures shared by several test modules: the tiny PPO run, its reward, and tiny HF checkpoints.

Kept out of the ``test_*`` modules so that importing one never collects or runs another, and so
that ``reward.fn`` names a plugin module rather than a test module.  Importing this module is
cheap (torch and transformers are imported by the functions that need them): ``test_slurm.py``
reads ``TINY`` at collection time.
"""

from __future__ import annotations

import json
import os

# The layout parity tests' model, batch, body and comparisons (``megatron-rl check-layouts`` runs them too).
from megatron_rl.testing.layout_parity import (  # noqa: F401
    CP_LENGTHS,
    CP_MODEL,
    CP_STEP_OPTIM,
    CP_TOL,
    ActorCriticHead,
    actor_critic_step,
    build_with_value_head,
    make_sequences,
    max_diff_outputs,
    max_diff_tensors,
)

# A PPO run small enough for a few steps on CPU in seconds; tests append layout and run overrides.
TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
    "model.num_query_groups=2", "model.vocab_size=64", "model.max_position_embeddings=64",
    "data.train_path=task:add_small", "data.tokenizer=char", "data.max_prompt_tokens=16",
    "reward.fn=tests.support.helpers:digit_share", "rollout.n=2", "rollout.max_new_tokens=3",
    "trainer.prompts_per_step=4", "trainer.plot=false", "actor.optim.lr=0.003", "critic.optim.lr=0.003",
    "batch.micro_batch_size=2", "algorithm.kl_coef=0.05", "algorithm.mini_batches=2",
]


def digit_share(prompts, responses, answers, **kwargs) -> list[float]:
    """Share of digits in the response: a tiny random model scores 0.1-0.2 from the first step, so
    every metric moves (an exact-answer reward would stay 0 and leave nothing to compare)."""
    return [sum(ch.isdigit() for ch in r) / max(len(r), 1) for r in responses]


def answer_digits_in_place(prompts, responses, answers, **kwargs) -> list[float]:
    """Share of the answer's characters the response has in the same places: partial credit a tiny
    model earns long before its answers are exact, so GRPO has groups with different rewards."""
    return [sum(a == b for a, b in zip(r.strip(), ans)) / len(ans) if ans else 0.0
            for r, ans in zip(responses, answers)]


def never_returns(prompts, responses, answers, **kwargs) -> list[float]:
    """A plain batch reward stuck in a blocking call (no Python code runs that could be interrupted)."""
    import time

    time.sleep(10**6)
    return [0.0] * len(responses)


def train_body(config, overrides: list[str]):
    """Harness body: validate and run PPO from ``config`` (a YAML path or None) and ``overrides``."""
    import torch.distributed as dist

    from megatron_rl.config.loader import load_config
    from megatron_rl.trainer.ppo import run_ppo
    from megatron_rl.validation import validate

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
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
ARCHS = {
    "llama": dict(rope_theta=10000.0),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(head_dim=32, rope_theta=1e6),
    "mistral": dict(sliding_window=None),
    "llama3_rope": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                        max_position_embeddings=16384),
    # YaRN as Qwen2.5 uses it past its native window, scaled down: pretrained on 16 positions, run
    # on up to 64 (the longest scored sequence).
    "qwen2_yarn": dict(tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=64,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
}
# Models whose queries and keys get large weights, so attention is peaked and a wrong RoPE
# frequency or attention factor moves the log-probs far past the tolerance.
SHARP_ATTENTION = {"qwen2_yarn"}


def make_hf_model(kind: str, path: str, seed: int = 0):
    """A random tiny HF model of ``kind`` (a key of ``ARCHS``), saved to ``path``; returns it."""
    import torch
    import transformers

    classes = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "llama3_rope": "Llama",
               "qwen2_yarn": "Qwen2"}
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
            elif kind in SHARP_ATTENTION and pname.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.25)
    model.save_pretrained(path)
    return model


def hf_logprobs_in_a_fresh_process(hf_dir: str, sequences: list[list[int]]) -> list:
    """HF transformers' log-probs (:func:`hf_logprobs`) of the model saved in ``hf_dir``, loaded
    with ``from_pretrained`` in a process of its own: late in a long test process the same load
    once gave NaN log-probs (a YaRN model 0.3 off) that a fresh process never gives."""
    import subprocess
    import sys

    import torch

    code = ("import json, sys, torch, transformers\n"
            "from tests.support.helpers import hf_logprobs\n"
            "model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
            "print(json.dumps([hf_logprobs(model, ids).tolist() for ids in json.loads(sys.argv[2])]))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code, hf_dir, json.dumps(sequences)], cwd=root,
                          capture_output=True, text=True, timeout=300, check=True)
    return [torch.tensor(row) for row in json.loads(proc.stdout.strip().splitlines()[-1])]


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


def roundtrip_body(hf_dir: str, out_dir: str, layout_kw: dict):
    """Harness body: HF -> megatron on ``layout_kw`` -> HF into ``out_dir``; the bytes each rank read."""
    import torch
    import torch.distributed as dist

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.hf_bridge import export_hf, load_hf_weights
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(**layout_kw)
    hf = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf, ModelConfig())
    chunks = build_gpt_chunks(cfg, layout, torch.device("cpu"))
    read = load_hf_weights(chunks, hf_dir)
    export_hf(chunks, out_dir, hf, cfg, source_dir=hf_dir)
    dist.barrier()
    return read


def read_scores(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh]


def scored_gap(world: int, hf_dir: str, overrides: list[str], reference: list, tmp_path) -> float:
    """``megatron-rl score`` of ``hf_dir/in.jsonl`` on ``world`` ranks with ``overrides``: the largest
    |log-prob - reference| (:func:`check_scores`)."""
    from megatron_rl.testing.harness import run_distributed

    out = str(tmp_path / "out.jsonl")
    run_distributed(world, score_body, hf_dir, overrides, out)
    return check_scores(out, reference)


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


# ----------------------------------------------------------------------------- CP layout parity

# The model, batch, body and comparisons of the layout parity tests: megatron_rl/testing/layout_parity.py
# (imported above), which ``megatron-rl check-layouts`` runs too.

_CP_REFERENCES: dict = {}


def cp_reference(lengths=CP_LENGTHS, model_kw: dict | None = None, optim_kw: dict | None = None,
                 do_step: bool = False) -> dict:
    """The CP=1 one-process run of :func:`actor_critic_step` on whole sequences (cached)."""
    from megatron_rl.testing.harness import run_distributed

    key = repr((tuple(lengths), sorted((model_kw or {}).items()), sorted((optim_kw or {}).items()), do_step))
    if key not in _CP_REFERENCES:
        _CP_REFERENCES[key] = run_distributed(1, actor_critic_step, {}, None, tuple(lengths),
                                              dict(micro_batch_size=3), False, model_kw, optim_kw, do_step)[0]
    return _CP_REFERENCES[key]


def check_against_reference(world, layout_kw, plan_kw, lengths=CP_LENGTHS, model_kw=None, optim_kw=None,
                            do_step=False, compare_grads=True):
    """Run :func:`actor_critic_step` on ``world`` ranks and compare with :func:`cp_reference`.

    Per-token log-probs, entropy and values, and every parameter gradient (or, with
    ``compare_grads=False``, only the parameters after the step) within :data:`CP_TOL`."""
    from megatron_rl.testing.harness import run_distributed

    ref = cp_reference(lengths, model_kw, optim_kw, do_step)
    got = run_distributed(world, actor_critic_step, layout_kw, ref["weights"], tuple(lengths), plan_kw, False,
                          model_kw, optim_kw, do_step)
    rank0 = got[0]
    outs = max_diff_outputs(rank0["outs"], ref["outs"])
    grad = max_diff_tensors(rank0["grads"], ref["grads"]) if compare_grads else 0.0
    line = f"{layout_kw} {plan_kw}: max|d| {outs} grads {grad:.2e}"
    if do_step:
        param = max_diff_tensors(rank0["params"], ref["params"])
        line += f" params after the step {param:.2e}"
        assert param <= CP_TOL, param
        assert max_diff_tensors(ref["params"], ref["weights"]) > 1e-3  # the step moved the weights
    print(line)
    assert all(v <= CP_TOL for v in outs.values()), outs
    assert grad <= CP_TOL, grad
    # The comparison means something: gradients reach every parameter.
    assert all(float(g.abs().max()) > 0 for g in ref["grads"].values())
    rank0["per_rank_tokens"] = [rank0["local_tokens"]] + got[1:]
    return rank0


def spec_logits_body(impl: str, weights, moe: dict | None = None):
    """Harness body (CUDA): logits of a small model built with the ``impl`` layer spec -- with routed
    experts when ``moe`` (MoEConfig fields) is given -- on ``weights`` (canonical), or on its own
    init when ``weights`` is None; returns ``(weights, logits)`` so a second spec can reuse them."""
    import torch

    from megatron_rl.config.schema import ModelConfig, MoEConfig
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical, load_canonical
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout()
    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2,
                      vocab_size=256, transformer_impl=impl, params_dtype="float32",
                      moe=MoEConfig(**moe) if moe else MoEConfig())
    device = torch.device("cuda")
    chunk = build_gpt_chunks(cfg, layout, device)[0]
    if weights is None:
        weights = gather_canonical([chunk])
    else:
        load_canonical([chunk], weights)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(64, device=device).expand(2, 64)
    hidden = chunk(tokens, positions, None)
    return weights, (hidden.float() @ chunk.output_weight().float().t()).cpu()


def started_or_skipped(resource, start, stop, unavailable: type[Exception], what: str):
    """A fixture's body for a machine resource (a local Slurm, network namespaces): ``start()`` it --
    the tests skip with the reason where this machine cannot -- yield ``resource``, ``stop()`` it."""
    import pytest

    try:
        start()
    except unavailable as err:
        pytest.skip(f"{what}: {err}")
    try:
        yield resource
    finally:
        stop()


def venv_dir() -> str:
    """The virtual environment the tests run in (the sbatch script's VENV): the stack the jobs must use."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return sys.prefix if sys.prefix != sys.base_prefix else os.path.join(root, ".venv")


def read_or_reason(path) -> str:
    """A log's text for an assertion message, or why it could not be read."""
    try:
        with open(path, errors="replace") as fh:
            return fh.read()
    except OSError as err:
        return f"<{err}>"
