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


def test_te_spec_matches_local_spec():
    from megatron_rl.testing.harness import run_distributed
    from tests.support.helpers import spec_logits_body

    weights, local = run_distributed(1, spec_logits_body, "local", None)[0]
    _, te = run_distributed(1, spec_logits_body, "transformer_engine", weights)[0]
    assert (local - te).abs().max() < 2e-3
