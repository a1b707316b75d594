"""The rollout interface over megatron-core's inference (see the package doc): which weights
(:mod:`.weights`), and how the samples are batched (:mod:`.dynamic`, :mod:`.static`)."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.layout.arch import max_positions
from megatron_rl.rollout.choice import STATIC
from megatron_rl.rollout.engine import GeneratorPlace, LiveWeights, RolloutBatch
from megatron_rl.rollout.megatron.dynamic import DynamicBatching
from megatron_rl.rollout.megatron.static import StaticBatching
from megatron_rl.rollout.megatron.weights import EngineWeights
from megatron_rl.rollout.sampling import SamplingParams, sample_key
from megatron_rl.utils.seeds import derive_seed


class MegatronRolloutEngine:
    """The rollout interface over megatron-core's dynamic engine or its static batching."""

    def __init__(self, model_cfg: ModelConfig, device="cpu", max_batch_size: int = 64, dtype=None, *,
                 kv_cache_memory: float = 0.4, prefill_chunk_tokens: int = 4096, kv_block_tokens: int = 256,
                 record_routing: bool = False, layout=None,
                 prefix_caching: bool = True, batching: str = "auto", paged_attention: str = "auto",
                 cuda_graphs: Optional[bool] = None, lora=None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model_cfg = model_cfg
        self.device = torch.device(device)
        self.max_requests = max_batch_size
        self.kv_cache_memory = kv_cache_memory
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.kv_block_tokens = kv_block_tokens
        # MoE routing replay: the routers record every token's experts while generating; each
        # generate returns them in ``RolloutBatch.routing`` ({layer: [length, topk]} per sample).
        self.record_routing = record_routing
        self.prefix_caching = prefix_caching  # prompt pages shared between requests (package doc)
        self.batching = batching  # rollout.batching: dynamic, static, or auto (choice.pick_batching)
        self.last_batching: Optional[str] = None  # what the last generate ran
        # rollout.paged_attention and rollout.cuda_graphs (None: on with CUDA where the kernels allow)
        self.paged_attention = paged_attention
        self.cuda_graphs = cuda_graphs
        # Static batching: prompts left-padded under an attention mask (None: where the model's core
        # attention applies one, static_batching.honours_attention_masks), else aligned at column 0.
        self.static_left_pad: Optional[bool] = None
        self.prefill_tokens = 0  # prompt tokens the last generate computed (shared pages are not)
        # megatron's own routing record (``routing_indices``), for comparison only: in megatron-core
        # 0.19.2 it is the same experts as ours wherever it exists, but some requests finish without
        # one (compat: inference.routing_indices_incomplete), so ``RolloutBatch.routing`` stays ours.
        self.megatron_routing = False
        # Partial rollouts: weights that may change between two steps (generator ranks, async).
        self.live_weights: Optional[LiveWeights] = None
        # lora: the actor's LoRAConfig, for the adapters of a model of its own (rollout.layout)
        self.weights = EngineWeights(model_cfg, self.device, layout, lora=lora)
        self.dynamic = DynamicBatching(self)
        self.static = StaticBatching(self)

    # -- what the batching parts report -----------------------------------------------------------
    @property
    def last_refit(self):
        """RefitStats of the latest refit; None while generating in place."""
        return self.weights.last_refit

    @property
    def idle_steps(self) -> int:
        """The last generate's dummy steps (this expert-parallel rank had no work)."""
        return self.dynamic.idle_steps

    @property
    def weight_swaps(self) -> int:
        """Pushes the last generate took mid-rollout."""
        return self.dynamic.weight_swaps

    @property
    def megatron_routing_indices(self) -> dict:
        """Request id -> megatron's own routing record, with ``megatron_routing`` on."""
        return self.dynamic.megatron_routing_indices

    # -- weights ----------------------------------------------------------------------------------
    def inference_layout(self):
        return self.weights.inference_layout()

    def load_from_chunks(self, chunks: list) -> None:
        """Generate with the actor's chunk itself where the inference layout is the training
        layout; else refit the actor's weights into the engine's own model on ``rollout.layout``."""
        if self.weights.place(chunks):
            self.dynamic.close()  # built for the model it generated with before

    def load_weights(self, canonical: dict[str, torch.Tensor]) -> None:
        """Load a canonical state dict into a megatron model of the active layout built for it."""
        from megatron_rl.models.canonical import load_canonical

        built = self.weights.own_chunks_for_canonical()
        if built is not None:
            self.load_from_chunks(built)
        load_canonical(self.weights.own_chunks, canonical)

    def release_weights(self) -> None:
        """The KV cache is freed until the next rollout; so are the weights of the engine's own
        model (refit again before the next rollout), while the actor's own shards stay."""
        self.dynamic.suspend()
        self.weights.release()

    def generator_of_this_rank(self) -> Optional[GeneratorPlace]:
        """Where the engine generates on a model of its own, its data-parallel replicas are the
        generators (:func:`megatron_rl.rollout.dp.generator_of_groups`); None while it generates in place."""
        from megatron_rl.rollout.dp import generator_of_groups

        groups = self.weights.own_layout_groups()
        return None if groups is None else generator_of_groups(groups)

    def weight_bytes(self) -> int:
        """Bytes of the actor shard this rank generates with (shared with training, not a copy)."""
        return self.weights.weight_bytes()

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's paged KV cache while allocated (0 before the first rollout)."""
        return self.dynamic.kv_cache_bytes()

    # -- generating -------------------------------------------------------------------------------
    def batching_now(self) -> str:
        """``dynamic`` or ``static``: how the next generate batches (``rollout.batching`` with
        ``auto`` resolved for this model, device and rollout; :func:`~megatron_rl.rollout.choice.pick_batching`)."""
        from megatron_rl.capabilities import paged_kernels_installed
        from megatron_rl.layout.arch import is_moe
        from megatron_rl.rollout.choice import batching_refusal, pick_batching

        facts = dict(moe=is_moe(self.model_cfg), partial=self.live_weights is not None,
                     paged_kernels=self.device.type == "cuda" and paged_kernels_installed())
        picked = pick_batching(self.batching, **facts)
        refusal = batching_refusal(picked, **facts) if picked == STATIC else None
        if refusal:
            raise ValueError(f"rollout.batching=static: {refusal}")
        return picked

    @property
    def max_sequence_length(self) -> int:
        return max_positions(self.model_cfg)

    def _check_prompts(self, prompt_ids: list[list[int]], params: SamplingParams) -> None:
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

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int,
                 sample_keys: Optional[list[int]] = None) -> RolloutBatch:
        """``params.n`` samples per prompt; every TP/PP rank of the replica must call it with the
        same arguments (they run one engine together).  ``sample_keys``: one per sample, in place
        of the keys derived from ``seed`` (see RolloutEngine.generate)."""
        if self.weights.model is None:
            raise RuntimeError("MegatronRolloutEngine.generate called before load_from_chunks / load_weights")
        self._check_prompts(prompt_ids, params)
        samples = [(i, j) for i in range(len(prompt_ids)) for j in range(params.n)]
        if sample_keys is not None and len(sample_keys) != len(samples):
            raise ValueError(f"{len(sample_keys)} sample keys for {len(samples)} samples")
        keys = [sample_keys[rid] if sample_keys is not None else sample_key(derive_seed(seed, i, j))
                for rid, (i, j) in enumerate(samples)]
        self.last_batching = self.batching_now()
        part = self.static if self.last_batching == STATIC else self.dynamic
        batch = part.generate(self.weights.model, prompt_ids, params, samples, keys, self.model_cfg.vocab_size)
        self.prefill_tokens = part.prefill_tokens
        return batch
