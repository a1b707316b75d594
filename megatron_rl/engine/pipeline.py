"""Forward (and backward) over a list of micro-batches with megatron-core's pipeline schedules.

``get_forward_backward_func`` picks no-pipelining, 1F1B or interleaved 1F1B from the parallel
state.  Micro-batches may differ in length (``variable_seq_lengths``): the schedule exchanges
tensor shapes between stages.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from megatron.core.pipeline_parallel import get_forward_backward_func


def run_microbatches(
    chunks: list,
    microbatches: Sequence[Any],
    forward_step: Callable,
    *,
    forward_only: bool,
    seq_length: int,
    micro_batch_size: int = 1,
) -> list:
    """Run the schedule; returns what each micro-batch's loss function logged (last stage only).

    ``forward_step(batch, model) -> (output, loss_func)`` is called once per micro-batch per
    model chunk; ``batch`` is the micro-batch object from ``microbatches``.
    """
    if not microbatches:
        return []

    def step(data_iterator, model, *extra):
        return forward_step(next(data_iterator), model)

    num_chunks = len(chunks)
    if num_chunks > 1:
        iterators = [iter(list(microbatches)) for _ in range(num_chunks)]
    else:
        iterators = iter(list(microbatches))
    fb = get_forward_backward_func()
    return fb(
        forward_step_func=step,
        data_iterator=iterators,
        model=chunks if num_chunks > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
