"""The GPU runtime checked on one GPU, in one table, in under 8 minutes.

    python benchmarks/gpu_check.py [--out FILE.md] [--budget-s 420] [--critic]

World size 1 with NCCL (every collective goes through the rules NCCL imposes), bf16, the local
layer spec.  Rows:

(a) a PPO step of a ~0.55B Llama-shaped model (24 layers, hidden 1280, GQA 10:2, SwiGLU 4096,
    vocab 32768): rollout, experience, update and checkpoint save; then a second run that loads
    the checkpoint and trains one more step (GRPO with a reference model; ``--critic`` adds GAE
    and the critic);
(b) ``score`` against HF transformers in bf16 on a small random Llama (skipped without
    transformers);
(c) which SDPA backend each attention path used (flash / cuDNN / efficient / math);
(d) actor-update MFU, next to a plain megatron-core forward/backward of the same model and
    micro-batch shape in the same run;
(e) peak GPU memory of the PPO steps against the planner's estimate for the same config;
(f) generation tokens/s;
(g) the actor update against megatron-core's own training step on the same packed micro-batches
    (``benchmarks/update_vs_plain.py``) at a size where the figures mean something: a
    Qwen2.5-1.5B-shaped model (random init, bf16, vocabulary 151,936), 4 micro-batches of 8k
    tokens; each RL piece switched on in turn, the experience forwards against a plain forward,
    MFU, first against steady step, build time, and the update's peak memory against the planner.
(h) generation with megatron's dynamic engine against HF ``generate`` on the same weights at a
    Qwen2.5-1.5B shape (``benchmarks/engine_vs_hf.py``): greedy parity in bf16, tokens/s at 64 and
    256 requests x 512 new tokens and a long tail, the memory-bandwidth bound, CUDA graphs on / off
    (and the recapture a rollout pays), prefix caching at n=8 with 1k-token prompts;

Everything is built here: random weights, the built-in ``task:digit_sum`` prompts, the character
tokenizer; nothing is downloaded.  Each section fails soft: an error becomes its row, and the next
section runs.  Needs torch with CUDA, megatron-core 0.19.2 and megatron_rl's other requirements
(``omegaconf``, ``psutil``, ``pyyaml``, ``packaging``, ``numpy``, ``einops``); run from the repository
root.  docs/gpu_check.md has the commands that install them from wheels on a machine without network.

Without CUDA it prints one line and exits 0.  ``--cpu-dry-run`` runs every section on the CPU
with a tiny model (gloo, fp32 where bf16 is not the point) to check the script itself; its numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import os
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the GPU machine runs this from a copy of the tree, without installing it
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

H200_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100/H200 SXM (the MFU denominator)
NO_CUDA = "gpu_check: no CUDA device here; nothing to check (run it on a machine with one GPU)"

GPU_MODEL = dict(num_layers=24, hidden_size=1280, ffn_hidden_size=4096, num_attention_heads=10,
                 num_query_groups=2, vocab_size=32768, max_position_embeddings=4096, rotary_base=500000.0)
CPU_MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2, vocab_size=256, max_position_embeddings=512)
GPU_RUN = dict(prompts=16, n=4, new_tokens=64, tokens_per_microbatch=4096)
CPU_RUN = dict(prompts=2, n=2, new_tokens=4, tokens_per_microbatch=256)


class Check:
    """The run's rows, its time budget, and what later sections reuse from earlier ones."""

    def __init__(self, cpu: bool, budget_s: float, critic: bool):
        self.cpu = cpu
        self.device = torch.device("cpu" if cpu else "cuda")
        self.model = CPU_MODEL if cpu else GPU_MODEL
        self.run = CPU_RUN if cpu else GPU_RUN
        self.critic = critic
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.rows: list[tuple[str, str]] = []
        self.facts: dict = {}
        self.tmp = tempfile.mkdtemp(prefix="gpu_check_")

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def section(self, name: str, fn) -> None:
        """Run one section; its rows, or its error as the row, go to the table."""
        if self.elapsed() > self.budget_s:
            self.rows.append((name, f"skipped: time budget of {self.budget_s:.0f} s spent"))
            return
        began = time.perf_counter()
        try:
            for row in fn(self):
                self.rows.append(row)
                print(f"[gpu_check] {row[0]}: {row[1]}", file=sys.stderr, flush=True)
        except Exception as err:  # noqa: BLE001 - a failing section is a row, the script goes on
            traceback.print_exc()
            first = (str(err).strip().splitlines() or [""])[0][:300]
            self.rows.append((name, f"ERROR {type(err).__name__}: {first}"))
        finally:
            gc.collect()
            if not self.cpu:
                torch.cuda.empty_cache()
        print(f"[gpu_check] {name}: {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- setup


def section_setup(check: Check):
    """World size 1: NCCL on CUDA (gloo for the CPU dry run)."""
    from megatron_rl.config.schema import DistributedConfig
    from megatron_rl.distributed.env import free_port
    from megatron_rl.distributed.runtime import init_distributed

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    backend, device = ("gloo", "cpu") if check.cpu else ("nccl", "cuda")
    init_distributed(DistributedConfig(backend=backend, device=device, timeout_s=300))
    check.facts["backend"] = torch.distributed.get_backend()
    return []


def model_overrides(model: dict) -> list[str]:
    return [f"model.{k}={v}" for k, v in model.items()]


def ppo_overrides(check: Check, steps: int) -> list[str]:
    run = check.run
    dtype = "bfloat16"
    out = model_overrides(check.model) + [
        f"model.params_dtype={dtype}", "model.transformer_impl=local",
        "data.train_path=task:digit_sum", "data.tokenizer=char", "data.max_prompt_tokens=64",
        f"rollout.n={run['n']}", f"rollout.max_new_tokens={run['new_tokens']}", "rollout.max_batch_size=64",
        f"trainer.prompts_per_step={run['prompts']}", f"trainer.steps={steps}", "trainer.plot=false",
        "trainer.keep_last=1", f"batch.max_tokens_per_rank={run['tokens_per_microbatch']}",
        "algorithm.kl_coef=0.01", "actor.optim.lr=1e-6", "critic.optim.lr=1e-6",
        f"run.dir={check.tmp}", "run.name=ppo", f"distributed.device={check.device.type}",
        f"distributed.backend={'gloo' if check.cpu else 'nccl'}",
    ]
    if not check.critic:
        out.append("algorithm.advantage=grpo")
    return out


def read_metrics(check: Check) -> list[dict]:
    path = os.path.join(check.tmp, "ppo", "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def peak_gib(check: Check) -> float:
    return 0.0 if check.cpu else torch.cuda.max_memory_allocated() / 2**30


def reset_peak(check: Check) -> None:
    if not check.cpu:
        torch.cuda.reset_peak_memory_stats()


# ----------------------------------------------------------------------------- (a) PPO


def _ppo_run(check: Check, steps: int) -> tuple[float, list[str]]:
    from megatron_rl.config.loader import load_config
    from megatron_rl.trainer.ppo import run_ppo
    from megatron_rl.validation import validate

    cfg = load_config(None, ppo_overrides(check, steps))
    validate(cfg, 1)
    check.facts["cfg"] = cfg
    lines: list[str] = []
    began = time.perf_counter()
    try:
        run_ppo(cfg, log=lines.append)
    finally:
        check.facts["ppo_peak_gib"] = max(check.facts.get("ppo_peak_gib", 0.0), peak_gib(check))
    return time.perf_counter() - began, lines


def _step_summary(row: dict) -> str:
    keys = [("step", "timing/step_s"), ("rollout", "timing/rollout_s"), ("experience", "timing/experience_s"),
            ("update", "timing/actor_update_s")]
    parts = [f"{label} {row[k]:.2f} s" for label, k in keys if isinstance(row.get(k), (int, float))]
    loss = row.get("actor/pg_loss")
    parts.append(f"pg_loss {loss:.4g}" if isinstance(loss, (int, float)) else "pg_loss n/a")
    parts.append(f"skipped updates {row.get('actor/skipped_updates', 'n/a')}")
    return ", ".join(parts)


# The top-level phases of a PPO step (trainer/ppo.py::train_step): their sum against the step's time
# shows what no phase accounts for.
STEP_PHASES = ("weight_sync", "rollout", "rollout_wait", "reward", "experience", "actor_update", "critic_update",
               "weight_push")


def section_ppo(check: Check):
    from megatron_rl.planner.memory import total_params

    cfg_model = _model_config(check)
    params = total_params(cfg_model)
    reset_peak(check)
    what = "GAE + critic" if check.critic else "GRPO"
    try:
        seconds, _ = _ppo_run(check, steps=1)
    except Exception:
        rows = read_metrics(check)
        if rows:  # the step trained; the save (or what follows) failed: report both
            yield (f"(a) PPO step 1, {params / 1e6:.0f}M params, bf16, {what}", _step_summary(rows[0]))
        raise
    rows = read_metrics(check)
    saved = os.path.isdir(os.path.join(check.tmp, "ppo", "checkpoints", "step_00000001"))
    yield (f"(a) PPO step 1, {params / 1e6:.0f}M params, bf16, {what} (rollout, experience, update, save)",
           f"{_step_summary(rows[0])}; run {seconds:.1f} s incl. build + save; checkpoint saved: {saved}")
    seconds, lines = _ppo_run(check, steps=2)
    rows = read_metrics(check)
    resumed = [line for line in lines if "resum" in line.lower()]
    step2 = rows[-1] if rows and rows[-1].get("step") == 2 else {}
    build_and_load = seconds - float(step2.get("timing/step_s", 0.0))
    yield ("(a) PPO resume from checkpoint + step 2",
           f"{_step_summary(step2)}; load + build {build_and_load:.1f} s; steps logged {[r.get('step') for r in rows]}"
           + (f"; '{resumed[0][:80]}'" if resumed else ""))
    if step2:
        phases = sum(float(step2.get(f"timing/{k}_s", 0.0)) for k in STEP_PHASES)
        total = float(step2.get("timing/step_s", 0.0))
        yield ("(a) step 2: its phases against the step (no hidden waits)",
               f"phases {phases:.2f} s of step {total:.2f} s: {100 * (total - phases) / max(total, 1e-9):.1f}% "
               f"outside them ({', '.join(STEP_PHASES)})")
    check.facts["ppo_rows"] = rows


def _model_config(check: Check):
    from megatron_rl.config.schema import ModelConfig

    return ModelConfig(**check.model, params_dtype="bfloat16", transformer_impl="local")


# ----------------------------------------------------------------------------- (b) score vs HF


def section_score(check: Check):
    try:
        import transformers
    except ImportError:
        yield ("(b) score vs HF transformers (bf16)", "skipped: transformers not installed")
        return
    from megatron_rl.config.loader import load_config
    from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
    from megatron_rl.tools.score import run_score

    hf_dir = os.path.join(check.tmp, "hf_llama")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                      rope_theta=10000.0)
    hf = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    hf.save_pretrained(hf_dir)
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (200, 3, 77, 128, 31)]
    with open(os.path.join(hf_dir, "in.jsonl"), "w") as fh:
        for ids in sequences:
            fh.write(json.dumps({"input_ids": ids}) + "\n")
    cfg = load_config(None, ["model.params_dtype=bfloat16", "model.transformer_impl=local",
                             f"distributed.device={check.device.type}", "batch.max_tokens_per_rank=1024"])
    cfg.model = model_config_from_hf(read_hf_config(hf_dir), cfg.model)
    cfg.model.hf_path = hf_dir
    out_path = os.path.join(hf_dir, "out.jsonl")
    run_score(cfg, hf_dir, os.path.join(hf_dir, "in.jsonl"), out_path)
    with open(out_path) as fh:
        scored = [json.loads(line) for line in fh]
    hf = hf.to(check.device)
    got = [torch.tensor(row["logprobs"]) for row in scored]
    ref16 = [_hf_logprobs(hf, ids, check.device) for ids in sequences]
    ref32 = [_hf_logprobs(hf.float(), ids, check.device) for ids in sequences]
    diff16 = torch.cat([(a - b).abs() for a, b in zip(got, ref16)])
    diff32 = torch.cat([(a - b).abs() for a, b in zip(got, ref32)])
    yield ("(b) score vs HF transformers, bf16 random Llama (4 layers, GQA 8:2)",
           f"max |dlogp| vs HF bf16 {float(diff16.max()):.3g}, mean {float(diff16.mean()):.3g}; "
           f"max vs HF on the same weights in fp32 {float(diff32.max()):.3g} ({diff16.numel()} tokens)")


