"""Forward (and backward) over a list of micro-batches with megatron-core's pipeline schedules.

``get_forward_backward_func`` picks no-pipelining, 1F1B or interleaved 1F1B from the parallel
state.  Micro-batches may differ in length (``variable_seq_lengths``): the schedule exchanges
tensor shapes between stages.
"""

from __future__ import annotations

import functools
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
    return _schedule(chunks)(
        forward_step_func=step,
        data_iterator=iterators,
        model=chunks if num_chunks > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def _schedule(chunks: list) -> Callable:
    """megatron's schedule for the active layout: parallel_state's, or the groups of a model on a
    layout of its own (:func:`megatron_rl.distributed.runtime.layout_active`), handed to it with
    their pipeline communicator."""
    from megatron_rl.distributed.runtime import overriding_groups

    groups = overriding_groups()
    if groups is None:
        return get_forward_backward_func()
    kwargs = {"pg_collection": groups}
    if groups.pp.size() > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
        from megatron.core.utils import get_model_config

        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=groups.pp, config=get_model_config(chunks[0]))
    return functools.partial(get_forward_backward_func(pp_size=groups.pp.size(), vp_size=None), **kwargs)
