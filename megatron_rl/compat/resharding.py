"""The private parts of megatron-core's resharding that the refit reads (``rollout/refit.py``).

megatron-core 0.19.2 caches each reshard plan in a module-private dict keyed by the two models'
layouts, and renames a chunk's layers to global numbers with private helpers; neither has a public
call.  The refit needs both: the plan a push or refit used (to count the bytes it moved, and to know
what a trainer rank sends), and the global layer names of each chunk (VPP chunks number their layers
from 0).  Each use sits behind one function here.
"""

from __future__ import annotations

from typing import Callable

from megatron_rl.compat.records import MEGATRON_TESTED, Workaround, register_workaround


def cached_reshard_plan(sources: list | None, targets: list | None, **key):
    """``(plan, target core)``: the plan megatron's ``swap_model_weights`` cached for these models
    (None before it built one); ``key``: the group and rank offsets of a cross-world swap."""
    from megatron.core.resharding.refit import _build_plan_cache_key, _plan_cache, _unwrap_model_cores

    src_core, tgt_core, experts = _unwrap_model_cores(sources, targets)
    return _plan_cache.get(_build_plan_cache_key(src_core, tgt_core, experts, **key)), tgt_core


def global_layer_renamer(chunk) -> Callable[[str], str]:
    """A parameter or module name of ``chunk`` -> the same name with its global layer number."""
    from megatron.core.resharding.utils import _build_layer_module_prefix_map, _resolve_global_layer_number_in_name

    prefix_map = _build_layer_module_prefix_map(chunk)
    return lambda name: _resolve_global_layer_number_in_name(name, prefix_map)


def preset_refit_tensors(model, tensors: dict) -> None:
    """Make megatron's resharding send ``tensors`` (name -> tensor) for ``model``: the copy a trainer
    rank took, so it goes on updating its weights while the copy waits to be sent."""
    object.__setattr__(model, "_refit_tensor_cache", tensors)  # not a submodule attribute


register_workaround(
    Workaround(
        name="resharding.preset_send_tensors",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "resharding/utils.py get_refit_tensor_dict reads a model's tensors from its private "
            "_refit_tensor_cache attribute when set; a trainer rank's push sets it to the snapshot it took, "
            "and there is no public way to hand the executor other tensors than the live ones"
        ),
        used_in="rollout/refit.py:preset_refit_tensors",
    )
)
register_workaround(
    Workaround(
        name="resharding.cached_plan_lookup",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "resharding/refit.py keeps the plans swap_model_weights builds in the private _plan_cache, keyed "
            "by _build_plan_cache_key of the cores _unwrap_model_cores returns; no public call returns a "
            "plan, and the refit reads it to count the bytes a rank receives and what a trainer rank sends"
        ),
        used_in="rollout/refit.py:cached_reshard_plan",
    )
)
register_workaround(
    Workaround(
        name="resharding.global_layer_names",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "resharding/utils.py renames a chunk's layers to global numbers only through the private "
            "_build_layer_module_prefix_map and _resolve_global_layer_number_in_name; the refit's view of a "
            "rank's chunks (VPP chunks each number their layers from 0) names its parameters with them"
        ),
        used_in="rollout/refit.py:global_layer_renamer",
    )
)
