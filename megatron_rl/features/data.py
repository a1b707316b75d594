"""Data: prompt files and formats, batching of sequences."""

from __future__ import annotations

from megatron_rl.features.base import TESTED_CPU, Feature

AREA = "data"
FEATURES = [
    Feature(
        "Prompt data (JSONL / Parquet, chat templates)", "data", TESTED_CPU,
        "prompt / answer / messages records; over-long prompts dropped and counted; seeded, resumable sampling.",
        ("tests/test_prompts.py::test_sampler_exact_resume",
         "tests/test_prompts.py::test_long_prompts_dropped_and_logged"),
        config="data.*",
    ),
]
