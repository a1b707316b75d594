"""Imported once by the test forkserver, so every forked worker starts with these loaded."""

from megatron_rl.compat import quiet_known_warnings

quiet_known_warnings()

import megatron.core
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

import megatron_rl.models.builder
