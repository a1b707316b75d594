"""Every number a config takes is one the runtime can take: a value past a key's range stops
``validate`` (and the launcher) with one line naming the key, the range and the fix, instead of an
OverflowError in the ranks."""

from __future__ import annotations

import datetime
import math
import typing

import numpy as np
import pytest
import torch

from megatron_rl.config.loader import load_config
from megatron_rl.config.rules import check_field_rules
from megatron_rl.config.schema import Config, iter_fields, leaf_types
from megatron_rl.errors import ConfigError
from tests.test_cli import cli

TYPES = leaf_types()

# What the runtime takes, stated here independently of the schema's own limits.
INT64_MAX = 2**63 - 1  # torch's ints
C_INT_MAX = 2**31 - 1  # ranks, sizes and counts in torch, megatron-core and the kernels
SEED_LIMIT = 2**32  # numpy's seeds are below it
STEP_LIMIT = 10**8  # checkpoints are step_XXXXXXXX: 8 digits
TIMEOUT_LIMIT_S = 2**31 / 1000  # a pipe's poll() counts milliseconds in a C int


def _base(tp):
    """``int``/``float`` for a numeric key (``Optional`` unwrapped), else None."""
    args = {a for a in (tp, *typing.get_args(tp)) if a in (int, float)}
    return args.pop() if args else None


NUMERIC = [(key, field, _base(TYPES[key])) for key, field, _ in iter_fields() if _base(TYPES[key])]
FLOATS = [key for key, _, base in NUMERIC if base is float]


def _upper(field):
    bounds = field.metadata.get("bounds", {})
    return bounds.get("le", bounds.get("lt"))


def _set(cfg, key: str, value) -> None:
    *parents, name = key.split(".")
    node = cfg
    for part in parents:
        node = getattr(node, part)
    setattr(node, name, value)


def _refusal(key: str, value) -> str:
    cfg = Config()
    _set(cfg, key, value)
    with pytest.raises(ConfigError) as info:
        check_field_rules(cfg)
    return str(info.value)


def test_every_numeric_key_declares_a_range_the_runtime_takes():
    """A key added without an upper bound, or with one past what torch/numpy/timedelta take, fails here."""
    assert len(NUMERIC) > 90
    f32_max = torch.finfo(torch.float32).max
    for key, field, base in NUMERIC:
        bounds = field.metadata.get("bounds", {})
        upper = _upper(field)
        assert upper is not None, f"{key}: declare le= (see the MAX_* limits in config/schema.py)"
        assert {"ge", "gt"} & set(bounds), f"{key}: declare a lower bound too"
        if base is int:
            assert isinstance(upper, int) and upper <= INT64_MAX, (key, upper)
            torch.tensor([upper], dtype=torch.int64)  # fits what torch takes as an int
        else:
            assert math.isfinite(upper) and abs(upper) <= f32_max, (key, upper)
            assert math.isfinite(torch.tensor(upper, dtype=torch.float32).item()), key
        if key.endswith("timeout_s"):
            assert upper < TIMEOUT_LIMIT_S, key
            datetime.timedelta(seconds=upper)  # what init_process_group and the stores get
        if key.endswith("seed"):
            assert upper < SEED_LIMIT, key
            np.random.default_rng(upper)
            torch.Generator().manual_seed(upper + 2718 + 100 * C_INT_MAX)  # with megatron-core's per-rank offsets
        if key.endswith(("steps", "_every")):
            assert upper < STEP_LIMIT, key


@pytest.mark.parametrize("key", [key for key, _, _ in NUMERIC])
def test_a_value_past_the_range_is_refused_naming_the_key_and_range(key):
    field = next(f for k, f, _ in NUMERIC if k == key)
    base, upper = _base(TYPES[key]), _upper(field)
    past = upper + 1 if base is int else upper * 2
    line = _refusal(key, past)
    assert line.startswith(f"config error: {key}=") and "out of range (must be" in line, line
    assert str(upper) in line and f"fix: set {key} to" in line, line


@pytest.mark.parametrize("key", FLOATS)
def test_nan_and_infinity_are_refused_for_every_float_key(key):
    for value in (math.inf, -math.inf):
        line = _refusal(key, value)
        assert line.startswith(f"config error: {key}=") and "not a finite number (must be" in line, line
    with pytest.raises(ConfigError) as info:  # as typed on the command line
        check_field_rules(load_config(None, [f"{key}=nan"]))
    assert str(info.value).startswith(f"config error: {key}=nan: not a finite number (must be "), info.value


@pytest.mark.parametrize("override,key,allowed", [
    ("distributed.timeout_s=1e20", "distributed.timeout_s", "> 0 and <= 604800"),
    ("distributed.timeout_s=100000000000000000000", "distributed.timeout_s", "> 0 and <= 604800"),
    (f"run.seed={2**70}", "run.seed", ">= 0 and <= 4294967295"),
    ("actor.optim.lr=nan", "actor.optim.lr", ">= 0 and <= 3e+38"),
    ("actor.optim.lr=1" + "0" * 400, "actor.optim.lr", ">= 0 and <= 3e+38"),
], ids=["timeout-1e20", "timeout-int-1e20", "seed-2**70", "lr-nan", "lr-int-too-large-for-a-float"])
def test_validate_refuses_extreme_values_with_one_line(override, key, allowed):
    proc, _ = cli("validate", "configs/demo_cpu.yaml", override)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}="), lines
    assert f"(must be {allowed}" in lines[0] or f"(must be an integer {allowed}" in lines[0], lines[0]
    assert f"; fix: set {key} to" in lines[0] and "Traceback" not in proc.stderr, lines[0]


def test_the_limits_themselves_are_accepted():
    cfg = Config()
    week, seed, steps = 7 * 24 * 3600, SEED_LIMIT - 1, STEP_LIMIT - 1
    for key, value in (("distributed.timeout_s", week), ("run.seed", seed), ("trainer.steps", steps)):
        _set(cfg, key, value)
    check_field_rules(cfg)
    check_field_rules(load_config("configs/demo_cpu.yaml", [f"distributed.timeout_s={week}", f"run.seed={seed}"]))
