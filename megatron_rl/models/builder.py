"""Build Megatron-Core GPT models (one per virtual pipeline stage) from our config.

The device decides the settings that only pay off, or only work, on a GPU
(:func:`device_settings`): on CUDA the fusions the installed stack supports, weights initialised
on the device, and TF32 for fp32 matmuls; on CPU every fusion is off and weights are initialised
on the host, as megatron's CPU paths need.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.capabilities import resolve_transformer_impl, te_version
from megatron_rl.compat.megatron_fixes import transformer_config_fixes
from megatron_rl.compat.yarn import rope_fusion_allowed, set_yarn_attributes
from megatron_rl.config.schema import ModelConfig
from megatron_rl.distributed.runtime import active_groups, active_layout
from megatron_rl.layout.arch import (
    ACTIVATIONS,
    MEGATRON_ROPE_SCALING_FACTOR,
    padded_vocab_size,
    resolve_dtype,
    rope_mscale,
    yarn_megatron_mscales,
    yarn_original_positions,
)
from megatron_rl.layout.sizes import ParallelLayout
from megatron_rl.models.gpt import RLGPTModel
from megatron_rl.models.moe import attach_moe_state, moe_transformer_kwargs, router_class
from megatron_rl.models.specs import block_spec


def device_settings(device_type: str, te_available: bool, apex_available: bool) -> dict:
    """``TransformerConfig`` values that depend on the device and the installed kernels.

    On CUDA: bias+activation, bias+dropout+add and masked-softmax fusions (megatron's own fused
    code; masked softmax falls back by itself where its kernel is missing), RoPE fusion with
    TransformerEngine (also keeps megatron's unfused THD RoPE, which reads ``cu_seqlens`` back, off
    the hot path), and gradient-accumulation fusion and persistent layer norm with Apex: megatron
    0.16's ``ColumnParallelLinear`` (the output layer exists in every spec) refuses
    gradient-accumulation fusion without Apex's ``fused_weight_gradient_mlp_cuda``, even with TE.
    Weights are initialised on the device.  On CPU everything is off and weights are initialised
    on the host.
    """
    cuda = device_type == "cuda"
    return dict(
        use_cpu_initialization=not cuda,
        bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=cuda,
        apply_rope_fusion=cuda and te_available,
        gradient_accumulation_fusion=cuda and apex_available,
        persist_layer_norm=cuda and apex_available,
    )


def _fusable_activation(model: ModelConfig) -> bool:
    """megatron fuses the bias into swiglu always, into plain gelu only when there is a bias."""
    gated, _ = ACTIVATIONS[model.activation]
    return gated or model.add_bias_linear


def apex_grad_accumulation_available() -> bool:
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def transformer_config_kwargs(
    model: ModelConfig, layout: ParallelLayout, dtype: torch.dtype, impl: str, *,
    device: torch.device | str = "cpu", te_available: bool | None = None, apex_available: bool | None = None,
    initialize: bool = True,
) -> dict:
    """The ``TransformerConfig`` arguments for ``device``, built without touching it.

    ``te_available`` / ``apex_available`` default to what this process can import.
    ``initialize=False`` skips megatron's random initialisation, for models whose weights are
    loaded right after (a checkpoint, an HF model)."""
    device_type = torch.device(device).type
    if te_available is None:
        te_available = te_version() is not None
    if apex_available is None:
        apex_available = apex_grad_accumulation_available()
    settings = device_settings(device_type, te_available, apex_available)
    settings["bias_activation_fusion"] = settings["bias_activation_fusion"] and _fusable_activation(model)
    settings["apply_rope_fusion"] = settings["apply_rope_fusion"] and rope_fusion_allowed(rope_mscale(model))
    rec = model.recompute
    kwargs = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=ACTIVATIONS[model.activation][0],
        activation_func=ACTIVATIONS[model.activation][1],
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        sequence_parallel=layout.sequence_parallel,
        cp_comm_type=layout.cp_comm_type,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        batch_p2p_comm=layout.batch_p2p_comm,
        variable_seq_lengths=True,
        deallocate_pipeline_outputs=True,
        perform_initialization=initialize,
        calculate_per_token_loss=True,
        recompute_granularity=rec.granularity,
        recompute_method=rec.method if rec.granularity == "full" else None,
        recompute_num_layers=rec.num_layers if rec.granularity == "full" else None,
        recompute_modules=list(rec.modules) if rec.granularity == "selective" else None,
        **settings,
    )
    kwargs.update(moe_transformer_kwargs(model, layout, impl))
    kwargs.update(transformer_config_fixes())
    return kwargs


def transformer_config(
    model: ModelConfig, layout: ParallelLayout, dtype: torch.dtype, impl: str, *,
    device: torch.device | str = "cpu", initialize: bool = True, **overrides
) -> TransformerConfig:
    kwargs = transformer_config_kwargs(model, layout, dtype, impl, device=device, initialize=initialize)
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    rs = model.rope_scaling
    if rs.type == "yarn":
        mscale, mscale_all_dim = yarn_megatron_mscales(rs)
        set_yarn_attributes(config, factor=rs.factor, original_max_position_embeddings=yarn_original_positions(model),
                            beta_fast=rs.beta_fast, beta_slow=rs.beta_slow, mscale=mscale,
                            mscale_all_dim=mscale_all_dim, truncate=rs.truncate)
    return config


@functools.lru_cache(maxsize=None)
def allow_tf32() -> None:
    """fp32 matmuls on CUDA may use TF32 tensor cores (set once per process; bf16 models are
    unaffected, fp32 ones trade ~1e-3 relative matmul precision for ~8x the throughput)."""
    torch.set_float32_matmul_precision("high")


def gpt_model(model: ModelConfig, config: TransformerConfig, impl: str, vocab: int, *, pre_process: bool,
              post_process: bool, model_cls=RLGPTModel, vp_stage: int | None = None, pp_rank: int | None = None,
              **model_kwargs):
    """One ``model_cls`` for ``config``: the training chunks
    and the inference model of ``rollout.layout`` (its own process groups and ``pp_rank`` in
    ``model_kwargs``) are built by this one call, so their modules and RoPE settings agree."""
    rs = model.rope_scaling
    chunk = model_cls(
        config=config,
        transformer_layer_spec=block_spec(config, impl, vp_stage, router_class(model), pp_rank=pp_rank),
        vocab_size=vocab,
        max_sequence_length=model.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=model.tie_word_embeddings,
        position_embedding_type="yarn" if rs.type == "yarn" else "rope",
        rotary_base=int(model.rotary_base),
        rope_scaling=rs.type == "llama3",
        rope_scaling_factor=rs.factor if rs.type == "llama3" else MEGATRON_ROPE_SCALING_FACTOR,
        vp_stage=vp_stage,
        **model_kwargs,
    )
    chunk.true_vocab_size = model.vocab_size
    return chunk


def pipeline_ends(vp_stage: int | None) -> tuple[bool, bool]:
    """Whether virtual stage ``vp_stage`` of this rank is the first / last stage of the pipeline
    (megatron's ``is_pipeline_first/last_stage(ignore_virtual=False)`` on the active groups)."""
    pp, vpp = active_groups().pp, active_layout().vpp
    first, last = pp.rank() == 0, pp.rank() == pp.size() - 1
    if vpp is not None:
        first, last = first and vp_stage == 0, last and vp_stage == vpp - 1
    return first, last


def build_gpt_chunks(
    model: ModelConfig, layout: ParallelLayout, device: torch.device, model_cls=RLGPTModel, *,
    initialize: bool = True, vocab_rows: int | None = None, **model_kwargs
) -> list[RLGPTModel]:
    """One ``model_cls`` per virtual pipeline stage held by this rank, on ``device``.

    ``initialize=False`` when weights are loaded right after (checkpoint, HF): megatron then
    allocates the parameters without initialising them.  ``vocab_rows``: the padded vocabulary
    of another layout's model (one refit from it), instead of this layout's own."""
    impl = resolve_transformer_impl(model.transformer_impl)
    dtype = resolve_dtype(model.params_dtype, device)
    if torch.device(device).type == "cuda":
        allow_tf32()
    config = transformer_config(model, layout, dtype, impl, device=device, initialize=initialize)
    vocab = vocab_rows or padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, layout.tp)
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        stage = vp_stage if layout.vpp else None
        first, last = pipeline_ends(stage)
        chunk = gpt_model(model, config, impl, vocab, pre_process=first, post_process=last,
                          model_cls=model_cls, vp_stage=stage, **model_kwargs)
        chunks.append(chunk.to(device))
    attach_moe_state(chunks)
    return chunks
