"""verl's ``ppo_megatron_trainer`` keys, each mapped to ours or marked as having no counterpart.

Built from verl's generated config (``verl/trainer/config/_generated_ppo_megatron_trainer.yaml``);
``tests/data/verl_ppo_megatron_trainer_keys.txt`` lists its key paths and a test checks that every
one of them is covered here, by its full path or by a pattern in ``VERL_GROUPS``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Optional

SAME, DIFFERENT, GENERATION, NO_EQUIVALENT = "same", "different", "generation", "no equivalent"
BY_VALUE = "by value"  # accepted when its value means what ours does (``Alias.rule`` decides), else refused


class Alias(NamedTuple):
    kind: str  # SAME: accepted and rewritten; BY_VALUE: ``rule`` reads the value; the others are refused
    ours: Optional[str]  # our key (None for NO_EQUIVALENT)
    note: str  # why it is refused ("" for SAME); ``{value}`` is replaced by the value typed
    origin: str = "verl"
    rule: Optional[Callable[[Any, "Context"], "Reading"]] = None


class Reading(NamedTuple):
    """What a BY_VALUE name amounts to: our keys to set (none when ours already does it) and why."""

    sets: dict
    why: str
    replaces: bool = False  # may change a key of ours the user set (it completes that key)


class Refused(Exception):
    """A BY_VALUE name whose value cannot run here: the problem and the fix, for one line."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


class Context(NamedTuple):
    """What a rule may read once every key of the file and the command line is merged."""

    value: Callable[[str], Any]  # our key -> its merged value
    typed: dict  # every name typed (the file's, then the command line's) -> its value, read as YAML
    given: frozenset  # our keys set by name (any name), not left at their defaults
    world_size: Optional[int]  # the job's process count when known (--nproc, torchrun, srun)


def same(ours: str, origin: str = "verl") -> Alias:
    return Alias(SAME, ours, "", origin)


def differs(ours: str, how: str, origin: str = "verl") -> Alias:
    return Alias(DIFFERENT, ours, how)._replace(origin=origin)


def absent(why: str = "") -> Alias:
    return Alias(NO_EQUIVALENT, None, why)


def by_value(ours: str, how: str, rule: Callable, origin: str = "verl") -> Alias:
    """``how`` is the documentation's line; ``rule(value, context)`` returns a Reading or raises Refused."""
    return Alias(BY_VALUE, ours, how, origin, rule)


def same_setting(a, b) -> bool:
    """``a`` and ``b`` name the same setting value: 2 == 2.0, true == True, null == None."""
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return str(a).lower().replace("none", "null") == str(b).lower().replace("none", "null")
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return str(a) == str(b)


def flag(value, name: str, ours: str) -> bool:
    """``value`` as true or false, or refused naming the key it maps to."""
    if isinstance(value, bool):
        return value
    raise Refused(f"{name} is true or false", f"give true or false; see {ours}")


def count(value, name: str, ours: str, least: int = 1) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= least:
        return value
    raise Refused(f"{name} is an integer >= {least}", f"give an integer >= {least}; see {ours}")


GENERATION_LAYOUT = ("generation's data-parallel replicas are the ranks its layout leaves (world size / "
                     "(rollout.layout.tp x rollout.layout.pp)): drop it")


def generation(why: str = GENERATION_LAYOUT) -> Alias:
    return Alias(GENERATION, None, why)


ULYSSES = differs("parallel.cp", "verl's Ulysses sequence parallelism is our context parallelism with all-to-all "
                                 "attention, set parallel.cp={value} parallel.cp_comm_type=a2a; "
                                 "parallel.sequence_parallel is Megatron's TP activation sharding, not this")

_OPTIM = {  # verl optim key -> our key under actor.optim / critic.optim (SAME), or an Alias
    "lr": "lr", "weight_decay": "weight_decay", "clip_grad": "clip_grad", "min_lr": "min_lr",
    "lr_warmup_steps": "warmup_steps", "lr_decay_style": "schedule",
    "betas": lambda o: differs(o + "adam_beta1", f"one key per beta: {o}adam_beta1 and {o}adam_beta2"),
    "lr_warmup_steps_ratio": lambda o: differs(o + "warmup_steps", "a number of steps here, not a ratio"),
    "total_training_steps": lambda o: differs("trainer.steps", "the schedule spans trainer.steps"),
    "optimizer": lambda o: absent("the optimizer is always Adam(W)"),
    "lr_warmup_init": lambda o: absent("warm-up starts from 0"),
    "lr_decay_steps": lambda o: differs(o + "schedule", "a decaying schedule spans the run's steps"),
    "weight_decay_incr_style": lambda o: absent(), "lr_wsd_decay_style": lambda o: absent(),
    "lr_wsd_decay_steps": lambda o: absent(), "use_checkpoint_opt_param_scheduler": lambda o: absent(),
    "override_optimizer_config": lambda o: absent("the optimizer keys are listed in docs/config.md"),
}

