"""Dynamic batching: megatron-core's ``DynamicInferenceEngine`` over a paged KV cache, built on
the first rollout, suspended between rollouts (its KV cache freed) and resumed for the next."""

from __future__ import annotations

import contextlib
import math
from typing import Optional

from megatron_rl.compat.inference_graphs import DecodeGraphs
from megatron_rl.compat.paged_attention import install_paged_attention, paged_attention_refusal, pick_paged_attention
from megatron_rl.distributed.runtime import one_rank_group
from megatron_rl.layout.arch import max_positions
from megatron_rl.rollout.engine import RolloutBatch
from megatron_rl.rollout.megatron.controller import (
    IdsOnly,
    padded_context_class,
    request_params_class,
    sampling_controller_class,
)
from megatron_rl.rollout.megatron.draws import sampled_batch
from megatron_rl.rollout.megatron.modes import (
    after_generating,
    kv_cache_bytes_for,
    without_context_parallel,
)
from megatron_rl.rollout.megatron.wrapper import actor_wrapper_class
from megatron_rl.rollout.sampling import SamplingParams

# Tokens a forward step is padded to: megatron pads to 64 for CUDA graphs and tensor cores; on
# the CPU that only adds work (a decode step of 3 requests would run 64 tokens).
GPU_TOKEN_ROUNDER = 64
CPU_TOKEN_ROUNDER = 1


@contextlib.contextmanager
def engine_records_routing(model, context):
    """megatron's own routing recording (``moe_enable_routing_replay``) on ``model``'s routers while
    the engine steps: each finished request then carries ``routing_indices`` [prompt + response - 1,
    this stage's MoE layers, top-k], or None where megatron-core 0.19.2 lost it (evicted requests,
    and requests whose KV blocks are handed on in the step they finish).  megatron's list of router
    instances is process-global (every MoE model built in the process): it holds only this model's
    routers meanwhile, in layer order."""
    from megatron.core.inference.contexts.routing_metadata import RoutingMetadata
    from megatron.core.transformer.moe.router_replay import RouterReplay

    state = getattr(model, "moe_state", None)
    if state is None:
        yield
        return
    config = model.config
    instances = list(RouterReplay.global_router_replay_instances)
    RouterReplay.global_router_replay_instances[:] = [r.router_replay for r in state.routers]
    if getattr(context, "moe_routing_metadata", None) is None:
        context.moe_enable_routing_replay = True
        context.moe_routing_metadata = RoutingMetadata(context, config.moe_router_topk)
    config.moe_enable_routing_replay = True
    try:
        yield
    finally:
        config.moe_enable_routing_replay = False
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()
        RouterReplay.global_router_replay_instances[:] = instances


