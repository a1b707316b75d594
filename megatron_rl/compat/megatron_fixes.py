"""Workarounds for megatron-core behaviour that is wrong or missing on every device.

Each is registered with the megatron-core versions it was checked against.
"""

from __future__ import annotations

from megatron_rl.compat.registry import Patch, register_patch


def transformer_config_fixes() -> dict:
    """Extra ``TransformerConfig`` arguments that work around megatron-core checks.

    megatron-core 0.16.1: ``TransformerConfig.__post_init__`` rejects
    ``variable_seq_lengths=True`` (needed for token-budget micro-batches through the pipeline)
    whenever ``moe_token_dispatcher_type == "allgather"`` -- its default -- even for dense models
    without experts.  The dispatcher is unused by dense models, so name the one that passes.
    """
    return {"moe_token_dispatcher_type": "alltoall"}


register_patch(
    Patch(
        name="config.moe_dispatcher_for_variable_seq_lengths",
        megatron_versions=">=0.16,<0.17",
        reason=(
            "TransformerConfig rejects variable_seq_lengths with the default 'allgather' MoE "
            "dispatcher even for dense models; transformer_config_fixes() names 'alltoall'"
        ),
        apply=lambda: None,
    )
)
register_patch(
    Patch(
        name="model.gptmodel_postprocess_hook",
        megatron_versions=">=0.16,<0.18",
        reason=(
            "RLGPTModel overrides GPTModel._postprocess (private) to return hidden states so the "
            "chunked log-prob and value heads replace the output layer; checked by the model tests"
        ),
        apply=lambda: None,
    )
)