_LAYOUT = {
    "tensor_model_parallel_size": "parallel.tp", "pipeline_model_parallel_size": "parallel.pp",
    "virtual_pipeline_model_parallel_size": "parallel.vpp", "context_parallel_size": "parallel.cp",
    "expert_model_parallel_size": "parallel.ep", "expert_tensor_parallel_size": "parallel.etp",
    "sequence_parallel": "parallel.sequence_parallel", "seed": "run.seed", "dtype": "model.params_dtype",
    "use_remove_padding": "batch.packing",
    "override_transformer_config.recompute_granularity": "model.recompute.granularity",
    "override_transformer_config.recompute_modules": "model.recompute.modules",
    "override_transformer_config.recompute_method": "model.recompute.method",
    "override_transformer_config.recompute_num_layers": "model.recompute.num_layers",
}
_OFFLOAD = differs("trainer.offload", "one switch here: weights, gradients and optimizer state of the models "
                                      "not in use move to host memory")
_MEGATRON_OTHER = {
    "param_offload": _OFFLOAD, "grad_offload": _OFFLOAD, "optimizer_offload": _OFFLOAD,
    "use_dist_checkpointing": absent("checkpoints are always megatron-core distributed checkpoints"),
    "dist_checkpointing_path": differs("actor.init_checkpoint", "a megatron_rl checkpoint to start from"),
    "dist_checkpointing_prefix": absent(), "override_ddp_config": absent(),
    "override_mcore_model_config": absent("the model is read from model.hf_path or the model.* keys"),
    "override_transformer_config.attention_backend": absent("the attention kernel follows model.transformer_impl"),
    "override_transformer_config": absent("the model.* keys set megatron-core's TransformerConfig"),
    "use_mbridge": absent("Hugging Face weights are imported from model.hf_path"), "vanilla_mbridge": absent(),
    "forward_only": absent(),
}


def _megatron(prefix: str, role: Optional[str]) -> dict[str, Alias]:
    """``<prefix>megatron.*``: the actor's layout keys are ours; the critic and the reference model
    train on the actor's layout, so their sizes are accepted when they equal it, their other keys refused."""
    table = {}
    for key, ours in _LAYOUT.items():
        table[prefix + "megatron." + key] = (
            same(ours) if role is None else _actors_layout(ours, role) if ours.startswith("parallel.")
            else differs(ours, f"the {role} uses the actor's settings: set {ours}"))
    table[prefix + "megatron.use_distributed_optimizer"] = (
        same(f"{role or 'actor'}.optim.use_distributed_optimizer") if role != "reference model" else
        absent("the reference model has no optimizer"))
    table.update({prefix + "megatron." + key: alias for key, alias in _MEGATRON_OTHER.items()})
    return table


def _optim(prefix: str, ours: str) -> dict[str, Alias]:
    return {prefix + "optim." + key: (same(ours + val) if isinstance(val, str) else val(ours))
            for key, val in _OPTIM.items()}


_ONE_SETTING = "one setting here for every model and pass: {ours}"


def _shared(ours: str) -> Alias:
    return differs(ours, _ONE_SETTING.format(ours=ours))


def _equal_to(ours: str, accepted: str, refused: str) -> Alias:
    """A setting ours keeps once for every model: accepted when it equals ours, else refused.
    ``accepted`` and ``refused`` are formatted with ``ours``, ``current`` and ``value``."""
    def rule(value, ctx: Context) -> Reading:
        current = ctx.value(ours)
        if same_setting(value, current):
            return Reading({}, accepted.format(ours=ours, current=current, value=value))
        raise Refused(f"differs from {ours}={current}", refused.format(ours=ours, current=current, value=value))
    return by_value(ours, "accepted when equal to " + ours + ": " + refused.split(":")[0], rule)


def _actors_layout(ours: str, role: str) -> Alias:
    return _equal_to(ours, f"the {role} runs on the actor's layout, {{ours}}={{current}}",
                     f"the {role} uses the actor's settings: set {{ours}}={{value}}, or remove it")


def _one_setting(ours: str) -> Alias:
    return _equal_to(ours, _ONE_SETTING + "={current}", _ONE_SETTING + ": set {ours}={value}, or remove it")


def loggers(value, ctx: Context, origin: str = "verl") -> Reading:
    """verl's trainer.logger / TRL's report_to: a name or a list of them."""
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if names is None:
        raise Refused("a logger name or a list of them", "give e.g. ['console','tensorboard']")
    sets = {}
    for name in (str(n).lower() for n in names):
        if name in ("tensorboard", "wandb"):
            sets[f"trainer.{name}"] = True
        elif name in ("none", "all") and origin == "TRL":
            sets.update({"trainer.tensorboard": name == "all", "trainer.wandb": name == "all"})
        elif name != "console":
            raise Refused(f"{name} is not a logger here", "the console always logs; trainer.tensorboard=true and "
                                                          "trainer.wandb=true add the others")
    return Reading(sets, "the console always logs; TensorBoard and W&B are switches")


