"""The warnings megatron-core and torch emit on the tested stack that a user cannot act on.

Each is silenced by its message (and, where the message is generic, the module that triggers
it), never by category: a warning that is not listed here still shows, which is what an upgrade
needs.  The list was taken from ``-W default`` runs of ``megatron-rl smoke`` (TP, SP, PP+VPP, CP,
DP with the distributed optimizer), a training run that saves and resumes, and the test suite.
:func:`pytest_filter_lines` gives the same filters in ``pytest.ini`` syntax (kept in step by
``tests/test_compat_registry.py``).

On CPU, the torch calls that take a device run through a wrapper in
:mod:`megatron_rl.compat.cpu`, so a warning torch raises for their caller is attributed to
``megatron_rl.compat.cpu``; the module patterns name it next to the megatron or torch module.
"""

from __future__ import annotations

import logging
import re
import warnings

from megatron_rl.compat.records import (
    MEGATRON_TESTED,
    TORCH_TESTED,
    KnownLogMessage,
    KnownWarning,
    register_log_message,
    register_warning,
    registered_log_messages,
    registered_warnings,
)

_CPU_MODE = r"megatron_rl\.compat\.cpu"

for _known in (
    KnownWarning(
        name="megatron.optional_dependencies_missing",
        message=r".*(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed",
        category=UserWarning,
        module=r"megatron\.core|megatron_fsdp",
        reason="warned at import when TE/Apex are absent; `megatron-rl features` reports what is installed",
        megatron_versions=MEGATRON_TESTED,
    ),
    KnownWarning(
        name="torch.collective_tensor_names_deprecated",
        message=r".*`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        category=FutureWarning,
        module="",
        reason=(
            "torch 2.13 renames these collectives; megatron-core 0.16 and ops/cp_attention.py keep "
            "the old names, which the torch builds on GPU machines (2.11) still need"
        ),
        torch_versions=TORCH_TESTED,
    ),
    KnownWarning(
        name="torch.jit_script_method_deprecated",
        message=r"`torch\.jit\.script_method` is deprecated",
        category=DeprecationWarning,
        module=r"torch\.jit\._script",
        reason="torch's own torch/utils/mkldnn.py uses it when torch._inductor is imported",
        torch_versions=TORCH_TESTED,
    ),
    KnownWarning(
        name="torch.backend_used_as_process_group",
        message=r"You are using a Backend <class 'torch\.distributed\.distributed_c10d\.ProcessGroupGloo'> as a "
                r"ProcessGroup",
        category=UserWarning,
        module=r"torch\.distributed\.distributed_c10d",
        reason=(
            "the group joining the training and the generating world (distributed/cross_world.py) "
            "is a gloo backend outside either world's group table; megatron's resharding gathers "
            "its plan over it with all_gather_object, which warns for such a group and works"
        ),
        torch_versions=TORCH_TESTED,
    ),
    KnownWarning(
        name="megatron.inference_contexts_imports",
        message=r"The following imports from `dynamic_context\.py` will be removed",
        category=DeprecationWarning,
        module=r"megatron\.core\.inference\.contexts",
        reason="megatron-core's own import chain reaches its deprecated re-exports",
        megatron_versions=MEGATRON_TESTED,
    ),
    KnownWarning(
        name="megatron.custom_layers_module_deprecated",
        message=r"The 'megatron\.core\.transformer\.custom_layers\.transformer_engine'\s+module is deprecated",
        category=DeprecationWarning,
        module=r"megatron\.core\.transformer\.multi_latent_attention",
        reason="megatron-core's multi_latent_attention imports its own deprecated module",
        megatron_versions=MEGATRON_TESTED,
    ),
    KnownWarning(
        name="megatron.mlp_spec_without_ffn_hidden_size",
        message=r"MLP requires ffn_hidden_size, but it was not provided",
        category=DeprecationWarning,
        module=r"megatron\.core\.transformer\.spec_utils",
        reason="megatron-core's own layer specs build the MLP without ffn_hidden_size",
        megatron_versions=MEGATRON_TESTED,
    ),
    KnownWarning(
        name="megatron.linear_layers_default_tp_group",
        message=r"Warning. tp_group is None, using default tp group",
        category=DeprecationWarning,
        module=r"megatron\.core\.tensor_parallel\.layers",
        reason=(
            "RowParallelLinear and frozen-weight linears call megatron's own linear functions "
            "without their tp_group (calls from our code, attributed to mappings, still warn)"
        ),
        megatron_versions=MEGATRON_TESTED,
    ),
    KnownWarning(
        name="megatron.cuda_device_max_connections_hint",
        message=r"When using (sequence parallelism|async grad allreduce) it is recommended to set the "
                r"environment variable CUDA_DEVICE_MAX_CONNECTIONS",
        category=UserWarning,
        module=r"megatron\.core\.tensor_parallel\.layers",
        reason="a CUDA stream-scheduling hint; there are no CUDA streams on the CPU",
        megatron_versions=MEGATRON_TESTED,
        cpu_only=True,
    ),
    KnownWarning(
        name="megatron.distrib_optimizer_zero_grad_of_views",
        message=r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        category=UserWarning,
        module=rf"(megatron\.core\.optimizer\.optimizer|{_CPU_MODE})",
        reason=(
            "DistributedOptimizer.zero_grad reads .grad of its fp32 shard views (megatron marks it "
            "'throws grad-access warning'); harmless, the shards' gradients live elsewhere"
        ),
        megatron_versions=MEGATRON_TESTED,
    ),
    KnownWarning(
        name="torch.dcp_load_state_dict_deprecated",
        message=r"`load_state_dict` is deprecated and will be removed in future versions",
        category=FutureWarning,
        module=r"megatron\.core\.dist_checkpointing\.strategies\.torch",
        reason="megatron-core's torch dist-checkpoint strategy loads with the deprecated DCP call",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
    ),
    KnownWarning(
        name="torch.sharded_tensor_deprecated",
        message=r"Please use DTensor instead and we are deprecating ShardedTensor",
        category=FutureWarning,
        module=rf"(torch\.distributed\.checkpoint|{_CPU_MODE})",
        reason="megatron-core's dist_checkpointing stores torch ShardedTensors; loading them warns",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
    ),
    KnownWarning(
        name="megatron.mimo_config_experimental",
        message=r"MimoModelConfig is experimental and still under active development",
        category=UserWarning,
        module=r"megatron\.core\.models\.mimo",
        reason="warned when megatron-core's own import chain reaches its multimodal model config, which megatron_rl "
               "never uses",
        megatron_versions=MEGATRON_TESTED,
    ),
    KnownWarning(
        name="megatron.absl_logging_missing",
        message=r"absl\.logging is not installed\. Using logging\.getLogger",
        category=UserWarning,
        module=r"megatron\.core\.hyper_comm_grid",
        reason="megatron-core's HyperCommGrid falls back to the standard logging module, which is all megatron_rl uses",
        megatron_versions=MEGATRON_TESTED,
    ),
):
    register_warning(_known)


