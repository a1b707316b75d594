"""LoRA in generation: the engine's model of its own (``rollout.layout``) and the generator ranks
carry the actor's adapters, so they generate what the actor in place generates, not the base; the
base is frozen, so refits and pushes after the first move the adapter tensors alone."""

from __future__ import annotations

import pytest

from megatron_rl.testing.harness import run_distributed

CFG = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
           vocab_size=100, params_dtype="float32", transformer_impl="local", max_position_embeddings=96)
LORA = dict(rank=2, alpha=8.0, target_modules=["all-linear"])
PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 8, 30], [1], [70, 71, 72, 73, 74]]
ENGINE = dict(max_batch_size=8, kv_cache_memory=2**22, prefill_chunk_tokens=16, kv_block_tokens=16,
              batching="dynamic")


def generate_body(train_kw: dict, infer_kw: dict) -> dict:
    """Greedy responses of a LoRA actor on ``train_kw``: in place, and on an engine of its own on
    ``infer_kw`` (twice: before and after the adapters change); with the refits' bytes."""
    import torch

    from megatron_rl.config.schema import LoRAConfig, ModelConfig, RolloutLayoutConfig
    from megatron_rl.layout.lora import adapter_params
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import load_canonical
    from megatron_rl.models.lora.adapters import adapter_parameters, adapters_disabled, attach_lora
    from megatron_rl.rollout.megatron import MegatronRolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.testing.weights import load_random_adapters, random_canonical

    cfg, lora = ModelConfig(**CFG), LoRAConfig(**LORA)
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    chunks = build_gpt_chunks(cfg, use_layout(**train_kw), torch.device("cpu"))
    attach_lora(chunks, cfg, lora, seed=0)
    load_canonical(chunks, random_canonical(cfg, 3, std=0.2), strict=False)
    adapters = load_random_adapters(chunks, cfg, lora, seed=5)
    in_place = MegatronRolloutEngine(cfg, "cpu", **ENGINE, lora=lora)
    own = MegatronRolloutEngine(cfg, "cpu", **ENGINE, layout=RolloutLayoutConfig(**infer_kw), lora=lora)
    out = dict(base=None, in_place=[], own=[], bytes=[], adapters_mismatched=[])
    for round_ in range(2):
        if round_:  # the adapters move (a training step): the next refit must carry them
            with torch.no_grad():
                for _, p in adapter_parameters(chunks):
                    p.mul_(1.5)
        in_place.load_from_chunks(chunks)
        out["in_place"].append(in_place.generate(PROMPTS, greedy, seed=0).response_ids)
        own.load_from_chunks(chunks)
        out["own"].append(own.generate(PROMPTS, greedy, seed=0).response_ids)
        out["bytes"].append(own.last_refit.bytes_received)
        infer = own.weights.inference_model
        # Bit for bit the actor's adapters, cut as this rank's inference shard holds them (B's rows
        # on column-parallel layers, A's columns on row-parallel ones).
        tp, scale = infer.pg_collection.tp, 1.5 ** round_
        out["adapters_mismatched"] += sorted(
            f"{round_}: {n}" for n, p in infer.named_parameters() if ".lora." in n and not torch.equal(
                p, (adapters[n] * scale).chunk(tp.size(), p.partition_dim)[tp.rank()]
                if getattr(p, "tensor_model_parallel", False) else adapters[n] * scale))
        own.release_weights()
    with adapters_disabled(chunks):
        out["base"] = in_place.generate(PROMPTS, greedy, seed=0).response_ids
    out["shard_bytes"] = sum(p.numel() * p.element_size() for p in infer.parameters())
    out["adapter_bytes"] = sum(p.numel() * p.element_size() for n, p in infer.named_parameters() if ".lora." in n)
    # The count from the adapter shapes alone: the inference shard's TP, every layer of its PP stage.
    infer_tp, infer_pp = infer_kw.get("tp", 1), infer_kw.get("pp", 1)
    out["adapter_bytes_from_shapes"] = adapter_params(cfg, lora, tp=infer_tp) // infer_pp * 4  # fp32
    out["adapters_released"] = all(p.untyped_storage().nbytes() == 0 for n, p in infer.named_parameters()
                                   if ".lora." in n)
    out["base_kept"] = all(p.untyped_storage().nbytes() > 0 for n, p in infer.named_parameters() if ".lora." not in n)
    return out


@pytest.mark.parametrize("train_kw,infer_kw", [(dict(tp=2), dict(tp=1, pp=1)), (dict(pp=2), dict(tp=2, pp=1))],
                         ids=["tp2_into_tp1", "pp2_into_tp2"])