def _gpus_per_node(value, ctx: Context) -> Reading:
    """verl's GPUs per node x nodes is the job's process count; on one machine, --nproc's."""
    per_node = count(value, "trainer.n_gpus_per_node", "distributed.nproc")
    nodes = ctx.typed.get("trainer.nnodes", 1)
    nodes = count(nodes, "trainer.nnodes", "distributed.nproc") if nodes != 1 else 1
    world = ctx.world_size
    if world is None and nodes > 1:
        raise Refused(f"{nodes} machines", "start every machine's processes with torchrun or srun (docs/slurm.md); "
                                           "--nproc starts processes on this machine only")
    if world is not None and per_node * nodes != world:
        raise Refused(f"trainer.n_gpus_per_node x trainer.nnodes is {per_node * nodes} processes, the job has {world}",
                      f"set them to match the job ({world} processes), or remove them")
    return Reading({"distributed.nproc": per_node}, "processes on this machine, one per GPU")


def _nodes(value, ctx: Context) -> Reading:
    nodes = count(value, "trainer.nnodes", "distributed.nproc")
    if "trainer.n_gpus_per_node" in ctx.typed or nodes == 1:
        return Reading({}, "checked with trainer.n_gpus_per_node" if nodes > 1 else "one machine")
    raise Refused(f"{nodes} machines without trainer.n_gpus_per_node", "give trainer.n_gpus_per_node too, and start "
                                                                      "the processes with torchrun or srun")


def _engine_name(value, ctx: Context) -> Reading:
    if str(value).lower() in ("vllm", "sglang", "hf", "megatron"):
        return Reading({}, f"megatron-core's inference engine generates here (rollout.engine), not {value}")
    raise Refused(f"{value} is not a generator here", "megatron-core's inference engine generates: remove it "
                                                      "(rollout.engine, rollout.batching)")


def _project(value, ctx: Context) -> Reading:
    return Reading({"run.dir": os.path.join(str(ctx.value("run.dir")), str(value))},
                   "a project's runs go to run.dir/<project>/<run.name>", replaces=True)


def epochs_rule(steps_name: str, our_steps: str = "trainer.steps"):
    """Epochs end a run only when no step count is given, as in verl and the HF Trainer; here a run
    always has a step count."""
    def rule(value, ctx: Context) -> Reading:
        if our_steps in ctx.given:
            return Reading({}, f"{our_steps}={ctx.value(our_steps)} ends the run, as {steps_name} does: "
                               "the epochs count is not used")
        raise Refused("a number of epochs; a run here lasts trainer.steps",
                      f"set trainer.steps ({steps_name}): epochs x prompts in data.train_path / "
                      "trainer.prompts_per_step")
    return rule


def _critic_warmup(value, ctx: Context) -> Reading:
    if same_setting(value, 0):
        return Reading({}, "no critic warm-up: the actor updates from the first step")
    raise Refused("the actor updates from the first step here", "remove it: there are no critic-only warm-up steps")


def _prompt_length(value, ctx: Context) -> Reading:
    return Reading({"data.max_prompt_tokens": count(value, "data.max_prompt_length", "data.max_prompt_tokens")},
                   "longer prompts are dropped and counted, never truncated")


def _filter_overlong(value, ctx: Context) -> Reading:
    if flag(value, "data.filter_overlong_prompts", "data.max_prompt_tokens"):
        return Reading({}, "prompts over data.max_prompt_tokens are dropped and counted")
    raise Refused("longer prompts are always dropped here", "remove it; prompts over data.max_prompt_tokens are "
                                                            "dropped and counted")


def _truncation(value, ctx: Context) -> Reading:
    if str(value) != "error":
        raise Refused("prompts are never truncated here: longer ones are dropped and counted",
                      "remove it; raise data.max_prompt_tokens to keep longer prompts")
    if ctx.typed.get("data.filter_overlong_prompts") is True:
        return Reading({}, "with filter_overlong_prompts=True nothing is left to truncate: longer prompts are "
                           "dropped and counted")
    raise Refused("verl stops at a longer prompt; here longer prompts are dropped and counted",
                  "add data.filter_overlong_prompts=True to accept that, or raise data.max_prompt_tokens")


VERL_KL_LOSS_COEF = 0.001  # verl's actor.kl_loss_coef default


def _kl_loss(value, ctx: Context) -> Reading:
    coef, in_reward = ctx.value("algorithm.kl_coef"), ctx.value("algorithm.kl_in_reward")
    if flag(value, "use_kl_loss", "algorithm.kl_coef"):
        if in_reward:
            raise Refused("verl adds both KLs; here the KL is in the loss or in the reward",
                          "set algorithm.kl_in_reward=false (verl's use_kl_in_reward), or remove use_kl_loss")
        if "algorithm.kl_coef" not in ctx.given:
            return Reading({"algorithm.kl_coef": VERL_KL_LOSS_COEF}, "the KL goes into the loss, with verl's "
                                                                      "kl_loss_coef default")
        return Reading({}, f"the KL goes into the loss with algorithm.kl_coef={coef}")
    if coef > 0 and not in_reward:
        raise Refused(f"algorithm.kl_coef={coef} puts the KL in the loss here",
                      "set algorithm.kl_coef=0, or algorithm.kl_in_reward=true for an in-reward KL")
    return Reading({}, "no KL in the loss")


