"""The feature matrix in docs/ is generated from the registry and every row's evidence exists."""

from __future__ import annotations

import ast
import os

from megatron_rl.features import FEATURES, STATUSES
from megatron_rl.tools.features_cmd import matrix_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_feature_matrix_doc_is_current():
    with open(os.path.join(ROOT, "docs", "feature_matrix.md")) as fh:
        committed = fh.read()
    assert committed == matrix_markdown(), (
        "docs/feature_matrix.md is stale: run `megatron-rl features --markdown > docs/feature_matrix.md`"
    )


def _test_functions(path: str) -> set[str]:
    """Top-level ``test_*`` functions only: a helper or a nested function is not evidence."""
    with open(path) as fh:
        tree = ast.parse(fh.read())
    return {n.name for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")}


def test_every_feature_names_existing_tests():
    for feat in FEATURES:
        assert feat.status in STATUSES, feat.name
        if feat.status.startswith("tested"):
            assert feat.evidence, f"{feat.name} is '{feat.status}' but names no test"
        for node in feat.evidence:
            path, _, func = node.partition("::")
            full = os.path.join(ROOT, path)
            assert os.path.isfile(full), f"{feat.name}: {path} does not exist"
            assert func.split("[")[0] in _test_functions(full), f"{feat.name}: {node} does not exist"


def test_feature_names_are_unique():
    names = [f.name for f in FEATURES]
    assert len(names) == len(set(names))
