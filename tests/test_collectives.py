"""Host-side collectives work on any process group, NCCL-only ones included.

An NCCL group serves CUDA tensors only: an all-reduce of a CPU tensor on it fails with "No backend
type associated with device type cpu" -- the crash of the first multi-GPU step when metrics,
micro-batch counts or stop flags were reduced as CPU tensors on the world group.  A gloo group
registered for CUDA only (``backend="cuda:gloo"``) fails the same way on this CPU machine, which
shows the failure is real here; the CPU cannot hold a CUDA tensor, so the fix is proven in three
parts: the module places values on the device the group serves (checked on real groups), every
host-side collective the package runs goes through the module (checked while the call sites
run), and no collective anywhere in the package bypasses it outside the device-side code that
already holds device tensors (checked on the source).
"""

from __future__ import annotations

import ast
import os
import sys

from megatron_rl.rollout.engine import RolloutEngineBase
from megatron_rl.testing.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_rl")
MODULE = "megatron_rl.distributed.collectives"

TENSOR_COLLECTIVES = {
    "all_reduce", "all_gather", "broadcast", "reduce", "gather", "scatter", "reduce_scatter", "all_to_all",
    "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "batch_isend_irecv", "isend",
    "irecv", "send", "recv",
}
P2P = {"batch_isend_irecv", "isend", "irecv", "send", "recv"}
HOST_COLLECTIVES = {
    "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "send_object_list", "recv_object_list",
}
# Modules whose tensor collectives move device tensors the model computed, on the model's groups.
DEVICE_SIDE = {
    "megatron_rl/ops/logprob.py": "vocab-parallel logit statistics",
    "megatron_rl/ops/cp_attention.py": "K/V gathers and ring exchanges",
    "megatron_rl/data/microbatch.py": "the head's per-token outputs over CP",
    "megatron_rl/models/canonical.py": "weight and gradient shards over TP",
    "megatron_rl/models/lora/quantized_base.py": "an int8 base's row maxima and input gradients over TP",
    "megatron_rl/rollout/static_batching.py": "the last pipeline stage's draws",
    "megatron_rl/trainer/update.py": "per-sequence sums of the loss's tensors over CP",
    "megatron_rl/compat/megatron_fixes.py": "megatron's pipeline shape exchange, re-ordered (device tensors)",
}


def test_served_device_types_and_where_host_values_travel():
    from megatron_rl.distributed.collectives import served_device_types, transfer_device_type

    cases = {
        "cuda:nccl": (("cuda",), "cuda"),
        "nccl": (("cuda",), "cuda"),
        "cpu:gloo,cuda:nccl": (("cpu", "cuda"), "cpu"),
        "cpu:gloo,cuda:gloo": (("cpu", "cuda"), "cpu"),
        "gloo": (("cpu", "cuda"), "cpu"),
        "cuda:gloo": (("cuda",), "cuda"),
    }
    for config, (served, device) in cases.items():
        assert served_device_types(config) == served, config
        assert transfer_device_type(served) == device, config


def real_groups_body():
    import torch
    import torch.distributed as dist

    from megatron_rl.distributed import collectives

    cuda_only = dist.new_group(backend="cuda:gloo")
    try:
        dist.all_reduce(torch.ones(1), group=cuda_only)
        error = None
    except RuntimeError as err:
        error = str(err)
    summed = collectives.all_reduce(torch.tensor([1.0, float(dist.get_rank())]))
    out = {"cuda_only": collectives.group_device_type(cuda_only), "world": collectives.group_device().type,
           "error": error, "sum": summed.tolist(), "max": collectives.agree_max(dist.get_rank() * 5),
           "any": collectives.agree_any(dist.get_rank() == 1),
           "objects": collectives.all_gather_object(dist.get_rank()),
           "broadcast": collectives.broadcast_object(f"from {dist.get_rank()}", src=1),
           # rank 0 sends nothing, rank 1 three values
           "varlen": [t.tolist() for t in collectives.all_gather_varlen(torch.arange(3 * dist.get_rank()) + 0.5)]}
    dist.destroy_process_group(cuda_only)
    return out


def test_module_puts_host_values_where_the_group_needs_them():
    got = run_distributed(2, real_groups_body)
    for out in got:
        # What the old call sites did -- a CPU tensor on a group without a CPU backend -- fails here.
        assert "No backend type associated with device type cpu" in out["error"]
        assert (out["cuda_only"], out["world"]) == ("cuda", "cpu")
        assert out["sum"] == [2.0, 1.0] and out["max"] == 5 and out["any"] is True
        assert out["objects"] == [0, 1] and out["broadcast"] == "from 1"
        assert out["varlen"] == [[], [0.5, 1.5, 2.5]]


