"""Run megatron-core's dynamic inference engine on a CPU-only PyTorch (gloo).

``rollout.engine=megatron`` drives ``megatron.core.inference``'s ``DynamicInferenceEngine`` (paged
KV cache, continuous batching, chunked prefill) on the actor's own shards.  On a CPU build of
torch, besides the CUDA events, NVTX ranges and memory statistics that
:mod:`megatron_rl.compat.cuda_standins` stands in for, these stop it; each is replaced here, for
CPU processes only:

* the paged attention kernels -- with a dynamic context ``Attention.forward`` skips the layer
  spec's core attention and calls flash-attn's ``flash_attn_varlen_func`` (prefill and mixed
  steps) and ``flash_attn_with_kvcache`` (decode-only steps) on the KV pages, after asserting a
  flash-attn version, or FA3's / FA4's kernels when those are importable.
  :func:`sdpa_varlen_paged` and :func:`sdpa_decode_paged` compute the same thing with
  ``scaled_dot_product_attention`` over each request's pages: causal attention aligned to the
  end of the keys (a query at chunk offset ``j`` sees keys ``< kv_len - q_len + j + 1``), GQA,
  and zeros for padding tokens and padding requests.  They are a CPU stand-in tested for parity
  with a full-sequence forward, not a model of the GPU kernels' speed;
* the Triton KV-cache append -- ``DynamicInferenceContext.append_key_value_cache`` calls
  ``triton_append_key_value_cache`` whenever triton imports, and that kernel asserts CUDA
  tensors; without it the context writes the pages with its own indexed copy;
* ``communication_utils._is_cuda`` -- asserts ``tensor.is_cuda`` on the logits the last pipeline
  stage broadcasts (PP >= 2).

On a GPU none of this applies: the engine needs flash-attn >= 2.7.3 (or FA3 / FA4) there, and
:mod:`megatron_rl.rollout.megatron_engine` says so before it starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.compat.records import (
    MEGATRON_TESTED,
    TORCH_TESTED,
    Patch,
    Workaround,
    register_patch,
    register_workaround,
)


# ----------------------------------------------------------------------------- PP broadcast
def _is_not_none(tensor) -> None:
    assert tensor is not None


def _patch_pp_broadcast_check() -> None:
    from megatron.core.inference import communication_utils

    communication_utils._is_cuda = _is_not_none


# ----------------------------------------------------------------------------- paged attention
def _pages(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, kv_heads, d]``: one request's keys (or values) read from its KV pages."""
    block = cache.size(1)
    blocks = table_row[: -(-length // block)].long()
    return cache[blocks].flatten(0, 1)[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """``q [sq, h, d]`` over ``k/v [sk, kvh, d]``, causal aligned to the last key (flash-attn's rule)."""
    sq, sk = q.size(0), k.size(0)
    mask = None
    if causal and sq > 1:
        rows = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        mask = torch.arange(sk, device=q.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=q.size(1) != k.size(1),
    )
    return out.transpose(0, 1)


def _full_attention_only(window_size, lse: bool) -> None:
    """The stand-ins compute full causal attention and return no log-sum-exp: a sliding-window
    layer or a sink softmax (which corrects the output with the LSE) would be silently wrong."""
    if window_size is not None and tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"the CPU paged attention has no sliding window (window_size={window_size})")
    if lse:
        raise NotImplementedError("the CPU paged attention returns no softmax LSE (sink softmax)")


def sdpa_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                      softmax_scale=None, causal=True, block_table=None, window_size=None,
                      return_attn_probs=False, **_unused):
    """flash-attn's ``flash_attn_varlen_func`` with a ``block_table``, for the CPU.

    ``q [tokens, heads, d]`` packs every request's new tokens (``cu_seqlens_q``); ``k``/``v`` are the
    paged caches ``[blocks, block_size, kv_heads, d]`` already holding the new keys; request ``i``
    has ``cu_seqlens_k[i+1] - cu_seqlens_k[i]`` keys in pages ``block_table[i]``.
    """
    _full_attention_only(window_size, return_attn_probs)
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    out = torch.zeros_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q0, q1, kv_len = cu_q[i], cu_q[i + 1], cu_k[i + 1] - cu_k[i]
        if q1 == q0 or kv_len == 0:
            continue  # a padding request
        keys, values = _pages(k, block_table[i], kv_len), _pages(v, block_table[i], kv_len)
        out[q0:q1] = _attend(q[q0:q1], keys, values, scale, causal)
    return out


# A batch of decode requests is padded to its longest; requests are grouped (longest first) while
# the padded slots stay within this factor of the real ones, so one long request does not make
# every short one attend over its length.
DECODE_PADDING_SLACK = 1.5


def decode_groups(lengths: list[int], slack: float = DECODE_PADDING_SLACK) -> list[list[int]]:
    """Indices into ``lengths`` in groups, longest first, each padded to its first (longest)
    member with at most ``slack`` x the group's real length."""
    groups: list[list[int]] = []
    real = 0  # the last group's real length
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= slack * (real + lengths[i]):
            groups[-1].append(i)
            real += lengths[i]
        else:
            groups.append([i])
            real = lengths[i]
    return groups


def sdpa_decode_paged(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True,
                      window_size=None, return_softmax_lse=False, **_unused):
    """flash-attn's ``flash_attn_with_kvcache`` with a ``block_table`` (decode: one query per
    request), batched over requests of similar length (:func:`decode_groups`):
    ``q [b, 1, heads, d]`` -> ``[b, 1, heads, d]``.

    Each request's pages are copied whole (``index_select`` of pages: about 3x faster on the CPU
    than gathering token slots), padded to its group's longest page count.  The slots past a
    request's length may hold anything -- uninitialised memory, NaN included, which would survive
    the mask as 0 * NaN -- so those rows of the copy are zeroed before SDPA masks them."""
    _full_attention_only(window_size, return_softmax_lse)
    if q.size(1) != 1:  # several queries per request: speculative decoding, which is off
        raise NotImplementedError(f"the CPU paged decode takes one query per request, got {q.size(1)}")
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    out = torch.zeros_like(q)
    live = (cache_seqlens > 0).nonzero().squeeze(1)  # padding requests have no keys: zeros
    if live.numel() == 0:
        return out
    block = k_cache.size(1)
    all_lengths = cache_seqlens[live].long()
    for group in decode_groups(all_lengths.tolist()):
        members = torch.tensor(group, dtype=torch.long, device=live.device)
        rows, lengths = live[members], all_lengths[members]
        pages = (int(lengths[0]) + block - 1) // block
        table = block_table[rows, :pages].long().clamp_min(0).flatten()
        valid = torch.arange(pages * block, device=q.device)[None, :] < lengths[:, None]  # [rows, slots]
        shape = (rows.numel(), pages * block) + tuple(k_cache.shape[2:])
        keys = k_cache.index_select(0, table).view(shape)
        values = v_cache.index_select(0, table).view(shape)
        hidden = (~valid).flatten().nonzero().squeeze(1)
        if hidden.numel():
            for copy in (keys, values):
                copy.view(-1, copy.size(2) * copy.size(3)).index_fill_(0, hidden, 0.0)
        attn = F.scaled_dot_product_attention(
            q[rows].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=q.size(2) != k_cache.size(2),
        )
        out[rows] = attn.transpose(1, 2)
    return out


def _fa_version_ok(*_args, **_kwargs) -> bool:
    return True


def _patch_paged_attention() -> None:
    from megatron.core.transformer import attention

    attention.flash_attn_varlen_func = sdpa_varlen_paged
    attention.flash_attn_with_kvcache = sdpa_decode_paged
    attention.is_fa_min_version = _fa_version_ok  # only attention.py's dynamic-batching assert reads it


def _patch_flash_generation_off() -> None:
    """Keep ``Attention._resolve_flash_version`` on the FA2 names the stand-ins replace."""
    from megatron.core.transformer import attention

    attention.HAVE_FA3 = False
    attention.HAVE_FA4 = False


# ----------------------------------------------------------------------------- KV append
def _patch_triton_kv_append() -> None:
    from megatron.core.inference.contexts import dynamic_context

    dynamic_context.triton_append_key_value_cache = None


# What the engine adapter does on every device, because of how megatron-core 0.19.2's dynamic engine
# behaves (listed with the CPU layer: they are re-checked together on an upgrade).
register_workaround(
    Workaround(
        name="inference.kv_cache_freed_on_suspend",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "DynamicInferenceEngine.suspend() frees the KV cache only when InferenceConfig."
            "kv_cache_management_mode is not PERSIST, the default; the engine asks for RECOMPUTE so "
            "the cache is deleted while the actor trains and rebuilt by resume()"
        ),
        used_in="rollout/megatron_engine.py:KVCacheManagementMode.RECOMPUTE",
    )
)
register_workaround(
    Workaround(
        name="inference.inference_mode_only_while_stepping",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "inference/utils.py InferenceMode is a process-wide flag that DynamicInferenceEngine "
            "__init__ and resume() set and only suspend() clears; GPTModel._preprocess/_postprocess "
            "read it (last-token logits only while it is set), so it is cleared after building or "
            "resuming and set only around the engine's steps"
        ),
        used_in="rollout/megatron_engine.py:InferenceMode.active",
    )
)
register_workaround(
    Workaround(
        name="inference.prefix_cache_ref_zero",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "with enable_prefix_caching a KV page is found by a hash of its prompt tokens alone "
            "(inference_request.compute_block_hashes_batched), not of the weights; the LRU eviction policy "
            "keeps released pages for later requests, which after an optimizer step would reuse keys and "
            "values of the old weights, so the engine asks for REF_ZERO (a page is shared only while a "
            "request holds it). No CPU shim: the SDPA stand-ins read every request's keys through its "
            "block table, shared pages included"
        ),
        used_in="rollout/megatron_engine.py:PrefixCachingEvictionPolicy.REF_ZERO",
    )
)
register_workaround(
    Workaround(
        name="inference.moe_dispatcher_nccl",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "DynamicInferenceContext.__init__ allocates NVLSAllGatherVDispatcher symmetric-memory "
            "buffers with EP > 1 when inference_moe_token_dispatcher_type is 'nvls' (the default), "
            "which raises without Hopper+ GPUs fully connected by NVLink (and on the CPU); only "
            "transformer_impl='inference_optimized' MoE layers use that dispatcher"
        ),
        used_in="rollout/megatron_engine.py:inference_moe_token_dispatcher_type",
    )
)
register_workaround(
    Workaround(
        name="inference.ep_dummy_step_not_recorded",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "TextGenerationController.dummy_forward() now runs the wrapper's _forward on a dummy "
            "request whose id is never set (add_dummy_requests_for_expert_parallel_step); MoE "
            "routing is not recorded when the context's _bookkeeping_no_real_work is set"
        ),
        used_in="rollout/megatron_engine.py:_bookkeeping_no_real_work",
    )
)

