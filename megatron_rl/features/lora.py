"""LoRA: low-rank adapters on the frozen base, for the actor and the critic."""

from __future__ import annotations

from megatron_rl.features.base import PLANNED, TESTED_CPU, Feature, Measured, _uses_te, need
from megatron_rl.features.rollout import shares_actor_shards
from megatron_rl.layout.lora import (
    ALL_LINEAR,
    ATTENTION,
    PROJECTIONS,
    int8_base,
    lora_on,
    moe_mlp_targets,
    unknown_targets,
)

AREA = "LoRA"

_NAMES = ", ".join(PROJECTIONS) + f" or {ALL_LINEAR}"


def _targets_rules(part: str) -> tuple:
    def lora(c):
        return getattr(c, part).lora

    key = f"{part}.lora.target_modules"
    return (
        need(key, lambda c, w: not unknown_targets(lora(c).target_modules) and bool(lora(c).target_modules),
             f"{part}.lora.target_modules names no projection LoRA knows: {{c.{part}.lora.target_modules}}",
             f"name projections as Hugging Face does: {_NAMES}",
             f"{part}.lora.target_modules are HF projection names", when=lambda c: lora_on(lora(c))),
        need(key, lambda c, w: not moe_mlp_targets(c.model, lora(c).target_modules),
             "adapters on the MLP of a mixture-of-experts model (one per expert) are not built yet",
             f"set {key}=[{','.join(ATTENTION)}] (attention projections) on this model",
             "LoRA on a mixture-of-experts model: attention projections only",
             when=lambda c: lora_on(lora(c))),
        need("model.transformer_impl", lambda c, w: not _uses_te(c),
             "LoRA adapters read each projection's input, which TransformerEngine's fused layer-norm + linear "
             "layer does not expose", "set model.transformer_impl=local for LoRA runs",
             "LoRA runs on the local layer spec (not TransformerEngine's)", when=lambda c: lora_on(lora(c))),
    )


def _int8_in_place(c) -> bool:
    """An int8 base generates with the training model's own shards (no refit of the base)."""
    return not c.rollout.ranks and shares_actor_shards(c)


def _critic_base_restorable(c) -> bool:
    """A LoRA critic's checkpoint holds adapters only: its base must be rebuilt on resume, which a
    fully trained actor's SFT warm-up would have changed."""
    return lora_on(c.actor.lora) or bool(c.critic.hf_path) or not c.trainer.sft_warmup_steps


