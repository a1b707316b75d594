"""GPU settings chosen without a GPU: DDP overlap and buckets, hierarchical CP groups, no CUDA at import."""

from __future__ import annotations

import os

import pytest

from megatron_rl.testing.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ddp_config_overlaps_bucketed_reduction_on_cuda_only():
    from megatron_rl.config.schema import OptimConfig
    from megatron_rl.engine.trainable import ddp_config

    cuda = ddp_config("cuda", OptimConfig())
    assert (cuda.overlap_grad_reduce, cuda.bucket_size, cuda.grad_reduce_in_fp32) == (True, None, True)
    assert not cuda.overlap_param_gather and not cuda.use_distributed_optimizer
    sized = ddp_config("cuda", OptimConfig(grad_reduce_bucket_size=1 << 20, grad_reduce_dtype="bfloat16",
                                           use_distributed_optimizer=True))
    assert (sized.bucket_size, sized.grad_reduce_in_fp32, sized.use_distributed_optimizer) == (1 << 20, False, True)
    assert not ddp_config("cuda", OptimConfig(overlap_grad_reduce=False)).overlap_grad_reduce
    # The CPU keeps what every CPU parity test proves: one bucket after backward, fp32.
    for optim in (OptimConfig(), OptimConfig(grad_reduce_bucket_size=1 << 20)):
        cpu = ddp_config("cpu", optim)
        assert (cpu.overlap_grad_reduce, cpu.bucket_size, cpu.grad_reduce_in_fp32) == (False, None, True)


def overlap_step_body(layout_kw: dict, weights, bucket_size: int):
    """The LM step of test_parallel_parity on this layout with the CUDA DDP settings and small buckets."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.config.schema import ModelConfig, OptimConfig
    from megatron_rl.distributed.metrics import reduce_sum_count
    from megatron_rl.engine.pipeline import run_microbatches
    from megatron_rl.engine.trainable import ddp_config, rebuild_optimizer, wrap_ddp
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.models.canonical import gather_canonical, load_canonical
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.tools.smoke import data_parallel_slice, lm_forward_step, lm_microbatches, synthetic_sequences
    from tests.test_parallel_parity import MODEL, SEQ_LEN, SEQS

    layout = use_layout(**layout_kw)
    chunks = build_gpt_chunks(ModelConfig(**MODEL), layout, torch.device("cpu"))
    load_canonical(chunks, weights)
    settings = ddp_config("cuda", OptimConfig(grad_reduce_bucket_size=bucket_size))
    wrapped = wrap_ddp(chunks, settings=settings)
    buckets = sum(len(g.buckets) for w in wrapped for g in w.bucket_groups)
    trainable = rebuild_optimizer(wrapped, OptimConfig(), 1)
    tokens = synthetic_sequences(0, SEQS, SEQ_LEN, MODEL["vocab_size"], seed=7)
    mbs = lm_microbatches(data_parallel_slice(tokens), 2, 1, ps.get_context_parallel_rank())
    trainable.zero_grad()
    logs = run_microbatches(trainable.chunks, mbs, lm_forward_step(torch.device("cpu")), forward_only=False,
                            seq_length=SEQ_LEN, micro_batch_size=2)
    out = {"loss": reduce_sum_count(logs, ["lm_loss"])["lm_loss"], "grads": gather_canonical(trainable.chunks, "grad"),
           "buckets": buckets, "overlap": wrapped[0].ddp_config.overlap_grad_reduce}
    return out if dist.get_rank() == 0 else None


@pytest.mark.parametrize("world,layout_kw", [(2, {}), (4, dict(pp=2))], ids=["dp2", "dp2_pp2"])
def test_overlapped_bucketed_grad_reduce_gives_the_same_gradients(world, layout_kw):
    """Overlap changes when buckets are reduced, not what they hold: on gloo with the CUDA settings
    and small buckets, DP2 (and DP2 x PP2, where the 1F1B schedule starts each reduction) matches
    one process."""
    from tests.test_parallel_parity import TOL, max_diff, reference

    ref = reference()
    got = run_distributed(world, overlap_step_body, layout_kw, ref["weights"], 20_000)[0]
    loss_diff, grad_diff = abs(got["loss"] - ref["loss"]), max_diff(got["grads"], ref["grads"])
    print(f"{layout_kw}: {got['buckets']} buckets on rank 0, |dloss| {loss_diff:.1e} max|dgrad| {grad_diff:.1e}")
    assert got["overlap"] and got["buckets"] >= 4, got["buckets"]
    assert loss_diff <= TOL
    assert grad_diff <= TOL


def hierarchical_cp_body(build: bool):
    """The hierarchical CP sizes ``init_model_parallel`` hands megatron (and, when ``build``, the
    groups megatron makes of them: that needs einops, which megatron imports for it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.config.schema import ParallelConfig
    from megatron_rl.distributed.runtime import init_model_parallel
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.testing.layouts import use_layout

    class Stop(Exception):
        pass

    original = ps.initialize_model_parallel
    seen = {}

    def recording(*args, **kwargs):
        seen.update(kwargs)
        if not build:
            raise Stop
        return original(*args, **kwargs)

    cfg = ParallelConfig(cp=4, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])
    ps.initialize_model_parallel = recording
    try:
        init_model_parallel(ParallelLayout.from_config(cfg, 4))
        groups = [dist.get_process_group_ranks(g) for g in ps.get_hierarchical_context_parallel_groups()]
    except Stop:
        groups = None
    finally:
        ps.initialize_model_parallel = original
        use_layout()  # leave the pool on a plain layout
    return seen["hierarchical_context_parallel_sizes"], groups


