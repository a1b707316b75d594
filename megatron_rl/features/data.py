"""Data: prompt files and formats, batching of sequences."""

from __future__ import annotations

from megatron_rl.features.base import PLANNED, TESTED_CPU, Feature

AREA = "data"
FEATURES = [
    Feature(
        "Prompt data (JSONL / Parquet, chat templates)", "data", TESTED_CPU,
        "prompt / answer / messages records; over-long prompts dropped and counted; seeded, resumable sampling.",
        ("tests/test_prompts.py::test_sampler_exact_resume",
         "tests/test_prompts.py::test_long_prompts_dropped_and_logged"),
        config="data.*",
    ),
    Feature(
        "Evaluation set during training", "data", PLANNED,
        "A held-out prompt file graded every N steps (greedy or sampled, pass@k) into metrics.jsonl; today only the "
        "training prompts are scored.",
    ),
    Feature(
        "Nested record keys (verl's reward_model.ground_truth)", "data", PLANNED,
        "Dotted keys for prompt, answer and messages, a chat-message list under the prompt key, and an answer key "
        "missing from the records refused before launch; today keys are top-level names.",
    ),
]
