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


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    area: str
    status: str
    summary: str
    evidence: tuple[str, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    config: str = ""  # the keys that turn it on
    in_use: Optional[Callable[[object], bool]] = None  # planned/unsupported features refuse configs using them


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

    return Constraint(text, check)


def _mp(cfg) -> int:
    p = cfg.parallel
    return p.tp * p.pp * p.cp


def _heads_kv(cfg) -> int:
    return cfg.model.num_query_groups or cfg.model.num_attention_heads


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
        "Parallel layouts (world size <= 8)", "runtime", TESTED_CPU,
        "Megatron parallel_state for every TP x PP x CP x DP (and VPP) layout; DP derived from world size.",
        ("tests/test_runtime.py::test_parallel_state_every_layout_up_to_8",),
        (
            _need("parallel.tp", lambda c, w: w is None or w % _mp(c) == 0,
                  "world size {w} is not divisible by tp*pp*cp",
                  "choose tp*pp*cp that divides {w}, or start a multiple of tp*pp*cp processes",
                  "world size divisible by tp*pp*cp"),
            _need("parallel.tp", lambda c, w: min(c.parallel.tp, c.parallel.pp, c.parallel.cp) >= 1,
                  "parallel sizes must be >= 1", "set parallel.tp/pp/cp to positive integers",
                  "tp, pp, cp >= 1"),
        ),
        config="parallel.tp, parallel.pp, parallel.cp, --nproc",
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
        "Unknown keys, wrong types and impossible layouts fail before any process starts: one line naming the key and the fix, exit code 2.",
        ("tests/test_config.py::test_bad_layouts_are_rejected_with_the_key",
         "tests/test_cli.py::test_bad_override_exits_2_with_one_line"),
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
        "Several model chunks per pipeline rank. With PP=2 batched p2p is turned off: megatron-core gives silently wrong results there.",
        ("tests/test_parallel_parity.py::test_pp2_vpp2",
         "tests/test_config.py::test_pp2_vpp_with_batched_p2p_is_rejected"),
        (
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
        "Activation recompute", "memory", TESTED_CPU,
        "Megatron full (uniform/block) or selective recompute, passed through to TransformerConfig.",
        ("tests/test_parallel_parity.py::test_recompute_full_and_selective_match",),
        (
            _need("model.recompute.granularity", lambda c, w: c.model.recompute.granularity in (None, "full", "selective"),
                  "unknown recompute granularity", "use null, full or selective", "granularity in {null, full, selective}"),
            _need("model.recompute.method", lambda c, w: c.model.recompute.method in ("uniform", "block"),
                  "unknown recompute method", "use uniform or block", "method in {uniform, block}",
                  when=lambda c: c.model.recompute.granularity == "full"),
            _need("model.recompute.modules",
                  lambda c, w: set(c.model.recompute.modules) <= {"core_attn", "mlp", "layernorm", "moe_act"},
                  "unknown selective-recompute module", "use a subset of [core_attn, mlp, layernorm, moe_act]",
                  "modules within {core_attn, mlp, layernorm, moe_act}",
                  when=lambda c: c.model.recompute.granularity == "selective"),
            _need("model.recompute.modules",
                  lambda c, w: not ({"mlp", "layernorm"} & set(c.model.recompute.modules)),
                  "recompute of mlp/layernorm modules needs TransformerEngine in megatron-core 0.16 (and hangs with linear biases)",
                  "use modules=[core_attn] or granularity=full", "selective mlp/layernorm recompute needs TE",
                  when=lambda c: c.model.recompute.granularity == "selective" and c.model.transformer_impl != "transformer_engine"),
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
        (
            _need("model.transformer_impl", lambda c, w: c.model.transformer_impl in ("auto", "local", "transformer_engine"),
                  "unknown layer implementation", "use auto, local or transformer_engine", "auto | local | transformer_engine"),
        ),
        config="model.transformer_impl=transformer_engine",
    ),
]


FEATURES += [
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
        "Chunked vocab-parallel log-probs and entropy", "memory", TESTED_CPU,
        "Output projection fused into the log-softmax, walked in token chunks with fp32 inside the chunk; never [tokens, vocab]. Measured peak extra memory 0.18x naive at 2k tokens.",
        ("tests/test_logprob_op.py::test_matches_naive_forward_and_gradients",
         "tests/test_logprob_op.py::test_extra_memory_below_a_quarter_of_naive_at_2k_tokens"),
        config="batch.logprob_chunk_size",
    ),
    Feature(
        "Distributed checkpoints with resharding", "checkpointing", TESTED_CPU,
        "Megatron dist_checkpointing (torch_dist), atomic rename, loadable into another TP/PP/VPP layout.",
        ("tests/test_hf_models.py::test_convert_command_both_directions",),
        config="megatron-rl convert; trainer.save_every",
    ),
]


def feature(name: str) -> Feature:
    for f in FEATURES:
        if f.name == name:
            return f
    raise KeyError(name)


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
            lines.append(f"| **{f.name}**: {f.summary} | {f.status} | {f.config or '-'} | {cons} | {ev} |")
        lines.append("")
    return "\n".join(lines)