FEATURES = [
    Feature(
        "LoRA adapters on tensor-parallel layers", AREA, TESTED_CPU,
        "Low-rank adapters (peft's: A Kaiming-uniform, B zero, scaled by alpha/rank) on megatron's column- and "
        "row-parallel layers, one per HF projection on the fused QKV and gate/up layers; the base frozen in the "
        "model's dtype, adapters and their Adam state in fp32, only adapters (and a critic's value head) train; "
        "TP (A or B split like the base), sequence parallelism, PP/VPP, CP, DP (distributed optimizer too), EP for "
        "a MoE model's attention, and full recompute equal one process.",
        ("tests/test_lora.py::test_lora_on_every_layout_equals_one_process",
         "tests/test_lora.py::test_lora_with_a_bf16_base_stays_within_bf16_rounding_of_fp32",
         "tests/test_lora.py::test_fresh_adapters_start_as_peft_does_the_same_on_every_layout_and_leave_the_model_"
         "unchanged"),
        constraints=_targets_rules("actor") + _targets_rules("critic") + (
            need("critic.lora.rank", lambda c, w: _critic_base_restorable(c),
                 "a LoRA critic starts from the actor after its SFT warm-up, which a checkpoint of adapters cannot "
                 "restore", "use actor.lora too, set critic.hf_path, or train the critic fully (critic.lora.rank=0)",
                 "critic.lora with trainer.sft_warmup_steps needs actor.lora or critic.hf_path",
                 when=lambda c: lora_on(c.critic.lora)),
        ),
        config="actor.lora.rank, alpha, dropout, target_modules; critic.lora.*",
        measured=(Measured("GRPO on add_small, a hidden-256 model, 30 steps, 2 seeds: LoRA rank 8 ends at reward 0.673 "
                           "(full fine-tuning: 0.713 at its best rate); on the hidden-64 demo model LoRA stays below",
                           "python benchmarks/lora_vs_full.py --seeds 2 --steps 30 --full-lrs 0.002,0.0005 --set "
                           "model.hidden_size=256 --set model.ffn_hidden_size=704 --set model.num_attention_heads=8 "
                           "--set model.num_query_groups=4"),),
    ),
    Feature(
        "LoRA equals peft", AREA, TESTED_CPU,
        "Our LoRA forward and adapter gradients on an HF model's weights equal peft's LoRA on the HF model with the "
        "same adapters (1e-4 bound; log-probs 9.5e-7, gradients 4.7e-7 of the largest measured), on one process and "
        "TP2 with sequence parallelism.",
        ("tests/test_lora.py::test_lora_equals_peft_on_the_hf_model_and_exports_what_peft_loads",),
        config="actor.lora",
    ),
    Feature(
        "LoRA reference = the base with adapters off", AREA, TESTED_CPU,
        "A LoRA actor with a KL term keeps no reference copy: the reference pass runs the actor with its adapters "
        "switched off (the base before any training, SFT warm-up included).",
        ("tests/test_lora.py::test_lora_checkpoints_hold_adapters_only_and_resume_exactly_on_another_layout",),
        config="actor.lora.rank > 0 with algorithm.kl_coef > 0",
    ),
    Feature(
        "LoRA checkpoints: adapters only, bound to their base", AREA, TESTED_CPU,
        "Checkpoints hold adapters, a critic's value head and their optimizer state, plus the base's path and "
        "sha256 (or seed); a resume loads the base first, then the adapters, exactly and onto another layout; "
        "adapters of another base are refused.",
        ("tests/test_lora.py::test_lora_checkpoints_hold_adapters_only_and_resume_exactly_on_another_layout",
         "tests/test_lora.py::test_lora_resume_on_the_same_layout_is_bit_identical",
         "tests/test_lora.py::test_lora_adapters_on_another_base_are_refused"),
        config="trainer.save_every with actor.lora / critic.lora",
    ),
    Feature(
        "LoRA in generation: adapter-only refit", AREA, TESTED_CPU,
        "Generating in place (rollout.layout = the training layout) runs the adapters as they train; a model of its "
        "own on rollout.layout and generator ranks (one_step_off, async) carry the same adapters, and after the "
        "first refit or push only adapter tensors move (rollout/refit_bytes), the base staying in place.",
        ("tests/test_lora_rollout.py::test_lora_engine_on_a_layout_of_its_own_generates_the_actors_greedy_tokens",
         "tests/test_lora_rollout.py::test_lora_ppo_on_a_rollout_layout_of_its_own_logs_adapter_sized_refits",
         "tests/test_lora_rollout.py::test_lora_on_generator_ranks_trains_what_the_colocated_mode_trains_and_"
         "pushes_adapters"),
        config="actor.lora with rollout.layout / rollout.ranks",
        measured=(Measured("TP2 -> TP1 refit per rank: 443,648 bytes the first time, 16,384 (the adapters) after; "
                           "generation with adapters 0.89x the tokens per CPU-second of merged weights on this CPU",
                           "python benchmarks/lora_generation.py"),),
    ),
    Feature(
        "LoRA memory, measured and planned", AREA, TESTED_CPU,
        "Per rank: the frozen base in the model's dtype without gradients or optimizer state, fp32 adapters with "
        "their gradients and Adam state, no reference copy; `megatron-rl plan --lora-rank R` counts it so.",
        ("tests/test_lora_memory.py::test_lora_memory_measured_and_planned",
         "tests/test_lora_memory.py::test_plan_names_lora_lines_and_counts_no_reference_copy"),
        config="actor.lora.rank; megatron-rl plan --lora-rank R [--lora-targets ...]",
        measured=(Measured("rank 8: 0.117x of full fine-tuning's weights + grads + optimizer state (with its "
                           "reference copy), bf16, hidden 512; the plan within 0.01% of measured",
                           "python benchmarks/lora_memory.py"),),
    ),
    Feature(
        "LoRA on an int8 base", AREA, TESTED_CPU,
        "lora.quantize_base=int8 holds the frozen base's transformer-layer projections as int8 with one fp32 scale "
        "per output row (the embedding, output layer, norms and biases in the model's dtype), dequantized in each "
        "matmul and again in the backward pass (only int8 is kept for it): the model is exactly the one with the "
        "dequantized weights, on every layout; the reference is that base; the plan counts a byte per weight.",
        ("tests/test_lora.py::test_an_int8_base_computes_its_dequantized_weights_on_every_layout",
         "tests/test_lora_memory.py::test_lora_memory_measured_and_planned",
         "tests/test_lora_memory.py::test_an_int8_base_keeps_no_dequantized_weight_for_the_backward_pass",
         "tests/test_lora_memory.py::test_an_int8_base_is_refused_where_it_would_be_refit_and_planned_in_place"),
        constraints=tuple(
            need(f"{part}.lora.quantize_base", lambda c, w, part=part: lora_on(getattr(c, part).lora),
                 f"quantizes a LoRA base, but {part}.lora.rank=0 trains every weight (none is frozen)",
                 f"set {part}.lora.rank > 0, or drop {part}.lora.quantize_base",
                 "lora.quantize_base needs lora.rank > 0",
                 when=lambda c, part=part: getattr(c, part).lora.quantize_base != "none")
            for part in ("actor", "critic")) + (
            # Only the actor generates: a critic's int8 base is never refit.
            need("actor.lora.quantize_base", lambda c, w: _int8_in_place(c),
                 "an int8 base is held by the training model only: generation on a model of its own "
                 "(rollout.layout) or on generator ranks (rollout.ranks) would refit int8 values as weights",
                 "generate in place (rollout.layout unset, rollout.ranks=0) or set actor.lora.quantize_base=none",
                 "lora.quantize_base=int8 generates in place", when=lambda c: int8_base(c.actor.lora)),),
        config="actor.lora.quantize_base, critic.lora.quantize_base",
        measured=(Measured("rank 8 on an int8 base: weights + grads + optimizer state 0.075x of full fine-tuning's "
                           "(0.117x on a bf16 base), bf16, hidden 512; the plan within 0.01% of measured",
                           "python benchmarks/lora_memory.py"),),
    ),
    Feature(
        "LoRA on a 4-bit (NF4) base", AREA, PLANNED,
        "QLoRA's 4-bit NormalFloat base with block-wise scales: half an int8 base's memory; today the smallest base "
        "is int8.",
        config="actor.lora.quantize_base=nf4",
    ),
    Feature(
        "LoRA int8 base with generation on a model of its own", AREA, PLANNED,
        "Refit and generator-rank pushes of an int8 base (the inference model holding int8 too); today an int8 base "
        "generates in place.",
        config="actor.lora.quantize_base=int8 with rollout.layout / rollout.ranks",
    ),
    Feature(
        "LoRA export: peft adapter or merged model", AREA, TESTED_CPU,
        "`convert --checkpoint RUN --hf-out DIR` writes a peft adapter (adapter_config.json + "
        "adapter_model.safetensors) that peft.PeftModel.from_pretrained loads onto the HF base; `--merge "
        "--hf-model BASE` writes the base with the adapters merged in (BASE checked against the recorded sha256). "
        "Both equal the trained model's log-probs (1e-4 bound; 1e-6 measured).",
        ("tests/test_lora.py::test_a_lora_run_exports_a_peft_adapter_and_a_merged_model_that_hf_loads",),
        config="megatron-rl convert --checkpoint RUN --hf-out DIR [--merge --hf-model BASE]",
    ),
    Feature(
        "LoRA on mixture-of-experts MLPs (per-expert adapters)", AREA, PLANNED,
        "Adapters on routed and shared experts; today a MoE model takes adapters on its attention projections.",
        config="actor.lora.target_modules on a MoE model",
    ),
    Feature(
        "LoRA with TransformerEngine layers", AREA, PLANNED,
        "Adapters beside TE's fused layer-norm + linear layers (the normalised input is needed); today LoRA runs "
        "on the local layer spec, on CPU and GPU.",
        config="actor.lora with model.transformer_impl=transformer_engine",
    ),
]
