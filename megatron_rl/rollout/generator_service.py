"""What a generator rank does (``rollout.ranks``): load the weights the trainers push, generate the
batches they request, in the order they were posted, until told to stop.

The generator ranks are a world of their own with megatron's groups for ``rollout.layout`` (CP 1,
the remaining ranks data-parallel replicas); their engine generates on that layout's own shards.
Generator rank 0 reads the trainer's messages (:mod:`megatron_rl.distributed.bridge`) and passes
each to the others; at a weight push every generator rank receives its own shard from the trainer
ranks (megatron-core's resharding across the two worlds, :func:`refit_across_worlds`); generator rank 0
returns each batch with the policy version that generated it and the time it took, and how long
the generators sat idle before the request came.  Signals are the trainers' to act on: a
generator serves until the trainers have checkpointed and said stop.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from typing import Optional

import torch.distributed as dist

from megatron_rl.config.schema import Config
from megatron_rl.distributed import collectives, faults, guard
from megatron_rl.distributed.bridge import Bridge, ask_to_stop
from megatron_rl.distributed.cross_world import data_group, joint_group
from megatron_rl.distributed.messages import (
    GeneratedRollout,
    GenerationRequest,
    GenerationResult,
    SamplingSettings,
    Stop,
    WeightsPush,
)
from megatron_rl.distributed.placement import GENERATOR
from megatron_rl.distributed.runtime import job_placement, job_store
from megatron_rl.distributed.startup import start_model_parallel
from megatron_rl.layout.lora import lora_on
from megatron_rl.layout.sizes import ParallelLayout
from megatron_rl.models.builder import build_gpt_chunks
from megatron_rl.models.lora.adapters import attach_inference_lora
from megatron_rl.rollout.build import make_rollout_engine, on_active_layout
from megatron_rl.rollout.dp import generate_data_parallel
from megatron_rl.rollout.engine import RolloutBatch
from megatron_rl.rollout.refit import RefitStats, refit_across_worlds, refit_vocab_rows
from megatron_rl.rollout.sampling import SamplingParams


def generator_layout(cfg: Config, generators: int) -> ParallelLayout:
    """The generators' layout: ``rollout.layout`` (resolved: unset sizes are the training
    layout's), CP 1, no virtual stages, the remaining ranks data-parallel."""
    own = cfg.rollout.layout
    parallel = dataclasses.replace(cfg.parallel, tp=own.tp, pp=own.pp, ep=own.ep, etp=own.etp, cp=1, vpp=None,
                                   cp_comm_type="p2p", hierarchical_context_parallel_sizes=None)
    return ParallelLayout.from_config(parallel, generators)


def rollout_to_message(rollout: RolloutBatch) -> GeneratedRollout:
    out = GeneratedRollout(prompt_index=rollout.prompt_index, response_ids=rollout.response_ids,
                           response_logprobs=rollout.response_logprobs, finish_reason=rollout.finish_reason,
                           token_versions=rollout.token_versions)
    if rollout.response_mask is not None:  # multi-turn: an agent's session may start from its own prompt
        out = dataclasses.replace(out, prompt_ids=rollout.prompt_ids, response_mask=rollout.response_mask,
                                  env_info=rollout.env_info)
    return out


def rollout_from_message(message: GeneratedRollout, prompt_ids: list[list[int]]) -> RolloutBatch:
    """The batch a generator returned; ``prompt_ids``: the request's prompts (sent back only by
    multi-turn rollouts)."""
    prompts = message.prompt_ids or [list(prompt_ids[i]) for i in message.prompt_index]
    return RolloutBatch(prompt_index=list(message.prompt_index), prompt_ids=[list(p) for p in prompts],
                        response_ids=message.response_ids, response_logprobs=message.response_logprobs,
                        finish_reason=message.finish_reason, token_versions=message.token_versions,
                        response_mask=message.response_mask, env_info=message.env_info)


