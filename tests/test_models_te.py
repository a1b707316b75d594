"""TransformerEngine layer spec: needs TE and CUDA, skipped (not faked) elsewhere."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.capabilities import te_usable, te_version

pytestmark = pytest.mark.skipif(
    not te_usable(),
    reason=f"needs TransformerEngine and CUDA (TE: {te_version() or 'not installed'}, "
           f"CUDA: {'yes' if torch.cuda.is_available() else 'no'})",
)


def _logits(impl: str, weights):
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical, load_canonical
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout()
    cfg = ModelConfig(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4,
                      num_query_groups=2, vocab_size=256, transformer_impl=impl, params_dtype="float32")
    device = torch.device("cuda")
    chunk = build_gpt_chunks(cfg, layout, device)[0]
    if weights is None:
        weights = gather_canonical([chunk])
    else:
        load_canonical([chunk], weights)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(64, device=device).expand(2, 64)
    hidden = chunk(tokens, positions, None)
    return weights, (hidden.float() @ chunk.output_weight().float().t()).cpu()


def test_te_spec_matches_local_spec():
    from megatron_rl.testing.harness import run_distributed

    weights, local = run_distributed(1, _logits, "local", None)[0]
    _, te = run_distributed(1, _logits, "transformer_engine", weights)[0]
    assert (local - te).abs().max() < 2e-3
