"""Checks of the paths ``score``, ``generate`` and ``convert`` are given, before any rank starts.

A missing model directory, input file or checkpoint, or an output nobody can write, is one line
naming the flag and exit code 2 within a second, as ``train`` does for its config, instead of a
failure after every rank has started and built its model.  A run directory or its
``checkpoints/`` directory given as ``--checkpoint`` becomes the newest complete step directory
under it.
"""

from __future__ import annotations

import os

from megatron_rl.engine.checkpoint import check_checkpoint, list_checkpoints, resolve_checkpoint
from megatron_rl.errors import CheckpointError, ConfigError, DataError, StorageError


def check_hf_model(path: str) -> None:
    if not os.path.isdir(path):
        raise ConfigError("--hf-model", path, "no such directory",
                          "give a local Hugging Face model directory (config.json, model.safetensors)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError("--hf-model", path, "no config.json in this directory",
                          "give a local Hugging Face model directory (config.json, model.safetensors)")


def check_input(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise DataError("--input", path, "file not found", f"give a JSONL file with {what} per line")


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def check_output_file(flag: str, path: str) -> None:
    """The file can be written (an existing one is replaced, as any output file)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise StorageError(flag, path, "is a directory", "give a file name")
    if not os.path.isdir(parent):
        raise StorageError(flag, path, f"its directory {parent} does not exist", "create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise StorageError(flag, path, f"its directory {parent} is not writable", "choose another path")


def check_output_dir(flag: str, path: str) -> None:
    """A directory to create, or an empty one: files left in it would mix with what is written."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise StorageError(flag, path, "already exists and is not an empty directory",
                           "choose a new directory, or remove this one first")
    existing = _nearest_existing(path)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise StorageError(flag, path, f"{existing} is not a writable directory", "choose another path")


def check_checkpoint_arg(path: str, part: str, need_hf_config: bool = False) -> str:
    """The complete step directory ``--checkpoint`` names (see :func:`resolve_checkpoint`), holding ``part``."""
    if not os.path.isdir(path):
        raise CheckpointError("--checkpoint", path, "no such directory",
                              "give a step_XXXXXXXX directory, a run's checkpoints/ directory or the run directory")
    step = resolve_checkpoint(path)
    meta = check_checkpoint(step)
    if part not in meta.get("models", {}):
        raise CheckpointError("--part", part, f"the checkpoint holds {sorted(meta.get('models', {}))}",
                              "choose one of those parts")
    if need_hf_config and "hf_config" not in meta:
        raise CheckpointError("--checkpoint", step, "it records no Hugging Face config",
                              "convert checkpoints of runs started from an HF model (model.hf_path)")
    return step


def check_lora_checkpoint(step: str, args) -> None:
    """What a checkpoint of LoRA adapters can be turned into: a peft adapter, or with ``--merge`` the
    base the user names (the one the adapters were trained on) with them merged in."""
    from megatron_rl.models.lora.base import lora_settings, weights_sha256

    meta = check_checkpoint(step)
    saved = lora_settings(meta, args.part)
    merge = getattr(args, "merge", False)
    if saved is None:
        if merge:
            raise CheckpointError("--merge", step, f"its {args.part} holds full weights: there are no adapters to "
                                  "merge", "drop --merge")
        return
    if args.command == "generate":
        raise CheckpointError("--checkpoint", step, f"its {args.part} holds LoRA adapters, not a whole model",
                              f"write the model first: megatron-rl convert --checkpoint {step} --hf-out DIR --merge "
                              "--hf-model BASE, then generate --hf-model DIR")
    if not merge and args.part == "critic":
        raise CheckpointError("--part", "critic", "a LoRA critic's adapters need its value head, which a peft "
                              "adapter of a causal LM does not carry", "add --merge --hf-model BASE")
    if not merge:
        return
    base = (meta["lora"].get("base") or {})
    if not args.hf_model:
        raise CheckpointError("--hf-model", None, "--merge needs the base the adapters were trained on",
                              f"add --hf-model {base.get('hf_path', 'BASE')}")
    if base.get("sha256") and weights_sha256(args.hf_model) != base["sha256"]:
        raise CheckpointError("--hf-model", args.hf_model, "its weights are not the base the adapters were trained "
                              f"on (sha256 {base['sha256'][:12]}... recorded, from {base.get('hf_path')})",
                              "give the base model the LoRA run started from")


def check_tool_paths(args) -> str | None:
    """Check what ``args`` of ``score``/``generate``/``convert`` name; returns the checkpoint step
    directory to read when ``--checkpoint`` is given (else None)."""
    command = args.command
    if getattr(args, "hf_model", None):
        check_hf_model(args.hf_model)
    step = None
    if getattr(args, "checkpoint", None):
        step = check_checkpoint_arg(args.checkpoint, args.part, need_hf_config=command == "convert")
    if command == "score":
        check_input(args.input, "input_ids or text")
    if command == "generate":
        check_input(args.input, "prompt_ids, prompt or messages")
    if command in ("score", "generate"):
        check_output_file("--output", args.output)
    if step is not None and command in ("convert", "generate"):
        check_lora_checkpoint(step, args)
    if command == "convert" and args.hf_model and args.out:
        if list_checkpoints(args.out):
            raise CheckpointError("--out", args.out, "already holds checkpoints (step_00000000 would be replaced)",
                                  "choose a new directory")
        check_output_dir("--out", os.path.join(args.out, "step_00000000"))
    if command == "convert" and args.checkpoint:
        check_output_dir("--hf-out", args.hf_out)
    return step
