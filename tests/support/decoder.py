"""A plain-PyTorch decoder of the actor's weights: a test oracle, not a generator.

megatron-core's inference generates in the product (``megatron_rl/rollout/megatron/``).
This second implementation of the model's math -- written independently of megatron-core, and
checked against megatron's forward (``tests/test_rollout.py``) -- is kept for tests that want a
reference generator that shares no code with the engine: the multi-turn and generator-rank tests
score with it, and its KV cache and left-padding are checked on their own.

Its tree mirrors the canonical names (TP=1/PP=1 names and shapes, true vocabulary size; see
:mod:`megatron_rl.models.canonical`), so loading is a key-for-key copy; :class:`TensorParallel`
can also hold one TP shard in megatron's split (the forward then runs the all-reduces).

The math follows megatron-core's GPT with the local layer spec: pre-norm blocks; norms in fp32;
fused QKV grouped per KV group; q/k norm per head before RoPE; rotate-half RoPE (Llama-3 or YaRN
scaling); causal GQA attention with scale 1/sqrt(head_dim); SwiGLU or gelu MLP.  Batches are
left-padded (:func:`left_pad`), positions counted from each row's first real token.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_rl.config.schema import ModelConfig
from megatron_rl.layout.arch import (
    ACTIVATIONS,
    NORMALIZATIONS,
    attention_dims,
    fp32_norm,
    local_norm_name,
    resolve_dtype,
    rope_inv_freq,
)
from megatron_rl.rollout.engine import LiveWeights, RolloutBatch, RolloutEngineBase, stopped
from megatron_rl.rollout.sampling import SamplingParams, keyed_exponentials, sample


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Which shard of the weights this decoder holds, in megatron's own TP split.

    ``size == 1`` is the whole model and no collective runs.  Otherwise attention heads, KV groups
    and the MLP's hidden units are split in contiguous blocks, the gated MLP input holds
    ``[gate_r; up_r]``, and the embedding / output layer hold rows ``[r*V/size, (r+1)*V/size)`` of
    the vocabulary padded to ``padded_vocab`` -- exactly the tensors megatron's TP rank ``r``
    holds (the split rule of :mod:`megatron_rl.models.canonical`), so they load without any
    reshuffling.
    """

    size: int = 1
    rank: int = 0
    group: Any = None
    padded_vocab: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def first_rank_draw(self, tokens: torch.Tensor, logprobs: torch.Tensor):
        """TP rank 0's sampled ``(tokens, logprobs)`` on every rank, so all shards continue the
        same sequences."""
        if self.size == 1:
            return tokens, logprobs
        # float64 holds every token id exactly; one broadcast carries both.
        both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])
        dist.broadcast(both, src=dist.get_global_rank(self.group, 0), group=self.group)
        return both[0].long(), both[1].to(logprobs.dtype)


