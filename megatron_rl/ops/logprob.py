"""Per-token log-probabilities and entropy from vocab-parallel output weights, in chunks.

The naive path -- ``logits = h @ W.T`` for the whole sequence, gather over TP, ``log_softmax`` in
fp32 -- holds ``[tokens, vocab]`` fp32 tensors that dominate memory at long context (32k tokens
x 152k vocabulary x 4 bytes = 19.5 GB per copy).  This op fuses the output projection into the
log-softmax and walks the tokens in chunks of ``chunk_size``: a chunk's ``[chunk, vocab/TP]``
logits exist only inside the loop, in fp32, and are recomputed in backward.  Across the tensor-
parallel group only per-token scalars travel (max, sum-exp, target logit, expected logit).

Saved for backward: the hidden states (already alive for the model's own backward) and three
fp32 scalars per token.  Padded vocabulary entries (TP padding) are masked out, so they never
reach log-probs or entropy.  Temperature divides the logits before the softmax.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_rl.ops.precision import compute_dtype

DEFAULT_CHUNK_SIZE = 1024


def _chunk_logits(h, weight, vocab_start, true_vocab, temperature):
    dtype = compute_dtype(h)
    z = torch.matmul(h.to(dtype), weight.to(dtype).t())
    if temperature != 1.0:
        z = z / temperature
    cols = torch.arange(vocab_start, vocab_start + weight.size(0), device=z.device)
    valid = cols < true_vocab
    if not bool(valid.all()):
        z = z.masked_fill(~valid, float("-inf"))
    return z, valid


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, true_vocab, temperature, chunk_size, group, with_entropy):
        tp_size = dist.get_world_size(group) if group is not None else 1
        tp_rank = dist.get_rank(group) if group is not None else 0
        vocab_local = weight.size(0)
        vocab_start = tp_rank * vocab_local
        tokens = hidden.size(0)
        logp = torch.empty(tokens, dtype=compute_dtype(hidden), device=hidden.device)
        log_z = torch.empty_like(logp)
        mean_z = torch.empty_like(logp)
        for start in range(0, tokens, chunk_size):
            end = min(start + chunk_size, tokens)
            # At most two [chunk, vocab/TP] buffers live at once: the logits and their exp.
            z, valid = _chunk_logits(hidden[start:end], weight, vocab_start, true_vocab, temperature)
            m = z.amax(dim=-1)
            if tp_size > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            lab = labels[start:end]
            local = (lab >= vocab_start) & (lab < vocab_start + vocab_local)
            idx = (lab - vocab_start).clamp(0, vocab_local - 1)
            target = torch.where(local, z.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(m))
            z.sub_(m[:, None])
            e = torch.exp(z)
            sum_e = e.sum(-1)
            stats = [sum_e, target]
            if with_entropy:
                if not bool(valid.all()):
                    z.masked_fill_(~valid, 0.0)  # padded columns: e == 0 there, avoid 0 * -inf
                # sum(e * z) = sum(e * (z - m)) + m * sum(e)
                stats.append(e.mul_(z).sum(-1) + m * sum_e)
            stats = torch.stack(stats)
            if tp_size > 1:
                dist.all_reduce(stats, group=group)
            lz = m + torch.log(stats[0])
            log_z[start:end] = lz
            logp[start:end] = stats[1] - lz
            if with_entropy:
                mean_z[start:end] = stats[2] / stats[0]
            del z, e
        ctx.save_for_backward(hidden, weight, labels, log_z, mean_z)
        ctx.cfg = (true_vocab, temperature, chunk_size, group, with_entropy, vocab_start)
        entropy = (log_z - mean_z) if with_entropy else torch.zeros_like(logp)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, log_z, mean_z = ctx.saved_tensors
        true_vocab, temperature, chunk_size, group, with_entropy, vocab_start = ctx.cfg
        vocab_local = weight.size(0)
        grad_hidden = torch.empty_like(hidden)
        dtype = compute_dtype(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        grad_logp = grad_logp.to(dtype)
        grad_entropy = grad_entropy.to(dtype) if with_entropy else None
        for start in range(0, hidden.size(0), chunk_size):
            end = min(start + chunk_size, hidden.size(0))
            h = hidden[start:end]
            grad_a = grad_logp[start:end, None]
            z, valid = _chunk_logits(h, weight, vocab_start, true_vocab, temperature)
            z.sub_(log_z[start:end, None])
            p = torch.exp(z)  # softmax; 0 on padded columns
            if with_entropy:
                # g = a (onehot - p) - b p (z - E_p[z]) = p * (-a - b (z - E_p[z])) + a onehot
                if not bool(valid.all()):
                    z.masked_fill_(~valid, 0.0)
                z.add_((log_z[start:end] - mean_z[start:end])[:, None])  # z - E_p[z]
                g = z.mul_(-grad_entropy[start:end, None]).sub_(grad_a).mul_(p)
                del p
            else:
                del z
                g = p.mul_(-grad_a)
            lab = labels[start:end]
            local = (lab >= vocab_start) & (lab < vocab_start + vocab_local)
            rows = torch.nonzero(local).squeeze(1)
            g[rows, lab[rows] - vocab_start] += grad_logp[start:end][rows]
            if temperature != 1.0:
                g.div_(temperature)
            grad_hidden[start:end] = (g @ weight.to(dtype)).to(hidden.dtype)
            grad_weight.addmm_(g.t(), h.to(dtype))
            del g
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    true_vocab_size: int,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    sequence_parallel: bool = False,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``labels`` and entropy per token, from the model's last hidden states.

    ``hidden``: ``[s, b, h]`` as the decoder returns it (``[s/TP, b, h]`` under sequence
    parallelism); ``weight``: this rank's ``[vocab/TP, h]`` output weight; ``labels``: ``[b, s]``
    global token ids (any value where the result is masked later).  Returns two ``[b, s]`` fp32
    tensors.  Gradients flow to ``hidden`` and ``weight``.
    """
    tp_active = ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() > 1
    group = ps.get_tensor_model_parallel_group() if tp_active else None
    if sequence_parallel and group is not None:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
    elif group is not None:
        hidden = copy_to_tensor_model_parallel_region(hidden)
    s, b, h = hidden.shape
    flat = hidden.transpose(0, 1).reshape(b * s, h)
    labels = labels.reshape(b * s).long()
    labels = labels.clamp(0, true_vocab_size - 1)
    logp, entropy = _VocabParallelLogProb.apply(
        flat, weight, labels, true_vocab_size, float(temperature), int(chunk_size), group, with_entropy
    )
    return logp.view(b, s), entropy.view(b, s)


def naive_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """Reference: full ``[.., vocab]`` fp32 log-softmax (what the op avoids)."""
    logits = logits.to(compute_dtype(logits))
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
