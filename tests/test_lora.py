"""LoRA: adapters on megatron's tensor-parallel layers equal one process on every layout, equal
peft's LoRA on the HF model, start as the base (B = 0), export to what peft loads, and leave only
adapter state to train."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.testing.harness import run_distributed
from megatron_rl.testing.layout_parity import (
    CP_LENGTHS,
    CP_STEP_OPTIM,
    CP_TOL,
    actor_critic_step,
    max_diff_outputs,
    max_diff_tensors,
)

LORA = dict(rank=4, alpha=8.0, target_modules=["all-linear"])
PLAN = dict(micro_batch_size=3)

_REFERENCE: dict = {}
# A model with routed experts (adapters on its attention projections; its experts stay frozen).
MOE_KW = dict(moe=dict(num_experts=4, router_topk=2, ffn_hidden_size=32))
ATTENTION_ONLY = dict(LORA, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


def _reference(lora_kw: dict, model_kw=None, optim_kw=None) -> dict:
    key = repr((sorted(lora_kw.items()), model_kw, optim_kw))
    if key not in _REFERENCE:
        _REFERENCE[key] = run_distributed(1, actor_critic_step, {}, None, CP_LENGTHS, PLAN, False, model_kw,
                                          dict(CP_STEP_OPTIM, **(optim_kw or {})), True, 1, lora_kw)[0]
    return _REFERENCE[key]


@pytest.mark.parametrize("world,layout_kw,model_kw,lora_kw,optim_kw", [
    (2, dict(tp=2), None, LORA, None),
    (2, dict(tp=2, sp=True), None, LORA, None),
    (2, dict(pp=2), None, LORA, None),
    (2, dict(pp=2, vpp=2), dict(num_layers=4), LORA, None),
    (2, dict(cp=2), None, LORA, None),
    (2, {}, None, LORA, dict(use_distributed_optimizer=True)),  # DP2, adapter state sharded
    (2, dict(ep=2), MOE_KW, ATTENTION_ONLY, None),
    (4, dict(tp=2, pp=2, sp=True), None, LORA, None),
    (4, dict(tp=2, cp=2), None, LORA, None),
    (2, dict(tp=2, sp=True), dict(recompute=dict(granularity="full", method="uniform", num_layers=1)), LORA, None),
], ids=["tp2", "tp2_sp", "pp2", "pp2_vpp2", "cp2", "dp2_distopt", "ep2_moe", "tp2_pp2_sp", "tp2_cp2",
        "tp2_sp_full_recompute"])
def test_lora_on_every_layout_equals_one_process(world, layout_kw, model_kw, lora_kw, optim_kw):
    from megatron_rl.config.schema import LoRAConfig
    from megatron_rl.layout.lora import projections
    from megatron_rl.testing.layout_parity import model_config

    # Recompute changes no number: compared with one process that keeps its activations.
    ref_model_kw = {k: v for k, v in model_kw.items() if k != "recompute"} or None if model_kw else None
    ref = _reference(lora_kw, ref_model_kw, optim_kw)
    got = run_distributed(world, actor_critic_step, layout_kw, ref["weights"], CP_LENGTHS, PLAN, False, model_kw,
                          dict(CP_STEP_OPTIM, **(optim_kw or {})), True, 1, lora_kw)[0]
    outs = max_diff_outputs(got["outs"], ref["outs"])
    # The distributed optimizer leaves each rank the reduced gradients of its own shard only: the
    # weights after the step are what compares.
    sharded = (optim_kw or {}).get("use_distributed_optimizer", False)
    grads = 0.0 if sharded else max_diff_tensors(got["grads"], ref["grads"])
    params = max_diff_tensors(got["params"], ref["params"])
    print(f"{layout_kw}: outputs {outs} grads {grads:.2e} params after a step {params:.2e}")
    assert all(v <= CP_TOL for v in outs.values()), outs
    assert grads <= CP_TOL and params <= CP_TOL, (grads, params)
    # Only adapters (and the value head) have gradients; every adapter has one.
    adapters = [k for k in ref["grads"] if ".lora." in k]
    assert set(ref["grads"]) == set(adapters) | {"value_head.linear.weight", "value_head.linear.bias"}
    model = model_config(model_kw)
    assert len(adapters) == 2 * model.num_layers * len(projections(model, LoRAConfig(**lora_kw).target_modules))
    assert all(float(ref["grads"][k].abs().max()) > 0 for k in adapters)
    moved = {k for k in ref["params"] if not torch.equal(ref["params"][k], ref["weights"].get(k, ref["params"][k]))}
    assert not any(".lora." not in k and not k.startswith("value_head") for k in moved), moved


# bf16 base (adapters fp32) against the fp32 one-process run: the bounds of tests/test_bf16.py, but
# values get 3e-2 of their largest: the random adapters here (std 0.1) enlarge the hidden states, and
# one bf16 process is already 1.8e-2 off (measured; TP2+SP 2.1e-2, log-probs 4.7e-3 / 5.6e-3,
# adapter gradients 0.9% / 1.1% of the largest).
BF16_TOL = {"logprob": 1e-2, "entropy": 5e-4, "value_rel": 3e-2, "grad_rel": 2.5e-2}


@pytest.mark.parametrize("world,layout_kw", [(1, {}), (2, dict(tp=2, sp=True))], ids=["one_process", "tp2_sp"])
def test_lora_with_a_bf16_base_stays_within_bf16_rounding_of_fp32(world, layout_kw):
    ref = _reference(LORA)
    got = run_distributed(world, actor_critic_step, layout_kw, ref["weights"], CP_LENGTHS, PLAN, False,
                          dict(params_dtype="bfloat16"), CP_STEP_OPTIM, True, 1, LORA)[0]
    outs = max_diff_outputs(got["outs"], ref["outs"])
    value_scale = max(float(o["value"].abs().max()) for o in ref["outs"])
    grad_scale = max(float(g.abs().max()) for g in ref["grads"].values())
    err = {"logprob": outs["logprob"], "entropy": outs["entropy"], "value_rel": outs["value"] / value_scale,
           "grad_rel": max_diff_tensors(got["grads"], ref["grads"]) / grad_scale}
    print(f"bf16 base {layout_kw}: " + " ".join(f"{k} {v:.2e}" for k, v in err.items()))
    assert all(err[k] <= BF16_TOL[k] for k in BF16_TOL), err
    assert err["logprob"] > 1e-5  # the base is bf16: there is rounding to measure
    assert all(v.dtype == torch.float32 for k, v in got["grads"].items() if ".lora." in k)


INT8 = dict(LORA, quantize_base="int8")


def _base_of(params: dict, weights: dict) -> dict:
    """The frozen base a LoRA step left (its parameters less adapters), the value head as it started."""
    return {k: (weights[k] if k.startswith("value_head") else v) for k, v in params.items() if ".lora." not in k}


@pytest.mark.parametrize("world,layout_kw", [(2, dict(tp=2)), (2, dict(tp=2, sp=True)), (2, dict(pp=2)),
                                             (2, dict(cp=2)), (4, dict(tp=2, pp=2, sp=True))],
                         ids=["tp2", "tp2_sp", "pp2", "cp2", "tp2_pp2_sp"])
def test_an_int8_base_computes_its_dequantized_weights_on_every_layout(world, layout_kw):
    """An int8 base (one fp32 scale per output row) is exactly the model with its dequantized
    weights -- outputs, adapter gradients and the step -- and every layout quantizes to the same
    values as one process (a row-parallel layer's rows take their maximum over TP)."""
    ref = _reference(LORA)
    one = _reference(INT8)
    got = run_distributed(world, actor_critic_step, layout_kw, ref["weights"], CP_LENGTHS, PLAN, False, None,
                          CP_STEP_OPTIM, True, 1, INT8)[0]
    base = _base_of(one["params"], ref["weights"])
    assert _base_of(got["params"], ref["weights"]).keys() == base.keys()
    assert all(torch.equal(got["params"][k], base[k]) for k in base if not k.startswith("value_head"))
    # The same model with the dequantized weights held in fp32, no int8 anywhere.
    plain = run_distributed(1, actor_critic_step, {}, base, CP_LENGTHS, PLAN, False, None, CP_STEP_OPTIM, True, 1,
                            LORA)[0]
    exact = max_diff_outputs(one["outs"], plain["outs"])
    exact_grads = max_diff_tensors(one["grads"], plain["grads"])
    layout = max_diff_outputs(got["outs"], one["outs"])
    layout_grads, layout_params = max_diff_tensors(got["grads"], one["grads"]), max_diff_tensors(got["params"],
                                                                                                one["params"])
    rounding = max_diff_outputs(one["outs"], ref["outs"])
    weight_gap = max(float((base[k] - ref["weights"][k]).abs().max() / ref["weights"][k].abs().max())
                     for k in base if k.endswith(("linear_qkv.weight", "linear_fc2.weight")))
    print(f"int8 base {layout_kw}: vs dequantized fp32 weights {exact} grads {exact_grads:.2e}; layout vs one "
          f"process {layout} grads {layout_grads:.2e} params {layout_params:.2e}; int8 rounding moves log-probs "
          f"{rounding['logprob']:.2e} (weights {weight_gap:.2e} of a row's largest)")
    assert all(v <= 1e-6 for v in exact.values()) and exact_grads <= 1e-6, (exact, exact_grads)
    assert all(v <= CP_TOL for v in layout.values()) and layout_grads <= CP_TOL and layout_params <= CP_TOL
    assert 1e-6 < rounding["logprob"] < 5e-2 and weight_gap <= 0.5 / 127 + 1e-6  # half a step of 1/127


def fresh_adapters_body(layout_kw: dict):
    """Worker body: canonical adapters as attached (peft's start) and the log-probs with them on and off."""
    from megatron_rl.config.schema import LoRAConfig
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.models.lora.adapters import adapters_disabled, attach_lora
    from megatron_rl.models.seeded_init import seeded_init
    from megatron_rl.testing.layout_parity import make_sequences, model_config
    from megatron_rl.testing.layouts import use_layout

    layout = use_layout(**layout_kw)
    model = model_config()
    chunks = build_gpt_chunks(model, layout, torch.device("cpu"))
    attach_lora(chunks, model, LoRAConfig(**LORA), seed=5)
    seeded_init(chunks, 5)
    seqs = make_sequences()

    def logprobs():
        with torch.no_grad():
            return run_sequences(chunks, seqs, LogProbHead(with_entropy=False), BatchPlan(micro_batch_size=3),
                                 torch.device("cpu"))[0]

    on = logprobs()
    with adapters_disabled(chunks):
        off = logprobs()
    return gather_canonical(chunks, select=lambda n: ".lora." in n), on, off


def test_fresh_adapters_start_as_peft_does_the_same_on_every_layout_and_leave_the_model_unchanged():
    one = run_distributed(1, fresh_adapters_body, {})[0]
    tp2 = run_distributed(2, fresh_adapters_body, dict(tp=2, sp=True))[0]
    adapters, on, off = one
    assert adapters.keys() == tp2[0].keys() and all(torch.equal(adapters[k], tp2[0][k]) for k in adapters)
    for name, tensor in adapters.items():
        if name.endswith("lora_B.weight"):
            assert not tensor.any(), name  # B = 0: step 0 is the base model
        else:  # peft's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))
            bound = tensor.shape[1] ** -0.5
            assert float(tensor.abs().max()) <= bound and float(tensor.std()) > 0.8 * bound / 3 ** 0.5, name
    assert all(torch.equal(a["logprob"], b["logprob"]) for a, b in zip(on, off))


def peft_parity_body(hf_dir: str, out_dir: str, layout_kw: dict, sequences: list, lora_kw: dict):
    """Worker body: the HF model on ``layout_kw`` with seeded random adapters; rank 0 writes them as a
    peft adapter to ``out_dir`` and returns our log-probs, with and without the adapters."""
    import torch.distributed as dist

    from megatron_rl.config.schema import LoRAConfig, ModelConfig, OptimConfig
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.layout.lora import target_names
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.models.hf_bridge import load_hf_weights
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.models.lora.adapters import adapters_disabled, attach_lora
    from megatron_rl.models.lora.export import peft_tensors, split_adapters, write_peft_adapter
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.testing.weights import load_random_adapters

    layout = use_layout(**layout_kw)
    cfg = model_config_from_hf(read_hf_config(hf_dir), ModelConfig())
    lora = LoRAConfig(**lora_kw)
    chunks = build_gpt_chunks(cfg, layout, torch.device("cpu"))
    attach_lora(chunks, cfg, lora, seed=0)
    load_hf_weights(chunks, hf_dir)
    load_random_adapters(chunks, cfg, lora, seed=9)
    # In megatron's DDP, as training runs: its gradient finalisation all-reduces the gradients that
    # sequence parallelism leaves partial.
    chunks = make_trainable(chunks, OptimConfig(), 1).chunks
    seqs = [{"tokens": torch.tensor(ids)} for ids in sequences]

    def logprobs():
        with torch.no_grad():
            outs, _ = run_sequences(chunks, seqs, LogProbHead(with_entropy=False), BatchPlan(micro_batch_size=2),
                                    torch.device("cpu"))
        return [o["logprob"][:len(ids) - 1] for o, ids in zip(outs, sequences)]

    with_adapters = logprobs()
    with adapters_disabled(chunks):
        base = logprobs()
    # The adapters' gradients of the summed log-probs (the last position has no label: masked).
    masked = [{"tokens": torch.tensor(ids), "mask": torch.cat([torch.ones(len(ids) - 1), torch.zeros(1)])}
              for ids in sequences]
    run_sequences(chunks, masked, LogProbHead(with_entropy=False), BatchPlan(micro_batch_size=2),
                  torch.device("cpu"), loss_fn=lambda o, t, mb: ((o["logprob"] * t["mask"]).sum(), {}),
                  forward_only=False)
    grads = gather_canonical(chunks, "grad", select=lambda n: ".lora." in n)
    _, adapters = split_adapters(gather_canonical(chunks))
    if dist.get_rank() == 0:
        write_peft_adapter(out_dir, adapters, lora, target_names(cfg, lora.target_modules), hf_dir)
    dist.barrier()
    return with_adapters, base, peft_tensors(grads)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    from tests.support.helpers import COMMON, make_hf_model

    path = str(tmp_path_factory.mktemp("hf") / "llama")
    make_hf_model("llama", path)
    g = torch.Generator().manual_seed(2)
    return path, [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in (17, 5, 30)]


@pytest.mark.parametrize("world,layout_kw,targets", [
    (1, {}, ["all-linear"]),
    (2, dict(tp=2, sp=True), ["q_proj", "v_proj", "down_proj"]),
])
def test_lora_equals_peft_on_the_hf_model_and_exports_what_peft_loads(hf_llama, tmp_path, world, layout_kw,
                                                                       targets):
    import peft
    import transformers

    from tests.support.helpers import hf_logprobs

    hf_dir, sequences = hf_llama
    lora_kw = dict(rank=4, alpha=12.0, target_modules=targets)
    ours, base, our_grads = run_distributed(world, peft_parity_body, hf_dir, str(tmp_path / "adapter"), layout_kw,
                                            sequences, lora_kw)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    plain = [hf_logprobs(model, ids) for ids in sequences]
    peft_model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter"), is_trainable=True).eval()
    theirs = [hf_logprobs(peft_model, ids) for ids in sequences]
    for ids in sequences:  # peft's adapter gradients of the same summed log-probs
        logits = peft_model(torch.tensor([ids])).logits[0].float()
        torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).sum().backward()
    peft_grads = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if "lora_" in n}
    assert peft_grads.keys() == our_grads.keys()
    scale = max(float(g.abs().max()) for g in peft_grads.values())
    grad_gap = max(float((our_grads[k] - g).abs().max()) for k, g in peft_grads.items()) / scale
    gap = max(float((a - b).abs().max()) for a, b in zip(ours, theirs))
    base_gap = max(float((a - b).abs().max()) for a, b in zip(base, plain))
    moved = max(float((a - b).abs().max()) for a, b in zip(theirs, plain))
    print(f"{layout_kw} {targets}: |ours - peft| {gap:.2e}, adapters off vs HF base {base_gap:.2e}, "
          f"adapters move log-probs by {moved:.2e}; adapter gradients vs peft {grad_gap:.2e} of the largest")
    assert gap <= 1e-4 and base_gap <= 1e-4 and grad_gap <= 1e-4
    assert moved > 1e-2  # the adapters matter, so the comparison means something
    assert sorted(peft_model.peft_config["default"].target_modules) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        if targets == ["all-linear"] else targets)


