"""Build Megatron-Core GPT models (one per virtual pipeline stage) from our config."""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.capabilities import resolve_transformer_impl
from megatron_rl.compat.megatron_fixes import transformer_config_fixes
from megatron_rl.config.schema import ModelConfig
from megatron_rl.distributed.runtime import ParallelLayout
from megatron_rl.models.arch import ACTIVATIONS, MEGATRON_ROPE_SCALING_FACTOR, resolve_dtype
from megatron_rl.models.canonical import padded_vocab_size
from megatron_rl.models.gpt import RLGPTModel
from megatron_rl.models.specs import block_spec


def transformer_config(
    model: ModelConfig, layout: ParallelLayout, dtype: torch.dtype, impl: str, **overrides
) -> TransformerConfig:
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
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        calculate_per_token_loss=True,
        recompute_granularity=rec.granularity,
        recompute_method=rec.method if rec.granularity == "full" else None,
        recompute_num_layers=rec.num_layers if rec.granularity == "full" else None,
        recompute_modules=list(rec.modules) if rec.granularity == "selective" else None,
    )
    kwargs.update(transformer_config_fixes())
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_chunks(
    model: ModelConfig, layout: ParallelLayout, device: torch.device, model_cls=RLGPTModel, **model_kwargs
) -> list[RLGPTModel]:
    """One ``model_cls`` per virtual pipeline stage held by this rank, on ``device``."""
    impl = resolve_transformer_impl(model.transformer_impl)
    dtype = resolve_dtype(model.params_dtype, device)
    config = transformer_config(model, layout, dtype, impl)
    vocab = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, layout.tp)
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        stage = vp_stage if layout.vpp else None
        chunk = model_cls(
            config=config,
            transformer_layer_spec=block_spec(config, impl, stage),
            vocab_size=vocab,
            max_sequence_length=model.max_position_embeddings,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(model.rotary_base),
            rope_scaling=model.rope_scaling_factor is not None,
            rope_scaling_factor=model.rope_scaling_factor or MEGATRON_ROPE_SCALING_FACTOR,
            vp_stage=stage,
            **model_kwargs,
        )
        chunk.true_vocab_size = model.vocab_size
        chunks.append(chunk.to(device))
    return chunks
