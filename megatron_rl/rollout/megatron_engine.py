"""``rollout.engine=megatron``: megatron-core's ``DynamicInferenceEngine`` on the actor's own shards.

The actor's TP/PP chunk generates directly -- no weight copy, no reshard: a paged KV cache
(``rollout.kv_cache_memory``, blocks of ``rollout.kv_block_tokens``), continuous batching of up to
``rollout.max_batch_size`` requests, prefill chunked to ``rollout.prefill_chunk_tokens`` tokens
per step.  Between rollouts the engine is suspended (``release_weights``, which the trainer calls
after every rollout): its KV cache is freed while the actor trains.  The next rollout resumes it
at the same size when the budget is in bytes; a budget given as a fraction of free memory is
measured again, so the context is rebuilt for it.

What this module adds around megatron's engine, so its samples mean what the trainer expects:

* **Logits from our model.**  ``RLGPTModel`` returns hidden states (the log-prob and value heads
  replace the output layer); the inference wrapper here applies ``GPTModel``'s own output step to
  them on the last stage (last-token selection, sequence-parallel gather, TP gather).
* **Our sampler.**  The controller's sampling is replaced by
  :func:`megatron_rl.rollout.sampling.sample` on the true vocabulary (padded ids are never drawn):
  temperature, top-k and top-p together, greedy at T=0, and log-probs under the
  temperature-scaled full distribution -- the trainer's definition, not megatron's raw-logit one.
  The race noise is :func:`~megatron_rl.rollout.sampling.keyed_exponentials` of (seed, prompt,
  sample, position), so a seed gives the same samples whatever the KV budget, chunk size or
  scheduling (requests pausing, being evicted and re-prefilled).
* **Prefix caching** (``rollout.prefix_caching``).  Requests whose prompts share whole KV pages
  share those pages: the ``n`` samples of a prompt prefill it once, and each other sample
  computes only the tokens after its last whole page (at least 2, a page when the prompt ends on
  a page boundary).  The shared keys and values are the ones each sample would have computed,
  so samples do not change.  Pages are shared only while a request holds them (megatron's
  ``REF_ZERO`` eviction), so nothing is reused across rollouts, whose weights differ.  Off while
  routing is recorded (MoE routing replay): a reused token is never routed again, so its experts
  would be missing from the samples that reuse it.
* **Our stop rule.**  Every stop id and stop sequence ends a sample on the step that produced it
  (the stop token kept), through the engine's own termination path; ``n`` samples per prompt are
  ``n`` requests.

* **Partial rollouts** (``live_weights``, async generator ranks).  Before every step the engine
  asks whether newer weights were pushed; when they were, they are already in the shards it runs
  on, and megatron's own suspend / resume (``RECOMPUTE``) re-prefills every request in flight, so
  later tokens are the new policy's given the sample so far; each token records its version.

Layouts: TP, PP, SP, EP (with PP too) and CP -- each context-parallel rank generates on its own
as a replica of the TP/PP shards (megatron's inference has no context parallelism, so the model's
CP group is swapped for a one-rank group while it generates).  With VPP the engine generates on a
model of its own (:mod:`megatron_rl.rollout.refit`, refit from the interleaved chunks before every
rollout): megatron's inference refuses interleaved chunks.

Paged attention (``rollout.paged_attention``, :mod:`megatron_rl.compat.paged_attention`):
flash-attn's kernels where they import on CUDA, else the Triton kernel
(:mod:`megatron_rl.ops.paged_attention`); on a CPU the SDPA stand-in and the other shims of
:mod:`megatron_rl.compat.inference_cpu`.  On CUDA decode steps replay megatron's per-layer CUDA
graphs (``rollout.cuda_graphs``, :mod:`megatron_rl.compat.inference_graphs`), attached to the actor's
layers only while the engine builds, resumes and steps, so the training forward never sees them.

megatron-core 0.19's inference mode is a process-wide flag (``InferenceMode``) that changes
``GPTModel``'s pre- and post-processing (last-token logits among them); it is on only while this
engine steps, so the trainer's forwards between rollouts never see it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional

import torch
import torch.distributed as dist

from megatron_rl.compat.inference_graphs import DecodeGraphs
from megatron_rl.compat.paged_attention import install_paged_attention, paged_attention_refusal, pick_paged_attention
from megatron_rl.config.schema import ModelConfig
from megatron_rl.models.arch import max_positions
from megatron_rl.rollout.choice import STATIC
from megatron_rl.rollout.engine import LiveWeights, RolloutBatch, stopped
from megatron_rl.rollout.sampling import SamplingParams, keyed_exponentials, sample, sample_key
from megatron_rl.utils.seeds import derive_seed

# Tokens a forward step is padded to: megatron pads to 64 for CUDA graphs and tensor cores; on
# the CPU that only adds work (a decode step of 3 requests would run 64 tokens).
GPU_TOKEN_ROUNDER = 64
CPU_TOKEN_ROUNDER = 1


def kv_cache_bytes_for(budget: float, device: torch.device) -> int:
    """``rollout.kv_cache_memory`` in bytes: a fraction of the memory free now when <= 1, else bytes."""
    if budget > 1:
        return int(budget)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # What torch's caching allocator holds unused is free to this process too.
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    else:
        import psutil

        free = psutil.virtual_memory().available
    return int(budget * free)


class _IdsOnly:
    """The tokenizer the controller is given: prompts arrive as ids and results leave as ids, so
    only the attributes megatron reads at the end of a request exist (no text is produced)."""

    eod = -1
    bos = None

    def detokenize(self, ids, **_kwargs) -> str:
        return ""

    def tokenize(self, text):
        raise TypeError("rollout.engine=megatron takes token ids, not text")


@functools.lru_cache(maxsize=None)
def _one_rank_group():
    """A process group of this rank alone (created collectively, once per process)."""
    group, _ = dist.new_subgroups(group_size=1)
    return group


@contextlib.contextmanager
def _without_context_parallel(model: torch.nn.Module, cp_group):
    """Let a model built for CP > 1 run whole sequences: every reference to ``cp_group`` in its
    modules (RoPE's slicing, attention's THD RoPE) points at a one-rank group meanwhile."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        yield
        return
    solo = _one_rank_group()
    swapped: list[tuple[object, str]] = []
    seen: set[int] = set()
    for module in model.modules():
        for holder in (module, getattr(module, "pg_collection", None)):
            if holder is None or id(holder) in seen:
                continue
            seen.add(id(holder))
            for attr in ("cp_group", "cp"):
                if getattr(holder, attr, None) is cp_group:
                    setattr(holder, attr, solo)
                    swapped.append((holder, attr))
    _clear_rope_cache()  # tables cached for the CP group are cut to this rank's slice
    try:
        yield
    finally:
        for holder, attr in swapped:
            setattr(holder, attr, cp_group)


