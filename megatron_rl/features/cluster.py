"""Clusters: Slurm, requeue, multi-node."""

from __future__ import annotations

from megatron_rl.features.base import TESTED_CPU, Feature

AREA = "cluster"
FEATURES = [
    Feature(
        "Slurm launch (sbatch)", "cluster", TESTED_CPU,
        "scripts/slurm/ppo.sbatch: one srun task per node running torchrun (c10d rendezvous on the first node), logs "
        "in the run dir, one dead node ends the job; tested against a real single-node Slurm in CI.",
        ("tests/test_slurm.py::test_smoke_job_on_one_node_with_four_ranks",
         "tests/test_slurm.py::test_bad_override_fails_the_job_with_the_config_error"),
        config="sbatch scripts/slurm/ppo.sbatch",
    ),
    Feature(
        "Requeue and resume on preemption", "cluster", TESTED_CPU,
        "--signal=B:USR1 reaches every rank, the trainer checkpoints after the current step and exits 0, the script "
        "requeues the job, and the restarted job resumes without losing or repeating a step.",
        ("tests/test_slurm.py::test_preempted_ppo_job_resumes_from_checkpoint",
         "tests/test_slurm.py::test_usr1_checkpoints_and_requeues_with_stub_trainer"),
        config="#SBATCH --requeue --signal=B:USR1@300; trainer.resume=auto",
    ),
    Feature(
        "Multi-node launch", "cluster", TESTED_CPU,
        "The same sbatch script with NODES>1 (torchrun c10d rendezvous on the first node). Tested on CPU with two "
        "network namespaces as two nodes (gloo, TP=2 across them): the script's torchrun line on each node, a PPO job "
        "that trains, a node killed mid-step ending the job on the other within seconds, and a new job resuming.",
        ("tests/test_multinode.py::test_ppo_job_spans_two_nodes",
         "tests/test_multinode.py::test_a_lost_node_ends_the_job_promptly_and_a_new_job_resumes"),
        config="NODES=... sbatch scripts/slurm/ppo.sbatch",
    ),
]
