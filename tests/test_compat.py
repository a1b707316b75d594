"""The CPU compatibility layer: when it is applied, and which megatron-core call sites it rewrites."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_rl.testing.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def traced_step():
    """Run one TP2+SP, PP-free training step with tracing on; return the rewritten call sites."""
    import torch

    from megatron_rl.compat import cpu
    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.engine.pipeline import run_microbatches
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.tools.smoke import lm_forward_step, lm_microbatches, synthetic_sequences

    cpu.set_trace(True)
    try:
        layout = use_layout(tp=2, sp=True)
        chunks = build_gpt_chunks(ModelConfig(), layout, torch.device("cpu"))
        trainable = make_trainable(chunks, OptimConfig(), total_steps=1)
        mbs = lm_microbatches(synthetic_sequences(0, 2, 16, 128, 1), 2, 1, 0)
        trainable.zero_grad()
        run_microbatches(trainable.chunks, mbs, lm_forward_step(torch.device("cpu")),
                         forward_only=False, seq_length=16)
        trainable.step()
    finally:
        cpu.set_trace(False)
    return cpu.cpu_compat_trace()


def test_cpu_trace_lists_megatron_call_sites():
    trace = run_distributed(2, traced_step)[0]
    files = {site.split(":")[0] for site in trace}
    print("\n".join(sorted(trace)))
    # The megatron-core 0.16.1 call sites this path sends to CUDA (device="cuda" factories and
    # the 'torch.cuda.FloatTensor' check in grad clipping).  Buffers built on
    # torch.cuda.current_device() need no rewrite: the stand-in returns the CPU.  A megatron-core
    # release that moves or adds sites changes this set: re-run the parity tests, then update it.
    assert files == {
        "megatron/core/optimizer/clip_grads.py",
        "megatron/core/optimizer/optimizer.py",
        "megatron/core/pipeline_parallel/schedules.py",
        "megatron/core/utils.py",
    }
    assert any("clip_grads.py" in site and "Tensor.type()" in site for site in trace)
    assert all(site.startswith("megatron/core/") for site in trace)


# Run in a fresh interpreter: patches cannot be undone, and this process must stay unpatched.
_PROBE = """
import json, sys
import torch
from megatron_rl.compat import enable_compat
from megatron_rl.compat.registry import all_patches, apply_patches, applied_patches
if sys.argv[1] == "cuda":
    from megatron_rl.compat import cpu, megatron_fixes  # noqa: F401  (register their patches)
    apply_patches(cpu=False)
else:
    enable_compat()
try:
    device = torch.zeros(1, device="cuda").device.type
except (AssertionError, RuntimeError):  # torch without CUDA refuses the factory
    device = "refused"
print(json.dumps({"applied": applied_patches(), "cpu_only": [p.name for p in all_patches() if p.cpu_only],
                  "everywhere": [p.name for p in all_patches() if not p.cpu_only], "device": device}))
