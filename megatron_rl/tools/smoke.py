"""Parallel smoke job: train a tiny GPT language model on synthetic sequences on any layout.

``megatron-rl smoke --nproc 4 parallel.tp=2 parallel.pp=2`` checks that a machine (or a
cluster allocation) runs megatron-core end to end: process groups, pipeline schedule, DDP,
optimizer.  The sequences follow ``x[t+1] = (5 * x[t] + 3) mod V``, so the loss falls fast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.config.schema import Config
from megatron_rl.distributed import faults
from megatron_rl.distributed.metrics import reduce_sum_count
from megatron_rl.distributed.runtime import active_groups
from megatron_rl.distributed.startup import start_model_parallel
from megatron_rl.engine.pipeline import run_microbatches
from megatron_rl.engine.trainable import make_trainable
from megatron_rl.models.builder import build_gpt_chunks
from megatron_rl.models.canonical import unwrap
from megatron_rl.ops import zigzag
from megatron_rl.ops.logprob import vocab_parallel_logprobs
from megatron_rl.utils.seeds import derive_seed
from megatron_rl.utils.timing import timed, timing_key


def synthetic_sequences(step: int, count: int, seq_len: int, vocab: int, seed: int) -> torch.Tensor:
    """``[count, seq_len + 1]`` token ids of the affine recurrence, random starts."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "smoke", step))
    x = torch.randint(0, vocab, (count, 1), generator=gen)
    cols = [x]
    for _ in range(seq_len):
        x = (5 * x + 3) % vocab
        cols.append(x)
    return torch.cat(cols, dim=1)


def lm_microbatches(tokens: torch.Tensor, micro_batch_size: int, cp: int, cp_rank: int) -> list[dict]:
    """Split ``[n, s+1]`` tokens into micro-batches of inputs/labels/mask, this CP rank's shard."""
    out = []
    for start in range(0, tokens.size(0), micro_batch_size):
        piece = tokens[start : start + micro_batch_size]
        inputs, labels = piece[:, :-1], piece[:, 1:]  # shift before the CP split
        mask = torch.ones_like(inputs, dtype=torch.float32)
        out.append({k: zigzag.shard(v, cp, cp_rank, dim=1) for k, v in
                    {"tokens": inputs, "labels": labels, "mask": mask}.items()})
    return out


def lm_forward_step(device: torch.device):
    def forward_step(batch, model):
        tokens = batch["tokens"].to(device)
        positions = torch.arange(tokens.size(1), device=device).expand_as(tokens)
        hidden = model(tokens, positions, None)
        inner = unwrap(model)

        def loss_func(output):
            logp, _ = vocab_parallel_logprobs(
                output, inner.output_weight(), batch["labels"].to(device),
                true_vocab_size=inner.true_vocab_size, sequence_parallel=inner.config.sequence_parallel,
                with_entropy=False, tp_group=active_groups().tp,
            )
            mask = batch["mask"].to(device)
            nll = -(logp * mask).sum()
            count = mask.sum().to(torch.int)
            return nll, count, {"lm_loss": torch.stack([nll.detach(), mask.sum()])}

        return hidden, loss_func

    return forward_step


def data_parallel_slice(tokens: torch.Tensor, dp_group=None) -> torch.Tensor:
    """This data-parallel rank's share of ``tokens``; ``dp_group`` defaults to the active layout's."""
    dp_group = active_groups().dp if dp_group is None else dp_group
    dp, rank = dp_group.size(), dp_group.rank()
    per = tokens.size(0) // dp
    return tokens[rank * per : (rank + 1) * per]


def run_smoke(cfg: Config, log=print) -> list[float]:
    started = start_model_parallel(cfg)
    layout, groups, device = started.layout, started.groups, started.device
    chunks = build_gpt_chunks(cfg.model, layout, device)
    trainable = make_trainable(chunks, cfg.actor.optim, cfg.smoke.steps)
    sm = cfg.smoke
    step_fn = lm_forward_step(device)
    losses = []
    if dist.get_rank() == 0:
        log(f"smoke: layout tp={layout.tp} pp={layout.pp} vpp={layout.vpp} cp={layout.cp} dp={layout.dp} "
            f"sp={layout.sequence_parallel} on {device}; {sm.steps} steps x {sm.num_microbatches} micro-batches")
    for step in range(sm.steps):
        timings: dict = {}
        with timed("step", timings):
            faults.maybe_inject(step + 1)
            tokens = synthetic_sequences(step, layout.dp * sm.num_microbatches * sm.micro_batch_size,
                                         sm.seq_length, cfg.model.vocab_size, cfg.run.seed)
            mbs = lm_microbatches(data_parallel_slice(tokens, groups.dp), sm.micro_batch_size, layout.cp,
                                  groups.cp.rank())
            trainable.zero_grad()
            logs = run_microbatches(trainable.chunks, mbs, step_fn, forward_only=False,
                                    seq_length=sm.seq_length // layout.cp, micro_batch_size=sm.micro_batch_size)
            grad_norm = trainable.step().grad_norm
            loss = reduce_sum_count(logs, ["lm_loss"])["lm_loss"]
        losses.append(loss)
        if dist.get_rank() == 0:
            log(f"step {step + 1:3d}  loss {loss:.4f}  grad_norm {grad_norm:.3f}  "
                f"lr {trainable.lr:.2e}  {timings[timing_key('step')]:.2f}s")
    return losses
