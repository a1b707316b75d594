"""Step 3 of a PPO step: the forward passes over the sampled batch (old log-probs, reference
log-probs, values) and what is computed from them -- token rewards, KL in the reward, advantages,
rollout-correction weights."""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.algorithms.distill import distill_advantages, reverse_kl, uses_task_advantage
from megatron_rl.algorithms.kl import apply_kl_penalty
from megatron_rl.algorithms.old_logprobs import OldLogprobSource
from megatron_rl.algorithms.rollout_correction import correction_weights
from megatron_rl.config.schema import Config
from megatron_rl.engine.forward import run_sequences
from megatron_rl.models.heads import ValueOutput, logprob_head
from megatron_rl.models.moe import load_routing, moe_pass
from megatron_rl.trainer.experience import Experience, Samples, compute_advantages, token_rewards_from_scores
from megatron_rl.trainer.model_set import ModelSet
from megatron_rl.trainer.old_policy import PolicyPass
from megatron_rl.utils.timing import timed


def _forward_passes(models: ModelSet, samples: Samples, mask: torch.Tensor, cfg: Config,
                    old_logprobs: OldLogprobSource, timings: dict) -> tuple:
    """The recomputed policy pass (or None), the reference's and the critic's outputs (or None)."""
    seqs = samples.sequences()
    head = logprob_head(cfg)
    ref = values = recomputed = None
    # Routing replay: the experts the rollout engine routed to, else the old-log-prob pass's.
    replay_mode = None
    if cfg.algorithm.routing_replay:
        replay_mode = "forward_replay" if load_routing(models.actor.chunks, samples.routing) else "record"
    with torch.no_grad():
        if old_logprobs.recompute:
            with timed("old_logprob", timings):
                models.phase("actor")
                with moe_pass(models.actor.chunks, seqs, replay_mode):
                    outs, _ = run_sequences(models.actor.chunks, seqs, head, models.plan, models.device)
            recomputed = PolicyPass.from_outputs(samples, mask, outs)
        if models.has_reference:
            with timed("ref_logprob", timings), models.reference_pass() as reference:
                ref, _ = run_sequences(reference, seqs, dataclasses.replace(head, with_entropy=False),
                                       models.plan, models.device)
        if models.critic is not None:
            with timed("values", timings):
                models.phase("critic")
                values, _ = run_sequences(models.critic.chunks, seqs, ValueOutput(), models.plan, models.device)
    return recomputed, ref, values


def teacher_logprobs(models: ModelSet, samples: Samples, teacher_rows: dict, cfg: Config,
                     timings: dict) -> torch.Tensor:
    """``[B, R]`` log-prob each sample's teacher gives each sampled token (``teacher_rows``: the rows
    of each teacher, by name), at the temperature the student's log-probs are taken at."""
    head = dataclasses.replace(logprob_head(cfg), with_entropy=False)
    out = torch.zeros(len(samples), max(len(r) for r in samples.response_ids))
    for name, rows in teacher_rows.items():
        if not rows:
            continue
        own = samples.select(rows)
        with torch.no_grad(), timed("teacher_logprob", timings), models.teacher_pass(name) as chunks:
            outs, _ = run_sequences(chunks, own.sequences(), head, models.plan, models.device)
        scored = own.pad_responses([o["logprob"] for o in outs])
        out[rows, : scored.size(1)] = scored
    return out


def _distill(advantage_rows, student, teacher, mask, teacher_rows: dict, alg) -> tuple[torch.Tensor, dict]:
    """The distillation advantage and ``distill/reverse_kl`` (all tokens, and per teacher when several)."""
    d = alg.distill
    advantage_rows = distill_advantages(advantage_rows, student, teacher, mask, d.coef, d.reward_coef, d.baseline)
    metrics = {"distill/reverse_kl": reverse_kl(student, teacher, mask)}
    if len(teacher_rows) > 1:
        for name, rows in teacher_rows.items():
            metrics[f"distill/reverse_kl/{name}"] = reverse_kl(student[rows], teacher[rows], mask[rows])
    return advantage_rows, metrics


def make_experience(models: ModelSet, samples: Samples, scores: torch.Tensor, cfg: Config,
                    old_logprobs: OldLogprobSource, kl_coef: float, timings: dict,
                    teacher_rows: dict | None = None) -> Experience:
    """Everything the update trains on; ``kl_coef``: the KL controller's current coefficient;
    ``teacher_rows``: with distillation, the rows each teacher scores, by name."""
    alg = cfg.algorithm
    mask = samples.response_mask()
    recomputed, ref, values = _forward_passes(models, samples, mask, cfg, old_logprobs, timings)
    # training_forward: none here, the loss reads its own forward's (detached).
    old_logprob = None
    if recomputed is not None:
        old_logprob = recomputed.logprob
    elif old_logprobs.from_rollout:
        old_logprob = samples.rollout_logprobs() * mask
    ref_logprob = samples.pad_responses([o["logprob"] for o in ref]) * mask if ref is not None else None
    value_rows = samples.pad_responses([o["value"] for o in values]) * mask if values is not None else None
    token_rewards = token_rewards_from_scores(scores, mask)
    if ref_logprob is not None and alg.kl_in_reward:
        # The KL penalty in the reward (else the actor loss carries it); outcome estimators (GRPO,
        # RLOO, ...) see it as the row sum of the penalised token rewards.  Validation keeps
        # old_logprobs=training_forward away from it, so the old log-probs are known here.
        token_rewards, _ = apply_kl_penalty(token_rewards, old_logprob, ref_logprob, mask, kl_coef, alg.kl_kind)
    advantage_rows, returns = torch.zeros_like(mask), None
    if uses_task_advantage(alg):
        advantage_rows, returns = compute_advantages(
            alg.advantage, scores, torch.tensor(samples.prompt_index), mask, token_rewards, value_rows, alg,
        )
    weights, metrics = None, {}
    if teacher_rows:
        teacher = teacher_logprobs(models, samples, teacher_rows, cfg, timings) * mask
        advantage_rows, metrics = _distill(advantage_rows, old_logprob, teacher, mask, teacher_rows, alg)
    correction = alg.rollout_correction
    if correction.mode != "off":
        weights, correction_metrics = correction_weights(old_logprob, samples.rollout_logprobs(), mask,
                                                         correction.mode, correction.level, correction.threshold)
        metrics.update(correction_metrics)
    return Experience(samples, scores, mask, old_logprob, ref_logprob, value_rows, token_rewards,
                      advantage_rows, returns, rollout_weights=weights, metrics=metrics, trainer_pass=recomputed)
