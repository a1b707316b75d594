"""Tearing down megatron-core's process groups so a process can build another layout.

megatron-core 0.19.2's ``parallel_state.destroy_model_parallel()`` destroys only its extra
``*_GLOO`` groups and forgets the others: with a gloo world (CPU) those stay alive, three threads
and open sockets each, and caches inside megatron keep some of them referenced.  Rebuilding layouts
(the test pool, elastic restarts) would pile up hundreds of busy threads.
"""

from __future__ import annotations

import gc

import torch.distributed as dist

from megatron_rl.compat.records import MEGATRON_TESTED, Workaround, register_workaround


def release_group_caches() -> None:
    """Drop megatron-core caches that keep process groups alive after their layout is gone.

    ``RotaryEmbedding.forward`` (and the YaRN variant) is wrapped in a class-level
    ``functools.lru_cache`` keyed on ``self`` and ``cp_group``, so up to 32 modules and their
    context-parallel groups outlive the model.  Modules freed by the cache may sit in reference
    cycles, so collect them before the groups are destroyed.
    """
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    for cls in (rotary_pos_embedding.RotaryEmbedding, yarn_rotary_pos_embedding.YarnRotaryEmbedding):
        clear = getattr(cls.forward, "cache_clear", None)
        if clear is not None:
            clear()
    gc.collect()


def destroy_model_parallel_groups() -> None:
    """Destroy every process group megatron's ``parallel_state`` created, then reset it.

    megatron-core keeps its groups in private module globals (``_TENSOR_MODEL_PARALLEL_GROUP``,
    lists for the embedding groups, ...) and has no call that destroys them; walk those globals.
    """
    from megatron.core import parallel_state as ps

    release_group_caches()
    seen = set()
    for name, value in list(vars(ps).items()):
        if not name.startswith("_") or name.startswith("__"):
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        for group in values:
            if isinstance(group, dist.ProcessGroup) and id(group) not in seen and group != dist.group.WORLD:
                seen.add(id(group))
                try:
                    dist.destroy_process_group(group)
                except (ValueError, RuntimeError):  # already destroyed
                    pass
    ps.destroy_model_parallel()


register_workaround(
    Workaround(
        name="parallel_state.release_group_caches",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "RotaryEmbedding.forward is lru_cached on self and cp_group; the cache keeps destroyed "
            "process groups (and their gloo threads) alive; release_group_caches() clears it before "
            "a layout is torn down"
        ),
        used_in="distributed/runtime.py:init_model_parallel",
    )
)
register_workaround(
    Workaround(
        name="parallel_state.destroy_private_groups",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "destroy_model_parallel() destroys only the *_GLOO groups and forgets the rest; "
            "destroy_model_parallel_groups() walks parallel_state's private group globals and "
            "destroys each one so a rebuilt layout does not leak gloo threads and sockets"
        ),
        used_in="distributed/runtime.py:init_model_parallel",
    )
)