"""


def _probe(mode: str, force_cpu: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_RL_FORCE_CPU"}
    if force_cpu is not None:
        env["MEGATRON_RL_FORCE_CPU"] = force_cpu
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_layer_is_not_applied_with_cuda_flag_off():
    """What a CUDA process applies: the patches needed everywhere, none of the CPU layer, so a
    ``device="cuda"`` factory is left alone (on a machine without CUDA, torch refuses it)."""
    out = _probe("cuda", None)
    assert out["cpu_only"] and out["everywhere"], out
    assert set(out["applied"]) == set(out["everywhere"]), out
    assert out["device"] == ("cuda" if torch.cuda.is_available() else "refused"), out


@pytest.mark.parametrize("force_cpu", [None, "1"], ids=["default", "forced"])
def test_cpu_layer_follows_cuda_and_the_force_cpu_switch(force_cpu):
    """``enable_compat`` applies the CPU layer when CUDA is absent or MEGATRON_RL_FORCE_CPU=1, and
    then sends ``device="cuda"`` to the CPU."""
    out = _probe("auto", force_cpu)
    cpu_layer = force_cpu == "1" or not torch.cuda.is_available()
    assert set(out["everywhere"]) <= set(out["applied"]), out
    assert (set(out["cpu_only"]) <= set(out["applied"])) == cpu_layer, out
    if cpu_layer:
        assert out["device"] == "cpu", out


def _megatron_unpatched_rope_utils():
    """A fresh copy of megatron's rope_utils module, untouched by our patches."""
    import importlib.util

    from megatron.core.models.common.embeddings import rope_utils

    spec = importlib.util.spec_from_file_location("rope_utils_unpatched", rope_utils.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("exact", [False, True])
def test_thd_rope_patch_equals_megatrons_own(cp_size, exact):
    """The THD RoPE patch gathers every sequence's frequencies with one cached index; it must give
    megatron's own per-sequence slices bit for bit, on every CP rank, for packed offsets too."""
    from megatron_rl.compat import rope_host_seqlens
    from megatron_rl.ops.zigzag import with_host_values

    original = _megatron_unpatched_rope_utils()._apply_rotary_pos_emb_thd
    gen = torch.Generator().manual_seed(cp_size)
    lengths = [4 * cp_size * n for n in (1, 3, 2, 5)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    freqs = torch.randn(cu[-1] if exact else max(lengths), 1, 1, 8, generator=gen)
    for rank in range(cp_size):
        t = torch.randn(cu[-1] // cp_size, 3, 8, generator=gen)
        group = _Group(cp_size, rank)
        want = original(t, torch.tensor(cu), freqs, cp_group=group)
        got = rope_host_seqlens._apply_rotary_pos_emb_thd_host(
            t, with_host_values(torch.tensor(cu), cu), freqs, cp_group=group)
        assert torch.equal(got, want), (cp_size, rank, exact)


def test_cpu_placement_wraps_every_torch_call_that_takes_a_device():
    """The CPU layer wraps a fixed list of torch calls; a torch upgrade that adds a factory must
    show up here, not as a CUDA error deep in megatron."""
    from megatron_rl.compat import cpu

    takes_a_device = set()
    for schema in torch._C._jit_get_all_schemas():
        name = schema.name.removeprefix("aten::")
        if schema.name.startswith("aten::") and not name.startswith("_") and \
                any(a.name in ("device", "pin_memory") for a in schema.arguments):
            takes_a_device.add(name)
    functions = {n for n in takes_a_device if hasattr(torch, n)} - {"Generator", "empty_quantized", "from_file"}
    functions -= {n for n in functions if n.startswith("sparse_") and n != "sparse_coo_tensor"}
    methods = {n for n in takes_a_device if hasattr(torch.Tensor, n)} - {"is_pinned", "pin_memory", "to"}
    assert functions <= set(cpu.TORCH_FACTORIES), sorted(functions - set(cpu.TORCH_FACTORIES))
    assert methods <= set(cpu.TENSOR_FACTORIES), sorted(methods - set(cpu.TENSOR_FACTORIES))


def test_cpu_placement_rewrites_cuda_requests_and_leaves_other_calls_alone():
    """With the CPU layer applied, CUDA placements land on the CPU."""
    from megatron_rl.compat import cuda_available, enable_compat

    if cuda_available():
        pytest.skip("the CPU layer is applied only where CUDA is absent")
    enable_compat()
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.tensor([1.0], device=0).device.type == "cpu"
    assert torch.empty(3, pin_memory=True).device.type == "cpu"
    x = torch.ones(2)
    assert x.to("cuda").device.type == "cpu" and x.to(torch.device("cuda", 0)).device.type == "cpu"
    assert x.to(device="cuda", dtype=torch.float64).dtype == torch.float64
    assert x.to(torch.float16).dtype == torch.float16  # a dtype is not a device
    assert x.new_zeros(3, device="cuda").device.type == "cpu"
    assert x.cuda() is x
    assert x.type() == "torch.cuda.FloatTensor" and x.type(torch.float64).dtype == torch.float64
    assert torch.add(x, x).device.type == "cpu"


def save_twice_and_list_new_children(root: str):
    """Save a checkpoint twice in a worker; return the child processes the saves left running and
    whether a reload gives back the saved weights."""
    import psutil
    import torch

    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.engine import checkpoint
    from megatron_rl.engine.trainable import make_trainable
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.testing.layouts import use_layout

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    layout = use_layout()
    trainable = make_trainable(build_gpt_chunks(ModelConfig(), layout, torch.device("cpu")), OptimConfig(), 1)
    parts = {"actor": checkpoint.ModelPart(trainable.chunks, trainable.optimizer, trainable.scheduler)}
    for step in (1, 2):
        path = checkpoint.save_checkpoint(root, step, parts)
    saved = [p.detach().clone() for c in trainable.chunks for p in c.parameters()]
    with torch.no_grad():
        for c in trainable.chunks:
            for p in c.parameters():
                p.zero_()
    checkpoint.load_checkpoint(path, {"actor": checkpoint.ModelPart(trainable.chunks)}, with_optimizer=False)
    same = all(torch.equal(a, p) for a, p in zip(saved, (p for c in trainable.chunks for p in c.parameters())))
    new = [" ".join(p.cmdline())[:120] for p in psutil.Process().children(recursive=True) if p.pid not in before]
    return new, same


def test_a_checkpoint_save_starts_no_helper_process(tmp_path):
    """megatron-core hands each save's write results through a multiprocessing Manager queue whose
    server is a spawned Python process; it imports torch on the first save (seconds per rank) and
    outlives the save.  Our saves are synchronous, so the results stay in the process."""
    new, same = run_distributed(1, save_twice_and_list_new_children, str(tmp_path))[0]
    assert same
    assert new == [], f"the saves left helper processes running: {new}"


_IMPORT_PROBE = """
import json, sys, time
import megatron_rl, torch
start = time.perf_counter()
import megatron.core, megatron.core.models.gpt, megatron.core.pipeline_parallel, megatron.core.optimizer
seconds = time.perf_counter() - start
loaded = "torch._dynamo" in sys.modules
from megatron.core.fusions.fused_bias_gelu import bias_gelu
x, b = torch.randn(4, 8), torch.randn(8)
want = x + b
want = want * 0.5 * (1.0 + torch.tanh(0.79788456 * want * (1 + 0.044715 * want * want)))
got = bias_gelu(b, x)
print(json.dumps({"compiler_loaded_by_import": loaded, "seconds": seconds,
                  "real_compile_restored": not hasattr(torch.compile, "_megatron_rl_deferred"),
                  "compiled_on_first_call": "torch._dynamo" in sys.modules,
                  "max_diff": float((got - want).abs().max())}))
"""


def test_megatron_import_does_not_load_the_compiler_and_kernels_compile_when_called():
    """megatron-core wraps its fused kernels in torch.compile at import; the wrappers are made at
    the first call instead, and that call gives the kernel's numbers.  TORCHDYNAMO_DISABLE: the
    first call goes through torch.compile (loading torch._dynamo) and runs the kernel eagerly,
    instead of 40 s of inductor's C++ build."""
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"import megatron.core and its model / pipeline / optimizer packages: {got['seconds']:.2f} s")
    assert got["compiler_loaded_by_import"] is False
    assert got["real_compile_restored"] and got["compiled_on_first_call"]
    assert got["max_diff"] < 1e-5


_ONE_GRAPH_PROBE = """
import json, torch
from torch._dynamo.utils import counters
from megatron_rl.compat.deferred_compile import _deferred

def gated(y):
    a, b = torch.chunk(y, 2, -1)
    return torch.nn.functional.silu(a) * b

kernel = _deferred(torch.compile)(gated, backend="eager")
same = True
for length in (12, 17, 30, 5):
    y = torch.randn(length, 2, 16)
    same = same and torch.equal(kernel(y), gated(y))
print(json.dumps({"same": bool(same), "graphs": counters["stats"]["unique_graphs"]}))
"""


def test_deferred_compile_makes_one_graph_for_every_length():
    """megatron's fused kernels see a new token count at nearly every RL call.  Compiled at the
    first call with the token dimension symbolic, a kernel has one graph for all lengths; left to
    dynamo, it compiled a static graph and then a dynamic one (two compilations of every kernel on
    a cold machine, each 1-20 s).  In a fresh process: dynamo's counters are process-wide."""
    out = subprocess.run([sys.executable, "-c", _ONE_GRAPH_PROBE], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["same"]
    assert got["graphs"] == 1, got