@contextlib.contextmanager
def _without_sequence_parallel(model: torch.nn.Module):
    """Let a model built with sequence parallelism run megatron's static batching, which has none
    (a decode step's one token cannot be split over the TP group): every rank of the group runs the
    whole sequence meanwhile.  The math is the same -- sequence parallelism only moves where the
    activations outside attention and the MLP are split -- so the switch is the flags megatron reads
    when it forwards: the config's, each parallel linear layer's, the embedding's scatter."""
    config = getattr(model, "config", None)
    if config is None or not config.sequence_parallel:
        yield
        return
    flipped: list[tuple[object, str]] = [(config, "sequence_parallel")]
    for module in model.modules():
        for attr in ("sequence_parallel", "reduce_scatter_embeddings"):
            if getattr(module, attr, None) is True:
                flipped.append((module, attr))
    for holder, attr in flipped:
        setattr(holder, attr, False)
    try:
        yield
    finally:
        for holder, attr in flipped:
            setattr(holder, attr, True)


def _drop_inference_buffers() -> None:
    """Forget megatron's process-wide scratch buffers (``GlobalMemoryBuffer``: the sequence-parallel
    all-gather's among them) that were grown while generating: made under ``torch.inference_mode``,
    they are inference tensors, and the training forward writing into them raises.  Training grows
    its own again on first use."""
    from megatron.core import parallel_state as ps

    buffers = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None)
    if buffers is None:
        return
    for key in [k for k, t in buffers.buffer.items() if t is not None and t.is_inference()]:
        del buffers.buffer[key]


def _clear_rope_cache() -> None:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    RotaryEmbedding.forward.cache_clear()
    YarnRotaryEmbedding.forward.cache_clear()  # its own cache (YaRN models)


@contextlib.contextmanager
def _engine_records_routing(model, context):
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


