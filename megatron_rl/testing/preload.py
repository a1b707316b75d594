"""Imported once by the test forkserver, so every forked worker starts with these loaded."""

import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402,F401

from megatron_rl.compat import quiet_optional_dependency_warnings  # noqa: E402

quiet_optional_dependency_warnings()

import megatron.core  # noqa: E402,F401
from megatron.core.models.gpt import GPTModel  # noqa: E402,F401
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402,F401
from megatron.core.distributed import DistributedDataParallel  # noqa: E402,F401
from megatron.core.optimizer import get_megatron_optimizer  # noqa: E402,F401

import megatron_rl.models.builder  # noqa: E402,F401