def _metrics(run_dir) -> list[dict]:
    from tests.support.helpers import read_metrics

    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/", "memory/"))}
            for r in read_metrics(run_dir)]


LORA_RUN = ["actor.lora.rank=4", "actor.lora.alpha=8", "critic.lora.rank=4", "trainer.save_every=1",
            "actor.optim.lr=0.02", "critic.optim.lr=0.02"]


def test_lora_checkpoints_hold_adapters_only_and_resume_exactly_on_another_layout(tmp_path):
    import json

    from tests.support.helpers import ppo_body

    common = LORA_RUN + [f"run.dir={tmp_path}"]
    run_distributed(2, ppo_body, common + ["parallel.tp=2", "trainer.steps=3", "run.name=straight"])
    run_distributed(2, ppo_body, common + ["parallel.tp=2", "trainer.steps=1", "run.name=resumed"])
    # The second half on PP2: adapters and their Adam state reshard on load.
    run_distributed(2, ppo_body, common + ["parallel.pp=2", "trainer.steps=3", "run.name=resumed"])
    straight, resumed = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for a, b in zip(straight, resumed):
        for key, value in a.items():
            if key != "rollout/weights_gb" and isinstance(value, float):
                assert b[key] == pytest.approx(value, abs=1e-5), (a["step"], key)
    assert len({r["reward/mean"] for r in straight}) > 1 and straight[-1]["actor/kl"] != 0
    step = tmp_path / "straight" / "checkpoints" / "step_00000003"
    meta = json.loads((step / "meta.json").read_text())
    assert meta["lora"]["base"] == {"seed": 1234} and meta["lora"]["models"]["actor"]["rank"] == 4
    # The tensors stored: adapters (the critic's with its value head) and Adam's state for them.
    from megatron.core import dist_checkpointing

    for part, extra in (("actor", ()), ("critic", ("value_head.",))):
        keys = [k.removeprefix("optimizer.state.exp_avg_sq.").removeprefix("optimizer.state.exp_avg.")
                .removeprefix("optimizer.state.fp32_param.")
                for k in dist_checkpointing.load_tensors_metadata(str(step / part))]
        assert keys and all(".lora." in k or k.startswith(extra) for k in keys), keys
        assert sum(".lora." in k for k in keys) == 3 * 7 * 2  # weight, exp_avg, exp_avg_sq x 7 projections x A/B


