"""Checkpointing: saving, resuming, integrity, stopping."""

from __future__ import annotations

from megatron_rl.features.base import TESTED_CPU, Feature

AREA = "checkpointing"
FEATURES = [
    Feature(
        "Distributed checkpoints with resharding", "checkpointing", TESTED_CPU,
        "Megatron dist_checkpointing (torch_dist), atomic rename, loadable into another TP/PP/VPP layout.",
        ("tests/test_hf_models.py::test_convert_command_both_directions",),
        config="megatron-rl convert; trainer.save_every",
    ),
    Feature(
        "Checkpoint and exact resume", "checkpointing", TESTED_CPU,
        "Actor, critic, reference, optimizers, schedulers, RNG, data position, KL controller; atomic; keep last K; "
        "resume=auto; resumes into another layout.",
        ("tests/test_ppo.py::test_resume_same_layout_is_bit_identical",
         "tests/test_ppo.py::test_resume_gives_identical_metrics",
         "tests/test_ppo.py::test_failed_save_leaves_previous_checkpoint_loadable",
         "tests/test_ppo.py::test_truncated_checkpoint_is_detected_and_previous_used"),
        config="trainer.save_every, keep_last, resume",
    ),
    Feature(
        "Preemption (SIGTERM / SIGUSR1)", "checkpointing", TESTED_CPU,
        "A signal on any rank, generator ranks included, and in any phase (evaluation, SFT warm-up): every rank "
        "stops after the same step, checkpoints and exits 0.",
        ("tests/test_ppo.py::test_sigterm_checkpoints_then_resume_continues",
         "tests/test_generator_ranks.py::test_a_stop_signal_that_reaches_only_a_generator_rank_checkpoints_and_exits_0",
         "tests/test_signals.py::test_sigterm_in_evaluation_or_sft_warm_up_checkpoints_and_exits_0",
         "tests/test_signals.py::test_ctrl_c_twice_in_evaluation_or_sft_warm_up_aborts_without_a_checkpoint"),
        config="(always on)",
    ),
    Feature(
        "Stopping without loss or leftovers (Ctrl-C, second signal, kill -9)", "checkpointing", TESTED_CPU,
        "Stop signals reach each rank's main process only (checkpoint writers live to finish); a first Ctrl-C "
        "checkpoints and exits 0, a second aborts (130); ranks still running distributed.timeout_s after a stop are "
        "ended; every rank's process group is killed when the job ends; ranks die with their launcher "
        "(PR_SET_PDEATHSIG).",
        ("tests/test_signals.py::test_sigterm_after_a_periodic_save_checkpoints_and_exits_0",
         "tests/test_signals.py::test_ctrl_c_once_checkpoints_and_twice_aborts_with_one_process",
         "tests/test_signals.py::test_kill_9_of_a_rank_ends_the_job_and_leaves_no_helper_holding_its_output",
         "tests/test_signals.py::test_kill_9_of_the_launcher_stops_the_ranks"),
        config="(always on); distributed.timeout_s bounds the wait after a stop",
    ),
    Feature(
        "Checkpoint integrity (sha256) and fallback", "checkpointing", TESTED_CPU,
        "Every file's sha256 in meta.json, checked before loading (hashed in shares over the ranks); a file meta.json "
        "does not list, a symbolic link, or a meta.json of another shape makes the step a bad one; resume=auto falls "
        "back past a checkpoint that does not load; a changed architecture names the setting; non-finite weights are "
        "never saved.",
        ("tests/test_checkpoint_safety.py::test_a_corrupted_checkpoint_is_named_and_resume_auto_falls_back",
         "tests/test_checkpoint_safety.py::test_a_manifest_of_another_shape_marks_the_step_corrupt",
         "tests/test_checkpoint_safety.py::test_a_file_meta_json_does_not_list_is_refused_unread",
         "tests/test_checkpoint_safety.py::test_links_in_a_step_directory_are_refused_not_followed",
         "tests/test_checkpoint_safety.py::test_resuming_with_another_model_shape_names_the_setting",
         "tests/test_trainer_guards.py::test_infinite_learning_rate_applies_no_update_and_nan_weights_are_never_saved"),
        config="trainer.resume=auto",
    ),
    Feature(
        "Tools read a run's newest checkpoint", "checkpointing", TESTED_CPU,
        "`convert --checkpoint` and `generate --checkpoint` take a step directory, or a run directory or its "
        "checkpoints/ for the newest complete step (a save that did not finish is passed over; the step taken is "
        "printed); a directory that is none of these says what to pass.",
        ("tests/test_export_tools.py::test_a_run_or_its_checkpoints_directory_resolves_to_the_newest_complete_step",
         "tests/test_export_tools.py::test_export_of_a_run_carries_its_tokenizer_chat_template_and_generation_config",
         "tests/test_export_tools.py::test_generate_reads_the_newest_checkpoint_under_checkpoints_with_the_runs_"
         "tokenizer"),
        config="megatron-rl convert/generate --checkpoint runs/<name>",
    ),
    Feature(
        "Checkpoints never run code", "checkpointing", TESTED_CPU,
        "trainer_state, RNG files, byte items and a listed common.pt load with an explicit weights_only=True "
        "(whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says), .metadata through an allow-list unpickler; a crafted file "
        "is refused with one line (exit 2) by train, convert and generate; convert and generate read the tokenizer "
        "the checkpoint carries, never a directory its meta.json names, and an HF index names only shards beside it. "
        "TE's FP8 extra state under weights_only not yet checked on GPU.",
        ("tests/test_checkpoint_safety.py::test_crafted_checkpoints_are_refused_and_run_nothing",
         "tests/test_checkpoint_safety.py::test_a_listed_common_pt_is_read_weights_only_whatever_the_environment_says",
         "tests/test_checkpoint_safety.py::test_exports_and_generation_never_open_the_directories_meta_json_names",
         "tests/test_checkpoint_safety.py::"
         "test_a_safetensors_index_naming_a_file_outside_the_model_directory_is_refused"),
        config="(always on)",
    ),
    Feature(
        "Fresh start in a used run directory", "checkpointing", TESTED_CPU,
        "trainer.resume=never moves all the earlier run wrote (checkpoints, metrics, samples, config.yaml) to <run "
        "dir>/replaced/<time>/, where it can be resumed; nothing deleted, nothing mixed.",
        ("tests/test_cli.py::test_fresh_start_in_a_used_run_directory_keeps_the_old_run_and_does_not_mix_with_it",),
        config="trainer.resume=never",
    ),
    Feature(
        "Full disk during a save", "checkpointing", TESTED_CPU,
        "Before writing, every rank agrees on the space the checkpoint needs (the newest one's size, or an estimate "
        "from the parameters and Adam's state) and rank 0's free space; a save that does not fit, or a disk that fills "
        "during the write, stops with one line naming the directory and the space needed (exit 2), no partial "
        "checkpoint is left, and the last good one resumes; a failed save's temporaries never block the next run.",
        ("tests/test_disk_full.py::test_a_checkpoint_that_does_not_fit_stops_before_writing_with_one_line",
         "tests/test_disk_full.py::test_a_disk_that_fills_during_the_save_keeps_the_last_checkpoint_and_resumes",
         "tests/test_disk_full.py::test_temporaries_of_a_failed_save_never_block_the_next_run"),
        config="(always on); trainer.keep_last, run.dir",
    ),
    Feature(
        "Full disk outside a save", "checkpointing", TESTED_CPU,
        "The run's other writers -- config.yaml, the metrics line, the sample log, TensorBoard's events, the plot -- "
        "stop on a full disk with one line naming the file, what it needed and what was free (exit 2); a file is the "
        "old one or the new one, never a part (no .tmp left, no half line), the last checkpoint is intact and the same "
        "command resumes once there is space.",
        ("tests/test_disk_full.py::test_a_disk_that_fills_outside_a_save_stops_each_writer_with_one_line",
         "tests/test_disk_full.py::test_a_disk_full_before_the_job_starts_stops_at_its_config_with_one_line"),
        config="(always on); run.dir",
    ),
]
