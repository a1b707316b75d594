"""Memory: recompute, offload, the distributed optimizer, the planner."""

from __future__ import annotations

from megatron_rl.features.base import GPU_UNTESTED, TESTED_CPU, Feature, Measured, _uses_te, need
from megatron_rl.layout.arch import RECOMPUTE_MODULES

AREA = "memory"
FEATURES = [
    Feature(
        "Activation recompute", "memory", TESTED_CPU,
        "Megatron full (uniform/block) or selective recompute, passed through to TransformerConfig.",
        ("tests/test_parallel_parity.py::test_recompute_full_and_selective_match",),
        (
            need("model.recompute.modules",
                 lambda c, w: set(c.model.recompute.modules) <= set(RECOMPUTE_MODULES),
                 "unknown selective-recompute module", f"use a subset of [{', '.join(RECOMPUTE_MODULES)}]",
                 f"modules within {{{', '.join(RECOMPUTE_MODULES)}}}",
                 when=lambda c: c.model.recompute.granularity == "selective"),
            need("model.recompute.modules",
                 lambda c, w: not ({"mlp", "layernorm"} & set(c.model.recompute.modules)),
                 "recompute of mlp/layernorm modules needs TransformerEngine in megatron-core 0.19 (and hangs with "
                 "linear biases)",
                 "use modules=[core_attn] or granularity=full", "selective mlp/layernorm recompute needs TE",
                 when=lambda c: c.model.recompute.granularity == "selective" and not _uses_te(c)),
        ),
        config="model.recompute.*",
    ),
    Feature(
        "Log-prob head in the model dtype", "memory", TESTED_CPU,
        "bf16 models multiply in bf16 with fp32 accumulation; log-softmax, entropy and the logit gradient are fp32 "
        "inside each chunk; no fp32 copy of the [V/TP, h] output weight.",
        ("tests/test_greedy_and_dtype.py::test_bf16_head_against_float64",
         "tests/test_greedy_and_dtype.py::test_bf16_forward_makes_no_fp32_copy_of_the_weight",
         "tests/test_logprob_op.py::test_bf16_tensor_parallel_shards_against_float64"),
        config="model.params_dtype=bfloat16",
        measured=(Measured("bf16 log-probs within 2.5e-2 of float64 at T=1 (bound 2*2^-8*max|logit|/T); gradients "
                           "within 0.82%",
                           "pytest -s tests/test_greedy_and_dtype.py -k bf16"),),
    ),
    Feature(
        "Offload between phases", "memory", GPU_UNTESTED,
        "Models not used by the running phase (weights, DDP grad buffers, optimizer state) wait in host memory; "
        "storages are freed in place so megatron's views stay valid. Numbers unchanged (tested on CPU); the memory "
        "saving is measured only on GPU.",
        ("tests/test_ppo.py::test_offload_between_phases_changes_no_number",
         "tests/test_ppo.py::test_offloader_frees_device_storage_and_restores_it_in_place"),
        config="trainer.offload=true",
    ),
    Feature(
        "Distributed optimizer", "memory", TESTED_CPU,
        "megatron-core's DistributedOptimizer: Adam state and fp32 master weights sharded over DP x CP ranks. Works "
        "with TE/Apex fused Adam or torch's Adam; checkpoints are fully reshardable (resume on another TP/PP/DP "
        "layout).",
        ("tests/test_parallel_parity.py::test_dp2_distributed_optimizer_step",
         "tests/test_ppo.py::test_distributed_optimizer_matches_plain_adam_and_resumes_exactly"),
        config="actor.optim.use_distributed_optimizer, critic.optim.use_distributed_optimizer",
        measured=(Measured("parameters after one Adam step within 3.7e-6 of one process (DP2)",
                           "pytest -s tests/test_parallel_parity.py -k distributed_optimizer"),),
    ),
    Feature(
        "Memory planner (megatron-rl plan)", "memory", TESTED_CPU,
        "Per-GPU memory by component for candidate TP/PP/CP/recompute/offload layouts, the recommended one with "
        "overrides, or the smallest node count that fits. Each row names its CP communication (p2p, a2a, "
        "a2a+p2p with its sizes), the training peak, the total and what is left of the budget (90% of the GPU); "
        "the ranking rule that orders the rows is printed with them; columns stay aligned for MoE layouts. GPU "
        "figures unvalidated.",
        ("tests/test_planner.py::test_activation_estimate_within_1_percent_of_measurement",
         "tests/test_planner.py::test_qwen7b_at_32k_fits_one_node_of_8x80gb",
         "tests/test_planner.py::test_plan_rows_show_cp_comm_margin_and_the_ranking_rule",
         "tests/test_planner.py::test_plan_columns_line_up_on_an_moe_plan"),
        config="megatron-rl plan --model ... --response-len ...",
        measured=(Measured("activation and log-prob estimates within 1% of CPU measurement on the benchmark model",
                           "pytest -s tests/test_planner.py -k measurement"),),
    ),
    Feature(
        "Recipes checked against the plan (megatron-rl plan --config)", "memory", TESTED_CPU,
        "--config plans for a recipe's prompt and response lengths, critic (the advantage estimator's) and "
        "reference (kl_coef > 0), and lists every key where the recipe differs from the recommendation (layout, "
        "recompute, distributed optimizer, offload, rollout engine and batch, token budget, MoE KV-cache bytes), "
        "exit 1; every GPU recipe in configs/ equals the plan for 8 x 80 GB.",
        ("tests/test_planner.py::test_plan_config_lists_the_keys_where_a_recipe_differs",
         "tests/test_recipes.py::test_gpu_recipe_equals_the_plan",
         "tests/test_recipes.py::test_a_recipe_off_the_plan_is_caught"),
        config="megatron-rl plan --model <preset> --config configs/<recipe>.yaml",
    ),
]
