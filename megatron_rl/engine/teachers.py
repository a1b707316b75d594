"""The teachers of on-policy distillation (``algorithm.distill.teachers``): what each one is, read
once from its directory before launch and again, identically, on every rank.

A teacher is a Hugging Face model directory or a megatron_rl checkpoint step directory.  Its
architecture comes from its own ``config.json`` (HF) or ``meta.json`` (checkpoint); everything
else about how it runs (dtype, attention implementation) is the student's.  Its vocabulary must be
the student's: the same tokens at the same ids, compared by digest
(:func:`megatron_rl.data.tokenizer.vocabulary_digest`), since the advantage compares the two
models' log-probs of the very token the student sampled.  Their embedding tables may be padded to
other sizes (Qwen2.5-7B has 152064 rows, Qwen2.5-1.5B 151936, one tokenizer of 151665 tokens):
each model's log-softmax runs over its own rows, as Hugging Face computes it, and sampled ids are
always tokens of the tokenizer.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megatron_rl.config.schema import ModelConfig
from megatron_rl.errors import ConfigError

KEY = "algorithm.distill.teachers"
DEFAULT_SOURCE = "default"  # the teacher of every prompt whose data_source names no teacher of its own
HF, CHECKPOINT = "hf", "checkpoint"


@dataclasses.dataclass(frozen=True)
class TeacherSource:
    name: str           # the data_source it scores, or DEFAULT_SOURCE
    path: str
    kind: str           # HF or CHECKPOINT
    model: ModelConfig  # its architecture with the student's run settings

    @property
    def key(self) -> str:
        return f"{KEY}.{self.name}"


def _located(key: str, path: str) -> tuple[str, str]:
    """``(kind, directory)``: an HF model directory, or a checkpoint step directory (a run directory or
    its ``checkpoints/`` stands for its newest complete step)."""
    from megatron_rl.engine.checkpoint import resolve_checkpoint

    if not isinstance(path, str) or not path:
        raise ConfigError(key, path, "is not a path", "give an HF model directory or a checkpoint step directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return HF, path
    if os.path.isdir(path):
        step = resolve_checkpoint(path, key)
        if os.path.isfile(os.path.join(step, "meta.json")):
            return CHECKPOINT, step
    what = "no such directory" if not os.path.isdir(path) else "holds neither config.json (HF) nor a checkpoint"
    raise ConfigError(key, path, what, "give an HF model directory, a checkpoint step directory or a run directory")


def _checkpoint_model(key: str, path: str, student: ModelConfig) -> tuple[ModelConfig, dict]:
    from megatron_rl.config.model_io import model_config_from_dict
    from megatron_rl.engine.checkpoint import check_checkpoint
    from megatron_rl.errors import CheckpointError

    try:
        meta = check_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(key, path, f"not a usable checkpoint ({err.problem})", err.fix) from None
    if "actor" not in meta.get("models", {}):
        raise ConfigError(key, path, f"the checkpoint holds no actor (parts {sorted(meta.get('models', {}))})",
                          "give the checkpoint of a run whose actor is the teacher")
    if meta.get("lora"):
        raise ConfigError(key, path, "is a LoRA checkpoint (adapters only)",
                          f"merge it first: megatron-rl convert --checkpoint {path} --hf-out DIR --merge "
                          "--hf-model BASE")
    saved = model_config_from_dict(meta["models"]["actor"])
    return dataclasses.replace(saved, params_dtype=student.params_dtype, transformer_impl=student.transformer_impl,
                               hf_path=None), meta


def _vocabulary(key: str, source: TeacherSource, meta: Optional[dict]) -> Optional[dict]:
    """The teacher's vocabulary digest, or None when it records none (refused by the caller)."""
    from megatron_rl.data.tokenizer import has_tokenizer_files, load_tokenizer, vocabulary_digest
    from megatron_rl.engine.checkpoint import companions_dir

    if source.kind == HF:
        return vocabulary_digest(load_tokenizer(source.path)) if has_tokenizer_files(source.path) else None
    if meta.get("vocabulary"):
        return meta["vocabulary"]
    carried = companions_dir(source.path)
    if carried and has_tokenizer_files(carried):
        return vocabulary_digest(load_tokenizer(carried))
    return None


