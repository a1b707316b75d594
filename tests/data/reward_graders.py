"""Graders for the tests of the bounded worker: one that loops on a given response, one that raises,
one that ends its process with code 0.

Torch-free on purpose: the worker process imports this module."""

import os
import time

from megatron_rl.rewards.registry import grader


@grader
def loops_on(response, answer, forever="loop"):
    """1.0, except for ``response == forever``, which never returns."""
    while response == forever:
        time.sleep(0.01)
    return 1.0


@grader
def raises_on_seven(response, answer):
    if response == "7":
        raise ValueError("seven is not allowed")
    return float(len(response))


@grader
def exits_on_seven(response, answer):
    if response == "7":
        os._exit(0)  # as a library the grader imports might
    return float(len(response))
