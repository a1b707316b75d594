"""``megatron-rl score``: per-token log-probs and entropy of a Hugging Face model, on any layout.

    megatron-rl score --hf-model DIR --input IN.jsonl --output OUT.jsonl [--nproc N] [key=value ...]

Each input line is ``{"input_ids": [...]}`` or ``{"text": "..."}`` (tokenized with the model's
tokenizer); each output line, in the same order, is ``{"logprobs": [...], "entropy": [...]}``
with ``logprobs[t-1] = log p(input_ids[t] | input_ids[:t])`` for ``t = 1..n-1``.  The tool to
check a converted model against its source -- and what the parity tests use.
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch
import torch.distributed as dist

from megatron_rl.config.schema import Config
from megatron_rl.distributed.startup import start_model_parallel
from megatron_rl.engine.forward import batch_plan, run_sequences
from megatron_rl.errors import DataError
from megatron_rl.models.builder import build_gpt_chunks
from megatron_rl.models.heads import LogProbHead
from megatron_rl.models.hf_bridge import load_hf_weights
from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
from megatron_rl.resolve import Job, resolve


def read_score_input(path: str, hf_dir: str, vocab_size: int) -> list[list[int]]:
    if not os.path.isfile(path):
        raise DataError("--input", path, "file not found", "give a JSONL file with input_ids or text per line")
    tokenizer = None
    out = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}", None, f"not valid JSON ({err.msg})",
                                "write one JSON object per line") from None
            if "input_ids" in record:
                ids = record["input_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                    raise DataError(f"{path}:{lineno}", None, "'input_ids' must be a non-empty list of integers",
                                    "fix that line")
            elif isinstance(record.get("text"), str):
                if tokenizer is None:
                    from megatron_rl.data.tokenizer import load_tokenizer

                    tokenizer = load_tokenizer(hf_dir)
                ids = tokenizer.encode(record["text"])
            else:
                raise DataError(f"{path}:{lineno}", None, "needs 'input_ids' (list of ints) or 'text' (string)",
                                "fix that line")
            bad = [t for t in ids if t < 0 or t >= vocab_size]
            if bad:
                raise DataError(f"{path}:{lineno}", bad[0], f"token id outside the vocabulary (size {vocab_size})",
                                "fix that line")
            out.append(ids)
    if not out:
        raise DataError("--input", path, "no sequences", "add at least one line")
    return out


def run_score(cfg: Config, hf_dir: str, input_path: str, output_path: str, temperature: float = 1.0) -> int:
    if not cfg.model.hf_path:  # the architecture is the HF model's
        cfg = dataclasses.replace(cfg, model=model_config_from_hf(read_hf_config(hf_dir), cfg.model))
    sequences = read_score_input(input_path, hf_dir, cfg.model.vocab_size)
    resolution = resolve(cfg, dist.get_world_size(), Job(max_seq_len=max(map(len, sequences))))
    cfg = resolution.config
    model_cfg = cfg.model
    started = start_model_parallel(cfg)
    layout, device = started.layout, started.device
    chunks = build_gpt_chunks(model_cfg, layout, device)
    load_hf_weights(chunks, hf_dir)
    for chunk in chunks:
        chunk.eval()
    seqs = [{"tokens": torch.tensor(ids, dtype=torch.long)} for ids in sequences]
    plan = batch_plan(cfg.batch, layout, resolution.get("batch.token_budget").value)
    head = LogProbHead(temperature=temperature, chunk_size=cfg.batch.logprob_chunk_size)
    with torch.no_grad():
        outputs, _ = run_sequences(chunks, seqs, head, plan, device)
    if dist.get_rank() == 0:
        tmp = output_path + ".tmp"
        with open(tmp, "w") as fh:
            for ids, out in zip(sequences, outputs):
                n = len(ids) - 1
                fh.write(json.dumps({"logprobs": out["logprob"][:n].tolist(),
                                     "entropy": out["entropy"][:n].tolist()}) + "\n")
        os.replace(tmp, output_path)
        print(f"scored {len(sequences)} sequences ({sum(map(len, sequences))} tokens) -> {output_path}")
    return 0
