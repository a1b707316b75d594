"""Workload shaping for benchmarks and tests that run whole jobs: patches every process of the
job applies at start-up (``PYTHONPATH`` starting with :data:`SITE_DIR`, whose ``sitecustomize``
calls :func:`shape_from_env`).  Never imported by a training run.

- ``MEGATRON_RL_LONG_TAIL=1``: a response whose first token id is 2 mod 5 (two of the ten digits
  the add_small answers start with) ignores EOS and runs to ``rollout.max_new_tokens``: most
  responses stop after the answer, about a tenth run to the maximum.  The reward reads a response
  up to its first EOS, so the tail costs generation and training what a long response costs and
  leaves its reward what it would have been: a longer response is not a wrong one.
- ``MEGATRON_RL_DECODE_FLOOR_S=x``: every decode step (one token per running sample, no prompt
  computed) takes at least ``x`` seconds whatever its rows, in megatron's static batching and its
  dynamic engine -- an emulation of a memory-bound GPU decode, where a batch costs its longest
  response.
"""

from __future__ import annotations

import os
import time

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
LONG_TAIL_ENV, DECODE_FLOOR_ENV = "MEGATRON_RL_LONG_TAIL", "MEGATRON_RL_DECODE_FLOOR_S"


def job_env(long_tail: bool = False, decode_floor_s: float = 0.0, base: dict | None = None) -> dict:
    """An environment for a job whose every process applies the shaping asked for."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE_DIR, env.get("PYTHONPATH", "")) if p)
    if long_tail:
        env[LONG_TAIL_ENV] = "1"
    if decode_floor_s:
        env[DECODE_FLOOR_ENV] = str(decode_floor_s)
    return env


def shape_from_env() -> None:
    if os.environ.get(LONG_TAIL_ENV):
        install_long_tail()
    floor = float(os.environ.get(DECODE_FLOOR_ENV, "0") or 0)
    if floor > 0:
        install_decode_floor(floor)


def install_long_tail() -> None:
    from megatron_rl.rollout import engine
    from megatron_rl.rollout.megatron import draws

    stopped = engine.stopped

    def long_tail_stopped(response, params):
        return stopped(response, params) and response[0] % 5 != 2

    engine.stopped = draws.stopped = long_tail_stopped

    from megatron_rl.trainer import ppo

    def graded_up_to_eos(self, i: int) -> str:
        ids = list(self.response_ids[i])
        eos = self.tokenizer.eos_id
        return self.tokenizer.decode(ids[:ids.index(eos)] if eos in ids else ids)

    ppo._Decoded.__getitem__ = graded_up_to_eos


def install_decode_floor(seconds: float) -> None:
    """Every decode step of megatron's engine (static batching: a one-token forward; dynamic: a step
    that computed no prompt token) takes at least ``seconds``."""
    from megatron_rl.rollout import static_batching

    forward = static_batching.forward_step

    def floored(wrapper, inputs):
        start = time.perf_counter()
        out = forward(wrapper, inputs)
        if inputs["tokens"].shape[1] == 1:
            left = seconds - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)
        return out

    static_batching.forward_step = floored

    from megatron_rl.rollout.megatron.dynamic import DynamicBatching

    step = DynamicBatching.step

    def floored_step(engine):
        wrapper = engine.controller.inference_wrapped_model
        start, prefilled = time.perf_counter(), wrapper.prefill_tokens
        out = step(engine)
        if wrapper.prefill_tokens == prefilled:  # a decode step: no prompt token computed
            left = seconds - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)
        return out

    DynamicBatching.step = staticmethod(floored_step)
