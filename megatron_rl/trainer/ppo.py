"""The PPO loop, read top to bottom: build, (warm up), then per step

1. hand the actor's current weights to the rollout engine and sample ``rollout.n`` responses per
   prompt (prompts split over data-parallel ranks, samples gathered so every rank holds them);
2. score them (rank 0 calls the reward function, everyone receives the result);
3. recompute old log-probs (and entropy) with the training model, reference log-probs, values;
   token rewards, KL, advantages;
4. update actor and critic over ``ppo_epochs`` x ``mini_batches`` optimizer steps;
5. log metrics, checkpoint when due or when SIGTERM/SIGUSR1 asked for it.

Works for GAE (with a critic), GRPO and RLOO (without), on every TP/PP/VPP/CP/DP layout.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.algorithms import advantages as adv
from megatron_rl.algorithms import kl as kl_mod
from megatron_rl.algorithms import losses
from megatron_rl.errors import ConfigError, UserInputError
from megatron_rl.config.model_io import model_config_to_dict
from megatron_rl.config.schema import Config
from megatron_rl.data.prompts import PromptSampler, load_prompts
from megatron_rl.data.tasks import load_task
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.distributed import faults
from megatron_rl.distributed.metrics import reduce_sum_count, reduce_sums
from megatron_rl.distributed.runtime import ParallelLayout, init_model_parallel, resolve_device
from megatron_rl.engine import checkpoint as ckpt
from megatron_rl.engine.forward import BatchPlan, run_sequences
from megatron_rl.engine.offload import Offloader
from megatron_rl.engine.trainable import Trainable, freeze, fresh_optimizer, make_trainable
from megatron_rl.models.builder import build_gpt_chunks
from megatron_rl.models.canonical import gather_canonical, load_canonical
from megatron_rl.models.heads import LogProbHead, ValueOutput, attach_value_head
from megatron_rl.models.hf_bridge import load_hf_weights
from megatron_rl.rewards.registry import compute_rewards, get_reward_fn
from megatron_rl.rollout.engine import make_engine
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.trainer.experience import (Experience, Samples, compute_advantages, kl_per_token,
                                            token_rewards_from_scores)
from megatron_rl.trainer.metrics import MetricsWriter, plot_metrics
from megatron_rl.trainer.signals import StopRequest
from megatron_rl.trainer.update import actor_loss_fn, critic_loss_fn, loss_denominator, mini_batches


def _rank0() -> bool:
    return dist.get_rank() == 0


class PPOTrainer:
    def __init__(self, cfg: Config, log: Callable[[str], None] = print):
        # Installed first, so a preemption signal that arrives while models load is honoured
        # at the first step boundary.
        self.stop = StopRequest()
        self.cfg = cfg
        self.log = log if _rank0() else (lambda *_: None)
        self.layout = ParallelLayout.from_config(cfg.parallel, dist.get_world_size())
        init_model_parallel(self.layout, seed=cfg.run.seed, timeout_s=cfg.distributed.timeout_s)
        self.device = resolve_device(cfg.distributed)
        self.run_dir = os.path.join(cfg.run.dir, cfg.run.name)
        self.ckpt_root = os.path.join(self.run_dir, "checkpoints")
        os.makedirs(self.run_dir, exist_ok=True)
        alg = cfg.algorithm
        self.use_critic = adv.needs_critic(alg.advantage)
        self.use_ref = alg.kl_coef > 0
        self.plan = BatchPlan(cfg.batch.max_tokens_per_rank, cfg.batch.micro_batch_size, cfg.batch.packing)

        self.tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.model.hf_path or "char")
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError("model.vocab_size", cfg.model.vocab_size,
                              f"smaller than the tokenizer's vocabulary ({self.tokenizer.vocab_size})",
                              f"set model.vocab_size >= {self.tokenizer.vocab_size}")
        self.plan = dataclasses.replace(self.plan, pad_id=self.tokenizer.pad_id)
        self.prompts = self._load_prompts()
        self.sampler = PromptSampler(self.prompts, cfg.trainer.prompts_per_step, cfg.run.seed, cfg.data.shuffle)
        self.reward_fn = get_reward_fn(cfg.reward.fn)
        self.kl_ctl = kl_mod.make_kl_controller(alg.kl_controller, alg.kl_coef, alg.kl_target, alg.kl_horizon)
        self.sampling = SamplingParams(
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
            max_new_tokens=cfg.rollout.max_new_tokens, n=cfg.rollout.n,
            stop_token_ids=(self.tokenizer.eos_id,),
            stop_sequences=tuple(tuple(self.tokenizer.encode(s)) for s in cfg.rollout.stop),
        )
        updates = cfg.trainer.steps * alg.ppo_epochs * alg.mini_batches
        self.actor = make_trainable(self._build(), cfg.actor.optim, updates)
        self.reference: Optional[list] = freeze(self._build()) if self.use_ref else None
        self.critic: Optional[Trainable] = (
            make_trainable(attach_value_head(self._build()), cfg.critic.optim, updates) if self.use_critic else None
        )
        self.engine = make_engine(cfg.rollout.engine, cfg.model, device=self.device,
                                  max_batch_size=cfg.rollout.max_batch_size)
        self.metrics = MetricsWriter(self.run_dir, _rank0(), cfg.trainer.steps, cfg.trainer.tensorboard,
                                     cfg.trainer.wandb, cfg.run.name)
        self.start_step = self._resume_or_init()
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

    def _load_prompts(self):
        data = self.cfg.data
        if data.train_path.startswith("task:"):
            prompts = load_task(data.train_path[5:], self.tokenizer, data.max_prompt_tokens)
        else:
            prompts = load_prompts(data.train_path, self.tokenizer, data.max_prompt_tokens, data.prompt_key,
                                   data.answer_key, data.messages_key)
        if prompts.num_dropped:
            self.log(f"data: dropped {prompts.num_dropped} prompts longer than {data.max_prompt_tokens} tokens")
        return prompts

    def _build(self) -> list:
        return build_gpt_chunks(self.cfg.model, self.layout, self.device)

    def _init_weights(self) -> None:
        """Actor from HF / a checkpoint / seeded init; reference and critic start from the actor."""
        cfg = self.cfg
        if cfg.actor.init_checkpoint:
            ckpt.load_checkpoint(cfg.actor.init_checkpoint, {"actor": ckpt.ModelPart(self.actor.chunks)},
                                 with_optimizer=False, load_rng=False)
        elif cfg.model.hf_path:
            load_hf_weights(self.actor.chunks, cfg.model.hf_path)
        if cfg.trainer.sft_warmup_steps:
            self._sft_warmup()
        if self.reference is None and self.critic is None:
            return
        initial = gather_canonical(self.actor.chunks)
        if self.reference is not None:
            load_canonical(self.reference, initial)
        if self.critic is not None:
            load_canonical(self.critic.chunks, initial, strict=False)
            if cfg.critic.hf_path:
                load_hf_weights(self.critic.chunks, cfg.critic.hf_path)

    def _resume_or_init(self) -> int:
        mode = self.cfg.trainer.resume
        path = None
        if mode == "auto":
            path = ckpt.find_latest(self.ckpt_root)
        elif mode != "never":
            path = mode
        if path is None:
            self._init_weights()
            self.metrics.truncate_after(0)
            return 0
        meta = ckpt.load_checkpoint(path, self._parts())
        state = ckpt.load_trainer_state(path) or {}
        if "sampler" in state:
            self.sampler.load_state_dict(state["sampler"])
        if "kl" in state:
            self.kl_ctl.load_state_dict(state["kl"])
        step = int(meta["step"])
        self.metrics.truncate_after(step)
        self.log(f"resumed after step {step} from {path}")
        return step

    def _parts(self) -> dict:
        parts = {"actor": ckpt.ModelPart(self.actor.chunks, self.actor.optimizer, self.actor.scheduler)}
        if self.critic is not None:
            parts["critic"] = ckpt.ModelPart(self.critic.chunks, self.critic.optimizer, self.critic.scheduler)
        if self.reference is not None:
            parts["reference"] = ckpt.ModelPart(self.reference)
        return parts

    def save(self, step: int) -> str:
        meta = {"models": {name: model_config_to_dict(self.cfg.model) for name in self._parts()}}
        if self.cfg.model.hf_path:
            from megatron_rl.models.hf_config import read_hf_config

            meta["hf_config"] = read_hf_config(self.cfg.model.hf_path)
            meta["source"] = os.path.abspath(self.cfg.model.hf_path)
        state = {"step": step, "sampler": self.sampler.state_dict(), "kl": self.kl_ctl.state_dict()}
        return ckpt.save_checkpoint(self.ckpt_root, step, self._parts(), trainer_state=state, meta=meta,
                                    keep_last=self.cfg.trainer.keep_last)

    # ------------------------------------------------------------------ warm-up

    def _sft_warmup(self) -> None:
        """Supervised steps on prompt + answer + EOS (teaches a fresh model the answer format)."""
        cfg = self.cfg
        for group in self.actor.optimizer.param_groups:
            group["lr"] = cfg.trainer.sft_lr
        sampler = PromptSampler(self.prompts, cfg.trainer.prompts_per_step, cfg.run.seed + 7919, True)
        if cfg.trainer.sft_answers not in ("true", "shuffled"):
            raise ConfigError("trainer.sft_answers", cfg.trainer.sft_answers, "unknown warm-up target", "use true or shuffled")
        answers = list(self.prompts.answers)
        if cfg.trainer.sft_answers == "shuffled":
            order = torch.randperm(len(answers), generator=torch.Generator().manual_seed(cfg.run.seed)).tolist()
            answers = [answers[j] for j in order]
        for step in range(cfg.trainer.sft_warmup_steps):
            seqs, lengths = [], []
            for i in sampler.next_batch():
                prompt = self.prompts.prompt_ids[i]
                answer = self.tokenizer.encode(answers[i] or "") + [self.tokenizer.eos_id]
                tokens = torch.tensor(prompt + answer)
                mask = torch.zeros(len(tokens))
                mask[len(prompt) - 1 : len(tokens) - 1] = 1.0
                seqs.append({"tokens": tokens, "loss_mask": mask})
                lengths.append(len(answer))
            total = float(sum(lengths))

            def nll(outs, t, mb):
                loss = -(outs["logprob"] * t["loss_mask"]).sum() / total
                return loss, {"sft/loss": loss.detach()}

            self.actor.zero_grad()
            _, logs = run_sequences(self.actor.chunks, seqs, LogProbHead(with_entropy=False), self.plan, self.device,
                                    loss_fn=nll, forward_only=False)
            self.actor.step()
            loss = reduce_sums(logs, ["sft/loss"])["sft/loss"]
            if step == 0 or (step + 1) % 10 == 0 or step + 1 == cfg.trainer.sft_warmup_steps:
                self.log(f"sft warm-up {step + 1}/{cfg.trainer.sft_warmup_steps}  loss {loss:.4f}")
        # RL starts from a fresh optimizer state and the RL learning rate.
        self.actor = fresh_optimizer(self.actor.chunks, cfg.actor.optim,
                                     cfg.trainer.steps * cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches)

    # ------------------------------------------------------------------ one step

    def _rollout(self, batch: list[int], step: int) -> Samples:
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        per = -(-len(batch) // dp)
        mine = list(range(dp_rank * per, min(len(batch), (dp_rank + 1) * per)))
        out = self.engine.generate([self.prompts.prompt_ids[batch[i]] for i in mine], self.sampling,
                                   seed=self.cfg.run.seed * 1_000_003 + step * 7_919 + dp_rank)
        rows = [(mine[out.prompt_index[k]], k, out.prompt_ids[k], out.response_ids[k], out.response_logprobs[k],
                 out.finish_reason[k]) for k in range(len(out))]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (dp_rank, rows))
        by_dp: dict[int, list] = {}
        for rank_dp, rank_rows in gathered:  # first rank of each DP index is the source of truth
            by_dp.setdefault(rank_dp, rank_rows)
        merged = sorted((row for rows_ in by_dp.values() for row in rows_), key=lambda r: (r[0], r[1]))
        return Samples(
            prompt_index=[r[0] for r in merged], dataset_index=[batch[r[0]] for r in merged],
            prompt_ids=[list(r[2]) for r in merged], response_ids=[list(r[3]) for r in merged],
            rollout_logprob=[list(r[4]) for r in merged], finish_reason=[r[5] for r in merged],
        )

    def _rewards(self, samples: Samples) -> torch.Tensor:
        box: list = [None]
        if _rank0():
            try:
                scores = compute_rewards(
                    self.reward_fn,
                    [self.prompts.prompts[i] for i in samples.dataset_index],
                    [self.tokenizer.decode(r) for r in samples.response_ids],
                    [self.prompts.answers[i] for i in samples.dataset_index],
                    prompt_indices=[self.prompts.source_index[i] for i in samples.dataset_index],
                    **dict(self.cfg.reward.kwargs),
                )
                box[0] = ("ok", scores)
            except UserInputError as err:
                box[0] = ("error", err)
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise value
        return value

    def _experience(self, samples: Samples, scores: torch.Tensor) -> tuple[Experience, dict]:
        alg, timings = self.cfg.algorithm, {}
        seqs = samples.sequences()
        mask = samples.response_mask()
        temperature = self.cfg.rollout.temperature
        head = LogProbHead(temperature=temperature, chunk_size=self.cfg.batch.logprob_chunk_size)
        t0 = time.perf_counter()
        with torch.no_grad():
            self._phase("actor")
            old, _ = run_sequences(self.actor.chunks, seqs, head, self.plan, self.device)
            timings["timing/old_logprob_s"] = time.perf_counter() - t0
            ref = values = None
            if self.reference is not None:
                t0 = time.perf_counter()
                self._phase("reference")
                ref, _ = run_sequences(self.reference, seqs, dataclasses.replace(head, with_entropy=False),
                                       self.plan, self.device)
                timings["timing/ref_logprob_s"] = time.perf_counter() - t0
            if self.critic is not None:
                t0 = time.perf_counter()
                self._phase("critic")
                values, _ = run_sequences(self.critic.chunks, seqs, ValueOutput(), self.plan, self.device)
                timings["timing/values_s"] = time.perf_counter() - t0
        old_logprob = samples.pad_responses([o["logprob"] for o in old]) * mask
        entropy = samples.pad_responses([o["entropy"] for o in old]) * mask
        ref_logprob = samples.pad_responses([o["logprob"] for o in ref]) * mask if ref else None
        value_rows = samples.pad_responses([o["value"] for o in values]) * mask if values else None
        token_rewards = token_rewards_from_scores(scores, mask)
        kl = kl_per_token(old_logprob, ref_logprob, mask, alg.kl_kind) if ref_logprob is not None else None
        if kl is not None and alg.kl_in_reward:
            token_rewards = token_rewards - self.kl_ctl.value * kl
        advantages, returns = compute_advantages(
            alg.advantage, scores, torch.tensor(samples.prompt_index), mask, token_rewards, value_rows,
            gamma=alg.gamma, lam=alg.lam, whiten=alg.whiten_advantages, norm_by_std=alg.norm_by_std,
        )
        exp = Experience(samples, scores, mask, old_logprob, entropy, ref_logprob, value_rows, token_rewards,
                         advantages, returns, kl)
        return exp, timings

    def _update(self, exp: Experience, step: int) -> dict:
        alg = self.cfg.algorithm
        fields = {"old_logprob": exp.old_logprob, "advantages": exp.advantages}
        if self.reference is not None and not alg.kl_in_reward:
            fields["ref_logprob"] = exp.ref_logprob
        if self.critic is not None:
            fields.update(old_value=exp.values, returns=exp.returns)
        seqs = exp.training_sequences(fields)
        valid = [len(r) for r in exp.samples.response_ids]
        kl_loss_coef = self.kl_ctl.value if (self.reference is not None and not alg.kl_in_reward) else 0.0
        head = LogProbHead(temperature=self.cfg.rollout.temperature, chunk_size=self.cfg.batch.logprob_chunk_size,
                           with_entropy=alg.entropy_coef > 0)
        actor_logs, critic_logs, stats = [], [], {"actor": [], "critic": []}
        t_actor = t_critic = 0.0
        for epoch in range(alg.ppo_epochs):
            seed = None if alg.mini_batches == 1 else self.cfg.run.seed * 31 + step * 1009 + epoch
            for members in mini_batches(len(seqs), alg.mini_batches, seed):
                sub = [seqs[i] for i in members]
                lengths = [valid[i] for i in members]
                den = loss_denominator(alg.loss_agg, lengths)
                t0 = time.perf_counter()
                self._phase("actor")
                self.actor.zero_grad()
                _, logs = run_sequences(self.actor.chunks, sub, head, self.plan, self.device,
                                        loss_fn=actor_loss_fn(alg, den, lengths, kl_loss_coef), forward_only=False)
                stats["actor"].append(self.actor.step())
                actor_logs.append(logs)
                t_actor += time.perf_counter() - t0
                if self.critic is not None:
                    t0 = time.perf_counter()
                    self._phase("critic")
                    self.critic.zero_grad()
                    _, logs = run_sequences(self.critic.chunks, sub, ValueOutput(), self.plan, self.device,
                                            loss_fn=critic_loss_fn(alg, den, lengths), forward_only=False)
                    stats["critic"].append(self.critic.step())
                    critic_logs.append(logs)
                    t_critic += time.perf_counter() - t0
        updates = alg.ppo_epochs * max(1, min(alg.mini_batches, len(seqs)))
        out = {"timing/actor_update_s": t_actor}
        flat = [log for logs in actor_logs for log in logs]
        out.update({k: v / updates for k, v in reduce_sums(flat, ["actor/pg_loss", "actor/entropy_loss",
                                                                  "actor/kl_loss"]).items()})
        out.update(reduce_sum_count(flat, ["actor/clipfrac", "actor/dual_clipfrac", "actor/approx_kl",
                                           "actor/ratio_mean"]))
        out.update(_step_stats("actor", stats["actor"]))
        out["actor/lr"] = self.actor.lr
        if self.critic is not None:
            flat = [log for logs in critic_logs for log in logs]
            out["timing/critic_update_s"] = t_critic
            out["critic/vf_loss"] = reduce_sums(flat, ["critic/vf_loss"])["critic/vf_loss"] / updates
            out.update(reduce_sum_count(flat, ["critic/vf_clipfrac", "critic/vpred_mean"]))
            out.update(_step_stats("critic", stats["critic"]))
        return out

    # ------------------------------------------------------------------ the loop

    def train(self) -> dict:
        cfg = self.cfg
        stop = self.stop
        last: dict = {}
        step = self.start_step
        try:
            if step >= cfg.trainer.steps:
                self.log(f"nothing to do: the run already finished {step} steps")
                return last
            while step < cfg.trainer.steps:
                step += 1
                faults.maybe_inject(step)
                last = self.train_step(step)
                self.metrics.log(step, last)
                if step % max(1, cfg.trainer.log_every) == 0 or step == cfg.trainer.steps:
                    self.metrics.progress(step, last)
                due = cfg.trainer.save_every and step % cfg.trainer.save_every == 0
                stopping = stop.agreed()
                if due or stopping or step == cfg.trainer.steps:
                    self._phase(None)
                    path = self.save(step)
                    if stopping:
                        self.log(f"signal {stop.signum or 'on another rank'}: checkpoint after step {step} at {path}; exiting")
                        return last
        finally:
            stop.restore()
            self.metrics.close()
        if _rank0() and cfg.trainer.plot:
            plot = plot_metrics(self.metrics.path, os.path.join(self.run_dir, "plot.png"))
            self.log(f"plot: {plot}" if plot else "plot: skipped (pip install matplotlib)")
        return last

    def train_step(self, step: int) -> dict:
        alg = self.cfg.algorithm
        t_step = time.perf_counter()
        t0 = time.perf_counter()
        self._phase("actor")
        self.engine.load_from_chunks(self.actor.chunks)
        t_sync = time.perf_counter() - t0
        batch = self.sampler.next_batch()
        t0 = time.perf_counter()
        samples = self._rollout(batch, step)
        self.engine.release_weights()  # reloaded before the next rollout; training gets the memory
        t_rollout = time.perf_counter() - t0
        t0 = time.perf_counter()
        scores = self._rewards(samples)
        t_reward = time.perf_counter() - t0
        t0 = time.perf_counter()
        exp, timings = self._experience(samples, scores)
        t_exp = time.perf_counter() - t0
        metrics = self._update(exp, step)
        if exp.kl is not None:
            current_kl = float(losses.aggregate(exp.kl, exp.mask, "token-mean"))
            metrics["actor/kl"] = current_kl
            self.kl_ctl.update(current_kl, len(samples))
            metrics["actor/kl_coef"] = self.kl_ctl.value
        metrics.update(self._step_metrics(exp))
        metrics.update(timings)
        step_s = time.perf_counter() - t_step
        tokens = sum(len(p) + len(r) for p, r in zip(samples.prompt_ids, samples.response_ids))
        metrics.update({
            "rollout/weights_gb": self.engine.weight_bytes() / 2**30,
            "timing/weight_sync_s": t_sync, "timing/rollout_s": t_rollout, "timing/reward_s": t_reward,
            "timing/experience_s": t_exp, "timing/step_s": step_s,
            "throughput/tokens_per_s": tokens / step_s, "memory/" + _memory_key(): _memory_gb(),
        })
        return metrics

    def _step_metrics(self, exp: Experience) -> dict:
        mask, samples = exp.mask, exp.samples
        lengths = mask.sum(-1)
        out = {
            "reward/mean": float(exp.scores.mean()), "reward/std": float(exp.scores.std()) if len(exp.scores) > 1 else 0.0,
            "reward/max": float(exp.scores.max()), "reward/min": float(exp.scores.min()),
            "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/stopped_frac": sum(r == "stop" for r in samples.finish_reason) / len(samples),
            "actor/entropy": float(losses.aggregate(exp.entropy, mask, "token-mean")),
            "advantages/mean": float(losses.aggregate(exp.advantages, mask, "token-mean")),
        }
        rollout = samples.pad_responses([torch.tensor([0.0] * (len(p) - 1) + list(lp) + [0.0])
                                         for p, lp in zip(samples.prompt_ids, samples.rollout_logprob)])
        diff = (rollout - exp.old_logprob).abs() * mask
        out["rollout/logprob_mismatch_mean"] = float(diff.sum() / mask.sum().clamp(min=1))
        out["rollout/logprob_mismatch_max"] = float(diff.max())
        if exp.values is not None:
            out["critic/explained_var"] = float(losses.explained_variance(exp.values, exp.returns, mask))
            out["critic/values_mean"] = float(losses.aggregate(exp.values, mask, "token-mean"))
        return out


def _step_stats(prefix: str, results: list) -> dict:
    norms = [r.grad_norm for r in results if r.ok]
    return {f"{prefix}/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
            f"{prefix}/skipped_updates": sum(1 for r in results if not r.ok)}


def _memory_key() -> str:
    return "max_allocated_gb" if torch.cuda.is_available() and torch.cuda.is_initialized() else "rss_gb"


def _memory_gb() -> float:
    if _memory_key() == "max_allocated_gb":
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def run_ppo(cfg: Config, log=print) -> dict:
    trainer = PPOTrainer(cfg, log=log)
    return trainer.train()
