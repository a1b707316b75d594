"""Learning-rate schedules after warm-up: ``optim.schedule`` -> megatron-core's ``lr_decay_style``.

Kept free of megatron imports so config validation can read the choices.
"""

from __future__ import annotations

from megatron_rl.config.choices import LR_SCHEDULE_NAMES, require_same

# name -> (megatron lr_decay_style, whether the rate decays to optim.min_lr)
LR_SCHEDULES = {
    "constant": ("constant", False),
    "linear": ("linear", True),
    "cosine": ("cosine", True),
}
require_same(LR_SCHEDULES, LR_SCHEDULE_NAMES, "optim.schedule")
