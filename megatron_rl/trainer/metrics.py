"""The numbers of a step and where they go: ``metrics.jsonl`` (one JSON line per step), a console
progress line, optional TensorBoard / Weights & Biases, and ``plot.png`` at the end.  Rank 0 writes.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import threading
import time
from typing import Optional, Sequence

import psutil
import torch

from megatron_rl.algorithms import losses
from megatron_rl.distributed import faults
from megatron_rl.engine.trainable import StepResult
from megatron_rl.trainer.experience import Experience
from megatron_rl.trainer.old_policy import OldPolicy
from megatron_rl.utils import run_files

KEY_FIGURES = {"reward/mean": "reward", "actor/kl": "kl", "actor/pg_loss": "pg_loss", "critic/vf_loss": "vf_loss",
               "actor/entropy": "entropy", "response_length/mean": "resp_len", "actor/grad_norm": "grad_norm"}


def _quiet_tensorboard_writer_thread() -> None:
    """TensorBoard writes its events on a thread that prints its OSError as a traceback, then gives
    it to the next ``flush`` on the main thread -- where :meth:`MetricsWriter.log` reports it in one
    line.  The thread's own traceback is left out; every other thread's failure prints as before."""
    previous = threading.excepthook
    if getattr(previous, "leaves_out_tensorboard", False):  # installed already
        return

    def hook(args) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard."):
            return
        previous(args)

    hook.leaves_out_tensorboard = True
    threading.excepthook = hook


class MetricsWriter:
    def __init__(self, run_dir: str, enabled: bool, total_steps: int, tensorboard: bool = False,
                 wandb: bool = False, run_name: str = "megatron_rl", config: Optional[dict] = None):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.run_dir = run_dir
        self.enabled = enabled
        self.total_steps = total_steps
        self._tb = None
        self._wandb = None
        self._start = time.time()
        if not enabled:
            return
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
                _quiet_tensorboard_writer_thread()
            except ImportError:
                print("metrics: tensorboard is not installed (pip install tensorboard); skipping it", file=sys.stderr)
        if wandb:
            try:
                import wandb as wb

                self._wandb = wb.init(project="megatron_rl", name=run_name, config=config or {}, dir=run_dir)
            except ImportError:
                print("metrics: wandb is not installed (pip install wandb); skipping it", file=sys.stderr)

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after ``step`` (a resumed run redoes them)."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        with open(self.path) as fh:
            keep = [line for line in fh if line.strip() and json.loads(line).get("step", 0) <= step]
        run_files.replace_text(self.path, "".join(keep), "the metrics of the steps kept")

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        faults.maybe_fill_disk(step, self.path, phase="metrics")
        run_files.append_text(self.path, json.dumps(record) + "\n", f"the step {step} metrics line")
        if self._tb is not None:
            faults.maybe_fill_disk(step, self.path, phase="tensorboard",
                                   appended=glob.glob(os.path.join(glob.escape(self._tb.log_dir), "*")))
            tb, self._tb = self._tb, None  # a writer that failed is not closed: its thread would fail again
            with run_files.writing(tb.log_dir, f"the step {step} TensorBoard events"):
                for key, value in record.items():
                    if key != "step" and isinstance(value, (int, float)):
                        tb.add_scalar(key, value, step)
                tb.flush()  # a full disk is reported at this step, not at some later one
            self._tb = tb
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def progress(self, step: int, metrics: dict) -> str:
        width = 20
        done = int(width * step / max(1, self.total_steps))
        bar = "#" * done + "-" * (width - done)
        parts = [f"step {step:>4}/{self.total_steps} [{bar}]"]
        for key, label in KEY_FIGURES.items():
            if key in metrics and metrics[key] is not None and not _is_nan(metrics[key]):
                parts.append(f"{label} {metrics[key]:.4g}")
        parts.append(f"{metrics.get('timing/step_s', 0.0):.1f}s/step")
        line = "  ".join(parts)
        if self.enabled:
            print(line, flush=True)
        return line

    def close(self) -> None:
        if self._tb is not None:
            with run_files.writing(self._tb.log_dir, "the TensorBoard events"):
                self._tb.close()
        if self._wandb is not None:
            print("metrics: waiting for Weights & Biases to finish uploading ...", flush=True)
            self._wandb.finish()


def experience_metrics(exp: Experience, policy: OldPolicy) -> dict:
    """Rewards, response lengths, entropy, advantages, rollout-vs-trainer log-prob mismatch, values.

    Entropy and the mismatch are over the samples the trainer's pre-update log-probs were measured
    on (``policy.measured``; every sample unless old_logprobs=rollout with several mini-batches)."""
    mask, samples = exp.mask, exp.samples
    lengths = mask.sum(-1)
    measured = mask if policy.measured is None else mask * policy.measured[:, None]
    out = {
        "reward/mean": float(exp.scores.mean()), "reward/std": float(exp.scores.std()) if len(exp.scores) > 1 else 0.0,
        "reward/max": float(exp.scores.max()), "reward/min": float(exp.scores.min()),
        "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
        "response_length/stopped_frac": sum(r == "stop" for r in samples.finish_reason) / len(samples),
        "advantages/mean": float(losses.aggregate(exp.advantages, mask, "token-mean")),
    }
    if policy.entropy is not None:
        out["actor/entropy"] = float(losses.aggregate(policy.entropy, measured, "token-mean"))
    if policy.trainer_logprob is not None:
        diff = (samples.rollout_logprobs() - policy.trainer_logprob).abs() * measured
        out["rollout/logprob_mismatch_mean"] = float(diff.sum() / measured.sum().clamp(min=1))
        out["rollout/logprob_mismatch_max"] = float(diff.max())
    if exp.values is not None:
        out["critic/explained_var"] = float(losses.explained_variance(exp.values, exp.returns, mask))
        out["critic/values_mean"] = float(losses.aggregate(exp.values, mask, "token-mean"))
    return out


def throughput_metrics(samples, step_s: float) -> dict:
    """Tokens per second of the whole step: generated (response) tokens, and all tokens the
    trainer processed (prompt + response)."""
    generated = sum(len(r) for r in samples.response_ids)
    prompt = sum(len(p) for p in samples.prompt_ids)
    return {"throughput/generated_tokens_per_s": generated / step_s,
            "throughput/total_tokens_per_s": (prompt + generated) / step_s}


def optimizer_step_metrics(phase: str, results: Sequence[StepResult]) -> dict:
    """Mean gradient norm of the applied steps (NaN when none was) and the count of skipped ones."""
    norms = [r.grad_norm for r in results if r.ok]
    return {f"{phase}/grad_norm": sum(norms) / len(norms) if norms else float("nan"),
            f"{phase}/skipped_updates": sum(1 for r in results if not r.ok)}


def memory_metrics() -> dict:
    """Peak CUDA memory allocated, or the process's resident memory on CPU, in GiB."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"memory/max_allocated_gb": torch.cuda.max_memory_allocated() / 2**30}
    return {"memory/rss_gb": psutil.Process().memory_info().rss / 2**30}


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def plot_metrics(metrics_path: str, out_path: str) -> Optional[str]:
    """reward, evaluation reward, KL and losses against the step; returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_metrics(metrics_path)
    if not rows:
        return None
    panels = [("reward/mean", "mean reward"), ("eval/reward_mean", "evaluation set: mean reward"),
              ("actor/kl", "KL(actor || reference)"),
              ("actor/pg_loss", "policy loss"), ("critic/vf_loss", "value loss")]
    panels = [(k, t) for k, t in panels if any(k in r and not _is_nan(r[k]) for r in rows)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (key, title) in zip(axes[:, 0], panels):
        xs = [r["step"] for r in rows if key in r and not _is_nan(r[key])]
        ys = [r[key] for r in rows if key in r and not _is_nan(r[key])]
        ax.plot(xs, ys, marker="o", markersize=2)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    try:
        run_files.replace_file(out_path, "the plot of the metrics",
                               lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return out_path


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def _clean(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value
