"""Run megatron-core's dynamic inference engine on a CPU-only PyTorch (gloo).

``rollout.engine=megatron`` drives ``megatron.core.inference``'s ``DynamicInferenceEngine`` (paged
KV cache, continuous batching, chunked prefill) on the actor's own shards.  On a CPU build of
torch, besides the CUDA events, NVTX ranges and memory statistics that
:mod:`megatron_rl.compat.cuda_standins` stands in for, these stop it; each is replaced here, for
CPU processes only:

* the paged attention kernels -- with a dynamic context ``Attention.forward`` skips the layer
  spec's core attention and calls flash-attn's ``flash_attn_varlen_func`` (prefill and mixed
  steps) and ``flash_attn_with_kvcache`` (decode-only steps) on the KV pages.
  :func:`sdpa_varlen_paged` and :func:`sdpa_decode_paged` compute the same thing with
  ``scaled_dot_product_attention`` over each request's pages: causal attention aligned to the
  end of the keys (a query at chunk offset ``j`` sees keys ``< kv_len - q_len + j + 1``), GQA,
  and zeros for padding tokens and padding requests.  The engine installs them as
  ``rollout.paged_attention=sdpa`` (what ``auto`` picks on the CPU;
  :mod:`megatron_rl.compat.paged_attention`); they read lengths on the host, so on CUDA the Triton
  kernel takes their place;
* the Triton KV-cache append -- ``DynamicInferenceContext.append_key_value_cache`` calls
  ``triton_append_key_value_cache`` whenever triton imports, and that kernel asserts CUDA
  tensors; without it the context writes the pages with its own indexed copy;
* ``communication_utils._is_cuda`` -- asserts ``tensor.is_cuda`` on the logits the last pipeline
  stage broadcasts (PP >= 2).

On a GPU none of this applies: the paged attention there is flash-attn's or the Triton kernel
(:mod:`megatron_rl.ops.paged_attention`).
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
def _full_attention_only(window_size, lse: bool) -> None:
    """The stand-ins compute full causal attention and return no log-sum-exp: a sliding-window
    layer or a sink softmax (which corrects the output with the LSE) would be silently wrong."""
    if window_size is not None and tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"the CPU paged attention has no sliding window (window_size={window_size})")
    if lse:
        raise NotImplementedError("the CPU paged attention returns no softmax LSE (sink softmax)")


# Requests are padded to their group's longest (queries and keys); requests are grouped (longest
# keys first) while the padded work stays within this factor of the real work, so one long request
# does not make every short one attend over its length.
DECODE_PADDING_SLACK = 1.5


def attention_groups(query_lengths: list[int], key_lengths: list[int],
                     slack: float = DECODE_PADDING_SLACK) -> list[list[int]]:
    """Indices of the requests in groups, longest keys first, each padded to its longest query
    and key count with at most ``slack`` x the group's real query x key work."""
    groups: list[list[int]] = []
    real = longest_q = 0  # the last group's real work and longest query
    for i in sorted(range(len(key_lengths)), key=lambda i: (-key_lengths[i], -query_lengths[i])):
        work = query_lengths[i] * key_lengths[i]
        if groups:
            q = max(longest_q, query_lengths[i])
            if (len(groups[-1]) + 1) * q * key_lengths[groups[-1][0]] <= slack * (real + work):
                groups[-1].append(i)
                real, longest_q = real + work, q
                continue
        groups.append([i])
        real, longest_q = work, query_lengths[i]
    return groups


def decode_groups(lengths: list[int], slack: float = DECODE_PADDING_SLACK) -> list[list[int]]:
    """:func:`attention_groups` of one query per request (decode)."""
    return attention_groups([1] * len(lengths), lengths, slack)