@functools.lru_cache(maxsize=None)
def _make_wrapper_class():
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.models.gpt import RLGPTModel

    class ActorInferenceWrapper(GPTInferenceWrapper):
        """``GPTInferenceWrapper`` whose last stage turns ``RLGPTModel``'s hidden states into logits
        with ``GPTModel``'s own output step (last tokens only, SP gather, TP gather)."""

        def _forward(self, inference_input):
            from megatron_rl.models.moe import inference_token_map

            model = self.model
            state = getattr(model, "moe_state", None)
            # An idle expert-parallel rank's dummy step (one dummy request with no id) records nothing.
            dummy = getattr(self.inference_context, "_bookkeeping_no_real_work", False)
            recording = state is not None and state.mode == "rollout" and not dummy
            if recording:  # MoE routing recorded for replay: which request and position each token is
                tokens = inference_token_map(self.inference_context, state.rollout_lengths)
                for router in state.routers:
                    router.tokens = tokens
            if not dummy and self.inference_context.is_dynamic_batching():
                # the prompt tokens this step computes (a decode request runs one token)
                ctx = self.inference_context
                self.prefill_tokens += int(ctx.active_token_count) - int(ctx.num_decode_requests)
            try:
                out = super()._forward(inference_input)
            finally:
                if recording:
                    for router in state.routers:
                        router.tokens = None
            if not isinstance(model, RLGPTModel) or not model.post_process:
                return out
            return GPTModel._postprocess(
                model, hidden_states=out, input_ids=None, position_ids=None, labels=None,
                rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None,
                inference_context=self.inference_context, runtime_gather_output=True,
            )

    return ActorInferenceWrapper


def _make_controller_class():
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class SamplingController(TextGenerationController):
        """megatron's controller with the project's sampler, stop rule and log-probs.

        Per request it keeps the response tokens and log-probs on the host (across evictions,
        whose re-prefill re-enters the prompt and the tokens so far)."""

        def begin(self, params: SamplingParams, true_vocab: int, keys: dict[int, int]) -> None:
            # No controller buffer aliases the context's (rebuilt on resume): nothing to re-make.
            self.params, self.true_vocab, self.keys = params, true_vocab, keys
            self.responses: dict[int, list[int]] = {rid: [] for rid in keys}
            self.logprobs: dict[int, list[float]] = {rid: [] for rid in keys}
            # Partial rollouts: the policy version of the weights each token is drawn with.
            # (megatron stamps its own epochs only through its inference coordinator's messages,
            # which this adapter does not run.)
            self.version: Optional[int] = None
            self.versions: dict[int, list[int]] = {rid: [] for rid in keys}
            self._stops = None

        def _dynamic_step_sample_logits(self):
            ctx = self.inference_wrapped_model.inference_context
            n = ctx.total_request_count - ctx.paused_request_count
            # materialize_only_last_token_logits: one row per active request, in slot order
            last = self._all_logits_cuda.squeeze(0)[:n, : self.true_vocab]
            rids = ctx.request_ids[ctx.paused_request_count : ctx.total_request_count].tolist()
            noise = None
            if not self.params.is_greedy:
                keys = torch.tensor([self.keys[r] for r in rids], dtype=torch.long)
                positions = torch.tensor([len(self.responses[r]) for r in rids], dtype=torch.long)
                noise = keyed_exponentials(keys.to(last.device), positions.to(last.device), self.true_vocab)
            tokens, logp = sample(last, self.params, None, noise=noise)
            self._sampled_tokens_cuda[:n] = tokens
            stops = []
            for rid, token, lp in zip(rids, tokens.tolist(), logp.tolist()):
                if rid == ctx.chunked_prefill_request_id:  # a prompt chunk: its token is discarded
                    stops.append(False)
                    continue
                self.responses[rid].append(token)
                self.logprobs[rid].append(lp)
                if self.version is not None:
                    self.versions[rid].append(self.version)
                stops.append(stopped(self.responses[rid], self.params))
            self._stops = torch.tensor(stops, dtype=torch.bool)

        @staticmethod
        def detokenize(tokenizer, tokens, remove_EOD: bool = True, skip_special_tokens: bool = True) -> str:
            # Results leave as ids: the engine detokenizes every finished request's prompt and
            # response, and megatron's version inspects the tokenizer's signature each time.
            return ""

        def _dynamic_step_context_bookkeeping(self):
            # megatron ends a request whose token equals its step's termination id (the host copy
            # of the active slots' metadata): point it at the token just drawn for the requests
            # our stop rule ends, at -1 (never drawn) otherwise.
            ctx = self.inference_wrapped_model.inference_context
            n = ctx.total_request_count - ctx.paused_request_count
            drawn = self._sampled_tokens_cuda[:n].cpu()
            term = ctx.active_request_metadata["termination_id"]
            term[:n] = torch.where(self._stops, drawn, torch.full_like(drawn, -1)).to(term.dtype)
            return super()._dynamic_step_context_bookkeeping()

    return SamplingController


@functools.lru_cache(maxsize=None)
def _request_params_class():
    """megatron's ``SamplingParams`` whose per-request copy is shallow: every request deep-copies its
    parameters (``DynamicInferenceRequest.__post_init__``), about 0.1 ms each on the CPU, and the
    engine only ever reassigns their top-level fields."""
    import copy
    import dataclasses

    from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling

    @dataclasses.dataclass
    class RequestParams(MegatronSampling):
        def __deepcopy__(self, memo):
            return copy.copy(self)

    return RequestParams


