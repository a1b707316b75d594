"""LoRA adapters out of megatron: a peft adapter directory, or the base with the adapters merged in.

A peft adapter directory is ``adapter_config.json`` + ``adapter_model.safetensors`` with keys
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ... (what
``peft.PeftModel.from_pretrained`` loads onto the HF base and ``save_pretrained`` writes).
"""

from __future__ import annotations

import json
import os
import re

import torch

from megatron_rl.layout.lora import hf_module, is_adapter_param

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_ADAPTER = re.compile(r"^decoder\.layers\.(\d+)\.lora\.(\w+)\.(lora_[AB])\.weight$")


def split_adapters(canonical: dict) -> tuple[dict, dict]:
    """``(base, adapters)`` of a canonical dict."""
    adapters = {k: v for k, v in canonical.items() if is_adapter_param(k)}
    return {k: v for k, v in canonical.items() if k not in adapters}, adapters


def peft_tensors(adapters: dict) -> dict[str, torch.Tensor]:
    """Canonical adapter tensors under peft's names."""
    out = {}
    for name, tensor in adapters.items():
        m = _ADAPTER.match(name)
        if m is None:
            raise ValueError(f"not a LoRA adapter tensor: {name}")
        layer, proj, which = m.groups()
        out[f"base_model.model.model.layers.{layer}.{hf_module(proj)}.{which}.weight"] = tensor
    return out


def peft_config(lora, targets: tuple[str, ...], base_path: str | None) -> dict:
    """peft's ``LoraConfig`` as ``save_pretrained`` writes it, for these adapters."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout, "target_modules": sorted(targets), "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base_path,
    }


def write_peft_adapter(out_dir: str, adapters: dict, lora, targets: tuple[str, ...], base_path: str | None,
                       dtype: torch.dtype = torch.float32) -> str:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.to(dtype).contiguous() for k, v in peft_tensors(adapters).items()}
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as fh:
        json.dump(peft_config(lora, targets, base_path), fh, indent=2)
    return out_dir


def merge_into_hf(hf_tensors: dict, adapters: dict, scaling: float) -> dict:
    """HF tensors of the base with each adapter's ``scaling * B @ A`` added to its projection
    (computed in fp32, written back in each weight's dtype)."""
    merged = dict(hf_tensors)
    by_module: dict[str, dict] = {}
    for name, tensor in peft_tensors(adapters).items():
        module, which = name[len("base_model.model."):].rsplit(".", 2)[0], name.rsplit(".", 2)[1]
        by_module.setdefault(module, {})[which] = tensor
    for module, ab in by_module.items():
        key = f"{module}.weight"
        base = merged[key]
        merged[key] = (base.float() + scaling * (ab["lora_B"].float() @ ab["lora_A"].float())).to(base.dtype)
    return merged


def export_merged_hf(base: dict, adapters: dict, lora, out_dir: str, hf_config: dict, model_cfg) -> None:
    """Write the base (canonical) with the adapters merged in as an HF model directory (rank 0)."""
    import torch.distributed as dist

    from megatron_rl.models.hf_bridge import canonical_to_hf, write_hf

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    merged = merge_into_hf(canonical_to_hf(base, model_cfg), adapters, lora.alpha / lora.rank)
    write_hf(merged, out_dir, hf_config, model_cfg)