WHOLE_MODEL = TensorParallel()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class KVCache:
    """Preallocated keys/values ``[layers, batch, kv_heads, max_len, head_dim]``.

    All rows share one write offset (``length``): a left-padded batch advances in lock step, and
    ``valid[b, t]`` records whether slot ``t`` of row ``b`` holds a real token.  Decoding writes
    into slices, so no step reallocates; only :meth:`keep` (dropping finished rows) copies.
    """

    def __init__(self, num_layers, batch, kv_heads, max_len, head_dim, dtype, device):
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.length = 0

    @classmethod
    def for_model(cls, model: "TorchDecoder", batch: int, max_len: int) -> "KVCache":
        p = model.embedding.word_embeddings.weight
        return cls(model.num_layers, batch, model.num_kv_heads, max_len, model.head_dim, p.dtype, p.device)

    @property
    def max_len(self) -> int:
        return self.k.size(3)

    @property
    def batch(self) -> int:
        return self.k.size(1)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` (in that order), freeing the others."""
        self.k = self.k.index_select(1, rows)
        self.v = self.v.index_select(1, rows)
        self.valid = self.valid.index_select(0, rows)


class _Norm(nn.Module):
    """RMSNorm / LayerNorm with the trainer's math (:func:`~megatron_rl.layout.arch.fp32_norm`)."""

    def __init__(self, size: int, kind: str, eps: float, dtype):
        super().__init__()
        if kind not in NORMALIZATIONS:
            raise ValueError(f"normalization {kind!r} is not supported")
        self.rms, self.eps = kind == "RMSNorm", eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_norm(x, self.weight, self.bias, self.eps, self.rms)


class _RowParallelLinear(nn.Linear):
    """``nn.Linear`` whose input features are split over TP: partial products are summed over
    the group and the (replicated) bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, tp: TensorParallel):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class _VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the (padded) vocabulary; other ids contribute zeros to the TP sum."""

    def __init__(self, rows: int, hidden: int, dtype, tp: TensorParallel):
        super().__init__(rows, hidden, dtype=dtype)
        self.tp, self.start = tp, tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[..., None], 0))


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, heads: int, groups: int, head_dim: int, dtype,
                 tp: TensorParallel = WHOLE_MODEL):
        super().__init__()
        heads, groups = heads // tp.size, groups // tp.size  # this rank's heads and KV groups
        self.heads, self.groups, self.head_dim = heads, groups, head_dim
        qkv_out = (heads + 2 * groups) * head_dim
        self.linear_qkv = nn.Linear(
            cfg.hidden_size, qkv_out, bias=cfg.add_bias_linear or cfg.add_qkv_bias, dtype=dtype
        )
        if cfg.qk_layernorm:
            self.q_layernorm = _Norm(head_dim, cfg.normalization, cfg.norm_epsilon, dtype)
            self.k_layernorm = _Norm(head_dim, cfg.normalization, cfg.norm_epsilon, dtype)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.linear_proj = _RowParallelLinear(heads * head_dim, cfg.hidden_size, cfg.add_bias_linear, dtype, tp)

    def forward(self, x, cos, sin, mask, cache: Optional[KVCache], layer: int):
        b, s, _ = x.shape
        per_group = self.heads // self.groups
        qkv = self.linear_qkv(x).view(b, s, self.groups, (per_group + 2) * self.head_dim)
        q, k, v = qkv.split([per_group * self.head_dim, self.head_dim, self.head_dim], dim=-1)
        q = q.reshape(b, s, self.heads, self.head_dim)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        # [b, s, n, d] -> [b, n, s, d]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            start = cache.length
            cache.k[layer, :, :, start : start + s] = k
            cache.v[layer, :, :, start : start + s] = v
            k, v = cache.k[layer, :, :, : start + s], cache.v[layer, :, :, : start + s]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.head_dim**-0.5,
            enable_gqa=self.heads != self.groups,
        )
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype, tp: TensorParallel = WHOLE_MODEL):
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(f"activation {cfg.activation!r} is not supported")
        self.gated, self.activation = ACTIVATIONS[cfg.activation]  # what megatron is built with
        ffn = cfg.ffn_hidden_size // tp.size
        fc1_out = ffn * (2 if self.gated else 1)
        self.linear_fc1 = nn.Linear(cfg.hidden_size, fc1_out, bias=cfg.add_bias_linear, dtype=dtype)
        self.linear_fc2 = _RowParallelLinear(ffn, cfg.hidden_size, cfg.add_bias_linear, dtype, tp)

    def forward(self, x):
        h = self.linear_fc1(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.activation(gate) * up
        else:
            h = self.activation(h)
        return self.linear_fc2(h)


class _Layer(nn.Module):
    def __init__(self, cfg, heads, groups, head_dim, dtype, tp: TensorParallel = WHOLE_MODEL):
        super().__init__()
        self.input_layernorm = _Norm(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, dtype)
        self.self_attention = _Attention(cfg, heads, groups, head_dim, dtype, tp)
        self.pre_mlp_layernorm = _Norm(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, dtype)
        self.mlp = _MLP(cfg, dtype, tp)

    def forward(self, x, cos, sin, mask, cache, layer):
        x = x + self.self_attention(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.pre_mlp_layernorm(x))


class TorchDecoder(nn.Module):
    """The actor as a plain ``nn.Module`` whose ``state_dict`` keys are the canonical names.

    With ``tp.size > 1`` it holds one TP rank's shard (see :class:`TensorParallel`) and its
    forward runs the matching all-reduces; the logits it returns are still the full vocabulary.
    """

    def __init__(self, model_cfg: ModelConfig, dtype: torch.dtype = torch.float32, tp: TensorParallel = WHOLE_MODEL):
        super().__init__()
        cfg = self.cfg = model_cfg
        heads, groups, head_dim = attention_dims(cfg)
        if heads % groups:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_query_groups={groups}")
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
        if tp.size > 1:
            for what, n in (("num_query_groups", groups), ("ffn_hidden_size", cfg.ffn_hidden_size),
                            ("padded vocabulary", tp.padded_vocab)):
                if n % tp.size:
                    raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {tp.size}")
        self.tp = tp
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_layers, groups // tp.size, head_dim
        # Megatron pads the vocabulary (to a multiple of make_vocab_size_divisible_by * TP); a
        # decoder built for its shards holds the padded rows and drops their logits.
        vocab_rows = tp.padded_vocab // tp.size if tp.padded_vocab else cfg.vocab_size
        self.embedding = nn.Module()
        self.embedding.word_embeddings = _VocabParallelEmbedding(vocab_rows, cfg.hidden_size, dtype, tp)
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            _Layer(cfg, heads, groups, head_dim, dtype, tp) for _ in range(cfg.num_layers)
        )
        self.decoder.final_layernorm = _Norm(cfg.hidden_size, cfg.normalization, cfg.norm_epsilon, dtype)
        self.output_layer = None
        if not cfg.tie_word_embeddings:
            self.output_layer = nn.Linear(cfg.hidden_size, vocab_rows, bias=False, dtype=dtype)
        # Same base value the trainer's builder hands to megatron (an int).  Kept off the module's
        # buffers so that ``.to(bfloat16)`` can never round it.
        # YaRN's attention factor multiplies cos and sin, as megatron-core and HF apply it.
        self._inv_freq_cpu, self._rope_mscale = rope_inv_freq(head_dim, int(cfg.rotary_base), cfg)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    # -- weights -----------------------------------------------------------------------------
    @torch.no_grad()
    def load_canonical(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a canonical state dict in (cast to this module's dtype and device); strict."""
        state = {local_norm_name(name): t for name, t in state.items()}
        expected = self.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise KeyError(
                f"canonical state does not match the model config: missing {missing}, unexpected {unexpected}"
            )
        bad = [
            f"{n}: {tuple(state[n].shape)} != {tuple(p.shape)}"
            for n, p in expected.items()
            if tuple(state[n].shape) != tuple(p.shape)
        ]
        if bad:
            raise ValueError("canonical tensor shapes do not match the model config: " + "; ".join(bad))
        self.load_state_dict(state, strict=True)

    def output_weight(self) -> torch.Tensor:
        if self.output_layer is None:  # tied embeddings
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    # -- forward -----------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, dtype: torch.dtype):
        inv = self._inv_freq.get(positions.device)
        if inv is None:
            inv = self._inv_freq[positions.device] = self._inv_freq_cpu.to(positions.device)
        freqs = positions.float()[..., None] * inv  # [b, s, d/2], fp32 like megatron
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, s, d]
        return (emb.cos() * self._rope_mscale).to(dtype), (emb.sin() * self._rope_mscale).to(dtype)

    @staticmethod
    def _mask(attention_mask, cache: Optional[KVCache], b: int, s: int, device) -> Optional[torch.Tensor]:
        """``[b, 1, s, keys]`` boolean: causal, real keys only, and always the query itself.

        The diagonal keeps an all-pad query row finite; no real token ever attends to it.
        """
        past = cache.length if cache is not None else 0
        if attention_mask is None:
            new_valid = torch.ones(b, s, dtype=torch.bool, device=device)
        else:
            new_valid = attention_mask.bool()
        if cache is not None:
            if past + s > cache.max_len:
                raise ValueError(f"KV cache full: {past} + {s} tokens > max_len {cache.max_len}")
            cache.valid[:, past : past + s] = new_valid
            keys_valid = cache.valid[:, : past + s]
        elif attention_mask is None:
            return None  # plain causal attention
        else:
            keys_valid = new_valid
        key_pos = torch.arange(past + s, device=device)
        query_pos = torch.arange(past, past + s, device=device)[:, None]
        mask = (keys_valid[:, None, :] & (key_pos <= query_pos)) | (key_pos == query_pos)
        return mask[:, None]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: Optional[KVCache] = None,
        attention_mask: Optional[torch.Tensor] = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """fp32 logits ``[b, s, vocab]`` (``[b, 1, vocab]`` with ``last_only``).

        ``input_ids``/``positions``: ``[b, s]``; ``attention_mask``: ``[b, s]``, true for real
        tokens of this input (cached slots keep their own validity).  With ``kv_cache`` the new
        keys/values are written at ``kv_cache.length`` and the cache advances by ``s``.
        """
        b, s = input_ids.shape
        x = self.embedding.word_embeddings(input_ids)
        cos, sin = self._rope(positions, x.dtype)
        mask = self._mask(attention_mask, kv_cache, b, s, input_ids.device)
        for i, layer in enumerate(self.decoder.layers):
            x = layer(x, cos, sin, mask, kv_cache, i)
        if kv_cache is not None:
            kv_cache.length += s
        if last_only:
            x = x[:, -1:]
        x = self.decoder.final_layernorm(x)
        logits = F.linear(x, self.output_weight()).float()
        # vocab-parallel -> full vocabulary, padding rows dropped
        return self.tp.all_gather_last(logits)[..., : self.cfg.vocab_size]


def row_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions of a left-padded batch: counted from each row's first real token (0 on pads)."""
    return (attention_mask.long().cumsum(1) - 1).clamp_min(0)


def left_pad(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask, positions)``, each ``[len(prompts), longest]`` on the CPU:
    prompts right-aligned, so the last token of every row is real and generation appends to all
    rows at the same offset."""
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, longest - len(p):] = torch.tensor(p)
        mask[r, longest - len(p):] = True
    return ids, mask, row_positions(mask)


class TorchRolloutEngine(RolloutEngineBase):
    """KV-cached generation with :class:`TorchDecoder` (the rollout engine interface), ``max_batch_size``
    rows per pass: left-padded prompts prefilled in one forward, then one token per unfinished row a
    step; once at most half of the rows run, the finished ones are dropped."""

    def __init__(self, model_cfg: ModelConfig, device="cpu", max_batch_size: int = 64, dtype=None,
                 tp: TensorParallel = WHOLE_MODEL):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        dtype = dtype or resolve_dtype(model_cfg.params_dtype, self.device)
        # Built without initialising weights: load_weights() provides every tensor.
        with torch.device("meta"):
            model = TorchDecoder(model_cfg, dtype=dtype, tp=tp)
        self.model = model.to_empty(device=self.device).eval().requires_grad_(False)
        self._loaded = False
        # Partial rollouts: weights that can change between two tokens; None = fixed per rollout.
        self.live_weights: Optional[LiveWeights] = None

    def load_weights(self, canonical: dict[str, torch.Tensor]) -> None:
        self._materialize()
        self.model.load_canonical(canonical)
        self._loaded = True

    def load_from_chunks(self, chunks: list) -> None:
        """Load the actor's current weights from its megatron chunks (any layout): gathered into
        one full canonical copy on every rank."""
        from megatron_rl.models.canonical import gather_canonical  # megatron's groups

        self.load_weights(gather_canonical(chunks))

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds for generation (while loaded)."""
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def release_weights(self) -> None:
        """Free the weights' device memory until the next load.

        The trainer reloads the actor's weights before every rollout, so between rollouts they are
        dead weight: released, training has the memory the planner counts for it."""
        for tensor in self.model.state_dict().values():
            tensor.untyped_storage().resize_(0)
        self._loaded = False

    def _materialize(self) -> None:
        """Give released weights their storage back (contents are overwritten by the load)."""
        for tensor in self.model.state_dict().values():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(tensor.numel() * tensor.element_size())

    @torch.inference_mode()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, seed: int,
                 sample_keys: Optional[list[int]] = None) -> RolloutBatch:
        if not self._loaded:
            raise RuntimeError("TorchRolloutEngine.generate called before load_weights")
        vocab = self.model.cfg.vocab_size
        for i, prompt in enumerate(prompt_ids):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        samples = [(i, list(p)) for i, p in enumerate(prompt_ids) for _ in range(params.n)]
        if sample_keys is not None and len(sample_keys) != len(samples):
            raise ValueError(f"{len(sample_keys)} sample keys for {len(samples)} samples")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        responses, logprobs, reasons, versions = [], [], [], []
        for start in range(0, len(samples), self.max_batch_size):
            prompts = [p for _, p in samples[start : start + self.max_batch_size]]
            keys = sample_keys[start : start + self.max_batch_size] if sample_keys is not None else None
            r, lp, why, v = self._generate_batch(prompts, params, generator, keys)
            responses += r
            logprobs += lp
            reasons += why
            versions += v
        return RolloutBatch(
            prompt_index=[i for i, _ in samples],
            prompt_ids=[p for _, p in samples],
            response_ids=responses,
            response_logprobs=logprobs,
            finish_reason=reasons,
            token_versions=versions if self.live_weights is not None else None,
        )

    def _prefill(self, sequences: list[list[int]], new_tokens: int):
        """Logits of the next token of every sequence, the KV cache holding them with room for
        ``new_tokens`` more, and the position of each next token."""
        ids, mask, positions = (t.to(self.device) for t in left_pad(sequences))
        cache = KVCache.for_model(self.model, ids.shape[0], ids.shape[1] + new_tokens)
        logits = self.model(ids, positions, cache, mask, last_only=True)[:, -1]
        return logits, cache, mask.sum(1)

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, generator, keys=None):
        dev = self.device
        b = len(prompts)
        logits, cache, next_pos = self._prefill(prompts, params.max_new_tokens)

        responses: list[list[int]] = [[] for _ in range(b)]
        logprobs: list[list[float]] = [[] for _ in range(b)]
        versions: list[list[int]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        rows = list(range(b))  # batch row -> sample; shrinks when finished rows are dropped
        live = self.live_weights
        for step in range(params.max_new_tokens):
            if live is not None and live.poll():
                # Newer weights arrived: the running samples go on with them.  Their KV cache is
                # recomputed with the new weights, so every later token is drawn from the new
                # policy given the sample so far, and its log-prob is that policy's.
                rows = [s for s in rows if reasons[s] != "stop"]
                logits, cache, next_pos = self._prefill([prompts[s] + responses[s] for s in rows],
                                                        params.max_new_tokens - step)
            noise = None
            if keys is not None:
                noise = keyed_exponentials(torch.tensor([keys[s] for s in rows], device=dev),
                                           torch.tensor([len(responses[s]) for s in rows], device=dev),
                                           logits.shape[-1])
            tokens, token_logp = self.model.tp.first_rank_draw(*sample(logits, params, generator, noise))
            running = []
            for r, (s, tok, lp) in enumerate(zip(rows, tokens.tolist(), token_logp.tolist())):
                if reasons[s] == "stop":
                    continue
                responses[s].append(tok)
                logprobs[s].append(lp)
                if live is not None:
                    versions[s].append(live.version)
                if stopped(responses[s], params):
                    reasons[s] = "stop"
                else:
                    running.append(r)
            if not running or step + 1 == params.max_new_tokens:
                break
            if 2 * len(running) <= len(rows):
                keep = torch.tensor(running, device=dev)
                cache.keep(keep)
                tokens, next_pos = tokens[keep], next_pos[keep]
                rows = [rows[r] for r in running]
                step_mask = None
            else:
                step_mask = torch.zeros(len(rows), 1, dtype=torch.bool)
                step_mask[running] = True
                step_mask = step_mask.to(dev)
            logits = self.model(tokens[:, None], next_pos[:, None], cache, step_mask, last_only=True)[:, -1]
            next_pos = next_pos + 1
        return responses, logprobs, reasons, versions
