"""Every trained sample, one JSON line each, in ``<run dir>/samples/step_<k>.jsonl`` (``trainer.log_samples``).

What verl writes with ``trainer.rollout_data_dir``, plus what asynchronous training needs to be
checked: each sample's id (``<batch>-<row>``: the step whose batch it was generated for, the
dynamic-sampling round where there are several, and its row in that batch; a batch generated
ahead and kept in a checkpoint keeps its ids), the policy version that generated it (its oldest
token's with partial rollouts) and the step that trained it.  One file per step, so a resumed run
rewrites the steps it redoes and never holds a sample twice.  Rank 0 writes.
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch

from megatron_rl.distributed import faults
from megatron_rl.trainer.experience import Samples
from megatron_rl.trainer.staleness import generating_versions
from megatron_rl.utils import run_files

STEP_FILE = "step_{:08d}.jsonl"


class SampleLog:
    def __init__(self, run_dir: str, enabled: bool, tokenizer):
        self.dir = os.path.join(run_dir, "samples")
        self.enabled, self.tokenizer = enabled, tokenizer

    def truncate_after(self, step: int) -> None:
        """Remove the files of steps after ``step`` (a resumed run redoes them; -1: a fresh start)."""
        if not self.enabled:
            return
        for path in glob.glob(os.path.join(self.dir, "step_*.jsonl")):
            match = re.fullmatch(r"step_(\d+)\.jsonl", os.path.basename(path))
            if match and int(match.group(1)) > step:
                os.unlink(path)

    def write(self, step: int, samples: Samples, rewards: torch.Tensor, advantages: torch.Tensor,
              response_mask: torch.Tensor, version: int) -> None:
        """``rewards`` [B] (as trained, shaping included), ``advantages`` and ``response_mask`` [B, T]
        (each sample's mean advantage over its response tokens is written); ``version``: the one the
        batch was generated with."""
        if not self.enabled:
            return
        mask = response_mask.float()
        mean_advantage = (advantages.float() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        generated_by = generating_versions(samples, version)
        lines = []
        for i in range(len(samples)):
            versions = samples.token_versions[i] if samples.token_versions else None
            record = {
                "id": samples.sample_id[i] if samples.sample_id else f"{step}-{i}",
                "step": step,
                "version": generated_by[i],
                "dataset_index": samples.dataset_index[i],
                "prompt": self.tokenizer.decode(samples.prompt_ids[i]),
                "response": self.tokenizer.decode(samples.response_ids[i]),
                "response_tokens": len(samples.response_ids[i]),
                "finish_reason": samples.finish_reason[i],
                "reward": float(rewards[i]),
                "advantage": float(mean_advantage[i]),
            }
            if versions:
                record["token_versions"] = sorted(set(versions))
            lines.append(json.dumps(record, ensure_ascii=False) + "\n")
        path = os.path.join(self.dir, STEP_FILE.format(step))
        faults.maybe_fill_disk(step, self.dir, phase="samples")
        run_files.replace_text(path, "".join(lines), f"the step {step} samples")
