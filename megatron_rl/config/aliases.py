"""Names TRL and verl users type, mapped to ours.

``SAME`` aliases mean exactly what our key means: a command-line override under that name is
accepted and rewritten, with a one-line note.  ``SIMILAR`` ones differ in meaning or units, so they
only steer "did you mean" to the key to read about.  Matching is on the last one or two dotted
parts, so ``num_generations``, ``rollout.num_generations`` and verl's full
``actor_rollout_ref.rollout.n`` all resolve.  ``docs/coming_from_trl_verl.md`` is generated from
these tables.
"""

from __future__ import annotations

from typing import Optional

# alias -> (our key, where the name comes from)
SAME = {
    "num_generations": ("rollout.n", "TRL"),
    "rollout.n": ("rollout.n", "verl"),
    "beta": ("algorithm.kl_coef", "TRL"),
    "kl_loss_coef": ("algorithm.kl_coef", "verl"),
    "kl_loss_type": ("algorithm.kl_kind", "verl"),
    "learning_rate": ("actor.optim.lr", "TRL"),
    "max_completion_length": ("rollout.max_new_tokens", "TRL"),
    "max_response_length": ("rollout.max_new_tokens", "verl"),
    "max_steps": ("trainer.steps", "TRL"),
    "total_training_steps": ("trainer.steps", "verl"),
    "ppo_max_token_len_per_gpu": ("batch.max_tokens_per_rank", "verl"),
    "num_iterations": ("algorithm.ppo_epochs", "TRL"),
    "ppo_epochs": ("algorithm.ppo_epochs", "verl"),
    "epsilon": ("algorithm.clip_low", "TRL"),
    "epsilon_high": ("algorithm.clip_high", "TRL"),
    "clip_ratio_low": ("algorithm.clip_low", "verl"),
    "clip_ratio_high": ("algorithm.clip_high", "verl"),
    "entropy_coeff": ("algorithm.entropy_coef", "verl"),
    "loss_agg_mode": ("algorithm.loss_agg", "verl"),
    "adv_estimator": ("algorithm.advantage", "verl"),
    "train_batch_size": ("trainer.prompts_per_step", "verl"),
    "save_freq": ("trainer.save_every", "verl"),
    "tensor_model_parallel_size": ("parallel.tp", "verl / Megatron-LM"),
    "pipeline_model_parallel_size": ("parallel.pp", "verl / Megatron-LM"),
    "context_parallel_size": ("parallel.cp", "verl / Megatron-LM"),
    "virtual_pipeline_model_parallel_size": ("parallel.vpp", "verl / Megatron-LM"),
    "sequence_parallel": ("parallel.sequence_parallel", "verl / Megatron-LM"),
}

# alias -> (our key, how it differs)
SIMILAR = {
    "ppo_mini_batch_size": ("algorithm.mini_batches",
                            "verl gives prompts per mini-batch; ours is the number of mini-batches"),
    "clip_ratio": ("algorithm.clip_low", "verl's sets both ends; set algorithm.clip_low and algorithm.clip_high"),
    "max_prompt_length": ("data.max_prompt_tokens", "longer prompts are dropped and counted, never truncated"),
    "per_device_train_batch_size": ("batch.micro_batch_size", "or a token budget: batch.max_tokens_per_rank"),
    "gradient_checkpointing": ("model.recompute.granularity", "full or selective"),
    "lr": ("actor.optim.lr", "actor and critic have their own: actor.optim.lr, critic.optim.lr"),
    "output_dir": ("run.dir", "the run directory is run.dir/run.name"),
    "kl_coef": ("algorithm.kl_coef", "verl's algorithm.kl_ctrl.kl_coef is the in-reward KL: also set "
                                     "algorithm.kl_in_reward=true"),
}


def _tails(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[-2:]), parts[-1]] if len(parts) > 1 else [key]


def same_meaning(key: str, known: set[str]) -> Optional[tuple[str, str]]:
    """``(our key, origin)`` when ``key`` is a same-meaning alias (and not already one of ours)."""
    if key in known:
        return None
    for tail in _tails(key):
        if tail in SAME:
            return SAME[tail]
    return None


def suggestion(key: str) -> Optional[str]:
    """A "did you mean" text from the alias tables, or None."""
    for tail in _tails(key):
        if tail in SAME:
            ours, origin = SAME[tail]
            return f"did you mean {ours}? ({tail} is {origin}'s name for it)"
        if tail in SIMILAR:
            ours, how = SIMILAR[tail]
            return f"see {ours} ({how})"
    return None
