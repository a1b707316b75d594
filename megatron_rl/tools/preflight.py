"""Checks of what a training config points at, before any process starts.

Validation (``megatron_rl/validation.py``) judges the values; this opens what they name: the prompt file
and the evaluation file (every record parsed and measured as training parses and measures it, of
files up to 1 GiB (``data.prompts.FULL_CHECK_BYTES``) -- the first GiB of larger ones, said in one
line; no prompt within ``data.max_prompt_tokens`` is refused, dropped ones are counted; the answer
key when the reward reads answers), the reward function (its calling convention), the tokenizer (its
vocabulary must fit the model's), the critic's HF directory, the initial checkpoint and the
distillation teachers (their vocabulary is the student's).  Each failure
is one line naming the key, or the file and line.
"""

from __future__ import annotations

import os

from megatron_rl.config.loader import note_once
from megatron_rl.config.schema import Config
from megatron_rl.data.prompts import FULL_CHECK_BYTES
from megatron_rl.data.sources import TRAIN_KEY, VAL_KEY, check_prompt_source, tokenizer_spec
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.errors import ConfigError
from megatron_rl.rewards.conventions import needs_answers
from megatron_rl.rewards.registry import get_reward_fn, missing_column_error

LAUNCHER_ENV = "MEGATRON_RL_LAUNCHER"  # set in the ranks our launcher (or the test harness) starts


def _check_dir(key: str, path: str | None, what: str) -> None:
    if path and not os.path.isdir(path):
        raise ConfigError(key, path, "no such directory", f"point {key} at {what}, or set it to null")


def _launched_rank() -> bool:
    """A rank our launcher started: the launcher already read the files in full before starting it."""
    return bool(os.environ.get(LAUNCHER_ENV))


def _read_bound() -> int:
    """How much of a prompt file a check reads here: its first record on a launched rank, else the
    full-check bound."""
    return 1 if _launched_rank() else FULL_CHECK_BYTES


def _check_prompts(cfg: Config, key: str, needs: bool, tokenizer) -> str:
    """The prompt source at ``key`` parses (every record, up to 1 GiB) and, given the ``tokenizer``,
    has a prompt within ``data.max_prompt_tokens`` (how many training drops is said); the answer key.

    A rank of our local launcher reads only the first record: the launcher checked the whole file
    before starting it, and every rank parses and measures each line again as it loads it."""
    if _launched_rank():
        return check_prompt_source(cfg.data, key, needs_answers=needs, max_bytes=1)
    return check_prompt_source(cfg.data, key, needs_answers=needs, note=note_once, tokenizer=tokenizer)


def check_training_inputs(cfg: Config) -> None:
    reward_fn = get_reward_fn(cfg.reward.fn, cfg.reward.convention, cfg.reward.kwargs)
    tokenizer = load_tokenizer(tokenizer_spec(cfg.data, cfg.model.hf_path))
    answer_key = _check_prompts(cfg, TRAIN_KEY, needs_answers(reward_fn), tokenizer)
    if answer_key != cfg.data.answer_key:
        note_once(f"data: answers read from {answer_key} (verl's schema; the records have no "
                  f"'{cfg.data.answer_key}')")
    if cfg.data.val_path:  # measured only where evaluation will load it
        _check_prompts(cfg, VAL_KEY, needs_answers(reward_fn), tokenizer if cfg.trainer.eval_every else None)
    _check_reward_columns(cfg, reward_fn)
    _check_dir("critic.hf_path", cfg.critic.hf_path, "a local reward-model directory")
    _check_dir("actor.init_checkpoint", cfg.actor.init_checkpoint, "a megatron_rl checkpoint step directory")
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError("model.vocab_size", cfg.model.vocab_size,
                          f"smaller than the tokenizer's vocabulary ({tokenizer.vocab_size})",
                          f"set model.vocab_size >= {tokenizer.vocab_size}")
    if cfg.rollout.env:
        _check_environment(cfg, tokenizer)
    if cfg.rollout.agent:
        _check_agent(cfg)
    if cfg.algorithm.distill.teachers:
        _check_teachers(cfg, tokenizer)


