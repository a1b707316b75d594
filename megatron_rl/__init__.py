"""megatron_rl: PPO / GRPO for large language models on Megatron-Core."""

import os as _os

# megatron-core's package_info runs ``git rev-parse`` in its install directory at import and appends
# the hash to ``__version__``: inside a checkout's .venv that is the checkout's commit, not
# megatron's (and one git process per import per rank).  Its own switch turns that off; set here,
# before any megatron_rl module imports megatron-core (compat registry: package_info.no_vcs_version).
NO_VCS_VERSION = _os.environ.setdefault("NO_VCS_VERSION", "1")

# megatron-core wraps its fused kernels in torch.compile while it is imported, which loads torch's
# compiler (2.5-3 s of every rank's start); the wrappers are made at their first call instead
# (compat registry: import.deferred_torch_compile).
from megatron_rl.compat import deferred_compile as _deferred_compile  # noqa: E402

_deferred_compile.install()
