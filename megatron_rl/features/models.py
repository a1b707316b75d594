"""Models: layer specs, architectures, HF import and export, MoE layers, heads."""

from __future__ import annotations

from megatron_rl.features.base import GPU_UNTESTED, TESTED_CPU, Constraint, Feature, Measured, need
from megatron_rl.layout.arch import LLAMA3_ROPE_FIXED, is_moe, max_positions, yarn_original_positions

LLAMA3_ORIGINAL = LLAMA3_ROPE_FIXED["original_max_position_embeddings"]

AREA = "models"


def _position_limit(cfg, job=None) -> tuple | None:
    """The longest sequence generation makes past the model's positions: the error.  It is the
    prompts a command read (``job.prompts_read``, ``generate``) + ``rollout.max_new_tokens``, else
    ``data.max_prompt_tokens + rollout.max_new_tokens`` (training drops longer prompts); a
    multi-turn trajectory's ``rollout.max_trajectory_tokens`` (resolved) besides."""
    read = job.prompts_read if job is not None else None
    if read is not None:
        problem = _prompts_past_positions(cfg, read)
    elif not cfg.rollout.multi_turn:
        problem = _budget_past_positions(cfg)
    else:
        problem = None
    return problem or _trajectory_past_positions(cfg)


def _trajectory_past_positions(cfg) -> tuple | None:
    trajectory = cfg.rollout.max_trajectory_tokens if cfg.rollout.multi_turn else None
    limit = max_positions(cfg.model)
    if trajectory is None or trajectory <= limit:
        return None
    return ("rollout.max_trajectory_tokens", trajectory,
            f"multi-turn trajectories of {trajectory} tokens exceed the model's {limit} positions",
            f"set rollout.max_trajectory_tokens <= {limit}, or lower rollout.max_turns / rollout.max_new_tokens, "
            "or extend the positions (model.rope_scaling, docs/long_context.md)")


def _window(model) -> str:
    """Where the model's positions come from, for the error."""
    if model.rope_scaling.type == "yarn":
        return (f"YaRN factor {model.rope_scaling.factor:g} x original_max_position_embeddings "
                f"{yarn_original_positions(model)}; native model.max_position_embeddings "
                f"{model.max_position_embeddings}")
    return f"model.max_position_embeddings {model.max_position_embeddings}"


def _extension(model, longest: int) -> str:
    """How to give the model ``longest`` positions: YaRN, or a larger factor of it."""
    if model.rope_scaling.type == "yarn":
        return "raise model.rope_scaling.factor"
    native = model.max_position_embeddings
    return (f"enable YaRN (model.rope_scaling.type=yarn, model.rope_scaling.factor={-(-longest // native)}, "
            f"model.rope_scaling.original_max_position_embeddings={native}; docs/long_context.md)")


def _budget_past_positions(cfg) -> tuple | None:
    """``data.max_prompt_tokens + rollout.max_new_tokens`` past the model's positions: the error."""
    model, longest = cfg.model, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    limit = max_positions(model)
    if longest <= limit:
        return None
    if model.rope_scaling.type == "yarn":
        fix = f"{_extension(model, longest)}, or lower data.max_prompt_tokens / rollout.max_new_tokens"
    else:
        fix = (f"{_extension(model, longest)}, raise model.max_position_embeddings for a model built from scratch, "
               "or lower data.max_prompt_tokens / rollout.max_new_tokens")
    return ("rollout.max_new_tokens", cfg.rollout.max_new_tokens,
            f"data.max_prompt_tokens {cfg.data.max_prompt_tokens} + rollout.max_new_tokens "
            f"{cfg.rollout.max_new_tokens} = {longest} tokens exceed the model's {limit} positions "
            f"({_window(model)})", fix)


