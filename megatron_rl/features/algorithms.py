"""Algorithms: advantage estimators, policy losses, KL, clipping, recipes."""

from __future__ import annotations

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from megatron_rl.algorithms.kl import KL_ESTIMATORS
from megatron_rl.algorithms.losses import AGG_MODES, POLICY_LOSSES
from megatron_rl.algorithms.old_logprobs import training_forward_blockers
from megatron_rl.features.base import TESTED_CPU, Feature, _needs_groups, _registry_names, need
from megatron_rl.layout.arch import is_moe

AREA = "algorithms"
FEATURES = [
    Feature(
        "PPO with a critic (GAE)", "algorithms", TESTED_CPU,
        "Clipped surrogate (asymmetric clip_low/clip_high), GAE with optional whitening, clipped value loss.",
        ("tests/test_ppo.py::test_ppo_two_steps_on_parallel_layouts", "tests/test_algorithms.py::test_gae_discounted"),
        config="algorithm.advantage=gae",
    ),
    Feature(
        "Algorithm registries", "algorithms", TESTED_CPU,
        "One decorator per entry; the schema's choices, validation and the trainer read them, so a new estimator or "
        "loss is a one-file change. "
        "Advantage estimators: " + _registry_names(ADVANTAGE_ESTIMATORS)
        + "; policy losses: " + _registry_names(POLICY_LOSSES)
        + "; KL estimators: " + _registry_names(KL_ESTIMATORS) + "; loss aggregations: " + _registry_names(AGG_MODES)
        + ". Formulas and configs: docs/algorithms.md.",
        ("tests/test_algorithm_registries.py::test_every_registry_is_what_the_schema_accepts",
         "tests/test_algorithm_registries.py::test_new_estimator_is_a_one_file_change",
         "tests/test_algorithm_registries.py::test_new_policy_loss_is_a_one_file_change"),
        (
            _needs_groups(),
            need("algorithm.dual_clip", lambda c, w: POLICY_LOSSES[c.algorithm.policy_loss].uses_dual_clip,
                 "algorithm.policy_loss={c.algorithm.policy_loss} has no dual clip", "set algorithm.dual_clip=null",
                 "dual_clip only with a loss that uses it (ppo)", when=lambda c: c.algorithm.dual_clip is not None),
        ),
        config="algorithm.advantage, policy_loss, kl_kind, loss_agg",
    ),
    Feature(
        "GRPO (no critic)", "algorithms", TESTED_CPU,
        "Group-normalised sequence returns (unbiased std), no value model. Group statistics in float64 around the "
        "group's minimum, so an all-equal group gets exactly 0; with kl_in_reward the return is the sum of the "
        "KL-penalised token rewards.",
        ("tests/test_ppo.py::test_grpo_runs_without_a_critic",
         "tests/test_algorithms.py::test_all_equal_group_of_16_gets_exactly_zero_advantage_in_fp32",
         "tests/test_algorithms.py::test_kl_in_reward_reaches_grpo_and_rloo_advantages"),
        config="algorithm.advantage=grpo",
    ),
    Feature(
        "RLOO (no critic)", "algorithms", TESTED_CPU,
        "Leave-one-out baseline over the samples of a prompt.",
        ("tests/test_algorithms.py::test_rloo_hand_case",
         "tests/test_algorithms.py::test_kl_in_reward_reaches_grpo_and_rloo_advantages"),
        config="algorithm.advantage=rloo",
    ),
    Feature(
        "Dr.GRPO", "algorithms", TESTED_CPU,
        "Group mean baseline without std normalisation, with the seq-mean-token-sum-norm aggregation (token sums over "
        "a constant, rollout.max_new_tokens).",
        ("tests/test_estimators_and_losses.py::test_drgrpo_against_formula",
         "tests/test_estimators_and_losses.py::test_seq_mean_token_sum_norm_against_formula",
         "tests/test_estimators_and_losses.py::test_loss_gradients_do_not_depend_on_how_the_batch_is_cut"),
        config="algorithm.advantage=drgrpo, algorithm.loss_agg=seq-mean-token-sum-norm",
    ),
    Feature(
        "REINFORCE++ (no critic)", "algorithms", TESTED_CPU,
        "Discounted reward-to-go of the token rewards (KL in the reward), whitened over the batch.",
        ("tests/test_estimators_and_losses.py::test_reinforce_plus_plus_against_formula",
         "tests/test_recipes.py::test_cpu_recipe_runs_two_steps"),
        config="algorithm.advantage=reinforce_plus_plus (configs/reinforce_pp_cpu.yaml)",
    ),
    Feature(
        "REINFORCE++ with baseline", "algorithms", TESTED_CPU,
        "Sequence return minus the group mean, broadcast over tokens, whitened over the batch.",
        ("tests/test_estimators_and_losses.py::test_reinforce_plus_plus_baseline_against_formula",),
        config="algorithm.advantage=reinforce_plus_plus_baseline",
    ),
    Feature(
        "GSPO (sequence-level ratio)", "algorithms", TESTED_CPU,
        "PPO clip on the length-normalised sequence ratio exp(mean_t log(pi/pi_old)) (value per sequence, gradient "
        "through each token); the sequence sum is reduced over the CP group, so gradients do not depend on "
        "micro-batches, DP or CP.",
        ("tests/test_estimators_and_losses.py::test_gspo_hand_case",
         "tests/test_estimators_and_losses.py::test_gspo_against_formula",
         "tests/test_estimators_and_losses.py::test_loss_gradients_do_not_depend_on_how_the_batch_is_cut",
         "tests/test_recipes.py::test_gspo_recipe_learns"),
        config="algorithm.policy_loss=gspo (configs/gspo_cpu.yaml)",
    ),
    Feature(
        "CISPO", "algorithms", TESTED_CPU,
        "-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi: the clipped IS weight is a constant, so no token "
        "loses its gradient.",
        ("tests/test_estimators_and_losses.py::test_cispo_hand_case",
         "tests/test_estimators_and_losses.py::test_cispo_against_formula",
         "tests/test_estimators_and_losses.py::test_loss_gradients_do_not_depend_on_how_the_batch_is_cut"),
        config="algorithm.policy_loss=cispo",
    ),
    Feature(
        "DAPO dynamic sampling", "algorithms", TESTED_CPU,
        "Groups whose rewards are all equal are dropped and further prompt batches sampled until prompts_per_step "
        "groups remain; at most dynamic_sampling_max_rounds rounds, then the batch is filled with dropped groups, so "
        "the batch size never changes. Logged: dynamic_sampling/rounds, prompts_drawn, kept/dropped/padded groups, "
        "reward/drawn_mean.",
        ("tests/test_recipes.py::test_dynamic_sampling_keeps_the_batch_size_and_terminates",
         "tests/test_recipes.py::test_dynamic_sampling_fills_up_with_dropped_groups_at_the_bound",
         "tests/test_recipes.py::test_dapo_recipe_learns"),
        (
            need("rollout.n", lambda c, w: c.rollout.n >= 2, "dynamic sampling compares the rewards of a prompt's "
                                                             "samples",
                 "set rollout.n >= 2 or algorithm.dynamic_sampling=false", "dynamic sampling needs rollout.n >= 2",
                 when=lambda c: c.algorithm.dynamic_sampling),
        ),
        config="algorithm.dynamic_sampling=true, dynamic_sampling_max_rounds (configs/dapo_cpu.yaml)",
    ),
    Feature(
        "DAPO overlong reward shaping", "algorithms", TESTED_CPU,
        "A penalty growing linearly from 0 to overlong_penalty over the last overlong_buffer tokens before "
        "rollout.max_new_tokens, added to the score.",
        ("tests/test_estimators_and_losses.py::test_overlong_penalty_hand_values",
         "tests/test_recipes.py::test_dapo_recipe_learns"),
        (
            need("algorithm.overlong_buffer", lambda c, w: c.algorithm.overlong_buffer <= c.rollout.max_new_tokens,
                 "the overlong buffer is longer than rollout.max_new_tokens={c.rollout.max_new_tokens}",
                 "set algorithm.overlong_buffer <= rollout.max_new_tokens", "overlong_buffer <= max_new_tokens"),
        ),
        config="algorithm.overlong_buffer, overlong_penalty",
    ),
    Feature(
        "Old log-prob source (on-policy shortcut)", "algorithms", TESTED_CPU,
        "algorithm.old_logprobs: auto (default) takes the PPO ratio's old log-probs from the update's own forward, "
        "detached, when the update is exactly on-policy (one epoch, one mini-batch, no rollout correction, no KL in "
        "the reward): the same loss and gradients as recomputing them, one actor forward fewer per step; otherwise it "
        "recomputes them. recompute and rollout (the engine's log-probs) on request.",
        ("tests/test_ppo.py::test_on_policy_shortcut_gives_the_recompute_gradients_with_one_forward_fewer",
         "tests/test_ppo.py::test_old_logprob_source_keeps_the_recompute_pass_where_the_update_needs_it"),
        (
            need("algorithm.old_logprobs", lambda c, w: not training_forward_blockers(c.algorithm),
                 "the update's forward gives the old log-probs only when it is exactly on-policy and nothing reads "
                 "them before the update (ppo_epochs=1, mini_batches=1, rollout_correction.mode=off, no KL in the "
                 "reward, no algorithm.distill)",
                 "use algorithm.old_logprobs=auto (it recomputes them here) or recompute",
                 "training_forward: ppo_epochs=1, mini_batches=1, no rollout correction, no KL in the reward, no "
                 "distillation",
                 when=lambda c: c.algorithm.old_logprobs == "training_forward"),
            need("algorithm.old_logprobs", lambda c, w: c.algorithm.rollout_correction.mode == "off",
                 "rollout correction weighs the trainer's log-probs against the rollout's, which are the old ones here",
                 "use algorithm.old_logprobs=auto or recompute, or algorithm.rollout_correction.mode=off",
                 "rollout: no rollout correction", when=lambda c: c.algorithm.old_logprobs == "rollout"),
        ),
        config="algorithm.old_logprobs=auto (default) | recompute | training_forward | rollout",
    ),
    Feature(
        "Rollout correction (IS / TIS / MIS, decoupled PPO)", "algorithms", TESTED_CPU,
        "Importance weights exp(logp_trainer - logp_rollout) per token or per sequence, plain (is), truncated (tis) "
        "or masked (mis) at a threshold, multiply the policy loss; is with old_logprobs=recompute is the decoupled "
        "PPO objective (ratio clipped against the proximal policy, weighted by proximal / behaviour); logged: "
        "rollout_correction/weight_mean, weight_max, truncated_frac, masked_frac or above_threshold_frac. The "
        "default, auto, is resolved before launch: off for trainer.mode=sync, decoupled PPO for stale batches (is "
        "for one_step_off and async with max_staleness 1, tis for async with max_staleness > 1); set it for bf16 "
        "or external engines.",
        ("tests/test_estimators_and_losses.py::test_rollout_correction_tis_and_mis_token_and_sequence",
         "tests/test_estimators_and_losses.py::test_decoupled_ppo_is_ppo_against_the_proximal_policy_times_the_"
         "behaviour_weight",
         "tests/test_estimators_and_losses.py::test_loss_gradients_do_not_depend_on_how_the_batch_is_cut",
         "tests/test_recipes.py::test_rollout_correction_and_overlong_shaping_in_a_run",
         "tests/test_resolve.py::test_stale_modes_default_to_decoupled_ppo_and_sync_to_no_correction"),
        config="algorithm.rollout_correction.mode, level, threshold",
    ),
    Feature(
        "Dual clip", "algorithms", TESTED_CPU,
        "Bound the loss of negative-advantage tokens at dual_clip * |A|.",
        ("tests/test_algorithms.py::test_policy_loss_batch_with_dual_clip",),
        config="algorithm.dual_clip",
    ),
    Feature(
        "KL penalty (loss or reward; registered estimators; fixed/adaptive)", "algorithms", TESTED_CPU,
        "KL to a frozen reference model as a loss term or a per-token reward penalty, fixed or adaptive coefficient; "
        "estimators k1/kl, k2/mse, k3/low_var_kl (bounded to [0, 10] like verl), abs, k3+ (k3's value, k2's gradient).",
        ("tests/test_algorithms.py::test_adaptive_controller_update_and_state",
         "tests/test_ppo.py::test_ppo_two_steps_on_parallel_layouts",
         "tests/test_algorithms.py::test_k3_is_bounded_to_ten_like_verl_and_its_gradient",
         "tests/test_estimators_and_losses.py::test_kl_estimators_against_formula"),
        (
            need("algorithm.kl_target",
                 lambda c, w: c.algorithm.kl_target is not None and c.algorithm.kl_horizon is not None,
                 "the adaptive controller needs kl_target and kl_horizon",
                 "set algorithm.kl_target and algorithm.kl_horizon",
                 "adaptive needs kl_target and kl_horizon", when=lambda c: c.algorithm.kl_controller == "adaptive"),
        ),
        config="algorithm.kl_coef, kl_kind, kl_in_reward, kl_controller",
    ),
    Feature(
        "Entropy bonus", "algorithms", TESTED_CPU,
        "coef * entropy subtracted from the policy loss, same aggregation and denominator.",
        ("tests/test_algorithms.py::test_entropy_bonus_shares_the_policy_denominator",),
        config="algorithm.entropy_coef",
    ),
    Feature(
        "Loss aggregation with global normalisation", "algorithms", TESTED_CPU,
        "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm; divided once by the "
        "mini-batch's global count, so gradients do not depend on micro-batches, DP or CP.",
        ("tests/test_ppo.py::test_gradients_do_not_depend_on_how_the_batch_is_cut",
         "tests/test_estimators_and_losses.py::test_loss_gradients_do_not_depend_on_how_the_batch_is_cut"),
        config="algorithm.loss_agg",
    ),
    Feature(
        "Algorithm recipes", "algorithms", TESTED_CPU,
        "configs/grpo_cpu.yaml, dapo_cpu.yaml, gspo_cpu.yaml, reinforce_pp_cpu.yaml on the built-in add_small task "
        "(one CPU process); "
        "the same algorithms for Qwen2.5-7B at 32k tokens on 8 GPUs (qwen2.5_7b_32k.yaml is GRPO; dapo_, gspo_, "
        "reinforce_pp_qwen2.5_7b_32k.yaml), validated only.",
        ("tests/test_recipes.py::test_cpu_recipe_runs_two_steps",
         "tests/test_recipes.py::test_gpu_recipes_validate_for_eight_gpus"),
        config="--config configs/<recipe>.yaml",
    ),
    Feature(
        "Routing replay", "algorithms", TESTED_CPU,
        "algorithm.routing_replay=true: the routers record each token's experts per MoE "
        "layer while the engine generates (prefill and decode, across evictions), keyed by (sample, position; copied "
        "to the host without a wait per layer and step, written once the rollout ends), and the recordings travel with "
        "the samples (exchanged over each pipeline stage's TP x DP x CP ranks); the old-log-prob forward and every "
        "training forward of the step route to them (weights recomputed at those experts), also when full recompute "
        "re-runs a layer in backward, so routing adds nothing to the rollout/train mismatch; "
        "actor/routing_replay_mismatch is the share of (token, layer) pairs whose recomputed top-k differs from the "
        "rollout's. Host memory per rank: tokens x MoE "
        "layers of its stage x top-k x 2 bytes.",
        ("tests/test_moe.py::test_routing_replay_reproduces_the_recorded_routing",
         "tests/test_moe.py::test_routing_replay_with_full_recompute_gives_the_same_gradients",
         "tests/test_moe.py::test_rollout_records_the_routing_the_trainer_replays",
         "tests/test_moe.py::test_grpo_learns_on_a_tiny_moe"),
        (
            need("algorithm.routing_replay", lambda c, w: is_moe(c.model), "routing replay needs an MoE model",
                 "set algorithm.routing_replay=false", "needs model.moe.num_experts",
                 when=lambda c: c.algorithm.routing_replay),
        ),
        config="algorithm.routing_replay=true",
    ),
    Feature(
        "Engine routing replay", "algorithms", TESTED_CPU,
        "megatron-core's own routing record (moe_enable_routing_replay: routing_indices per finished request) compared "
        "with the routers' on the same generation (one process and PP2 x EP2): the same experts for every token it "
        "covers, but in megatron-core 0.19.2 it is lost for evicted requests and for requests whose KV blocks go to a "
        "waiting request in the step they finish (1/10 requests without evictions, 5/10 with a tight KV cache), so the "
        "rollout's routing (RolloutBatch.routing) stays the routers' own; MegatronRolloutEngine.megatron_routing turns "
        "megatron's on for the comparison (compat: inference.routing_indices_incomplete).",
        ("tests/test_moe.py::test_megatron_routing_indices_are_ours_where_recorded_and_lost_for_some_requests",
         "tests/test_moe.py::test_rollout_records_the_routing_the_trainer_replays"),
        config="(diagnostic: MegatronRolloutEngine.megatron_routing)",
    ),
]
