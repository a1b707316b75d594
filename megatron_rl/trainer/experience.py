"""From rollouts to training data: sequences, rewards, old/ref log-probs, values, advantages.

A sample is ``prompt + response``.  Position ``t`` of a sequence predicts token ``t+1``, so the
response tokens are predicted at the positions :func:`response_positions` gives; every per-token
quantity here (``[B, R]`` tensors) lives at those positions.  All of it is built on the host,
identically on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from megatron_rl.algorithms import advantages as adv
from megatron_rl.config.schema import AlgorithmConfig
from megatron_rl.rollout.engine import RolloutBatch
from megatron_rl.trainer.old_policy import PolicyPass


def response_positions(prompt_len: int, response_len: int) -> slice:
    """The positions whose outputs predict the response tokens: token ``t`` is predicted at
    position ``t - 1``, so a ``P``-token prompt's ``R`` response tokens at ``P-1 .. P+R-2``."""
    return slice(prompt_len - 1, prompt_len + response_len - 1)


@dataclasses.dataclass
class Samples:
    prompt_index: list[int]        # position of the prompt in the step's prompt batch
    dataset_index: list[int]       # index in the PromptSet
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprob: list[list[float]]
    finish_reason: list[str]
    # MoE routing the rollout engine recorded (this rank's pipeline stage), one entry per
    # sample; empty when none was recorded.
    routing: list = dataclasses.field(default_factory=list)
    # Partial rollouts: the policy version that sampled each response token; empty when a batch
    # was generated whole with the weights it started with.
    token_versions: list = dataclasses.field(default_factory=list)
    # Multi-turn: 1 on the policy's response tokens, 0 on observations (no loss there), and what
    # the environment reported per sample (EnvironmentRollout); empty for single-turn samples.
    loss_mask: list = dataclasses.field(default_factory=list)
    env_info: list = dataclasses.field(default_factory=list)
    # One id per sample, ``<batch>-<row>`` (trainer.log_samples writes them); empty for samples
    # made outside a training run.
    sample_id: list = dataclasses.field(default_factory=list)

    @classmethod
    def from_rollout(cls, rollout: RolloutBatch, dataset_index: list[int], batch_id: str | None = None) -> "Samples":
        """Samples of a rollout over the prompts ``dataset_index`` (PromptSet indices, in rollout
        order); ``batch_id`` names the batch (the step it is generated for) in each sample's id."""
        return cls(
            sample_id=[f"{batch_id}-{row}" for row in range(len(rollout.response_ids))] if batch_id is not None else [],
            prompt_index=list(rollout.prompt_index), dataset_index=[dataset_index[i] for i in rollout.prompt_index],
            prompt_ids=rollout.prompt_ids, response_ids=rollout.response_ids,
            rollout_logprob=rollout.response_logprobs, finish_reason=rollout.finish_reason,
            routing=list(rollout.routing) if rollout.routing is not None else [],
            token_versions=list(rollout.token_versions) if rollout.token_versions is not None else [],
            loss_mask=list(rollout.response_mask) if rollout.response_mask is not None else [],
            env_info=list(rollout.env_info) if rollout.env_info is not None else [],
        )

    def __len__(self) -> int:
        return len(self.response_ids)

    def select(self, rows: Sequence[int], prompt_index: Optional[Sequence[int]] = None) -> "Samples":
        """The samples at ``rows``, in that order, optionally with new ``prompt_index`` values."""
        rows = list(rows)
        return Samples(
            prompt_index=list(prompt_index) if prompt_index is not None else [self.prompt_index[i] for i in rows],
            dataset_index=[self.dataset_index[i] for i in rows], prompt_ids=[self.prompt_ids[i] for i in rows],
            response_ids=[self.response_ids[i] for i in rows], rollout_logprob=[self.rollout_logprob[i] for i in rows],
            finish_reason=[self.finish_reason[i] for i in rows],
            routing=[self.routing[i] for i in rows] if self.routing else [],
            token_versions=[self.token_versions[i] for i in rows] if self.token_versions else [],
            loss_mask=[self.loss_mask[i] for i in rows] if self.loss_mask else [],
            env_info=[self.env_info[i] for i in rows] if self.env_info else [],
            sample_id=[self.sample_id[i] for i in rows] if self.sample_id else [],
        )

    def groups(self) -> dict[int, list[int]]:
        """``prompt_index -> rows`` of the samples of each prompt, in first-appearance order."""
        out: dict[int, list[int]] = {}
        for row, p in enumerate(self.prompt_index):
            out.setdefault(p, []).append(row)
        return out

    def sequences(self) -> list[dict]:
        """One dict per sample for :func:`megatron_rl.engine.forward.run_sequences`."""
        return [{"tokens": torch.tensor(p + r, dtype=torch.long)} for p, r in zip(self.prompt_ids, self.response_ids)]

    def response_slice(self, i: int) -> slice:
        return response_positions(len(self.prompt_ids[i]), len(self.response_ids[i]))

    def pad_responses(self, per_seq: list[torch.Tensor]) -> torch.Tensor:
        """``[B, R_max]`` from per-sequence full-length vectors (response positions only)."""
        width = max(len(r) for r in self.response_ids)
        out = torch.zeros(len(self), width)
        for i, vec in enumerate(per_seq):
            piece = vec[self.response_slice(i)]
            out[i, : piece.numel()] = piece
        return out

    def rollout_logprobs(self) -> torch.Tensor:
        """``[B, R_max]`` log-probs the rollout engine sampled the response tokens with."""
        out = torch.zeros(len(self), max(len(r) for r in self.response_ids))
        for i, logprobs in enumerate(self.rollout_logprob):
            out[i, : len(logprobs)] = torch.tensor(logprobs)
        return out

    def response_mask(self) -> torch.Tensor:
        """``[B, R_max]``: 1 on the tokens the policy generated (observations of multi-turn
        trajectories and padding are 0)."""
        width = max(len(r) for r in self.response_ids)
        mask = torch.zeros(len(self), width)
        for i, r in enumerate(self.response_ids):
            if self.loss_mask:
                mask[i, : len(r)] = torch.tensor(self.loss_mask[i], dtype=mask.dtype)
            else:
                mask[i, : len(r)] = 1.0
        return mask

    def graded_responses(self) -> list[list[int]]:
        """What the reward function grades of each response (:func:`graded_responses`)."""
        return graded_responses(self.response_ids, self.env_info)


