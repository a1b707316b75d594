"""The RL math as pure tensor functions, kept free of models and process groups.

Keeping advantages, losses and KL apart from the engine lets every formula be checked by
hand on tiny tensors, and lets the engine change how it shards a batch without touching them.
Each family is a registry filled by one decorator per entry (``advantages.register_advantage``,
``losses.register_policy_loss``, ``losses.register_aggregation``, ``kl.register_kl``,
``rollout_correction.register_correction``); the config schema, validation, the trainer and the
feature matrix read the registries.  ``docs/algorithms.md`` gives every formula.
"""

from megatron_rl.algorithms import advantages, kl, losses, rollout_correction, shaping

__all__ = ["advantages", "kl", "losses", "rollout_correction", "shaping"]
