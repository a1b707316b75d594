"""Hugging Face safetensors <-> Megatron model chunks on any TP / PP / VPP layout.

Import reads, on every rank, only the slices of the HF tensors that rank's shards need
(``safetensors`` slicing: the layers of its pipeline stages, the rows or columns of its tensor-
parallel shard), so no rank ever loads the whole model.  Export gathers the canonical weights and
writes HF names, shapes and dtypes; HF -> Megatron -> HF gives back the same tensors, bit for bit.

Name mapping (canonical <- HF) for layer ``i``::

    input_layernorm            <- model.layers.i.input_layernorm
    self_attention.linear_qkv  <- q_proj, k_proj, v_proj   (fused per KV group: q.., k, v)
    self_attention.q/k_layernorm <- self_attn.q_norm / k_norm   (Qwen3)
    self_attention.linear_proj <- self_attn.o_proj
    pre_mlp_layernorm          <- post_attention_layernorm
    mlp.linear_fc1             <- gate_proj, up_proj        ([gate; up])
    mlp.linear_fc2             <- down_proj
    value_head.linear          <- score                     (critic / reward model, optional)

and for mixtures of experts (Qwen3-MoE, Qwen2-MoE; Hub checkpoints name every expert)::

    mlp.router                             <- mlp.gate
    mlp.experts.local_experts.j.linear_fc1 <- mlp.experts.j.gate_proj, up_proj   ([gate; up])
    mlp.experts.local_experts.j.linear_fc2 <- mlp.experts.j.down_proj
    mlp.shared_experts.linear_fc1          <- mlp.shared_expert.gate_proj, up_proj  (Qwen2-MoE)
    mlp.shared_experts.linear_fc2          <- mlp.shared_expert.down_proj
    mlp.shared_experts.gate_weight         <- mlp.shared_expert_gate

Each expert-parallel rank reads only its experts, each expert tensor-parallel rank its slice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.errors import CheckpointError
from megatron_rl.layout.arch import DTYPES, attention_dims
from megatron_rl.layout.lora import is_adapter_param
from megatron_rl.models.canonical import (
    VOCAB_PARALLEL,
    fuse_gate_up,
    fuse_qkv,
    gather_canonical,
    global_named_parameters,
    pad_rows,
    split_gate_up,
    split_qkv,
    tp_block,
    tp_group_of,
    tp_split_dim,
    unwrap,
)
from megatron_rl.models.hf_config import hf_config_with_rope_scaling

_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
# fc1 ([gate; up]) -> its HF module: the dense MLP, the shared experts, routed expert j.
_FC1 = {"mlp.linear_fc1.weight": "mlp", "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert"}
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TOP_DIRECT = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
    "value_head.linear.weight": "score.weight",
    "value_head.linear.bias": "score.bias",
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _direct_name(rest: str) -> Optional[str]:
    """The HF name (after ``model.layers.i.``) of a layer tensor copied as it is, or None."""
    if rest in _LAYER_DIRECT:
        return _LAYER_DIRECT[rest]
    m = _EXPERT.match(rest)
    if m and m.group(2) == "linear_fc2":
        return f"mlp.experts.{m.group(1)}.down_proj.weight"
    return None


def _fc1_module(rest: str) -> Optional[str]:
    """The HF module (after ``model.layers.i.``) whose gate_proj/up_proj make fc1 ``rest``, or None."""
    if rest in _FC1:
        return _FC1[rest]
    m = _EXPERT.match(rest)
    if m and m.group(2) == "linear_fc1":
        return f"mlp.experts.{m.group(1)}"
    return None
# Written beside the weights from the model's own directory (sampling defaults, every EOS id).
GENERATION_CONFIG = "generation_config.json"


SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_weight_map(hf_dir: str, index: str) -> dict[str, str]:
    """The ``weight_map`` of a sharded model's index: every tensor's shard, a ``.safetensors`` file
    in ``hf_dir`` itself.  A shard named by a path (``../x``, ``/x``, ``sub/x``) is refused, so an
    index never makes a command read a file outside the model directory."""
    fix = "re-download or re-save the model (save_pretrained writes its shards beside the index)"
    try:
        with open(index) as fh:
            weight_map = json.load(fh)["weight_map"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as err:
        raise CheckpointError("model.hf_path", hf_dir, f"{SAFETENSORS_INDEX} is not a safetensors index "
                              f"({type(err).__name__})", fix) from None
    if not isinstance(weight_map, dict):
        raise CheckpointError("model.hf_path", hf_dir, f"{SAFETENSORS_INDEX}: weight_map is not an object", fix)
    for name, shard in weight_map.items():
        if not (isinstance(shard, str) and shard.endswith(".safetensors") and os.path.basename(shard) == shard):
            raise CheckpointError("model.hf_path", hf_dir, f"{SAFETENSORS_INDEX} maps {name} to {shard!r}, not a "
                                  ".safetensors file in this directory", fix)
    return weight_map


class HFReader:
    """Lazy, slice-wise access to the tensors of a local HF safetensors checkpoint."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self.dir = hf_dir
        index = os.path.join(hf_dir, SAFETENSORS_INDEX)
        if os.path.isfile(index):
            self.weight_map = read_weight_map(hf_dir, index)
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118 - not a dict
        else:
            raise CheckpointError("model.hf_path", hf_dir, "no model.safetensors or model.safetensors.index.json",
                                  "save the HF model with safe_serialization=True (the default)")
        self._open = safe_open
        self._files: dict = {}
        self.bytes_read = 0

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _file(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError("model.hf_path", self.dir, f"tensor {name!r} is missing",
                                  "check that the checkpoint matches its config.json")
        fname = self.weight_map[name]
        if fname not in self._files:
            self._files[fname] = self._open(os.path.join(self.dir, fname), "pt")
        return self._files[fname]

    def read(self, name: str, rows: Optional[tuple] = None, cols: Optional[tuple] = None) -> torch.Tensor:
        piece = self._file(name).get_slice(name)
        if rows is not None and cols is not None:
            out = piece[rows[0]:rows[1], cols[0]:cols[1]]
        elif rows is not None:
            out = piece[rows[0]:rows[1]]
        elif cols is not None:
            out = piece[:, cols[0]:cols[1]]
        else:
            out = piece[:]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def shape(self, name: str) -> list[int]:
        return list(self._file(name).get_slice(name).get_shape())


def _read_shard(reader: HFReader, name: str, model, param, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's shard of canonical tensor ``name``, read slice-wise from HF tensors with the
    split rule of :mod:`megatron_rl.models.canonical`."""
    dim = tp_split_dim(param)
    m = _LAYER.match(name)
    if m is None:
        hf_name = _TOP_DIRECT[name]
        if name == "value_head.linear.bias" and not reader.has(hf_name):
            return torch.zeros(1)
        if name in VOCAB_PARALLEL:
            vocab = reader.shape(hf_name)[0]
            lo, hi = tp_block(param.shape[0] * tp_size, tp_rank, tp_size)
            return pad_rows(reader.read(hf_name, rows=(min(lo, vocab), min(hi, vocab))), hi - lo)
        return reader.read(hf_name)
    layer, rest = m.group(1), m.group(2)
    prefix = f"model.layers.{layer}."
    if _direct_name(rest) is not None:
        hf_name = prefix + _direct_name(rest)
        if dim is None or tp_size == 1:
            return reader.read(hf_name)
        span = tp_block(reader.shape(hf_name)[dim], tp_rank, tp_size)
        return reader.read(hf_name, rows=span) if dim == 0 else reader.read(hf_name, cols=span)
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]  # weight | bias
        heads, groups, head = attention_dims(model.config)
        per_group = heads // groups
        g0, g1 = tp_block(groups, tp_rank, tp_size)  # this rank's KV groups
        q = reader.read(f"{prefix}self_attn.q_proj.{kind}", rows=(g0 * per_group * head, g1 * per_group * head))
        k = reader.read(f"{prefix}self_attn.k_proj.{kind}", rows=(g0 * head, g1 * head))
        v = reader.read(f"{prefix}self_attn.v_proj.{kind}", rows=(g0 * head, g1 * head))
        return fuse_qkv(q, k, v, g1 - g0)
    if _fc1_module(rest) is not None:
        module = prefix + _fc1_module(rest)
        span = tp_block(reader.shape(f"{module}.gate_proj.weight")[0], tp_rank, tp_size)
        return fuse_gate_up(reader.read(f"{module}.gate_proj.weight", rows=span),
                            reader.read(f"{module}.up_proj.weight", rows=span))
    raise CheckpointError("model.hf_path", reader.dir, f"no HF source for parameter {name!r}",
                          "this architecture variant is not supported by the bridge")


@torch.no_grad()
def load_hf_weights(chunks: list, hf_dir: str) -> int:
    """Fill this rank's shards from ``hf_dir``; returns the bytes this rank read."""
    reader = HFReader(hf_dir)
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in global_named_parameters(model):
            if is_adapter_param(name):
                continue  # LoRA adapters start as peft's (or come from a checkpoint), not from the base
            if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
                name = "embedding.word_embeddings.weight"
            if name.startswith("value_head.") and not reader.has("score.weight"):
                continue  # a critic started from a policy checkpoint keeps its zero-initialised head
            _, tp_rank, tp_size = tp_group_of(name)  # routed experts: the expert TP group
            piece = _read_shard(reader, name, model, param, tp_rank, tp_size)
            if tuple(piece.shape) != tuple(param.shape):
                raise CheckpointError("model.hf_path", hf_dir,
                                      f"{name}: HF gives {tuple(piece.shape)}, the model expects {tuple(param.shape)}",
                                      "check that the config matches the checkpoint")
            param.copy_(piece.to(param.dtype))
    return reader.bytes_read


def canonical_to_hf(canonical: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Canonical tensors -> HF names and shapes (used by export)."""
    out: dict[str, torch.Tensor] = {}
    heads, groups, head = attention_dims(cfg)
    for name, tensor in canonical.items():
        m = _LAYER.match(name)
        if m is None:
            out[_TOP_DIRECT[name]] = tensor
            continue
        prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
        if _direct_name(rest) is not None:
            out[prefix + _direct_name(rest)] = tensor
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            q, k, v = split_qkv(tensor, heads, groups, head)
            out[f"{prefix}self_attn.q_proj.{kind}"] = q
            out[f"{prefix}self_attn.k_proj.{kind}"] = k
            out[f"{prefix}self_attn.v_proj.{kind}"] = v
        elif _fc1_module(rest) is not None:
            module = prefix + _fc1_module(rest)
            out[f"{module}.gate_proj.weight"], out[f"{module}.up_proj.weight"] = split_gate_up(tensor)
        else:
            raise ValueError(f"no HF name for {name}")
    return out


def export_hf(chunks: list, out_dir: str, hf_config: dict, model_cfg, source_dir: Optional[str] = None,
              max_shard_bytes: int = 5 * 2**30, drop_lm_head: bool = False,
              tokenizer_dir: Optional[str] = None) -> Optional[str]:
    """Write ``out_dir`` as an HF model directory (rank 0 writes; every rank must call), with the
    tokenizer of ``tokenizer_dir`` (default ``source_dir``) and the generation config of ``source_dir``."""
    canonical = gather_canonical(chunks)
    if drop_lm_head:
        canonical.pop("output_layer.weight", None)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return write_hf(canonical_to_hf(canonical, model_cfg), out_dir, hf_config, model_cfg, source_dir,
                    max_shard_bytes, tokenizer_dir)


def write_hf(hf_tensors: dict, out_dir: str, hf_config: dict, model_cfg, source_dir: Optional[str] = None,
             max_shard_bytes: int = 5 * 2**30, tokenizer_dir: Optional[str] = None) -> str:
    """Write HF-named tensors, in the config's dtype, as an HF model directory (one process)."""
    from safetensors.torch import save_file

    dtype = DTYPES.get(
        str(hf_config.get("torch_dtype", hf_config.get("dtype", "float32"))).replace("torch.", ""), torch.float32)
    tensors = {k: v.to(dtype).contiguous() for k, v in hf_tensors.items()}
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                       "weight_map": weight_map}, fh, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf_config_with_rope_scaling(hf_config, model_cfg), fh, indent=2)
    copy_companion_files(out_dir, source_dir, tokenizer_dir or source_dir)
    return out_dir


def model_source_meta(hf_path: Optional[str], tokenizer: Optional[str]) -> dict:
    """What a checkpoint records of where its model came from, so an export can write the same
    tokenizer (chat template included) and generation defaults beside the weights: the HF config,
    the HF directory (``source``) and the tokenizer directory the run used, when it was not the
    model's own (``data.tokenizer``)."""
    from megatron_rl.models.hf_config import read_hf_config

    meta: dict = {}
    if hf_path:
        meta["hf_config"] = read_hf_config(hf_path)
        meta["source"] = os.path.abspath(hf_path)
    if tokenizer and os.path.isdir(tokenizer):
        meta["tokenizer"] = os.path.abspath(tokenizer)
    return meta


def copy_companion_files(out_dir: str, model_dir: Optional[str], tokenizer_dir: Optional[str]) -> dict[str, str]:
    """Copy the tokenizer files (chat template included) from ``tokenizer_dir`` and
    ``generation_config.json`` from ``model_dir`` (else ``tokenizer_dir``) into ``out_dir``;
    returns each name copied with the directory it came from.  A directory that no longer exists
    is skipped."""
    from megatron_rl.data.tokenizer import HF_TOKENIZER_DIRS, HF_TOKENIZER_FILES

    copied = {}
    if tokenizer_dir and os.path.isdir(tokenizer_dir):
        for name in HF_TOKENIZER_FILES:
            if os.path.isfile(os.path.join(tokenizer_dir, name)):
                shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
                copied[name] = tokenizer_dir
        for name in HF_TOKENIZER_DIRS:
            if os.path.isdir(os.path.join(tokenizer_dir, name)):
                shutil.copytree(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name), dirs_exist_ok=True)
                copied[name + "/"] = tokenizer_dir
    for where in (model_dir, tokenizer_dir):
        if where and os.path.isfile(os.path.join(where, GENERATION_CONFIG)):
            shutil.copy(os.path.join(where, GENERATION_CONFIG), os.path.join(out_dir, GENERATION_CONFIG))
            copied[GENERATION_CONFIG] = where
            break
    return copied
