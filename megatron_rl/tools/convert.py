"""``megatron-rl convert``: Hugging Face <-> megatron_rl checkpoints.

    megatron-rl convert --hf-model DIR --out CKPT_ROOT [--nproc N] [parallel.tp=...]
    megatron-rl convert --checkpoint CKPT_DIR --hf-out DIR [--part actor|critic] [--nproc N]

HF -> Megatron writes ``CKPT_ROOT/step_00000000`` (a model-only checkpoint that loads into any
layout).  Megatron -> HF reads a model out of any checkpoint (a converted one or a PPO training
checkpoint) and writes HF names, shapes, dtypes and config; a critic is written with its value
head as ``score`` (``*ForTokenClassification``, one label) and without the LM head.
"""

from __future__ import annotations

import copy
import dataclasses
import os

import torch.distributed as dist

from megatron_rl.config.model_io import model_config_from_dict, model_config_to_dict
from megatron_rl.config.schema import Config
from megatron_rl.distributed.runtime import ParallelLayout, init_model_parallel, resolve_device
from megatron_rl.engine.checkpoint import ModelPart, check_checkpoint, load_checkpoint, save_checkpoint
from megatron_rl.errors import CheckpointError
from megatron_rl.models.builder import build_gpt_chunks
from megatron_rl.models.heads import attach_value_head
from megatron_rl.models.hf_bridge import export_hf, load_hf_weights
from megatron_rl.models.hf_config import read_hf_config


def _setup(cfg: Config):
    layout = ParallelLayout.from_config(cfg.parallel, dist.get_world_size())
    init_model_parallel(layout, seed=cfg.run.seed, timeout_s=cfg.distributed.timeout_s)
    return layout, resolve_device(cfg.distributed)


def hf_to_megatron(cfg: Config, hf_dir: str, out_root: str) -> str:
    layout, device = _setup(cfg)
    chunks = build_gpt_chunks(cfg.model, layout, device)
    load_hf_weights(chunks, hf_dir)
    meta = {"models": {"actor": model_config_to_dict(cfg.model)}, "hf_config": read_hf_config(hf_dir),
            "source": os.path.abspath(hf_dir)}
    path = save_checkpoint(out_root, 0, {"actor": ModelPart(chunks)}, meta=meta, with_optimizer=False)
    if dist.get_rank() == 0:
        print(f"converted {hf_dir} -> {path}")
    return path


def critic_hf_config(hf_config: dict) -> dict:
    out = copy.deepcopy(hf_config)
    archs = out.get("architectures") or ["LlamaForCausalLM"]
    out["architectures"] = [a.replace("ForCausalLM", "ForTokenClassification") for a in archs]
    out["num_labels"] = 1
    out["id2label"], out["label2id"] = {"0": "value"}, {"value": 0}
    return out


def megatron_to_hf(cfg: Config, checkpoint: str, hf_out: str, part: str = "actor") -> str:
    meta = check_checkpoint(checkpoint)
    if part not in meta.get("models", {}):
        raise CheckpointError("--part", part, f"the checkpoint holds {sorted(meta.get('models', {}))}",
                              "choose one of those parts")
    if "hf_config" not in meta:
        raise CheckpointError("--checkpoint", checkpoint, "it records no Hugging Face config",
                              "convert checkpoints of runs started from an HF model (model.hf_path)")
    model_cfg = model_config_from_dict(meta["models"][part])
    layout, device = _setup(dataclasses.replace(cfg, model=model_cfg))
    chunks = build_gpt_chunks(model_cfg, layout, device)
    hf_config = meta["hf_config"]
    if part == "critic":
        chunks = attach_value_head(chunks)
        hf_config = critic_hf_config(hf_config)
    load_checkpoint(checkpoint, {part: ModelPart(chunks)}, with_optimizer=False, load_rng=False)
    export_hf(chunks, hf_out, hf_config, model_cfg, source_dir=meta.get("source"), drop_lm_head=part == "critic")
    if dist.get_rank() == 0:
        print(f"exported {part} of {checkpoint} -> {hf_out}")
    return hf_out
