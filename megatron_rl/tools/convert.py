"""``megatron-rl convert``: Hugging Face <-> megatron_rl checkpoints.

    megatron-rl convert --hf-model DIR --out CKPT_ROOT [--nproc N] [parallel.tp=...]
    megatron-rl convert --checkpoint CKPT_DIR --hf-out DIR [--part actor|critic] [--nproc N]
    megatron-rl convert --checkpoint LORA_CKPT --hf-out DIR [--merge --hf-model BASE]

HF -> Megatron writes ``CKPT_ROOT/step_00000000`` (a model-only checkpoint that loads into any
layout).  Megatron -> HF reads a model out of any checkpoint (a converted one or a PPO training
checkpoint) and writes HF names, shapes, dtypes and config; a critic is written with its value
head as ``score`` (``*ForTokenClassification``, one label) and without the LM head.  Beside the
weights go the tokenizer the run used (``data.tokenizer``, else the model's own; every tokenizer
file, ``chat_template.jinja`` included, so chats render as in training) and the model's
``generation_config.json``, from the copies the checkpoint carries (its ``tokenizer/``); the
directories its ``meta.json`` names are never opened.
``--checkpoint`` may be a run directory or its ``checkpoints/``: the newest complete step is read.
A LoRA checkpoint (adapters only) becomes a peft adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``, for ``peft.PeftModel.from_pretrained`` on the base), or with
``--merge --hf-model BASE`` the base with the adapters merged in; BASE is the directory the user
names, checked against the sha256 the checkpoint records.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

import torch.distributed as dist

from megatron_rl.config.model_io import model_config_from_dict, model_config_to_dict
from megatron_rl.config.schema import Config
from megatron_rl.distributed.startup import start_model_parallel
from megatron_rl.engine.checkpoint import (
    ONLY_TRAINED,
    ModelPart,
    check_checkpoint,
    companions_dir,
    load_checkpoint,
    save_checkpoint,
)
from megatron_rl.errors import CheckpointError
from megatron_rl.layout.lora import is_adapter_param, target_names
from megatron_rl.models.builder import build_gpt_chunks
from megatron_rl.models.canonical import gather_canonical
from megatron_rl.models.heads import attach_value_head
from megatron_rl.models.hf_bridge import copy_companion_files, export_hf, load_hf_weights, model_source_meta
from megatron_rl.models.lora.adapters import attach_lora
from megatron_rl.models.lora.base import lora_settings
from megatron_rl.models.lora.export import export_merged_hf, split_adapters, write_peft_adapter


def _setup(cfg: Config):
    started = start_model_parallel(cfg)
    return started.layout, started.device


def hf_to_megatron(cfg: Config, hf_dir: str, out_root: str) -> str:
    layout, device = _setup(cfg)
    chunks = build_gpt_chunks(cfg.model, layout, device)
    load_hf_weights(chunks, hf_dir)
    meta = {"models": {"actor": model_config_to_dict(cfg.model)}, **model_source_meta(hf_dir, cfg.data.tokenizer)}
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


def megatron_to_hf(cfg: Config, checkpoint: str, hf_out: str, part: str = "actor", merge: bool = False,
                   base_dir: str | None = None) -> str:
    meta = check_checkpoint(checkpoint)
    if lora_settings(meta, part) is not None:
        return _lora_to_hf(cfg, checkpoint, meta, hf_out, part, merge, base_dir)
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
    export_hf(chunks, hf_out, hf_config, model_cfg, drop_lm_head=part == "critic")
    if dist.get_rank() == 0:
        print(f"exported {part} of {checkpoint} -> {hf_out}")
        carried = companions_dir(checkpoint)
        recorded = meta.get("tokenizer") or meta.get("source")
        print(_companions_line(hf_out, carried, carried, recorded), flush=True)
    return hf_out


def _lora_to_hf(cfg: Config, checkpoint: str, meta: dict, hf_out: str, part: str, merge: bool,
                base_dir: str | None) -> str:
    """A LoRA checkpoint out to HF: a peft adapter directory, or (``merge``) the base ``base_dir``
    (checked against the sha256 the checkpoint records) with the adapters merged in."""
    lora = lora_settings(meta, part)
    model_cfg = model_config_from_dict(meta["models"][part])
    layout, device = _setup(dataclasses.replace(cfg, model=model_cfg))
    chunks = build_gpt_chunks(model_cfg, layout, device, initialize=False)
    hf_config = meta["hf_config"]
    if part == "critic":
        chunks = attach_value_head(chunks)
        hf_config = critic_hf_config(hf_config)
    attach_lora(chunks, model_cfg, lora, seed=0, train_also=("value_head",))
    if merge:
        load_hf_weights(chunks, base_dir)
    load_checkpoint(checkpoint, {part: ModelPart(chunks, only=ONLY_TRAINED)}, with_optimizer=False, load_rng=False)
    base, adapters = split_adapters(gather_canonical(chunks, select=None if merge else is_adapter_param))
    if merge:
        if part == "critic":
            base.pop("output_layer.weight", None)
        export_merged_hf(base, adapters, lora, hf_out, hf_config, model_cfg)
    elif dist.get_rank() == 0:
        write_peft_adapter(hf_out, adapters, lora, target_names(model_cfg, lora.target_modules),
                           (meta["lora"]["base"] or {}).get("hf_path"))
    if dist.get_rank() == 0:
        what = "merged model" if merge else f"peft adapter (rank {lora.rank}, {len(adapters) // 2} projections)"
        print(f"exported {part} of {checkpoint} as a {what} -> {hf_out}")
        carried = companions_dir(checkpoint)
        print(_companions_line(hf_out, carried, carried, meta.get("tokenizer") or meta.get("source")), flush=True)
    return hf_out


def _companions_line(hf_out: str, model_dir: str | None, tokenizer_dir: str | None,
                     recorded: str | None = None) -> str:
    """Copy the tokenizer and generation config the run used beside the export; say what was copied
    or why nothing was (a chat model exported without its template renders chats differently).
    ``recorded`` (the directory the checkpoint names) is only named, never read."""
    copied = copy_companion_files(hf_out, model_dir, tokenizer_dir)
    if not copied:
        where = tokenizer_dir or model_dir
        why = f"{where} holds none" if where else "the checkpoint carries no tokenizer files"
        origin = f" ({recorded}, if you trust it)" if recorded else ""
        return (f"no tokenizer or generation_config.json copied ({why}); copy them into {hf_out} from the "
                f"model the run started from{origin}")
    by_dir: dict[str, list[str]] = {}
    for name, where in copied.items():
        by_dir.setdefault(where, []).append(name)
    template = "with" if _has_chat_template(hf_out) else "without"
    groups = "; ".join(", ".join(names) + f" from {where}" for where, names in by_dir.items())
    return f"copied {groups} (tokenizer {template} a chat template)"


def _has_chat_template(hf_dir: str) -> bool:
    if any(os.path.isfile(os.path.join(hf_dir, n)) for n in ("chat_template.jinja", "chat_template.json")):
        return True
    path = os.path.join(hf_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as fh:
        return bool(json.load(fh).get("chat_template"))
