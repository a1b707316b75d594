"""Parallel layouts: tensor, sequence, pipeline (and virtual), data and expert parallelism."""

from __future__ import annotations

from megatron_rl.features.base import GPU_UNTESTED, TESTED_CPU, Feature, _vpp_pass_sequences, need, training_rule
from megatron_rl.layout.rules import EP_RULES, ETP_RULES, PP_RULES, TP_RULES, VPP_RULES

AREA = "layouts"
FEATURES = [
    Feature(
        "Tensor parallelism", "layouts", TESTED_CPU,
        "Megatron column/row-parallel linears and vocab-parallel embedding.",
        ("tests/test_parallel_parity.py::test_tp2_sequence_parallel",
         "tests/test_parallel_parity.py::test_tp2_pp2"),
        tuple(training_rule(rule) for rule in TP_RULES),
        config="parallel.tp",
    ),
    Feature(
        "Sequence parallelism", "layouts", TESTED_CPU,
        "Activations outside attention/MLP sharded over TP; norms marked so their grads are summed over TP. Ignored at "
        "tp=1.",
        ("tests/test_parallel_parity.py::test_tp2_sequence_parallel",),
        config="parallel.sequence_parallel=true",
    ),
    Feature(
        "Pipeline parallelism (1F1B)", "layouts", TESTED_CPU,
        "megatron-core's 1F1B schedule through get_forward_backward_func; variable-length micro-batches.",
        ("tests/test_parallel_parity.py::test_pp2_1f1b_four_microbatches",
         "tests/test_parallel_parity.py::test_tp2_pp2"),
        tuple(training_rule(rule) for rule in PP_RULES),
        config="parallel.pp",
    ),
    Feature(
        "Virtual pipeline (interleaved 1F1B)", "layouts", TESTED_CPU,
        "Several model chunks per pipeline rank. With PP=2 batched p2p is turned off: megatron-core gives silently "
        "wrong results there. Training passes run at least 2*pp micro-batches (with exactly pp megatron-core's "
        "schedule hangs), of any lengths (token budgets, the derived default).",
        ("tests/test_parallel_parity.py::test_pp2_vpp2",
         "tests/test_config.py::test_pp2_vpp_with_batched_p2p_is_rejected",
         "tests/test_cp_layouts.py::test_virtual_pipeline_with_data_dependent_micro_batches_matches_one_process"),
        (
            need("trainer.prompts_per_step", lambda c, w: _vpp_pass_sequences(c, w) >= 2 * c.parallel.pp,
                 "with virtual pipeline stages a training pass needs at least 2*pp micro-batches, but a data-parallel "
                 "rank gets fewer sequences per pass (prompts_per_step x rollout.n / data-parallel size / "
                 "algorithm.mini_batches; in the warm-up prompts_per_step / data-parallel size)",
                 "raise trainer.prompts_per_step (or rollout.n), lower algorithm.mini_batches, or parallel.vpp=null",
                 "sequences per training pass per data-parallel rank >= 2*pp",
                 when=lambda c: (c.parallel.vpp or 1) > 1),
            *(training_rule(rule) for rule in VPP_RULES),
            need("parallel.batch_p2p_comm", lambda c, w: not (c.parallel.pp == 2 and c.parallel.batch_p2p_comm),
                 "PP=2 with VPP and batched p2p gives silently wrong losses and gradients in megatron-core",
                 "set parallel.batch_p2p_comm=false (or leave it null), or use pp>=3",
                 "PP=2 needs batch_p2p_comm=false", when=lambda c: (c.parallel.vpp or 1) > 1),
        ),
        config="parallel.vpp",
    ),
    Feature(
        "Data parallelism (Megatron DDP)", "layouts", TESTED_CPU,
        "Megatron DistributedDataParallel with fp32 grad buffers; gradients normalised by the global token count.",
        ("tests/test_parallel_parity.py::test_dp2_ddp_optimizer_step",),
        config="derived: world size / (tp*pp*cp)",
    ),
    Feature(
        "DDP gradient-reduce overlap with buckets (CUDA)", "layouts", GPU_UNTESTED,
        "On CUDA gradients are reduced bucket by bucket while backward runs, optionally in bf16; the CPU keeps one "
        "reduction after backward in fp32. The settings are a pure function of the device; on gloo, the CUDA settings "
        "with ~8 buckets give one process's gradients (DP2, DP2 x PP2). Speed-up not yet measured on GPU.",
        ("tests/test_gpu_settings.py::test_ddp_config_overlaps_bucketed_reduction_on_cuda_only",
         "tests/test_gpu_settings.py::test_overlapped_bucketed_grad_reduce_gives_the_same_gradients"),
        config="actor.optim.overlap_grad_reduce, actor.optim.grad_reduce_bucket_size, actor.optim.grad_reduce_dtype "
               "(and critic.optim.*)",
    ),
    Feature(
        "Expert parallelism", "layouts", TESTED_CPU,
        "parallel.ep splits the routed experts of every MoE layer over ep ranks drawn from the data- and "
        "context-parallel ranks (megatron's expert rank generator: world = etp x ep x expert-DP x pp); their gradients "
        "are reduced over the expert data-parallel group by megatron's DDP, the distributed optimizer shards them "
        "there; checkpoints, HF import (each rank reads only its experts) and export work from and into any layout; "
        "the start-up layout line names ep (and etp when it is not tp).",
        ("tests/test_moe.py::test_loss_and_gradients_match_one_process",
         "tests/test_moe.py::test_score_matches_hf_on_expert_parallel_layouts",
         "tests/test_moe.py::test_distributed_optimizer_with_experts_matches_one_process",
         "tests/test_moe.py::test_convert_reshards_experts_between_layouts",
         "tests/test_moe.py::test_moe_layouts_are_refused_before_launch",
         "tests/test_moe.py::test_planner_counts_experts_per_rank_and_plans_qwen3_30b_a3b",
         "tests/test_moe.py::test_planner_moe_activations_match_a_measurement",
         "tests/test_runtime.py::test_the_layout_line_names_expert_parallelism",
         "tests/test_moe.py::test_score_and_generate_commands_on_pp2_ep2"),
        tuple(training_rule(rule) for rule in EP_RULES),
        config="parallel.ep",
    ),
    Feature(
        "MoE PP x EP", "layouts", TESTED_CPU,
        "Pipeline stages with expert parallelism train, score and generate (megatron's engine): on PP2 x EP2 the "
        "loss, router losses and gradients are one process's, score gives HF's log-probs, and greedy tokens and "
        "log-probs are one process's, also when one generator finishes first -- its ranks run megatron's dummy forward "
        "through both stages, keeping the other generator's expert exchanges in step; the rollout's routing replays.",
        ("tests/test_moe.py::test_megatron_engine_generates_on_expert_parallel_layouts_as_one_process",
         "tests/test_moe.py::test_score_and_generate_commands_on_pp2_ep2",
         "tests/test_moe.py::test_loss_and_gradients_match_one_process",
         "tests/test_moe.py::test_rollout_records_the_routing_the_trainer_replays"),
        config="parallel.pp > 1 with parallel.ep > 1",
    ),
    Feature(
        "Expert tensor parallelism", "layouts", TESTED_CPU,
        "parallel.etp splits each routed expert's FFN over etp ranks, independently of the attention's tp (e.g. tp=2 "
        "with etp=1: whole experts over more EP ranks).",
        ("tests/test_moe.py::test_loss_and_gradients_match_one_process",
         "tests/test_moe.py::test_score_matches_hf_on_expert_parallel_layouts"),
        tuple(training_rule(rule) for rule in ETP_RULES),
        config="parallel.etp",
    ),
    Feature(
        "Layout check of a config (megatron-rl check-layouts)", "layouts", TESTED_CPU,
        "Trains the config's model, shrunk to 4 layers and width 64 on CPU gloo ranks with its kinds kept (GQA "
        "ratio up to 4, MoE or dense, norm, activation, RoPE, tied embeddings, head dim), for N random layouts "
        "(TP/PP/VPP/CP/EP/ETP/SP/cp_comm_type, batch cuts, full recompute, distributed optimizer) that validate "
        "accepts, a few steps each; prints per layout the largest difference from one process of the loss, "
        "log-probs, entropy/values, gradients, gradient norm and updated weights against 1e-5, and a verdict: exit 0 "
        "all match, 1 one differs or fails, 2 bad input. Seeded (the seed is printed); the random-layout tests "
        "draw and compare with it. Runs on the CPU only.",
        ("tests/test_check_layouts.py::test_command_checks_two_layouts_of_a_tiny_config_and_prints_the_table",
         "tests/test_check_layouts.py::test_a_layout_beyond_the_tolerance_or_failing_fails_the_verdict",
         "tests/test_check_layouts.py::test_every_drawn_layout_is_one_validate_accepts_and_fills_the_world",
         "tests/test_cp_layouts.py::test_random_layout_matches_one_process"),
        config="megatron-rl check-layouts --config CONFIG --layouts N",
    ),
]