@torch.no_grad()
def _hf_logprobs(model, ids: list[int], device) -> torch.Tensor:
    logits = model(torch.tensor([ids], device=device)).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0].cpu()


# ----------------------------------------------------------------------------- (c) SDPA backends

SDPA_OPS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_cudnn_attention": "cuDNN",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_flash_attention_for_cpu": "flash (CPU kernel)",
    "_scaled_dot_product_fused_attention_overrideable": "fused (overrideable)",
    "_flash_attention_forward": "varlen flash",  # packed rows on CUDA (torch.nn.attention.varlen)
}


def sdpa_recorder():
    """A dispatch mode recording the fused SDPA kernels called, with the query length of each.

    ``F.scaled_dot_product_attention`` picks its backend above the dispatcher; a fused backend
    then calls its own operator (seen here), the math backend decomposes into plain ops (so a
    path that called SDPA and shows no fused operator ran the math backend)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name in SDPA_OPS:
                self.calls.append((SDPA_OPS[name], int(args[0].size(-2))))
            return func(*args, **(kwargs or {}))

    return Recorder()


def backends_seen(calls, sdpa_calls: int) -> str:
    """'flash x2', or 'math' when SDPA ran without any fused operator."""
    names: dict[str, int] = {}
    for name, _ in calls:
        names[name] = names.get(name, 0) + 1
    if not names:
        return f"math x{sdpa_calls}" if sdpa_calls else "no SDPA call"
    math = sdpa_calls - len(calls)
    return ", ".join(f"{n} x{c}" for n, c in names.items()) + (f", math x{math}" if math > 0 else "")


class _SdpaCounter:
    """Records the query length of every ``F.scaled_dot_product_attention`` call (to tell the
    math backend from no call at all)."""

    def __init__(self):
        self.query_lengths: list[int] = []
        self._orig = None

    def __enter__(self):
        import torch.nn.functional as F

        self._orig = F.scaled_dot_product_attention

        def counted(query, *args, **kwargs):
            self.query_lengths.append(int(query.size(-2)))
            return self._orig(query, *args, **kwargs)

        F.scaled_dot_product_attention = counted
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self._orig

    def count(self, decode: bool | None = None) -> int:
        """Calls, or only decode (one query) / prefill (several) calls."""
        if decode is None:
            return len(self.query_lengths)
        return sum((n == 1) == decode for n in self.query_lengths)


def _probe(fn) -> str:
    recorder = sdpa_recorder()
    with _SdpaCounter() as counter, recorder:
        fn()
    return backends_seen(recorder.calls, counter.count())


def _lse_merge_error(heads: int, kv: int, d: int, dtype, dev) -> str:
    """Attention over two key blocks through the fused kernels, merged by log-sum-exp, forward and
    backward, against one SDPA call over all keys (what the CP ring does on every step)."""
    import torch.nn.functional as F

    from megatron_rl.ops.attention_kernels import attention_backward, attention_forward, merge_into

    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, heads, 128, d, generator=g).to(dev, dtype)
    k, v = (torch.randn(1, kv, 256, d, generator=g).to(dev, dtype) for _ in range(2))
    do = torch.randn(1, heads, 128, d, generator=g).to(dev, dtype)
    scale = d**-0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    # The reference in full fp32: the PPO runs before this turned TF32 on for matrix products
    # (models/builder.py::allow_tf32), which made the fp32 row read 5.9e-4 on an H200 (1.4e-6 without).
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = F.scaled_dot_product_attention(*leaves, scale=scale, enable_gqa=heads != kv)
        ref.backward(do)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    out, lse = attention_forward(q, k[:, :, :128], v[:, :, :128], False, scale)
    acc_out, acc_lse = out.float(), lse.float().clone()
    merge_into(acc_out, acc_lse, *attention_forward(q, k[:, :, 128:], v[:, :, 128:], False, scale))
    merged = acc_out.to(dtype)
    dq1, dk1, _ = attention_backward(do, q, k[:, :, :128], v[:, :, :128], merged, acc_lse, False, scale)
    dq2, dk2, _ = attention_backward(do, q, k[:, :, 128:], v[:, :, 128:], merged, acc_lse, False, scale)
    errs = [(merged - ref).abs().max(), (dq1 + dq2 - leaves[0].grad).abs().max(),
            (torch.cat([dk1, dk2], 2) - leaves[1].grad).abs().max()]
    return ", ".join(f"{float(e):.1e}" for e in errs)


def _packed_blocks_error(heads: int, kv: int, d: int, dev) -> str:
    """A packed row's ring-step blocks (all causal; all full) as one varlen flash call against one
    call per sequence, forward and backward, bf16: the CP path on packed rows on CUDA."""
    from megatron_rl.ops import cp_attention

    if not cp_attention.attention_kernels.varlen_ready(torch.empty(0, device=dev, dtype=torch.bfloat16)):
        return "n/a (needs CUDA)"
    g = torch.Generator(device="cpu").manual_seed(1)
    cu = (0, 64, 96, 224)  # three sequences of one packed row, CP=2 shards
    local = cu[-1] // 2
    q, do = (torch.randn(1, heads, local, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, kv, local, d, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    errors = []
    for src in (1, 0):  # rank 1 against its own keys (causal), then rank 0's (full)
        pairs = cp_attention.block_pairs(cu, 2, 1, src)
        blocks = cp_attention.packed_blocks(pairs, q.device)
        outs = []
        for packed in (True, False):
            acc_out, acc_lse = cp_attention._accumulators(q)
            acc_out.zero_(), acc_lse.fill_(float("-inf"))
            if packed:
                cp_attention._packed_block_forward(q, k, v, blocks, d**-0.5, acc_out, acc_lse, first=True)
            else:
                for (qa, qe), (ka, ke), causal in pairs:
                    out, lse = cp_attention.attention_forward(q[..., qa:qe, :], k[..., ka:ke, :], v[..., ka:ke, :],
                                                              causal, d**-0.5)
                    acc_out[..., qa:qe, :].copy_(out), acc_lse[..., qa:qe].copy_(lse)
            dq, dkv = torch.zeros_like(acc_out), torch.zeros(1, kv, local, 2 * d, device=dev)
            if packed:
                cp_attention._packed_block_backward(do, q, k, v, acc_out, acc_lse, blocks, d**-0.5, dq, dkv, d)
            else:
                for pair in pairs:
                    cp_attention._block_backward(do, q, k, v, acc_out, acc_lse, (pair,), d**-0.5, dq, dkv, d)
            outs.append((acc_out, dq, dkv))
        errors += [float((a - b).abs().max()) for a, b in zip(*outs)]
    return ", ".join(f"{e:.1e}" for e in errors)


def section_sdpa(check: Check):
    """The paths on the full model's head shape (2 layers are enough to see the kernels)."""
    from megatron_rl.data.microbatch import build_microbatch
    from megatron_rl.distributed.runtime import init_model_parallel
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.ops import cp_attention
    from megatron_rl.rollout.megatron import MegatronRolloutEngine
    from megatron_rl.rollout.sampling import SamplingParams

    init_model_parallel(ParallelLayout())
    model_cfg = dataclasses.replace(_model_config(check), num_layers=2)
    chunk = build_gpt_chunks(model_cfg, ParallelLayout(), check.device)[0]
    dev = check.device
    g = torch.Generator().manual_seed(0)
    seqs = [{"tokens": torch.randint(0, 100, (n,), generator=g)} for n in (96, 40, 7)]

    def trainer_pass(packed: bool):
        mb = build_microbatch(seqs, [0, 1, 2], packed=packed)
        inputs = mb.to(dev, ["tokens", "position_ids"])
        hidden = chunk(inputs["tokens"], inputs["position_ids"], None, packed_seq_params=mb.packed_seq_params(dev))
        hidden.float().sum().backward()

    yield ("(c) SDPA: trainer, CP=1 BSHD rows (is_causal, GQA)", _probe(lambda: trainer_pass(False)))
    yield ("(c) SDPA: trainer, CP=1 packed THD (is_causal per sequence)", _probe(lambda: trainer_pass(True)))

    heads, kv = model_cfg.num_attention_heads, model_cfg.num_query_groups
    d = model_cfg.hidden_size // heads
    for dtype in (torch.bfloat16, torch.float32):
        yield (f"(c) fused kernels with LSE, {str(dtype)[6:]}: two key blocks merged vs SDPA (max |d| out, dq, dk)",
               _lse_merge_error(heads, kv, d, dtype, dev))
    yield ("(c) CP on packed rows: one varlen flash call per ring step vs per sequence (causal out, dq, dkv; "
           "full out, dq, dkv)", _packed_blocks_error(heads, kv, d, dev))
    world = torch.distributed.group.WORLD

    def cp_path(comm: str):  # the real autograd function on a CP group of one rank
        q, k, v = (torch.randn(1, n, 256, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for n in (heads, kv, kv))
        out = cp_attention.context_parallel_attention(q, k, v, (0, 256), world, d**-0.5, comm)
        out.float().sum().backward()

    for comm in ("p2p", "all_gather", "a2a"):
        yield (f"(c) {comm} CP path (fused kernels; CP=1 here)", _probe(lambda: cp_path(comm)))

    engine = MegatronRolloutEngine(model_cfg, dev, max_batch_size=8)  # rollout.batching=auto
    engine.load_from_chunks([chunk])
    recorder = sdpa_recorder()
    with _SdpaCounter() as counter, recorder:
        engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 4, SamplingParams(max_new_tokens=4), seed=0)
    prefill = [c for c in recorder.calls if c[1] > 1]
    decode = [c for c in recorder.calls if c[1] == 1]
    how = f"megatron engine, {engine.last_batching} batching"
    yield (f"(c) SDPA: rollout prefill ({how})", backends_seen(prefill, counter.count(decode=False)))
    yield (f"(c) SDPA: rollout decode (KV cache, {how})", backends_seen(decode, counter.count(decode=True)))


