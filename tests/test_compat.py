"""The CPU compatibility layer: which megatron-core call sites it rewrites (upgrade canary)."""

from __future__ import annotations

from megatron_rl.testing.harness import run_distributed


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


def test_cpu_layer_is_not_applied_with_cuda_flag_off():
    import torch

    from megatron_rl.compat import cuda_available

    assert cuda_available() == torch.cuda.is_available() or not torch.cuda.is_available()
