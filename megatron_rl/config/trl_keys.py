"""TRL's ``GRPOConfig`` names, mapped to ours: by name, by value, or refused pointing at ours.

A bare name is matched wherever it sits (``loss_type``, ``algorithm.loss_type``); see ``aliases``.
"""

from __future__ import annotations

from megatron_rl.config.verl_keys import (
    Context,
    Reading,
    Refused,
    by_value,
    count,
    differs,
    epochs_rule,
    flag,
    loggers,
    same,
)

# TRL's loss_type -> our loss aggregation, with what differs.
_LOSS_AGG = {
    "grpo": ("seq-mean-token-mean", "each completion's token mean, then the mean over completions"),
    "dr_grpo": ("seq-mean-token-sum-norm", "token sums / rollout.max_new_tokens (Dr. GRPO)"),
    "dapo": ("token-mean", "the mean over every token of the mini-batch"),
    "bnpo": ("token-mean", "the mean over every token of the mini-batch (TRL's bnpo: of each device's batch)"),
}


def _loss_type(value, ctx: Context) -> Reading:
    if value in _LOSS_AGG:
        agg, why = _LOSS_AGG[value]
        return Reading({"algorithm.loss_agg": agg}, why)
    raise Refused(f"TRL's loss_type {value} has no counterpart here",
                  "set algorithm.loss_agg (token-mean, seq-mean-token-sum, seq-mean-token-mean, "
                  "seq-mean-token-sum-norm) and algorithm.policy_loss (ppo, gspo, cispo)")


def _scale_rewards(value, ctx: Context) -> Reading:
    if value in (True, "group"):
        return Reading({"algorithm.norm_by_std": True}, "advantages divided by their group's reward std")
    if value in (False, "none"):
        return Reading({"algorithm.norm_by_std": False}, "advantages not divided by a std")
    raise Refused(f"TRL's scale_rewards={value} has no counterpart here",
                  "algorithm.norm_by_std=true divides by each group's std, false by nothing")


def _mask_truncated(value, ctx: Context) -> Reading:
    if not flag(value, "mask_truncated_completions", "algorithm.overlong_buffer"):
        return Reading({}, "truncated completions are trained on")
    raise Refused("TRL's truncated-completion mask has no counterpart here",
                  "remove it; algorithm.overlong_buffer penalises completions near rollout.max_new_tokens (DAPO)")


def _steps_per_generation(value, ctx: Context) -> Reading:
    steps = count(value, "steps_per_generation", "algorithm.mini_batches")
    return Reading({"algorithm.mini_batches": steps}, "optimizer steps per generated batch (TRL's count with "
                                                      "gradient_accumulation_steps=1)")


def _importance_sampling_level(value, ctx: Context) -> Reading:
    if value == "sequence":
        return Reading({"algorithm.policy_loss": "gspo"}, "one ratio per sequence (GSPO)")
    if value == "token":
        return Reading({}, "one ratio per token, as algorithm.policy_loss=ppo")
    raise Refused(f"TRL's importance_sampling_level={value} has no counterpart here",
                  "set algorithm.policy_loss: ppo (per token) or gspo (per sequence)")


def _bf16(value, ctx: Context) -> Reading:
    dtype = "bfloat16" if flag(value, "bf16", "model.params_dtype") else "float32"
    return Reading({"model.params_dtype": dtype}, "the dtype of the weights megatron-core trains")


def _report_to(value, ctx: Context) -> Reading:
    return loggers(value, ctx, origin="TRL")


def _logging_steps(value, ctx: Context) -> Reading:
    every = count(value, "logging_steps", "trainer.log_every")
    return Reading({"trainer.log_every": every}, "console progress every N steps; metrics.jsonl has every step")


def _use_vllm(value, ctx: Context) -> Reading:
    flag(value, "use_vllm", "rollout.engine")
    return Reading({}, "megatron-core's inference engine generates here (rollout.engine), no vLLM")


def _log_completions(value, ctx: Context) -> Reading:
    if flag(value, "log_completions", "trainer.log_samples"):
        return Reading({"trainer.log_samples": True}, "every trained sample to <run dir>/samples/step_<k>.jsonl")
    return Reading({}, "no samples written")


TRL = {
    "num_generations": same("rollout.n", "TRL"), "beta": same("algorithm.kl_coef", "TRL"),
    "learning_rate": same("actor.optim.lr", "TRL"), "max_completion_length": same("rollout.max_new_tokens", "TRL"),
    "max_steps": same("trainer.steps", "TRL"), "num_iterations": same("algorithm.ppo_epochs", "TRL"),
    "epsilon": same("algorithm.clip_low", "TRL"), "epsilon_high": same("algorithm.clip_high", "TRL"),
    "per_device_train_batch_size": differs("batch.micro_batch_size", "or a token budget: batch.max_tokens_per_rank",
                                           "TRL"),
    "gradient_checkpointing": differs("model.recompute.granularity", "set full or selective", "TRL"),
    "lr": differs("actor.optim.lr", "actor and critic have their own: actor.optim.lr, critic.optim.lr", "TRL"),
    "output_dir": differs("run.dir", "the run directory is run.dir/run.name", "TRL"),
    "gradient_accumulation_steps": differs("algorithm.mini_batches", "micro-batches per optimizer step follow from "
                                           "the mini-batch (trainer.prompts_per_step x rollout.n / "
                                           "algorithm.mini_batches) and batch.micro_batch_size", "TRL"),
    "loss_type": by_value("algorithm.loss_agg", "grpo: seq-mean-token-mean, dr_grpo: seq-mean-token-sum-norm, "
                                                "dapo and bnpo: token-mean", _loss_type, "TRL"),
    "scale_rewards": by_value("algorithm.norm_by_std", "group/true: true, none/false: false; batch has no "
                                                       "counterpart", _scale_rewards, "TRL"),
    "mask_truncated_completions": by_value("algorithm.overlong_buffer", "false accepted; true has no counterpart",
                                           _mask_truncated, "TRL"),
    "steps_per_generation": by_value("algorithm.mini_batches", "optimizer steps per generated batch",
                                     _steps_per_generation, "TRL"),
    "importance_sampling_level": by_value("algorithm.policy_loss", "token: ppo, sequence: gspo",
                                          _importance_sampling_level, "TRL"),
    "num_train_epochs": by_value("trainer.steps", "accepted with max_steps, which ends the run as in TRL",
                                 epochs_rule("max_steps"), "TRL"),
    "bf16": by_value("model.params_dtype", "true: bfloat16, false: float32", _bf16, "TRL"),
    "report_to": by_value("trainer.tensorboard", "tensorboard, wandb, none, all: trainer.tensorboard and "
                                                 "trainer.wandb", _report_to, "TRL"),
    "logging_steps": by_value("trainer.log_every", "console progress every N steps", _logging_steps, "TRL"),
    "use_vllm": by_value("rollout.engine", "accepted: megatron-core's inference engine generates", _use_vllm, "TRL"),
    "log_completions": by_value("trainer.log_samples", "true: every trained sample to <run dir>/samples/",
                                _log_completions, "TRL"),
}
