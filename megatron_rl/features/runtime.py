"""Running a job: the tested stack, launchers, validation, devices, metrics."""

from __future__ import annotations

from megatron_rl.features.base import (
    GPU_UNTESTED,
    TESTED_CPU,
    TESTED_GPU,
    Feature,
    Measured,
    model_parallel_size,
    need,
)

AREA = "runtime"
FEATURES = [
    Feature(
        "CPU execution (gloo)", "runtime", TESTED_CPU,
        "megatron-core's real TP/PP/CP/DP code on a CPU-only torch through megatron_rl/compat.",
        ("tests/test_compat.py::test_cpu_trace_lists_megatron_call_sites",
         "tests/test_parallel_parity.py::test_tp2_sequence_parallel"),
        config="distributed.device=cpu (auto without CUDA)",
    ),
    Feature(
        "One tested stack (Python 3.12, megatron-core 0.19.2)", "runtime", TESTED_CPU,
        "scripts/bootstrap.sh builds .venv on Python 3.12 (PATH, then pyenv's interpreters) or says in one line what "
        "to install; every command stops before launch on a megatron-core outside >=0.19.2,<0.20, naming the range, "
        "unless run.allow_untested_megatron_core=true (one warning).",
        ("tests/test_compat_registry.py::test_megatron_core_outside_the_tested_range_stops_before_launch",
         "tests/test_compat_registry.py::test_bootstrap_without_python_312_says_what_to_install",
         "tests/test_compat_registry.py::test_ranges_are_what_is_tested"),
        config="run.allow_untested_megatron_core",
    ),
    Feature(
        "Parallel layouts (world size <= 8)", "runtime", TESTED_CPU,
        "Megatron parallel_state for every TP x PP x CP x DP (and VPP) layout; DP derived from world size.",
        ("tests/test_runtime.py::test_parallel_state_every_layout_up_to_8",),
        (
            need("parallel.tp", lambda c, w: w is None or w % model_parallel_size(c) == 0,
                 "world size {w} is not divisible by tp*pp*cp",
                 "choose tp*pp*cp that divides {w}, or start a multiple of tp*pp*cp processes",
                 "world size divisible by tp*pp*cp"),
        ),
        config="parallel.tp, parallel.pp, parallel.cp, --nproc",
    ),
    Feature(
        "Random init independent of the layout", "runtime", TESTED_CPU,
        "Without model.hf_path or actor.init_checkpoint the actor's weights are drawn per tensor from run.seed and its "
        "global name with megatron-core's distributions (constants kept, residual projections scaled by 1/sqrt(2L)), "
        "on the CPU: the same seed gives the same model on TP/PP/EP/VPP layouts and on CPU or GPU, and the same run "
        "numbers on every layout.",
        ("tests/test_seeded_init.py::test_same_seed_same_weights_on_every_layout",
         "tests/test_seeded_init.py::test_seeded_weights_follow_megatrons_distributions",
         "tests/test_seeded_init.py::test_a_run_from_random_init_gives_the_same_numbers_on_every_layout"),
        config="run.seed",
    ),
    Feature(
        "TRL / verl key names", "runtime", TESTED_CPU,
        "Every key path of verl's ppo_megatron_trainer.yaml is mapped, and TRL's GRPOConfig names: on the command "
        "line and in a YAML file alike, a name for the same setting (num_generations, beta, "
        "actor_rollout_ref.actor.optim.lr, ...) is accepted with a one-line note; a name read by its value (loss_type, "
        "scale_rewards, report_to, trainer.logger, ppo_mini_batch_size, the reference model's layout equal to the "
        "actor's, n_gpus_per_node x nnodes equal to the job's ranks, rollout.name=vllm, custom_reward_function.path, "
        "the rollout's TP/PP/EP as rollout.layout) is accepted where the value means ours; names that mean something "
        "else are refused pointing at our key; every refused key of a run is reported in one error (exit 2), each "
        "with its fix; did-you-mean only for close misspellings. docs/coming_from_trl_verl.md lists them.",
        ("tests/test_config_aliases.py::test_same_meaning_alias_is_accepted_with_one_note",
         "tests/test_config_aliases.py::test_different_meaning_alias_is_refused_pointing_at_our_key",
         "tests/test_config_aliases.py::test_generation_layout_keys_set_the_rollout_layout_not_the_training_one",
         "tests/test_config_aliases.py::test_every_key_of_verls_megatron_trainer_is_mapped",
         "tests/test_config_aliases.py::test_verl_names_point_at_the_right_key_not_a_look_alike",
         "tests/test_config_aliases.py::test_two_names_for_one_key_with_different_values_are_refused",
         "tests/test_config_aliases.py::test_a_typo_still_gets_did_you_mean",
         "tests/test_foreign_keys.py::test_every_refused_key_of_verls_megatron_ppo_command_is_reported_at_once",
         "tests/test_foreign_keys.py::test_verl_values_that_mean_ours_are_accepted_with_a_note",
         "tests/test_foreign_keys.py::test_trl_and_verl_names_in_a_yaml_file_give_what_the_command_line_gives",
         "tests/test_foreign_keys.py::test_verls_files_with_verls_key_names_in_one_run"),
        config="e.g. num_generations=8, actor_rollout_ref.actor.optim.lr=1e-6",
    ),
    Feature(
        "Local launcher (--nproc)", "runtime", TESTED_CPU,
        "megatron-rl <command> --nproc N starts N local ranks; torchrun and srun are detected from their environment. "
        "Rank 0 binds a port the kernel picks and publishes it to the others, so jobs started at once never clash.",
        ("tests/test_cli.py::test_smoke_command_runs_on_four_processes",
         "tests/test_cli.py::test_four_jobs_started_at_once_all_start",
         "tests/test_cli.py::test_a_job_starts_even_when_another_process_binds_the_port_its_ranks_were_told"),
        config="--nproc N or distributed.nproc",
    ),
    Feature(
        "Failing rank ends the job", "runtime", TESTED_CPU,
        "An exception on any rank stops every rank with a non-zero exit and prints that rank's traceback once; a rank "
        "that exits 0 before its work is done (os._exit or a C library's exit(0) in a reward or tool) fails the job "
        "with one line naming the rank, the call site where Python made it, and the step and phase.",
        ("tests/test_cli.py::test_rank_that_raises_ends_job_with_its_traceback",
         "tests/test_cli.py::test_a_reward_that_ends_the_process_with_code_0_fails_the_job_naming_the_rank_and_phase",
         "tests/test_cli.py::test_rank_that_hangs_is_stopped_by_the_timeout"),
        config="distributed.timeout_s",
    ),
    Feature(
        "Resolved values with their origin", "runtime", TESTED_CPU,
        "Every auto and derived value (device, backend, dtype, layer implementation, rollout engine, old-log-prob "
        "source, rollout batch, micro-batch token budget) is resolved in one place for this machine and world "
        "size, before launch; validation checks the resolved values; train, score and generate read them (score "
        "and generate for their own inputs); the trainer prints them with their origin, and config.yaml lists "
        "them as comments.",
        ("tests/test_resolve.py::test_nothing_auto_is_left_and_resolving_again_changes_nothing",
         "tests/test_resolve.py::test_each_value_says_where_it_came_from",
         "tests/test_resolve.py::test_the_token_budget_is_resolved_before_launch_for_the_job",
         "tests/test_resolve.py::test_config_yaml_keeps_what_was_asked_and_notes_what_it_resolved_to"),
        config="(always on); any key left at auto",
    ),
    Feature(
        "Config validation", "runtime", TESTED_CPU,
        "Unknown keys, wrong types, values outside a key's choices or range (every number has one the runtime "
        "takes: timeouts, seeds, counts; no NaN or infinity), impossible layouts, and what a training config points "
        "at (prompt and evaluation files: every line parsed as the loader parses it, of files up to 1 GiB, the first "
        "GiB of larger ones; reward function, tokenizer and its vocabulary, model directories) fail before any "
        "process starts: one line naming the key (or file and line), the value and the fix, exit code 2.",
        ("tests/test_config.py::test_bad_layouts_are_rejected_with_the_key",
         "tests/test_cli.py::test_bad_override_exits_2_with_one_line",
         "tests/test_validation.py::test_unknown_choice_is_refused_with_the_choices",
         "tests/test_validation.py::test_out_of_range_number_is_refused",
         "tests/test_validation.py::test_prompt_file_whose_first_record_does_not_parse",
         "tests/test_validation.py::test_reward_that_does_not_resolve",
         "tests/test_validation.py::test_tokenizer_vocabulary_larger_than_the_model",
         "tests/test_validation.py::test_train_refuses_before_starting_any_process",
         "tests/test_config_bounds.py::test_every_numeric_key_declares_a_range_the_runtime_takes",
         "tests/test_config_bounds.py::test_validate_refuses_extreme_values_with_one_line",
         "tests/test_prompt_file_check.py::test_validate_names_a_bad_line_500",
         "tests/test_prompt_file_check.py::test_train_stops_on_line_500_before_any_rank_starts"),
        config="megatron-rl validate CONFIG --world-size N",
    ),
    Feature(
        "Tool paths checked before launch", "runtime", TESTED_CPU,
        "score, generate and convert check what they are given before any rank starts: the --hf-model directory, "
        "the --input file, the --checkpoint (and its --part), and that --output / --out / --hf-out can be written "
        "without mixing with earlier files; one line naming the flag and the fix, exit code 2.",
        ("tests/test_export_tools.py::test_bad_tool_paths_exit_2_in_one_line_before_any_rank_starts",),
        config="(always on)",
    ),
    Feature(
        "Host-side collectives on NCCL-only groups", "runtime", GPU_UNTESTED,
        "Metrics, agreed micro-batch counts, stop flags, rollout and reward gathers, output and weight gathers over "
        "PP, and checkpoint barriers all go through megatron_rl/distributed/collectives.py, which puts host values on "
        "a device the group's backend serves (CPU for gloo, the rank's GPU for NCCL). On CPU: the routing is checked "
        "while the call sites run and over the source, and the placement on a gloo group registered for CUDA only; "
        "on NCCL a world of one GPU ran a PPO job with checkpoint barriers (benchmarks/gpu_check.py, H200); NCCL "
        "between several GPUs not yet run.",
        ("tests/test_collectives.py::test_module_puts_host_values_where_the_group_needs_them",
         "tests/test_collectives.py::test_host_side_collectives_go_through_the_module",
         "tests/test_collectives.py::test_no_collective_in_the_package_bypasses_the_module"),
        config="distributed.backend=nccl (auto on CUDA)",
    ),
    Feature(
        "bf16 end to end", "runtime", TESTED_GPU,
        "model.params_dtype=bfloat16 for PPO (actor, critic, reference; the first update starts from the loaded "
        "weights: the optimizer's fp32 master copies are refreshed after every load), checkpoints saved, resumed "
        "(bit-identical) and resharded (weights, fp32 master weights and Adam state bit for bit; the critic's fp32 "
        "value head next to bf16 weights), the distributed optimizer, score, CP (ring, all_gather) and the log-prob "
        "head, against fp32 on one process. On one H200 (torch 2.11, NCCL, local spec): a GRPO step of a 0.55B "
        "model with a reference model, checkpoint, resume and a second step; score against HF in bf16.",
        ("tests/test_bf16.py::test_bf16_matches_fp32_one_process",
         "tests/test_bf16.py::test_bf16_resume_same_layout_is_bit_identical",
         "tests/test_bf16.py::test_bf16_checkpoint_reshards_weights_master_weights_and_adam_state_exactly",
         "tests/test_bf16.py::test_bf16_distributed_optimizer_state_reshards_exactly",
         "tests/test_bf16.py::test_bf16_score_matches_hf_transformers",
         "tests/test_seeded_init.py::test_bf16_updates_start_from_the_loaded_weights"),
        config="model.params_dtype=bfloat16 (auto on CUDA)",
        measured=(Measured("bf16 vs fp32 on CP2, CP4, TP2xCP2: log-probs <= 2.6e-3, values <= 5e-3 and gradients <= "
                           "8.3e-3 of their largest, loss <= 1.7e-3; score vs HF fp32 3.6e-3",
                           "pytest -s tests/test_bf16.py -k 'matches_fp32 or score'"),
                  Measured("H200, bf16: score vs HF transformers bf16 max |dlogp| 0.0079 (vs HF fp32 on the same "
                           "weights 0.0059); GRPO step of 0.55B 4.1 s after warm-up, peak 14.75 GiB (planner 15.86)",
                           "python benchmarks/gpu_check.py (docs/gpu_check.md)")),
    ),
    Feature(
        "No host syncs per layer", "runtime", TESTED_CPU,
        "cu_seqlens carry their host values with the micro-batch (our attention and megatron's unfused THD RoPE read "
        "those), the ring's tile plan and device positions are made once per micro-batch; host copies to CUDA are "
        "pinned and non-blocking (the loss's per-sequence lengths included); a micro-batch's per-token outputs come "
        "back to the host in one copy, not one per sequence.",
        ("tests/test_host_syncs.py::test_value_reads_do_not_grow_with_the_number_of_layers",
         "tests/test_host_syncs.py::test_the_update_reads_back_once_per_micro_batch_not_once_per_sequence"),
        config="(always on)",
        measured=(Measured("device reads per packed CP2 forward+backward: 52 (2 layers) / 90 (4 layers) before, 6 / 6 "
                           "after",
                           "pytest -s tests/test_host_syncs.py"),),
    ),
    Feature(
        "GPU-grade layer settings", "runtime", TESTED_GPU,
        "On CUDA: bias-activation, bias-dropout and masked-softmax fusion, RoPE fusion with TE, gradient-accumulation "
        "fusion with Apex, weights initialised on the device, TF32 allowed; CPU settings unchanged. The "
        "TransformerConfig for a CUDA device is unit-tested without one; on an H200 without TE or Apex the "
        "megatron fusions, device initialisation and TF32 trained, saved and resumed (docs/gpu_check.md); the TE "
        "and Apex settings not yet run. megatron's torch.compile'd fused kernels compile at their first call "
        "with the token dimension symbolic: one graph for every length (dynamo alone compiled a static one, then "
        "a dynamic one at the second length; checked on CPU, the time it saves on a GPU not yet measured).",
        ("tests/test_gpu_check.py::test_transformer_config_for_a_cuda_device_without_one",
         "tests/test_gpu_check.py::test_cuda_settings_follow_the_installed_kernels",
         "tests/test_compat.py::test_deferred_compile_makes_one_graph_for_every_length"),
        config="distributed.device=cuda (auto with CUDA)",
    ),
    Feature(
        "One-GPU check (benchmarks/gpu_check.py)", "runtime", TESTED_GPU,
        "World size 1 on NCCL: a bf16 PPO step with checkpoint save and load, score vs HF in bf16, the SDPA backend of "
        "each attention path, actor-update MFU against plain megatron-core, peak memory against the planner, "
        "generation tokens/s. Without CUDA it says so and exits 0. Run on an H200 (torch 2.11, megatron-core "
        "0.19.2, no TE): every row filled, table in docs/gpu_check.md. Its (g) rows (the update against "
        "megatron-core's own step at a Qwen2.5-1.5B shape) are checked on the CPU only, not yet run on a GPU.",
        ("tests/test_gpu_check.py::test_without_cuda_it_prints_one_line_and_exits_0",
         "tests/test_gpu_check.py::test_cpu_dry_run_fills_every_row"),
        config="python benchmarks/gpu_check.py",
        measured=(Measured("H200: whole check 141 s; actor update 29-32 TFLOP/s (0.35x a plain megatron-core "
                           "fwd+bwd of the same shape); peak 14.75 GiB against the planner's 15.86 GiB",
                           "python benchmarks/gpu_check.py"),),
    ),
    Feature(
        "Actor update against megatron-core's own training step (benchmarks/update_vs_plain.py)", "runtime",
        TESTED_CPU,
        "On the same packed micro-batches and weights: megatron-core's step as pretrain_gpt runs it (GPTModel, its "
        "vocab-parallel cross-entropy, DDP, optimizer, forward_backward_func) against the actor update with each "
        "RL piece switched on in turn (log-probs, entropy, PPO loss and masks, KL, metrics; logits kept or "
        "recomputed), and the experience forwards against megatron's forward; the two losses are checked equal. "
        "The same rows run in benchmarks/gpu_check.py (g) at a Qwen2.5-1.5B shape; not yet run on a GPU.",
        ("tests/test_update_speed.py::test_update_benchmark_compares_the_same_loss_on_the_same_weights",
         "tests/test_gpu_check.py::test_cpu_dry_run_fills_every_row"),
        config="python benchmarks/update_vs_plain.py",
        measured=(Measured("CPU (2 cores, fp32, 8 layers, hidden 1024, vocabulary 32k, 1,766 tokens in 2 "
                           "micro-batches): the whole actor update 0.93x megatron-core's step (0.83-0.84x before the "
                           "update-speed changes), the experience forwards 1.01-1.02x its forward; losses equal within "
                           "9.5e-7; build + load 1.4-1.8x megatron's dist_checkpointing (2.03x before)",
                           "python benchmarks/update_vs_plain.py --model cpu --rounds 5 --build-and-load"),),
    ),
    Feature(
        "Non-finite gradients skip the update", "runtime", TESTED_CPU,
        "A NaN/inf gradient norm skips the optimizer step and is reported as actor/skipped_updates, "
        "critic/skipped_updates; a PPO step in which every actor or critic step was skipped stops the run with one "
        "line naming the likely cause (exit 2) instead of logging nulls. The check costs nothing extra: the step "
        "is megatron's optimizer step in its pieces, each once (one gradient norm a step, the clip by it), bit for "
        "bit megatron's own step().",
        ("tests/test_parallel_parity.py::test_non_finite_gradients_skip_the_update",
         "tests/test_trainer_guards.py::test_run_whose_critic_updates_are_all_non_finite_stops_with_one_line",
         "tests/test_update_speed.py::test_optimizer_step_is_megatrons_with_one_gradient_norm"),
        config="(always on)",
    ),
    Feature(
        "Metrics, plot, TensorBoard, W&B", "runtime", TESTED_CPU,
        "metrics.jsonl per step (reward, lengths, losses, KL, entropy, clipfrac, grad norms, explained variance, "
        "timings, throughput, memory), console progress, plot.png; TensorBoard/W&B optional.",
        ("tests/test_ppo.py::test_ppo_two_steps_on_parallel_layouts", "tests/test_ppo.py::test_run_ppo_sh_demo_learns",
         "tests/test_evaluation.py::test_metrics_writer_sends_the_step_zero_evaluation_to_tensorboard_and_the_plot"),
        config="trainer.tensorboard, trainer.wandb, trainer.plot",
    ),
    Feature(
        "Trained-sample log (trainer.log_samples)", "runtime", TESTED_CPU,
        "Every trained sample as one JSON line in <run dir>/samples/step_<k>.jsonl: its id (<batch>-<row>, kept by a "
        "batch generated ahead and held in a checkpoint), the step that trained it, the policy version that "
        "generated it (its oldest token's with partial rollouts, and the versions of its tokens), prompt, response, "
        "reward, mean advantage; verl's trainer.rollout_data_dir. A resumed run rewrites the steps it redoes, so an "
        "async job killed and resumed holds every sample id once.",
        ("tests/test_generator_ranks.py::test_async_staleness_stays_bounded_and_a_killed_job_resumes_exactly",),
        config="trainer.log_samples=true",
    ),
    Feature(
        "CPU demo that learns", "runtime", TESTED_CPU,
        "./run_ppo.sh without a GPU: PPO (GAE + KL) on add_small, TP2xPP2 on 4 gloo ranks; reward rises by more than "
        "0.3 in about 5 minutes on 2 cores.",
        ("tests/test_ppo.py::test_run_ppo_sh_demo_learns",),
        config="configs/demo_cpu.yaml",
    ),
]
