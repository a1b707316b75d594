"""What runs on a GPU, checked without one: the settings the builder gives a CUDA device, and
``benchmarks/gpu_check.py`` (its no-CUDA exit, its helpers, and a CPU dry run of every section).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_OFF = dict(use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
               masked_softmax_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
               persist_layer_norm=False)


def _gpu_check():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    return gpu_check


# ----------------------------------------------------------------------------- builder settings


@pytest.mark.parametrize("te,apex", [(False, False), (True, False), (False, True), (True, True)])
def test_cpu_settings_do_not_depend_on_the_stack(te, apex):
    from megatron_rl.models.builder import device_settings

    assert device_settings("cpu", te, apex) == CPU_OFF


def test_cuda_settings_follow_the_installed_kernels():
    from megatron_rl.models.builder import device_settings

    bare = device_settings("cuda", False, False)
    assert bare == dict(use_cpu_initialization=False, bias_activation_fusion=True, bias_dropout_fusion=True,
                        masked_softmax_fusion=True, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                        persist_layer_norm=False)
    assert device_settings("cuda", True, False) == dict(bare, apply_rope_fusion=True)
    with_apex = dict(bare, gradient_accumulation_fusion=True, persist_layer_norm=True)
    assert device_settings("cuda", False, True) == with_apex


def _kwargs(device, **kw):
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.layout.sizes import ParallelLayout
    from megatron_rl.models.builder import transformer_config_kwargs

    model = ModelConfig(**kw.pop("model", {}))
    return transformer_config_kwargs(model, ParallelLayout(tp=2, sequence_parallel=True), torch.bfloat16, "local",
                                     device=torch.device(device), **kw)


def test_transformer_config_for_a_cuda_device_without_one():
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = _kwargs("cuda", te_available=False, apex_available=False)
    assert {k: kwargs[k] for k in CPU_OFF} == dict(
        use_cpu_initialization=False, bias_activation_fusion=True, bias_dropout_fusion=True,
        masked_softmax_fusion=True, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False)
    assert kwargs["perform_initialization"] is True and kwargs["bf16"] is True
    assert kwargs["tensor_model_parallel_size"] == 2 and kwargs["sequence_parallel"] is True
    config = TransformerConfig(**kwargs)  # megatron's own checks accept them, on a CPU-only machine
    assert config.bias_activation_fusion and not config.use_cpu_initialization
    assert torch.get_float32_matmul_precision() == "highest"  # building kwargs touched nothing global


def test_cuda_config_with_transformer_engine_fuses_rope():
    kwargs = _kwargs("cuda", te_available=True, apex_available=False)
    assert kwargs["apply_rope_fusion"] is True and kwargs["gradient_accumulation_fusion"] is False


def test_yarn_keeps_rope_fusion_off():
    """megatron-core 0.19.2's fused packed (THD) RoPE drops YaRN's attention factor: fusion stays off."""
    from megatron_rl.config.schema import RopeScalingConfig

    yarn = dict(rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=1024))
    assert _kwargs("cuda", te_available=True, apex_available=False, model=yarn)["apply_rope_fusion"] is False
    llama3 = dict(rope_scaling=RopeScalingConfig(type="llama3", factor=8.0))  # no attention factor: fused
    assert _kwargs("cuda", te_available=True, apex_available=False, model=llama3)["apply_rope_fusion"] is True


def test_cpu_config_is_what_it_was():
    kwargs = _kwargs("cpu")
    assert {k: kwargs[k] for k in CPU_OFF} == CPU_OFF
    assert kwargs["perform_initialization"] is True


def test_plain_gelu_without_bias_is_not_fused():
    """megatron refuses bias+activation fusion for a non-gated GeLU without a bias."""
    kwargs = _kwargs("cuda", te_available=False, apex_available=False,
                     model=dict(activation="gelu", add_bias_linear=False))
    assert kwargs["bias_activation_fusion"] is False
    assert _kwargs("cuda", te_available=False, apex_available=False,
                   model=dict(activation="gelu", add_bias_linear=True))["bias_activation_fusion"] is True


def test_weights_that_are_loaded_next_are_not_initialised():
    loading = _kwargs("cuda", te_available=False, apex_available=False, initialize=False)
    assert loading["perform_initialization"] is False


# ----------------------------------------------------------------------------- gpu_check


def test_without_cuda_it_prints_one_line_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == _gpu_check().NO_CUDA + "\n"


def test_sdpa_recorder_tells_a_fused_kernel_from_math():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    check = _gpu_check()
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)

    def run(backend=None):
        def call():
            if backend is None:
                F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            else:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        return check._probe(call)

    assert run() == "flash (CPU kernel) x1"
    assert run(SDPBackend.MATH) == "math x1"
    assert check._probe(lambda: None) == "no SDPA call"


def test_model_flops_per_token_by_hand():
    from megatron_rl.config.schema import ModelConfig

    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                      vocab_size=100)
    # Per layer: q 64x64, k and v 64x32 each, output 64x64, SwiGLU 3 x 64x128; two RMSNorm weights.
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64
    expected = 6 * (2 * layer + 100 * 64) + 6 * 2 * 10 * 64
    assert _gpu_check().model_flops_per_token(cfg, 10) == expected


@pytest.mark.slow
def test_cpu_dry_run_fills_every_row():
    """Every section of the GPU check runs on the CPU with a tiny model and reports no error."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--cpu-dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| (")]
    print("\n".join(rows))
    assert not [r for r in rows if "ERROR" in r], proc.stderr[-3000:]
    for part in ("(a) PPO step 1", "(a) PPO resume", "(b) score", "(c) SDPA: trainer, CP=1 BSHD",
                 "(c) SDPA: rollout decode", "(d) actor update MFU", "(d) plain megatron-core", "(e) peak memory",
                 "(f) generation", "(g) model and batch", "(g) plain megatron-core step", "(g) + metrics",
                 "(g) forward: reference pass", "(g) first step vs steady step", "(g) build (", "(g) loss parity",
                 "(g) build + load", "(a) step 2: its phases", "(h) parity: greedy tokens", "(h) throughput: 4",
                 "(h) long tail", "(h) prefix caching", "(h) device copy bandwidth"):
        assert any(r.startswith(f"| {part}") for r in rows), part
    parity = next(r for r in rows if r.startswith("| (g) loss parity"))
    assert float(parity.split("|d| = ")[1].split()[0]) <= 1e-5, parity
    greedy = next(r for r in rows if r.startswith("| (h) parity: greedy tokens"))
    assert greedy.split("| ")[2].startswith("8/8 prompts"), greedy
    logprobs = next(r for r in rows if r.startswith("| (h) parity: max abs(log-prob"))
    assert float(logprobs.split("| ")[2].split()[0]) <= 1e-5, logprobs