def _check_teachers(cfg: Config, tokenizer) -> None:
    """Each teacher's directory, vocabulary (the student's) and shape on the training layout; without a
    ``default`` teacher, every prompt's data_source names one."""
    from megatron_rl.data.tokenizer import vocabulary_digest
    from megatron_rl.engine.teachers import DEFAULT_SOURCE, check_teacher_layouts, read_teachers

    teachers = read_teachers(cfg.algorithm.distill.teachers, cfg.model, vocabulary_digest(tokenizer))
    check_teacher_layouts(teachers, cfg)
    if not _launched_rank() and DEFAULT_SOURCE not in {t.name for t in teachers}:
        from megatron_rl.data.sources import load_prompt_source
        from megatron_rl.trainer.teacher_rows import TeacherRows

        TeacherRows(teachers, load_prompt_source(cfg.data, tokenizer))


def _check_reward_columns(cfg: Config, reward_fn) -> None:
    """Every record has the dataset columns the reward function requires by name (a TRL function's
    ``solution``), so a gap is one line before launch, not a stop at the first step."""
    from megatron_rl.data.prompts import first_missing_column
    from megatron_rl.data.tasks import TASK_PREFIX

    required = getattr(reward_fn, "required_columns", ())
    if not required:
        return
    path = cfg.data.train_path
    if path.startswith(TASK_PREFIX):
        found = (path, required[0], [])
    else:
        found = first_missing_column(path, required, TRAIN_KEY,
                                     max_bytes=_read_bound())
    if found is not None:
        where, column, present = found
        raise missing_column_error(cfg.reward.fn, column, f"at {where}", dict.fromkeys(present))


def _check_environment(cfg: Config, tokenizer) -> None:
    """rollout.env builds (one instance), and the tokenizer can write its stop strings."""
    from megatron_rl.envs.base import environment_factory

    env = environment_factory(cfg.rollout.env, cfg.rollout.env_kwargs,
                              defaults={"timeout_s": cfg.rollout.tool_timeout_s})()
    for stop in getattr(env, "stop", ()):
        if tokenizer.decode(tokenizer.encode(stop)) != stop:
            raise ConfigError("data.tokenizer", cfg.data.tokenizer,
                              f"cannot encode the environment's stop string {stop!r} (it comes back as "
                              f"{tokenizer.decode(tokenizer.encode(stop))!r})",
                              "use a tokenizer whose vocabulary has its characters (e.g. char:<alphabet with them>)")


def _check_agent(cfg: Config) -> None:
    """rollout.agent names a function (imported here, as its worker processes will)."""
    from megatron_rl.envs.base import import_for

    spec = cfg.rollout.agent
    fn = import_for("rollout.agent", spec) if ":" in spec else None
    if not callable(fn):
        raise ConfigError("rollout.agent", spec, "is not 'package.module:function' naming a function",
                          "point rollout.agent at fn(base_url, session_id, record) (docs/environments.md)")
    if cfg.trainer.sft_warmup_steps:
        _check_agent_warmup_data(cfg)


def _check_agent_warmup_data(cfg: Config) -> None:
    """The warm-up of agent mode trains on demonstrated chats as the endpoint serves them
    (``trainer/sft.py``): every record must be one (a launcher's rank reads the first)."""
    from megatron_rl.data.prompts import first_without_demonstration
    from megatron_rl.data.tasks import TASK_PREFIX

    data = cfg.data
    if data.train_path.startswith(TASK_PREFIX):
        where = f"{TRAIN_KEY}={data.train_path} is a built-in task, not '{data.messages_key}' chats"
    else:
        found = first_without_demonstration(data.train_path, data.prompt_key, data.messages_key,
                                            max_bytes=_read_bound())
        if found is None:
            return
        where = f"{found} is not a '{data.messages_key}' chat"
    raise ConfigError("trainer.sft_warmup_steps", cfg.trainer.sft_warmup_steps,
                      f"with rollout.agent the warm-up trains on the chat the endpoint serves, and {where} "
                      "ending in a demonstration (the assistant's turns, tool results between them)",
                      f"end every '{data.messages_key}' chat with the assistant's demonstration "
                      "(docs/environments.md), or set trainer.sft_warmup_steps=0")