register_workaround(
    Workaround(
        name="inference.routing_indices_incomplete",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "with moe_enable_routing_replay the dynamic engine's per-request routing_indices are the "
            "same experts as the routers' own recording on every token they cover, but are None for a "
            "request that was evicted and re-prefilled (DynamicInferenceEngine reconstructs routing only "
            "when the request's record holds one request) and for a request whose KV blocks the same "
            "step's update_requests allocates to a waiting request (KVBlockAllocator."
            "allocate_memory_blocks drops those blocks' routing before the engine reconstructs from "
            "them); RolloutBatch.routing stays the routers' own recording (moe_rollout)"
        ),
        used_in="rollout/megatron_engine.py:megatron_routing; models/moe/router.py:_TopK",
    )
)


_CPU_PATCHES = (
    ("inference_cpu.paged_attention_sdpa", _patch_paged_attention,
     "with a DynamicInferenceContext Attention.forward bypasses core_attention and "
     "Attention.flash_decode_and_prefill calls flash-attn's paged flash_attn_varlen_func / "
     "flash_attn_with_kvcache (now with window_size, softmax_scale, num_splits) after asserting "
     "HAVE_FA4 or HAVE_FA3 or flash-attn >= 2.7.3; SDPA over each request's KV pages computes the "
     "same full causal attention on the CPU (sliding windows and sink softmax refused)"),
    ("inference_cpu.flash_attn_generation_off", _patch_flash_generation_off,
     "Attention._resolve_flash_version prefers FA4 (flash_attn.cute) > FA3 (flash_attn_3) > FA2 when "
     "importable, which would bypass the SDPA stand-ins; HAVE_FA3/HAVE_FA4 are set False on the CPU"),
    ("inference_cpu.triton_kv_append_off", _patch_triton_kv_append,
     "DynamicInferenceContext.append_key_value_cache calls fused_kv_append_kernel."
     "triton_append_key_value_cache whenever triton imports, and it asserts CUDA tensors on every "
     "layer of every step; set to None, the context's indexed-copy fallback writes the KV pages"),
    ("inference_cpu.pp_logits_broadcast_is_cuda", _patch_pp_broadcast_check,
     "communication_utils._is_cuda asserts tensor.is_cuda on the logits the last pipeline stage "
     "broadcasts during generation (PP >= 2); only the not-None check is kept"),
)

for _name, _apply, _reason in _CPU_PATCHES:
    register_patch(Patch(name=_name, megatron_versions=MEGATRON_TESTED, torch_versions=TORCH_TESTED,
                         reason=_reason, apply=_apply, cpu_only=True))
