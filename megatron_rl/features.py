"""The feature registry: the one list of what megatron_rl can do, how well it is proven, and
which configs it forbids.

Each :class:`Feature` has a status, the constraints it imposes on a config (config validation
runs every constraint before any process group starts), and its evidence: the tests that prove
it.  ``docs/feature_matrix.md`` and ``megatron-rl features`` are rendered from this list; a test
fails when the committed document drifts from it, and another when evidence names a test that
does not exist.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from packaging.version import Version

from megatron_rl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from megatron_rl.algorithms.kl import KL_ESTIMATORS
from megatron_rl.algorithms.losses import AGG_MODES, POLICY_LOSSES
from megatron_rl.capabilities import resolve_transformer_impl, te_version
from megatron_rl.models.arch import RECOMPUTE_MODULES, attention_dims, expert_ffn_size, is_moe
from megatron_rl.ops.cp_attention import A2A_COMM_TYPES, kv_replication
from megatron_rl.rollout.choice import MEGATRON, rollout_engine
from megatron_rl.trainer.old_logprobs import resolve_old_logprob_source, training_forward_blockers

TESTED_CPU = "tested on CPU"
TESTED_GPU = "tested on GPU"
GPU_UNTESTED = "GPU-only, not yet tested"
PLANNED = "planned"
UNSUPPORTED = "unsupported"
STATUSES = (TESTED_CPU, TESTED_GPU, GPU_UNTESTED, PLANNED, UNSUPPORTED)

# check(cfg, world_size) -> None when fine, else (key, value, problem, fix)
Check = Callable[[object, Optional[int]], Optional[tuple]]


@dataclasses.dataclass(frozen=True)
class Constraint:
    text: str  # shown in the matrix
    check: Check
    key: str = ""  # the config key its error names


@dataclasses.dataclass(frozen=True)
class Measured:
    """A figure quoted in the matrix, with the command that prints it (so it can be re-measured)."""

    figure: str
    command: str


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    area: str
    status: str
    summary: str  # what it does; figures go in ``measured``
    evidence: tuple[str, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    config: str = ""  # the keys that turn it on
    in_use: Optional[Callable[[object], bool]] = None  # planned/unsupported features refuse configs using them
    measured: tuple[Measured, ...] = ()


def _get(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _need(key: str, ok: Callable, problem: str, fix: str, text: str, when: Callable = lambda c: True) -> Constraint:
    def check(cfg, world):
        if not when(cfg):
            return None
        if ok(cfg, world):
            return None
        return key, _get(cfg, key), problem.format(c=cfg, w=world), fix.format(c=cfg, w=world)

    return Constraint(text, check, key)


def _mp(cfg) -> int:
    p = cfg.parallel
    return p.tp * p.pp * p.cp


def _vpp_pass_sequences(cfg, world) -> int:
    """Fewest sequences a data-parallel rank gets in one training pass: an RL mini-batch, or a
    supervised warm-up batch (one sequence per prompt).  Unknown world size: no limit."""
    if world is None:
        return 1 << 30
    dp = max(1, world // _mp(cfg))
    per_step = cfg.trainer.prompts_per_step * cfg.rollout.n
    passes = [per_step // (dp * cfg.algorithm.mini_batches)]
    if cfg.trainer.sft_warmup_steps:
        passes.append(cfg.trainer.prompts_per_step // dp)
    return min(passes)


def _heads_kv(cfg) -> int:
    return attention_dims(cfg.model)[1]


def _te_at_least(version: str) -> bool:
    found = te_version()
    return found is not None and Version(Version(found).base_version) >= Version(version)


def _product(sizes) -> int:
    out = 1
    for size in sizes or ():
        out *= int(size)
    return out if sizes else 0


def _a2a_size(cfg) -> int:
    """The group a2a splits heads over: the first hierarchical size with a2a+p2p, else all of CP."""
    p = cfg.parallel
    hierarchical = getattr(p, "hierarchical_context_parallel_sizes", None)
    if p.cp_comm_type == "a2a+p2p" and hierarchical:
        return int(hierarchical[0])
    return p.cp


def _a2a_heads_fit(cfg) -> bool:
    """The local a2a path's head rule (it replicates K/V heads when the a2a size is a multiple)."""
    a2a, tp = _a2a_size(cfg), cfg.parallel.tp
    if (attention_dims(cfg.model)[0] // tp) % a2a:
        return False
    try:
        kv_replication(_heads_kv(cfg) // tp, a2a)
    except ValueError:
        return False
    return True


def _uses_te(cfg) -> bool:
    """Rules that depend on TransformerEngine read what ``auto`` resolves to on this machine."""
    return resolve_transformer_impl(cfg.model.transformer_impl) == "transformer_engine"


def _needs_groups() -> Constraint:
    """rollout.n >= 2 for every estimator the registry declares ``needs_groups`` (plugins included)."""
    names = ", ".join(n for n, e in ADVANTAGE_ESTIMATORS.items() if e.needs_groups)
    return _need("rollout.n", lambda c, w: c.rollout.n >= 2,
                 "algorithm.advantage={c.algorithm.advantage} takes its baseline from the other samples of a prompt",
                 "set rollout.n >= 2", f"rollout.n >= 2 for group estimators ({names})",
                 when=lambda c: ADVANTAGE_ESTIMATORS[c.algorithm.advantage].needs_groups)


def _old_logprob_source(cfg) -> str:
    return resolve_old_logprob_source(cfg.algorithm)


def _registry_names(registry) -> str:
    return ", ".join(f"`{name}`" for name in registry)


FEATURES: list[Feature] = [
    # ------------------------------------------------------------------ runtime
    Feature(
        "CPU execution (gloo)", "runtime", TESTED_CPU,
        "megatron-core's real TP/PP/CP/DP code on a CPU-only torch through megatron_rl/compat.",
        ("tests/test_compat.py::test_cpu_trace_lists_megatron_call_sites",
         "tests/test_parallel_parity.py::test_tp2_sequence_parallel"),
        config="distributed.device=cpu (auto without CUDA)",
    ),
    Feature(
        "One tested stack (Python 3.12, megatron-core 0.19.2)", "runtime", TESTED_CPU,
        "scripts/bootstrap.sh builds .venv on Python 3.12 (PATH, then pyenv's interpreters) or says in one line what to install; every command stops before launch on a megatron-core outside >=0.19.2,<0.20, naming the range, unless run.allow_untested_megatron_core=true (one warning).",
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
            _need("parallel.tp", lambda c, w: w is None or w % _mp(c) == 0,
                  "world size {w} is not divisible by tp*pp*cp",
                  "choose tp*pp*cp that divides {w}, or start a multiple of tp*pp*cp processes",
                  "world size divisible by tp*pp*cp"),
        ),
        config="parallel.tp, parallel.pp, parallel.cp, --nproc",
    ),
    Feature(
        "Random init independent of the layout", "runtime", TESTED_CPU,
        "Without model.hf_path or actor.init_checkpoint the actor's weights are drawn per tensor from run.seed and its global name with megatron-core's distributions (constants kept, residual projections scaled by 1/sqrt(2L)), on the CPU: the same seed gives the same model on TP/PP/EP/VPP layouts and on CPU or GPU, and the same run numbers on every layout.",
        ("tests/test_seeded_init.py::test_same_seed_same_weights_on_every_layout",
         "tests/test_seeded_init.py::test_seeded_weights_follow_megatrons_distributions",
         "tests/test_seeded_init.py::test_a_run_from_random_init_gives_the_same_numbers_on_every_layout"),
        config="run.seed",
    ),
    Feature(
        "TRL / verl key names", "runtime", TESTED_CPU,
        "Command-line overrides under TRL's or verl's name for the same setting (num_generations, beta, learning_rate, max_completion_length, ppo_max_token_len_per_gpu, ...) are accepted with a one-line note; names that mean something else here are refused pointing at our key; docs/coming_from_trl_verl.md lists both.",
        ("tests/test_config_aliases.py::test_same_meaning_alias_is_accepted_with_one_note",
         "tests/test_config_aliases.py::test_different_meaning_alias_is_refused_pointing_at_our_key"),
        config="e.g. num_generations=8",
    ),
    Feature(
        "Local launcher (--nproc)", "runtime", TESTED_CPU,
        "megatron-rl <command> --nproc N starts N local ranks; torchrun and srun are detected from their environment.",
        ("tests/test_cli.py::test_smoke_command_runs_on_four_processes",),
        config="--nproc N or distributed.nproc",
    ),
    Feature(
        "Failing rank ends the job", "runtime", TESTED_CPU,
        "An exception on any rank stops every rank with a non-zero exit and prints that rank's traceback once.",
        ("tests/test_cli.py::test_rank_that_raises_ends_job_with_its_traceback",
         "tests/test_cli.py::test_rank_that_hangs_is_stopped_by_the_timeout"),
        config="distributed.timeout_s",
    ),
    Feature(
        "Config validation", "runtime", TESTED_CPU,
        "Unknown keys, wrong types, values outside a key's choices or range, impossible layouts, and what a training config points at (prompt file and its first record, reward function, tokenizer and its vocabulary, model directories) fail before any process starts: one line naming the key, the value and the fix, exit code 2.",
        ("tests/test_config.py::test_bad_layouts_are_rejected_with_the_key",
         "tests/test_cli.py::test_bad_override_exits_2_with_one_line",
         "tests/test_validation.py::test_unknown_choice_is_refused_with_the_choices",
         "tests/test_validation.py::test_out_of_range_number_is_refused",
         "tests/test_validation.py::test_prompt_file_whose_first_record_does_not_parse",
         "tests/test_validation.py::test_reward_that_does_not_resolve",
         "tests/test_validation.py::test_tokenizer_vocabulary_larger_than_the_model",
         "tests/test_validation.py::test_train_refuses_before_starting_any_process"),
        config="megatron-rl validate CONFIG --world-size N",
    ),
    # ------------------------------------------------------------------ parallelism
    Feature(
        "Tensor parallelism", "parallelism", TESTED_CPU,
        "Megatron column/row-parallel linears and vocab-parallel embedding.",
        ("tests/test_parallel_parity.py::test_tp2_sequence_parallel",
         "tests/test_parallel_parity.py::test_tp2_pp2"),
        (
            _need("parallel.tp", lambda c, w: c.model.num_attention_heads % c.parallel.tp == 0,
                  "model.num_attention_heads={c.model.num_attention_heads} is not divisible by tp",
                  "use a tp that divides the number of attention heads", "num_attention_heads % tp == 0"),
            _need("parallel.tp", lambda c, w: _heads_kv(c) % c.parallel.tp == 0,
                  "KV heads (model.num_query_groups={c.model.num_query_groups}) are not divisible by tp",
                  "use a tp that divides the number of KV heads", "num_query_groups % tp == 0"),
            _need("parallel.tp", lambda c, w: c.model.ffn_hidden_size % c.parallel.tp == 0,
                  "model.ffn_hidden_size={c.model.ffn_hidden_size} is not divisible by tp",
                  "use a tp that divides ffn_hidden_size", "ffn_hidden_size % tp == 0"),
        ),
        config="parallel.tp",
    ),
    Feature(
        "Sequence parallelism", "parallelism", TESTED_CPU,
        "Activations outside attention/MLP sharded over TP; norms marked so their grads are summed over TP. Ignored at tp=1.",
        ("tests/test_parallel_parity.py::test_tp2_sequence_parallel",),
        config="parallel.sequence_parallel=true",
    ),
    Feature(
        "Pipeline parallelism (1F1B)", "parallelism", TESTED_CPU,
        "megatron-core's 1F1B schedule through get_forward_backward_func; variable-length micro-batches.",
        ("tests/test_parallel_parity.py::test_pp2_1f1b_four_microbatches",
         "tests/test_parallel_parity.py::test_tp2_pp2"),
        (
            _need("parallel.pp", lambda c, w: c.model.num_layers % c.parallel.pp == 0,
                  "model.num_layers={c.model.num_layers} is not divisible by pp",
                  "use a pp that divides the number of layers", "num_layers % pp == 0"),
        ),
        config="parallel.pp",
    ),
    Feature(
        "Virtual pipeline (interleaved 1F1B)", "parallelism", TESTED_CPU,
        "Several model chunks per pipeline rank. With PP=2 batched p2p is turned off: megatron-core gives silently wrong results there. Training passes run at least 2*pp micro-batches (with exactly pp megatron-core's schedule hangs), of any lengths (token budgets, the derived default).",
        ("tests/test_parallel_parity.py::test_pp2_vpp2",
         "tests/test_config.py::test_pp2_vpp_with_batched_p2p_is_rejected",
         "tests/test_cp_layouts.py::test_virtual_pipeline_with_data_dependent_micro_batches_matches_one_process"),
        (
            _need("trainer.prompts_per_step", lambda c, w: _vpp_pass_sequences(c, w) >= 2 * c.parallel.pp,
                  "with virtual pipeline stages a training pass needs at least 2*pp micro-batches, but a data-parallel "
                  "rank gets fewer sequences per pass (prompts_per_step x rollout.n / data-parallel size / "
                  "algorithm.mini_batches; in the warm-up prompts_per_step / data-parallel size)",
                  "raise trainer.prompts_per_step (or rollout.n), lower algorithm.mini_batches, or parallel.vpp=null",
                  "sequences per training pass per data-parallel rank >= 2*pp",
                  when=lambda c: (c.parallel.vpp or 1) > 1),
            _need("parallel.vpp", lambda c, w: c.parallel.pp > 1,
                  "virtual pipeline stages need pipeline parallelism", "set parallel.pp>=2 or parallel.vpp=null",
                  "pp >= 2", when=lambda c: (c.parallel.vpp or 1) > 1),
            _need("parallel.vpp", lambda c, w: c.model.num_layers % (c.parallel.pp * c.parallel.vpp) == 0,
                  "model.num_layers={c.model.num_layers} is not divisible by pp*vpp",
                  "choose pp*vpp that divides the number of layers", "num_layers % (pp*vpp) == 0",
                  when=lambda c: (c.parallel.vpp or 1) > 1),
            _need("parallel.batch_p2p_comm", lambda c, w: not (c.parallel.pp == 2 and c.parallel.batch_p2p_comm),
                  "PP=2 with VPP and batched p2p gives silently wrong losses and gradients in megatron-core",
                  "set parallel.batch_p2p_comm=false (or leave it null), or use pp>=3",
                  "PP=2 needs batch_p2p_comm=false", when=lambda c: (c.parallel.vpp or 1) > 1),
        ),
        config="parallel.vpp",
    ),
    Feature(
        "Data parallelism (Megatron DDP)", "parallelism", TESTED_CPU,
        "Megatron DistributedDataParallel with fp32 grad buffers; gradients normalised by the global token count.",
        ("tests/test_parallel_parity.py::test_dp2_ddp_optimizer_step",),
        config="derived: world size / (tp*pp*cp)",
    ),
    Feature(
        "DDP gradient-reduce overlap with buckets (CUDA)", "parallelism", GPU_UNTESTED,
        "On CUDA gradients are reduced bucket by bucket while backward runs, optionally in bf16; the CPU keeps one reduction after backward in fp32. The settings are a pure function of the device; on gloo, the CUDA settings with ~8 buckets give one process's gradients (DP2, DP2 x PP2). Speed-up not yet measured on GPU.",
        ("tests/test_gpu_settings.py::test_ddp_config_overlaps_bucketed_reduction_on_cuda_only",
         "tests/test_gpu_settings.py::test_overlapped_bucketed_grad_reduce_gives_the_same_gradients"),
        config="actor.optim.overlap_grad_reduce, actor.optim.grad_reduce_bucket_size, actor.optim.grad_reduce_dtype (and critic.optim.*)",
    ),
    Feature(
        "Host-side collectives on NCCL-only groups", "runtime", GPU_UNTESTED,
        "Metrics, agreed micro-batch counts, stop flags, rollout and reward gathers, output and weight gathers over PP, and checkpoint barriers all go through megatron_rl/distributed/collectives.py, which puts host values on a device the group's backend serves (CPU for gloo, the rank's GPU for NCCL). On CPU: the routing is checked while the call sites run and over the source, and the placement on a gloo group registered for CUDA only; NCCL itself not yet run.",
        ("tests/test_collectives.py::test_module_puts_host_values_where_the_group_needs_them",
         "tests/test_collectives.py::test_host_side_collectives_go_through_the_module",
         "tests/test_collectives.py::test_no_collective_in_the_package_bypasses_the_module"),
        config="distributed.backend=nccl (auto on CUDA)",
    ),
    Feature(
        "bf16 end to end", "runtime", TESTED_CPU,
        "model.params_dtype=bfloat16 for PPO (actor, critic, reference; the first update starts from the loaded weights: the optimizer's fp32 master copies are refreshed after every load), checkpoints saved, resumed (bit-identical) and resharded (weights, fp32 master weights and Adam state bit for bit; the critic's fp32 value head next to bf16 weights), the distributed optimizer, score, CP (ring, all_gather) and the log-prob head, against fp32 on one process.",
        ("tests/test_bf16.py::test_bf16_matches_fp32_one_process",
         "tests/test_bf16.py::test_bf16_resume_same_layout_is_bit_identical",
         "tests/test_bf16.py::test_bf16_checkpoint_reshards_weights_master_weights_and_adam_state_exactly",
         "tests/test_bf16.py::test_bf16_distributed_optimizer_state_reshards_exactly",
         "tests/test_bf16.py::test_bf16_score_matches_hf_transformers",
         "tests/test_seeded_init.py::test_bf16_updates_start_from_the_loaded_weights"),
        config="model.params_dtype=bfloat16 (auto on CUDA)",
        measured=(Measured("bf16 vs fp32 on CP2, CP4, TP2xCP2: log-probs <= 2.6e-3, values <= 5e-3 and gradients <= 8.3e-3 of their largest, loss <= 1.7e-3; score vs HF fp32 3.6e-3",
                           "pytest -s tests/test_bf16.py -k 'matches_fp32 or score'"),),
    ),
    Feature(
        "Activation recompute", "memory", TESTED_CPU,
        "Megatron full (uniform/block) or selective recompute, passed through to TransformerConfig.",
        ("tests/test_parallel_parity.py::test_recompute_full_and_selective_match",),
        (
            _need("model.recompute.modules",
                  lambda c, w: set(c.model.recompute.modules) <= set(RECOMPUTE_MODULES),
                  "unknown selective-recompute module", f"use a subset of [{', '.join(RECOMPUTE_MODULES)}]",
                  f"modules within {{{', '.join(RECOMPUTE_MODULES)}}}",
                  when=lambda c: c.model.recompute.granularity == "selective"),
            _need("model.recompute.modules",
                  lambda c, w: not ({"mlp", "layernorm"} & set(c.model.recompute.modules)),
                  "recompute of mlp/layernorm modules needs TransformerEngine in megatron-core 0.19 (and hangs with linear biases)",
                  "use modules=[core_attn] or granularity=full", "selective mlp/layernorm recompute needs TE",
                  when=lambda c: c.model.recompute.granularity == "selective" and not _uses_te(c)),
        ),
        config="model.recompute.*",
    ),
    # ------------------------------------------------------------------ models
    Feature(
        "Local layer spec", "models", TESTED_CPU,
        "megatron-core's local spec with our sequence-parallel norms and our core attention (SDPA; CP; packed sequences).",
        ("tests/test_parallel_parity.py::test_tp2_sequence_parallel",),
        config="model.transformer_impl=local (auto without TE or CUDA)",
    ),
    Feature(
        "TransformerEngine layer spec", "models", GPU_UNTESTED,
        "megatron-core's TE spec (fused norms/linears, TE attention incl. its CP); needs `pip install .[gpu]` and CUDA.",
        ("tests/test_models_te.py::test_te_spec_matches_local_spec",),
        config="model.transformer_impl=transformer_engine",
    ),
    Feature(
        "Llama 2/3 (incl. Llama-3 RoPE scaling)", "models", TESTED_CPU,
        "GQA, SwiGLU, RMSNorm, rope theta, untied embeddings; Llama-3.1 RoPE scaling with megatron-core's fixed factors.",
        ("tests/test_hf_models.py::test_score_matches_hf_transformers",
         "tests/test_hf_models.py::test_more_architectures_match_hf"),
        config="model.hf_path=<dir> (or --hf-model)",
    ),
    Feature(
        "Qwen2 / Qwen2.5", "models", TESTED_CPU,
        "QKV bias, tied embeddings for small sizes.",
        ("tests/test_hf_models.py::test_score_matches_hf_transformers",),
        config="model.hf_path=<dir>",
    ),
    Feature(
        "Qwen3", "models", TESTED_CPU,
        "Per-head QK RMSNorm, head_dim independent of hidden size.",
        ("tests/test_hf_models.py::test_score_matches_hf_transformers",),
        config="model.hf_path=<dir>",
    ),
    Feature(
        "Mistral (no sliding window)", "models", TESTED_CPU,
        "Mistral v0.2+ style checkpoints; a sliding window shorter than the context is refused (not implemented).",
        ("tests/test_hf_models.py::test_more_architectures_match_hf",),
        config="model.hf_path=<dir>",
    ),
    Feature(
        "Vocabulary padding for TP", "models", TESTED_CPU,
        "The vocabulary is padded to a multiple of make_vocab_size_divisible_by*tp; padded entries are masked out of log-probs and entropy.",
        ("tests/test_logprob_op.py::test_padded_vocab_never_leaks",
         "tests/test_logprob_op.py::test_tensor_parallel_shards_match_naive"),
        config="model.make_vocab_size_divisible_by",
    ),
    Feature(
        "Critic value head", "models", TESTED_CPU,
        "Linear(hidden, 1) in fp32 on the last stage, parameters marked sequence-parallel so TP ranks never drift; from the actor or a reward-model checkpoint (HF `score`).",
        ("tests/test_hf_models.py::test_critic_values_and_head_gradient_do_not_depend_on_layout",),
        config="critic (PPO with GAE)",
    ),
    Feature(
        "HF import / export (bridge)", "models", TESTED_CPU,
        "Safetensors into any TP/PP/VPP layout, each rank reading only its slices; export back bit-exact (critic as *ForTokenClassification).",
        ("tests/test_hf_models.py::test_hf_megatron_hf_round_trip_is_bit_exact",
         "tests/test_hf_models.py::test_convert_command_both_directions"),
        config="megatron-rl convert",
    ),
    Feature(
        "megatron-rl score", "models", TESTED_CPU,
        "Per-token log-probs and entropy of an HF model from JSONL, on any layout, same order as the input.",
        ("tests/test_hf_models.py::test_score_matches_hf_transformers",
         "tests/test_hf_models.py::test_score_command_line"),
        config="megatron-rl score --hf-model DIR --input IN --output OUT",
    ),
    Feature(
        "Log-prob head in the model dtype", "memory", TESTED_CPU,
        "bf16 models multiply in bf16 with fp32 accumulation; log-softmax, entropy and the logit gradient are fp32 inside each chunk; no fp32 copy of the [V/TP, h] output weight.",
        ("tests/test_greedy_and_dtype.py::test_bf16_head_against_float64",
         "tests/test_greedy_and_dtype.py::test_bf16_forward_makes_no_fp32_copy_of_the_weight",
         "tests/test_logprob_op.py::test_bf16_tensor_parallel_shards_against_float64"),
        config="model.params_dtype=bfloat16",
        measured=(Measured("bf16 log-probs within 2.5e-2 of float64 at T=1 (bound 2*2^-8*max|logit|/T); gradients within 0.82%",
                           "pytest -s tests/test_greedy_and_dtype.py -k bf16"),),
    ),
    Feature(
        "Greedy rollout (temperature 0)", "rollout", TESTED_CPU,
        "rollout.temperature=0 samples the argmax and scores log-probs at temperature 1; one rule shared by the sampler and the log-prob head, so a greedy PPO run trains.",
        ("tests/test_greedy_and_dtype.py::test_greedy_ppo_trains",
         "tests/test_greedy_and_dtype.py::test_head_at_temperature_zero_scores_at_temperature_one",
         "tests/test_greedy_and_dtype.py::test_sampling_at_temperature_zero_is_argmax_with_temperature_one_logprobs"),
        config="rollout.temperature=0",
    ),
    Feature(
        "No host syncs per layer", "runtime", TESTED_CPU,
        "cu_seqlens carry their host values with the micro-batch (our attention and megatron's unfused THD RoPE read those), the ring's tile plan and device positions are made once per micro-batch; host copies to CUDA are pinned and non-blocking.",
        ("tests/test_host_syncs.py::test_value_reads_do_not_grow_with_the_number_of_layers",),
        config="(always on)",
        measured=(Measured("device reads per packed CP2 forward+backward: 52 (2 layers) / 90 (4 layers) before, 6 / 6 after",
                           "pytest -s tests/test_host_syncs.py"),),
    ),
    Feature(
        "GPU-grade layer settings", "runtime", GPU_UNTESTED,
        "On CUDA: bias-activation, bias-dropout and masked-softmax fusion, RoPE fusion with TE, gradient-accumulation fusion with Apex, weights initialised on the device, TF32 allowed; CPU settings unchanged. The TransformerConfig for a CUDA device is unit-tested without one.",
        ("tests/test_gpu_check.py::test_transformer_config_for_a_cuda_device_without_one",
         "tests/test_gpu_check.py::test_cuda_settings_follow_the_installed_kernels"),
        config="distributed.device=cuda (auto with CUDA)",
    ),
    Feature(
        "One-GPU check (benchmarks/gpu_check.py)", "runtime", GPU_UNTESTED,
        "World size 1 on NCCL: a bf16 PPO step with checkpoint save and load, score vs HF in bf16, the SDPA backend of each attention path, actor-update MFU against plain megatron-core, peak memory against the planner, generation tokens/s. Without CUDA it says so and exits 0; not yet run on a GPU.",
        ("tests/test_gpu_check.py::test_without_cuda_it_prints_one_line_and_exits_0",
         "tests/test_gpu_check.py::test_cpu_dry_run_fills_every_row"),
        config="python benchmarks/gpu_check.py",
    ),
    Feature(
        "Chunked vocab-parallel log-probs and entropy", "memory", TESTED_CPU,
        "Output projection fused into the log-softmax, walked in token chunks with fp32 inside the chunk; never [tokens, vocab]; at most two [chunk, vocab/TP] fp32 buffers.",
        ("tests/test_logprob_op.py::test_matches_naive_forward_and_gradients",
         "tests/test_logprob_op.py::test_extra_memory_below_a_quarter_of_naive_at_2k_tokens"),
        config="batch.logprob_chunk_size",
        measured=(Measured("peak extra memory 0.057x naive at 2k tokens x 16k vocab",
                           "pytest -s tests/test_logprob_op.py -k extra_memory"),),
    ),
    Feature(
        "Distributed checkpoints with resharding", "checkpointing", TESTED_CPU,
        "Megatron dist_checkpointing (torch_dist), atomic rename, loadable into another TP/PP/VPP layout.",
        ("tests/test_hf_models.py::test_convert_command_both_directions",),
        config="megatron-rl convert; trainer.save_every",
    ),
    Feature(
        "PPO with a critic (GAE)", "algorithms", TESTED_CPU,
        "Clipped surrogate (asymmetric clip_low/clip_high), GAE with optional whitening, clipped value loss.",
        ("tests/test_ppo.py::test_ppo_two_steps_on_parallel_layouts", "tests/test_algorithms.py::test_gae_discounted"),
        config="algorithm.advantage=gae",
    ),
    Feature(
        "Algorithm registries", "algorithms", TESTED_CPU,
        "One decorator per entry; the schema's choices, validation and the trainer read them, so a new estimator or loss is a one-file change. "
        "Advantage estimators: " + _registry_names(ADVANTAGE_ESTIMATORS) + "; policy losses: " + _registry_names(POLICY_LOSSES)
        + "; KL estimators: " + _registry_names(KL_ESTIMATORS) + "; loss aggregations: " + _registry_names(AGG_MODES)
        + ". Formulas and configs: docs/algorithms.md.",
        ("tests/test_algorithm_registries.py::test_every_registry_is_what_the_schema_accepts",
         "tests/test_algorithm_registries.py::test_new_estimator_is_a_one_file_change",
         "tests/test_algorithm_registries.py::test_new_policy_loss_is_a_one_file_change"),
        (
            _needs_groups(),
            _need("algorithm.dual_clip", lambda c, w: POLICY_LOSSES[c.algorithm.policy_loss].uses_dual_clip,
                  "algorithm.policy_loss={c.algorithm.policy_loss} has no dual clip", "set algorithm.dual_clip=null",
                  "dual_clip only with a loss that uses it (ppo)", when=lambda c: c.algorithm.dual_clip is not None),
        ),
        config="algorithm.advantage, policy_loss, kl_kind, loss_agg",
    ),
    Feature(
        "GRPO (no critic)", "algorithms", TESTED_CPU,
        "Group-normalised sequence returns (unbiased std), no value model. Group statistics in float64 around the group's minimum, so an all-equal group gets exactly 0; with kl_in_reward the return is the sum of the KL-penalised token rewards.",
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
        "Group mean baseline without std normalisation, with the seq-mean-token-sum-norm aggregation (token sums over a constant, rollout.max_new_tokens).",
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
        "PPO clip on the length-normalised sequence ratio exp(mean_t log(pi/pi_old)) (value per sequence, gradient through each token); the sequence sum is reduced over the CP group, so gradients do not depend on micro-batches, DP or CP.",
        ("tests/test_estimators_and_losses.py::test_gspo_hand_case",
         "tests/test_estimators_and_losses.py::test_gspo_against_formula",
         "tests/test_estimators_and_losses.py::test_loss_gradients_do_not_depend_on_how_the_batch_is_cut",
         "tests/test_recipes.py::test_gspo_recipe_learns"),
        config="algorithm.policy_loss=gspo (configs/gspo_cpu.yaml)",
    ),
    Feature(
        "CISPO", "algorithms", TESTED_CPU,
        "-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi: the clipped IS weight is a constant, so no token loses its gradient.",
        ("tests/test_estimators_and_losses.py::test_cispo_hand_case",
         "tests/test_estimators_and_losses.py::test_cispo_against_formula",
         "tests/test_estimators_and_losses.py::test_loss_gradients_do_not_depend_on_how_the_batch_is_cut"),
        config="algorithm.policy_loss=cispo",
    ),
    Feature(
        "DAPO dynamic sampling", "algorithms", TESTED_CPU,
        "Groups whose rewards are all equal are dropped and further prompt batches sampled until prompts_per_step groups remain; at most dynamic_sampling_max_rounds rounds, then the batch is filled with dropped groups, so the batch size never changes. Logged: dynamic_sampling/rounds, prompts_drawn, kept/dropped/padded groups, reward/drawn_mean.",
        ("tests/test_recipes.py::test_dynamic_sampling_keeps_the_batch_size_and_terminates",
         "tests/test_recipes.py::test_dynamic_sampling_fills_up_with_dropped_groups_at_the_bound",
         "tests/test_recipes.py::test_dapo_recipe_learns"),
        (
            _need("rollout.n", lambda c, w: c.rollout.n >= 2, "dynamic sampling compares the rewards of a prompt's samples",
                  "set rollout.n >= 2 or algorithm.dynamic_sampling=false", "dynamic sampling needs rollout.n >= 2",
                  when=lambda c: c.algorithm.dynamic_sampling),
        ),
        config="algorithm.dynamic_sampling=true, dynamic_sampling_max_rounds (configs/dapo_cpu.yaml)",
    ),
    Feature(
        "DAPO overlong reward shaping", "algorithms", TESTED_CPU,
        "A penalty growing linearly from 0 to overlong_penalty over the last overlong_buffer tokens before rollout.max_new_tokens, added to the score.",
        ("tests/test_estimators_and_losses.py::test_overlong_penalty_hand_values",
         "tests/test_recipes.py::test_dapo_recipe_learns"),
        (
            _need("algorithm.overlong_buffer", lambda c, w: c.algorithm.overlong_buffer <= c.rollout.max_new_tokens,
                  "the overlong buffer is longer than rollout.max_new_tokens={c.rollout.max_new_tokens}",
                  "set algorithm.overlong_buffer <= rollout.max_new_tokens", "overlong_buffer <= max_new_tokens"),
        ),
        config="algorithm.overlong_buffer, overlong_penalty",
    ),
    Feature(
        "Old log-prob source (on-policy shortcut)", "algorithms", TESTED_CPU,
        "algorithm.old_logprobs: auto (default) takes the PPO ratio's old log-probs from the update's own forward, detached, when the update is exactly on-policy (one epoch, one mini-batch, no rollout correction, no KL in the reward): the same loss and gradients as recomputing them, one actor forward fewer per step; otherwise it recomputes them. recompute and rollout (the engine's log-probs) on request.",
        ("tests/test_ppo.py::test_on_policy_shortcut_gives_the_recompute_gradients_with_one_forward_fewer",
         "tests/test_ppo.py::test_old_logprob_source_keeps_the_recompute_pass_where_the_update_needs_it"),
        (
            _need("algorithm.old_logprobs", lambda c, w: not training_forward_blockers(c.algorithm),
                  "the update's forward gives the old log-probs only when it is exactly on-policy "
                  "(ppo_epochs=1, mini_batches=1, rollout_correction.mode=off, no KL in the reward)",
                  "use algorithm.old_logprobs=auto (it recomputes them here) or recompute",
                  "training_forward: ppo_epochs=1, mini_batches=1, no rollout correction, no KL in the reward",
                  when=lambda c: c.algorithm.old_logprobs == "training_forward"),
            _need("algorithm.old_logprobs", lambda c, w: c.algorithm.rollout_correction.mode == "off",
                  "rollout correction weighs the trainer's log-probs against the rollout's, which are the old ones here",
                  "use algorithm.old_logprobs=auto or recompute, or algorithm.rollout_correction.mode=off",
                  "rollout: no rollout correction", when=lambda c: c.algorithm.old_logprobs == "rollout"),
        ),
        config="algorithm.old_logprobs=auto (default) | recompute | training_forward | rollout",
    ),
    Feature(
        "Rollout correction (TIS / MIS)", "algorithms", TESTED_CPU,
        "Importance weights exp(logp_trainer - logp_rollout) per token or per sequence, truncated (tis) or masked (mis) at a threshold, multiply the policy loss; logged: rollout_correction/weight_mean, weight_max, truncated_frac or masked_frac. Off by default; for bf16, external or asynchronous engines.",
        ("tests/test_estimators_and_losses.py::test_rollout_correction_tis_and_mis_token_and_sequence",
         "tests/test_estimators_and_losses.py::test_loss_gradients_do_not_depend_on_how_the_batch_is_cut",
         "tests/test_recipes.py::test_rollout_correction_and_overlong_shaping_in_a_run"),
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
        "KL to a frozen reference model as a loss term or a per-token reward penalty, fixed or adaptive coefficient; estimators k1/kl, k2/mse, k3/low_var_kl (bounded to [0, 10] like verl), abs, k3+ (k3's value, k2's gradient).",
        ("tests/test_algorithms.py::test_adaptive_controller_update_and_state",
         "tests/test_ppo.py::test_ppo_two_steps_on_parallel_layouts",
         "tests/test_algorithms.py::test_k3_is_bounded_to_ten_like_verl_and_its_gradient",
         "tests/test_estimators_and_losses.py::test_kl_estimators_against_formula"),
        (
            _need("algorithm.kl_target", lambda c, w: c.algorithm.kl_target is not None and c.algorithm.kl_horizon is not None,
                  "the adaptive controller needs kl_target and kl_horizon", "set algorithm.kl_target and algorithm.kl_horizon",
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
        "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm; divided once by the mini-batch's global count, so gradients do not depend on micro-batches, DP or CP.",
        ("tests/test_ppo.py::test_gradients_do_not_depend_on_how_the_batch_is_cut",
         "tests/test_estimators_and_losses.py::test_loss_gradients_do_not_depend_on_how_the_batch_is_cut"),
        config="algorithm.loss_agg",
    ),
    Feature(
        "Algorithm recipes", "algorithms", TESTED_CPU,
        "configs/grpo_cpu.yaml, dapo_cpu.yaml, gspo_cpu.yaml, reinforce_pp_cpu.yaml on the built-in add_small task (one CPU process); "
        "the same algorithms for Qwen2.5-7B at 32k tokens on 8 GPUs (qwen2.5_7b_32k.yaml is GRPO; dapo_, gspo_, reinforce_pp_qwen2.5_7b_32k.yaml), validated only.",
        ("tests/test_recipes.py::test_cpu_recipe_runs_two_steps",
         "tests/test_recipes.py::test_gpu_recipes_validate_for_eight_gpus"),
        config="--config configs/<recipe>.yaml",
    ),
    Feature(
        "Rollout with KV cache", "rollout", TESTED_CPU,
        "Batched sampling (temperature, top-p, top-k, EOS and stop sequences, n per prompt), seeded; with rollout.engine=torch the actor's weights are gathered from any TP/PP/VPP/CP layout into one full copy per rank (tp_sharded: see below); the engine's weights are freed after each rollout, so training does not carry them; rollout vs recomputed log-prob mismatch logged.",
        ("tests/test_rollout.py::test_kv_cache_greedy_equals_recompute",
         "tests/test_ppo.py::test_ppo_two_steps_on_parallel_layouts"),
        config="rollout.*",
        measured=(Measured("10.4x faster than re-running the prefix at 256 new tokens, one thread",
                           "python benchmarks/rollout_kv_cache.py --threads 1"),),
    ),
    Feature(
        "TP-sharded rollout engine", "rollout", TESTED_CPU,
        "rollout.engine=tp_sharded: the KV-cache decoder on each rank's tensor-parallel shard, loaded straight from megatron's shards (other pipeline stages' layers by broadcast), so weights and KV cache per rank are 1/TP of the full copy. Same samples as the full-copy engine for the same seed on TP, TPxPP, tied embeddings, PP+VPP.",
        ("tests/test_rollout.py::test_tp_sharded_engine_generates_what_one_full_copy_generates",
         "tests/test_ppo.py::test_ppo_with_tp_sharded_rollout_matches_full_copy"),
        config="rollout.engine=tp_sharded",
        measured=(Measured("weights + KV cache per rank 0.500x the full copy at TP=2, 0.250x at TP=4; "
                           "weight sync 0.03 s instead of a 0.69 s gather at TP=2",
                           "python benchmarks/rollout_tp_sharded.py"),),
    ),
    Feature(
        "Megatron-core dynamic inference engine", "rollout", TESTED_CPU,
        "rollout.engine=megatron: megatron-core's DynamicInferenceEngine on the actor's own TP/PP(/SP) shards, no weight copy: paged KV cache (rollout.kv_cache_memory, kv_block_tokens), continuous batching of rollout.max_batch_size requests, chunked prefill (rollout.prefill_chunk_tokens); suspended (KV freed) while the actor trains; greedy tokens equal HF generate's and log-probs HF's teacher-forced ones on TP, PP, TPxPP and CP. The project's sampler on the true vocabulary (temperature-scaled log-probs, top-k with top-p, n, every stop id and sequence) with keyed noise: a seed gives the same samples whatever the KV budget or scheduling. CPU via compat/inference_cpu.py (SDPA over the KV pages); GPU needs flash-attn >= 2.7.3, runs without CUDA graphs, untested there. What rollout.engine=auto (the default) runs for MoE models and on CUDA with flash-attn (see the next row).",
        ("tests/test_rollout_megatron_engine.py::test_engine_greedy_is_the_argmax_and_logprobs_are_the_trainers",
         "tests/test_rollout_megatron_engine.py::test_seed_gives_the_same_samples_whatever_the_kv_budget_and_scheduling",
         "tests/test_rollout_megatron_engine.py::test_stop_on_every_eos_id_and_stop_sequences_and_padded_vocab_never_drawn",
         "tests/test_rollout_megatron_engine.py::test_ppo_runs_with_the_megatron_engine_and_recomputes_its_logprobs",
         "tests/test_rollout_megatron_engine.py::test_grpo_learns_the_demo_task_with_the_megatron_engine",
         "tests/test_planner.py::test_megatron_engine_plans_a_paged_kv_budget_on_the_actors_shards"),
        constraints=(
            _need("rollout.engine", lambda c, w: not c.parallel.vpp or c.parallel.vpp <= 1,
                  "megatron-core's inference refuses virtual pipeline stages (interleaved chunks)",
                  "use rollout.engine=tp_sharded or torch with parallel.vpp, or set parallel.vpp=null",
                  "no VPP", when=lambda c: rollout_engine(c) == MEGATRON),
        ),
        config="rollout.engine=megatron",
        measured=(Measured("CPU, tokens per CPU-second (fastest of 3 runs): long tail 0.73x the torch decoder's (target 2x) "
                           "in 0.59x its decode steps, uniform lengths 0.70x HF generate's (target 1x), bounded by "
                           "megatron's per-step host cost; KV allocated 1.03-1.13x what the live tokens need (target "
                           "<= 1.25x; static batches 4.4-5.1x on the long tail) (docs/rollout.md)",
                           "python benchmarks/rollout_throughput.py"),
                  Measured("CPU stand-in for the paged decode kernel: 2.85x (similar lengths) and 1.13x (one long "
                           "request among short ones) the CPU time of SDPA over a padded contiguous cache",
                           "python benchmarks/paged_decode_cpu.py")),
    ),
    Feature(
        "Rollout engine chosen by the layout (auto)", "rollout", TESTED_CPU,
        "rollout.engine=auto (the default): megatron's dynamic engine for MoE models, and for dense models on CUDA with flash-attn >= 2.7.3 (or FA3) and no VPP; the torch decoder for VPP layouts, on CUDA without flash-attn and on the CPU (faster there: docs/rollout.md). One rule (rollout/choice.py) read by validation before launch and by the trainer and `megatron-rl generate` when they build the engine; the first log lines name the engine and the reason. The CUDA branch has not run on a GPU.",
        ("tests/test_rollout_choice.py::test_auto_picks_megatron_where_it_runs_well_and_the_decoder_elsewhere",
         "tests/test_rollout_choice.py::test_config_and_engine_builder_agree_on_this_machine",
         "tests/test_rollout_choice.py::test_vpp_runs_the_decoder_under_auto_and_is_refused_for_megatron",
         "tests/test_moe.py::test_train_refuses_an_moe_model_with_a_decoder_without_experts"),
        config="rollout.engine=auto",
    ),
    Feature(
        "Rollout without redundant generators", "rollout", TESTED_CPU,
        "Every DP x CP rank generates a distinct share of the prompts (context-parallel ranks hold the same shards as their replica, so they generate as data-parallel ones do); the TP/PP ranks of a generator share one; each sample is gathered once.",
        ("tests/test_rollout_megatron_engine.py::test_every_prompt_is_generated_once_over_the_world",),
        config="(always on)",
    ),
    Feature(
        "Non-finite gradients skip the update", "runtime", TESTED_CPU,
        "A NaN/inf gradient norm skips the optimizer step and is reported as actor/skipped_updates, critic/skipped_updates; a PPO step in which every actor or critic step was skipped stops the run with one line naming the likely cause (exit 2) instead of logging nulls.",
        ("tests/test_parallel_parity.py::test_non_finite_gradients_skip_the_update",
         "tests/test_trainer_guards.py::test_run_whose_critic_updates_are_all_non_finite_stops_with_one_line"),
        config="(always on)",
    ),
    Feature(
        "Prompt data (JSONL / Parquet, chat templates)", "data", TESTED_CPU,
        "prompt / answer / messages records; over-long prompts dropped and counted; seeded, resumable sampling.",
        ("tests/test_prompts.py::test_sampler_exact_resume", "tests/test_prompts.py::test_long_prompts_dropped_and_logged"),
        config="data.*",
    ),
    Feature(
        "Reward functions (registry, verifiable math)", "data", TESTED_CPU,
        "Built-in math_answer (GSM8K ####, \\boxed{}), math_verify, format, exact_match, digit_sum; any package.module:function (resolved from the working directory for every launch, checked before launch); a failing or malformed reward stops the run naming the prompt.",
        ("tests/test_rewards.py::test_raising_fn_names_the_prompt_index",
         "tests/test_ppo.py::test_reward_function_that_raises_stops_the_run_with_the_prompt_index",
         "tests/test_config_aliases.py::test_reward_module_in_the_working_directory_imports_with_one_process_as_with_many"),
        config="reward.fn, reward.kwargs",
    ),
    Feature(
        "Exact math grader (math_answer)", "data", TESTED_CPU,
        "GSM8K #### or the last group of \\boxed{}/\\fbox{}; numbers as exact rationals, percent, units, x= prefixes, unicode, markdown bold, a heading after the answer, exact algebra (roots, polynomials); boxes that disagree score 0.",
        ("tests/test_reward_corpus.py::test_math_answer_on_the_corpus_no_false_positive_at_least_95_percent",
         "tests/test_rewards.py::test_several_boxes_policy"),
        config="reward.fn=math_answer",
        measured=(Measured("95.6% accuracy, 0 false positives on 272 labelled cases (math-verify alone: 81.6%, 18)",
                           "python benchmarks/reward_grading.py"),),
    ),
    Feature(
        "Symbolic math grader (math_verify)", "data", TESTED_CPU,
        "The project's extraction and exact rules, then math-verify's SymPy comparison (signal timeouts off, bounded by the grading worker, any thread); needs pip install 'megatron_rl[math]'.",
        ("tests/test_reward_corpus.py::test_math_verify_on_the_corpus_no_false_positive_at_least_98_percent",
         "tests/test_rewards.py::test_math_verify_adds_symbolic_equivalence_and_keeps_the_contract",
         "tests/test_rewards.py::test_math_verify_is_bounded_and_thread_safe"),
        config="reward.fn=math_verify",
        measured=(Measured("98.9% accuracy, 0 false positives on 272 labelled cases",
                           "python benchmarks/reward_grading.py"),),
    ),
    Feature(
        "Per-sample reward time bound", "data", TESTED_CPU,
        "Each sample of a built-in or @grader reward is graded in a worker process bounded by reward.timeout_s; a timed-out sample scores 0, is counted in reward/timeouts and never stops the run; parsing is linear in the response length.",
        ("tests/test_rewards.py::test_timed_out_sample_scores_zero_is_counted_and_the_rest_are_graded",
         "tests/test_rewards.py::test_adversarial_input_is_graded_in_under_a_second",
         "tests/test_rewards.py::test_grading_is_bounded_on_a_thread_other_than_main"),
        config="reward.timeout_s",
        measured=(Measured("slowest adversarial input (1 MB text, depth-10,000 braces, 10,000 boxes, 100k-digit runs) 0.083 s",
                           "python benchmarks/reward_grading.py"),),
    ),
    Feature(
        "Rewards graded on every rank", "data", TESTED_CPU,
        "Each rank grades every world-th sample and one all_gather_object gives all ranks the scores and the timeout count; a failing reward stops every rank at once naming the prompt; whole_batch functions run on rank 0.",
        ("tests/test_rewards.py::test_rewards_on_every_rank_equal_one_rank",
         "tests/test_rewards.py::test_rewards_on_every_rank_count_timeouts_over_all_ranks",
         "tests/test_ppo.py::test_reward_function_that_raises_stops_the_run_with_the_prompt_index"),
        config="(always on)",
        measured=(Measured("2 gloo ranks give the same 7 scores as one; timeouts summed over ranks",
                           "pytest tests/test_rewards.py -k every_rank -s"),),
    ),
    Feature(
        "Checkpoint and exact resume", "checkpointing", TESTED_CPU,
        "Actor, critic, reference, optimizers, schedulers, RNG, data position, KL controller; atomic; keep last K; resume=auto; resumes into another layout.",
        ("tests/test_ppo.py::test_resume_same_layout_is_bit_identical", "tests/test_ppo.py::test_resume_gives_identical_metrics",
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
        "Stop signals reach each rank's main process only (checkpoint writers live to finish); a first Ctrl-C checkpoints and exits 0, a second aborts (130); ranks still running distributed.timeout_s after a stop are ended; every rank's process group is killed when the job ends; ranks die with their launcher (PR_SET_PDEATHSIG).",
        ("tests/test_signals.py::test_sigterm_after_a_periodic_save_checkpoints_and_exits_0",
         "tests/test_signals.py::test_ctrl_c_once_checkpoints_and_twice_aborts_with_one_process",
         "tests/test_signals.py::test_kill_9_of_a_rank_ends_the_job_and_leaves_no_helper_holding_its_output",
         "tests/test_signals.py::test_kill_9_of_the_launcher_stops_the_ranks"),
        config="(always on); distributed.timeout_s bounds the wait after a stop",
    ),
    Feature(
        "Checkpoint integrity (sha256) and fallback", "checkpointing", TESTED_CPU,
        "Every file's sha256 in meta.json, checked before loading (hashed in shares over the ranks); resume=auto falls back past a checkpoint that does not load; a changed architecture names the setting; non-finite weights are never saved.",
        ("tests/test_checkpoint_safety.py::test_a_corrupted_checkpoint_is_named_and_resume_auto_falls_back",
         "tests/test_checkpoint_safety.py::test_resuming_with_another_model_shape_names_the_setting",
         "tests/test_trainer_guards.py::test_infinite_learning_rate_applies_no_update_and_nan_weights_are_never_saved"),
        config="trainer.resume=auto",
    ),
    Feature(
        "Checkpoints never run code", "checkpointing", TESTED_CPU,
        "trainer_state, RNG files and byte items load with weights_only=True, .metadata through an allow-list unpickler; a crafted file is refused with one line (exit 2) by train, convert and generate. TE's FP8 extra state under weights_only not yet checked on GPU.",
        ("tests/test_checkpoint_safety.py::test_crafted_checkpoints_are_refused_and_run_nothing",),
        config="(always on)",
    ),
    Feature(
        "Fresh start in a used run directory", "checkpointing", TESTED_CPU,
        "trainer.resume=never moves the earlier run's checkpoints and metrics to <run dir>/replaced/<time>/; nothing deleted, nothing mixed.",
        ("tests/test_cli.py::test_fresh_start_in_a_used_run_directory_keeps_the_old_run_and_does_not_mix_with_it",),
        config="trainer.resume=never",
    ),
    Feature(
        "Full disk during a save", "checkpointing", TESTED_CPU,
        "Before writing, every rank agrees on the space the checkpoint needs (the newest one's size, or an estimate from the parameters and Adam's state) and rank 0's free space; a save that does not fit, or a disk that fills during the write, stops with one line naming the directory and the space needed (exit 2), no partial checkpoint is left, and the last good one resumes; a failed save's temporaries never block the next run.",
        ("tests/test_disk_full.py::test_a_checkpoint_that_does_not_fit_stops_before_writing_with_one_line",
         "tests/test_disk_full.py::test_a_disk_that_fills_during_the_save_keeps_the_last_checkpoint_and_resumes",
         "tests/test_disk_full.py::test_temporaries_of_a_failed_save_never_block_the_next_run"),
        config="(always on); trainer.keep_last, run.dir",
    ),
    Feature(
        "Time bound on plain reward functions", "data", TESTED_CPU,
        "A plain batch reward gets reward.timeout_s per response of its batch; past it the run stops with one line (a watchdog ends the rank even when the function is stuck in C).",
        ("tests/test_trainer_guards.py::test_plain_reward_that_never_returns_stops_the_job_with_one_line",),
        config="reward.timeout_s",
    ),
    Feature(
        "Metrics, plot, TensorBoard, W&B", "runtime", TESTED_CPU,
        "metrics.jsonl per step (reward, lengths, losses, KL, entropy, clipfrac, grad norms, explained variance, timings, throughput, memory), console progress, plot.png; TensorBoard/W&B optional.",
        ("tests/test_ppo.py::test_ppo_two_steps_on_parallel_layouts", "tests/test_ppo.py::test_run_ppo_sh_demo_learns"),
        config="trainer.tensorboard, trainer.wandb, trainer.plot",
    ),
    Feature(
        "CPU demo that learns", "runtime", TESTED_CPU,
        "./run_ppo.sh without a GPU: PPO (GAE + KL) on add_small, TP2xPP2 on 4 gloo ranks; reward rises by more than 0.3 in about 5 minutes on 2 cores.",
        ("tests/test_ppo.py::test_run_ppo_sh_demo_learns",),
        config="configs/demo_cpu.yaml",
    ),
    Feature(
        "Offload between phases", "memory", GPU_UNTESTED,
        "Models not used by the running phase (weights, DDP grad buffers, optimizer state) wait in host memory; storages are freed in place so megatron's views stay valid. Numbers unchanged (tested on CPU); the memory saving is measured only on GPU.",
        ("tests/test_ppo.py::test_offload_between_phases_changes_no_number",
         "tests/test_ppo.py::test_offloader_frees_device_storage_and_restores_it_in_place"),
        config="trainer.offload=true",
    ),
    Feature(
        "Distributed optimizer", "memory", TESTED_CPU,
        "megatron-core's DistributedOptimizer: Adam state and fp32 master weights sharded over DP x CP ranks. Works with TE/Apex fused Adam or torch's Adam; checkpoints are fully reshardable (resume on another TP/PP/DP layout).",
        ("tests/test_parallel_parity.py::test_dp2_distributed_optimizer_step",
         "tests/test_ppo.py::test_distributed_optimizer_matches_plain_adam_and_resumes_exactly"),
        config="actor.optim.use_distributed_optimizer, critic.optim.use_distributed_optimizer",
        measured=(Measured("parameters after one Adam step within 3.7e-6 of one process (DP2)",
                           "pytest -s tests/test_parallel_parity.py -k distributed_optimizer"),),
    ),
    Feature(
        "Memory planner (megatron-rl plan)", "memory", TESTED_CPU,
        "Per-GPU memory by component for candidate TP/PP/CP/recompute/offload layouts, the recommended one with overrides, or the smallest node count that fits. GPU figures unvalidated.",
        ("tests/test_planner.py::test_activation_estimate_within_1_percent_of_measurement",
         "tests/test_planner.py::test_qwen7b_at_32k_fits_one_node_of_8x80gb"),
        config="megatron-rl plan --model ... --response-len ...",
        measured=(Measured("activation and log-prob estimates within 1% of CPU measurement on the benchmark model",
                           "pytest -s tests/test_planner.py -k measurement"),),
    ),
    # ------------------------------------------------------------------ mixture of experts
    Feature(
        "Mixture-of-experts layers", "models", TESTED_CPU,
        "megatron-core's MoE layer (top-k router, alltoall or allgather token dispatcher, SequentialMLP experts on the local spec, shared experts with an optional sigmoid gate, dense layers by model.moe.layer_freq / dense_layers) with our router: load-balancing (per micro-batch or per sequence) and z-losses over real tokens, divided once by the pass's token count like the policy loss, reported as actor/moe_aux_loss and actor/moe_z_loss and in the gradient only with a coefficient > 0; no token dropping unless model.moe.capacity_factor is set. Training generates with rollout.engine=megatron (the torch decoders have no MoE layers; `megatron-rl train` and `validate` refuse them for an MoE model).",
        ("tests/test_moe.py::test_loss_and_gradients_match_one_process",
         "tests/test_moe.py::test_router_losses_enter_the_gradient_with_their_coefficients",
         "tests/test_moe.py::test_micro_batch_load_balancing_loss_where_the_batch_is_cut_the_same",
         "tests/test_moe.py::test_moe_config_maps_to_megatron_fields",
         "tests/test_moe.py::test_grpo_learns_on_a_tiny_moe"),
        (
            _need("model.moe.router_topk", lambda c, w: c.model.moe.router_topk <= c.model.moe.num_experts,
                  "router_topk={c.model.moe.router_topk} is more than num_experts={c.model.moe.num_experts}",
                  "route to at most num_experts experts", "router_topk <= num_experts", when=lambda c: is_moe(c.model)),
            _need("parallel.sequence_parallel", lambda c, w: c.parallel.tp == 1 or c.parallel.sequence_parallel,
                  "megatron-core's MoE layer refuses tensor parallelism without sequence parallelism in training",
                  "set parallel.sequence_parallel=true", "tp > 1 needs sequence_parallel=true",
                  when=lambda c: is_moe(c.model)),
            _need("model.moe.topk_norm", lambda c, w: c.model.moe.topk_norm or c.model.moe.score_function == "softmax",
                  "megatron-core always renormalises sigmoid scores over the chosen experts",
                  "set model.moe.topk_norm=true with score_function=sigmoid", "sigmoid scores need topk_norm=true",
                  when=lambda c: is_moe(c.model)),
            _need("model.moe.dense_layers",
                  lambda c, w: all(0 <= int(i) < c.model.num_layers for i in c.model.moe.dense_layers),
                  "names a layer the model does not have", "give indices in [0, model.num_layers)",
                  "dense_layers within the model", when=lambda c: is_moe(c.model)),
            _need("model.moe.shared_expert_ffn_hidden_size",
                  lambda c, w: (c.model.moe.shared_expert_ffn_hidden_size or 0) % c.parallel.tp == 0,
                  "the shared experts' hidden units are not divisible by tp", "choose a tp that divides them",
                  "shared_expert_ffn_hidden_size % tp == 0", when=lambda c: is_moe(c.model)),
        ),
        config="model.moe.num_experts, model.moe.* (docs/moe.md)",
    ),
    Feature(
        "Expert parallelism", "parallelism", TESTED_CPU,
        "parallel.ep splits the routed experts of every MoE layer over ep ranks drawn from the data- and context-parallel ranks (megatron's expert rank generator: world = etp x ep x expert-DP x pp); their gradients are reduced over the expert data-parallel group by megatron's DDP, the distributed optimizer shards them there; checkpoints, HF import (each rank reads only its experts) and export work from and into any layout.",
        ("tests/test_moe.py::test_loss_and_gradients_match_one_process",
         "tests/test_moe.py::test_score_matches_hf_on_expert_parallel_layouts",
         "tests/test_moe.py::test_distributed_optimizer_with_experts_matches_one_process",
         "tests/test_moe.py::test_convert_reshards_experts_between_layouts",
         "tests/test_moe.py::test_moe_layouts_are_refused_before_launch",
         "tests/test_moe.py::test_planner_counts_experts_per_rank_and_plans_qwen3_30b_a3b",
         "tests/test_moe.py::test_planner_moe_activations_match_a_measurement"),
        (
            _need("parallel.ep", lambda c, w: is_moe(c.model), "expert parallelism needs an MoE model",
                  "set model.moe.num_experts (or model.hf_path to an MoE checkpoint), or parallel.ep=1",
                  "ep > 1 needs model.moe.num_experts", when=lambda c: c.parallel.ep > 1),
            _need("parallel.ep", lambda c, w: c.model.moe.num_experts % c.parallel.ep == 0,
                  "model.moe.num_experts={c.model.moe.num_experts} is not divisible by ep",
                  "choose an ep that divides the number of experts", "num_experts % ep == 0",
                  when=lambda c: is_moe(c.model)),
            _need("parallel.ep",
                  lambda c, w: w is None or w % ((c.parallel.etp or c.parallel.tp) * c.parallel.ep * c.parallel.pp) == 0,
                  "world size {w} is not divisible by etp*ep*pp (one copy of the experts spans etp x ep x pp ranks)",
                  "choose etp*ep*pp that divides {w}, e.g. ep = {w} / (etp*pp)", "world size divisible by etp*ep*pp"),
            _need("parallel.pp", lambda c, w: c.parallel.pp == 1,
                  "megatron's inference engine keeps idle expert-parallel ranks in step with dummy forwards, "
                  "which have no pipeline stages", "use parallel.pp=1 with parallel.ep > 1 (more ep or tp instead)",
                  "rollout.engine=megatron with ep > 1 needs pp=1",
                  when=lambda c: c.parallel.ep > 1 and rollout_engine(c) == MEGATRON),
        ),
        config="parallel.ep",
    ),
    Feature(
        "Expert tensor parallelism", "parallelism", TESTED_CPU,
        "parallel.etp splits each routed expert's FFN over etp ranks, independently of the attention's tp (e.g. tp=2 with etp=1: whole experts over more EP ranks).",
        ("tests/test_moe.py::test_loss_and_gradients_match_one_process",
         "tests/test_moe.py::test_score_matches_hf_on_expert_parallel_layouts"),
        (
            _need("parallel.etp", lambda c, w: is_moe(c.model), "expert tensor parallelism needs an MoE model",
                  "set model.moe.num_experts, or parallel.etp=null", "etp needs model.moe.num_experts",
                  when=lambda c: c.parallel.etp is not None and c.parallel.etp != c.parallel.tp),
            _need("parallel.etp", lambda c, w: expert_ffn_size(c.model) % (c.parallel.etp or c.parallel.tp) == 0,
                  "an expert's hidden units ({c.model.moe.ffn_hidden_size}) are not divisible by etp (null = tp)",
                  "choose an etp that divides model.moe.ffn_hidden_size", "moe.ffn_hidden_size % etp == 0",
                  when=lambda c: is_moe(c.model)),
            _need("parallel.etp", lambda c, w: not c.model.add_bias_linear or (c.parallel.etp or c.parallel.tp) == 1,
                  "megatron-core supports MoE linear biases only with etp=1", "set parallel.etp=1",
                  "linear biases need etp=1", when=lambda c: is_moe(c.model)),
        ),
        config="parallel.etp",
    ),
    Feature(
        "Qwen3-MoE", "models", TESTED_CPU,
        "Qwen3MoeForCausalLM checkpoints (per-expert tensor names, as on the Hub and as transformers saves them): QK norm, top-k routing with or without norm_topk_prob, decoder_sparse_step / mlp_only_layers; score, convert and PPO on any TP/PP/CP/EP/ETP layout.",
        ("tests/test_moe.py::test_score_matches_hf_on_expert_parallel_layouts",
         "tests/test_moe.py::test_hf_megatron_hf_round_trip_is_bit_exact_on_ep2_pp2",
         "tests/test_moe.py::test_convert_reshards_experts_between_layouts"),
        config="model.hf_path=<dir> (configs/qwen3_30b_a3b_32k.yaml)",
    ),
    Feature(
        "Qwen2-MoE", "models", TESTED_CPU,
        "Qwen2MoeForCausalLM: QKV bias, softmax routing without renormalisation, a shared expert scaled by its sigmoid gate, dense layers.",
        ("tests/test_moe.py::test_qwen2_moe_shared_experts_match_hf",
         "tests/test_moe.py::test_hf_megatron_hf_round_trip_is_bit_exact_on_ep2_pp2"),
        config="model.hf_path=<dir>",
    ),
    Feature(
        "MoE critic", "models", TESTED_CPU,
        "The value head on an MoE model: values and gradients independent of the TP/PP/CP/EP layout.",
        ("tests/test_moe.py::test_loss_and_gradients_match_one_process",),
        config="critic (PPO with GAE) on an MoE model",
    ),
    Feature(
        "Routing replay", "algorithms", TESTED_CPU,
        "algorithm.routing_replay=true: with rollout.engine=megatron the routers record each token's experts per MoE layer while the engine generates (prefill and decode, across evictions), keyed by (sample, position; copied to the host without a wait per layer and step, written once the rollout ends), and the recordings travel with the samples (exchanged over each pipeline stage's TP x DP x CP ranks); the old-log-prob forward and every training forward of the step route to them (weights recomputed at those experts), also when full recompute re-runs a layer in backward, so routing adds nothing to the rollout/train mismatch; actor/routing_replay_mismatch is the share of (token, layer) pairs whose recomputed top-k differs from the rollout's. With another engine the old-log-prob pass records instead. Host memory per rank: tokens x MoE layers of its stage x top-k x 2 bytes.",
        ("tests/test_moe.py::test_routing_replay_reproduces_the_recorded_routing",
         "tests/test_moe.py::test_routing_replay_with_full_recompute_gives_the_same_gradients",
         "tests/test_moe.py::test_rollout_records_the_routing_the_trainer_replays",
         "tests/test_moe.py::test_grpo_learns_on_a_tiny_moe"),
        (
            _need("algorithm.routing_replay", lambda c, w: is_moe(c.model), "routing replay needs an MoE model",
                  "set algorithm.routing_replay=false", "needs model.moe.num_experts",
                  when=lambda c: c.algorithm.routing_replay),
            _need("algorithm.routing_replay",
                  lambda c, w: rollout_engine(c) == MEGATRON or _old_logprob_source(c) == "recompute",
                  "rollout.engine={c.rollout.engine} does not record routing, so the old-log-prob pass would, and "
                  "algorithm.old_logprobs={c.algorithm.old_logprobs} does not run it",
                  "set rollout.engine=megatron (records routing while it generates), or algorithm.old_logprobs=recompute",
                  "rollout.engine=megatron, or old_logprobs resolves to recompute",
                  when=lambda c: c.algorithm.routing_replay),
        ),
        config="algorithm.routing_replay=true",
    ),
    Feature(
        "Context parallelism: p2p ring (local path)", "parallelism", TESTED_CPU,
        "K/V travel around the CP ring in the model dtype, the next hop overlapping the current block; each block is a fused attention kernel (CPU flash / CUDA flash or memory-efficient) returning its log-sum-exp, merged exactly; no mask tensor (zigzag pairs are full, causal-diagonal or skipped), so every rank does the same work per step; backward uses the kernels' backward. Saved activations O(S/CP). Packed rows: one kernel call per sequence on the CPU; on CUDA in half precision one variable-length flash call per ring step (the packing is tested on CPU, the CUDA call not yet run on a GPU).",
        ("tests/test_context_parallel.py::test_cp_attention_matches_one_process",
         "tests/test_context_parallel.py::test_packed_matches_one_process",
         "tests/test_context_parallel.py::test_packed_rows_as_one_varlen_call_per_ring_step"),
        config="parallel.cp>1, parallel.cp_comm_type=p2p",
        measured=(Measured("32k tokens, per-rank peak RSS: scoring 0.507x CP=1 at CP=2, 0.361x at CP=4; training 0.337x "
                           "at CP=4; ring blocks 1.14x SDPA's CPU time per useful FLOP (forward+backward, CP=2)",
                           "python benchmarks/long_context_memory.py --lengths 32768 --cp 1,2,4 --comm p2p,all_gather,a2a --modes score,train --attention"),),
    ),
    Feature(
        "Context parallelism: all_gather (local path)", "parallelism", TESTED_CPU,
        "K/V gathered over the CP group in the model dtype, then the same fused per-block kernel calls as the ring (no mask, no cache); backward gathers again and reduce-scatters the K/V gradients, so saved activations are 1/CP. While a layer runs it holds the whole sequence's K/V.",
        ("tests/test_context_parallel.py::test_cp_attention_matches_one_process",),
        config="parallel.cp_comm_type=all_gather",
        measured=(Measured("32k tokens, per-rank peak RSS: scoring 0.507x CP=1 at CP=2 (wall 0.68-0.80x), 0.361x at "
                           "CP=4; training 0.337x at CP=4", "python benchmarks/long_context_memory.py --lengths 32768 --cp 1,2,4 --comm p2p,all_gather,a2a --modes score,train --attention"),),
    ),
    Feature(
        "Context parallelism: a2a / Ulysses (local path)", "parallelism", TESTED_CPU,
        "An all-to-all turns sequence shards into head shards, one fused causal attention runs over the whole sequence (packed rows: per sequence), another all-to-all turns it back. K/V heads are split over CP when they divide, replicated when CP is a multiple of them.",
        ("tests/test_context_parallel.py::test_cp_attention_matches_one_process",),
        (
            _need("parallel.cp",
                  lambda c, w: _a2a_heads_fit(c),
                  "a2a splits each TP rank's heads over {c.parallel.cp_comm_type}'s a2a group: it needs (heads/tp) "
                  "divisible by the a2a size, and (kv_heads/tp) divisible by it or dividing it",
                  "use parallel.cp_comm_type=p2p, or an a2a size that divides heads/tp",
                  "a2a (local): (heads/tp) % a2a == 0; kv_heads/tp split or replicated",
                  when=lambda c: not _uses_te(c) and c.parallel.cp > 1 and c.parallel.cp_comm_type in A2A_COMM_TYPES),
        ),
        config="parallel.cp_comm_type=a2a",
        measured=(Measured("32k tokens, per-rank peak RSS: scoring 0.508x CP=1 at CP=2 (wall 0.66x), 0.362x at CP=4; "
                           "training 0.324x at CP=4", "python benchmarks/long_context_memory.py --lengths 32768 --cp 1,2,4 --comm p2p,all_gather,a2a --modes score,train --attention"),),
    ),
    Feature(
        "Context parallelism: a2a+p2p, hierarchical (local path)", "parallelism", TESTED_CPU,
        "a2a inside groups of consecutive CP ranks (parallel.hierarchical_context_parallel_sizes[0]), the ring across the groups: after the inner all-to-all a group holds exactly the zigzag halves of the outer ring, so the ring runs unchanged on head shards.",
        ("tests/test_context_parallel.py::test_cp_attention_matches_one_process",),
        config="parallel.cp_comm_type=a2a+p2p, parallel.hierarchical_context_parallel_sizes=[a2a, p2p]",
    ),
    Feature(
        "Context parallelism: TransformerEngine p2p / all_gather / a2a / a2a+p2p", "parallelism", GPU_UNTESTED,
        "TE's attention does the CP communication on the TE spec; a2a (Ulysses) splits each TP rank's query and KV heads over the a2a group.",
        (),
        (
            _need("parallel.cp",
                  lambda c, w: (attention_dims(c.model)[0] // c.parallel.tp) % _a2a_size(c) == 0
                  and (_heads_kv(c) // c.parallel.tp) % _a2a_size(c) == 0,
                  "a2a splits each TP rank's heads over the a2a group: TransformerEngine needs (heads/tp) % cp == 0 "
                  "and (kv_heads/tp) % cp == 0",
                  "use parallel.cp_comm_type=p2p, or a cp dividing both heads/tp and kv_heads/tp",
                  "a2a needs (heads/tp) % cp == 0 and (kv_heads/tp) % cp == 0",
                  when=lambda c: _uses_te(c) and c.parallel.cp > 1 and c.parallel.cp_comm_type in A2A_COMM_TYPES),
            _need("parallel.hierarchical_context_parallel_sizes",
                  lambda c, w: _product(c.parallel.hierarchical_context_parallel_sizes) == c.parallel.cp,
                  "the hierarchical CP sizes must multiply to parallel.cp",
                  "give sizes that multiply to {c.parallel.cp}, the a2a size first, or use cp_comm_type=p2p",
                  "a2a+p2p: product of hierarchical sizes == cp",
                  when=lambda c: c.parallel.cp_comm_type == "a2a+p2p" and c.parallel.cp > 1),
            _need("parallel.cp_comm_type", lambda c, w: _te_at_least("2.18"),
                  "TransformerEngine before 2.18 has no all_gather context parallelism for packed (THD) sequences",
                  "set batch.packing=false, or parallel.cp_comm_type=p2p, or install transformer-engine>=2.18",
                  "TE all_gather CP with packed sequences needs TE >= 2.18",
                  when=lambda c: _uses_te(c) and c.parallel.cp > 1 and c.parallel.cp_comm_type == "all_gather"
                  and c.batch.packing),
            _need("parallel.cp_comm_type", lambda c, w: _te_at_least("2.12"),
                  "TransformerEngine 2.9 and older have no a2a context parallelism for packed (THD) sequences",
                  "set batch.packing=false, or install transformer-engine>=2.12",
                  "TE a2a CP with packed sequences needs TE >= 2.12",
                  when=lambda c: _uses_te(c) and c.parallel.cp > 1 and c.parallel.cp_comm_type == "a2a" and c.batch.packing),
        ),
        config="model.transformer_impl=transformer_engine, parallel.cp_comm_type",
    ),
    Feature(
        "Host-side CP sharding", "data", TESTED_CPU,
        "Each rank cuts its zigzag shard of every sequence on the host; only 1/CP of the tokens (and masks, labels, per-token fields) reach its device. Labels are shifted before the split.",
        ("tests/test_context_parallel.py::test_each_rank_receives_one_cp_th_of_the_tokens",),
        config="parallel.cp>1 (always on)",
    ),
    Feature(
        "Packed sequences (THD) with CP", "data", TESTED_CPU,
        "Mixed lengths in one micro-batch, each padded to a multiple of 2*cp (x tp with SP), attention never crosses sequences, per-sequence outputs back in the original order.",
        ("tests/test_context_parallel.py::test_packed_matches_one_process",),
        config="batch.packing=true",
    ),
    Feature(
        "Packed attention without a per-sequence loop (CP=1)", "data", TESTED_CPU,
        "Sequences of similar length share one fused causal SDPA call on a padded batch (padding at each sequence's end, hidden by the causal mask); short sequences always share one call; on CUDA in half precision one variable-length flash call (torch.nn.attention.varlen). The ring at CP>1 still calls the kernels per sequence of a packed row.",
        ("tests/test_packed_attention.py::test_packed_attention_matches_attention_per_sequence",),
        config="batch.packing=true (default)",
        measured=(Measured("attention fwd+bwd of 128 sequences of 12-19 tokens: 35 ms bucketed vs 34 ms padded rows vs 400 ms one call per sequence (2 CPU cores)",
                           "python benchmarks/packed_attention.py"),),
    ),
    Feature(
        "Unpacked (BSHD) input with CP", "data", TESTED_CPU,
        "Right-padded rows, zigzag-split per row.",
        ("tests/test_context_parallel.py::test_unpacked_matches_one_process",),
        config="batch.packing=false",
    ),
    Feature(
        "Token-budget micro-batches", "data", TESTED_CPU,
        "batch.max_tokens_per_rank: LPT-balanced on a cost with attention's quadratic term, same count on every DP rank, sequences up to budget x CP; a longer one is a clear error.",
        ("tests/test_context_parallel.py::test_token_budget_does_not_change_logprobs_or_gradients",
         "tests/test_context_parallel.py::test_sequence_longer_than_budget_times_cp_is_a_data_error"),
        config="batch.max_tokens_per_rank",
    ),
    Feature(
        "Token-budget micro-batches by default", "data", TESTED_CPU,
        "With neither batch.max_tokens_per_rank nor batch.micro_batch_size set, the budget is derived: 64 sequences of data.max_prompt_tokens + rollout.max_new_tokens, at most what 4 GiB of activations per rank hold for the model and layout, at least one such sequence, at least pp micro-batches; rollout.max_batch_size likewise defaults to the step's whole batch per rank (within 4 GiB of KV cache). An explicit micro_batch_size still fixes the size; a budget takes precedence over it.",
        ("tests/test_ppo.py::test_default_configs_train_on_micro_batches_of_many_sequences",
         "tests/test_context_parallel.py::test_token_budget_does_not_change_logprobs_or_gradients"),
        config="batch.max_tokens_per_rank=null, batch.micro_batch_size=null (defaults)",
    ),
    Feature(
        "Slurm launch (sbatch)", "cluster", TESTED_CPU,
        "scripts/slurm/ppo.sbatch: one srun task per node running torchrun (c10d rendezvous on the first node), logs in the run dir, one dead node ends the job; tested against a real single-node Slurm in CI.",
        ("tests/test_slurm.py::test_smoke_job_on_one_node_with_four_ranks",
         "tests/test_slurm.py::test_bad_override_fails_the_job_with_the_config_error"),
        config="sbatch scripts/slurm/ppo.sbatch",
    ),
    Feature(
        "Requeue and resume on preemption", "cluster", TESTED_CPU,
        "--signal=B:USR1 reaches every rank, the trainer checkpoints after the current step and exits 0, the script requeues the job, and the restarted job resumes without losing or repeating a step.",
        ("tests/test_slurm.py::test_preempted_ppo_job_resumes_from_checkpoint",
         "tests/test_slurm.py::test_usr1_checkpoints_and_requeues_with_stub_trainer"),
        config="#SBATCH --requeue --signal=B:USR1@300; trainer.resume=auto",
    ),
    Feature(
        "Multi-node launch", "cluster", GPU_UNTESTED,
        "The same sbatch script with NODES>1 (torchrun rendezvous on the first node); only single-node jobs run in CI.",
        (),
        config="NODES=... sbatch scripts/slurm/ppo.sbatch",
    ),
]


def render_markdown(versions: dict[str, str]) -> str:
    """The feature matrix as Markdown (``docs/feature_matrix.md``)."""
    lines = [
        "# Feature matrix",
        "",
        "Generated from `megatron_rl/features.py` by `megatron-rl features --markdown`; do not edit by hand",
        "(`tests/test_features.py` fails when this file and the registry differ).",
        "",
        "Tested stack: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        "Status: **" + "**, **".join(STATUSES) + "**. Every constraint below is enforced by config",
        "validation before any process starts (`megatron-rl validate CONFIG`), with a one-line error and exit code 2.",
        "",
    ]
    areas: list[str] = []
    for f in FEATURES:
        if f.area not in areas:
            areas.append(f.area)
    for area in areas:
        lines += [f"## {area}", "", "| Feature | Status | Turn on with | Constraints | Evidence |", "|---|---|---|---|---|"]
        for f in FEATURES:
            if f.area != area:
                continue
            cons = "<br>".join(c.text for c in f.constraints) or "-"
            ev = "<br>".join(f"`{e}`" for e in f.evidence) or "-"
            summary = f.summary + "".join(f"<br>Measured: {m.figure} (`{m.command}`)" for m in f.measured)
            lines.append(f"| **{f.name}**: {summary} | {f.status} | {f.config or '-'} | {cons} | {ev} |")
        lines.append("")
    return "\n".join(lines)