@pytest.mark.parametrize("base", ["none", "int8"])
def test_lora_resume_on_the_same_layout_is_bit_identical(tmp_path, base):
    """A run stopped after a step and resumed equals one run, bit for bit; an int8 base (actor and
    critic) too: it is quantized again from the same base on resume."""
    from tests.support.helpers import ppo_body

    common = LORA_RUN + [f"run.dir={tmp_path}", f"actor.lora.quantize_base={base}", f"critic.lora.quantize_base={base}"]
    run_distributed(1, ppo_body, common + ["trainer.steps=3", "run.name=a"])
    run_distributed(1, ppo_body, common + ["trainer.steps=1", "run.name=b"])
    run_distributed(1, ppo_body, common + ["trainer.steps=3", "run.name=b"])
    a = _metrics(tmp_path / "a")
    assert a == _metrics(tmp_path / "b")
    assert len({r["reward/mean"] for r in a}) > 1 and a[-1]["actor/kl"] != 0
    _BASE_RUNS[base] = a
    if len(_BASE_RUNS) == 2:  # the int8 base is another model, in fewer bytes
        plain, int8 = _BASE_RUNS["none"][0], _BASE_RUNS["int8"][0]
        assert plain["actor/grad_norm"] != int8["actor/grad_norm"]
        assert int8["rollout/weights_gb"] < 0.6 * plain["rollout/weights_gb"]


