"""Actor and critic loss functions for one micro-batch, normalised by the whole mini-batch.

Each loss function returns ``numerator / denominator`` where the denominator -- valid tokens
(``token-mean``) or sequences (``seq-mean-*``) of the *whole mini-batch* -- is known on the host
before the step.  Summed over micro-batches and over data- and context-parallel ranks (megatron
sums when ``calculate_per_token_loss`` is on, and :mod:`megatron_rl.engine.forward` returns a
count of 0 so ``finalize_model_grads`` does not divide again), the gradients are those of the
mini-batch loss, whatever the micro-batch, DP or CP split.  Packed micro-batches are turned back into one
row per sequence first, so the sequence-level aggregations see sequences, not packs.

The policy loss, the aggregation and the KL estimator are the registered ones
(``algorithm.policy_loss``, ``loss_agg``, ``kl_kind``).  A loss that needs a whole-sequence value
(GSPO's sequence ratio) sums its detached per-row values over the context-parallel group
(:func:`context_parallel_row_sum`): every CP rank of a DP index runs the same micro-batches, each
holding a shard of every sequence.  Rollout-correction weights arrive as the per-token field
``rollout_weight`` and multiply the policy loss.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_rl.algorithms import kl as kl_mod
from megatron_rl.algorithms import losses
from megatron_rl.config.schema import AlgorithmConfig, Config
from megatron_rl.data.microbatch import Microbatch
from megatron_rl.distributed.runtime import active_groups
from megatron_rl.ops import zigzag


def per_sequence_rows(mb: Microbatch, x: torch.Tensor) -> torch.Tensor:
    """``[num_seqs, local_len]`` rows (differentiable, zero-padded) from a micro-batch's per-token
    tensor: one gather (:meth:`Microbatch.row_index`), whatever the number of sequences."""
    if not mb.packed:
        return x
    index = mb.row_index(x.device)
    flat = torch.cat([x.reshape(-1), x.new_zeros(1)])  # the last slot: the padding's zero
    return flat.index_select(0, index.reshape(-1)).view(index.shape)


def micro_batch_lengths(mb: Microbatch, valid_lengths: Sequence[int], device) -> torch.Tensor:
    """``[num_seqs]`` full valid lengths of the micro-batch's sequences on ``device``, copied without
    waiting for the device (a plain ``torch.tensor(..., device="cuda")`` synchronises the stream,
    once per micro-batch)."""
    return zigzag.to_device(torch.tensor([float(valid_lengths[i]) for i in mb.seq_indices]), device)


def scheduled_updates(cfg: Config) -> int:
    """Optimizer steps the RL learning-rate schedule is laid out over: steps x epochs x mini-batches."""
    return cfg.trainer.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches


def loss_denominator(agg: str, valid_lengths: Sequence[int]) -> float:
    """The mini-batch's denominator: valid tokens or non-empty sequences, as the aggregation declares."""
    return losses.global_denominator(agg, valid_lengths)


def context_parallel_row_sum(x: torch.Tensor) -> torch.Tensor:
    """``[B]`` sums of the rows of a detached ``[B, local_len]`` over all context-parallel shards."""
    total = x.detach().sum(-1)
    groups = active_groups()
    if groups is not None and groups.cp.size() > 1:
        total = total.clone()
        dist.all_reduce(total, group=groups.cp)
    return total


def _renamed(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}/{k}": v.detach() for k, v in metrics.items()}


def actor_metric_names(alg: AlgorithmConfig) -> list[str]:
    """The ``[sum, count]`` metrics the actor loss logs (the same on every rank, for the reduction)."""
    return [f"actor/{name}" for name in losses.get_policy_loss(alg.policy_loss).metrics]


def actor_loss_fn(alg: AlgorithmConfig, denominator: float, valid_lengths: Sequence[int],
                  kl_loss_coef: float, horizon: Optional[int] = None) -> Callable:
    """The registered policy loss (+ entropy bonus, + KL loss) for ``run_sequences``.

    ``horizon`` is the constant of ``seq-mean-token-sum-norm`` (the trainer passes rollout.max_new_tokens).
    Sequences without an ``old_logprob`` field take this forward's own log-probs, detached, as the
    old ones (``algorithm.old_logprobs=training_forward``): ratio 1, the gradient of the recompute path.
    """

    def loss_fn(outs: dict, t: dict, mb: Microbatch):
        rows = lambda x: per_sequence_rows(mb, x)  # noqa: E731
        mask = rows(t["loss_mask"])
        lengths = micro_batch_lengths(mb, valid_lengths, mask.device)
        logp = rows(outs["logprob"])
        weights = rows(t["rollout_weight"]) if "rollout_weight" in t else None
        old = rows(t["old_logprob"]) if "old_logprob" in t else logp.detach()
        num, _, metrics = losses.policy_loss_terms(
            alg.policy_loss, logp, old, rows(t["advantages"]), mask, alg, agg=alg.loss_agg,
            seq_lengths=lengths, horizon=horizon, weights=weights, row_sum=context_parallel_row_sum,
        )
        logs = _renamed("actor", metrics)
        logs["actor/pg_loss"] = (num / denominator).detach()
        total = num
        if alg.entropy_coef:
            ent_num, _ = losses.entropy_bonus_parts(rows(outs["entropy"]), mask, alg.loss_agg, seq_lengths=lengths,
                                                    horizon=horizon)
            total = total - alg.entropy_coef * ent_num
            logs["actor/entropy_loss"] = (ent_num / denominator).detach()
        if kl_loss_coef:
            kl_tok = kl_mod.estimate(logp, rows(t["ref_logprob"]), alg.kl_kind)
            kl_num, _ = losses.aggregate_parts(kl_tok, mask, alg.loss_agg, seq_lengths=lengths, horizon=horizon)
            total = total + kl_loss_coef * kl_num
            logs["actor/kl_loss"] = (kl_num / denominator).detach()
        return total / denominator, logs

    return loss_fn


def critic_loss_fn(alg: AlgorithmConfig, denominator: float, valid_lengths: Sequence[int],
                   horizon: Optional[int] = None) -> Callable:
    """Clipped value loss for ``run_sequences``."""

    def loss_fn(outs: dict, t: dict, mb: Microbatch):
        rows = lambda x: per_sequence_rows(mb, x)  # noqa: E731
        mask = rows(t["loss_mask"])
        lengths = micro_batch_lengths(mb, valid_lengths, mask.device)
        num, _, metrics = losses.value_loss_parts(
            rows(outs["value"]), rows(t["old_value"]), rows(t["returns"]), mask, alg.value_clip,
            alg.loss_agg, seq_lengths=lengths, horizon=horizon,
        )
        logs = _renamed("critic", metrics)
        logs["critic/vf_loss"] = (num / denominator).detach()
        return num / denominator, logs

    return loss_fn


def mini_batches(num_samples: int, count: int, seed: Optional[int]) -> list[list[int]]:
    """Split sample indices into ``count`` mini-batches (shuffled with ``seed`` unless None)."""
    order = list(range(num_samples))
    if seed is not None:
        order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    count = max(1, min(count, num_samples))
    size, extra = divmod(num_samples, count)
    out, start = [], 0
    for c in range(count):
        n = size + (1 if c < extra else 0)
        out.append(sorted(order[start : start + n]))
        start += n
    return out
