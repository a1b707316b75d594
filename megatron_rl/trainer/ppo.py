"""The PPO loop, read top to bottom: build, (warm up), then per step

1. hand the actor's current weights to the rollout engine and sample ``rollout.n`` responses per
   prompt (``rollout/dp.py``: prompts split over data-parallel ranks, samples gathered so every
   rank holds them);
2. score them (``rewards/distributed.py``: every rank grades a share, each sample bounded by
   ``reward.timeout_s``, and every rank receives all scores), add the overlong penalty (``algorithms/shaping.py``); with
   dynamic sampling,
   repeat 1-2 on further prompts until the batch holds enough groups whose rewards differ
   (``trainer/dynamic_sampling.py``);
3. old log-probs (and entropy) -- recomputed by the training model, or taken from the update's own
   forward when it is exactly on-policy, or the rollout engine's (``algorithms/old_logprobs.py``) --,
   reference log-probs, values; token rewards, KL, advantages (the registered estimator),
   rollout-correction weights;
4. update actor and critic over ``ppo_epochs`` x ``mini_batches`` optimizer steps, and stop the
   run when every step of a phase was skipped as non-finite (``trainer/guards.py``);
5. evaluate on the held-out prompts when due (``trainer/evaluation.py``; also before the first step);
   log metrics, checkpoint when due or when SIGTERM/SIGUSR1 asked for it.

Works for every registered advantage estimator and policy loss (GAE with a critic; GRPO, RLOO,
Dr.GRPO, REINFORCE++ without; PPO, GSPO, CISPO losses), on every TP/PP/VPP/CP/DP layout.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_rl.algorithms import losses
from megatron_rl.algorithms.advantages import needs_critic
from megatron_rl.algorithms.kl import apply_kl_penalty, make_kl_controller
from megatron_rl.algorithms.old_logprobs import old_logprob_source
from megatron_rl.algorithms.rollout_correction import correction_weights
from megatron_rl.algorithms.shaping import overlong_penalty
from megatron_rl.config.choices import ONE_STEP_OFF
from megatron_rl.config.model_io import model_config_to_dict
from megatron_rl.config.schema import Config
from megatron_rl.data.prompts import PromptSampler, PromptSet
from megatron_rl.data.sources import load_prompt_source, tokenizer_spec
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.distributed import collectives, faults
from megatron_rl.distributed.metrics import reduce_sum_count, reduce_sums
from megatron_rl.distributed.runtime import ParallelLayout, init_model_parallel, resolve_device
from megatron_rl.engine import checkpoint
from megatron_rl.engine.forward import batch_plan, run_sequences
from megatron_rl.engine.offload import Offloader
from megatron_rl.engine.trainable import Trainable, freeze, make_trainable
from megatron_rl.envs.build import with_environment
from megatron_rl.envs.trajectories import env_metrics, trajectory_scores
from megatron_rl.models.builder import build_gpt_chunks
from megatron_rl.models.canonical import gather_canonical, load_canonical
from megatron_rl.models.heads import ValueOutput, attach_value_head, logprob_head
from megatron_rl.models.hf_bridge import load_hf_weights, model_source_meta
from megatron_rl.models.moe import load_routing, moe_metrics, moe_pass
from megatron_rl.models.seeded_init import seeded_init
from megatron_rl.planner.memory import total_params
from megatron_rl.resolve import AUTO_ORIGIN, DERIVED, resolve
from megatron_rl.rewards.conventions import needs_answers
from megatron_rl.rewards.distributed import rewards_on_every_rank
from megatron_rl.rewards.registry import Graded, get_reward_fn
from megatron_rl.rollout.dp import generate_data_parallel
from megatron_rl.rollout.engine import make_rollout_engine, on_active_layout
from megatron_rl.rollout.sampling import SamplingParams, eos_token_ids
from megatron_rl.trainer.dynamic_sampling import fill_batch
from megatron_rl.trainer.evaluation import Evaluator
from megatron_rl.trainer.experience import Experience, Samples, compute_advantages, token_rewards_from_scores
from megatron_rl.trainer.finished import (
    SET_ASIDE_ENV,
    finished_message,
    finished_step,
    set_aside_message,
    set_aside_previous_run,
)
from megatron_rl.trainer.guards import check_updates_applied
from megatron_rl.trainer.metrics import (
    MetricsWriter,
    experience_metrics,
    memory_metrics,
    optimizer_step_metrics,
    plot_metrics,
    throughput_metrics,
)
from megatron_rl.trainer.old_policy import OldPolicy, PolicyPass, old_policy
from megatron_rl.trainer.one_step_off import GeneratedBatch, buffered_batches, staleness_metrics
from megatron_rl.trainer.remote_rollout import RemoteRollout
from megatron_rl.trainer.reward_signal import AgentSessions, RewardSignal, stderr_line
from megatron_rl.trainer.sample_log import SampleLog
from megatron_rl.trainer.sft import sft_warmup
from megatron_rl.trainer.signals import StopRequest
from megatron_rl.trainer.update import (
    actor_loss_fn,
    actor_metric_names,
    critic_loss_fn,
    loss_denominator,
    mini_batches,
    scheduled_updates,
)
from megatron_rl.utils import phase
from megatron_rl.utils.seeds import derive_seed
from megatron_rl.utils.timing import timed, timing_key


def _rank0() -> bool:
    return dist.get_rank() == 0


def layout_line(layout: ParallelLayout, world_size: int, device) -> str:
    """The start-up line naming every parallel size, expert parallelism included (etp only
    when it is not TP, its default)."""
    vpp = f" vpp={layout.vpp}" if layout.vpp else ""
    etp = f" etp={layout.etp}" if layout.etp else ""
    sp = " (sequence parallel)" if layout.sequence_parallel else ""
    return (f"layout: tp={layout.tp} pp={layout.pp}{vpp} cp={layout.cp} dp={layout.dp} ep={layout.ep}{etp}{sp}, "
            f"world size {world_size}, {torch.device(device).type}")


def model_source(cfg: Config) -> str:
    if cfg.actor.init_checkpoint:
        return cfg.actor.init_checkpoint
    if cfg.model.hf_path:
        return cfg.model.hf_path
    return f"random init (seed {cfg.run.seed})"


class PPOTrainer:
    def __init__(self, cfg: Config, log: Callable[[str], None] = print):
        # Installed first, so a preemption signal that arrives while models load is honoured
        # at the first step boundary.
        self.stop = StopRequest()
        # Batches generated ahead of the step that trains them (one_step_off, generator ranks), by step.
        self.buffer: dict[int, GeneratedBatch] = {}
        self.remote: Optional[RemoteRollout] = None  # rollout.ranks > 0: generation on ranks of its own
        # Every auto and derived value, resolved once: everything after reads them from self.cfg.
        self.resolution = resolve(cfg, dist.get_world_size())
        self.cfg = cfg = self.resolution.config
        self.log = log if _rank0() else (lambda *_: None)
        self.layout = ParallelLayout.from_config(cfg.parallel, dist.get_world_size())
        init_model_parallel(self.layout, seed=cfg.run.seed, timeout_s=cfg.distributed.timeout_s)
        self.device = resolve_device(cfg.distributed)
        self.log(layout_line(self.layout, dist.get_world_size(), self.device))
        self.run_dir = os.path.join(cfg.run.dir, cfg.run.name)
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        os.makedirs(self.run_dir, exist_ok=True)
        alg = cfg.algorithm
        self.use_critic = needs_critic(alg.advantage)
        self.use_ref = alg.kl_coef > 0

        spec = tokenizer_spec(cfg.data, cfg.model.hf_path)
        self.tokenizer = load_tokenizer(spec)
        self.log(f"tokenizer: {spec} (vocab {self.tokenizer.vocab_size})")
        self.prompts = self._load_prompts()
        self.plan = batch_plan(cfg.batch, self.layout, self.resolution.get("batch.token_budget").value,
                               pad_id=self.tokenizer.pad_id)
        self.log(f"batching: {self.plan.describe()}")
        engine, batch = self.resolution.get("rollout.engine"), self.resolution.get("rollout.max_batch_size")
        batching = self.resolution.get("rollout.batching")
        how = f" (auto: {batching.why})" if batching.origin == AUTO_ORIGIN else ""
        self.log(f"rollout: {engine.value} engine, {batching.value} batching{how}, up to {batch.value} sequences "
                 "per generation pass per rank "
                 f"({'derived' if batch.origin == DERIVED else 'rollout.max_batch_size'})")
        self.old_logprobs = old_logprob_source(cfg.algorithm.old_logprobs)
        auto = self.resolution.get("algorithm.old_logprobs").origin == AUTO_ORIGIN
        self.log(f"old log-probs: {self.old_logprobs.name}" + (" (auto)" if auto else ""))
        self.log("resolved: " + ", ".join(self.resolution.lines()))
        self.sampler = PromptSampler(self.prompts, cfg.trainer.prompts_per_step, cfg.run.seed, cfg.data.shuffle)
        self.reward_fn = get_reward_fn(cfg.reward.fn, cfg.reward.convention, cfg.reward.kwargs)
        self.reward_signal = RewardSignal(self.prompts.answer_key, needs_answers(self.reward_fn), self.log)
        self.agent_sessions = AgentSessions(cfg.rollout.agent, stderr_line if _rank0() else (lambda *_: None))
        self.kl_ctl = make_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target, alg.kl_horizon)
        self.sampling = SamplingParams(
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens, n=cfg.rollout.n,
            stop_token_ids=eos_token_ids(self.tokenizer, cfg.model.hf_path),
            stop_sequences=tuple(tuple(self.tokenizer.encode(s)) for s in cfg.rollout.stop),
        )
        updates = scheduled_updates(cfg)
        self.actor = make_trainable(self._build(), cfg.actor.optim, updates)
        self.reference: Optional[list] = freeze(self._build()) if self.use_ref else None
        self.critic: Optional[Trainable] = (
            make_trainable(attach_value_head(self._build()), cfg.critic.optim, updates) if self.use_critic else None
        )
        built = ", ".join(name for name, on in (("actor", True), ("reference", self.use_ref),
                                                 ("critic", self.use_critic)) if on)
        self.log(f"model: {model_source(cfg)}: {total_params(cfg.model):,} parameters ({cfg.model.num_layers} layers, "
                 f"hidden {cfg.model.hidden_size}); built {built}")
        # With generator ranks of their own, rollout.layout is theirs; the trainers' engine (evaluation)
        # generates on the training layout.
        own = on_active_layout(cfg.rollout) if cfg.rollout.ranks else cfg.rollout
        self.engine = with_environment(
            cfg, make_rollout_engine(own, cfg.model, self.device, record_routing=cfg.algorithm.routing_replay),
            self.tokenizer)
        self.evaluator = Evaluator(cfg, self.tokenizer, self.engine, self.reward_fn, self.sampling,
                                   lambda: (self._phase("actor"), self.engine.load_from_chunks(self.actor.chunks)),
                                   self.log)
        self.metrics = MetricsWriter(self.run_dir, _rank0(), cfg.trainer.steps, cfg.trainer.tensorboard,
                                     cfg.trainer.wandb, cfg.run.name, config=dataclasses.asdict(cfg))
        self.sample_log = SampleLog(self.run_dir, _rank0() and cfg.trainer.log_samples, self.tokenizer)
        self.start_step = self._resume_or_init()
        if cfg.rollout.ranks:
            self.remote = RemoteRollout(cfg, self.sampler, self.prompts.prompt_ids, self.sampling,
                                        records_of=self.prompts.records if cfg.rollout.multi_turn else None)
            self.stop.asked_elsewhere = self.remote.stop_asked  # a signal that reached a generator rank only
        # Built from the actor as it is now: the SFT warm-up (in _resume_or_init) replaced its optimizer.
        self._offloaders = self._make_offloaders() if cfg.trainer.offload else {}

    # ------------------------------------------------------------------ offload

    def _make_offloaders(self) -> dict:
        out = {"actor": Offloader(self.actor.chunks, self.actor.optimizer)}
        if self.critic is not None:
            out["critic"] = Offloader(self.critic.chunks, self.critic.optimizer)
        if self.reference is not None:
            out["reference"] = Offloader(self.reference)
        return out

    def _phase(self, active: Optional[str]) -> None:
        """Keep ``active`` on the device and the other models in host memory (None: all on device)."""
        for name, offloader in self._offloaders.items():
            if active is None or name == active:
                offloader.onload()
            else:
                offloader.offload()

    # ------------------------------------------------------------------ setup

    def _load_prompts(self) -> PromptSet:
        data = self.cfg.data
        prompts = load_prompt_source(data, self.tokenizer)
        dropped = (f"; dropped {prompts.num_dropped} longer than {data.max_prompt_tokens} tokens"
                   if prompts.num_dropped else "")
        self.log(f"prompts: {len(prompts)} from {data.train_path}{dropped}")
        return prompts

    def _build(self) -> list:
        return build_gpt_chunks(self.cfg.model, self.layout, self.device)

    def _init_weights(self) -> None:
        """Actor from HF / a checkpoint / a seeded draw that is the same on every layout
        (:mod:`megatron_rl.models.seeded_init`), then the SFT warm-up; reference and critic start
        from the (warmed-up) actor."""
        cfg = self.cfg
        if cfg.actor.init_checkpoint:
            checkpoint.load_checkpoint(cfg.actor.init_checkpoint, {"actor": checkpoint.ModelPart(self.actor.chunks)},
                                       with_optimizer=False, load_rng=False,
                                       model_config=model_config_to_dict(cfg.model))
        elif cfg.model.hf_path:
            load_hf_weights(self.actor.chunks, cfg.model.hf_path)
        else:
            seeded_init(self.actor.chunks, cfg.run.seed)
        self.actor.weights_replaced()
        if cfg.trainer.sft_warmup_steps:
            with phase.entered("SFT warm-up"):
                self.actor = sft_warmup(self.actor, self.prompts, self.tokenizer, cfg, self.plan, self.device,
                                        self.log, make_env=getattr(self.engine, "make_env", None))
        if self.reference is None and self.critic is None:
            return
        initial = gather_canonical(self.actor.chunks)
        if self.reference is not None:
            load_canonical(self.reference, initial)
        if self.critic is not None:
            load_canonical(self.critic.chunks, initial, strict=False)
            if cfg.critic.hf_path:
                load_hf_weights(self.critic.chunks, cfg.critic.hf_path)
            self.critic.weights_replaced()

    def _resume_or_init(self) -> int:
        mode = self.cfg.trainer.resume
        if mode == "never":
            # Under torchrun / srun; the local launcher did this before it wrote the new config.yaml.
            already = os.environ.get(SET_ASIDE_ENV) == "1"
            moved = set_aside_previous_run(self.run_dir) if _rank0() and not already else None
            collectives.barrier()
            if moved:
                self.log(set_aside_message(moved))
            candidates = []
        elif mode == "auto":
            candidates = list(reversed(checkpoint.list_checkpoints(self.ckpt_root)))
        else:
            candidates = [mode]
        loaded = checkpoint.load_newest(candidates, self._parts(), model_config_to_dict(self.cfg.model),
                                        fall_back=mode == "auto", log=self.log)
        if loaded is None:
            self._init_weights()
            self.metrics.truncate_after(-1)  # a fresh start: no line survives, not even a step-0 evaluation
            self.sample_log.truncate_after(-1)
            return 0
        path, meta, state = loaded
        if "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])
        if "kl" in state:
            self.kl_ctl.load_state_dict(state["kl"])
        step = int(meta["step"])
        self.buffer = buffered_batches(state, step)
        self.metrics.truncate_after(step)
        self.sample_log.truncate_after(step)
        self.log(f"resumed after step {step} from {path}")
        return step

    def _parts(self) -> dict:
        parts = {"actor": checkpoint.ModelPart(self.actor.chunks, self.actor.optimizer, self.actor.scheduler)}
        if self.critic is not None:
            parts["critic"] = checkpoint.ModelPart(self.critic.chunks, self.critic.optimizer, self.critic.scheduler)
        if self.reference is not None:
            parts["reference"] = checkpoint.ModelPart(self.reference)
        return parts

    def save(self, step: int) -> str:
        meta = {"models": {name: model_config_to_dict(self.cfg.model) for name in self._parts()},
                **model_source_meta(self.cfg.model.hf_path, self.cfg.data.tokenizer)}
        if self.remote is not None:  # nothing in flight: every requested batch is in the checkpoint
            self.buffer.update(self.remote.drain())
        state = {"step": step, "sampler": self.sampler.state_dict(), "kl": self.kl_ctl.state_dict()}
        if self.buffer:  # batches generated for the coming steps
            state["rollout_buffer"] = [{"step": j, **batch.state_dict()} for j, batch in sorted(self.buffer.items())]
        # Step 0 (a stop before the first update): the optimizers hold no state yet, and megatron's
        # sharded optimizer state would name moments that were never made; the resumed job starts them.
        return checkpoint.save_checkpoint(self.ckpt_root, step, self._parts(), trainer_state=state, meta=meta,
                                          keep_last=self.cfg.trainer.keep_last, with_optimizer=step > 0)

    def _save_and_say(self, step: int, final: bool) -> str:
        """Save, with a line after it; before the last one also a line, since the job waits for it."""
        if final:
            self.log(f"checkpoint: writing step {step} to {self.ckpt_root} before exiting ...")
        start = time.perf_counter()
        with phase.entered("checkpoint save"):
            path = self.save(step)
        self.log(f"checkpoint: step {step} saved to {path} in {time.perf_counter() - start:.1f}s")
        return path

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        cfg = self.cfg
        stop = self.stop
        last: dict = {}
        step = self.start_step
        try:
            if step >= cfg.trainer.steps:
                self.log(finished_message(cfg, step))
                return last
            if step == 0 and self.evaluator.due(0):  # the starting weights (a resumed start was evaluated)
                with phase.entered("evaluation"):
                    faults.maybe_inject(0, phase="evaluation")
                    self.metrics.log(0, self.evaluator.run(0))
            if stop.agreed():  # asked while the job started (models loading, SFT warm-up, step-0 evaluation)
                return self._stop_before_training(step)
            if self.remote is not None:
                self.remote.start(step, list(self.buffer), self.actor.chunks)
            while step < cfg.trainer.steps:
                step += 1
                phase.at_step(step)
                faults.maybe_inject(step)
                last = self.train_step(step)
                if self.evaluator.due(step):
                    with phase.entered("evaluation"):
                        faults.maybe_inject(step, phase="evaluation")
                        last.update(self.evaluator.run(step))
                self.metrics.log(step, last)
                if step % max(1, cfg.trainer.log_every) == 0 or step == cfg.trainer.steps:
                    self.metrics.progress(step, last)
                due = cfg.trainer.save_every and step % cfg.trainer.save_every == 0
                stopping = stop.agreed()
                if due or stopping or step == cfg.trainer.steps:
                    self._phase(None)
                    path = self._save_and_say(step, final=stopping or step == cfg.trainer.steps)
                    if stopping:
                        self.log(f"{stop.describe()}: checkpoint after step {step} at {path}; exiting")
                        return last
        finally:
            stop.restore()
            self.metrics.close()
        if _rank0() and cfg.trainer.plot:
            faults.maybe_fill_disk(step, self.metrics.path, phase="plot")
            plot = plot_metrics(self.metrics.path, os.path.join(self.run_dir, "plot.png"))
            self.log(f"plot: {plot}" if plot else "plot: skipped (pip install matplotlib)")
        return last

    def _stop_before_training(self, step: int) -> dict:
        """A stop asked before the first step of this job: a fresh start saves what start-up made (the
        SFT warm-up's weights), so the resumed job does not redo it; a resumed one has its checkpoint."""
        if step == 0:
            path = self._save_and_say(0, final=True)
            self.log(f"{self.stop.describe()}: checkpoint of the starting weights (step 0) at {path}; exiting")
        else:
            self.log(f"{self.stop.describe()}: stopped before training; step {step} is saved; exiting")
        return {}

    def train_step(self, step: int) -> dict:
        timings: dict = {}
        with timed("step", timings):
            if self.remote is None:
                with timed("weight_sync", timings):
                    self._phase("actor")
                    self.engine.load_from_chunks(self.actor.chunks)
            samples, scores, sampling_metrics = self._sample(step, timings)
            with timed("experience", timings):
                exp = self._experience(samples, scores, timings)
            metrics, policy = self._update(exp, step, timings)
            metrics.update(self._update_kl_coef(exp, policy))
            metrics.update(experience_metrics(exp, policy))
            metrics.update(sampling_metrics)
            metrics.update(exp.metrics)
            if self.remote is not None:
                with timed("weight_push", timings):
                    self.remote.after_update(step, self.actor.chunks)
        metrics.update(timings)
        # Written outside the timed step: the log's decoding and I/O are not training time.
        self.sample_log.write(step, exp.samples, exp.scores, exp.advantages, exp.mask,
                              int(sampling_metrics["rollout/policy_version"]))
        metrics.update(memory_metrics())
        metrics["rollout/weights_gb"] = self.engine.weight_bytes() / 2**30
        refit = getattr(self.engine, "last_refit", None)  # rollout.layout of its own: the copy into it
        if refit is not None:
            metrics[timing_key("refit")] = refit.seconds
            metrics["rollout/refit_bytes"] = refit.bytes_received
        metrics.update(throughput_metrics(samples, timings[timing_key("step")]))
        return metrics

    # ------------------------------------------------------------------ one step, in order

    def _sample(self, step: int, timings: dict) -> tuple[Samples, torch.Tensor, dict]:
        """This step's samples and their (shaped) scores: one prompt batch, or with dynamic sampling as
        many as it takes to fill the batch with groups whose rewards differ (bounded)."""
        alg = self.cfg.algorithm
        raw_drawn: list[torch.Tensor] = []
        timed_out, no_reward = [0], [0]

        def grade(samples: Samples) -> tuple[Samples, torch.Tensor, torch.Tensor]:
            with timed("reward", timings):
                graded = self._score(samples)
            timed_out[0] += graded.timed_out
            no_reward[0] += graded.no_reward
            raw = graded.scores.float()
            raw_drawn.append(raw)
            return samples, raw + self._overlong_penalty(samples), raw  # dynamic sampling decides on raw

        def draw(round_: int) -> tuple[Samples, torch.Tensor, torch.Tensor]:
            batch = self.sampler.next_batch()
            with timed("rollout", timings):
                samples = self._rollout(batch, step, round_)
            return grade(samples)

        metrics: dict = {}
        version = step - 1  # RL updates the weights generating now have seen
        current: Optional[GeneratedBatch] = None  # a batch generated ahead (else generated now, by these weights)
        one_step_off = self.cfg.trainer.mode == ONE_STEP_OFF
        if self.remote is not None:
            with timed("rollout_wait", timings):
                current = self.buffer.pop(step, None)
                if current is None:
                    current, remote_metrics = self.remote.take(step)
                    metrics.update(remote_metrics)
            samples, scores, _ = grade(current.samples)
        elif one_step_off or self.buffer:  # (a sync run resumed with batches generated ahead: those first)
            with timed("rollout", timings):
                current = self.buffer.pop(step, None) or self._generate(step, version)
                if one_step_off and step < self.cfg.trainer.steps and step + 1 not in self.buffer:
                    self.buffer[step + 1] = self._generate(step + 1, version)
            samples, scores, _ = grade(current.samples)
        elif alg.dynamic_sampling:
            filled = fill_batch(draw, self.cfg.trainer.prompts_per_step, alg.dynamic_sampling_max_rounds)
            samples, scores, metrics = filled.samples, filled.scores, dict(filled.metrics)
        else:
            samples, scores, _ = draw(0)
        metrics.update(staleness_metrics(version, current))
        metrics.update(env_metrics(samples))
        with timed("rollout", timings):
            self.engine.release_weights()  # reloaded before the next rollout; training gets the memory
        metrics["reward/timeouts"] = timed_out[0]
        metrics["reward/none"] = no_reward[0]  # samples a reward function returned None for (scored 0)
        if alg.dynamic_sampling or alg.overlong_buffer:
            metrics["reward/drawn_mean"] = float(torch.cat(raw_drawn).mean())  # before shaping and filtering
        if alg.overlong_buffer:
            penalty = self._overlong_penalty(samples)
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
            metrics["reward/overlong_frac"] = float((penalty < 0).float().mean())
        return samples, scores, metrics

    def _overlong_penalty(self, samples: Samples) -> torch.Tensor:
        alg = self.cfg.algorithm
        return overlong_penalty([len(r) for r in samples.response_ids], self.cfg.rollout.max_new_tokens,
                                alg.overlong_buffer, alg.overlong_penalty)

    def _generate(self, step: int, version: int) -> GeneratedBatch:
        """The batch of ``step`` (the ``step``-th drawn, sampled with that step's seed)."""
        return GeneratedBatch(self._rollout(self.sampler.next_batch(), step), version)

    def _rollout(self, batch: list[int], step: int, round_: int = 0) -> Samples:
        tags = ("rollout", step) if round_ == 0 else ("rollout", step, "round", round_)
        records = self.prompts.records(batch) if self.cfg.rollout.multi_turn else None
        rollout = generate_data_parallel(self.engine, [self.prompts.prompt_ids[i] for i in batch], self.sampling,
                                         seed=derive_seed(self.cfg.run.seed, *tags), records=records)
        return Samples.from_rollout(rollout, batch, batch_id=str(step) if round_ == 0 else f"{step}.{round_}")

    def _score(self, samples: Samples) -> Graded:
        """The reward function on this step's samples, every rank grading a share (a collective);
        a batch without answers or a run without reward signal is reported (``reward_signal.py``)."""
        prompts, rows = self.prompts, samples.dataset_index
        answers, indices = [prompts.answers[i] for i in rows], [prompts.source_index[i] for i in rows]
        self.agent_sessions.check(samples.env_info)
        self.reward_signal.check_answers(answers, indices)
        graded = rewards_on_every_rank(
            self.reward_fn,
            [prompts.prompts[i] for i in rows],
            _Decoded(self.tokenizer, samples.graded_responses()),
            answers,
            indices,
            timeout_s=self.cfg.reward.timeout_s,
            fields=prompts.record_fields(rows),
            **dict(self.cfg.reward.kwargs),
        )
        graded = dataclasses.replace(graded, scores=trajectory_scores(samples, graded.scores))
        self.reward_signal.observe(graded.scores, samples.groups())
        return graded

    def _experience(self, samples: Samples, scores: torch.Tensor, timings: dict) -> Experience:
        alg = self.cfg.algorithm
        seqs = samples.sequences()
        mask = samples.response_mask()
        head = logprob_head(self.cfg)
        ref = values = recomputed = None
        # Routing replay: the experts the rollout engine routed to, else the old-log-prob pass's.
        replay_mode = None
        if alg.routing_replay:
            replay_mode = "forward_replay" if load_routing(self.actor.chunks, samples.routing) else "record"
        with torch.no_grad():
            if self.old_logprobs.recompute:
                with timed("old_logprob", timings):
                    self._phase("actor")
                    with moe_pass(self.actor.chunks, seqs, replay_mode):
                        outs, _ = run_sequences(self.actor.chunks, seqs, head, self.plan, self.device)
                recomputed = PolicyPass.from_outputs(samples, mask, outs)
            if self.reference is not None:
                with timed("ref_logprob", timings):
                    self._phase("reference")
                    ref, _ = run_sequences(self.reference, seqs, dataclasses.replace(head, with_entropy=False),
                                           self.plan, self.device)
            if self.critic is not None:
                with timed("values", timings):
                    self._phase("critic")
                    values, _ = run_sequences(self.critic.chunks, seqs, ValueOutput(), self.plan, self.device)
        # training_forward: none here, the loss reads its own forward's (detached).
        old_logprob = None
        if recomputed is not None:
            old_logprob = recomputed.logprob
        elif self.old_logprobs.from_rollout:
            old_logprob = samples.rollout_logprobs() * mask
        ref_logprob = samples.pad_responses([o["logprob"] for o in ref]) * mask if ref is not None else None
        value_rows = samples.pad_responses([o["value"] for o in values]) * mask if values is not None else None
        token_rewards = token_rewards_from_scores(scores, mask)
        if ref_logprob is not None and alg.kl_in_reward:
            # The KL penalty in the reward (else the actor loss carries it); outcome estimators (GRPO,
            # RLOO, ...) see it as the row sum of the penalised token rewards.  Validation keeps
            # old_logprobs=training_forward away from it, so the old log-probs are known here.
            token_rewards, _ = apply_kl_penalty(token_rewards, old_logprob, ref_logprob, mask, self.kl_ctl.value,
                                                alg.kl_kind)
        advantage_rows, returns = compute_advantages(
            alg.advantage, scores, torch.tensor(samples.prompt_index), mask, token_rewards, value_rows, alg,
        )
        weights, metrics = None, {}
        correction = alg.rollout_correction
        if correction.mode != "off":
            weights, metrics = correction_weights(old_logprob, samples.rollout_logprobs(), mask, correction.mode,
                                                  correction.level, correction.threshold)
        return Experience(samples, scores, mask, old_logprob, ref_logprob, value_rows, token_rewards,
                          advantage_rows, returns, rollout_weights=weights, metrics=metrics, trainer_pass=recomputed)

    def _update(self, exp: Experience, step: int, timings: dict) -> tuple[dict, OldPolicy]:
        """The actor's, then the critic's updates on the same mini-batches; returns their metrics
        and the policy before the update (:mod:`megatron_rl.trainer.old_policy`), measured by the
        recompute pass or by the update's first forward."""
        alg = self.cfg.algorithm
        fields = {"advantages": exp.advantages}
        if self.old_logprobs.loss_reads_old:  # without the field the loss takes its own forward's
            fields["old_logprob"] = exp.old_logprob
        if self.reference is not None and not alg.kl_in_reward:
            fields["ref_logprob"] = exp.ref_logprob
        if exp.rollout_weights is not None:
            fields["rollout_weight"] = exp.rollout_weights
        if self.critic is not None:
            fields.update(old_value=exp.values, returns=exp.returns)
        seqs = exp.training_sequences(fields)
        valid = [len(r) for r in exp.samples.response_ids]
        batches = []  # (members, their sequences, their response lengths, the loss denominator), every epoch
        for epoch in range(alg.ppo_epochs):
            order_seed = None if alg.mini_batches == 1 else derive_seed(self.cfg.run.seed, "mini_batches", step, epoch)
            for members in mini_batches(len(seqs), alg.mini_batches, order_seed):
                lengths = [valid[i] for i in members]
                batches.append((members, [seqs[i] for i in members], lengths, loss_denominator(alg.loss_agg, lengths)))
        actor_results, actor_logs, first_forward = self._update_actor(batches, timings)
        critic_results, critic_logs = self._update_critic(batches, timings) if self.critic is not None else ([], [])
        trainer_pass = exp.trainer_pass
        if first_forward is not None:
            members, outs = first_forward
            trainer_pass = PolicyPass.from_outputs(exp.samples, exp.mask, outs, members)
        # A critic whose updates all failed also poisons the actor's advantages: name it first.
        check_updates_applied("critic", critic_results, step, self.cfg)
        check_updates_applied("actor", actor_results, step, self.cfg)
        updates = len(actor_results)
        flat = [log for logs in actor_logs for log in logs]
        out = {k: v / updates for k, v in reduce_sums(flat, ["actor/pg_loss", "actor/entropy_loss",
                                                               "actor/kl_loss"]).items()}
        out.update(reduce_sum_count(flat, actor_metric_names(alg)))
        out.update(optimizer_step_metrics("actor", actor_results))
        out["actor/lr"] = self.actor.lr
        out.update(moe_metrics(self.actor.chunks))  # MoE: router losses, routing-replay mismatch
        if self.critic is not None:
            flat = [log for logs in critic_logs for log in logs]
            out["critic/vf_loss"] = reduce_sums(flat, ["critic/vf_loss"])["critic/vf_loss"] / updates
            out.update(reduce_sum_count(flat, ["critic/vf_clipfrac", "critic/vpred_mean"]))
            out.update(optimizer_step_metrics("critic", critic_results))
            out.update(moe_metrics(self.critic.chunks, "critic/"))
        return out, old_policy(exp, trainer_pass, alg.kl_kind)

    def _update_actor(self, batches: list, timings: dict) -> tuple[list, list, Optional[tuple]]:
        """One optimizer step per mini-batch; returns the step results, the loss logs and, where the
        old log-probs are not recomputed, the first forward's outputs (the weights before any update)."""
        alg = self.cfg.algorithm
        kl_loss_coef = self.kl_ctl.value if self.reference is not None and not alg.kl_in_reward else 0.0
        measure = self.old_logprobs.measured_in_update
        head = logprob_head(self.cfg, with_entropy=alg.entropy_coef > 0 or measure)
        horizon = self.cfg.rollout.max_new_tokens  # the constant of seq-mean-token-sum-norm
        results, logs_all, first_forward = [], [], None
        for members, sub, lengths, den in batches:
            with timed("actor_update", timings):
                self._phase("actor")
                self.actor.zero_grad()
                with moe_pass(self.actor.chunks, sub, "replay" if alg.routing_replay else "train", members):
                    outs, logs = run_sequences(self.actor.chunks, sub, head, self.plan, self.device,
                                               loss_fn=actor_loss_fn(alg, den, lengths, kl_loss_coef, horizon),
                                               forward_only=False)
                results.append(self.actor.step())
                logs_all.append(logs)
                if measure and first_forward is None:
                    first_forward = (members, outs)
        return results, logs_all, first_forward

    def _update_critic(self, batches: list, timings: dict) -> tuple[list, list]:
        alg = self.cfg.algorithm
        horizon = self.cfg.rollout.max_new_tokens
        results, logs_all = [], []
        for members, sub, lengths, den in batches:
            with timed("critic_update", timings):
                self._phase("critic")
                self.critic.zero_grad()
                with moe_pass(self.critic.chunks, sub, "train", members):
                    _, logs = run_sequences(self.critic.chunks, sub, ValueOutput(), self.plan, self.device,
                                            loss_fn=critic_loss_fn(alg, den, lengths, horizon), forward_only=False)
                results.append(self.critic.step())
                logs_all.append(logs)
        return results, logs_all

    def _update_kl_coef(self, exp: Experience, policy: OldPolicy) -> dict:
        """Move the KL coefficient by the KL to the reference measured this step; both as metrics."""
        if policy.kl is None:
            return {}
        current_kl = float(losses.aggregate(policy.kl, exp.mask, "token-mean"))
        self.kl_ctl.update(current_kl, len(exp.samples))
        return {"actor/kl": current_kl, "actor/kl_coef": self.kl_ctl.value}


def run_ppo(cfg: Config, log=print) -> dict:
    done = finished_step(cfg)
    if done is not None:  # before any model is built: a re-run of a finished run only says so
        if _rank0():
            log(finished_message(cfg, done))
        return {}
    trainer = PPOTrainer(cfg, log=log)
    last = trainer.train()
    if trainer.remote is not None:
        trainer.remote.close()  # the generators stop once every push is delivered
    return last


class _Decoded:
    """Responses decoded on first access: each rank decodes only the share it grades."""

    def __init__(self, tokenizer, response_ids):
        self.tokenizer, self.response_ids = tokenizer, response_ids

    def __len__(self) -> int:
        return len(self.response_ids)

    def __getitem__(self, i: int) -> str:
        return self.tokenizer.decode(self.response_ids[i])