def _reward_kl_coef(value, ctx: Context) -> Reading:
    if ctx.value("algorithm.kl_in_reward"):
        return Reading({"algorithm.kl_coef": value}, "verl's in-reward KL coefficient")
    return Reading({}, "unused while algorithm.kl_in_reward=false, as in verl")


def _mini_batch(value, ctx: Context) -> Reading:
    """verl's mini-batch is counted in prompts (each with its rollout.n samples); ours is a count of
    mini-batches per step."""
    prompts = count(value, "ppo_mini_batch_size", "algorithm.mini_batches")
    step = ctx.value("trainer.prompts_per_step")
    if step % prompts:
        raise Refused(f"{prompts} prompts per mini-batch do not divide trainer.prompts_per_step={step} "
                      "(verl's data.train_batch_size)",
                      f"give a ppo_mini_batch_size that divides {step}, or set algorithm.mini_batches")
    return Reading({"algorithm.mini_batches": step // prompts},
                   f"{step // prompts} mini-batches of {prompts} prompts x rollout.n={ctx.value('rollout.n')} samples")


def _val_before_train(value, ctx: Context) -> Reading:
    if flag(value, "trainer.val_before_train", "trainer.eval_every"):
        return Reading({}, "the evaluation runs before the first step whenever trainer.eval_every > 0")
    if ctx.value("trainer.eval_every") == 0:
        return Reading({}, "no evaluation: trainer.eval_every=0")
    raise Refused("the evaluation always runs before the first step when trainer.eval_every > 0", "remove it")


def _never_is_zero(ours: str, what: str):
    """verl's save_freq / test_freq: -1 is never, which is our 0."""
    def rule(value, ctx: Context) -> Reading:
        if same_setting(value, -1):
            return Reading({ours: 0}, f"verl's -1 is {ours}=0 here: {what}")
        return Reading({ours: value}, "every N steps")
    return by_value(ours, f"-1 (never) is 0 here: {what}", rule)


def _one_file(ours: str):
    """verl's train_files / val_files: a path or a list of paths; one file is read here."""
    def rule(value, ctx: Context) -> Reading:
        if isinstance(value, list):
            if len(value) != 1:
                raise Refused(f"a list of {len(value)} files", f"concatenate them into one file and set {ours}")
            value = value[0]
        return Reading({ours: str(value)}, "one file")
    return by_value(ours, "a path, or a list of one path", rule)


_SAVE_FREQ = _never_is_zero("trainer.save_every", "a checkpoint only at the end and on SIGTERM/SIGUSR1")
_TEST_FREQ = _never_is_zero("trainer.eval_every", "no evaluation")


def _gradient_checkpointing(value, ctx: Context) -> Reading:
    granularity = ctx.value("model.recompute.granularity")
    if flag(value, "enable_gradient_checkpointing", "model.recompute.granularity"):
        return Reading({"model.recompute.granularity": "full"}, "full activation recompute, one setting for "
                                                                "actor and critic")
    if granularity is None:
        return Reading({}, "no activation recompute")
    raise Refused(f"model.recompute.granularity={granularity} recomputes every model's activations",
                  "remove it, or set model.recompute.granularity=null")


VERL_REWARD_NAME = "compute_score"  # the function verl calls when custom_reward_function.name is not given


def _reward_path(value, ctx: Context) -> Reading:
    name = ctx.typed.get("custom_reward_function.name") or VERL_REWARD_NAME
    return Reading({"reward.fn": f"{value}:{name}"}, "verl's custom_reward_function.path and .name")


def _reward_name(value, ctx: Context) -> Reading:
    if "custom_reward_function.path" in ctx.typed:
        return Reading({}, "with custom_reward_function.path")
    fn = str(ctx.value("reward.fn"))
    path = fn.rpartition(":")[0] or fn
    if "reward.fn" in ctx.given and path.endswith(".py"):
        return Reading({"reward.fn": f"{path}:{value}"}, "the function of reward.fn's file", replaces=True)
    raise Refused("verl reads custom_reward_function.name from custom_reward_function.path",
                  "give custom_reward_function.path too, or reward.fn=<file.py>:<name>")


A, R, G = "actor_rollout_ref.actor.", "actor_rollout_ref.ref.", "actor_rollout_ref.rollout."
M = "actor_rollout_ref.model."

VERL = {
    **_optim(A, "actor.optim."), **_optim("critic.", "critic.optim."),
    **_megatron(A, None), **_megatron(R, "reference model"), **_megatron("critic.", "critic"),
    # --- actor
    A + "rollout_n": differs("rollout.n", "set rollout.n"),
    A + "strategy": absent("training always uses megatron-core"),
    A + "ppo_mini_batch_size": by_value("algorithm.mini_batches", "prompts per mini-batch: read as "
                                        "algorithm.mini_batches = data.train_batch_size / ppo_mini_batch_size",
                                        _mini_batch),
    A + "ppo_micro_batch_size": differs("batch.micro_batch_size", "verl's counts over all GPUs; ours per rank"),
    A + "ppo_micro_batch_size_per_gpu": same("batch.micro_batch_size"),
    A + "use_dynamic_bsz": differs("batch.max_tokens_per_rank",
                                   "micro-batches are filled to a token budget when it is set or derived"),
    A + "ppo_max_token_len_per_gpu": same("batch.max_tokens_per_rank"),
    A + "clip_ratio": differs("algorithm.clip_low", "verl's sets both ends; set algorithm.clip_low and "
                                                    "algorithm.clip_high"),
    A + "clip_ratio_low": same("algorithm.clip_low"), A + "clip_ratio_high": same("algorithm.clip_high"),
    A + "clip_ratio_c": same("algorithm.dual_clip"),
    A + "tau_pos": absent(), A + "tau_neg": absent(), A + "freeze_vision_tower": absent("text models only"),
    A + "policy_loss.loss_mode": differs("algorithm.policy_loss", "verl's vanilla is our ppo; gspo and cispo exist "
                                                                  "here, the other modes do not"),
    A + "loss_agg_mode": same("algorithm.loss_agg"),
    A + "loss_scale_factor": differs("algorithm.loss_agg", "seq-mean-token-sum-norm divides by "
                                                           "rollout.max_new_tokens"),
    A + "entropy_coeff": same("algorithm.entropy_coef"),
    A + "calculate_entropy": absent(),
    A + "use_kl_loss": by_value("algorithm.kl_coef", "the KL is in the loss whenever algorithm.kl_coef > 0 and "
                                                     "algorithm.kl_in_reward=false; true without kl_loss_coef sets "
                                                     "verl's 0.001", _kl_loss),
    A + "kl_loss_coef": same("algorithm.kl_coef"), A + "kl_loss_type": same("algorithm.kl_kind"),
    A + "ppo_epochs": same("algorithm.ppo_epochs"),
    A + "shuffle": absent(), A + "data_loader_seed": differs("run.seed", "one seed for the run"),
    A + "router_replay.mode": differs("algorithm.routing_replay", "true or false here: replay the "
                                                                  "rollout's routing"),
    A + "load_weight": absent(),
    # --- reference model
    R + "rollout_n": differs("rollout.n", "set rollout.n"),
    R + "strategy": absent("the reference model always runs on megatron-core"),
    R + "log_prob_micro_batch_size": _shared("batch.micro_batch_size"),
    R + "log_prob_micro_batch_size_per_gpu": _one_setting("batch.micro_batch_size"),
    R + "log_prob_use_dynamic_bsz": _shared("batch.max_tokens_per_rank"),
    R + "log_prob_max_token_len_per_gpu": _shared("batch.max_tokens_per_rank"),
    R + "router_replay.mode": differs("algorithm.routing_replay", "one setting for every forward"),
    R + "load_weight": absent(),
    # --- generation
    G + "name": by_value("rollout.engine", "vllm, sglang, hf: accepted, megatron-core's inference generates "
                                           "(no vLLM/SGLang); rollout.batching picks its dynamic or static batching",
                         _engine_name),
    G + "temperature": same("rollout.temperature"), G + "top_p": same("rollout.top_p"),
    G + "top_k": differs("rollout.top_k", "0 turns it off here (verl: -1)"),
    G + "prompt_length": differs("data.max_prompt_tokens", "longer prompts are dropped and counted, never "
                                                            "truncated"),
    G + "response_length": same("rollout.max_new_tokens"),
    G + "gpu_memory_utilization": differs("rollout.kv_cache_memory", "a share of the memory free when a rollout "
                                                                      "starts, for the KV cache only"),
    G + "tensor_model_parallel_size": same("rollout.layout.tp"), G + "data_parallel_size": generation(),
    G + "expert_parallel_size": same("rollout.layout.ep"),
    G + "pipeline_model_parallel_size": same("rollout.layout.pp"),
    G + "dtype": generation("generation uses the training weights' dtype (model.params_dtype)"),
    G + "max_num_batched_tokens": differs("rollout.prefill_chunk_tokens", "rollout.engine=megatron: most tokens "
                                                                          "one forward step takes"),
    G + "max_num_seqs": differs("rollout.max_batch_size", "counted per rank here"),
    G + "log_prob_micro_batch_size": _shared("batch.micro_batch_size"),
    G + "log_prob_micro_batch_size_per_gpu": _one_setting("batch.micro_batch_size"),
    G + "log_prob_use_dynamic_bsz": _shared("batch.max_tokens_per_rank"),
    G + "log_prob_max_token_len_per_gpu": _shared("batch.max_tokens_per_rank"),
    G + "do_sample": differs("rollout.temperature", "rollout.temperature=0 is greedy"),
    G + "n": same("rollout.n"),
    G + "calculate_log_probs": differs("algorithm.old_logprobs", "algorithm.old_logprobs=rollout uses the "
                                                                 "engine's log-probs"),
    G + "enable_rollout_routing_replay": differs("algorithm.routing_replay", "true or false here"),
    # --- model
    M + "path": same("model.hf_path"), M + "tokenizer_path": same("data.tokenizer"),
    M + "enable_gradient_checkpointing": by_value("model.recompute.granularity", "True: full activation recompute",
                                                  _gradient_checkpointing),
    "critic.model.enable_gradient_checkpointing": by_value("model.recompute.granularity", "one setting for actor and "
                                                           "critic; True: full activation recompute",
                                                           _gradient_checkpointing),
    M + "use_remove_padding": same("batch.packing"),
    "actor_rollout_ref.nccl_timeout": same("distributed.timeout_s"),
    "actor_rollout_ref.hybrid_engine": absent("generation runs in the training job: on the actor's shards, on a "
                                              "layout of its own refit from them (rollout.layout) or on ranks of "
                                              "its own (rollout.ranks)"),
    # --- data
    "data.train_files": _one_file("data.train_path"), "data.val_files": _one_file("data.val_path"),
    "data.max_prompt_length": by_value("data.max_prompt_tokens", "longer prompts are dropped and counted, never "
                                                                 "truncated", _prompt_length),
    "data.max_response_length": same("rollout.max_new_tokens"),
    "data.train_batch_size": same("trainer.prompts_per_step"),
    "data.seed": differs("run.seed", "one seed for the run, data order included"),
    "data.filter_overlong_prompts": by_value("data.max_prompt_tokens", "True accepted: longer prompts are always "
                                                                       "dropped and counted", _filter_overlong),
    "data.truncation": by_value("data.max_prompt_tokens", "error accepted with filter_overlong_prompts=True: "
                                                          "prompts are never truncated, longer ones are dropped",
                                _truncation),
    "data.reward_fn_key": differs("reward.fn", "one reward function for the run"),
    # --- reward
    "custom_reward_function.path": by_value("reward.fn", "read as reward.fn=<path>:<name>, the name "
                                                         "compute_score unless custom_reward_function.name is given",
                                            _reward_path),
    "custom_reward_function.name": by_value("reward.fn", "with custom_reward_function.path, or with a reward.fn "
                                                         "file: reward.fn=<path>:<name>", _reward_name),
    "reward_manager.name": differs("reward.fn", "reward.fn names a registered reward or module:function"),
    # --- critic
    "critic.rollout_n": differs("rollout.n", "set rollout.n"),
    "critic.strategy": absent("the critic always trains on megatron-core"),
    "critic.enable": differs("algorithm.advantage", "the critic is used with algorithm.advantage=gae"),
    "critic.model.path": same("critic.hf_path"),
    "critic.model.tokenizer_path": differs("data.tokenizer", "one tokenizer for the run"),
    "critic.ppo_mini_batch_size": by_value("algorithm.mini_batches", "prompts per mini-batch, for actor and critic: "
                                                                     "algorithm.mini_batches = data.train_batch_size "
                                                                     "/ ppo_mini_batch_size", _mini_batch),
    "critic.ppo_micro_batch_size": _shared("batch.micro_batch_size"),
    "critic.ppo_micro_batch_size_per_gpu": _one_setting("batch.micro_batch_size"),
    "critic.use_dynamic_bsz": _shared("batch.max_tokens_per_rank"),
    "critic.ppo_max_token_len_per_gpu": _shared("batch.max_tokens_per_rank"),
    "critic.forward_max_token_len_per_gpu": _shared("batch.max_tokens_per_rank"),
    "critic.ppo_epochs": _one_setting("algorithm.ppo_epochs"),
    "critic.loss_agg_mode": _one_setting("algorithm.loss_agg"),
    "critic.cliprange_value": same("algorithm.value_clip"),
    "critic.nccl_timeout": _one_setting("distributed.timeout_s"),
    "critic.shuffle": absent(), "critic.data_loader_seed": differs("run.seed", "one seed for the run"),
    "critic.load_weight": absent(),
    # --- algorithm
    "algorithm.adv_estimator": same("algorithm.advantage"),
    "algorithm.norm_adv_by_std_in_grpo": same("algorithm.norm_by_std"),
    "algorithm.use_kl_in_reward": same("algorithm.kl_in_reward"),
    "algorithm.kl_penalty": same("algorithm.kl_kind"),
    "algorithm.kl_ctrl.type": same("algorithm.kl_controller"),
    "algorithm.kl_ctrl.kl_coef": by_value("algorithm.kl_coef", "verl's in-reward KL: read as algorithm.kl_coef with "
                                                               "algorithm.kl_in_reward=true, unused without",
                                          _reward_kl_coef),
    "algorithm.kl_ctrl.horizon": same("algorithm.kl_horizon"),
    "algorithm.kl_ctrl.target_kl": same("algorithm.kl_target"),
    "algorithm.rollout_correction.rollout_is": differs("algorithm.rollout_correction.mode",
                                                       "mode=tis, with rollout_correction.level token or sequence"),
    "algorithm.rollout_correction.rollout_is_threshold": same("algorithm.rollout_correction.threshold"),
    "algorithm.rollout_correction.rollout_rs": differs("algorithm.rollout_correction.mode",
                                                       "mode=mis masks instead of truncating"),
    "algorithm.rollout_correction.rollout_rs_threshold": differs("algorithm.rollout_correction.threshold",
                                                                 "one threshold, with mode=mis"),
    "algorithm.rollout_correction.bypass_mode": differs("algorithm.old_logprobs", "algorithm.old_logprobs=rollout "
                                                                                  "takes the engine's log-probs"),
    # --- trainer
    "trainer.total_epochs": by_value("trainer.steps", "accepted with trainer.total_training_steps, which ends the "
                                                      "run as in verl; a run here always has a step count",
                                     epochs_rule("trainer.total_training_steps")),
    "trainer.total_training_steps": same("trainer.steps"),
    "trainer.experiment_name": same("run.name"),
    "trainer.project_name": by_value("run.dir", "a project's runs go to run.dir/<project>/<run.name>", _project),
    "trainer.rollout_data_dir": differs("trainer.log_samples", "a switch: every trained sample goes to <run "
                                                               "dir>/samples/step_<k>.jsonl, with its id and version"),
    "trainer.logger": by_value("trainer.tensorboard", "console, tensorboard, wandb: the console always; "
                                                      "trainer.tensorboard and trainer.wandb add the others", loggers),
    "trainer.nnodes": by_value("distributed.nproc", "checked with trainer.n_gpus_per_node against the job's process "
                                                    "count; several machines start with torchrun or srun", _nodes),
    "trainer.n_gpus_per_node": by_value("distributed.nproc", "processes on this machine, one per GPU; x nnodes "
                                                             "must equal the job's process count", _gpus_per_node),
    "trainer.save_freq": _SAVE_FREQ,
    "trainer.resume_mode": differs("trainer.resume", "auto, never, or a checkpoint path"),
    "trainer.resume_from_path": differs("trainer.resume", "give the checkpoint path as trainer.resume"),
    "trainer.test_freq": _TEST_FREQ,
    "trainer.default_local_dir": differs("run.dir", "checkpoints go under run.dir/run.name"),
    "trainer.max_actor_ckpt_to_keep": same("trainer.keep_last"),
    "trainer.max_critic_ckpt_to_keep": _one_setting("trainer.keep_last"),
    "trainer.device": same("distributed.device"),
    "trainer.critic_warmup": by_value("trainer.steps", "0 accepted: the actor updates from the first step, no "
                                                       "critic-only warm-up", _critic_warmup),
}

# verl keys with no counterpart here, by reason.
_NONE = {
    "": """actor.policy_loss.clip_cov_ratio actor.policy_loss.clip_cov_lb actor.policy_loss.clip_cov_ub
           actor.policy_loss.kl_cov_ratio actor.policy_loss.ppo_kl_coef actor.use_prefix_grouper
           model.enable_activation_offload model.override_config.moe_config.freeze_moe_router
           critic.model.override_config.moe_config.freeze_moe_router
           algorithm.rollout_correction.loss_type algorithm.rollout_correction.rollout_is_batch_normalize
           algorithm.use_pf_ppo algorithm.pf_ppo.reweight_method algorithm.pf_ppo.weight_pow
           trainer.balance_batch trainer.esi_redundant_time trainer.del_local_ckpt_after_load
           trainer.default_hdfs_dir trainer.use_legacy_worker_impl
           trainer.ray_wait_register_center_timeout data.use_shm model.use_shm""",
    "megatron-core's own kernels are used (model.transformer_impl)": """actor.use_torch_compile
           actor.use_fused_kernels ref.use_torch_compile model.use_liger model.use_fused_kernels
           model.fused_kernel_options.impl_backend model.tiled_mlp.enabled model.tiled_mlp.num_shards""",
    "the model is read from model.hf_path or the model.* keys": """model.hf_config_path model.trust_remote_code
           model.external_lib model.override_config.model_config critic.model.override_config.model_config
           critic.model.external_lib critic.model.trust_remote_code""",
    "the chat template comes with data.tokenizer": "model.custom_chat_template data.apply_chat_template_kwargs",
    "prompt records are read with data.prompt_key, data.messages_key and data.answer_key":
        """data.return_raw_input_ids data.return_raw_chat
           data.return_full_prompt data.dataloader_num_workers data.filter_overlong_prompts_workers
           data.trust_remote_code data.custom_cls.path data.custom_cls.name data.sampler.class_path
           data.sampler.class_name data.datagen.path data.datagen.name data.train_max_samples""",
    "text models only": """data.image_patch_size data.image_key data.video_key data.return_multi_modal_inputs""",
    "not configurable here": """data.val_batch_size data.validation_shuffle trainer.log_val_generations""",
}
_SHORT_ROOTS = {"actor.": A, "ref.": R, "model.": M}


def _full(name: str) -> str:
    root = next((r for r in _SHORT_ROOTS if name.startswith(r)), None)
    return _SHORT_ROOTS[root] + name[len(root):] if root else name


VERL.update({_full(name): absent(why) for why, names in _NONE.items() for name in names.split()})

# The evaluation set: verl's validation keys.
_VAL = "actor_rollout_ref.rollout.val_kwargs."
VERL.update({
    _VAL + "temperature": same("eval.temperature"), _VAL + "n": same("eval.n"), _VAL + "top_p": same("eval.top_p"),
    _VAL + "top_k": differs("eval.top_k", "0 turns top-k off here (verl: -1)"),
    _VAL + "do_sample": differs("eval.temperature", "no separate switch: eval.temperature=0 (the default) is "
                                                    "greedy, above 0 samples"),
    "data.val_max_samples": differs("eval.max_prompts", "the first N prompts of data.val_path, in file order"),
    "trainer.val_before_train": by_value("trainer.eval_every", "the evaluation always runs before the first step "
                                                               "when trainer.eval_every > 0", _val_before_train),
})

# Patterns (fnmatch, ``*`` spans dots) for whole groups; the first that matches wins.
_LORA = "full fine-tuning only: no LoRA"
VERL_GROUPS = (
    ("*._target_", absent("verl's dataclass marker")),
    ("*.profiler.*", absent("no profiler hooks")), ("global_profiler.*", absent("no profiler hooks")),
    ("actor_rollout_ref.model.lora*", absent(_LORA)), ("critic.model.lora*", absent(_LORA)),
    ("actor_rollout_ref.model.target_modules", absent(_LORA)),
    ("actor_rollout_ref.model.exclude_modules", absent(_LORA)),
    ("actor_rollout_ref.model.mtp.*", absent()), ("actor_rollout_ref.rollout.mtp", absent()),
    ("*.checkpoint.*", absent("what a checkpoint holds is not configurable")),
    ("*.router_replay.*", absent()),
    ("actor_rollout_ref.rollout.multi_turn.*", absent("single-turn generation only")),
    ("actor_rollout_ref.rollout.agent.*", absent("single-turn generation only")),
    ("data.tool_config_path", absent("single-turn generation only")),
    ("actor_rollout_ref.rollout.*", generation("a vLLM/SGLang setting: megatron-core's engine generates in the "
                                               "job's own processes (rollout.* keys, docs/rollout.md)")),
    ("reward_model.*", absent("rewards come from reward.fn, a function, not a served reward model")),
    ("reward_manager.*", differs("reward.fn", "reward.fn names a registered reward or module:function")),
    ("ray_kwargs.*", absent("no Ray: megatron-rl --nproc, torchrun or srun start the ranks")),
    ("transfer_queue.*", absent()),
)

# Bare names a verl (or Megatron-LM) user types, for the tail match; full paths above take precedence.
VERL_NAMES = {
    "rollout.n": same("rollout.n"), "kl_loss_coef": same("algorithm.kl_coef"),
    "kl_loss_type": same("algorithm.kl_kind"), "max_response_length": same("rollout.max_new_tokens"),
    "total_training_steps": same("trainer.steps"), "ppo_max_token_len_per_gpu": same("batch.max_tokens_per_rank"),
    "ppo_micro_batch_size_per_gpu": same("batch.micro_batch_size"),
    "ppo_epochs": same("algorithm.ppo_epochs"), "clip_ratio_low": same("algorithm.clip_low"),
    "clip_ratio_high": same("algorithm.clip_high"), "entropy_coeff": same("algorithm.entropy_coef"),
    "loss_agg_mode": same("algorithm.loss_agg"), "adv_estimator": same("algorithm.advantage"),
    "train_batch_size": same("trainer.prompts_per_step"), "save_freq": _SAVE_FREQ,
    "model.path": same("model.hf_path"), "train_files": _one_file("data.train_path"),
    "val_files": _one_file("data.val_path"), "test_freq": _TEST_FREQ,
    "tensor_model_parallel_size": same("parallel.tp", "verl / Megatron-LM"),
    "pipeline_model_parallel_size": same("parallel.pp", "verl / Megatron-LM"),
    "context_parallel_size": same("parallel.cp", "verl / Megatron-LM"),
    "virtual_pipeline_model_parallel_size": same("parallel.vpp", "verl / Megatron-LM"),
    "expert_model_parallel_size": same("parallel.ep", "verl / Megatron-LM"),
    "sequence_parallel": same("parallel.sequence_parallel", "verl / Megatron-LM"),
    "ulysses_sequence_parallel_size": ULYSSES,
    "ppo_mini_batch_size": VERL[A + "ppo_mini_batch_size"], "clip_ratio": VERL[A + "clip_ratio"],
    "max_prompt_length": VERL["data.max_prompt_length"], "kl_coef": VERL["algorithm.kl_ctrl.kl_coef"],
    "use_kl_loss": VERL[A + "use_kl_loss"], "use_dynamic_bsz": VERL[A + "use_dynamic_bsz"],
    "enable_gradient_checkpointing": VERL[M + "enable_gradient_checkpointing"],
    "use_remove_padding": same("batch.packing"), "total_epochs": VERL["trainer.total_epochs"],
}