def _make_context_class(token_rounder: int):
    """Steps padded to ``token_rounder`` tokens, and a prefill step's requests to at most as many:
    megatron pads them to a multiple of 4, which on the CPU (rounder 1) only adds empty requests."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    request_rounder = min(token_rounder, DynamicInferenceContext.REQUEST_ROUNDER)
    rounders = {"TOKEN_ROUNDER": token_rounder, "REQUEST_ROUNDER": request_rounder}
    return type("PaddedTo%dContext" % token_rounder, (DynamicInferenceContext,), rounders)


class MegatronRolloutEngine:
    """The rollout interface over megatron-core's dynamic inference engine (see the module doc)."""

    def __init__(self, model_cfg: ModelConfig, device="cpu", max_batch_size: int = 64, dtype=None, *,
                 kv_cache_memory: float = 0.4, prefill_chunk_tokens: int = 4096, kv_block_tokens: int = 256,
                 record_routing: bool = False, layout=None,
                 prefix_caching: bool = True, batching: str = "auto", paged_attention: str = "auto",
                 cuda_graphs: Optional[bool] = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model_cfg = model_cfg
        self.device = torch.device(device)
        self.max_requests = max_batch_size
        self.kv_cache_memory = kv_cache_memory
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.kv_block_tokens = kv_block_tokens
        self._model = None  # the actor's RLGPTModel (this rank's TP/PP shard)
        self._own_chunks: Optional[list] = None  # built by load_weights (tests, the generate command)
        self._engine = None
        self._kv_bytes = 0
        self._suspended = False
        # MoE routing replay: the routers record every token's experts while generating; each
        # generate returns them in ``RolloutBatch.routing`` ({layer: [length, topk]} per sample).
        self.record_routing = record_routing
        # rollout.layout (a RolloutLayoutConfig; unset sizes are the training layout's): where it
        # differs from the training layout the engine generates with a model of its own, refit
        # from the actor's chunks before every rollout (megatron_rl/rollout/refit.py).
        self.layout = layout
        self._inference_model = None
        self.last_refit = None  # RefitStats of the latest refit; None while generating in place
        self.prefix_caching = prefix_caching  # prompt pages shared between requests (module doc)
        self.batching = batching  # rollout.batching: dynamic, static, or auto (choice.pick_batching)
        self.last_batching: Optional[str] = None  # what the last generate ran
        # rollout.paged_attention and rollout.cuda_graphs (None: on with CUDA where the kernels allow)
        self.paged_attention = paged_attention
        self.cuda_graphs = cuda_graphs
        self._graphs: Optional[DecodeGraphs] = None  # megatron's per-layer graph managers, while graphed
        # Static batching: prompts left-padded under an attention mask (None: where the model's core
        # attention applies one, static_batching.honours_attention_masks), else aligned at column 0.
        self.static_left_pad: Optional[bool] = None
        self._static_wrapper = None  # static batching's inference wrapper, kept for its model
        self.prefill_tokens = 0  # prompt tokens the last generate computed (shared pages are not)
        self.idle_steps = 0  # the last generate's dummy steps (this expert-parallel rank had no work)
        # megatron's own routing record (``routing_indices``), for comparison only: in megatron-core
        # 0.19.2 it is the same experts as ours wherever it exists, but some requests finish without
        # one (compat: inference.routing_indices_incomplete), so ``RolloutBatch.routing`` stays ours.
        self.megatron_routing = False
        self.megatron_routing_indices: dict = {}  # request id -> [tokens - 1, layers, topk] or None
        # Partial rollouts: weights that may change between two steps (generator ranks, async).
        self.live_weights: Optional[LiveWeights] = None
        self.weight_swaps = 0  # pushes the last generate took mid-rollout

    # -- weights -------------------------------------------------------------------------------
    def inference_layout(self):
        """The :class:`~megatron_rl.planner.memory.RolloutLayout` this engine generates on (the
        training layout's sizes where ``rollout.layout`` leaves them unset)."""
        from megatron_rl.distributed.runtime import active_layout
        from megatron_rl.planner.memory import RolloutLayout

        train = active_layout()
        if train is None:
            raise RuntimeError("rollout.engine=megatron needs megatron's parallel groups (init_model_parallel)")
        return RolloutLayout.filled(self.layout, train)

    def load_from_chunks(self, chunks: list) -> None:
        """Generate with the actor's chunk itself where the inference layout is the training
        layout; else refit the actor's weights into the engine's own model on ``rollout.layout``."""
        from megatron_rl.distributed.runtime import active_layout
        from megatron_rl.models.canonical import unwrap
        from megatron_rl.planner.memory import shares_training_weights
        from megatron_rl.rollout.refit import build_inference_model, refit

        infer = self.inference_layout()
        if not shares_training_weights(infer, active_layout()):
            if self._inference_model is None:
                self._inference_model = build_inference_model(self.model_cfg, infer, active_layout(), self.device)
            self._materialize_inference_weights()
            self.last_refit = refit(chunks, self._inference_model, "nccl" if self.device.type == "cuda" else "gloo")
            if self._model is not self._inference_model:
                self._close()
                self._model = self._inference_model
            return
        self.last_refit = None
        if len(chunks) != 1:
            raise ValueError(
                f"rollout.engine=megatron needs one model chunk per rank, got {len(chunks)} (virtual "
                f"pipeline stages): megatron-core's inference refuses interleaved chunks; the engine "
                f"generates on a model of its own there (rollout.layout)"
            )
        model = unwrap(chunks[0])
        if model is not self._model:
            self._close()
            self._model = model
        if self._own_chunks is not None and unwrap(self._own_chunks[0]) is not model:
            self._own_chunks = None

    def load_weights(self, canonical: dict[str, torch.Tensor]) -> None:
        """Load a canonical state dict into a megatron model of the active layout built for it."""
        from megatron_rl.distributed.runtime import active_layout
        from megatron_rl.models.builder import build_gpt_chunks
        from megatron_rl.models.canonical import load_canonical

        if self._own_chunks is None:
            layout = active_layout()
            if layout is None:
                raise RuntimeError("rollout.engine=megatron needs megatron's parallel groups (init_model_parallel)")
            self._own_chunks = build_gpt_chunks(self.model_cfg, layout, self.device)
            self.load_from_chunks(self._own_chunks)
        load_canonical(self._own_chunks, canonical)

    def release_weights(self) -> None:
        """The KV cache is freed until the next rollout; so are the weights of the engine's own
        model (refit again before the next rollout), while the actor's own shards stay."""
        if self._engine is not None and not self._suspended:
            self._engine.suspend()
            self._suspended = True
        if self._inference_model is not None:
            for tensor in self._inference_model.parameters():
                tensor.untyped_storage().resize_(0)

    def generator_of_this_rank(self):
        """``(generators, this rank's generator, whether it reports)`` on the engine's own layout
        (its data-parallel replicas generate distinct shares); None while it generates in place
        (the training layout's DP x CP ranks are the generators)."""
        if self._model is None or self._model is not self._inference_model:
            return None
        groups = self._model.pg_collection
        return groups.dp.size(), groups.dp.rank(), groups.tp.rank() == 0 and groups.pp.rank() == 0

    def _materialize_inference_weights(self) -> None:
        """Give released weights their storage back (the refit overwrites every value)."""
        for tensor in self._inference_model.parameters():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(tensor.numel() * tensor.element_size())

    def weight_bytes(self) -> int:
        """Bytes of the actor shard this rank generates with (shared with training, not a copy)."""
        if self._model is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self._model.parameters())

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's paged KV cache while allocated (0 before the first rollout)."""
        return 0 if self._engine is None or self._suspended else self._kv_bytes

    # -- the engine ----------------------------------------------------------------------------
    def _close(self) -> None:
        if self._engine is not None and not self._suspended:
            self._engine.suspend()
        self._engine, self._suspended = None, False

    def _build(self):
        from megatron.core.inference.config import (
            InferenceConfig,
            KVCacheManagementMode,
            PrefixCachingEvictionPolicy,
        )
        from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

        model = self._model
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
        own = model is self._inference_model  # the engine's own model: its groups are not megatron's globals
        groups = model.pg_collection
        tp = groups.tp.size()
        rounder = GPU_TOKEN_ROUNDER if self.device.type == "cuda" else CPU_TOKEN_ROUNDER
        token_rounder = math.ceil(rounder / tp) * tp
        max_requests = math.ceil(self.max_requests / tp) * tp
        # Every step's (padded) token count must fit max_tokens: a multiple of the rounder.
        max_tokens = max(self.prefill_chunk_tokens, max_requests)
        max_tokens = math.ceil(max_tokens / token_rounder) * token_rounder
        self._kv_bytes = kv_cache_bytes_for(self.kv_cache_memory, self.device)
        inference_config = InferenceConfig(
            block_size_tokens=self.kv_block_tokens,
            buffer_size_gb=self._kv_bytes / 1024**3,
            max_requests=max_requests,
            max_tokens=max_tokens,
            max_sequence_length=max_positions(self.model_cfg),
            materialize_only_last_token_logits=True,
            use_flashinfer_fused_rope=False,
            unified_memory_level=0,
            enable_chunked_prefill=True,
            # suspend() frees the KV cache (the default, PERSIST, keeps it while the actor trains)
            kv_cache_management_mode=KVCacheManagementMode.RECOMPUTE,
            pg_collection=groups if own else None,
            enable_prefix_caching=self._caching(),
            # A page is shared only while a request holds it: the weights change between rollouts.
            prefix_caching_eviction_policy=PrefixCachingEvictionPolicy.REF_ZERO,
            **self._graph_options(kernels, max_requests),
        )
        # Layers, heads, head size, dtype and TP/PP sizes come from the model's config.
        if not self._graphed(kernels):
            self._graphs = None
        elif self._graphs is None or self._graphs.model is not model:  # one set of managers per model
            self._graphs = DecodeGraphs(model)
        with self._graphs_on():  # megatron reads cuda_graph_impl while it builds, and captures
            context = _make_context_class(rounder)(model_config=config, inference_config=inference_config)
            self._kv_bytes = context.kv_block_allocator.total_count * context.block_size_bytes
            wrapper = _make_wrapper_class()(model, context)
            wrapper.prefill_tokens = 0
            controller = _make_controller_class()(wrapper, _IdsOnly())
            self._engine = DynamicInferenceEngine(controller, context)
        self._suspended = False
        self._cp_group = None if own or groups.cp.size() == 1 else groups.cp
        if self._cp_group is not None:
            _one_rank_group()  # collective: every rank creates the groups now, at the same time

    def paged_kernels(self) -> str:
        """``rollout.paged_attention`` resolved for this device (:mod:`megatron_rl.compat.paged_attention`)."""
        cuda = self.device.type == "cuda"
        name = pick_paged_attention(self.paged_attention, cuda)
        refusal = paged_attention_refusal(name, cuda)
        if refusal:
            raise ValueError(f"rollout.paged_attention={name}: {refusal}")
        return name

    def _graphed(self, kernels: str) -> bool:
        """Whether decode steps replay CUDA graphs (``rollout.cuda_graphs``; None: wherever they can)."""
        from megatron_rl.models.arch import is_moe
        from megatron_rl.rollout.choice import DYNAMIC, cuda_graphs_refusal, pick_cuda_graphs

        facts = dict(cuda=self.device.type == "cuda", batching=DYNAMIC, kernels=kernels, moe=is_moe(self.model_cfg))
        on, _ = pick_cuda_graphs(self.cuda_graphs, **facts)
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

    def _graphs_on(self):
        return self._graphs.attached() if self._graphs is not None else contextlib.nullcontext()

    def _caching(self) -> bool:
        """Prefix caching, unless routing is recorded: a token read from a shared page is not routed."""
        return self.prefix_caching and not self.record_routing

    def _run(self, engine) -> list:
        """Step until every request finished.  Expert-parallel ranks (each with its own share of
        prompts) step together: their MoE layers exchange tokens in every forward, so a rank
        without work runs megatron's dummy forward until all of its EP group are done.

        With PP > 1 every stage of a generator has the same requests (the last stage's logits are
        broadcast to all), so its stages idle on the same steps; an EP group holds one stage of
        several generators, so every stage's group agrees on the same steps, and a dummy forward
        passes its one-token request stage to stage as a real step does."""
        from megatron_rl.distributed import collectives

        groups = self._model.pg_collection
        done = []
        self.idle_steps = self.weight_swaps = 0
        if groups.ep.size() == 1:
            while engine.has_unfinished_requests():
                self._take_pushed_weights(engine)
                done += self._step(engine)
            return done
        group = groups.ep
        while True:
            busy = engine.has_unfinished_requests()
            if not collectives.agree_any(busy, group=group):
                return done
            self._take_pushed_weights(engine)
            if busy:
                done += self._step(engine)
            else:
                engine.controller.dummy_forward()
                self.idle_steps += 1

    @staticmethod
    def _step(engine) -> list:
        """One engine step (a prefill chunk and / or one token per decoding request); the requests
        it finished."""
        return engine.step_modern()["finished_request_records"]

    def _take_pushed_weights(self, engine) -> None:
        """Partial rollouts: before every step, newer weights that have arrived are loaded (in place,
        into the shards the engine runs on) and the requests in flight go on with them.  Their KV
        cache is recomputed under the new weights by megatron's own suspend / resume in ``RECOMPUTE``
        mode (each request's prompt and tokens so far re-prefilled), so every later token is drawn
        from the new policy given the sample so far, and its log-prob is that policy's."""
        live = self.live_weights
        if live is None:
            return
        if live.poll():
            engine.suspend()
            engine.resume()
            self.weight_swaps += 1
        engine.controller.version = live.version

    def batching_now(self) -> str:
        """``dynamic`` or ``static``: how the next generate batches (``rollout.batching`` with
        ``auto`` resolved for this model, device and rollout; :func:`~megatron_rl.rollout.choice.pick_batching`)."""
        from megatron_rl.capabilities import paged_kernels_installed
        from megatron_rl.models.arch import is_moe
        from megatron_rl.rollout.choice import batching_refusal, pick_batching

        facts = dict(moe=is_moe(self.model_cfg), partial=self.live_weights is not None,
                     paged_kernels=self.device.type == "cuda" and paged_kernels_installed())
        picked = pick_batching(self.batching, **facts)
        refusal = batching_refusal(picked, **facts) if picked == STATIC else None
        if refusal:
            raise ValueError(f"rollout.batching=static: {refusal}")
        return picked

    def _generate_static(self, prompt_ids: list[list[int]], params: SamplingParams, samples: list[tuple[int, int]],
                         keys: list[int]) -> RolloutBatch:
        """Every sample through megatron's static-batching inference (:mod:`megatron_rl.rollout.static_batching`),
        ``rollout.max_batch_size`` rows at a time, fewer where a chunk's KV cache would exceed
        ``rollout.kv_cache_memory``."""
        from megatron.core.inference.utils import InferenceMode

        from megatron_rl.rollout.static_batching import generate_static, honours_attention_masks, kv_bytes_per_row

        if not samples:  # a generator whose share of the prompts is empty
            return RolloutBatch([], [], [], [], [])
        model, was_training = self._model, self._model.training
        groups = model.pg_collection
        width = max(len(p) for p in prompt_ids) + params.max_new_tokens
        budget = kv_cache_bytes_for(self.kv_cache_memory, self.device)
        per_row = kv_bytes_per_row(model, width)
        if budget < per_row:
            raise ValueError(
                f"rollout.kv_cache_memory: {budget} bytes hold no sequence of {width} tokens ({per_row} bytes of "
                "KV on this rank); raise rollout.kv_cache_memory or lower rollout.max_new_tokens")
        rows = min(self.max_requests, budget // per_row)
        cp_group = groups.cp if model is not self._inference_model and groups.cp.size() > 1 else None
        def wrapper(m, context):
            """One inference wrapper per model (building one costs about a millisecond), pointed at
            each chunk's context; the model's own groups: an engine-own model's are not megatron's
            globals."""
            context.config.pg_collection = m.pg_collection
            if self._static_wrapper is None or self._static_wrapper.model is not m:
                self._static_wrapper = _make_wrapper_class()(m, context)
            self._static_wrapper.inference_context = context
            return self._static_wrapper

        vocab = getattr(model, "true_vocab_size", None) or self.model_cfg.vocab_size
        left_pad = self.static_left_pad if self.static_left_pad is not None else honours_attention_masks(model)
        responses, logprobs = [], []
        self.prefill_tokens = 0
        model.eval()
        try:
            with _without_context_parallel(model, cp_group), _without_sequence_parallel(model), \
                    InferenceMode.active():
                for start in range(0, len(samples), rows):
                    chunk = samples[start : start + rows]
                    out = generate_static(wrapper, model, prompt_ids, [i for i, _ in chunk],
                                          keys[start : start + rows], params, vocab,
                                          share_prompts=self.prefix_caching, stopped=stopped, left_pad=left_pad)
                    responses += out.responses
                    logprobs += out.logprobs
                    self.prefill_tokens += out.prefill_tokens
        finally:
            InferenceMode.unset_active()
            model.train(was_training)
            _clear_rope_cache()
            _drop_inference_buffers()
        return RolloutBatch(
            prompt_index=[i for i, _ in samples],
            prompt_ids=[list(prompt_ids[i]) for i, _ in samples],
            response_ids=responses,
            response_logprobs=logprobs,
            finish_reason=["stop" if stopped(r, params) else "length" for r in responses],
        )

    @property
    def max_sequence_length(self) -> int:
        return max_positions(self.model_cfg)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int,
                 sample_keys: Optional[list[int]] = None) -> RolloutBatch:
        """``params.n`` samples per prompt; every TP/PP rank of the replica must call it with the
        same arguments (they run one engine together).  ``sample_keys``: one per sample, in place
        of the keys derived from ``seed`` (see RolloutEngine.generate)."""
        from megatron.core.inference.inference_request import Status
        from megatron.core.inference.utils import InferenceMode

        from megatron_rl.models.moe import moe_rollout

        if self._model is None:
            raise RuntimeError("MegatronRolloutEngine.generate called before load_from_chunks / load_weights")
        vocab = self.model_cfg.vocab_size
        for i, prompt in enumerate(prompt_ids):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            if len(prompt) + params.max_new_tokens > self.max_sequence_length:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} exceed "
                    f"the model's {self.max_sequence_length} positions (model.max_position_embeddings, or YaRN's "
                    "factor x original_max_position_embeddings)"
                )
        samples = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]
        if sample_keys is not None and len(sample_keys) != len(samples):
            raise ValueError(f"{len(sample_keys)} sample keys for {len(samples)} samples")
        keys = [sample_keys[rid] if sample_keys is not None else sample_key(derive_seed(seed, i, j))
                for rid, (i, j) in enumerate(samples)]
        self.last_batching = self.batching_now()
        if self.last_batching == STATIC:
            return self._generate_static(prompt_ids, params, samples, keys)
        if self._engine is not None and self._suspended and self.kv_cache_memory <= 1:
            self._engine = None  # a fraction of what is free now: sized again for this rollout
        if self._engine is not None and self._engine.context.enable_prefix_caching != self._caching():
            self._close()  # record_routing or prefix_caching changed since it was built
        install_paged_attention(self.paged_kernels())  # another engine of this process may have changed it
        try:
            if self._engine is None:
                self._build()
            elif self._suspended:
                with self._graphs_on():  # resume captures the graphs again (the KV cache is new)
                    self._engine.resume()
                self._suspended = False
        finally:
            InferenceMode.unset_active()  # building and resuming set it: on only while stepping
        engine, controller = self._engine, self._engine.controller
        blocks = engine.context.kv_block_allocator.active_count
        longest = max(len(p) for p in prompt_ids) + params.max_new_tokens if prompt_ids else 0
        if -(-longest // self.kv_block_tokens) > blocks:
            raise ValueError(
                f"rollout.kv_cache_memory: the KV cache holds {blocks} pages of {self.kv_block_tokens} tokens "
                f"({self._kv_bytes} bytes), fewer than one sequence of {longest} tokens needs; raise "
                f"rollout.kv_cache_memory or lower rollout.max_new_tokens"
            )
        controller.begin(params, getattr(self._model, "true_vocab_size", None) or vocab, dict(enumerate(keys)))
        request = _request_params_class()(num_tokens_to_generate=params.max_new_tokens, termination_id=-1,
                                   return_log_probs=False)
        model, was_training = self._model, self._model.training
        model.eval()
        lengths = {rid: len(prompt_ids[i]) + params.max_new_tokens for rid, (i, _) in enumerate(samples)}
        recording = moe_rollout(model, lengths) if self.record_routing else contextlib.nullcontext({})
        megatron_records = (_engine_records_routing(model, engine.context) if self.megatron_routing
                            else contextlib.nullcontext())
        try:
            with _without_context_parallel(model, self._cp_group), InferenceMode.active(), \
                    recording as routing, megatron_records, self._graphs_on():
                for rid, (i, _) in enumerate(samples):
                    engine.add_request(rid, list(prompt_ids[i]), request)
                wrapper = controller.inference_wrapped_model
                wrapper.prefill_tokens = 0
                done = self._run(engine)
                self.prefill_tokens = wrapper.prefill_tokens
        finally:
            model.train(was_training)
            _clear_rope_cache()  # its tables were made in inference mode: training must not reuse them
            _drop_inference_buffers()  # the same for megatron's scratch buffers
        if self.megatron_routing:
            self.megatron_routing_indices = {r.request_id: r.merge().routing_indices for r in done}
        failed = [r for r in done if r.requests[-1].status == Status.FAILED]
        if failed:
            events = failed[0].requests[-1].events
            raise RuntimeError(f"megatron inference failed request {failed[0].request_id}: {events}")
        responses = [controller.responses[rid] for rid in range(len(samples))]
        recorded = None
        if self.record_routing:  # cut each recording to the sample's prompt + response
            recorded = [{layer: table[: len(prompt_ids[samples[rid][0]]) + len(responses[rid])]
                         for layer, table in routing.get(rid, {}).items()}
                        for rid in range(len(samples))]
        return RolloutBatch(
            prompt_index=[i for i, _ in samples],
            prompt_ids=[list(prompt_ids[i]) for i, _ in samples],
            response_ids=responses,
            response_logprobs=[controller.logprobs[rid] for rid in range(len(samples))],
            finish_reason=["stop" if stopped(r, params) else "length" for r in responses],
            routing=recorded,
            token_versions=([controller.versions[rid] for rid in range(len(samples))]
                            if self.live_weights is not None else None),
        )