def test_lora_engine_on_a_layout_of_its_own_generates_the_actors_greedy_tokens(train_kw, infer_kw):
    """Training on TP2 (PP2) and generating on TP1 x DP2 (TP2): the engine's own model, refit with
    the adapters, generates the greedy tokens the actor generates in place, before and after the
    adapters change, and not the base's; its adapters are the actor's bit for bit, cut for its TP
    rank; the second refit receives exactly the adapter tensors of this rank's inference shard
    (counted from the adapter shapes), far less than the shard, and releasing the engine's weights
    frees the adapters and keeps the base."""
    for rank, r in enumerate(run_distributed(2, generate_body, train_kw, infer_kw)):
        assert r["own"] == r["in_place"], rank
        assert r["own"][0] != r["own"][1] and r["base"] != r["in_place"][0], "the adapters must matter here"
        first, second = r["bytes"]
        print(f"rank {rank}: refit bytes {first} (first) then {second}; shard {r['shard_bytes']}")
        assert first == r["shard_bytes"]
        assert second == r["adapter_bytes"] == r["adapter_bytes_from_shapes"]
        assert second * 10 < r["shard_bytes"]
        assert r["adapters_mismatched"] == [] and r["adapters_released"] and r["base_kept"]


def test_lora_on_generator_ranks_trains_what_the_colocated_mode_trains_and_pushes_adapters(tmp_path):
    """One trainer and one generator rank with LoRA (one step off): the generator carries the
    actor's adapters, so the run trains the colocated run's samples, rewards and losses step by
    step; the first push fills its whole shard, every later one only the adapter tensors
    (counted from the adapter shapes of the generator's TP1 shard)."""
    from megatron_rl.config.schema import LoRAConfig, ModelConfig
    from megatron_rl.layout.lora import adapter_params
    from tests.support.helpers import TINY, read_metrics
    from tests.test_cli import cli
    from tests.test_generator_ranks import _stable

    lora = ("actor.lora.rank=2", "actor.lora.alpha=8", "actor.optim.lr=0.02")
    common = (*TINY, *lora, "trainer.mode=one_step_off", "trainer.steps=3", f"run.dir={tmp_path}")
    for name, nproc, extra in (("colocated", 1, ()), ("separate", 2, ("rollout.ranks=1",))):
        proc, seconds = cli("train", "--nproc", str(nproc), *common, f"run.name={name}", *extra)
        print(f"{name}: {seconds:.1f} s")
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows, reference = read_metrics(tmp_path / "separate"), read_metrics(tmp_path / "colocated")
    # The same samples and rewards; with LoRA the log-probs agree to fp32 rounding from the second
    # batch on (as much with every push full), not bit for bit as without it.
    for got, want in zip(_stable(rows), _stable(reference), strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == (pytest.approx(value, rel=1e-5, abs=1e-6) if isinstance(value, float) else value), key
    assert len({r["actor/kl"] for r in rows}) > 1  # the adapters trained, so the pushes carried something
    model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        vocab_size=64)
    adapter_bytes = adapter_params(model, LoRAConfig(rank=2, alpha=8)) * 4  # fp32
    pushed = [(r["rollout/policy_version"], r["rollout/refit_bytes"], r["rollout/generator_shard_bytes"]) for r in rows]
    print("version, refit bytes, shard bytes:", pushed)
    assert [v for v, _, _ in pushed] == [0, 0, 1]
    assert all(b == shard for v, b, shard in pushed if v == 0)
    assert all(b == adapter_bytes and b * 5 < shard for v, b, shard in pushed if v > 0)


def test_lora_ppo_on_a_rollout_layout_of_its_own_logs_adapter_sized_refits(tmp_path):
    """PPO with LoRA training on TP2 and generating on TP1: what the engine sampled with is what
    the actor computes, and ``rollout/refit_bytes`` is the whole shard at the first step, then the
    adapter tensors of the TP1 shard (counted from the adapter shapes)."""
    from megatron_rl.config.schema import LoRAConfig, ModelConfig
    from megatron_rl.layout.lora import adapter_params
    from tests.support.helpers import ppo_body, read_metrics

    run_distributed(2, ppo_body, ["actor.lora.rank=4", "actor.lora.alpha=8", "actor.optim.lr=0.05", "parallel.tp=2",
                                  "rollout.layout.tp=1", "rollout.engine=megatron", "rollout.kv_cache_memory=4e6",
                                  "rollout.kv_block_tokens=16", "trainer.steps=2", "algorithm.old_logprobs=recompute",
                                  f"run.dir={tmp_path}", "run.name=r"])
    rows = read_metrics(tmp_path / "r")
    model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                        vocab_size=64)
    adapter_bytes = adapter_params(model, LoRAConfig(rank=4, alpha=8)) * 4  # fp32
    print("refit bytes per step:", [r["rollout/refit_bytes"] for r in rows])
    assert rows[0]["rollout/refit_bytes"] > 5 * adapter_bytes and rows[1]["rollout/refit_bytes"] == adapter_bytes
    assert max(r["rollout/logprob_mismatch_max"] for r in rows) < 1e-4
