"""Parallel layouts: tensor, sequence, pipeline (and virtual), data and expert parallelism."""

from __future__ import annotations

from megatron_rl.features.base import GPU_UNTESTED, TESTED_CPU, Feature, _heads_kv, _vpp_pass_sequences, need
from megatron_rl.models.arch import expert_ffn_size, is_moe

AREA = "layouts"
FEATURES = [
    Feature(
        "Tensor parallelism", "layouts", TESTED_CPU,
        "Megatron column/row-parallel linears and vocab-parallel embedding.",
        ("tests/test_parallel_parity.py::test_tp2_sequence_parallel",
         "tests/test_parallel_parity.py::test_tp2_pp2"),
        (
            need("parallel.tp", lambda c, w: c.model.num_attention_heads % c.parallel.tp == 0,
                 "model.num_attention_heads={c.model.num_attention_heads} is not divisible by tp",
                 "use a tp that divides the number of attention heads", "num_attention_heads % tp == 0"),
            need("parallel.tp", lambda c, w: _heads_kv(c) % c.parallel.tp == 0,
                 "KV heads (model.num_query_groups={c.model.num_query_groups}) are not divisible by tp",
                 "use a tp that divides the number of KV heads", "num_query_groups % tp == 0"),
            need("parallel.tp", lambda c, w: c.model.ffn_hidden_size % c.parallel.tp == 0,
                 "model.ffn_hidden_size={c.model.ffn_hidden_size} is not divisible by tp",
                 "use a tp that divides ffn_hidden_size", "ffn_hidden_size % tp == 0"),
        ),
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
        (
            need("parallel.pp", lambda c, w: c.model.num_layers % c.parallel.pp == 0,
                 "model.num_layers={c.model.num_layers} is not divisible by pp",
                 "use a pp that divides the number of layers", "num_layers % pp == 0"),
        ),
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
            need("parallel.vpp", lambda c, w: c.parallel.pp > 1,
                 "virtual pipeline stages need pipeline parallelism", "set parallel.pp>=2 or parallel.vpp=null",
                 "pp >= 2", when=lambda c: (c.parallel.vpp or 1) > 1),
            need("parallel.vpp", lambda c, w: c.model.num_layers % (c.parallel.pp * c.parallel.vpp) == 0,
                 "model.num_layers={c.model.num_layers} is not divisible by pp*vpp",
                 "choose pp*vpp that divides the number of layers", "num_layers % (pp*vpp) == 0",
                 when=lambda c: (c.parallel.vpp or 1) > 1),
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
        (
            need("parallel.ep", lambda c, w: is_moe(c.model), "expert parallelism needs an MoE model",
                 "set model.moe.num_experts (or model.hf_path to an MoE checkpoint), or parallel.ep=1",
                 "ep > 1 needs model.moe.num_experts", when=lambda c: c.parallel.ep > 1),
            need("parallel.ep", lambda c, w: c.model.moe.num_experts % c.parallel.ep == 0,
                 "model.moe.num_experts={c.model.moe.num_experts} is not divisible by ep",
                 "choose an ep that divides the number of experts", "num_experts % ep == 0",
                 when=lambda c: is_moe(c.model)),
            need("parallel.ep",
                 lambda c, w: w is None or w % ((c.parallel.etp or c.parallel.tp) * c.parallel.ep * c.parallel.pp) == 0,
                 "world size {w} is not divisible by etp*ep*pp (one copy of the experts spans etp x ep x pp ranks)",
                 "choose etp*ep*pp that divides {w}, e.g. ep = {w} / (etp*pp)", "world size divisible by etp*ep*pp"),
        ),
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
        (
            need("parallel.etp", lambda c, w: is_moe(c.model), "expert tensor parallelism needs an MoE model",
                 "set model.moe.num_experts, or parallel.etp=null", "etp needs model.moe.num_experts",
                 when=lambda c: c.parallel.etp is not None and c.parallel.etp != c.parallel.tp),
            need("parallel.etp", lambda c, w: expert_ffn_size(c.model) % (c.parallel.etp or c.parallel.tp) == 0,
                 "an expert's hidden units ({c.model.moe.ffn_hidden_size}) are not divisible by etp (null = tp)",
                 "choose an etp that divides model.moe.ffn_hidden_size", "moe.ffn_hidden_size % etp == 0",
                 when=lambda c: is_moe(c.model)),
            need("parallel.etp", lambda c, w: not c.model.add_bias_linear or (c.parallel.etp or c.parallel.tp) == 1,
                 "megatron-core supports MoE linear biases only with etp=1", "set parallel.etp=1",
                 "linear biases need etp=1", when=lambda c: is_moe(c.model)),
        ),
        config="parallel.etp",
    ),
]
