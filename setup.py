"""megatron_rl: PPO for large language models on Megatron-Core (TP/PP/VPP/CP/DP)."""

from setuptools import find_packages, setup

setup(
    name="megatron_rl",
    version="0.1.0",
    description="PPO/GRPO trainer on Megatron-Core with tensor, pipeline and context parallelism",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    # Only the trainer ships: tests/ (test-only helpers such as the local Slurm cluster, which
    # installs system packages) is never part of the wheel.
    packages=find_packages(include=["megatron_rl", "megatron_rl.*"]),
    include_package_data=True,
    install_requires=[
        # megatron-core 0.16.1 itself requires 2.6; our own code needs 2.5 (SDPA enable_gqa).
        "torch>=2.6",
        # Tested: 0.16.1 (CPU stack, Python 3.11).  Newer releases need Python >= 3.12 and
        # are accepted for GPU users; the compat layer warns about untested versions.
        "megatron-core>=0.19.2,<0.20",
        "omegaconf>=2.3",
        "psutil>=5.9",
        "numpy>=1.24",
        "packaging>=23",
        "pyyaml>=6",
        # megatron-core builds the hierarchical CP groups (cp_comm_type=a2a+p2p) with it.
        "einops>=0.7",
    ],
    extras_require={
        # Apex is optional and never required; see docs/quickstart.md.
        "gpu": ["transformer-engine[pytorch]>=2.0"],
        "hf": ["transformers>=4.45", "safetensors>=0.4"],
        "parquet": ["pyarrow>=14"],
        # The math_verify reward (docs/rewards.md); its parser needs the ANTLR runtime it pins.
        "math": ["math-verify[antlr4_13_2]>=0.9"],
        "plot": ["matplotlib>=3.7"],
        "loggers": ["tensorboard>=2.14", "wandb>=0.16"],
        # benchmarks/vs_trl.py: the TRL side of the per-step time comparison (docs/vs_trl.md).
        "bench": ["trl>=1.16"],
        "test": ["pytest>=8", "transformers>=4.45", "safetensors>=0.4", "ruff==0.17.6",
                 "math-verify[antlr4_13_2]>=0.9"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.tools.cli:main"]},
)
