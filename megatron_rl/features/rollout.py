"""Rollout: the generation engines and how one is chosen."""

from __future__ import annotations

from megatron_rl.config.choices import ASYNC, ONE_STEP_OFF
from megatron_rl.features.base import (
    GPU_UNTESTED,
    TESTED_CPU,
    Constraint,
    Feature,
    Measured,
    _old_logprob_source,
    need,
)
from megatron_rl.layout.rules import ROLLOUT_RULES
from megatron_rl.layout.sizes import ParallelLayout, shares_training_weights
from megatron_rl.rollout.choice import STATIC, batching_facts

AREA = "rollout"


def _filled(c) -> ParallelLayout:
    """rollout.layout with each unset size the training layout's."""
    return ParallelLayout.for_rollout(c.rollout.layout, c.parallel)


def shares_actor_shards(c) -> bool:
    """rollout.layout generates on the actor's own shards."""
    return shares_training_weights(_filled(c), c.parallel)


def _differs(c) -> bool:
    """rollout.layout is not the training layout's sizes (a second model, refit before each rollout)."""
    lay, p = _filled(c), c.parallel
    return (lay.tp, lay.pp, lay.ep, lay.expert_tp) != (p.tp, p.pp, p.ep, p.etp or p.tp)


def _rule(rule):
    """One of the :data:`~megatron_rl.layout.rules.ROLLOUT_RULES` as a check before launch, over the
    ranks that generate (the generator ranks when the job has its own, else the training world)."""
    return need(rule.key, lambda c, w: rule.holds(c.model, _filled(c), c.parallel, w), rule.problem,
                rule.fix, rule.text, when=lambda c: rule.applies(c.model, _filled(c)), generation=True,
                ranks=lambda c, w: c.rollout.ranks or w)


def _ahead(c) -> bool:
    """Batches are generated before the update they train after (one_step_off, async)."""
    return c.trainer.mode in (ONE_STEP_OFF, ASYNC)


def _static_fact(name: str):
    """Whether the fact ``name`` of :func:`~megatron_rl.rollout.choice.batching_facts` is absent (static
    batching can generate), for a config with rollout.batching=static."""
    return lambda c, w: not batching_facts(c, cuda=False)[name]


def _kernels_refused(cfg, world):
    """rollout.paged_attention named where it cannot run (flash-attn on the CPU or not installed)."""
    from megatron_rl.compat.paged_attention import paged_attention_refusal

    name = cfg.rollout.paged_attention
    refusal = paged_attention_refusal(name, cfg.distributed.device == "cuda")
    if not refusal:
        return None
    return "rollout.paged_attention", name, refusal, "set rollout.paged_attention=auto"


def _graphs_refused(cfg, world):
    """rollout.cuda_graphs=true where megatron's engine cannot replay graphs."""
    from megatron_rl.layout.arch import is_moe
    from megatron_rl.rollout.choice import cuda_graphs_refusal

    r = cfg.rollout
    if not r.cuda_graphs:
        return None
    problem = cuda_graphs_refusal(cuda=cfg.distributed.device == "cuda", batching=r.batching,
                                  kernels=r.paged_attention, moe=is_moe(cfg.model))
    if not problem:
        return None
    return "rollout.cuda_graphs", True, problem, "set rollout.cuda_graphs=null (on where they can run)"


PAGED_ATTENTION_CONSTRAINTS = (
    Constraint("rollout.paged_attention=flash_attn needs CUDA and flash-attn >= 2.7.3 (when generating)",
               _kernels_refused, "rollout.paged_attention", generation=True),
)
CUDA_GRAPH_CONSTRAINTS = (
    Constraint("rollout.cuda_graphs=true needs CUDA, dynamic batching, graph-safe kernels and a dense model "
               "(when generating)", _graphs_refused, "rollout.cuda_graphs", generation=True),
)


