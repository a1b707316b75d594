"""The test oracle decoder (tests/support/decoder.py) against megatron, its KV cache, the sampler,
and the rollout engine contract."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rl.config.schema import ModelConfig, RopeScalingConfig
from megatron_rl.layout.arch import rope_inv_freq
from megatron_rl.rollout.engine import RolloutBatch, RolloutEngine
from megatron_rl.rollout.sampling import SamplingParams, sample, top_k_filter, top_p_filter
from megatron_rl.testing.weights import random_canonical
from tests.support.decoder import KVCache, TorchDecoder, TorchRolloutEngine, left_pad, row_positions

BASE = dict(
    num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
    vocab_size=100, params_dtype="float32", transformer_impl="local",
)
PARITY_CONFIGS = {
    "rmsnorm_swiglu_gqa": {},
    "qk_layernorm_qkv_bias": dict(qk_layernorm=True, add_qkv_bias=True),
    "tied_embeddings": dict(tie_word_embeddings=True),
    "layernorm_gelu": dict(
        normalization="LayerNorm", activation="gelu", num_query_groups=4, add_bias_linear=True
    ),
    "rope_scaling": dict(rope_scaling=RopeScalingConfig(type="llama3", factor=8.0), rotary_base=500000.0),
    # YaRN pretrained on 8 positions, run on 24: frequencies and the attention factor both matter.
    "yarn": dict(rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=8),
                 rotary_base=1e6, max_position_embeddings=8),
    "yarn_mscale": dict(rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=8,
                                                       mscale=0.7, mscale_all_dim=0.3, beta_fast=16.0),
                        rotary_base=1e6, max_position_embeddings=32),
}


def _cfg(**overrides) -> ModelConfig:
    return ModelConfig(**{**BASE, **overrides})


def _decoder(cfg: ModelConfig, seed: int = 0, std: float = 0.2) -> TorchDecoder:
    model = TorchDecoder(cfg)
    model.load_canonical(random_canonical(cfg, seed, std))
    return model.eval()


def _engine(cfg: ModelConfig, seed: int = 0, **kwargs) -> TorchRolloutEngine:
    engine = TorchRolloutEngine(cfg, "cpu", **kwargs)
    engine.load_weights(random_canonical(cfg, seed, std=0.2))
    return engine


PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30], [1], [70, 71, 72, 73, 74]]


# -- megatron parity ---------------------------------------------------------------------------
def megatron_logits_body(model_cfg: ModelConfig, tokens: torch.Tensor, seed: int):
    """In a 1-rank gloo worker: random megatron model -> (canonical weights, logits, inv_freq)."""
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical, load_canonical
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout()
    chunks = build_gpt_chunks(model_cfg, layout, torch.device("cpu"))
    # megatron initialises norms to 1 and biases to 0; randomise every tensor so each is tested.
    state = random_canonical(model_cfg, seed, std=0.2)
    load_canonical(chunks, state)
    chunk = chunks[0].eval()
    b, s = tokens.shape
    positions = torch.arange(s)[None].expand(b, s)
    with torch.no_grad():
        hidden = chunk(tokens, positions, None)  # [s, b, h]
        logits = hidden.float() @ chunk.output_weight().float().t()
    logits = logits[..., : model_cfg.vocab_size].transpose(0, 1).contiguous()
    rope = chunk.rotary_pos_emb
    if model_cfg.rope_scaling.type == "yarn":  # YaRN's frequencies: position 1 of its table
        inv_freq = rope.get_emb(2)[0][1, 0, 0, : rope.dim // 2]
    else:
        inv_freq = rope.inv_freq
    return gather_canonical(chunks), logits, inv_freq.cpu()


@pytest.mark.parametrize("name", list(PARITY_CONFIGS))
def test_decoder_matches_megatron(name):
    from megatron_rl.testing.harness import get_pool

    cfg = _cfg(**PARITY_CONFIGS[name])
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    canonical, ref_logits, ref_inv_freq = get_pool(1).run(megatron_logits_body, cfg, tokens, 3)[0]
    model = TorchDecoder(cfg)
    model.load_canonical(canonical)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.size(1))[None].expand_as(tokens))
    assert torch.equal(model._inv_freq_cpu, ref_inv_freq)
    diff = (logits - ref_logits).abs().max().item()
    print(f"{name}: max |logits - megatron| = {diff:.3e} (logit std {ref_logits.std():.2f})")
    assert diff <= 1e-4


def test_rope_scaling_frequencies():
    inv, _ = rope_inv_freq(128, 500000, ModelConfig())
    scaled, mscale = rope_inv_freq(128, 500000, ModelConfig(rope_scaling=RopeScalingConfig(type="llama3", factor=8.0)))
    assert mscale == 1.0
    wavelen = 2 * torch.pi / inv
    assert torch.equal(scaled[wavelen < 2048], inv[wavelen < 2048])  # high frequencies kept
    assert torch.allclose(scaled[wavelen > 8192], inv[wavelen > 8192] / 8)  # low ones divided
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any() and bool(((scaled[mid] < inv[mid]) & (scaled[mid] > inv[mid] / 8)).all())


# -- decoder -----------------------------------------------------------------------------------
def test_left_padding_matches_unpadded_rows():
    model = _decoder(_cfg(qk_layernorm=True))
    ids, mask, pos = left_pad(PROMPTS)
    with torch.no_grad():
        padded = model(ids, pos, attention_mask=mask)
        for r, p in enumerate(PROMPTS):
            alone = model(torch.tensor([p]), torch.arange(len(p))[None])[0]
            assert torch.allclose(padded[r, mask[r]], alone, atol=1e-5, rtol=0)


def test_kv_cache_greedy_equals_recompute():
    model = _decoder(_cfg())
    steps = 12
    ids, mask, pos = left_pad(PROMPTS)
    with torch.no_grad():
        # Reference: rerun the whole (left-padded) prefix for every new token.
        ref_ids, ref_mask = ids, mask
        for _ in range(steps):
            ref_pos = row_positions(ref_mask)
            nxt = model(ref_ids, ref_pos, attention_mask=ref_mask)[:, -1].argmax(-1)
            ref_ids = torch.cat([ref_ids, nxt[:, None]], 1)
            ref_mask = torch.cat([ref_mask, torch.ones(len(PROMPTS), 1, dtype=torch.bool)], 1)
        # KV cache: prefill once, then one token per step.
        cache = KVCache.for_model(model, len(PROMPTS), ids.size(1) + steps)
        storage = cache.k.data_ptr()
        logits = model(ids, pos, cache, mask, last_only=True)[:, -1]
        next_pos, out = mask.sum(1), []
        for _ in range(steps):
            nxt = logits.argmax(-1)
            out.append(nxt)
            logits = model(nxt[:, None], next_pos[:, None], cache, last_only=True)[:, -1]
            next_pos = next_pos + 1
    assert cache.k.data_ptr() == storage and cache.length == ids.size(1) + steps
    assert torch.equal(torch.stack(out, 1), ref_ids[:, ids.size(1):])
    # The engine (same weights) gives the same tokens.
    engine = _engine(_cfg())
    batch = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=steps), seed=0)
    assert batch.response_ids == ref_ids[:, ids.size(1):].tolist()


def test_load_canonical_is_strict():
    cfg = _cfg()
    state = random_canonical(cfg)
    model = TorchDecoder(cfg)
    broken = dict(state)
    del broken["decoder.layers.1.mlp.linear_fc2.weight"]
    broken["decoder.layers.2.mlp.linear_fc2.weight"] = torch.zeros(1)
    with pytest.raises(KeyError) as err:
        model.load_canonical(broken)
    assert "decoder.layers.1.mlp.linear_fc2.weight" in str(err.value)
    assert "decoder.layers.2.mlp.linear_fc2.weight" in str(err.value)
    with pytest.raises(ValueError, match="linear_proj"):
        bad = {**state, "decoder.layers.0.self_attention.linear_proj.weight": torch.zeros(3, 3)}
        model.load_canonical(bad)
    # A dict gathered from a TransformerEngine model names the fused norms differently.
    te = {k.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"): v
          for k, v in state.items()}
    model.load_canonical(te)
    loaded = model.decoder.layers[0].input_layernorm.weight
    assert torch.equal(loaded, state["decoder.layers.0.input_layernorm.weight"])


# -- sampling ----------------------------------------------------------------------------------
def test_filters():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert torch.isinf(top_k_filter(logits, 2)).tolist() == [[True, False, True, False]]
    assert torch.equal(top_k_filter(logits, 0), logits)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = ~torch.isinf(top_p_filter(probs.log(), 0.75))
    assert kept.tolist() == [[True, True, False, False]]
    assert (~torch.isinf(top_p_filter(probs.log(), 0.1))).sum() == 1  # the top token always stays
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_sample_logprobs_are_unfiltered():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.5, top_k=5, top_p=0.8)
    tokens, logp = sample(logits, params, torch.Generator().manual_seed(1))
    expected = torch.log_softmax(logits / 0.5, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.equal(logp, expected)
    assert bool((logits.gather(-1, tokens[:, None]) >= logits.topk(5).values[:, -1:]).all())


def test_seeded_sampling_is_deterministic():
    engine = _engine(_cfg(), max_batch_size=3)
    params = SamplingParams(max_new_tokens=10, n=2)
    a = engine.generate(PROMPTS, params, seed=7)
    b = engine.generate(PROMPTS, params, seed=7)
    c = engine.generate(PROMPTS, params, seed=8)
    assert a == b
    assert a.response_ids != c.response_ids


def test_top_k_one_is_greedy():
    engine = _engine(_cfg())
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=10), seed=0)
    top1 = engine.generate(PROMPTS, SamplingParams(top_k=1, max_new_tokens=10), seed=123)
    assert greedy.response_ids == top1.response_ids


def test_samples_grouped_by_prompt():
    engine = _engine(_cfg(), max_batch_size=5)
    n = 3
    batch = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=6, n=n), seed=0)
    assert len(batch) == len(PROMPTS) * n
    assert batch.prompt_index == [i for i in range(len(PROMPTS)) for _ in range(n)]
    for i, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], SamplingParams(greedy=True, max_new_tokens=6), seed=0)
        for j in range(n):
            assert batch.prompt_ids[i * n + j] == prompt
            assert batch.response_ids[i * n + j] == alone.response_ids[0]


def _first_end(response, seq):
    for end in range(len(seq), len(response) + 1):
        if tuple(response[end - len(seq):end]) == tuple(seq):
            return end
    raise AssertionError("sequence not found")


def test_stop_token_sequence_and_length():
    engine = _engine(_cfg())
    free = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=8), seed=0)
    assert free.finish_reason == ["length"] * len(PROMPTS)
    assert all(len(r) == 8 for r in free.response_ids)
    row = free.response_ids[1]

    stop_tok = row[3]
    by_token = engine.generate(
        PROMPTS, SamplingParams(greedy=True, max_new_tokens=8, stop_token_ids=(stop_tok,)), seed=0
    )
    assert by_token.response_ids[1] == row[: row.index(stop_tok) + 1]
    assert by_token.finish_reason[1] == "stop"

    seq = tuple(row[4:6])
    by_seq = engine.generate(
        PROMPTS, SamplingParams(greedy=True, max_new_tokens=8, stop_sequences=(seq,)), seed=0
    )
    assert by_seq.response_ids[1] == row[: _first_end(row, seq)]
    assert by_seq.finish_reason[1] == "stop"
    for r, resp in enumerate(by_seq.response_ids):  # other rows stop only if they contain seq
        full = free.response_ids[r]
        if by_seq.finish_reason[r] == "length":
            assert resp == full
        else:
            assert resp == full[: _first_end(full, seq)]


def test_rows_finishing_at_different_times(monkeypatch):
    """Rows that stop early leave the batch (KV cache rows dropped); the others are unaffected."""
    engine = _engine(_cfg(), max_batch_size=8)
    long = SamplingParams(greedy=True, max_new_tokens=10)
    free = engine.generate(PROMPTS, long, seed=0).response_ids
    stops = (free[0][1], free[2][2], free[3][0])
    params = dataclasses.replace(long, stop_token_ids=stops)
    kept = []
    original_keep = KVCache.keep
    monkeypatch.setattr(
        KVCache, "keep", lambda self, rows: kept.append(len(rows)) or original_keep(self, rows)
    )
    batch = engine.generate(PROMPTS, params, seed=0)
    assert kept, "no finished rows were dropped"
    for r, full in enumerate(free):
        ends = [i + 1 for i, t in enumerate(full) if t in stops]
        assert batch.response_ids[r] == (full[: ends[0]] if ends else full)
        assert batch.finish_reason[r] == ("stop" if ends else "length")
        assert engine.generate([PROMPTS[r]], params, seed=0).response_ids[0] == batch.response_ids[r]
    assert sum(reason == "stop" for reason in batch.finish_reason) >= 3


def test_response_logprobs_match_full_forward():
    cfg = _cfg(qk_layernorm=True)
    engine = _engine(cfg, max_batch_size=4)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, n=2,
                            stop_token_ids=(3, 4))
    batch = engine.generate(PROMPTS, params, seed=5)
    worst = 0.0
    with torch.no_grad():
        for prompt, resp, logp in zip(batch.prompt_ids, batch.response_ids, batch.response_logprobs):
            seq = torch.tensor([prompt + resp])
            logits = engine.model(seq, torch.arange(seq.size(1))[None])[0]
            ref = torch.log_softmax(logits[len(prompt) - 1 : -1] / 0.7, -1)
            ref = ref.gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
            worst = max(worst, (ref - torch.tensor(logp)).abs().max().item())
    print(f"max |engine logprob - full forward| = {worst:.2e}")
    assert worst <= 1e-5


def test_released_weights_free_their_memory_and_reload():
    """Between rollouts the engine's weights hold no memory; reloaded, it samples the same."""
    cfg = _cfg()
    engine = _engine(cfg)
    params = SamplingParams(max_new_tokens=8, n=2)
    before = engine.generate(PROMPTS, params, seed=3)
    engine.release_weights()
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.model.state_dict().values())
    with pytest.raises(RuntimeError, match="before load_weights"):
        engine.generate(PROMPTS, params, seed=3)
    engine.load_weights(random_canonical(cfg, 0, std=0.2))
    assert engine.generate(PROMPTS, params, seed=3) == before


def test_engine_interface():
    engine = _engine(_cfg())
    assert isinstance(engine, RolloutEngine)
    assert type(engine) is TorchRolloutEngine
    with pytest.raises(RuntimeError):
        TorchRolloutEngine(_cfg()).generate([[1]], SamplingParams(), seed=0)
    with pytest.raises(ValueError):
        engine.generate([[]], SamplingParams(), seed=0)
    fields = {f.name for f in dataclasses.fields(RolloutBatch)}
    assert fields == {"prompt_index", "prompt_ids", "response_ids", "response_logprobs", "finish_reason", "routing",
                      "token_versions", "response_mask", "env_info"}
