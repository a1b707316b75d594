"""Which base a LoRA checkpoint's adapters belong to.

A LoRA checkpoint holds adapters and their optimizer state, not the frozen base: loading adapters
onto another base would train on quietly, so the checkpoint records the base (its path and the
sha256 of its weight files, or the seed of a random draw) and a resume refuses a different one.
"""

from __future__ import annotations

import glob
import hashlib
import os
from typing import Optional

from megatron_rl.errors import CheckpointError

_DIGESTS: dict = {}  # (files, sizes, mtimes) -> sha256: one pass over a base's files per process


def weights_sha256(directory: str) -> str:
    """sha256 over a model directory's weight files (``*.safetensors``, sorted by name: name and bytes)."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    key = tuple((f, os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        for path in files:
            digest.update(os.path.basename(path).encode())
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def _checkpoint_sha256(path: str) -> str:
    """sha256 of a checkpoint's manifest, which lists every file's own sha256."""
    with open(os.path.join(path, "meta.json"), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def lora_base_identity(cfg) -> dict:
    """What the frozen base is: an HF directory, a checkpoint, or a seeded draw."""
    if cfg.actor.init_checkpoint:
        path = os.path.abspath(cfg.actor.init_checkpoint)
        return {"init_checkpoint": path, "sha256": _checkpoint_sha256(path)}
    if cfg.model.hf_path:
        path = os.path.abspath(cfg.model.hf_path)
        return {"hf_path": path, "sha256": weights_sha256(path)}
    return {"seed": cfg.run.seed}


def lora_meta(cfg) -> dict:
    """The ``lora`` entry of a checkpoint's manifest: the base and each model's adapter settings."""
    from dataclasses import asdict

    models = {name: asdict(part.lora) for name, part in (("actor", cfg.actor), ("critic", cfg.critic))
              if part.lora.rank > 0}
    return {"base": lora_base_identity(cfg), "models": models}


def lora_settings(meta: dict, part: str):
    """The ``LoRAConfig`` model ``part`` of a checkpoint (its manifest ``meta``) was trained with,
    or None when it holds full weights: what :func:`lora_meta` wrote."""
    from megatron_rl.config.schema import LoRAConfig

    saved = ((meta.get("lora") or {}).get("models") or {}).get(part)
    return LoRAConfig(**saved) if saved else None


def check_lora_base(path: str, meta: dict, base: Optional[dict]) -> None:
    """Refuse adapters saved on another base than ``base`` (this run's)."""
    if base is None:
        return
    saved = (meta.get("lora") or {}).get("base")
    if saved is None:
        raise CheckpointError("actor.lora.rank", path, "holds full weights, not LoRA adapters",
                              "resume it without actor.lora / critic.lora, or start a LoRA run from it with "
                              "actor.init_checkpoint")
    if saved != base:
        where = {k: v for k, v in saved.items() if k != "sha256"}
        raise CheckpointError("model.hf_path", path, f"its adapters were trained on another base ({where}, sha256 "
                              f"{str(saved.get('sha256'))[:12]}...), not this run's {base}",
                              "start from the same base (model.hf_path / actor.init_checkpoint / run.seed) the "
                              "checkpoint names")
