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
        "Nested record keys (verl's reward_model.ground_truth)", "data", TESTED_CPU,
        "Dotted keys for prompt, answer and messages (a literal key with a dot wins), a chat-message list under the "
        "prompt key rendered with the chat template, an answer key missing from the first record refused before "
        "launch when the reward reads answers, and data_source / extra_info carried to the reward function.",
        ("tests/test_verl_data.py::test_verl_parquet_reads_nested_answer_chat_prompt_and_record_fields",
         "tests/test_verl_data.py::test_dotted_keys_for_prompt_and_messages_and_a_literal_dotted_key_wins",
         "tests/test_verl_data.py::test_validate_refuses_a_verl_file_without_the_answer_key_before_launch",
         "tests/test_verl_data.py::test_verl_parquet_and_compute_score_train_end_to_end"),
        config="data.prompt_key, data.answer_key, data.messages_key",
    ),
]
