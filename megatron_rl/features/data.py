"""Data: prompt files and formats, batching of sequences."""

from __future__ import annotations

from megatron_rl.features.base import TESTED_CPU, Feature, need

AREA = "data"
FEATURES = [
    Feature(
        "Prompt data (JSONL / Parquet, chat templates)", "data", TESTED_CPU,
        "prompt / answer / messages records; over-long prompts dropped and counted; seeded, resumable sampling. "
        "validate measures the prompts as train will (up to 1 GiB): how many are dropped, and a file with none "
        "within data.max_prompt_tokens refused before launch with train's own line.",
        ("tests/test_prompts.py::test_sampler_exact_resume",
         "tests/test_prompts.py::test_long_prompts_dropped_and_logged",
         "tests/test_prompt_lengths.py::test_validate_says_how_many_prompts_training_will_drop",
         "tests/test_prompt_lengths.py::test_train_stops_before_any_rank_starts_when_no_prompt_fits"),
        config="data.*",
    ),
    Feature(
        "Evaluation set during training", "data", TESTED_CPU,
        "data.val_path (a prompt file with the training data's keys, or a task) sampled by the training rollout "
        "engine with eval.* settings (greedy by default) and graded by reward.fn before the first step, every "
        "trainer.eval_every steps and after the last: eval/reward_mean, eval/accuracy (reward >= "
        "eval.correct_threshold), eval/response_len, eval/pass@k (eval.n > 1) in metrics.jsonl, TensorBoard and "
        "plot.png. Every data-parallel rank samples a share; greedy figures do not depend on the layout; a resumed "
        "run keeps the schedule (docs/coming_from_trl_verl.md).",
        ("tests/test_evaluation.py::test_greedy_evaluation_is_the_reward_of_greedy_generation",
         "tests/test_evaluation.py::test_greedy_evaluation_does_not_depend_on_the_data_parallel_size",
         "tests/test_evaluation.py::test_evaluation_keeps_its_schedule_across_a_resume_and_leaves_training_alone",
         "tests/test_evaluation.py::test_evaluation_file_is_checked_before_launch"),
        constraints=(
            need("trainer.eval_every", lambda c, w: not c.trainer.eval_every or bool(c.data.val_path),
                 "there is no evaluation set to evaluate", "set data.val_path to a prompt file (or task:<name>), "
                 "or trainer.eval_every=0", "eval_every needs data.val_path"),
            need("eval.n", lambda c, w: c.eval.n == 1 or c.eval.temperature > 0,
                 "greedy evaluation (eval.temperature=0) draws the same response n times",
                 "set eval.temperature > 0 for pass@k, or eval.n=1", "eval.n > 1 needs eval.temperature > 0"),
        ),
        config="data.val_path, trainer.eval_every, eval.*",
    ),
    Feature(
        "Nested record keys (verl's reward_model.ground_truth)", "data", TESTED_CPU,
        "Dotted keys for prompt, answer and messages (a literal key with a dot wins), verl's "
        "reward_model.ground_truth read when data.answer_key is left at its default, a chat-message list under the "
        "prompt key rendered with the chat template, an answer key missing from the first record refused before "
        "launch when the reward reads answers, and data_source / extra_info carried to the reward function.",
        ("tests/test_verl_data.py::test_verl_parquet_reads_nested_answer_chat_prompt_and_record_fields",
         "tests/test_verl_data.py::test_the_default_answer_key_reads_verls_ground_truth",
         "tests/test_verl_data.py::test_dotted_keys_for_prompt_and_messages_and_a_literal_dotted_key_wins",
         "tests/test_verl_data.py::test_validate_refuses_a_verl_file_without_the_answer_key_before_launch",
         "tests/test_verl_data.py::test_verl_parquet_and_compute_score_train_end_to_end"),
        config="data.prompt_key, data.answer_key, data.messages_key",
    ),
]
