"""Generated docs are current; the quickstart's commands run."""

from __future__ import annotations

from megatron_rl.tools.docs_gen import stale


def test_generated_docs_are_current():
    assert stale() == [], "run: python -m megatron_rl.tools.docs_gen --write"