def _gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor):
    """``(keys, values, valid)``: each request's first ``lengths[r]`` keys and values read from its
    pages (``table[r]``) as ``[requests, longest, kv_heads, d]``, zero past its length, and the
    ``[requests, longest]`` mask of its real slots.

    Pages are copied whole (``index_select`` of pages: about 3x faster on the CPU than gathering
    token slots); when every request fits in its first page only the slots up to the longest are
    copied.  The slots past a request's length may hold anything -- uninitialised memory, NaN
    included, which would survive the mask as 0 * NaN -- so they are zeroed."""
    block = k_cache.size(1)
    longest = int(lengths.max())
    pages = -(-longest // block)
    blocks = table[:, :pages].long().clamp_min(0)
    rows = blocks.size(0)
    if pages == 1:
        width = longest
        keys = k_cache[:, :longest].index_select(0, blocks[:, 0])
        values = v_cache[:, :longest].index_select(0, blocks[:, 0])
    else:
        width = pages * block
        shape = (rows, width) + tuple(k_cache.shape[2:])
        keys = k_cache.index_select(0, blocks.flatten()).view(shape)
        values = v_cache.index_select(0, blocks.flatten()).view(shape)
    valid = torch.arange(longest, device=lengths.device)[None, :] < lengths[:, None]
    if not bool(valid.all()):
        # Zero the hidden slots in place, as rows of the fresh copies (index_fill_: about 3x
        # cheaper on the CPU than masked_fill, which also allocates).
        row, slot = (~valid).nonzero(as_tuple=True)
        hidden = row * width + slot
        keys.view(rows * width, -1).index_fill_(0, hidden, 0.0)
        values.view(rows * width, -1).index_fill_(0, hidden, 0.0)
    return keys[:, :longest], values[:, :longest], valid


def _attend_padded(q, keys, values, mask, scale: float):
    """SDPA of ``q [requests, queries, heads, d]`` over ``keys/values [requests, slots, kv_heads, d]``
    with ``mask [requests, queries, slots]`` (GQA by head groups)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None], scale=scale,
        enable_gqa=q.size(2) != keys.size(2),
    )
    return out.transpose(1, 2)


def sdpa_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                      softmax_scale=None, causal=True, block_table=None, window_size=None,
                      return_attn_probs=False, **_unused):
    """flash-attn's ``flash_attn_varlen_func`` with a ``block_table``, for the CPU.

    ``q [tokens, heads, d]`` packs every request's new tokens (``cu_seqlens_q``); ``k``/``v`` are the
    paged caches ``[blocks, block_size, kv_heads, d]`` already holding the new keys; request ``i``
    has ``cu_seqlens_k[i+1] - cu_seqlens_k[i]`` keys in pages ``block_table[i]``.  Causal attention
    is aligned to the end of the keys: the query at chunk offset ``j`` sees keys
    ``< kv_len - q_len + j + 1``.  Requests of similar length are batched into one padded SDPA
    (:func:`attention_groups`); padding tokens and padding requests get zeros.
    """
    _full_attention_only(window_size, return_attn_probs)
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    out = torch.zeros_like(q)
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    q_lens, k_lens = cu_q.diff(), cu_k.diff()
    live = ((q_lens > 0) & (k_lens > 0)).nonzero().squeeze(1)  # padding requests: zeros
    if live.numel() == 0:
        return out
    q_live, k_live = q_lens[live], k_lens[live]
    for group in attention_groups(q_live.tolist(), k_live.tolist()):
        members = torch.tensor(group, dtype=torch.long, device=live.device)
        rows, ql, kl = live[members], q_live[members], k_live[members]
        keys, values, valid = _gather_kv(k, v, block_table[rows], kl)
        offsets = torch.arange(int(ql.max()), device=q.device)
        real = offsets[None, :] < ql[:, None]  # [requests, queries]
        index = (cu_q[rows][:, None] + offsets[None, :]).clamp(max=q.size(0) - 1)  # padded queries: any row
        mask = valid[:, None, :]
        if causal:
            last_visible = (kl - ql)[:, None, None] + offsets[None, :, None]
            mask = mask & (torch.arange(keys.size(1), device=q.device)[None, None, :] <= last_visible)
        attn = _attend_padded(q[index], keys, values, mask, scale)
        out[index[real]] = attn[real]
    return out


def sdpa_decode_paged(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=True,
                      window_size=None, return_softmax_lse=False, **_unused):
    """flash-attn's ``flash_attn_with_kvcache`` with a ``block_table`` (decode: one query per
    request), batched over requests of similar length (:func:`decode_groups`):
    ``q [b, 1, heads, d]`` -> ``[b, 1, heads, d]``; padding requests (no keys) get zeros."""
    _full_attention_only(window_size, return_softmax_lse)
    if q.size(1) != 1:  # several queries per request: speculative decoding, which is off
        raise NotImplementedError(f"the CPU paged decode takes one query per request, got {q.size(1)}")
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    out = torch.zeros_like(q)
    live = (cache_seqlens > 0).nonzero().squeeze(1)
    if live.numel() == 0:
        return out
    all_lengths = cache_seqlens[live].long()
    for group in decode_groups(all_lengths.tolist()):
        members = torch.tensor(group, dtype=torch.long, device=live.device)
        rows = live[members]
        keys, values, valid = _gather_kv(k_cache, v_cache, block_table[rows], all_lengths[members])
        out[rows] = _attend_padded(q[rows], keys, values, valid[:, None, :], scale)
    return out


# ----------------------------------------------------------------------------- KV append
def _patch_triton_kv_append() -> None:
    from megatron.core.inference.contexts import dynamic_context

    dynamic_context.triton_append_key_value_cache = None


# ----------------------------------------------------------------------------- suspend without graphs
def _delete_cuda_graphs_if_any(_delete):
    """``delete_cuda_graphs`` that returns at once when no graph was ever recorded: the engine runs
    eagerly, and the full ``gc.collect()`` it ends with costs 0.3-0.5 s in a trainer process on
    every rollout's suspend (more than the rollout itself on a small model)."""

    def delete_cuda_graphs():
        from megatron.core.transformer.cuda_graphs import CudaGraphManager, _CudagraphGlobalRecord

        record = _CudagraphGlobalRecord
        if (record.cudagraph_created or record.cudagraph_record or record.cudagraph_inference_record
                or CudaGraphManager.global_mempool is not None):
            _delete()

    delete_cuda_graphs.__wrapped__ = _delete
    return delete_cuda_graphs


