"""The feature registry: the one list of what megatron_rl can do, how well it is proven, and
which configs it forbids, one module per area.

Each :class:`Feature` has a status, the constraints it imposes on a config (validation runs every
constraint before any process group starts), and its evidence: the tests that prove it.
``docs/feature_matrix.md`` and ``megatron-rl features`` are rendered from this list, grouped by
area in the order of :data:`AREA_MODULES`; a test fails when the committed document drifts from
it, and another when evidence names a test that does not exist.  A new feature goes into the
module of its area, next to the features it interacts with; a new area is a new module here.
"""

from __future__ import annotations

from megatron_rl.features import (
    algorithms,
    checkpointing,
    cluster,
    data,
    distillation,
    environments,
    layouts,
    long_context,
    lora,
    memory,
    models,
    rewards,
    rollout,
    runtime,
)
from megatron_rl.features.base import (  # noqa: F401 - the registry's vocabulary, used by its readers
    GPU_UNTESTED,
    PLANNED,
    STATUSES,
    TESTED_CPU,
    TESTED_GPU,
    UNSUPPORTED,
    Constraint,
    Feature,
    Measured,
)

# The matrix's sections, in reading order: how to run, how to lay out, then what runs.
AREA_MODULES = (runtime, layouts, long_context, models, lora, rollout, environments, algorithms, distillation, rewards,
                data, memory, checkpointing, cluster)
FEATURES: list[Feature] = [feature for module in AREA_MODULES for feature in module.FEATURES]


def _check_areas() -> None:
    for module in AREA_MODULES:
        wrong = [f.name for f in module.FEATURES if f.area != module.AREA]
        if wrong:
            raise ImportError(f"{module.__name__}: features of another area: {wrong}")


_check_areas()


def render_markdown(versions: dict[str, str]) -> str:
    """The feature matrix as Markdown (``docs/feature_matrix.md``), one section per area."""
    lines = [
        "# Feature matrix",
        "",
        "Generated from `megatron_rl/features/` (one module per area) by `megatron-rl features --markdown`; do not",
        "edit by hand (`tests/test_features.py` fails when this file and the registry differ).",
        "",
        "Tested stack: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        "Status: **" + "**, **".join(STATUSES) + "**. Every constraint below is enforced by config",
        "validation before any process starts (`megatron-rl validate CONFIG`), with a one-line error and exit code 2.",
        "",
    ]
    for module in AREA_MODULES:
        lines += [f"## {module.AREA}", "", "| Feature | Status | Turn on with | Constraints | Evidence |",
                  "|---|---|---|---|---|"]
        for f in module.FEATURES:
            cons = "<br>".join(c.text for c in f.constraints) or "-"
            ev = "<br>".join(f"`{e}`" for e in f.evidence) or "-"
            summary = f.summary + "".join(f"<br>Measured: {m.figure} (`{m.command}`)" for m in f.measured)
            lines.append(f"| **{f.name}**: {summary} | {f.status} | {f.config or '-'} | {cons} | {ev} |")
        lines.append("")
    lines += ["## What does not work together", "",
              "Every combination config validation refuses before launch, by the feature whose rule it is "
              "(the same rules as the Constraints column above).", "",
              "| Area | Feature | Needs |", "|---|---|---|"]
    for module in AREA_MODULES:
        for f in module.FEATURES:
            lines += [f"| {module.AREA} | {f.name} | {c.text} |" for c in f.constraints]
    lines.append("")
    return "\n".join(lines)
