"""Step 4 of a PPO step: the actor's, then the critic's optimizer steps over ``ppo_epochs`` x
``mini_batches`` mini-batches, and their metrics."""

from __future__ import annotations

from typing import Optional

from megatron_rl.algorithms.old_logprobs import OldLogprobSource
from megatron_rl.config.schema import Config
from megatron_rl.distributed.metrics import reduce_sum_count, reduce_sums
from megatron_rl.engine.forward import run_sequences
from megatron_rl.models.heads import ValueOutput, logprob_head
from megatron_rl.models.moe import moe_metrics, moe_pass
from megatron_rl.trainer.experience import Experience
from megatron_rl.trainer.guards import check_updates_applied
from megatron_rl.trainer.metrics import optimizer_step_metrics
from megatron_rl.trainer.model_set import ModelSet
from megatron_rl.trainer.old_policy import OldPolicy, PolicyPass, old_policy
from megatron_rl.trainer.update import (
    actor_loss_fn,
    actor_metric_names,
    critic_loss_fn,
    loss_denominator,
    mini_batches,
)
from megatron_rl.utils.seeds import derive_seed
from megatron_rl.utils.timing import timed


def _batches(exp: Experience, seqs: list, cfg: Config, step: int) -> list:
    """(members, their sequences, their response lengths, the loss denominator), every epoch."""
    alg = cfg.algorithm
    valid = [len(r) for r in exp.samples.response_ids]
    batches = []
    for epoch in range(alg.ppo_epochs):
        order_seed = None if alg.mini_batches == 1 else derive_seed(cfg.run.seed, "mini_batches", step, epoch)
        for members in mini_batches(len(seqs), alg.mini_batches, order_seed):
            lengths = [valid[i] for i in members]
            batches.append((members, [seqs[i] for i in members], lengths, loss_denominator(alg.loss_agg, lengths)))
    return batches


def _training_fields(models: ModelSet, exp: Experience, cfg: Config, old_logprobs: OldLogprobSource) -> dict:
    """The per-token fields the losses read."""
    fields = {"advantages": exp.advantages}
    if old_logprobs.loss_reads_old:  # without the field the loss takes its own forward's
        fields["old_logprob"] = exp.old_logprob
    if models.has_reference and not cfg.algorithm.kl_in_reward:
        fields["ref_logprob"] = exp.ref_logprob
    if exp.rollout_weights is not None:
        fields["rollout_weight"] = exp.rollout_weights
    if models.critic is not None:
        fields.update(old_value=exp.values, returns=exp.returns)
    return fields


def update_models(models: ModelSet, exp: Experience, step: int, cfg: Config, old_logprobs: OldLogprobSource,
                  kl_coef: float, timings: dict) -> tuple[dict, OldPolicy]:
    """The actor's, then the critic's updates on the same mini-batches; returns their metrics
    and the policy before the update (:mod:`megatron_rl.trainer.old_policy`), measured by the
    recompute pass or by the update's first forward.  ``kl_coef``: the KL controller's coefficient."""
    alg = cfg.algorithm
    batches = _batches(exp, exp.training_sequences(_training_fields(models, exp, cfg, old_logprobs)), cfg, step)
    actor_results, actor_logs, first_forward = update_actor(models, batches, cfg, old_logprobs, kl_coef, timings)
    critic_results, critic_logs = ([], []) if models.critic is None else update_critic(models, batches, cfg, timings)
    trainer_pass = exp.trainer_pass
    if first_forward is not None:
        members, outs = first_forward
        trainer_pass = PolicyPass.from_outputs(exp.samples, exp.mask, outs, members)
    # A critic whose updates all failed also poisons the actor's advantages: name it first.
    check_updates_applied("critic", critic_results, step, cfg)
    check_updates_applied("actor", actor_results, step, cfg)
    updates = len(actor_results)
    flat = [log for logs in actor_logs for log in logs]
    out = {k: v / updates for k, v in reduce_sums(flat, ["actor/pg_loss", "actor/entropy_loss",
                                                           "actor/kl_loss"]).items()}
    out.update(reduce_sum_count(flat, actor_metric_names(alg)))
    out.update(optimizer_step_metrics("actor", actor_results))
    out["actor/lr"] = models.actor.lr
    out.update(moe_metrics(models.actor.chunks))  # MoE: router losses, routing-replay mismatch
    if models.critic is not None:
        flat = [log for logs in critic_logs for log in logs]
        out["critic/vf_loss"] = reduce_sums(flat, ["critic/vf_loss"])["critic/vf_loss"] / updates
        out.update(reduce_sum_count(flat, ["critic/vf_clipfrac", "critic/vpred_mean"]))
        out.update(optimizer_step_metrics("critic", critic_results))
        out.update(moe_metrics(models.critic.chunks, "critic/"))
    return out, old_policy(exp, trainer_pass, alg.kl_kind)


def update_actor(models: ModelSet, batches: list, cfg: Config, old_logprobs: OldLogprobSource, kl_coef: float,
                 timings: dict) -> tuple[list, list, Optional[tuple]]:
    """One optimizer step per mini-batch; returns the step results, the loss logs and, where the
    old log-probs are not recomputed, the first forward's outputs (the weights before any update)."""
    alg, actor = cfg.algorithm, models.actor
    kl_loss_coef = kl_coef if models.has_reference and not alg.kl_in_reward else 0.0
    measure = old_logprobs.measured_in_update
    head = logprob_head(cfg, with_entropy=alg.entropy_coef > 0 or measure)
    horizon = cfg.rollout.max_new_tokens  # the constant of seq-mean-token-sum-norm
    results, logs_all, first_forward = [], [], None
    for members, sub, lengths, den in batches:
        with timed("actor_update", timings):
            models.phase("actor")
            actor.zero_grad()
            with moe_pass(actor.chunks, sub, "replay" if alg.routing_replay else "train", members):
                outs, logs = run_sequences(actor.chunks, sub, head, models.plan, models.device,
                                           loss_fn=actor_loss_fn(alg, den, lengths, kl_loss_coef, horizon),
                                           forward_only=False)
            results.append(actor.step())
            logs_all.append(logs)
            if measure and first_forward is None:
                first_forward = (members, outs)
    return results, logs_all, first_forward


def update_critic(models: ModelSet, batches: list, cfg: Config, timings: dict) -> tuple[list, list]:
    alg, critic = cfg.algorithm, models.critic
    horizon = cfg.rollout.max_new_tokens
    results, logs_all = [], []
    for members, sub, lengths, den in batches:
        with timed("critic_update", timings):
            models.phase("critic")
            critic.zero_grad()
            with moe_pass(critic.chunks, sub, "train", members):
                _, logs = run_sequences(critic.chunks, sub, ValueOutput(), models.plan, models.device,
                                        loss_fn=critic_loss_fn(alg, den, lengths, horizon), forward_only=False)
            results.append(critic.step())
            logs_all.append(logs)
    return results, logs_all