def _patch_suspend_gc() -> None:
    from megatron.core.inference.engines import dynamic_engine

    if not hasattr(dynamic_engine.delete_cuda_graphs, "__wrapped__"):
        dynamic_engine.delete_cuda_graphs = _delete_cuda_graphs_if_any(dynamic_engine.delete_cuda_graphs)


register_patch(
    Patch(
        name="inference.suspend_without_graphs_skips_gc", megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED, apply=_patch_suspend_gc,
        reason=(
            "DynamicInferenceEngine.suspend() with a non-PERSIST KV cache calls cuda_graphs."
            "delete_cuda_graphs(), which ends with gc.collect() even when no CUDA graph was captured "
            "(the engine here runs eagerly): 0.3-0.5 s per rollout in a trainer process; it is skipped "
            "when nothing was recorded"
        ),
    )
)


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
        used_in="rollout/megatron/dynamic.py:KVCacheManagementMode.RECOMPUTE",
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
        used_in="rollout/megatron/dynamic.py:InferenceMode.active; rollout/megatron/static.py:InferenceMode.active",
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
        used_in="rollout/megatron/dynamic.py:PrefixCachingEvictionPolicy.REF_ZERO",
    )
)
register_workaround(
    Workaround(
        name="inference.global_memory_buffer_outside_inference_mode",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "parallel_state's GlobalMemoryBuffer (the sequence-parallel all-gather buffer among others) "
            "is process-wide and grown on demand; grown while the engine steps under torch.inference_mode "
            "it is an inference tensor, and the next training forward's all_gather into it raises "
            "'Inplace update to inference tensor outside InferenceMode'; such buffers are dropped after "
            "each rollout"
        ),
        used_in="compat/inference_hooks.py:drop_inference_buffers; rollout/megatron/modes.py:drop_inference_buffers",
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
        used_in="rollout/megatron/dynamic.py:inference_moe_token_dispatcher_type",
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
        used_in="compat/inference_hooks.py:_bookkeeping_no_real_work; rollout/megatron/wrapper.py:dummy",
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
        used_in="rollout/megatron/dynamic.py:megatron_routing; models/moe/router.py:_TopK",
    )
)


_CPU_PATCHES = (
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