# ----------------------------------------------------------------------------- (d) MFU


def model_flops_per_token(model_cfg, seq_len: float) -> float:
    """Training FLOPs per token (forward + backward): 6 per weight of the layers and the output
    projection, plus causal attention 6 * seq * heads * head_dim per layer."""
    from megatron_rl.layout.arch import attention_dims
    from megatron_rl.planner.memory import layer_params

    heads, _, d = attention_dims(model_cfg)
    dense = layer_params(model_cfg) * model_cfg.num_layers + model_cfg.vocab_size * model_cfg.hidden_size
    return 6 * dense + 6 * model_cfg.num_layers * seq_len * heads * d


def section_mfu(check: Check):
    rows = check.facts.get("ppo_rows") or read_metrics(check)
    if not rows:
        raise RuntimeError("no PPO step ran (section a)")
    row = rows[-1]
    model_cfg = _model_config(check)
    samples = check.run["prompts"] * check.run["n"]
    tokens = float(row["throughput/total_tokens_per_s"]) * float(row["timing/step_s"])
    seq = tokens / samples
    cfg = check.facts["cfg"]
    flops = model_flops_per_token(model_cfg, seq) * tokens * cfg.algorithm.ppo_epochs
    update_s = float(row["timing/actor_update_s"])
    ppo_tflops = flops / update_s / 1e12
    base_tflops, base_shape = _plain_megatron_tflops(check, model_cfg, int(seq), samples)
    peak = H200_BF16_TFLOPS
    yield ("(d) actor update MFU (step %d, %d tokens x %d epoch)"
           % (row.get("step", 0), tokens, cfg.algorithm.ppo_epochs),
           f"{ppo_tflops:.3g} TFLOP/s = {100 * ppo_tflops / peak:.3g}% of {peak:.0f}")
    # Not like for like: the update's time holds its optimizer step and two micro-batches; row (g)
    # compares the update with megatron's whole training step on the same micro-batches.
    yield (f"(d) plain megatron-core fwd+bwd without optimizer step, same model, {base_shape}",
           f"{base_tflops:.3g} TFLOP/s = {100 * base_tflops / peak:.3g}%; "
           f"PPO update (with its optimizer step) / plain fwd+bwd = {ppo_tflops / base_tflops:.2f}")