for _known_log in (
    KnownLogMessage(
        name="megatron.gptmodel_deprecated",
        message=r"GPTModel IS DEPRECATED",
        logger="megatron.core.models.gpt.gpt_model",
        reason=(
            "logged by every GPTModel.__init__ (once per model chunk); megatron_rl keeps GPTModel on "
            "purpose -- docs/architecture.md says what HybridModel lacks -- so the user cannot act on it"
        ),
        megatron_versions=MEGATRON_TESTED,
    ),
    KnownLogMessage(
        name="megatron.mcore_async_save_deprecated",
        message=r"MCore's async save is deprecated",
        logger="megatron.core.dist_checkpointing.strategies.torch",
        reason=(
            "TorchDistSaveShardedStrategy.save (the synchronous save megatron_rl calls) runs its own "
            "async_save(async_strategy='mcore') and logs this once per rank; nothing a user sets changes it"
        ),
        megatron_versions=MEGATRON_TESTED,
    ),
    KnownLogMessage(
        name="torch.cpp_extension_without_cuda_runtime",
        message=r"No CUDA runtime is found, using CUDA_HOME",
        logger="torch.utils.cpp_extension",
        reason=(
            "PyPI's torch wheel is a CUDA build; on a machine without a GPU, importing "
            "torch.utils.cpp_extension (megatron-core's tensor_parallel/random.py does) logs this in "
            "every process; megatron_rl compiles no extension on the CPU"
        ),
        torch_versions=TORCH_TESTED,
    ),
):
    register_log_message(_known_log)


class KnownLogFilter(logging.Filter):
    """Drops the records of one logger whose text starts with one of the known messages."""

    def __init__(self, patterns: list[str]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def quiet_known_log_messages() -> None:
    """One :class:`KnownLogFilter` per logger named by a :class:`KnownLogMessage` (replacing an
    earlier one, so calling this again does not stack filters)."""
    by_logger: dict[str, list[str]] = {}
    for known in registered_log_messages():
        by_logger.setdefault(known.logger, []).append(known.message)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, KnownLogFilter)]:
            logger.removeFilter(old)
        logger.addFilter(KnownLogFilter(patterns))


def quiet_known_warnings(cpu: bool | None = None) -> None:
    """Install a filter for every :class:`KnownWarning` (the CPU-only ones when ``cpu``) and every
    :class:`KnownLogMessage`."""
    if cpu is None:
        from megatron_rl.compat.devices import cuda_available

        cpu = not cuda_available()
    for known in registered_warnings():
        if known.cpu_only and not cpu:
            continue
        warnings.filterwarnings("ignore", message=known.message, category=known.category, module=known.module)
    quiet_known_log_messages()


def pytest_filter_lines() -> list[str]:
    """The ``filterwarnings`` lines of ``pytest.ini`` (pytest cannot call into the package)."""
    return [f"ignore:{k.message}:{k.category.__name__}" + (f":{k.module}" if k.module else "")
            for k in registered_warnings()]