ROLLOUT_BATCHING_CONSTRAINTS = tuple(
    need("rollout.batching", _static_fact(fact), problem, "set rollout.batching=auto (the dynamic engine there)",
         f"static batching without {what}", when=lambda c: c.rollout.batching == STATIC, generation=True)
    for fact, what, problem in (
        ("moe", "MoE layers", "MoE layers need the dynamic engine (expert-parallel ranks step together)"),
        ("partial", "partial rollouts",
         "trainer.partial_rollouts needs the dynamic engine (requests re-prefilled on a weight push)"),
    )
)
ROLLOUT_LAYOUT_CONSTRAINTS = (
    *(_rule(rule) for rule in ROLLOUT_RULES),
    need("algorithm.routing_replay", lambda c, w: shares_actor_shards(c),
         "routing replay records the experts on the actor's own shards; rollout.layout generates on a second model",
         "set algorithm.routing_replay=false, or leave rollout.layout unset (the training layout, one chunk per rank)",
         "routing replay needs rollout.layout to share the training weights",
         when=lambda c: c.algorithm.routing_replay and not c.rollout.ranks, generation=True),
)
FEATURES = [
    Feature(
        "Greedy rollout (temperature 0)", "rollout", TESTED_CPU,
        "rollout.temperature=0 samples the argmax and scores log-probs at temperature 1; one rule shared by the "
        "sampler and the log-prob head, so a greedy PPO run trains.",
        ("tests/test_greedy_and_dtype.py::test_greedy_ppo_trains",
         "tests/test_greedy_and_dtype.py::test_head_at_temperature_zero_scores_at_temperature_one",
         "tests/test_greedy_and_dtype.py::test_sampling_at_temperature_zero_is_argmax_with_temperature_one_logprobs"),
        config="rollout.temperature=0",
    ),
    Feature(
        "Rollout with KV cache", "rollout", TESTED_CPU,
        "Batched sampling (temperature, top-p, top-k, EOS and stop sequences, n per prompt), seeded, by "
        "megatron-core's inference on the actor's own shards (or a model of its own, rollout.layout) with its KV "
        "cache; the KV cache is freed after each rollout, so training does not carry it; rollout vs recomputed "
        "log-prob mismatch logged. One implementation of the model's math: the project's former hand-written "
        "decoder is a test oracle (tests/support/decoder.py), no longer a generator.",
        ("tests/test_rollout_megatron_engine.py::test_engine_greedy_is_the_argmax_and_logprobs_are_the_trainers",
         "tests/test_ppo.py::test_ppo_two_steps_on_parallel_layouts"),
        config="rollout.*",
    ),
    Feature(
        "Megatron-core dynamic inference engine", "rollout", TESTED_CPU,
        "rollout.engine=megatron: megatron-core's DynamicInferenceEngine on the actor's own TP/PP(/SP) shards, no "
        "weight copy: paged KV cache (rollout.kv_cache_memory, kv_block_tokens), continuous batching of "
        "rollout.max_batch_size requests, chunked prefill (rollout.prefill_chunk_tokens); suspended (KV freed) while "
        "the actor trains; greedy tokens equal HF generate's and log-probs HF's teacher-forced ones on TP, PP, TPxPP "
        "and CP. The project's sampler on the true vocabulary (temperature-scaled log-probs, top-k with top-p, n, "
        "every stop id and sequence) with keyed noise: a seed gives the same samples whatever the KV budget or "
        "scheduling. Paged attention from rollout.paged_attention (SDPA over the KV pages on the CPU; flash-attn or "
        "the Triton kernel on CUDA) and CUDA graphs for decode steps on CUDA (rows below); never run on a GPU yet. "
        "What rollout.batching=auto (the default) runs on CUDA and for MoE models and partial rollouts.",
        ("tests/test_rollout_megatron_engine.py::test_engine_greedy_is_the_argmax_and_logprobs_are_the_trainers",
         "tests/test_rollout_megatron_engine.py::test_seed_gives_the_same_samples_whatever_the_kv_budget_and_scheduling",
         "tests/test_rollout_megatron_engine.py::test_stop_on_every_eos_id_and_stop_sequences_and_padded_vocab_never_drawn",
         "tests/test_rollout_megatron_engine.py::test_ppo_runs_with_the_megatron_engine_and_recomputes_its_logprobs",
         "tests/test_rollout_megatron_engine.py::test_grpo_learns_the_demo_task_with_the_megatron_engine",
         "tests/test_planner.py::test_megatron_engine_plans_a_paged_kv_budget_on_the_actors_shards"),
        config="rollout.engine=megatron",
        measured=(Measured("CPU, tokens per CPU-second (fastest of 2 runs): long tail 1.24x HF generate's (target "
                           "1.5x) and 1.4x static batching's in 0.56x its decode steps, uniform lengths 0.63x HF's "
                           "(target 1x), bounded by megatron's per-step host cost; KV allocated 1.03-1.13x what the "
                           "live tokens need (target <= 1.25x; static batches 3.85x on the long tail) "
                           "(docs/rollout.md)", "python benchmarks/rollout_throughput.py --repeats 2"),
                  Measured("CPU stand-in for the paged decode kernel: 2.85x (similar lengths) and 1.13x (one long "
                           "request among short ones) the CPU time of SDPA over a padded contiguous cache",
                           "python benchmarks/paged_decode_cpu.py")),
    ),
    Feature(
        "Prefix caching in megatron's engine", "rollout", TESTED_CPU,
        "rollout.prefix_caching (default on). Static batching: each distinct prompt of a chunk is prefilled once and "
        "its KV rows copied to its n samples (1/n of the prompt tokens computed; same samples on or off). Dynamic "
        "engine: megatron-core's prefix caching shares the KV pages of prompts that start alike (whole pages, "
        "hashed by their tokens), so the n samples of a GRPO group "
        "prefill their prompt once; each other sample computes the tokens after its last whole page (at least 2: a "
        "prompt ending on a page boundary recomputes its last page). Samples are the same on or off (same tokens; "
        "log-probs within 1e-5, as two batchings without caching differ) on TP1 and TP2. Pages are shared only while "
        "a request holds them (REF_ZERO), never across rollouts, whose weights differ. Off while MoE routing is "
        "recorded (algorithm.routing_replay): a reused token is not routed again. GPU path untested.",
        ("tests/test_rollout_megatron_engine.py::test_prefix_caching_does_not_change_the_samples",
         "tests/test_rollout_megatron_engine.py::test_prefix_caching_prefills_a_groups_prompt_once",
         "tests/test_rollout_megatron_engine.py::test_static_batching_gives_the_dynamic_engines_samples",
         "tests/test_moe.py::test_rollout_records_the_routing_the_trainer_replays"),
        config="rollout.prefix_caching",
        measured=(Measured("CPU, 4 prompts of 512 tokens x n=8, pages of 16: 2,496 of 16,384 prompt tokens "
                           "computed (0.152; target 1/n = 0.125, out of reach: each extra sample recomputes at "
                           "least its last page), "
                           "2.49x the tokens per CPU-second of caching off (target 1.5x; 1.69-2.49x per interleaved "
                           "pair); pages of 256 (flash-attn's on a GPU): 0.562 computed, 1.14x (docs/rollout.md)",
                           "python benchmarks/rollout_throughput.py --workloads prefix"),),
    ),
    Feature(
        "Paged attention without flash-attn (rollout.paged_attention)", "rollout", TESTED_CPU,
        "The kernels megatron's dynamic engine calls for its paged KV cache, one registry "
        "(compat/paged_attention.py): flash_attn (flash-attn >= 2.7.3's own, CUDA), triton (the project's Triton "
        "kernel, ops/paged_attention.py: prefill chunks and decode rows of every request in one launch, reading the "
        "block table itself -- GQA, any head size, pages out of order -- with no host synchronisation, so a CUDA "
        "graph holds it), sdpa (SDPA over each request's pages, CPU). auto: flash_attn where it imports on CUDA, "
        "else triton; sdpa on the CPU, where Triton runs only in its interpreter. The Triton kernel's math, run by "
        "Triton's interpreter, equals attention over each request alone (1e-5, fp32) and, inside the engine, gives "
        "HF generate's greedy tokens and HF's teacher-forced log-probs (<= 1e-5, fp32) on one process, TP2, PP2, "
        "CP2 and EP2, prefix caching on and off. Compiled on CUDA: not yet run on a GPU "
        "(benchmarks/gpu_check.py rows (h)); sliding windows and sink softmax are refused.",
        ("tests/test_paged_attention.py::test_triton_prefill_equals_each_request_attending_alone",
         "tests/test_paged_attention.py::test_triton_decode_equals_the_stand_in_and_zeroes_padding_requests",
         "tests/test_paged_attention.py::test_triton_reads_no_slot_past_a_requests_length",
         "tests/test_rollout_megatron_engine.py::test_triton_paged_kernel_generates_hfs_greedy_tokens_and_logprobs",
         "tests/test_moe.py::test_megatron_engine_generates_on_expert_parallel_layouts_as_one_process",
         "tests/test_rollout_choice.py::test_paged_attention_and_cuda_graphs_resolve_off_cuda_and_are_refused_where_they_cannot_run"),
        config="rollout.paged_attention",
        constraints=PAGED_ATTENTION_CONSTRAINTS,
    ),
    Feature(
        "CUDA graphs for the dynamic engine's decode steps (rollout.cuda_graphs)", "rollout", GPU_UNTESTED,
        "On CUDA (null = on there; off for MoE and the sdpa kernels) decode steps replay megatron-core's per-layer "
        "CUDA graphs, captured for batch sizes halving from the rollout's most requests in flight down to the TP "
        "size; prefill and mixed steps run eagerly. The graph managers are attached to the actor's layers only while "
        "the engine builds, resumes and steps (compat/inference_graphs.py), so the training forward runs as built. "
        "Weights are updated in place (optimizer, refit), and megatron captures again on every resume after the KV "
        "cache was freed. Not yet run on a GPU: benchmarks/gpu_check.py rows (h) time graphs on / off and check their "
        "greedy tokens equal.",
        ("tests/test_rollout_megatron_engine.py::test_cuda_graph_decode_gives_the_eager_engines_tokens",
         "tests/test_rollout_megatron_engine.py::test_cuda_graphs_are_not_captured_by_the_rollout_engine_on_the_cpu"),
        config="rollout.cuda_graphs",
        constraints=CUDA_GRAPH_CONSTRAINTS,
    ),
    Feature(
        "Batching chosen by the machine (rollout.batching=auto)", "rollout", TESTED_CPU,
        "megatron's engine is the one generator (rollout.engine=auto names it; the torch and tp_sharded engines are "
        "gone). rollout.batching=auto (the default): its dynamic engine on CUDA (flash-attn's or the Triton paged "
        "kernels), and for MoE models and partial rollouts; its static batching on the CPU, where it is measured "
        "faster (docs/rollout.md). One rule (rollout/choice.py) resolved before launch (megatron-rl validate shows it "
        "with the reason) and read by the engine when it generates; rollout.batching=static where it cannot "
        "generate exits 2 before launch.",
        ("tests/test_rollout_choice.py::test_auto_batching_is_static_where_the_dynamic_engine_has_no_kernels_and_nothing_needs_it",
         "tests/test_rollout_choice.py::test_config_and_engine_agree_on_this_machine",
         "tests/test_rollout_choice.py::test_the_removed_engines_are_refused_with_the_choices",
         "tests/test_rollout_choice.py::test_static_batching_is_refused_before_launch_where_it_cannot_generate",
         "tests/test_rollout_choice.py::test_vpp_generates_with_megatrons_engine_on_a_model_of_its_own",
         "tests/test_rollout_choice.py::test_auto_batches_dynamically_on_cuda_with_paged_kernels"),
        config="rollout.batching=auto",
        constraints=ROLLOUT_BATCHING_CONSTRAINTS,
    ),
    Feature(
        "megatron's static batching (the engine's CPU path)", "rollout", TESTED_CPU,
        "rollout.batching=static: megatron-core's static-batching API (StaticInferenceContext, GPTInferenceWrapper) "
        "on the actor's shards, stepped by rollout/static_batching.py with the project's sampler and keyed noise: "
        "the distinct prompts of a chunk left-padded and prefilled once under megatron's attention mask, their KV "
        "rows copied to the n samples (rollout.prefix_caching), one position a step, finished rows dropped once half "
        "are done (with TransformerEngine's attention, which ignores an explicit mask under a causal mask type, "
        "prompts start at column 0 instead and a longer prompt is fed a token a step: causal attention alone, "
        "tested on the local spec on the CPU, not yet with TE); TP and SP (SP switched off while it generates), "
        "PP (the last stage's draws broadcast), CP (each CP rank a generator), VPP and rollout.layout through the "
        "engine's own model. Greedy tokens are HF generate's and log-probs HF's teacher-forced ones "
        "(fp32, within 1e-6) on every layout the dynamic engine is tested on; a seed gives the dynamic engine's "
        "samples.",
        ("tests/test_rollout_megatron_engine.py::test_engine_greedy_is_the_argmax_and_logprobs_are_the_trainers",
         "tests/test_rollout_megatron_engine.py::test_static_batching_gives_the_dynamic_engines_samples",
         "tests/test_rollout_megatron_engine.py::test_static_batching_inference_on_the_local_spec_equals_the_full_forward",
         "tests/test_benchmarks_static_batch.py::test_static_batching_gives_the_dynamic_engines_samples_and_each_way_is_timed"),
        config="rollout.batching=static",
        measured=(Measured("CPU ms per rollout on vs_trl's shape, median / fastest: 15.2 / 14.0, 1.15x the former "
                           "KV-cache decoder's 13.2 / 11.8 (the dynamic engine 52.2 / 48.2); vs_trl's step +6.7% and "
                           "the CPU demo's wall time +0.2% against the release that generated with the decoder "
                           "(docs/rollout.md)", "python benchmarks/rollout_static_batch.py --rounds 20"),),
    ),
    Feature(
        "Rollout without redundant generators", "rollout", TESTED_CPU,
        "Every DP x CP rank generates a distinct share of the prompts (context-parallel ranks hold the same shards as "
        "their replica, so they generate as data-parallel ones do); the TP/PP ranks of a generator share one; each "
        "sample is gathered once.",
        ("tests/test_rollout_megatron_engine.py::test_every_prompt_is_generated_once_over_the_world",),
        config="(always on)",
    ),
    Feature(
        "Generation on its own layout with weight refit", "rollout", TESTED_CPU,
        "rollout.layout (tp, pp, ep, etp; CP 1, the other ranks data-parallel replicas): megatron's engine generates "
        "with a second model built on that layout's process groups, refit from the actor's shards before every "
        "rollout with megatron-core's resharding (swap_model_weights: a plan built once, gloo on the CPU, NCCL on "
        "GPU) and freed after it; timing/refit_s and rollout/refit_bytes logged per step. Bit-exact from TP2, PP2, "
        "PP2xVPP2, TP2xPP2, CP2, TP2xCP2, EP2, PP2xEP2 into TP1, TP2, EP2; greedy responses after refit are HF "
        "generate's; VPP actors generate through it. Where rollout.layout equals the training layout (the default "
        "on the CPU) the engine generates in place, nothing copied; on CUDA the planner picks it when unset "
        "(megatron-rl plan shows it). NCCL refit untested (no GPU run).",
        ("tests/test_refit.py::test_refit_from_a_dense_training_layout_is_bit_exact",
         "tests/test_refit.py::test_refit_from_a_moe_training_layout_is_bit_exact",
         "tests/test_rollout_megatron_engine.py::test_engine_greedy_is_the_argmax_and_logprobs_are_the_trainers",
         "tests/test_rollout_megatron_engine.py::"
         "test_virtual_pipeline_training_generates_with_the_engine_on_a_layout_of_its_own",
         "tests/test_rollout_megatron_engine.py::test_ppo_generates_on_a_layout_of_its_own_refit_every_step",
         "tests/test_rollout_megatron_engine.py::test_generate_command_runs_on_a_rollout_layout_of_its_own",
         "tests/test_validation.py::test_rollout_layout_is_refused_before_launch",
         "tests/test_planner.py::test_rollout_layout_memory_and_choice_for_qwen7b_at_32k",
         "tests/test_planner.py::test_plan_shows_the_inference_layout_and_sets_it"),
        constraints=ROLLOUT_LAYOUT_CONSTRAINTS,
        config="rollout.layout.tp=1",
        measured=(Measured("4 gloo ranks, 215 MiB model: each rank receives exactly its inference shard (1.000x, 16 "
                           "layout pairs); refit 1.9-5.9x faster than gathering a full copy into TP1, 8-26x into TP2 / "
                           "EP2 (docs/rollout.md, Refit cost)", "python benchmarks/rollout_refit.py"),),
    ),
    Feature(
        "One-step-off training (staleness 1, same ranks)", "rollout", TESTED_CPU,
        "trainer.mode=one_step_off: step k trains on the batch generated at step k-1 with the weights of k-2 updates "
        "and generates the batch of step k+1 (same prompts and seeds as a synchronous run); old log-probs recomputed "
        "(the proximal policy), algorithm.rollout_correction for the behaviour policy (mode=is: decoupled PPO); the "
        "waiting batch is in every checkpoint, so a preempted run resumes exactly; rollout/staleness_max and "
        "rollout/policy_version logged. Without rollout.ranks generation and update run one after the other on the "
        "same ranks: the staleness without the overlap (with generator ranks: the row below).",
        ("tests/test_one_step_off.py::test_with_frozen_weights_one_step_off_trains_on_the_sync_batches",
         "tests/test_one_step_off.py::test_one_step_off_samples_are_one_update_stale",
         "tests/test_one_step_off.py::test_one_step_off_resumes_exactly_with_the_waiting_batch_from_the_checkpoint",
         "tests/test_one_step_off.py::test_a_sync_run_resumed_from_one_step_off_trains_the_waiting_batch_first",
         "tests/test_one_step_off.py::test_grpo_learns_the_demo_task_one_step_off_as_sync_does"),
        constraints=(
            need("algorithm.dynamic_sampling", lambda c, w: not c.algorithm.dynamic_sampling,
                 "dynamic sampling draws more prompts within a step; trainer.mode={c.trainer.mode} generates each "
                 "batch before the update it trains after",
                 "set algorithm.dynamic_sampling=false, or trainer.mode=sync",
                 "one_step_off / async without dynamic sampling", when=_ahead),
            need("algorithm.old_logprobs", lambda c, w: _old_logprob_source(c) != "rollout",
                 "with trainer.mode={c.trainer.mode} the rollout's log-probs are an earlier policy's, not the one the "
                 "update starts from", "use algorithm.old_logprobs=auto or recompute (with "
                 "algorithm.rollout_correction for the behaviour policy)",
                 "one_step_off / async recompute the old log-probs", when=_ahead),
        ),
        config="trainer.mode=one_step_off",
    ),
    Feature(
        "Generator ranks of their own (rollout.ranks; sync, one_step_off, async)", "rollout", TESTED_CPU,
        "rollout.ranks=G: the last G ranks generate on rollout.layout (CP 1, the rest data-parallel replicas), the "
        "others train; two torch.distributed worlds joined by the job's store (requests, samples) and a gloo group "
        "over the whole job (weights: megatron-core's resharding, swap_model_weights across the two worlds, each "
        "generator rank receiving exactly its shard from the trainer ranks that hold it, over NCCL between GPUs; each "
        "trainer rank copies what it sends and a sender thread overlaps the transfer with training). The order of "
        "weight pushes and requests fixes each batch's policy version: sync (no overlap), one_step_off (the colocated "
        "mode's batches, exactly, with generation of step k+1 overlapping the update of step k), async (generators up "
        "to trainer.max_staleness versions ahead, weights every trainer.push_weights_every updates; they wait rather "
        "than exceed the bound). one_step_off and async default to decoupled PPO "
        "(algorithm.rollout_correction.mode=auto -> is; tis, the behaviour weight truncated, for async with "
        "max_staleness > 1). A checkpoint takes every requested batch first "
        "(rollout_buffer: generated, not yet trained), so a SIGKILLed job resumes exactly; a dead generator rank ends "
        "the job with its name. Logged: staleness, policy version, generate and idle seconds of the generators, the "
        "trainer's wait, refit seconds and bytes (rollout/refit_bytes equals rollout/generator_shard_bytes; with LoRA, "
        "after the first push, the adapters' bytes). "
        "Evaluation runs on the training ranks. megatron-rl plan --generator-gpus (or rollout.ranks) sizes both sets.",
        ("tests/test_generator_ranks.py::test_one_step_off_on_generator_ranks_trains_what_the_colocated_mode_trains",
         "tests/test_generator_ranks.py::test_async_staleness_stays_bounded_and_a_killed_job_resumes_exactly",
         "tests/test_generator_ranks.py::test_two_training_ranks_and_a_tp2_generator_on_megatrons_engine",
         "tests/test_generator_ranks.py::test_generator_ranks_under_torchrun_share_the_agents_store",
         "tests/test_generator_ranks.py::test_sigterm_checkpoints_the_generated_batches_and_exits_0",
         "tests/test_slurm.py::test_a_job_with_generator_ranks_runs_under_the_script",
         "tests/test_generator_ranks.py::test_a_dead_generator_rank_ends_the_job_with_its_name",
         "tests/test_generator_ranks.py::test_generator_ranks_refuse_what_they_cannot_run_before_launch",
         "tests/test_generator_ranks.py::test_grpo_learns_the_demo_task_in_async_mode",
         "tests/test_resolve.py::test_stale_modes_default_to_decoupled_ppo_and_sync_to_no_correction",
         "tests/test_planner.py::test_plan_sizes_the_training_and_the_generator_gpus_apart",
         "tests/test_planner.py::test_planned_rollout_layout_of_generator_ranks_counts_no_training_state"),
        constraints=(
            need("trainer.mode", lambda c, w: c.rollout.ranks > 0,
                 "trainer.mode=async needs generator ranks of their own", "set rollout.ranks (e.g. 1), or use "
                 "trainer.mode=one_step_off", "async needs rollout.ranks > 0", when=lambda c: c.trainer.mode == ASYNC),
            need("algorithm.dynamic_sampling", lambda c, w: not c.algorithm.dynamic_sampling,
                 "dynamic sampling draws more prompts within a step; generator ranks generate the batches the "
                 "trainers requested ahead", "set algorithm.dynamic_sampling=false, or rollout.ranks=0",
                 "generator ranks without dynamic sampling", when=lambda c: c.rollout.ranks > 0),
            need("algorithm.routing_replay", lambda c, w: not c.algorithm.routing_replay,
                 "the generator ranks do not return the experts they routed to",
                 "set algorithm.routing_replay=false, or rollout.ranks=0",
                 "generator ranks without routing replay", when=lambda c: c.rollout.ranks > 0),
        ),
        config="rollout.ranks=1 trainer.mode=async",
    ),
    Feature(
        "Weights between the two worlds over NCCL (generator ranks on GPUs)", "rollout", GPU_UNTESTED,
        "With rollout.ranks on GPUs, megatron-core's resharding plan is made over the job-wide gloo group and the "
        "weights' bytes go device to device over a second group of the same ranks with NCCL (communicators made "
        "at the first push between two ranks), one packed message per pair of ranks; on the CPU they go over the "
        "gloo group. The packing and the plan-over-one-group, bytes-over-another path are tested on the CPU with "
        "gloo; NCCL itself needs a GPU per rank.",
        ("tests/test_cross_world.py::test_packed_weights_land_bit_for_bit",
         "tests/test_cross_world.py::test_weights_travel_over_nccl_between_gpus"),
        config="rollout.ranks=1 (on GPUs)",
    ),
    Feature(
        "Partial rollouts (weights pushed into requests in flight)", "rollout", TESTED_CPU,
        "trainer.partial_rollouts with trainer.mode=async: the generator looks for a weight push before every token; "
        "when one has come, the samples in flight go on with the new weights (their KV cache recomputed, so every "
        "later token is drawn from the new policy and its log-prob is that policy's) and each token records the "
        "version that drew it; staleness per sample is its oldest token's, rollout/staleness_p50, "
        "rollout/token_staleness_mean and rollout/partial_frac logged. Every engine (megatron's takes the push "
        "between two steps and re-prefills its requests in flight through its own suspend / resume in RECOMPUTE "
        "mode), one generator replica.",
        ("tests/test_generator_ranks.py::test_a_push_during_a_rollout_continues_it_with_the_new_weights",
         "tests/test_generator_ranks.py::test_partial_rollouts_mix_versions_within_the_bound_in_an_async_job"),
        constraints=(
            need("trainer.partial_rollouts", lambda c, w: c.trainer.mode == ASYNC and c.rollout.ranks > 0,
                 "partial rollouts change weights under requests in flight, which only trainer.mode=async with "
                 "generator ranks has", "set trainer.mode=async and rollout.ranks, or trainer.partial_rollouts=false",
                 "partial rollouts need async generator ranks", when=lambda c: c.trainer.partial_rollouts),
            need("rollout.ranks", lambda c, w: c.rollout.ranks == _filled(c).tp * _filled(c).pp,
                 "partial rollouts poll for weights before every token on every generator rank in step, which holds "
                 "for one replica (rollout.ranks = rollout.layout tp x pp)",
                 "set rollout.ranks to rollout.layout.tp x rollout.layout.pp, or trainer.partial_rollouts=false",
                 "partial rollouts with one generator replica", when=lambda c: c.trainer.partial_rollouts),
        ),
        config="trainer.partial_rollouts=true",
    ),
]
