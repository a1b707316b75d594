"""``megatron-rl generate``: completions for a JSONL of prompts, with the rollout engines.

    megatron-rl generate --hf-model DIR --input IN.jsonl --output OUT.jsonl [--nproc N] [key=value ...]
    megatron-rl generate --checkpoint CKPT --input IN.jsonl --output OUT.jsonl [--part actor] ...

Each input line is ``{"prompt_ids": [...]}`` (``input_ids`` is read too), ``{"prompt": "..."}``
(encoded as a prompt, BOS included) or ``{"messages": [...]}`` (the chat template).  Each output
line, for sample ``j`` of input line ``i`` (``rollout.n`` per prompt, in input order), is
``{"index": i, "sample": j, "prompt_ids", "response_ids", "text", "logprobs", "finish_reason"}``,
so an output file is also an input file (its prompts again, ``rollout.n`` times each):
``logprobs[t]`` is the log-prob of ``response_ids[t]`` under the temperature-scaled distribution,
the trainer's definition.  Sampling comes from the ``rollout.*`` keys (``rollout.engine``,
``temperature``, ``top_p``, ``top_k``, ``n``, ``max_new_tokens``, ``stop``), the seed from
``run.seed``; every EOS id of the tokenizer and of ``generation_config.json`` ends a response.
Rows of ids need no tokenizer: a model directory saved without tokenizer files generates from
them (``text`` is then null).  Generation is spread over the data- and context-parallel ranks of
the layout (``rollout/dp.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch.distributed as dist

from megatron_rl.config.schema import Config, ModelConfig
from megatron_rl.errors import CheckpointError, ConfigError, DataError

# The ids of a prompt: the name the output uses, then the name read before it.
PROMPT_ID_KEYS = ("prompt_ids", "input_ids")


def _prompt_ids(record: dict, where: str, tokenizer) -> list[int]:
    for key in PROMPT_ID_KEYS:
        if key in record:
            ids = record[key]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise DataError(where, None, f"'{key}' must be a non-empty list of integers", "fix that line")
            return ids
    text_key = next((k for k, kind in (("prompt", str), ("messages", list)) if isinstance(record.get(k), kind)), None)
    if text_key is None:
        raise DataError(where, None, "needs 'prompt_ids', 'prompt' or 'messages'", "fix that line")
    if tokenizer is None:
        raise DataError(where, None, f"'{text_key}' needs a tokenizer and the model directory holds none",
                        "give 'prompt_ids', or set data.tokenizer=<directory with the tokenizer files>")
    if text_key == "prompt":
        return tokenizer.encode_prompt(record["prompt"])
    return tokenizer.apply_chat_template(record["messages"])


def read_prompts(path: str, tokenizer, vocab_size: int, records: list | None = None,
                 lines: list | None = None) -> list[list[int]]:
    """Prompt ids, one per non-empty line of ``path``; ``tokenizer`` None reads rows of ids only.
    ``records`` (a list) receives each line's JSON object (what an environment starts from),
    ``lines`` each prompt's line number."""
    if not os.path.isfile(path):
        raise DataError("--input", path, "file not found",
                        "give a JSONL file with prompt_ids, prompt or messages per line")
    prompts = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(where, None, f"not valid JSON ({err.msg})", "write one JSON object per line") from None
            ids = _prompt_ids(record, where, tokenizer)
            bad = [t for t in ids if t < 0 or t >= vocab_size]
            if bad or not ids:
                raise DataError(where, bad[0] if bad else None,
                                f"token ids must be non-empty and inside the vocabulary (size {vocab_size})",
                                "fix that line")
            prompts.append(ids)
            if records is not None:
                records.append(record)
            if lines is not None:
                lines.append(lineno)
    if not prompts:
        raise DataError("--input", path, "no prompts", "add at least one line")
    return prompts


def load_generation_tokenizer(cfg: Config, source: str | None):
    """The tokenizer ``data.tokenizer`` names, else that of the model directory; None when the model
    directory holds no tokenizer files and none was named (rows of ids need none)."""
    from megatron_rl.data.sources import tokenizer_spec
    from megatron_rl.data.tokenizer import has_tokenizer_files, load_tokenizer

    spec = tokenizer_spec(cfg.data, source)
    if not cfg.data.tokenizer and source and os.path.isdir(source) and not has_tokenizer_files(source):
        if cfg.rollout.stop:
            raise ConfigError("rollout.stop", list(cfg.rollout.stop), f"stop strings need a tokenizer and {source} "
                              "holds none", "set data.tokenizer=<directory with the tokenizer files>, or drop them")
        return None
    return load_tokenizer(spec)


def _model_from_checkpoint(checkpoint: str, part: str, tokenizer: str | None = None):
    """The model settings, and the directory of the tokenizer and generation config the checkpoint
    carries (its own copies: a directory its ``meta.json`` names is never opened).  A checkpoint
    of an HF model saved before checkpoints carried them needs ``data.tokenizer`` (``tokenizer``)."""
    from megatron_rl.config.model_io import model_config_from_dict
    from megatron_rl.engine.checkpoint import check_checkpoint, companions_dir

    meta = check_checkpoint(checkpoint)
    if part not in meta.get("models", {}):
        raise CheckpointError("--part", part, f"the checkpoint holds {sorted(meta.get('models', {}))}",
                              "choose one of those parts")
    carried = companions_dir(checkpoint)
    recorded = meta.get("tokenizer") or meta.get("source")
    if carried is None and recorded and not tokenizer:
        raise CheckpointError("--checkpoint", checkpoint, "it carries no tokenizer files (saved before checkpoints "
                              f"carried them); the directory its meta.json names ({recorded}) is not opened",
                              f"pass data.tokenizer={recorded} if you trust that directory")
    return model_config_from_dict(meta["models"][part]), carried, carried


