"""Applies :mod:`megatron_rl.testing.workload`'s shaping in every process of a job started with
this folder first on ``PYTHONPATH`` (benchmarks and tests only)."""

import os

if os.environ.get("MEGATRON_RL_LONG_TAIL") or os.environ.get("MEGATRON_RL_DECODE_FLOOR_S"):
    from megatron_rl.testing.workload import shape_from_env

    shape_from_env()
