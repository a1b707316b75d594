"""The layout distillation teachers run on (``algorithm.distill.layout``): the training layout, or
sizes of their own on the same ranks for a teacher larger than the student.

A teacher on a layout of its own is built on all training ranks with process groups of its own
(:func:`megatron_rl.distributed.runtime.own_layout_groups`); the sequences it scores are split over
its own data-parallel replicas and every rank gets every log-prob back, as on the training layout.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

KEY = "algorithm.distill.layout"


def own_sizes(asked: dict, train) -> Optional[tuple[int, int, int]]:
    """``(tp, pp, cp)`` of the teachers' own layout: ``asked`` (``algorithm.distill.layout``'s sizes,
    None where unset) over the training layout ``train`` (a ``parallel`` config or a ``PlanOption``);
    None when that is the training layout itself."""
    sizes = tuple((asked or {}).get(k) or getattr(train, k) for k in ("tp", "pp", "cp"))
    return None if sizes == (train.tp, train.pp, train.cp) else sizes


def teacher_parallel(cfg):
    """The ``parallel`` config the teachers run on when ``algorithm.distill.layout`` sets sizes other
    than the training layout's: those sizes, no virtual stages, no expert parallelism, sequence
    parallelism as the training layout has it (when TP > 1).  None: the training layout itself."""
    p = cfg.parallel
    sizes = own_sizes(dataclasses.asdict(cfg.algorithm.distill.layout), p)
    if sizes is None:
        return None
    tp, pp, cp = sizes
    flat_cp = {} if cp > 1 else {"cp_comm_type": "p2p", "hierarchical_context_parallel_sizes": None}
    return dataclasses.replace(p, tp=tp, pp=pp, cp=cp, vpp=None, sequence_parallel=p.sequence_parallel and tp > 1,
                               ep=1, etp=None, batch_p2p_comm=None, **flat_cp)


def sizes_text(parallel) -> str:
    return f"tp={parallel.tp} pp={parallel.pp} cp={parallel.cp}"


def teacher_layout_problem(cfg, world: Optional[int]):
    """``(key, value, problem, fix)`` when the teachers' own layout cannot run, else None: set without a
    teacher, sizes whose product does not divide the training ranks, hierarchical CP."""
    own = teacher_parallel(cfg)
    if own is None:
        return None
    value = sizes_text(own)
    if not cfg.algorithm.distill.teachers:
        return (KEY, value, "is set, but there is no teacher (algorithm.distill.teachers is empty)",
                "set algorithm.distill.teachers, or leave algorithm.distill.layout unset")
    ranks = own.tp * own.pp * own.cp
    if world is not None and world % ranks:
        return (KEY, value, f"tp*pp*cp={ranks} does not divide the {world} training ranks",
                f"choose algorithm.distill.layout sizes whose product divides {world}")
    if own.cp > 1 and own.cp_comm_type == "a2a+p2p":
        return (KEY, value, "a layout of the teachers' own does not take hierarchical CP (cp_comm_type=a2a+p2p)",
                "use parallel.cp_comm_type p2p, a2a or all_gather, or the training layout for the teachers")
    return None
