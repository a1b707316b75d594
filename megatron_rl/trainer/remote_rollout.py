"""The trainers' side of generation on ranks of their own (``rollout.ranks``).

Trainer rank 0 posts, in one ordered stream (:mod:`megatron_rl.distributed.messages`), the weights
after an update and the requests for batches (prompts and seed of a step); the generators act on
them in that order, so batch ``j`` is generated with the last weights posted before its request,
and staleness is fixed by the order (:class:`~megatron_rl.trainer.staleness.StalenessPlan`):

- weights are pushed after every ``push_every``-th update (version = updates seen);
- after a push of version ``p`` the trainer requests every batch ``j <= p + bound + 1`` not yet
  requested, so batch ``j`` (trained after ``j - 1`` updates) is at most ``bound`` versions stale.

``trainer.mode`` picks the two numbers: ``sync`` (bound 0: generate, then train, no overlap),
``one_step_off`` (bound 1, every update pushed: batch ``j`` generated with the weights of ``j - 2``
updates, exactly the batches and seeds of the colocated mode), ``async`` (``trainer.max_staleness``
and ``trainer.push_weights_every``: generators keep up to that many batches ahead).  While the
trainers update, the generators generate what was requested: that overlap is the mode's gain.
With ``trainer.partial_rollouts`` a push also reaches the batch being generated: its later tokens
come from the newer weights, each recording its version, so a sample's staleness is its oldest
token's and stays within the same bound.

Prompts are drawn by the trainers (the sampler is theirs and in every checkpoint); a checkpoint
first takes every requested batch from the generators, so it holds each batch generated and not yet
trained and nothing is in flight: a resumed job trains exactly those batches, then requests the
next ones, none twice and none lost.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch.distributed as dist

from megatron_rl.config.schema import Config
from megatron_rl.distributed import collectives
from megatron_rl.distributed.bridge import Bridge, WeightSender
from megatron_rl.distributed.cross_world import data_group, joint_group
from megatron_rl.distributed.messages import GenerationRequest, SamplingSettings, WeightsPush
from megatron_rl.distributed.runtime import job_placement, job_store, resolve_device
from megatron_rl.layout.lora import lora_on
from megatron_rl.rollout.generator_service import rollout_from_message
from megatron_rl.rollout.refit import refit_across_worlds, snapshot_for_push
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.trainer.experience import Samples
from megatron_rl.trainer.rollout_buffer import GeneratedBatch
from megatron_rl.trainer.staleness import StalenessPlan
from megatron_rl.utils.seeds import derive_seed


class RemoteRollout:
    def __init__(self, cfg: Config, sampler, prompt_ids: list[list[int]], sampling: SamplingParams,
                 records_of=None):
        """``records_of(batch)``: what the environments of a batch's prompts start from (multi-turn)."""
        self.cfg, self.sampler, self.prompt_ids, self.sampling = cfg, sampler, prompt_ids, sampling
        self.records_of = records_of
        self.plan = StalenessPlan.of(cfg)
        self.rank0 = dist.get_rank() == 0
        self.bridge = Bridge(job_store()) if self.rank0 else None
        self.group = joint_group(cfg.distributed.timeout_s)
        self.data = data_group(self.group, cfg.distributed.timeout_s, resolve_device(cfg.distributed))
        self.trainers = job_placement().trainers
        self.sender = WeightSender(job_store(), lambda snapshot: refit_across_worlds(snapshot, None, self.group,
                                                                                     self.trainers, self.data))
        self.lora = lora_on(cfg.actor.lora)  # the base is frozen: pushes after the first carry adapters only
        self.base_pushed = False
        self.requested: dict[int, list[int]] = {}  # step -> dataset indices, requested and not yet taken
        self.next_request = 1
        self.pushed: Optional[int] = None
        self.closed = False

    def stop_asked(self) -> Optional[str]:
        """Who, on the generator ranks, was asked to stop the job (read on trainer rank 0)."""
        return self.bridge.stop_asked() if self.bridge is not None else None

    def start(self, step: int, buffered: list[int], chunks: list) -> None:
        """At the start (or resume) after ``step`` updates, with batches ``buffered`` already at hand."""
        if self.rank0:
            self.bridge.post(SamplingSettings(dataclasses.asdict(self.sampling)))
        self.next_request = max([step, *buffered]) + 1
        self.push(step, chunks)

    def push(self, version: int, chunks: list) -> None:
        """Send the actor's weights after ``version`` updates, then request what the bound allows.
        The trainers only copy what they will send (:func:`snapshot_for_push`); the transfer runs
        on their sender threads when the generators take it."""
        adapters_only = self.lora and self.base_pushed
        snapshot = snapshot_for_push(chunks, self.group, self.trainers, adapters_only=adapters_only)
        if self.rank0:
            self.bridge.post(WeightsPush(version, adapters_only=adapters_only))
        self.base_pushed = True
        self.sender.put(version, snapshot)
        self.pushed = version
        self._request()

    def _request(self) -> None:
        while self.next_request <= self.plan.last_batch(self.pushed, self.cfg.trainer.steps):
            step = self.next_request
            batch = self.sampler.next_batch()
            if self.rank0:
                self.bridge.post(GenerationRequest(
                    step, [self.prompt_ids[i] for i in batch], derive_seed(self.cfg.run.seed, "rollout", step),
                    records=self.records_of(batch) if self.records_of is not None else None))
            self.requested[step] = batch
            self.next_request += 1

    def after_update(self, step: int, chunks: list) -> None:
        """The actor has ``step`` updates: push them when due and of use -- while batches remain to
        request, or (partial rollouts) while requested ones may still be generating."""
        useful = self.next_request <= self.cfg.trainer.steps or (self.cfg.trainer.partial_rollouts and self.requested)
        if self.plan.push_due(step) and useful:
            self.push(step, chunks)

    def take(self, step: int) -> tuple[GeneratedBatch, dict]:
        """Batch ``step`` from the generators (waiting for it) on every trainer rank, and what its
        generation cost on their side."""
        batch = self.requested.pop(step)
        start = time.perf_counter()
        taken = None
        if self.rank0:
            taken = (self.bridge.take_result(step), time.perf_counter() - start)  # checked on receipt
        result, wait_s = collectives.broadcast_object(taken, src=0)
        rollout = rollout_from_message(result.rollout, [self.prompt_ids[i] for i in batch])
        samples = Samples.from_rollout(rollout, batch, batch_id=str(step))
        tokens = sum(len(r) for r in samples.response_ids)
        metrics = {"rollout/generate_s": result.generate_s, "rollout/generator_idle_s": result.idle_s,
                   "rollout/generator_tokens_per_s": tokens / max(result.generate_s, 1e-9),
                   "rollout/trainer_wait_s": wait_s,
                   "rollout/refit_bytes": result.refit_bytes, "rollout/generator_shard_bytes": result.shard_bytes,
                   "timing/refit_s": result.refit_s}
        return GeneratedBatch(samples, result.version), metrics

    def drain(self) -> dict[int, GeneratedBatch]:
        """Every requested batch, waited for: what a checkpoint keeps so nothing is in flight."""
        return {step: self.take(step)[0] for step in sorted(self.requested)}

    def close(self) -> None:
        """Stop the generators (after every push was delivered)."""
        if not self.closed:
            if self.rank0:
                self.bridge.post_stop()
            self.sender.close()
            if self.rank0:
                self.bridge.wait_stopped()
        self.closed = True
