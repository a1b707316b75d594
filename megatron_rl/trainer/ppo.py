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
from megatron_rl.algorithms.distill import uses_task_advantage
from megatron_rl.algorithms.kl import make_kl_controller
from megatron_rl.algorithms.old_logprobs import old_logprob_source
from megatron_rl.algorithms.shaping import overlong_penalty
from megatron_rl.config.choices import ONE_STEP_OFF
from megatron_rl.config.model_io import model_config_to_dict
from megatron_rl.config.schema import Config
from megatron_rl.data.prompts import PromptSampler, PromptSet
from megatron_rl.data.sources import load_prompt_source, tokenizer_spec
from megatron_rl.data.tokenizer import load_tokenizer, vocabulary_digest
from megatron_rl.distributed import collectives, faults
from megatron_rl.distributed.startup import start_model_parallel
from megatron_rl.engine import checkpoint
from megatron_rl.engine.forward import batch_plan
from megatron_rl.engine.teachers import check_teacher_layouts, read_teachers
from megatron_rl.engine.trainable import Trainable
from megatron_rl.envs.build import with_environment
from megatron_rl.envs.trajectories import env_metrics, trajectory_scores
from megatron_rl.models.hf_bridge import model_source_meta
from megatron_rl.models.lora.base import lora_base_identity, lora_meta
from megatron_rl.resolve import resolve
from megatron_rl.rewards.conventions import needs_answers
from megatron_rl.rewards.distributed import rewards_on_every_rank
from megatron_rl.rewards.registry import Graded, get_reward_fn
from megatron_rl.rollout.build import make_rollout_engine, on_active_layout
from megatron_rl.rollout.dp import generate_data_parallel
from megatron_rl.rollout.sampling import SamplingParams, eos_token_ids
from megatron_rl.trainer.dynamic_sampling import fill_batch
from megatron_rl.trainer.evaluation import Evaluator
from megatron_rl.trainer.experience import Experience, Samples
from megatron_rl.trainer.experience_pass import make_experience
from megatron_rl.trainer.finished import (
    SET_ASIDE_ENV,
    finished_message,
    finished_step,
    set_aside_message,
    set_aside_previous_run,
)
from megatron_rl.trainer.initial_weights import init_weights, load_base_weights, quantize_bases
from megatron_rl.trainer.metrics import (
    MetricsWriter,
    experience_metrics,
    memory_metrics,
    plot_metrics,
    throughput_metrics,
)
from megatron_rl.trainer.model_set import ModelSet, build_models
from megatron_rl.trainer.old_policy import OldPolicy
from megatron_rl.trainer.one_step_off import take_and_generate_ahead
from megatron_rl.trainer.policy_update import update_models
from megatron_rl.trainer.remote_rollout import RemoteRollout
from megatron_rl.trainer.reward_signal import AgentSessions, RewardSignal, stderr_line
from megatron_rl.trainer.rollout_buffer import GeneratedBatch, buffer_state, buffered_batches
from megatron_rl.trainer.sample_log import SampleLog
from megatron_rl.trainer.signals import StopRequest
from megatron_rl.trainer.staleness import StalenessPlan, staleness_metrics
from megatron_rl.trainer.startup_lines import layout_line, lora_lines, model_line, old_logprobs_line, rollout_line
from megatron_rl.trainer.teacher_rows import TeacherRows
from megatron_rl.utils import phase
from megatron_rl.utils.seeds import derive_seed
from megatron_rl.utils.timing import timed, timing_key