def _prompts_past_positions(cfg, read) -> tuple | None:
    """The longest prompt read + ``rollout.max_new_tokens`` past the model's positions: the error,
    naming its line and what would fit."""
    model, new = cfg.model, cfg.rollout.max_new_tokens
    longest, limit = read.tokens + new, max_positions(model)
    if longest <= limit:
        return None
    fixes = [f"shorten the prompts to {limit - new} tokens or fewer"] if limit > new else []
    fixes += [f"lower rollout.max_new_tokens to {limit - read.tokens} or less"] if limit > read.tokens else []
    fixes.append(_extension(model, longest))
    fix = fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + ", or " + fixes[-1]
    return (read.key, read.path,
            f"its longest prompt (line {read.line}, {read.tokens} tokens) + rollout.max_new_tokens {new} = {longest} "
            f"tokens exceed the model's {limit} positions ({_window(model)})", fix)


FEATURES = [
    Feature(
        "Local layer spec", "models", TESTED_CPU,
        "megatron-core's local spec with our sequence-parallel norms and our core attention (SDPA; CP; packed "
        "sequences).",
        ("tests/test_parallel_parity.py::test_tp2_sequence_parallel",),
        config="model.transformer_impl=local (auto without TE or CUDA)",
    ),
    Feature(
        "TransformerEngine layer spec", "models", GPU_UNTESTED,
        "megatron-core's TE spec (fused norms/linears, TE attention incl. its CP); needs `pip install .[gpu]` and "
        "CUDA.",
        ("tests/test_models_te.py::test_te_spec_matches_local_spec",),
        config="model.transformer_impl=transformer_engine",
    ),
    Feature(
        "Llama 2/3 (incl. Llama-3 RoPE scaling)", "models", TESTED_CPU,
        "GQA, SwiGLU, RMSNorm, rope theta, untied embeddings; Llama-3.1 RoPE scaling with megatron-core's fixed "
        "factors.",
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
        "The vocabulary is padded to a multiple of make_vocab_size_divisible_by*tp; padded entries are masked out of "
        "log-probs and entropy.",
        ("tests/test_logprob_op.py::test_padded_vocab_never_leaks",
         "tests/test_logprob_op.py::test_tensor_parallel_shards_match_naive"),
        config="model.make_vocab_size_divisible_by",
    ),
    Feature(
        "Critic value head", "models", TESTED_CPU,
        "Linear(hidden, 1) in fp32 on the last stage, parameters marked sequence-parallel so TP ranks never drift; "
        "from the actor or a reward-model checkpoint (HF `score`).",
        ("tests/test_hf_models.py::test_critic_values_and_head_gradient_do_not_depend_on_layout",),
        config="critic (PPO with GAE)",
    ),
    Feature(
        "HF import / export (bridge)", "models", TESTED_CPU,
        "Safetensors into any TP/PP/VPP layout, each rank reading only its slices; export back bit-exact (critic as "
        "*ForTokenClassification), with the tokenizer the run used (data.tokenizer, else the model's; every file, "
        "chat_template.jinja included, so chat prompts give the same ids) and the model's generation_config.json.",
        ("tests/test_hf_models.py::test_hf_megatron_hf_round_trip_is_bit_exact",
         "tests/test_hf_models.py::test_convert_command_both_directions",
         "tests/test_export_tools.py::test_export_of_a_run_carries_its_tokenizer_chat_template_and_generation_config"),
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
        "megatron-rl generate", "models", TESTED_CPU,
        "Completions (token ids, text, temperature-scaled log-probs, finish reason) for a JSONL of prompt_ids, prompt "
        "or messages rows, from an HF model or a checkpoint, with the rollout engines on any layout. Rows keep the "
        "name prompt_ids both ways, so an output file is also an input (input_ids is read too); rows of ids need no "
        "tokenizer (a model saved without one generates, text null).",
        ("tests/test_rollout_megatron_engine.py::test_generate_command_writes_tokens_text_and_logprobs",
         "tests/test_export_tools.py::test_generate_output_is_read_back_as_input",
         "tests/test_export_tools.py::test_generate_from_ids_with_a_model_saved_without_tokenizer"),
        config="megatron-rl generate --hf-model DIR (or --checkpoint RUN) --input IN --output OUT; rollout.*",
    ),
    Feature(
        "Mixture-of-experts layers", "models", TESTED_CPU,
        "megatron-core's MoE layer (top-k router, alltoall or allgather token dispatcher, SequentialMLP experts on the "
        "local spec, shared experts with an optional sigmoid gate, dense layers by model.moe.layer_freq / "
        "dense_layers) with our router: load-balancing (per micro-batch or per sequence) and z-losses over real "
        "tokens, divided once by the pass's token count like the policy loss, reported as actor/moe_aux_loss and "
        "actor/moe_z_loss and in the gradient only with a coefficient > 0; no token dropping unless "
        "model.moe.capacity_factor is set. Training generates with megatron's dynamic inference engine "
        "(rollout.batching=auto picks it for an MoE model; static batching is refused before launch).",
        ("tests/test_moe.py::test_loss_and_gradients_match_one_process",
         "tests/test_moe.py::test_router_losses_enter_the_gradient_with_their_coefficients",
         "tests/test_moe.py::test_micro_batch_load_balancing_loss_where_the_batch_is_cut_the_same",
         "tests/test_moe.py::test_moe_config_maps_to_megatron_fields",
         "tests/test_moe.py::test_grpo_learns_on_a_tiny_moe"),
        (
            need("model.moe.router_topk", lambda c, w: c.model.moe.router_topk <= c.model.moe.num_experts,
                 "router_topk={c.model.moe.router_topk} is more than num_experts={c.model.moe.num_experts}",
                 "route to at most num_experts experts", "router_topk <= num_experts", when=lambda c: is_moe(c.model)),
            need("parallel.sequence_parallel", lambda c, w: c.parallel.tp == 1 or c.parallel.sequence_parallel,
                 "megatron-core's MoE layer refuses tensor parallelism without sequence parallelism in training",
                 "set parallel.sequence_parallel=true", "tp > 1 needs sequence_parallel=true",
                 when=lambda c: is_moe(c.model)),
            need("model.moe.topk_norm", lambda c, w: c.model.moe.topk_norm or c.model.moe.score_function == "softmax",
                 "megatron-core always renormalises sigmoid scores over the chosen experts",
                 "set model.moe.topk_norm=true with score_function=sigmoid", "sigmoid scores need topk_norm=true",
                 when=lambda c: is_moe(c.model)),
            need("model.moe.dense_layers",
                 lambda c, w: all(0 <= int(i) < c.model.num_layers for i in c.model.moe.dense_layers),
                 "names a layer the model does not have", "give indices in [0, model.num_layers)",
                  "dense_layers within the model", when=lambda c: is_moe(c.model)),
            need("model.moe.shared_expert_ffn_hidden_size",
                 lambda c, w: (c.model.moe.shared_expert_ffn_hidden_size or 0) % c.parallel.tp == 0,
                 "the shared experts' hidden units are not divisible by tp", "choose a tp that divides them",
                 "shared_expert_ffn_hidden_size % tp == 0", when=lambda c: is_moe(c.model)),
        ),
        config="model.moe.num_experts, model.moe.* (docs/moe.md)",
    ),
    Feature(
        "Qwen3-MoE", "models", TESTED_CPU,
        "Qwen3MoeForCausalLM checkpoints (per-expert tensor names, as on the Hub and as transformers saves them): QK "
        "norm, top-k routing with or without norm_topk_prob, decoder_sparse_step / mlp_only_layers; score, convert and "
        "PPO on any TP/PP/CP/EP/ETP layout.",
        ("tests/test_moe.py::test_score_matches_hf_on_expert_parallel_layouts",
         "tests/test_moe.py::test_hf_megatron_hf_round_trip_is_bit_exact_on_ep2_pp2",
         "tests/test_moe.py::test_convert_reshards_experts_between_layouts"),
        config="model.hf_path=<dir> (configs/qwen3_30b_a3b_32k.yaml)",
    ),
    Feature(
        "Qwen2-MoE", "models", TESTED_CPU,
        "Qwen2MoeForCausalLM: QKV bias, softmax routing without renormalisation, a shared expert scaled by its sigmoid "
        "gate, dense layers.",
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
        "YaRN RoPE scaling", "models", TESTED_CPU,
        "HF rope_scaling type yarn (Qwen2.5/Qwen3 past their native window) read from config.json or set as "
        "model.rope_scaling, built as megatron-core's YaRN embedding with HF's attention factor on cos and sin "
        "(also in megatron's inference engine, both batchings; RoPE fusion off, as fused packed RoPE drops "
        "that factor), written back to config.json on export; log-probs match HF transformers "
        "on TP, PP/VPP and CP (p2p packed, all_gather unpadded, a2a) at 4x the original window. HF linear / dynamic "
        "scaling is refused.",
        ("tests/test_hf_models.py::test_yarn_matches_hf_on_every_layout",
         "tests/test_hf_models.py::test_yarn_reference_depends_on_frequencies_and_attention_factor",
         "tests/test_rollout_megatron_engine.py::test_engine_greedy_is_the_argmax_and_logprobs_are_the_trainers",
         "tests/test_hf_config.py::test_yarn_frequencies_and_attention_factor_match_hf",
         "tests/test_hf_config.py::test_yarn_round_trips_through_convert",
         "tests/test_hf_config.py::test_yarn_enabled_in_the_yaml_is_exported_and_hf_runs_it_alike"),
        (
            need("model.rope_scaling.factor",
                 lambda c, w: c.model.rope_scaling.factor is not None,
                 "RoPE scaling type {c.model.rope_scaling.type} needs a factor",
                 "set model.rope_scaling.factor (Qwen2.5: 4 with original_max_position_embeddings 32768)",
                 "llama3 / yarn: factor set",
                 when=lambda c: c.model.rope_scaling.type != "none"),
            need("model.rope_scaling.original_max_position_embeddings",
                 lambda c, w: c.model.rope_scaling.original_max_position_embeddings in (None, LLAMA3_ORIGINAL),
                 f"megatron-core's Llama-3 scaling has a fixed original length of {LLAMA3_ORIGINAL}",
                 "leave it unset for llama3 (or use a Llama-3.1 checkpoint)",
                 f"llama3: original_max_position_embeddings {LLAMA3_ORIGINAL}",
                 when=lambda c: c.model.rope_scaling.type == "llama3"),
        ),
        config="model.rope_scaling.type=yarn (or from the HF config.json)",
        measured=(Measured("max |logprob - HF| 9.5e-7 on TP1, TP2+SP, PP2xVPP2, CP2 p2p / all_gather / a2a, TP2xCP2 "
                           "(fp32, sequences to 4x the original window; without YaRN 0.24, without its attention "
                           "factor 0.067)", "pytest -s tests/test_hf_models.py -k yarn"),),
    ),
    Feature(
        "Sequence length within the model's positions", "models", TESTED_CPU,
        "data.max_prompt_tokens + rollout.max_new_tokens must fit the positions the model's RoPE is meant for: "
        "model.max_position_embeddings, or with YaRN factor x original_max_position_embeddings; checked before "
        "launch.  `generate` checks the longest prompt of its input + rollout.max_new_tokens instead, alike on "
        "every layout.",
        ("tests/test_hf_config.py::test_position_limit_is_checked_before_launch",
         "tests/test_prompt_lengths.py::test_generate_refuses_a_prompt_past_the_positions_with_one_line_on_every_layout"),
        (
            # The lengths of what a run generates; score reads the sequences it is given.
            Constraint("prompt + response <= max positions (native, or YaRN factor x original) (when generating)",
                       lambda c, w, job: _position_limit(c, job), "rollout.max_new_tokens", generation=True,
                       reads_job=True),
        ),
        config="data.max_prompt_tokens, rollout.max_new_tokens, model.max_position_embeddings, model.rope_scaling",
    ),
]