class PushedWeights:
    """The weights the trainers push, received into the generators' shards and engine.

    With ``trainer.partial_rollouts`` the engine calls :meth:`poll` before each token, so a push
    reaches the requests in flight (every generator rank polls in step: validation keeps partial
    rollouts to one replica, whose ranks run the same decode loop)."""

    def __init__(self, bridge: Optional[Bridge], chunks: list, engine, group, trainers: int, data=None):
        self.bridge, self.chunks, self.engine = bridge, chunks, engine
        self.group, self.trainers, self.data = group, trainers, data
        self.version: Optional[int] = None
        self.last_refit = RefitStats(0.0, 0)

    def load(self, push: WeightsPush) -> None:
        if self.bridge is not None:
            self.bridge.receiving(push)
        self.last_refit = refit_across_worlds(None, self.chunks[0], self.group, self.trainers, self.data,
                                              adapters_only=push.adapters_only)
        self.engine.load_from_chunks(self.chunks)
        self.version = push.version

    def poll(self) -> bool:
        message = self.bridge.peek_message() if self.bridge is not None else None
        if not collectives.agree_any(isinstance(message, WeightsPush)):
            return False
        if self.bridge is not None:
            self.bridge.next_message()
        self.load(collectives.broadcast_object(message, src=0))
        return True


def _pass_stop_signals_to_the_trainers() -> None:
    """A stop signal (SIGTERM, SIGUSR1, Ctrl-C) that reaches a generator rank -- a preemption notice
    can reach any node of a job -- asks the trainers to stop: they checkpoint at their next step
    boundary, then stop the generators, as when the signal reaches them.  A second Ctrl-C aborts."""
    store, where = job_store(), job_placement()
    who = f"generator rank {where.rank} (job rank {where.global_rank})"
    asked: list[int] = []

    def handle(signum, _frame) -> None:
        if signum == signal.SIGINT and signal.SIGINT in asked:
            guard.abort_now(f"aborted (Ctrl-C twice on {who}); no checkpoint of the current step")
        asked.append(signum)
        ask_to_stop(store, f"signal {signum} on {who}")

    for sig in guard.STOP_SIGNALS:
        signal.signal(sig, handle)


def serve_generation(cfg: Config, log=print, wrap_engine=None) -> None:
    """The generator ranks' main loop; ``cfg`` is resolved for the training world like the trainers'.
    ``wrap_engine(engine)``: the rollout the requests run on (multi-turn: the engine driven by
    ``rollout.env`` or ``rollout.agent``, :func:`megatron_rl.envs.build.with_environment`)."""
    _pass_stop_signals_to_the_trainers()
    rank0 = dist.get_rank() == 0
    started = start_model_parallel(cfg, generator_layout(cfg, dist.get_world_size()))
    layout, device = started.layout, started.device
    # The training model's vocabulary rows, so the embedding and output layer map row for row.
    chunks = build_gpt_chunks(cfg.model, layout, device, initialize=False,
                              vocab_rows=refit_vocab_rows(cfg.model, cfg.parallel.tp, layout.tp))
    if lora_on(cfg.actor.lora):  # the actor's adapters, so the generators do not generate from the base
        attach_inference_lora(chunks, cfg.model, cfg.actor.lora)
    engine = make_rollout_engine(on_active_layout(cfg.rollout), cfg.model, device)
    bridge = Bridge(job_store()) if rank0 else None
    group = joint_group(cfg.distributed.timeout_s)
    if rank0:
        log(f"generators: {dist.get_world_size()} rank(s), layout tp={layout.tp} pp={layout.pp} ep={layout.ep} "
            f"dp={layout.dp}, {type(engine).__name__}")
    weights = PushedWeights(bridge, chunks, engine, group, job_placement().trainers,
                            data_group(group, cfg.distributed.timeout_s, device))
    if cfg.trainer.partial_rollouts:
        engine.live_weights = weights
    rollout = wrap_engine(engine) if wrap_engine is not None else engine
    sampling = None
    idle_since = time.perf_counter()
    while True:
        # Checked by rank 0 on receipt (messages.decode), then passed to the other generator ranks.
        message = collectives.broadcast_object(bridge.next_message() if rank0 else None, src=0)
        if isinstance(message, Stop):
            break
        if isinstance(message, SamplingSettings):
            sampling = SamplingParams(**message.sampling)
        elif isinstance(message, WeightsPush):
            weights.load(message)
        elif isinstance(message, GenerationRequest):
            faults.maybe_inject(message.step, role=GENERATOR)
            start, version = time.perf_counter(), weights.version
            batch = generate_data_parallel(rollout, message.prompt_ids, sampling, seed=message.seed,
                                           records=message.records)
            done = time.perf_counter()
            if rank0:
                refit = weights.last_refit
                bridge.put_result(message.step, GenerationResult(
                    rollout_to_message(batch), version, generate_s=done - start, idle_s=start - idle_since,
                    refit_s=refit.seconds, refit_bytes=refit.bytes_received, shard_bytes=refit.shard_bytes))
            idle_since = done
    collectives.barrier()
    if rank0:
        bridge.stopped()