class DynamicBatching:
    """megatron's dynamic engine for one :class:`~megatron_rl.rollout.megatron.engine.MegatronRolloutEngine`,
    whose ``rollout.*`` settings it reads when it builds and generates (they may change between calls)."""

    def __init__(self, settings):
        self.settings = settings
        self.engine = None  # megatron's DynamicInferenceEngine, once built
        self.kv_bytes = 0
        self.suspended = False
        self.cp_group = None  # the model's CP group, swapped for a one-rank group while it generates
        self.graphs: Optional[DecodeGraphs] = None  # megatron's per-layer graph managers, while graphed
        self.prefill_tokens = 0  # prompt tokens the last generate computed (shared pages are not)
        self.idle_steps = 0  # the last generate's dummy steps (this expert-parallel rank had no work)
        self.weight_swaps = 0  # pushes the last generate took mid-rollout
        self.megatron_routing_indices: dict = {}  # request id -> [tokens - 1, layers, topk] or None

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's paged KV cache while allocated (0 before the first rollout)."""
        return 0 if self.engine is None or self.suspended else self.kv_bytes

    def suspend(self) -> None:
        """Free the KV cache until the next rollout."""
        if self.engine is not None and not self.suspended:
            self.engine.suspend()
            self.suspended = True

    def close(self) -> None:
        if self.engine is not None and not self.suspended:
            self.engine.suspend()
        self.engine, self.suspended = None, False

    def build(self, model) -> None:
        from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

        config = model.config
        kernels = self.paged_kernels()
        install_paged_attention(kernels)
        if config.virtual_pipeline_model_parallel_size is not None:
            raise ValueError("megatron's inference refuses virtual pipeline stages: a VPP actor generates on a model "
                             "of its own (rollout.layout), never on its interleaved chunks")
        # With EP > 1 the context allocates the buffers of the inference-optimized MoE layers'
        # dispatcher; the default, 'nvls', needs NVLink symmetric memory (none on the CPU or a PCIe
        # GPU), and this model's layers (local / TE specs) never use either dispatcher.
        config.inference_moe_token_dispatcher_type = "nccl"
        own = model is self.settings.weights.inference_model  # its groups are not megatron's globals
        groups = model.pg_collection
        rounder = GPU_TOKEN_ROUNDER if self.settings.device.type == "cuda" else CPU_TOKEN_ROUNDER
        inference_config = self._inference_config(groups if own else None, groups.tp.size(), rounder, kernels)
        # Layers, heads, head size, dtype and TP/PP sizes come from the model's config.
        if not self._graphed(kernels):
            self.graphs = None
        elif self.graphs is None or self.graphs.model is not model:  # one set of managers per model
            self.graphs = DecodeGraphs(model)
        with self.graphs_on():  # megatron reads cuda_graph_impl while it builds, and captures
            context = padded_context_class(rounder)(model_config=config, inference_config=inference_config)
            self.kv_bytes = context.kv_block_allocator.total_count * context.block_size_bytes
            wrapper = actor_wrapper_class()(model, context)
            wrapper.prefill_tokens = 0
            controller = sampling_controller_class()(wrapper, IdsOnly())
            self.engine = DynamicInferenceEngine(controller, context)
        self.suspended = False
        self.cp_group = None if own or groups.cp.size() == 1 else groups.cp
        if self.cp_group is not None:
            one_rank_group()  # collective: every rank creates the groups now, at the same time

    def _inference_config(self, own_groups, tp: int, rounder: int, kernels: str):
        """megatron's InferenceConfig of ``rollout.*``; ``own_groups``: the model of its own's groups."""
        from megatron.core.inference.config import InferenceConfig, KVCacheManagementMode, PrefixCachingEvictionPolicy

        s = self.settings
        token_rounder = math.ceil(rounder / tp) * tp
        max_requests = math.ceil(s.max_requests / tp) * tp
        # Every step's (padded) token count must fit max_tokens: a multiple of the rounder.
        max_tokens = max(s.prefill_chunk_tokens, max_requests)
        max_tokens = math.ceil(max_tokens / token_rounder) * token_rounder
        self.kv_bytes = kv_cache_bytes_for(s.kv_cache_memory, s.device)
        return InferenceConfig(
            block_size_tokens=s.kv_block_tokens,
            buffer_size_gb=self.kv_bytes / 1024**3,
            max_requests=max_requests,
            max_tokens=max_tokens,
            max_sequence_length=max_positions(s.model_cfg),
            materialize_only_last_token_logits=True,
            use_flashinfer_fused_rope=False,
            unified_memory_level=0,
            enable_chunked_prefill=True,
            # suspend() frees the KV cache (the default, PERSIST, keeps it while the actor trains)
            kv_cache_management_mode=KVCacheManagementMode.RECOMPUTE,
            pg_collection=own_groups,
            enable_prefix_caching=self.caching(),
            # A page is shared only while a request holds it: the weights change between rollouts.
            prefix_caching_eviction_policy=PrefixCachingEvictionPolicy.REF_ZERO,
            **self._graph_options(kernels, max_requests),
        )

    def paged_kernels(self) -> str:
        """``rollout.paged_attention`` resolved for this device (:mod:`megatron_rl.compat.paged_attention`)."""
        cuda = self.settings.device.type == "cuda"
        name = pick_paged_attention(self.settings.paged_attention, cuda)
        refusal = paged_attention_refusal(name, cuda)
        if refusal:
            raise ValueError(f"rollout.paged_attention={name}: {refusal}")
        return name

    def _graphed(self, kernels: str) -> bool:
        """Whether decode steps replay CUDA graphs (``rollout.cuda_graphs``; None: wherever they can)."""
        from megatron_rl.layout.arch import is_moe
        from megatron_rl.rollout.choice import DYNAMIC, cuda_graphs_refusal, pick_cuda_graphs

        s = self.settings
        facts = dict(cuda=s.device.type == "cuda", batching=DYNAMIC, kernels=kernels, moe=is_moe(s.model_cfg))
        on, _ = pick_cuda_graphs(s.cuda_graphs, **facts)
        refusal = cuda_graphs_refusal(**facts) if on else ""
        if refusal:
            raise ValueError(f"rollout.cuda_graphs=true: {refusal}")
        return on

    def _graph_options(self, kernels: str, max_requests: int) -> dict:
        """megatron's InferenceConfig fields for CUDA graphs of decode steps: batch sizes halving from
        the most requests in flight (the rollout's batch) down to the TP size."""
        if not self._graphed(kernels):
            return {}
        return dict(num_cuda_graphs=max(1, math.ceil(math.log2(max_requests)) + 1),
                    use_cuda_graphs_for_non_decode_steps=False)

    def graphs_on(self):
        return self.graphs.attached() if self.graphs is not None else contextlib.nullcontext()

    def caching(self) -> bool:
        """Prefix caching, unless routing is recorded: a token read from a shared page is not routed."""
        return self.settings.prefix_caching and not self.settings.record_routing

    def _ready(self, model) -> None:
        """megatron's engine built, or resumed, for this rollout."""
        from megatron.core.inference.utils import InferenceMode

        if self.engine is not None and self.suspended and self.settings.kv_cache_memory <= 1:
            self.engine = None  # a fraction of what is free now: sized again for this rollout
        if self.engine is not None and self.engine.context.enable_prefix_caching != self.caching():
            self.close()  # record_routing or prefix_caching changed since it was built
        install_paged_attention(self.paged_kernels())  # another engine of this process may have changed it
        try:
            if self.engine is None:
                self.build(model)
            elif self.suspended:
                with self.graphs_on():  # resume captures the graphs again (the KV cache is new)
                    self.engine.resume()
                self.suspended = False
        finally:
            InferenceMode.unset_active()  # building and resuming set it: on only while stepping

    def _check_fits(self, prompt_ids: list[list[int]], params: SamplingParams) -> None:
        blocks = self.engine.context.kv_block_allocator.active_count
        block_tokens = self.settings.kv_block_tokens
        longest = max(len(p) for p in prompt_ids) + params.max_new_tokens if prompt_ids else 0
        if -(-longest // block_tokens) > blocks:
            raise ValueError(
                f"rollout.kv_cache_memory: the KV cache holds {blocks} pages of {block_tokens} tokens "
                f"({self.kv_bytes} bytes), fewer than one sequence of {longest} tokens needs; raise "
                f"rollout.kv_cache_memory or lower rollout.max_new_tokens"
            )

    def generate(self, model, prompt_ids: list[list[int]], params: SamplingParams, samples: list[tuple[int, int]],
                 keys: list[int], vocab: int) -> RolloutBatch:
        """Every sample as one request of megatron's engine, stepped until all finished."""
        self._ready(model)
        self._check_fits(prompt_ids, params)
        controller = self.engine.controller
        controller.begin(params, getattr(model, "true_vocab_size", None) or vocab, dict(enumerate(keys)))
        lengths = {rid: len(prompt_ids[i]) + params.max_new_tokens for rid, (i, _) in enumerate(samples)}
        done, routing = self._generate_requests(model, prompt_ids, params, samples, lengths)
        if self.settings.megatron_routing:
            self.megatron_routing_indices = {r.request_id: r.merge().routing_indices for r in done}
        self._refuse_failed(done)
        log = controller.log
        responses = [log.responses[rid] for rid in range(len(samples))]
        recorded = None
        if self.settings.record_routing:  # cut each recording to the sample's prompt + response
            recorded = [{layer: table[: len(prompt_ids[samples[rid][0]]) + len(responses[rid])]
                         for layer, table in routing.get(rid, {}).items()}
                        for rid in range(len(samples))]
        versions = None
        if self.settings.live_weights is not None:
            versions = [log.versions[rid] for rid in range(len(samples))]
        return sampled_batch(prompt_ids, samples, responses, [log.logprobs[rid] for rid in range(len(samples))],
                             params, routing=recorded, token_versions=versions)

    def _generate_requests(self, model, prompt_ids, params, samples, lengths):
        """Add every request and step them all; ``(finished records, routing recorded by sample)``."""
        from megatron.core.inference.utils import InferenceMode

        from megatron_rl.models.moe import moe_rollout

        engine = self.engine
        request = request_params_class()(num_tokens_to_generate=params.max_new_tokens, termination_id=-1,
                                         return_log_probs=False)
        was_training = model.training
        model.eval()
        recording = moe_rollout(model, lengths) if self.settings.record_routing else contextlib.nullcontext({})
        megatron_records = (engine_records_routing(model, engine.context) if self.settings.megatron_routing
                            else contextlib.nullcontext())
        try:
            with without_context_parallel(model, self.cp_group), InferenceMode.active(), \
                    recording as routing, megatron_records, self.graphs_on():
                for rid, (i, _) in enumerate(samples):
                    engine.add_request(rid, list(prompt_ids[i]), request)
                wrapper = engine.controller.inference_wrapped_model
                wrapper.prefill_tokens = 0
                done = self.run(engine, model)
                self.prefill_tokens = wrapper.prefill_tokens
        finally:
            after_generating(model, was_training)
        return done, routing

    @staticmethod
    def _refuse_failed(done: list) -> None:
        from megatron.core.inference.inference_request import Status

        failed = [r for r in done if r.requests[-1].status == Status.FAILED]
        if failed:
            events = failed[0].requests[-1].events
            raise RuntimeError(f"megatron inference failed request {failed[0].request_id}: {events}")

    def run(self, engine, model) -> list:
        """Step until every request finished.  Expert-parallel ranks (each with its own share of
        prompts) step together: their MoE layers exchange tokens in every forward, so a rank
        without work runs megatron's dummy forward until all of its EP group are done.

        With PP > 1 every stage of a generator has the same requests (the last stage's logits are
        broadcast to all), so its stages idle on the same steps; an EP group holds one stage of
        several generators, so every stage's group agrees on the same steps, and a dummy forward
        passes its one-token request stage to stage as a real step does."""
        from megatron_rl.distributed import collectives

        groups = model.pg_collection
        done = []
        self.idle_steps = self.weight_swaps = 0
        if groups.ep.size() == 1:
            while engine.has_unfinished_requests():
                self._take_pushed_weights(engine)
                done += self.step(engine)
            return done
        group = groups.ep
        while True:
            busy = engine.has_unfinished_requests()
            if not collectives.agree_any(busy, group=group):
                return done
            self._take_pushed_weights(engine)
            if busy:
                done += self.step(engine)
            else:
                engine.controller.dummy_forward()
                self.idle_steps += 1

    @staticmethod
    def step(engine) -> list:
        """One engine step (a prefill chunk and / or one token per decoding request); the requests
        it finished."""
        return engine.step_modern()["finished_request_records"]

    def _take_pushed_weights(self, engine) -> None:
        """Partial rollouts: before every step, newer weights that have arrived are loaded (in place,
        into the shards the engine runs on) and the requests in flight go on with them.  Their KV
        cache is recomputed under the new weights by megatron's own suspend / resume in ``RECOMPUTE``
        mode (each request's prompt and tokens so far re-prefilled), so every later token is drawn
        from the new policy given the sample so far, and its log-prob is that policy's."""
        live = self.settings.live_weights
        if live is None:
            return
        if live.poll():
            engine.suspend()
            engine.resume()
            self.weight_swaps += 1
        engine.controller.version = live.version