_BASE_RUNS: dict = {}


def test_lora_adapters_on_another_base_are_refused(tmp_path):
    from megatron_rl.errors import CheckpointError
    from tests.support.helpers import ppo_body

    common = LORA_RUN + [f"run.dir={tmp_path}", "run.name=r"]
    run_distributed(1, ppo_body, common + ["trainer.steps=1"])
    with pytest.raises(Exception, match="another base") as err:
        run_distributed(1, ppo_body, common + ["trainer.steps=2", "run.seed=99"])
    assert "run.seed" in str(err.value) or CheckpointError


def lora_hf_run_body(hf_dir: str, run_dir: str, sequences: list):
    """Worker body: 2 LoRA GRPO steps on the HF model (a checkpoint per step), then the trained actor's
    log-probs of ``sequences``, rebuilt from the checkpoint (base from HF + adapters)."""
    import torch.distributed as dist

    from megatron_rl.config.loader import load_config
    from megatron_rl.engine.checkpoint import ONLY_TRAINED, ModelPart, find_latest, load_checkpoint
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.models.hf_bridge import load_hf_weights
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.models.lora.adapters import attach_lora
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.trainer.ppo import run_ppo
    from megatron_rl.validation import validate

    cfg = load_config(None, [
        f"model.hf_path={hf_dir}", "data.train_path=task:add_small", "data.tokenizer=char", "rollout.n=2",
        "rollout.max_new_tokens=3", "trainer.prompts_per_step=4", "trainer.plot=false", "trainer.steps=2",
        "trainer.save_every=1", "algorithm.advantage=grpo", "reward.fn=tests.support.helpers:digit_share",
        "actor.lora.rank=4", "actor.lora.alpha=8", "actor.lora.target_modules=[q_proj,v_proj,up_proj,down_proj]",
        "actor.optim.lr=0.05", f"run.dir={run_dir}", "run.name=lora"])
    cfg.model = model_config_from_hf(read_hf_config(hf_dir), cfg.model)
    validate(cfg, dist.get_world_size())
    run_ppo(cfg, log=lambda line: None)
    layout = use_layout()
    chunks = build_gpt_chunks(cfg.model, layout, torch.device("cpu"), initialize=False)
    attach_lora(chunks, cfg.model, cfg.actor.lora, seed=0)
    load_hf_weights(chunks, hf_dir)
    load_checkpoint(find_latest(f"{run_dir}/lora/checkpoints"), {"actor": ModelPart(chunks, only=ONLY_TRAINED)},
                    with_optimizer=False, load_rng=False)
    with torch.no_grad():
        outs, _ = run_sequences(chunks, [{"tokens": torch.tensor(ids)} for ids in sequences],
                                LogProbHead(with_entropy=False), BatchPlan(micro_batch_size=2), torch.device("cpu"))
    return [o["logprob"][:len(ids) - 1] for o, ids in zip(outs, sequences)]