def test_a2a_p2p_passes_hierarchical_cp_sizes_to_parallel_state():
    """TE's a2a+p2p reads [a2a group, p2p group] from parallel_state, which makes them only when
    initialize_model_parallel gets the sizes."""
    assert run_distributed(4, hierarchical_cp_body, False) == [([2, 2], None)] * 4


def test_a2a_p2p_builds_megatrons_hierarchical_cp_groups():
    pytest.importorskip("einops", reason="megatron-core builds hierarchical CP groups with einops")
    got = run_distributed(4, hierarchical_cp_body, True)
    assert [groups for _, groups in got] == [[[0, 1], [0, 2]], [[0, 1], [1, 3]], [[2, 3], [0, 2]], [[2, 3], [1, 3]]]


def test_hierarchical_cp_sizes_are_checked():
    from megatron_rl.config.schema import ParallelConfig
    from megatron_rl.errors import ConfigError
    from megatron_rl.layout.sizes import hierarchical_cp_sizes

    assert hierarchical_cp_sizes(ParallelConfig(cp=8, cp_comm_type="a2a+p2p",
                                                hierarchical_context_parallel_sizes=[2, 4])) == (2, 4)
    assert hierarchical_cp_sizes(ParallelConfig(cp=2)) is None
    for bad in (dict(cp=8, cp_comm_type="a2a+p2p"),
                dict(cp=8, cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2]),
                dict(cp=4, hierarchical_context_parallel_sizes=[2, 2])):
        with pytest.raises(ConfigError, match="hierarchical_context_parallel_sizes"):
            hierarchical_cp_sizes(ParallelConfig(**bad))


_FAKE_CUDA_BUILD = """
import torch
runtime_calls = []
# A CUDA build whose runtime check (cuInit: a forked child can no longer use CUDA) is recorded.
torch._C._cuda_getDeviceCount = lambda: runtime_calls.append(1) or 1
torch.cuda._device_count_nvml = lambda: 1
import megatron_rl.compat as compat
from megatron_rl.compat import quiet_known_warnings
quiet_known_warnings()
print(compat.cuda_available(), len(runtime_calls))
"""


@pytest.mark.parametrize("force_cpu,expected", [("0", "True 0"), ("1", "False 0")])
def test_cuda_check_at_import_does_not_initialise_cuda(force_cpu, expected):
    """What the test forkserver imports before forking workers asks NVML, never the CUDA runtime."""
    import subprocess
    import sys

    env = dict(os.environ, MEGATRON_RL_FORCE_CPU=force_cpu, PYTHONPATH=ROOT)
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    out = subprocess.run([sys.executable, "-c", _FAKE_CUDA_BUILD], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == expected
