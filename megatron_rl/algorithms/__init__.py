"""The RL math as pure tensor functions, kept free of models and process groups.

Keeping advantages, losses and KL apart from the engine lets every formula be checked by
hand on tiny tensors, and lets the engine change how it shards a batch without touching them.
"""

from megatron_rl.algorithms import advantages, kl, losses

__all__ = ["advantages", "kl", "losses"]