class _Recorder:
    """Wraps torch.distributed's collectives and records which module called each."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.calls: list[tuple[str, str]] = []
        # Point-to-point ops stay unwrapped: P2POp checks it was given torch's own isend/irecv.
        self.originals = {name: getattr(dist, name) for name in (TENSOR_COLLECTIVES - P2P) | HOST_COLLECTIVES
                          if hasattr(dist, name)}

    def __enter__(self):
        for name, fn in self.originals.items():
            setattr(self.dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(self.dist, name, fn)

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "?")
            if caller.startswith("megatron_rl."):
                self.calls.append((caller, name))
            return fn(*args, **kwargs)

        return wrapper


class _OneTokenEngine(RolloutEngineBase):
    """A rollout engine stand-in: one response token per sample."""

    def generate(self, prompt_ids, params, seed):
        from megatron_rl.rollout.engine import RolloutBatch

        n = params.n * len(prompt_ids)
        return RolloutBatch(prompt_index=[i // params.n for i in range(n)],
                            prompt_ids=[prompt_ids[i // params.n] for i in range(n)],
                            response_ids=[[seed % 7] for _ in range(n)], response_logprobs=[[-1.0]] * n,
                            finish_reason=["length"] * n)


def host_call_sites_body():
    """Run the package's host-side collectives (DP2, then PP2) and return who called torch for each."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.data.batching import plan_microbatches
    from megatron_rl.distributed.metrics import reduce_sum_count, reduce_sums
    from megatron_rl.engine import checkpoint
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.rollout.dp import generate_data_parallel
    from megatron_rl.rollout.sampling import SamplingParams
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.trainer.signals import StopRequest

    model = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64,
                        params_dtype="float32")
    seqs = [{"tokens": torch.arange(n) % 64} for n in (5, 9, 3, 7)]
    values = {}
    with _Recorder() as rec:
        for layout_kw in (dict(), dict(pp=2)):
            layout = use_layout(**layout_kw)
            values["mean"] = reduce_sum_count([{"x": torch.tensor([3.0, 2.0])}], ["x"])["x"]
            values["sum"] = reduce_sums([{"x": torch.tensor(1.5)}], ["x"])["x"]
            values["plan"] = plan_microbatches([5, 9, 3], [0, 1, 2][: 1 + ps.get_data_parallel_rank() * 2],
                                               max_tokens_per_rank=None, micro_batch_size=1, cp=1, align=1,
                                               packed=True, dp_group=ps.get_data_parallel_group())
            stop = StopRequest()
            values["stop"] = stop.agreed()
            stop.restore()
            batch = generate_data_parallel(_OneTokenEngine(), [[1, 2], [3], [4, 5]], SamplingParams(n=2), seed=3)
            values["rollout"] = len(batch.response_ids)
            chunks = build_gpt_chunks(model, layout, torch.device("cpu"))
            with torch.no_grad():
                outs, _ = run_sequences(chunks, seqs, LogProbHead(), BatchPlan(micro_batch_size=2), torch.device("cpu"))
            values["scored"] = [len(o["logprob"]) for o in outs]
            values["weights"] = len(gather_canonical(chunks))
            checkpoint._barrier()
    use_layout()
    return sorted(set(rec.calls)), values


def test_host_side_collectives_go_through_the_module():
    """Metrics, agreed micro-batch counts, the stop flag, the rollout gather, the gathers of model
    outputs and weights, and checkpoint barriers: each reaches torch through the module, so none
    can hand an NCCL group a CPU tensor."""
    got = run_distributed(2, host_call_sites_body)
    for calls, values in got:
        assert values["mean"] == 1.5 and values["sum"] == 3.0 and values["stop"] is False
        assert values["rollout"] == 6 and values["scored"] == [5, 9, 3, 7] and values["weights"] > 0
        bypassing = [(caller, name) for caller, name in calls
                     if caller != MODULE and not (name in TENSOR_COLLECTIVES and _path(caller) in DEVICE_SIDE)]
        assert not bypassing, f"host-side collectives that bypass {MODULE}: {bypassing}"
        assert {name for caller, name in calls if caller == MODULE} >= {"all_reduce", "all_gather_object",
                                                                        "broadcast_object_list", "barrier"}


def _path(module: str) -> str:
    return module.replace(".", "/") + ".py"


def _collective_calls(path: str):
    """``(line, name)`` of every torch.distributed collective ``path`` calls or imports by name."""
    tree = ast.parse(open(path).read(), path)
    aliases = {"dist"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for a in node.names:
                if a.name in TENSOR_COLLECTIVES | HOST_COLLECTIVES:
                    yield node.lineno, a.name
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = node.func.attr
            direct = isinstance(owner, ast.Name) and owner.id in aliases
            dotted = (isinstance(owner, ast.Attribute) and owner.attr == "distributed"
                      and isinstance(owner.value, ast.Name) and owner.value.id == "torch")
            if (direct or dotted) and name in TENSOR_COLLECTIVES | HOST_COLLECTIVES:
                yield node.lineno, name


def test_no_collective_in_the_package_bypasses_the_module():
    """Every collective call in megatron_rl/ outside the module is a tensor collective of
    device-side code; object collectives and barriers are host-side by nature."""
    offenders = []
    for dirpath, _, files in os.walk(PACKAGE):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, ROOT)
            if rel == _path(MODULE):
                continue
            for line, call in _collective_calls(path):
                if not (call in TENSOR_COLLECTIVES and rel in DEVICE_SIDE):
                    offenders.append(f"{rel}:{line} dist.{call}")
    assert not offenders, "route these through megatron_rl.distributed.collectives:\n" + "\n".join(offenders)
