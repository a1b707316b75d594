"""Rewards: reward functions, graders and their time bounds."""

from __future__ import annotations

from megatron_rl.features.base import TESTED_CPU, Feature, Measured

AREA = "rewards"
FEATURES = [
    Feature(
        "Reward functions (registry, verifiable math)", "rewards", TESTED_CPU,
        "Built-in math_answer (GSM8K ####, \\boxed{}), math_verify, format, exact_match, digit_sum; any "
        "package.module:function (resolved from the working directory for every launch, checked before launch); a "
        "failing or malformed reward stops the run naming the prompt.",
        ("tests/test_rewards.py::test_raising_fn_names_the_prompt_index",
         "tests/test_ppo.py::test_reward_function_that_raises_stops_the_run_with_the_prompt_index",
         "tests/test_config_aliases.py::test_reward_module_in_the_working_directory_imports_with_one_process_as_with_many"),
        config="reward.fn, reward.kwargs",
    ),
    Feature(
        "Exact math grader (math_answer)", "rewards", TESTED_CPU,
        "GSM8K #### or the last group of \\boxed{}/\\fbox{}; numbers as exact rationals, percent, units, x= prefixes, "
        "unicode, markdown bold, a heading after the answer, exact algebra (roots, polynomials, factorials); boxes "
        "that disagree score 0; an exact reference needs an exact answer (no rounded decimal of 1/3 or pi); an "
        "answer the response takes back scores 0.",
        ("tests/test_reward_corpus.py::test_math_answer_on_the_corpus_no_false_positive_at_least_95_percent",
         "tests/test_rewards.py::test_several_boxes_policy",
         "tests/test_rewards.py::test_math_answer_wrong"),
        config="reward.fn=math_answer",
        measured=(Measured("96.3% accuracy, 0 false positives on 324 labelled cases (previous version: 84.3%, 33; "
                           "math-verify alone: 80.6%, 33)",
                           "python benchmarks/reward_grading.py"),),
    ),
    Feature(
        "Symbolic math grader (math_verify)", "rewards", TESTED_CPU,
        "The project's extraction and exact rules, then math-verify's SymPy comparison (signal timeouts off, bounded "
        "by the grading worker, any thread); needs pip install 'megatron_rl[math]'.",
        ("tests/test_reward_corpus.py::test_math_verify_on_the_corpus_no_false_positive_at_least_98_percent",
         "tests/test_rewards.py::test_math_verify_adds_symbolic_equivalence_and_keeps_the_contract",
         "tests/test_rewards.py::test_math_verify_pays_no_decimal_for_an_exact_value_and_reads_factorials",
         "tests/test_rewards.py::test_math_verify_is_bounded_and_thread_safe"),
        config="reward.fn=math_verify",
        measured=(Measured("99.4% accuracy, 0 false positives on 324 labelled cases",
                           "python benchmarks/reward_grading.py"),),
    ),
    Feature(
        "Per-sample reward time bound", "rewards", TESTED_CPU,
        "Each sample of a built-in or @grader reward is graded in a worker process bounded by reward.timeout_s; a "
        "timed-out sample scores 0, is counted in reward/timeouts and never stops the run; parsing is linear in the "
        "response length.",
        ("tests/test_rewards.py::test_timed_out_sample_scores_zero_is_counted_and_the_rest_are_graded",
         "tests/test_rewards.py::test_adversarial_input_is_graded_in_under_a_second",
         "tests/test_rewards.py::test_grading_is_bounded_on_a_thread_other_than_main"),
        config="reward.timeout_s",
        measured=(Measured("slowest adversarial input (1 MB text, depth-10,000 braces, 10,000 boxes, 100k-digit runs) "
                           "0.083 s",
                           "python benchmarks/reward_grading.py"),),
    ),
    Feature(
        "Rewards graded on every rank", "rewards", TESTED_CPU,
        "Each rank grades every world-th sample and one all_gather_object gives all ranks the scores and the timeout "
        "count; a failing reward stops every rank at once naming the prompt; whole_batch functions run on rank 0.",
        ("tests/test_rewards.py::test_rewards_on_every_rank_equal_one_rank",
         "tests/test_rewards.py::test_rewards_on_every_rank_count_timeouts_over_all_ranks",
         "tests/test_ppo.py::test_reward_function_that_raises_stops_the_run_with_the_prompt_index"),
        config="(always on)",
        measured=(Measured("2 gloo ranks give the same 7 scores as one; timeouts summed over ranks",
                           "pytest tests/test_rewards.py -k every_rank -s"),),
    ),
    Feature(
        "Time bound on plain reward functions", "rewards", TESTED_CPU,
        "A plain batch reward gets reward.timeout_s per response of its batch; past it the run stops with one line (a "
        "watchdog ends the rank even when the function is stuck in C).",
        ("tests/test_trainer_guards.py::test_plain_reward_that_never_returns_stops_the_job_with_one_line",),
        config="reward.timeout_s",
    ),
    Feature(
        "verl reward functions (compute_score)", "rewards", TESTED_CPU,
        "verl's compute_score(data_source, solution_str, ground_truth, extra_info) detected by its parameter names "
        "(or reward.convention=verl), called per sample by keyword with the record's data_source and extra_info; a "
        "float or a dict with 'score'; a signature that fits no calling convention is refused before launch.",
        ("tests/test_verl_data.py::test_verl_compute_score_gets_the_record_fields_and_dict_or_float_results",
         "tests/test_verl_data.py::test_record_fields_follow_their_samples_to_the_rank_that_grades_them",
         "tests/test_verl_data.py::test_signatures_fitting_no_convention_are_refused_naming_the_conventions",
         "tests/test_verl_data.py::test_validate_refuses_a_reward_signature_before_launch",
         "tests/test_verl_data.py::test_verl_parquet_and_compute_score_train_end_to_end"),
        config="reward.fn, reward.convention",
        measured=(Measured("reward/mean 1.0 at step 1 on a verl-schema Parquet file: every sample's data_source, "
                           "extra_info and nested ground truth reached compute_score",
                           "pytest tests/test_verl_data.py -k end_to_end"),),
    ),
    Feature(
        "TRL reward functions, dataset columns, reward files", "rewards", TESTED_CPU,
        "TRL's fn(completions, **kwargs) detected by its completions parameter (or reward.convention=trl), called by "
        "keyword with prompts, completions (chat messages for conversational data), completion_ids and every dataset "
        "column by name; None scores 0 and is reported once; batch functions bind by parameter name and names that "
        "fit no convention are refused before launch; every dataset column reaches batch functions and graders by "
        "name; reward.fn=path/file.py:name imported by path in every process that grades.",
        ("tests/test_reward_conventions.py::test_trl_functions_are_detected_and_get_completions_prompts_and_columns_by_name",
         "tests/test_reward_conventions.py::test_names_bind_the_arguments_and_names_fitting_no_convention_are_refused",
         "tests/test_reward_conventions.py::test_columns_follow_their_samples_to_the_rank_that_grades_them",
         "tests/test_reward_conventions.py::test_reward_fn_as_a_file_path_imports_by_path_here_and_in_the_grading_worker",
         "tests/test_reward_conventions.py::test_trl_reward_functions_unchanged"),
        config="reward.fn, reward.convention",
        measured=(Measured("2-step runs of TRL-style format and accuracy rewards in a file, on TRL-format data: every "
                           "logged reward equals what the function computes on the logged response",
                           "pytest tests/test_reward_conventions.py -k unchanged"),),
    ),
    Feature(
        "Reward signal checks", "rewards", TESTED_CPU,
        "A batch in which no sample has an answer, for a reward that reads answers, stops the run with one line "
        "(exit 2); equal rewards in every group for the first 3 steps give one 'no learning signal' warning.",
        ("tests/test_verl_data.py::test_a_batch_without_any_answer_stops_and_one_with_some_goes_on",
         "tests/test_verl_data.py::test_no_signal_warning_once_after_equal_rewards_in_every_group",
         "tests/test_verl_data.py::test_train_stops_on_a_step_without_answers_and_warns_when_rewards_carry_no_signal"),
        config="(always on)",
    ),
]
