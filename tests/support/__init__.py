"""Everything the tests share besides the multi-process harness: the tiny runs, reward functions
and HF model builders (:mod:`tests.support.helpers`) and a local Slurm (:mod:`tests.support.local_slurm`).

The harness that spawns and reuses gloo workers lives in the package (:mod:`megatron_rl.testing`),
because the workers import it; nothing here ships with the trainer.
"""
