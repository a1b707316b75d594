"""Megatron's parallel_state for every TP x PP x CP (x VPP) layout of 2, 4 and 8 ranks on gloo."""

from __future__ import annotations

import itertools

import pytest

from megatron_rl.testing.harness import run_distributed


def layouts(world: int):
    sizes = [s for s in (1, 2, 4, 8) if s <= world]
    for tp, pp, cp in itertools.product(sizes, repeat=3):
        if world % (tp * pp * cp) == 0:
            yield dict(tp=tp, pp=pp, cp=cp)
            if pp >= 2:
                yield dict(tp=tp, pp=pp, cp=cp, vpp=2)


def check_groups(layout_list):
    """Build each layout; check group sizes, rank arithmetic and one collective per group."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.testing.layouts import use_layout

    world, rank = dist.get_world_size(), dist.get_rank()
    seen = []
    for kw in layout_list:
        layout = use_layout(**kw)
        tp, pp, cp = kw["tp"], kw["pp"], kw["cp"]
        dp = world // (tp * pp * cp)
        assert layout.dp == dp
        assert ps.get_tensor_model_parallel_world_size() == tp
        assert ps.get_pipeline_model_parallel_world_size() == pp
        assert ps.get_context_parallel_world_size() == cp
        assert ps.get_data_parallel_world_size() == dp
        assert ps.get_virtual_pipeline_model_parallel_world_size() == kw.get("vpp")
        # megatron's default order is tp-cp-ep-dp-pp: TP ranks are adjacent.
        assert ps.get_tensor_model_parallel_rank() == rank % tp
        assert ps.get_pipeline_model_parallel_rank() == rank // (tp * cp * dp)
        for group, size in ((ps.get_tensor_model_parallel_group(), tp),
                            (ps.get_pipeline_model_parallel_group(), pp),
                            (ps.get_context_parallel_group(), cp),
                            (ps.get_data_parallel_group(), dp),
                            (ps.get_data_parallel_group(with_context_parallel=True), dp * cp)):
            t = torch.ones(1)
            dist.all_reduce(t, group=group)
            assert int(t.item()) == size
        seen.append((tp, pp, cp, kw.get("vpp")))
    return seen


@pytest.mark.parametrize("world", [2, 4, 8])
def test_parallel_state_every_layout_up_to_8(world):
    todo = list(layouts(world))
    results = run_distributed(world, check_groups, todo)
    assert all(len(r) == len(todo) for r in results)
    print(f"world {world}: {len(todo)} layouts checked")


def rebuild_with_rope_model(rounds: int):
    """Switch layouts with a RoPE model alive in between; return this process's thread counts."""
    import os

    import torch

    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.models.builder import build_gpt_chunks
    from megatron_rl.testing.layouts import use_layout

    model = ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                        vocab_size=64, params_dtype="float32")
    counts = []
    for i in range(rounds):
        layout = use_layout(**(dict(cp=2) if i % 2 else dict(tp=2)))
        chunks = build_gpt_chunks(model, layout, torch.device("cpu"))
        tokens = torch.randint(0, 64, (1, 8 // layout.cp))
        position_ids = torch.arange(tokens.shape[1]).unsqueeze(0)
        with torch.no_grad():
            chunks[0](tokens, position_ids, None)  # fills megatron's rotary cache with this cp_group
        del chunks
        counts.append(len(os.listdir("/proc/self/task")))
    return counts


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_layout_switches_release_process_groups():
    """Destroyed groups must not stay alive (each gloo group holds three polling threads)."""
    counts = run_distributed(2, rebuild_with_rope_model, 8)[0]
    print(f"threads after each of 8 layout switches: {counts}")
    assert counts[-1] <= counts[1], counts


# ----------------------------------------------------------------------------- reused workers


def lower_block_cap():
    from megatron_rl.ops import cp_attention, packed_attention

    cp_attention.block_pairs((0, 8), 2, 0, 1)  # fills a cache
    packed_attention.MAX_PADDING_WASTE = 7.0  # and "forgets" to restore a tunable
    return cp_attention.block_pairs.cache_info().currsize


def read_state():
    from megatron_rl.ops import cp_attention, packed_attention

    return packed_attention.MAX_PADDING_WASTE, cp_attention.block_pairs.cache_info().currsize


def test_each_body_starts_from_the_default_state():
    """What one body leaves in a reused worker's caches and tunables, the next body does not see."""
    import importlib

    from megatron_rl.ops import packed_attention
    from megatron_rl.testing import harness

    for module, attr, method in harness._CACHES:  # every name the reset touches still exists
        assert callable(getattr(getattr(importlib.import_module(module), attr), method)), (module, attr)
    for module, attr in harness._TUNABLES:
        assert hasattr(importlib.import_module(module), attr), (module, attr)
    assert run_distributed(1, lower_block_cap) == [1]
    assert run_distributed(1, read_state) == [(packed_attention.MAX_PADDING_WASTE, 0)]


def test_a_single_process_job_needs_no_tcp_port(tmp_path):
    """Two one-process jobs started together must not race for a "free" port: a job with no
    launcher uses an in-memory store and binds no port, so it trains even when none can be bound."""
    import os
    import subprocess
    import sys

    from tests.support.helpers import TINY

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        "import socket, sys\n"
        "def taken(self, address):\n"
        "    raise OSError(98, 'Address already in use')\n"
        "socket.socket.bind = taken\n"
        "from megatron_rl.tools.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_RL_FAULT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", code, "train", "--nproc", "1", *TINY, "trainer.steps=1",
                           f"run.dir={tmp_path}", "run.name=r"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.path.isdir(tmp_path / "r" / "checkpoints" / "step_00000001")


def test_the_layout_line_names_expert_parallelism():
    from megatron_rl.config.schema import ParallelConfig
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.trainer.ppo import layout_line

    moe = ParallelLayout.from_config(ParallelConfig(tp=2, ep=2, etp=1, sequence_parallel=True), 8)
    assert layout_line(moe, 8, "cpu") == "layout: tp=2 pp=1 cp=1 dp=4 ep=2 etp=1 (sequence parallel), world size 8, cpu"
    same_etp = ParallelLayout.from_config(ParallelConfig(tp=2, cp=2, ep=4, etp=2), 8)  # etp = tp: the default
    assert layout_line(same_etp, 8, "cpu") == "layout: tp=2 pp=1 cp=2 dp=2 ep=4, world size 8, cpu"
    dense = ParallelLayout.from_config(ParallelConfig(tp=2, pp=2), 4)
    assert layout_line(dense, 4, "cpu") == "layout: tp=2 pp=2 cp=1 dp=1 ep=1, world size 4, cpu"


_ORPHAN_SCRIPT = """
import sys, time
from megatron_rl.testing.harness import get_pool
pool = get_pool(1)
print(pool._procs[0].pid, flush=True)
pool.run(time.sleep, 600)
"""


def test_pool_workers_exit_when_the_process_that_owns_them_is_killed():
    """A benchmark or test process killed mid-body (SIGKILL: no atexit) must not leave its gloo
    workers behind: they would run the body to its end and then idle, their process groups'
    threads taking CPU from everything else on the machine for as long as it stays up."""
    import os
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        worker = int(proc.stdout.readline())
        time.sleep(1.0)  # the body is running
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(worker):
            time.sleep(0.2)
        assert not _alive(worker), f"worker {worker} outlived the process that owned it"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    import os

    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