def _plain_megatron_tflops(check: Check, model_cfg, seq: int, samples: int) -> tuple[float, str]:
    """megatron's GPTModel with the same layer spec and config, its own output layer and
    cross-entropy, one packed micro-batch of the update's token budget, no RL machinery."""
    from megatron.core.models.gpt import GPTModel

    from megatron_rl.data.microbatch import build_microbatch
    from megatron_rl.distributed.runtime import init_model_parallel
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.models.builder import build_gpt_chunks

    init_model_parallel(ParallelLayout())
    model = build_gpt_chunks(model_cfg, ParallelLayout(), check.device, model_cls=GPTModel)[0]
    budget = check.run["tokens_per_microbatch"]
    per_mb = max(1, budget // max(seq, 1))
    g = torch.Generator().manual_seed(0)
    seqs = [{"tokens": torch.randint(0, model_cfg.vocab_size, (seq,), generator=g)} for _ in range(per_mb)]
    mb = build_microbatch(seqs, list(range(per_mb)), packed=True)
    inputs = mb.to(check.device, ["tokens", "position_ids", "labels"])
    params = mb.packed_seq_params(check.device)

    def step():
        loss = model(inputs["tokens"], inputs["position_ids"], None, labels=inputs["labels"],
                     packed_seq_params=params)
        loss.float().mean().backward()

    for _ in range(2):
        step()
    _sync(check)
    iters = 2 if check.cpu else 10
    began = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(check)
    seconds = (time.perf_counter() - began) / iters
    tokens = per_mb * seq
    tflops = model_flops_per_token(model_cfg, seq) * tokens / seconds / 1e12
    return tflops, f"{per_mb} x {seq} tokens packed"


def _sync(check: Check) -> None:
    if not check.cpu:
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------- (e) memory


def section_memory(check: Check):
    from megatron_rl.planner.memory import GiB, estimate
    from megatron_rl.planner.option import PlanOption

    cfg = check.facts.get("cfg")
    if cfg is None:
        raise RuntimeError("no PPO config (section a did not start)")
    budget = (torch.cuda.get_device_properties(0).total_memory if not check.cpu else 80 * GiB)
    plan = estimate(cfg.model, PlanOption.of(sequence_parallel=False), prompt_len=cfg.data.max_prompt_tokens,
                    response_len=cfg.rollout.max_new_tokens, tokens_per_microbatch=cfg.batch.max_tokens_per_rank,
                    budget_bytes=budget, max_rollout_batch=cfg.rollout.max_batch_size,
                    with_critic=check.critic, with_reference=cfg.algorithm.kl_coef > 0)
    measured = check.facts.get("ppo_peak_gib", 0.0)
    planned = plan.total / GiB
    ratio = f"{measured / planned:.2f}" if planned else "n/a"
    yield ("(e) peak memory of the PPO runs vs planner",
           f"measured {measured:.2f} GiB (max_memory_allocated), planner {planned:.2f} GiB "
           f"(rollout batch {plan.rollout_batch}); measured / planned = {ratio}")


# ----------------------------------------------------------------------------- (f) generation


def section_generation(check: Check):
    rows = check.facts.get("ppo_rows") or read_metrics(check)
    if not rows:
        raise RuntimeError("no PPO step ran (section a)")
    row = rows[-1]
    samples = check.run["prompts"] * check.run["n"]
    generated = float(row["response_length/mean"]) * samples
    seconds = float(row["timing/rollout_s"])
    from megatron_rl.capabilities import paged_kernels_installed
    from megatron_rl.rollout.choice import AUTO, pick_batching

    # The PPO runs leave rollout.batching at its default, auto (a dense model, no partial rollouts).
    batching = pick_batching(AUTO, moe=False, partial=False,
                             paged_kernels=check.device.type == "cuda" and paged_kernels_installed())
    yield (f"(f) generation, megatron engine, {batching} batching (auto), {samples} samples x <= "
           f"{check.run['new_tokens']} tokens",
           f"{generated / seconds:.0f} tokens/s ({generated:.0f} tokens in {seconds:.2f} s, prefill included)")


# ----------------------------------------------------------------------------- (g) update vs plain

GPU_PROFILE = dict(model="qwen2.5-1.5b", tokens=8192, microbatches=4, seq_len=1024, rounds=2)
CPU_PROFILE = dict(model="tiny", tokens=256, microbatches=2, seq_len=32, rounds=1)


def section_update_profile(check: Check):
    import update_vs_plain as uvp

    from megatron_rl.planner.memory import model_state, peak_bytes
    from megatron_rl.planner.option import PlanOption

    prof = CPU_PROFILE if check.cpu else GPU_PROFILE
    args = uvp.parse(["--model", prof["model"], "--tokens-per-microbatch", str(prof["tokens"]),
                      "--microbatches", str(prof["microbatches"]), "--seq-len", str(prof["seq_len"]),
                      "--rounds", str(prof["rounds"]), "--build-and-load"])
    uvp.init_world(check.device)
    setup = uvp.build_setup(args, check.device)
    result = uvp.measure(args, setup, log=lambda *a, **k: print(*a, file=sys.stderr, flush=True))
    out = uvp.report(args, setup, result)
    m = setup.model_cfg
    shape = (f"{m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}, {m.params_dtype}; "
             f"{setup.real_tokens} tokens in {len(setup.groups)} micro-batches of <= {setup.budget}")
    yield ("(g) model and batch", shape)
    flops_per_token = model_flops_per_token(m, setup.real_tokens / len(setup.seqs))
    for name, seconds, tps, ratio in out["rows"]:
        tflops = flops_per_token * tps / 1e12
        yield (f"(g) {name}", f"{tps:.0f} tokens/s = {tflops:.3g} TFLOP/s ({100 * tflops / H200_BF16_TFLOPS:.3g}% "
                              f"MFU); {ratio:.2f}x megatron-core; {seconds:.3f} s/step")
    for name, seconds, tps, ratio in out["forward_rows"]:
        yield (f"(g) forward: {name}", f"{tps:.0f} tokens/s; {ratio:.2f}x megatron-core; {seconds:.3f} s")
    steady = out["medians"][uvp.RL_PIECES[-1]]
    yield ("(g) first step vs steady step (all pieces)",
           f"first {out['first'][uvp.RL_PIECES[-1]]:.2f} s (after megatron's first step warmed the process), "
           f"steady {steady:.3f} s; megatron-core first {out['first'][uvp.PLAIN]:.2f} s")
    yield ("(g) build (model + DDP + optimizer, random init)",
           f"ours {out['build_s']['ours']:.1f} s, megatron-core GPTModel {out['build_s']['plain']:.1f} s")
    yield ("(g) loss parity: our -mean log-prob vs megatron's cross-entropy, same weights",
           f"|d| = {out['loss_parity']:.2e}")
    loads = out["build_and_load_s"]
    yield ("(g) build + load of weights and optimizer state",
           f"ours {loads['ours']:.1f} s (load_checkpoint: manifest, sha256, dist_checkpointing), megatron-core "
           f"{loads['megatron']:.1f} s (GPTModel + dist_checkpointing.load): {loads['ours'] / loads['megatron']:.2f}x; "
           f"weights restored exactly: {loads['ours_weights_equal']}")
    if not check.cpu:
        option = PlanOption.of(sequence_parallel=False)
        state = model_state(m, option, with_critic=False, with_reference=False, param_bytes=2)
        planned = (state["actor weights"] + state["actor grads"] + state["actor optimizer"]
                   + peak_bytes(m, option, setup.budget, 2, seq_len=max(int(s["tokens"].numel()) for s in setup.seqs)))
        name = uvp.RL_PIECES[-1]  # by its warm-up both models hold weights, gradients and Adam state
        held = result["allocated_before"][name]
        measured = result["peak_bytes"][name] - held / 2
        yield ("(g) peak memory of the update vs planner (peak of its first step less megatron's model, "
               "half of what both held)",
               f"measured {measured / 2**30:.2f} GiB, planner {planned / 2**30:.2f} GiB; "
               f"measured / planned = {measured / planned:.2f}")


# ----------------------------------------------------------------------------- (h) generation vs HF

GEN_GPU = ["--model", "qwen2.5-1.5b", "--concurrency", "64", "256", "--new-tokens", "512"]
GEN_CPU = ["--model", "tiny", "--concurrency", "4", "--new-tokens", "8", "--prompt-len", "16", "--prefix-len", "64",
           "--prefix-prompts", "2"]


def section_generation_vs_hf(check: Check):
    """megatron's dynamic engine (paged attention auto: the Triton kernel without flash-attn; CUDA graphs)
    against HF generate at a Qwen2.5-1.5B shape (benchmarks/engine_vs_hf.py)."""
    import engine_vs_hf
    import update_vs_plain as uvp

    uvp.init_world(check.device)
    args = engine_vs_hf.parse(GEN_CPU if check.cpu else GEN_GPU)
    for name, text in engine_vs_hf.measure(args, log=lambda *a: None):
        yield (f"(h) {name}", text)


# ----------------------------------------------------------------------------- main


def table(rows: list[tuple[str, str]]) -> str:
    width = max((len(name) for name, _ in rows), default=5)
    lines = [f"| {'check':<{width}} | result |", f"|{'-' * (width + 2)}|--------|"]
    lines += [f"| {name:<{width}} | {result} |" for name, result in rows]
    return "\n".join(lines)


def section_environment(check: Check):
    import megatron.core

    gpu = "CPU dry run" if check.cpu else torch.cuda.get_device_name(0)
    yield ("environment", f"{gpu}; torch {torch.__version__}; megatron-core {megatron.core.__version__}; "
                          f"backend {check.facts.get('backend')}; world size 1")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table (markdown) here")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip sections starting after this many seconds")
    parser.add_argument("--critic", action="store_true", help="PPO with GAE and a critic instead of GRPO")
    parser.add_argument("--cpu-dry-run", action="store_true", help="run every section on the CPU with a tiny model")
    parser.add_argument("--sections", default="abcdefgh",
                        help="the sections to run, by letter (default: all); e.g. --sections h")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    # A hang (a collective that never completes) still ends the run, with every thread's stack.
    faulthandler.dump_traceback_later(args.budget_s + 120, exit=True)
    check = Check(cpu=args.cpu_dry_run, budget_s=args.budget_s, critic=args.critic)
    check.section("setup: world size 1", section_setup)
    check.section("environment", section_environment)
    for name, fn in [("(a) PPO step", section_ppo), ("(b) score vs HF", section_score),
                     ("(c) SDPA backends", section_sdpa), ("(d) MFU", section_mfu),
                     ("(e) memory", section_memory), ("(f) generation", section_generation),
                     ("(g) update vs megatron-core", section_update_profile),
                     ("(h) generation vs HF generate", section_generation_vs_hf)]:
        if name[1] in args.sections:
            check.section(name, fn)
    check.rows.append(("total time", f"{check.elapsed():.0f} s"))
    text = table(check.rows)
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
