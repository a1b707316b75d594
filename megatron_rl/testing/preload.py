"""Imported once by the test forkserver, so every forked worker starts with these loaded."""

import warnings

warnings.filterwarnings("ignore")

import torch

from megatron_rl.compat import quiet_optional_dependency_warnings

quiet_optional_dependency_warnings()

import megatron.core
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

import megatron_rl.models.builder
