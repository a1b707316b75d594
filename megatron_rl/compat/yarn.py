"""YaRN RoPE on megatron-core 0.19.2 the way HF transformers computes it.

* ``GPTModel(position_embedding_type="yarn")`` reads its settings with ``getattr`` from
  ``yarn_*`` attributes that ``TransformerConfig`` does not declare (only the MLA config has
  them), and ``Attention`` takes the attention factor ("mscale") from the same attributes.
  :func:`set_yarn_attributes` puts them on a built config.
* megatron takes the mscale / mscale_all_dim ratio whenever both are not None; HF only when both
  are non-zero (else ``0.1 ln(factor) + 1``).  :func:`megatron_rl.layout.arch.yarn_megatron_mscales`
  hands megatron the pair that gives HF's factor.
* With ``apply_rope_fusion`` the fused THD RoPE (packed sequences) drops the mscale argument
  (``rope_utils.apply_rotary_pos_emb`` calls ``fused_apply_rotary_pos_emb_thd`` without it), and
  the fused BSHD path warns on every call before falling back.  :func:`rope_fusion_allowed` keeps
  fusion off for YaRN, so the unfused paths (which apply mscale) run.
"""

from __future__ import annotations

from megatron_rl.compat.records import MEGATRON_TESTED, Workaround, register_workaround


def set_yarn_attributes(config, *, factor: float, original_max_position_embeddings: int, beta_fast: float,
                        beta_slow: float, mscale, mscale_all_dim, truncate: bool) -> None:
    """The ``yarn_*`` attributes GPTModel and Attention read, on a built ``TransformerConfig``
    (``mscale`` / ``mscale_all_dim`` as megatron takes them: see the module docstring)."""
    config.yarn_rotary_scaling_factor = float(factor)
    config.yarn_original_max_position_embeddings = int(original_max_position_embeddings)
    config.yarn_beta_fast = float(beta_fast)
    config.yarn_beta_slow = float(beta_slow)
    config.yarn_mscale = mscale
    config.yarn_mscale_all_dim = mscale_all_dim
    config.yarn_correction_range_round_to_int = bool(truncate)


def rope_fusion_allowed(rope_mscale: float) -> bool:
    """False when RoPE's cos/sin carry a factor other than 1 (YaRN): fused THD RoPE would drop it."""
    return rope_mscale == 1.0


register_workaround(
    Workaround(
        name="rope.yarn_config_attributes",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "GPTModel(position_embedding_type='yarn') and Attention read yarn_* attributes TransformerConfig "
            "does not declare, and take the mscale ratio when both values are not None where HF needs both "
            "non-zero; set_yarn_attributes() sets them on the built config with HF's attention factor"
        ),
        used_in="models/builder.py:transformer_config",
    )
)
register_workaround(
    Workaround(
        name="rope.yarn_no_fused_thd_rope",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "rope_utils.apply_rotary_pos_emb with apply_rope_fusion calls TE's fused THD RoPE without "
            "YaRN's mscale (packed sequences lose the attention factor) and warns on every BSHD call; "
            "rope_fusion_allowed() keeps fusion off for YaRN"
        ),
        used_in="models/builder.py:transformer_config_kwargs",
    )
)
