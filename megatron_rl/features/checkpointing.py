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
        "A signal on any rank: every rank stops after the same step, checkpoints and exits 0.",
        ("tests/test_ppo.py::test_sigterm_checkpoints_then_resume_continues",),
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
        "Every file's sha256 in meta.json, checked before loading (hashed in shares over the ranks); resume=auto falls "
        "back past a checkpoint that does not load; a changed architecture names the setting; non-finite weights are "
        "never saved.",
        ("tests/test_checkpoint_safety.py::test_a_corrupted_checkpoint_is_named_and_resume_auto_falls_back",
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
        "trainer_state, RNG files and byte items load with weights_only=True, .metadata through an allow-list "
        "unpickler; a crafted file is refused with one line (exit 2) by train, convert and generate. TE's FP8 extra "
        "state under weights_only not yet checked on GPU.",
        ("tests/test_checkpoint_safety.py::test_crafted_checkpoints_are_refused_and_run_nothing",),
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
]