@dataclasses.dataclass
class GenerationInput:
    """What ``generate`` reads before it builds anything: the model it generates with, its
    tokenizer and the prompts.  Read once per process, before launch as on every rank, so
    validation and generation judge the same prompts."""

    model: ModelConfig
    model_dir: str | None
    tokenizer: object
    path: str
    prompts: list[list[int]]
    records: list[dict]
    lines: list[int]

    def job(self, cfg: Config):
        """The longest sequence and the prompt count for :func:`megatron_rl.resolve.resolve` and
        validation: the longest prompt read + rollout.max_new_tokens (with an environment or agent,
        at least the trajectory's token limit)."""
        from megatron_rl.resolve import Job, PromptsRead, trajectory_token_limit

        at = max(range(len(self.prompts)), key=lambda i: len(self.prompts[i]))
        longest = len(self.prompts[at]) + cfg.rollout.max_new_tokens
        if cfg.rollout.multi_turn:
            longest = max(longest, trajectory_token_limit(cfg))
        read = PromptsRead("--input", self.path, self.lines[at], len(self.prompts[at]))
        return Job(max_seq_len=longest, prompts=len(self.prompts), prompts_read=read)


def read_generation_input(cfg: Config, input_path: str, hf_dir: str | None = None, checkpoint: str | None = None,
                          part: str = "actor") -> GenerationInput:
    """The model (the checkpoint's, else ``cfg.model``), its tokenizer and the prompts of ``input_path``."""
    model_cfg, model_dir, tokenizer_dir = cfg.model, hf_dir, hf_dir
    if checkpoint:
        model_cfg, model_dir, tokenizer_dir = _model_from_checkpoint(checkpoint, part, cfg.data.tokenizer)
    tokenizer = load_generation_tokenizer(cfg, tokenizer_dir)
    if cfg.rollout.multi_turn and tokenizer is None:
        raise DataError("rollout.env", cfg.rollout.env or cfg.rollout.agent,
                        "multi-turn generation needs a tokenizer and the model directory holds none",
                        "set data.tokenizer")
    records: list = []
    lines: list = []
    prompts = read_prompts(input_path, tokenizer, model_cfg.vocab_size, records, lines)
    return GenerationInput(model_cfg, model_dir, tokenizer, input_path, prompts, records, lines)


def run_generate(cfg: Config, input_path: str, output_path: str, hf_dir: str | None = None,
                 checkpoint: str | None = None, part: str = "actor", source: GenerationInput | None = None) -> int:
    """``source``: the input as validation read it (None: read it here)."""
    from megatron_rl.distributed.startup import start_model_parallel
    from megatron_rl.envs.build import with_environment
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.resolve import resolve
    from megatron_rl.rollout.build import make_rollout_engine
    from megatron_rl.rollout.dp import generate_data_parallel
    from megatron_rl.rollout.sampling import SamplingParams, eos_token_ids

    source = source or read_generation_input(cfg, input_path, hf_dir, checkpoint, part)
    model_cfg, model_dir, tokenizer = source.model, source.model_dir, source.tokenizer
    prompts, records = source.prompts, source.records
    # The rollout batch and engine for these prompts and this model (every sample of a rank's
    # share in one pass, within the KV budget, unless rollout.max_batch_size says otherwise); with
    # an environment or agent, trajectories up to their token limit.
    resolution = resolve(dataclasses.replace(cfg, model=model_cfg), dist.get_world_size(), source.job(cfg))
    started = start_model_parallel(cfg)
    layout, device = started.layout, started.device
    chunks = build_gpt_chunks(model_cfg, layout, device)
    if checkpoint:
        from megatron_rl.engine.checkpoint import ModelPart, load_checkpoint

        load_checkpoint(checkpoint, {part: ModelPart(chunks)}, with_optimizer=False, load_rng=False)
    else:
        from megatron_rl.models.hf_bridge import load_hf_weights

        load_hf_weights(chunks, hf_dir)
    rollout = resolution.config.rollout
    engine = with_environment(resolution.config, make_rollout_engine(rollout, model_cfg, device), tokenizer)
    engine.load_from_chunks(chunks)
    params = SamplingParams(
        temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens, n=rollout.n, stop_token_ids=eos_token_ids(tokenizer, model_dir),
        stop_sequences=tuple(tuple(tokenizer.encode(s)) for s in rollout.stop) if tokenizer is not None else (),
    )
    batch = generate_data_parallel(engine, prompts, params, seed=cfg.run.seed,
                                   records=records if rollout.multi_turn else None)
    if dist.get_rank() == 0:
        tmp = output_path + ".tmp"
        with open(tmp, "w") as fh:
            for k in range(len(batch)):
                fh.write(json.dumps({
                    "index": batch.prompt_index[k], "sample": k % params.n, "prompt_ids": batch.prompt_ids[k],
                    "response_ids": batch.response_ids[k],
                    "text": tokenizer.decode(batch.response_ids[k]) if tokenizer is not None else None,
                    "logprobs": batch.response_logprobs[k], "finish_reason": batch.finish_reason[k],
                    **_trajectory_fields(batch, k),
                }) + "\n")
        os.replace(tmp, output_path)
        print(f"generated {len(batch)} samples for {len(prompts)} prompts -> {output_path}", flush=True)
    return 0


def _trajectory_fields(batch, k: int) -> dict:
    """A multi-turn sample's mask (1 on the policy's tokens) and what its environment reported."""
    if batch.response_mask is None:
        return {}
    info = batch.env_info[k]
    return {"response_mask": batch.response_mask[k], "turns": info["turns"], "limit": info["limit"],
            "env_reward": info["env_reward"]}
