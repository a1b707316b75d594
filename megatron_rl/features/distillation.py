"""On-policy distillation: frozen teachers score the student's own samples, per token."""

from __future__ import annotations

from megatron_rl.features.base import PLANNED, TESTED_CPU, Feature, Measured

AREA = "distillation"


FEATURES = [
    Feature(
        "On-policy distillation (reverse KL per token)", AREA, TESTED_CPU,
        "algorithm.distill.teachers: a frozen teacher (an HF directory, a checkpoint step or run directory) scores "
        "every token the student sampled; the token's advantage is coef * (teacher - student log-prob) plus "
        "reward_coef * the task advantage (0: pure distillation, no critic built).  Observation tokens of multi-turn "
        "trajectories carry none.  The teacher is built on the training layout (TP, SP, PP, CP, DP), scored with the "
        "chunked vocab-parallel log-prob op, offloaded between phases with trainer.offload, never checkpointed "
        "(a resumed run reads it again); colocated and with generator ranks (async).  Metric distill/reverse_kl (and "
        "distill/reverse_kl/<teacher> with several).  That it learns faster than GRPO is not shown on the CPU task "
        "(docs/distillation.md).",
        ("tests/test_distill.py::test_the_advantage_is_teacher_minus_student_on_policy_tokens_plus_the_weighted_task_"
         "advantage",
         "tests/test_distill.py::test_teacher_logprobs_equal_hf_transformers_on_every_layout",
         "tests/test_distill.py::test_distillation_steps_on_every_layout_equal_one_process",
         "tests/test_distill.py::test_distillation_runs_on_a_generator_rank_in_async_mode"),
        config="algorithm.distill.teachers, coef, reward_coef",
        measured=(Measured("teacher log-probs vs HF transformers: worst 9.5e-7 on one process, TP2+SP, PP2, CP2, DP2, "
                           "TP2xPP2, TP2xCP2+SP (bound 1e-4); two distillation steps vs one process: worst 3.3e-7 "
                           "relative on TP2+SP, PP2, CP2, DP2 (bound 1e-5)",
                           "pytest tests/test_distill.py -s"),),
    ),
    Feature(
        "Distillation teachers per data_source", AREA, TESTED_CPU,
        "Several teachers, one per data_source ({math: PATH, code: PATH, default: PATH}): each sample is scored by "
        "its record's source's teacher, `default` takes the rest; a prompt no teacher would score is refused before "
        "launch.  A teacher's vocabulary must be the student's (the same tokens at the same ids, compared by digest; "
        "checkpoints record theirs), its shape must fit the training layout: each refused in one line.",
        ("tests/test_distill.py::test_each_sample_goes_to_its_sources_teacher_and_a_source_without_one_is_refused",
         "tests/test_distill.py::test_a_teacher_checkpoint_records_its_vocabulary_and_another_one_is_refused",
         "tests/test_distill.py::test_a_teacher_of_another_vocabulary_or_without_one_is_refused_before_launch"),
        config="algorithm.distill.teachers",
    ),
    Feature(
        "Distillation teacher on a layout of its own", AREA, PLANNED,
        "algorithm.distill.layout: a teacher larger than the student on its own TP/PP (or on ranks of its own, like "
        "generator ranks), with its memory in megatron-rl plan.  Today the teacher runs on the training layout.",
        config="algorithm.distill.layout",
    ),
    Feature(
        "Cross-tokenizer distillation", AREA, PLANNED,
        "A teacher with another tokenizer (token alignment between vocabularies).  Today the vocabularies must be "
        "equal (refused before launch otherwise).",
        config="algorithm.distill.teachers",
    ),
]
