"""The test suite.

Every job it starts with ``--nproc N`` forks its ranks from the launcher
(``MEGATRON_RL_FORK_RANKS=1``, :mod:`megatron_rl.distributed.launcher`) instead of starting N new
interpreters that import torch and megatron-core each: most of a small job's time on a 2-core
machine.  The README demo's test starts its ranks the way users' jobs do."""

import os

os.environ.setdefault("MEGATRON_RL_FORK_RANKS", "1")
