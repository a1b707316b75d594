"""CUDA graphs for the dynamic engine's decode steps, on the actor's own layers (``rollout.cuda_graphs``).

megatron-core 0.19 captures inference graphs per ``TransformerLayer`` through a ``CudaGraphManager``
that a layer gets when it is built with ``config.cuda_graph_impl == "local"`` -- a build-time switch
that would also send the training forward through the graph manager.  :class:`DecodeGraphs` gives
the actor's layers their managers and sets ``cuda_graph_impl`` only while the engine builds,
resumes (megatron captures then, for every batch size of ``InferenceConfig.num_cuda_graphs``) and
steps; between rollouts the layers have none and the config says ``none``, so training runs as
built.  Mixed and prefill steps run eagerly (``use_cuda_graphs_for_non_decode_steps=False``).

Weights: the captured graphs read the parameters' storage, and every update writes into it in place
(megatron's optimizer copies its main parameters into the model's; refit copies into the engine's
own model), so no update can leave a graph reading stale weights.  The KV cache is freed while the
actor trains (``RECOMPUTE``): megatron deletes the graphs on ``suspend()`` and captures them again
on ``resume()``, every rollout -- ``benchmarks/gpu_check.py`` times it.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_rl.compat.records import MEGATRON_TESTED, Workaround, register_workaround


def _transformer_layers(model: torch.nn.Module) -> list:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


@contextlib.contextmanager
def _graph_manager_construction(config):
    """What ``CudaGraphManager.__init__`` asks of the process, given for the time it runs: the config
    saying ``local``, an RNG tracker it accepts (inference draws no random numbers inside a layer:
    dropout is off in eval), and the current stream kept (the first manager makes a side stream
    the current one for the rest of the process)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    was_inference, stream = tracker.is_inference_rng_tracker, torch.cuda.current_stream()
    tracker.is_inference_rng_tracker = True
    try:
        yield
    finally:
        tracker.is_inference_rng_tracker = was_inference
        torch.cuda.set_stream(stream)


class DecodeGraphs:
    """megatron's per-layer graph managers for one model, attached while the engine runs."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.cuda_graphs import CudaGraphManager
        from megatron.core.transformer.enums import InferenceCudaGraphScope

        self.model = model
        self.config = model.config
        self.layers = _transformer_layers(model)
        with self._config_local(), _graph_manager_construction(self.config):
            self.config.inference_cuda_graph_scope = InferenceCudaGraphScope.layer
            self.managers = [CudaGraphManager(self.config, need_backward=False, pg_collection=model.pg_collection)
                             for _ in self.layers]

    @contextlib.contextmanager
    def _config_local(self):
        before = self.config.cuda_graph_impl
        self.config.cuda_graph_impl = "local"
        try:
            yield
        finally:
            self.config.cuda_graph_impl = before

    @contextlib.contextmanager
    def attached(self):
        """The layers have their managers and the config says ``local`` meanwhile."""
        with self._config_local():
            for layer, manager in zip(self.layers, self.managers):
                layer.cudagraph_manager = manager
            try:
                yield
            finally:
                for layer in self.layers:
                    if "cudagraph_manager" in vars(layer) or hasattr(layer, "cudagraph_manager"):
                        delattr(layer, "cudagraph_manager")


register_workaround(
    Workaround(
        name="inference.cuda_graphs_attached_while_generating",
        megatron_versions=MEGATRON_TESTED,
        reason=(
            "a TransformerLayer gets its CudaGraphManager only when built with cuda_graph_impl='local', which also "
            "routes the training forward through it (TransformerLayer._should_call_local_cudagraph without an "
            "inference context); the managers are attached and cuda_graph_impl set only while the dynamic engine "
            "builds, resumes and steps. CudaGraphManager.__init__ asserts a graph-safe or inference RNG tracker "
            "(inference draws none inside a layer) and makes a side stream current for the process on first use "
            "(restored)"
        ),
        used_in="compat/inference_graphs.py:DecodeGraphs",
    )
)
