"""On-policy distillation: frozen teachers score the student's own samples, per token."""

from __future__ import annotations

from megatron_rl.features.base import PLANNED, TESTED_CPU, Constraint, Feature, Measured
from megatron_rl.layout.distill import KEY as LAYOUT_KEY
from megatron_rl.layout.distill import teacher_layout_problem

AREA = "distillation"


FEATURES = [
    Feature(
        "On-policy distillation (reverse KL per token)", AREA, TESTED_CPU,
        "algorithm.distill.teachers: a frozen teacher (an HF directory, a checkpoint step or run directory) scores "
        "every token the student sampled; the token's advantage is coef * (teacher - student log-prob, minus its "
        "batch mean with baseline: batch_mean, the default) plus reward_coef * the task advantage (0: pure "
        "distillation, no critic built).  Observation tokens of multi-turn "
        "trajectories carry none.  The teacher is built on the training layout (TP, SP, PP, CP, DP), scored with the "
        "chunked vocab-parallel log-prob op, offloaded between phases with trainer.offload, never checkpointed "
        "(a resumed run reads it again); colocated and with generator ranks (async).  Metric distill/reverse_kl (and "
        "distill/reverse_kl/<teacher> with several).  On the CPU digit-sum task a student distilled from a teacher "
        "the project trained gains reward faster than GRPO alone at equal samples (docs/distillation.md).",
        ("tests/test_distill.py::test_the_advantage_is_teacher_minus_student_on_policy_tokens_plus_the_weighted_task_"
         "advantage",
         "tests/test_distill.py::test_teacher_logprobs_equal_hf_transformers_on_every_layout",
         "tests/test_distill.py::test_distillation_steps_on_every_layout_equal_one_process",
         "tests/test_distill.py::test_distillation_runs_on_a_generator_rank_in_async_mode",
         "tests/test_distill.py::test_a_distilled_student_gains_reward_faster_than_grpo_alone"),
        config="algorithm.distill.teachers, coef, reward_coef, baseline",
        measured=(Measured("teacher log-probs vs HF transformers: worst 9.5e-7 on one process, TP2+SP, PP2, CP2, DP2, "
                           "TP2xPP2, TP2xCP2+SP (bound 1e-4); two distillation steps vs one process: worst 7.3e-7 "
                           "relative on TP2+SP, PP2, CP2, DP2 (bound 1e-5)",
                           "pytest tests/test_distill.py -s"),),
    ),
    Feature(
        "Distillation teachers per data_source", AREA, TESTED_CPU,
        "Several teachers, one per data_source ({math: PATH, code: PATH, default: PATH}): each sample is scored by "
        "its record's source's teacher, `default` takes the rest; a prompt no teacher would score is refused before "
        "launch.  A teacher's vocabulary must be the student's (the same tokens at the same ids, compared by digest; "
        "checkpoints record theirs; embedding tables padded to other sizes, as Qwen2.5-7B's and 1.5B's, are fine), "
        "its shape must fit the training layout: each refused in one line.",
        ("tests/test_distill.py::test_each_sample_goes_to_its_sources_teacher_and_a_source_without_one_is_refused",
         "tests/test_distill.py::test_a_teacher_checkpoint_records_its_vocabulary_and_another_one_is_refused",
         "tests/test_distill.py::test_a_teacher_of_another_vocabulary_or_without_one_is_refused_before_launch"),
        config="algorithm.distill.teachers",
    ),
    Feature(
        "Distillation teachers in the planner", AREA, TESTED_CPU,
        "megatron-rl plan --teacher PRESET|DIR (or a recipe's algorithm.distill.teachers) counts each teacher's "
        "frozen weights on the training layout or on --teacher-tp/-pp/-cp (algorithm.distill.layout) and the peak of "
        "its forward-only scoring pass (its own weights alone "
        "with trainer.offload, every model without), proposes no layout a teacher's shape cannot take, and sizes "
        "generation with what is left.  configs/distill_qwen2.5_7b_to_1.5b_16k.yaml is the plan for a 7B teacher and a "
        "1.5B student at 16k on 8 x 80 GB, the teacher on TP4 of its own (not yet run on a GPU).",
        ("tests/test_distill.py::test_the_planner_counts_the_teachers_weights_as_built",
         "tests/test_distill.py::test_plan_sizes_the_teacher_and_asks_for_one_it_cannot_read",
         "tests/test_recipes.py::test_gpu_recipe_equals_the_plan"),
        config="algorithm.distill.teachers",
        measured=(Measured("teacher weights per rank, planned vs as built (fp32, CPU): one process 657920 vs 659712 "
                           "B, TP2+SP 328960 vs 331008 B, PP2 360960 vs 362752 B, a TP2 teacher of its own beside a "
                           "PP2 student 328960 vs 331008 B (the plan leaves out the norms)",
                           "pytest tests/test_distill.py -s -k planner_counts"),),
    ),
    Feature(
        "Distillation teachers on a layout of their own", AREA, TESTED_CPU,
        "algorithm.distill.layout {tp, pp, cp}: a teacher larger than the student on more tensor-, pipeline- or "
        "context-parallel ranks than the student's layout has, on the same (training) ranks: built, loaded (HF or "
        "checkpoint) and scored with process groups of its own, its sequences split over its own data-parallel "
        "replicas; unset sizes are the training layout's.  Offloaded between phases with trainer.offload like the "
        "other models; megatron-rl plan counts its weights on that layout.  A mixture-of-experts teacher, and "
        "hierarchical CP (a2a+p2p) on the teachers' own layout, are refused in one line.",
        ("tests/test_distill.py::test_a_teacher_on_a_layout_of_its_own_scores_as_hf_transformers",
         "tests/test_distill.py::test_distillation_steps_on_every_layout_equal_one_process",
         "tests/test_distill.py::test_a_teachers_own_layout_is_refused_where_it_cannot_run"),
        constraints=(Constraint("algorithm.distill.layout: with a teacher, sizes whose product divides the training "
                                "ranks, no hierarchical CP", teacher_layout_problem, LAYOUT_KEY),),
        config="algorithm.distill.layout",
        measured=(Measured("teacher log-probs vs HF with the teacher on its own layout (training -> teacher): "
                           "DP2 -> TP2+SP, TP2+SP -> PP2, PP2 -> TP2, CP2 -> TP2, TP2 -> CP2, DP4 -> TP2xPP2: worst "
                           "9.5e-7 (bound 1e-4)", "pytest tests/test_distill.py -s -k own"),),
    ),
    Feature(
        "Distillation teachers on ranks of their own", AREA, PLANNED,
        "A teacher on GPUs that only score (like generator ranks, rollout.ranks), so it never shares memory with "
        "the student's training state.  Today the teachers run on the training ranks.",
        config="algorithm.distill.layout",
    ),
    Feature(
        "Cross-tokenizer distillation", AREA, PLANNED,
        "A teacher with another tokenizer (token alignment between vocabularies).  Today the vocabularies must be "
        "equal (refused before launch otherwise).",
        config="algorithm.distill.teachers",
    ),
]