def _rank0() -> bool:
    return dist.get_rank() == 0


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
        started = start_model_parallel(cfg)
        self.layout, self.groups, self.device = started.layout, started.groups, started.device
        self.log(layout_line(self.layout, dist.get_world_size(), self.device))
        self.run_dir = os.path.join(cfg.run.dir, cfg.run.name)
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        os.makedirs(self.run_dir, exist_ok=True)
        self.use_critic = needs_critic(cfg.algorithm.advantage) and uses_task_advantage(cfg.algorithm)
        self.use_ref = cfg.algorithm.kl_coef > 0
        self._load_data()
        self.teachers = read_teachers(cfg.algorithm.distill.teachers, cfg.model, vocabulary_digest(self.tokenizer))
        check_teacher_layouts(self.teachers, cfg)
        self.teacher_rows = TeacherRows(self.teachers, self.prompts)
        self.log(rollout_line(self.resolution))
        self.old_logprobs = old_logprob_source(cfg.algorithm.old_logprobs)
        self.log(old_logprobs_line(self.resolution, self.old_logprobs.name))
        self.log("resolved: " + ", ".join(self.resolution.lines()))
        self._make_step_inputs()
        self.models: ModelSet = build_models(cfg, self.layout, self.device, self.plan, self.use_ref, self.use_critic,
                                             self.teachers)
        self.log(model_line(cfg, self.models.built_line()))
        for line in lora_lines(cfg):
            self.log(line)
        self._make_engine_and_outputs()
        self.start_step = self._resume_or_init()
        if cfg.rollout.ranks:
            self.remote = RemoteRollout(cfg, self.sampler, self.prompts.prompt_ids, self.sampling,
                                        records_of=self.prompts.records if cfg.rollout.multi_turn else None)
            self.stop.asked_elsewhere = self.remote.stop_asked  # a signal that reached a generator rank only
        if cfg.trainer.offload:  # after the SFT warm-up (in _resume_or_init), which replaces the actor's optimizer
            self.models.start_offloading()

    @property
    def actor(self) -> Trainable:
        return self.models.actor

    @property
    def reference(self) -> Optional[list]:
        return self.models.reference

    @property
    def critic(self) -> Optional[Trainable]:
        return self.models.critic

    # ------------------------------------------------------------------ setup

    def _load_data(self) -> None:
        """Tokenizer, prompts, and how sequences are cut into micro-batches."""
        cfg = self.cfg
        spec = tokenizer_spec(cfg.data, cfg.model.hf_path)
        self.tokenizer = load_tokenizer(spec)
        self.log(f"tokenizer: {spec} (vocab {self.tokenizer.vocab_size})")
        self.prompts = self._load_prompts()
        self.plan = batch_plan(cfg.batch, self.layout, self.resolution.get("batch.token_budget").value,
                               pad_id=self.tokenizer.pad_id)
        self.log(f"batching: {self.plan.describe()}")

    def _make_step_inputs(self) -> None:
        """What a step draws, samples with and grades by, and the KL controller."""
        cfg, alg = self.cfg, self.cfg.algorithm
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

    def _make_engine_and_outputs(self) -> None:
        """The rollout engine, the evaluator on it, and the metrics and sample logs."""
        cfg = self.cfg
        # With generator ranks of their own, rollout.layout is theirs; the trainers' engine (evaluation)
        # generates on the training layout.
        own = on_active_layout(cfg.rollout) if cfg.rollout.ranks else cfg.rollout
        self.engine = with_environment(
            cfg, make_rollout_engine(own, cfg.model, self.device, record_routing=cfg.algorithm.routing_replay,
                                lora=cfg.actor.lora),
            self.tokenizer)
        self.evaluator = Evaluator(cfg, self.tokenizer, self.engine, self.reward_fn, self.sampling,
                                   self._weights_to_engine, self.log)
        self.metrics = MetricsWriter(self.run_dir, _rank0(), cfg.trainer.steps, cfg.trainer.tensorboard,
                                     cfg.trainer.wandb, cfg.run.name, config=dataclasses.asdict(cfg))
        self.sample_log = SampleLog(self.run_dir, _rank0() and cfg.trainer.log_samples, self.tokenizer)

    def _weights_to_engine(self) -> None:
        self.models.phase("actor")
        self.engine.load_from_chunks(self.actor.chunks)

    def _load_prompts(self) -> PromptSet:
        data = self.cfg.data
        prompts = load_prompt_source(data, self.tokenizer)
        dropped = (f"; dropped {prompts.num_dropped} longer than {data.max_prompt_tokens} tokens"
                   if prompts.num_dropped else "")
        self.log(f"prompts: {len(prompts)} from {data.train_path}{dropped}")
        return prompts

    # ------------------------------------------------------------------ saving and resuming

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
        # LoRA checkpoints hold adapters only: the frozen base comes first, from where the run started.
        base_first = bool(candidates) and (self.models.actor_lora or self.models.critic_lora)
        if base_first:
            load_base_weights(self.models, self.cfg, critic_base=True)
        loaded = checkpoint.load_newest(candidates, self.models.checkpoint_parts(),
                                        model_config_to_dict(self.cfg.model), fall_back=mode == "auto", log=self.log,
                                        base=lora_base_identity(self.cfg) if base_first and _rank0() else None)
        if loaded is None:
            init_weights(self.models, self.cfg, self.prompts, self.tokenizer, self.engine, self.log,
                         base_loaded=base_first)
            self.metrics.truncate_after(-1)  # a fresh start: no line survives, not even a step-0 evaluation
            self.sample_log.truncate_after(-1)
            return 0
        path, meta, state = loaded
        quantize_bases(self.models, self.cfg, "critic")  # its base came first, its adapters now
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

    def save(self, step: int) -> str:
        meta = {"models": {name: model_config_to_dict(self.cfg.model) for name in self.models.checkpoint_parts()},
                **model_source_meta(self.cfg.model.hf_path, self.cfg.data.tokenizer),
                "vocabulary": vocabulary_digest(self.tokenizer)}
        if (self.models.actor_lora or self.models.critic_lora) and _rank0():  # rank 0 writes the manifest
            meta["lora"] = lora_meta(self.cfg)
        if self.remote is not None:  # nothing in flight: every requested batch is in the checkpoint
            self.buffer.update(self.remote.drain())
        state = {"step": step, "sampler": self.sampler.state_dict(), "kl": self.kl_ctl.state_dict()}
        if self.buffer:  # batches generated for the coming steps
            state["rollout_buffer"] = buffer_state(self.buffer)
        # Step 0 (a stop before the first update): the optimizers hold no state yet, and megatron's
        # sharded optimizer state would name moments that were never made; the resumed job starts them.
        return checkpoint.save_checkpoint(self.ckpt_root, step, self.models.checkpoint_parts(), trainer_state=state,
                                          meta=meta, keep_last=self.cfg.trainer.keep_last, with_optimizer=step > 0)

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
                    self.models.phase(None)
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
                    self.models.phase("actor")
                    self.engine.load_from_chunks(self.actor.chunks)
            samples, scores, sampling_metrics = self._sample(step, timings)
            with timed("experience", timings):
                exp = make_experience(self.models, samples, scores, self.cfg, self.old_logprobs, self.kl_ctl.value,
                                      timings, self.teacher_rows.of(samples))
            metrics, policy = update_models(self.models, exp, step, self.cfg, self.old_logprobs, self.kl_ctl.value,
                                            timings)
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
        refit = self.engine.last_refit  # rollout.layout of its own: the copy into it
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
                current = take_and_generate_ahead(self.buffer, step, version, StalenessPlan.of(self.cfg),
                                                  self.cfg.trainer.steps, self._generate)
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