def read_teacher(name: str, path: str, student: ModelConfig, vocabulary: Optional[dict] = None) -> TeacherSource:
    """The teacher ``name`` at ``path``; with ``vocabulary`` (the student's digest) the teacher's
    must equal it.  Raises :class:`ConfigError` naming ``algorithm.distill.teachers.<name>``."""
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

    key = f"{KEY}.{name}"
    kind, path = _located(key, path)
    meta = None
    if kind == HF:
        try:
            model = model_config_from_hf(read_hf_config(path), dataclasses.replace(student, hf_path=None))
        except ConfigError as err:
            raise ConfigError(key, path, err.problem, err.fix) from None
        model = dataclasses.replace(model, hf_path=path)
    else:
        model, meta = _checkpoint_model(key, path, student)
    source = TeacherSource(name, path, kind, model)
    if vocabulary is not None:
        theirs = _vocabulary(key, source, meta)
        if theirs is None:
            raise ConfigError(key, path, "records no vocabulary to compare with the student's",
                              "give a directory with the teacher's tokenizer files (or a checkpoint saved by "
                              "megatron_rl, which records its vocabulary)")
        if theirs != vocabulary:
            raise ConfigError(key, path, f"its vocabulary ({theirs['size']} tokens) is not the student's "
                              f"({vocabulary['size']} tokens, or the same size with other tokens)",
                              "distil from a teacher of the student's tokenizer (cross-tokenizer distillation "
                              "is planned, docs/feature_matrix.md)")
    if vocabulary is None and model.vocab_size != student.vocab_size:
        raise ConfigError(key, path, f"its vocabulary size is {model.vocab_size}, the student's {student.vocab_size}",
                          "use a teacher with the student's vocabulary size")
    if vocabulary is not None and model.vocab_size < vocabulary["size"]:
        raise ConfigError(key, path, f"its embedding has {model.vocab_size} rows, fewer than the tokenizer's "
                          f"{vocabulary['size']} tokens", "give a teacher trained with this tokenizer")
    return source


def read_teachers(teachers: dict, student: ModelConfig, vocabulary: Optional[dict] = None) -> tuple[TeacherSource, ...]:
    """Every teacher of ``algorithm.distill.teachers``, in the order the config lists them."""
    if not isinstance(teachers, dict):
        raise ConfigError(KEY, teachers, "is not a mapping", "write {default: PATH} or {SOURCE: PATH, ...}")
    return tuple(read_teacher(str(name), path, student, vocabulary) for name, path in teachers.items())


def check_teacher_layouts(teachers: tuple[TeacherSource, ...], cfg) -> None:
    """Each teacher runs on the training layout (``cfg.parallel``) or on ``algorithm.distill.layout``:
    the layout rules hold for its shape there; a mixture-of-experts teacher takes the training layout."""
    from megatron_rl.layout.arch import is_moe
    from megatron_rl.layout.distill import KEY as LAYOUT_KEY
    from megatron_rl.layout.distill import sizes_text, teacher_parallel
    from megatron_rl.layout.rules import training_problems

    own = teacher_parallel(cfg)
    parallel = own or cfg.parallel
    where = f"on {LAYOUT_KEY} ({sizes_text(own)})" if own else "on the training layout"
    for teacher in teachers:
        if own is not None and is_moe(teacher.model):
            raise ConfigError(teacher.key, teacher.path, f"a mixture-of-experts teacher cannot run {where}",
                              f"leave {LAYOUT_KEY} unset: it runs on the training layout")
        broken = training_problems(teacher.model, parallel, None)
        if broken:
            as_teacher = dataclasses.replace(cfg, model=teacher.model, parallel=parallel)
            problem, fix = (text.format(c=as_teacher, w=None) for text in (broken[0].problem, broken[0].fix))
            raise ConfigError(teacher.key, teacher.path, f"{where}: {problem}", fix)


def teacher_of(teachers: tuple[TeacherSource, ...], data_source) -> Optional[TeacherSource]:
    """The teacher of a prompt whose record's ``data_source`` is ``data_source`` (None: none for it)."""
    by_name = {t.name: t for t in teachers}
    return by_name.get(str(data_source)) if str(data_source) in by_name else by_name.get(DEFAULT_SOURCE)