def graded_responses(response_ids: list[list[int]], env_info: Optional[list[dict]]) -> list[list[int]]:
    """The part of each response the reward function grades: all of it, or the last policy turn of a
    multi-turn trajectory (its answer; tool outputs before it are not the policy's)."""
    if not env_info:
        return list(response_ids)
    return [r[slice(*info["final_turn"])] for r, info in zip(response_ids, env_info)]


@dataclasses.dataclass(frozen=True)
class Experience:
    """Everything the update reads, complete before it starts and never edited after it; what only
    the update's first forward measures comes back separately
    (:class:`megatron_rl.trainer.old_policy.PolicyPass`)."""

    samples: Samples
    scores: torch.Tensor           # [B] reward of each sample
    mask: torch.Tensor             # [B, R]
    old_logprob: Optional[torch.Tensor]  # [B, R]; None with old_logprobs=training_forward (the loss's own)
    ref_logprob: Optional[torch.Tensor]
    values: Optional[torch.Tensor]
    token_rewards: torch.Tensor    # with the KL penalty subtracted when it is in the reward
    advantages: torch.Tensor
    returns: Optional[torch.Tensor]
    rollout_weights: Optional[torch.Tensor] = None  # [B, R] rollout-correction loss multipliers
    metrics: dict = dataclasses.field(default_factory=dict)  # algorithm metrics of this step
    # The recompute pass's log-probs and entropy (old_logprobs=recompute; else None).
    trainer_pass: Optional[PolicyPass] = None

    def full_length(self, i: int, rows: torch.Tensor) -> torch.Tensor:
        """Row ``i`` of a ``[B, R]`` tensor placed at its response positions of the full sequence."""
        n = len(self.samples.prompt_ids[i]) + len(self.samples.response_ids[i])
        out = torch.zeros(n)
        s = self.samples.response_slice(i)
        out[s] = rows[i, : s.stop - s.start]
        return out

    def training_sequences(self, fields: dict[str, torch.Tensor]) -> list[dict]:
        """Sequences with per-position fields (e.g. old_logprob, advantages) for the update pass."""
        seqs = self.samples.sequences()
        for i, seq in enumerate(seqs):
            seq["loss_mask"] = self.full_length(i, self.mask)
            for name, rows in fields.items():
                seq[name] = self.full_length(i, rows)
        return seqs


def token_rewards_from_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sequence reward on each sample's last valid response token (the policy's last token of a
    multi-turn trajectory), zero elsewhere."""
    rewards = torch.zeros_like(mask)
    positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(-1).values
    rows = torch.arange(mask.size(0))
    rewards[rows, last.clamp(min=0)] = scores * (last >= 0).float()
    return rewards


def compute_advantages(
    kind: str,
    scores: torch.Tensor,
    group_index: torch.Tensor,
    mask: torch.Tensor,
    token_rewards: torch.Tensor,
    values: Optional[torch.Tensor],
    alg: Optional[AlgorithmConfig] = None,
    *,
    whiten: Optional[bool] = None,
    **options,
):
    """Returns ``(advantages, returns)`` (returns only for estimators with a critic).

    The registered estimator ``kind`` (:data:`megatron_rl.algorithms.advantages.ADVANTAGE_ESTIMATORS`)
    reads its options from ``alg`` (default: the schema defaults) with ``options`` (AlgorithmConfig
    field names; ``whiten`` means ``whiten_advantages``) replacing fields.  Outcome estimators (GRPO,
    RLOO, ...) use each row's sum of ``token_rewards``: the score, minus the KL penalty when it is in
    the reward.  ``scores`` is only checked against that sum's shape.
    """
    if whiten is not None:
        options["whiten_advantages"] = whiten
    opts = dataclasses.replace(alg if alg is not None else AlgorithmConfig(), **options)
    if scores.shape != token_rewards.shape[:1]:
        raise ValueError(f"scores {tuple(scores.shape)} do not match token_rewards {tuple(token_rewards.shape)}")
    batch = adv.AdvantageBatch(token_rewards=token_rewards, mask=mask, group_index=group_index, values=values)
    return adv.compute(kind, batch, opts)