@pytest.mark.slow
def test_a_lora_run_exports_a_peft_adapter_and_a_merged_model_that_hf_loads(hf_llama, tmp_path):
    import os

    import peft
    import transformers

    from megatron_rl.testing.cli_runner import run_cli
    from tests.support.helpers import hf_logprobs, make_hf_model

    hf_dir, sequences = hf_llama
    ours = run_distributed(1, lora_hf_run_body, hf_dir, str(tmp_path), sequences)[0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = str(tmp_path / "lora")

    def cli(*args):
        return run_cli(*args, cwd=root, timeout=300)

    # TP2 on export: the adapters are gathered from their shards.
    done = cli("convert", "--checkpoint", run, "--hf-out", str(tmp_path / "adapter"), "--nproc", "2", "parallel.tp=2")
    assert done.returncode == 0, done.stderr
    done = cli("convert", "--checkpoint", run, "--hf-out", str(tmp_path / "merged"), "--merge", "--hf-model", hf_dir)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path / "adapter"))[:2] == ["adapter_config.json", "adapter_model.safetensors"]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    plain = [hf_logprobs(base, ids) for ids in sequences]
    with_peft = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    peft_lp = [hf_logprobs(with_peft, ids) for ids in sequences]
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    merged_lp = [hf_logprobs(merged, ids) for ids in sequences]

    def gap(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    print(f"ours vs peft {gap(ours, peft_lp):.2e}, ours vs merged {gap(ours, merged_lp):.2e}, "
          f"training moved log-probs by {gap(ours, plain):.2e}")
    assert gap(ours, peft_lp) <= 1e-4 and gap(ours, merged_lp) <= 1e-4
    assert gap(ours, plain) > 1e-3  # the adapters trained
    # What cannot be done is refused before any rank starts, naming the flag.
    other = str(tmp_path / "other")
    make_hf_model("llama", other, seed=7)
    refused = cli("convert", "--checkpoint", run, "--hf-out", str(tmp_path / "m2"), "--merge", "--hf-model", other)
    assert refused.returncode == 2 and "--hf-model" in refused.stderr and "not the base" in refused.stderr
    (tmp_path / "in.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n')
    refused = cli("generate", "--checkpoint", run, "--input", str(tmp_path / "in.jsonl"),
                  "--output", str(tmp_path / "o.jsonl"))
    assert refused.returncode == 2 and "LoRA adapters" in refused.stderr, refused.stderr
