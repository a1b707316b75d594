"""Per-token log-probabilities and entropy from vocab-parallel output weights, in chunks.

The naive path -- ``logits = h @ W.T`` for the whole sequence, gather over TP, ``log_softmax`` in
fp32 -- holds ``[tokens, vocab]`` fp32 tensors that dominate memory at long context (32k tokens
x 152k vocabulary x 4 bytes = 19.5 GB per copy).  This op fuses the output projection into the
log-softmax and walks the tokens in chunks of ``chunk_size``: a chunk's ``[chunk, vocab/TP]``
logits exist only inside the loop and are recomputed in backward.  Across the tensor-parallel
group only per-token scalars travel (max, sum-exp, target logit, expected logit).

Precision: the GEMMs run in the model's dtype (bf16 GEMMs accumulate in fp32 and round their
output once, as megatron's own output layer does), so the ``[vocab/TP, h]`` weight is never
copied; log-softmax, entropy and the gradient of the logits are fp32 inside each chunk.  fp32
and float64 models compute everything in their own dtype.

Saved for backward: the hidden states (already alive for the model's own backward), three fp32
scalars per token, and -- when they take at most ``keep_logits_bytes`` (``batch.logprob_keep_logits_gib``)
-- the micro-batch's fp32 logits: the backward then reads them instead of running the output
projection a second time (megatron's own cross-entropy always keeps them; at a 32k vocabulary the
second projection is about 8% of a small model's training FLOPs).  Kept or recomputed, the backward
sees the same bits.  Padded vocabulary entries (TP padding) are masked out, so they never
reach log-probs or entropy; which columns are padding is known on the host from the shapes, so
the loop never waits for the device.  Temperature divides the logits before the softmax;
temperature 0 (greedy decoding) means log-probs at temperature 1 (:func:`logprob_temperature`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from megatron_rl.ops.logits_memory import DEFAULT_KEEP_LOGITS_BYTES, keeps_logits
from megatron_rl.ops.precision import compute_dtype

DEFAULT_CHUNK_SIZE = 1024


def logprob_temperature(temperature: float) -> float:
    """The temperature log-probs are computed at: the sampling one, or 1 for greedy (T=0).

    Greedy decoding has no distribution of its own; the sampler and the trainer both report the
    model's untempered one, so their log-probs stay comparable and finite."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return float(temperature) if temperature > 0 else 1.0


def _valid_columns(vocab_start: int, vocab_local: int, true_vocab: int) -> int:
    """How many of this shard's columns are real tokens (the rest is TP padding)."""
    return max(0, min(vocab_local, true_vocab - vocab_start))


def _gemm_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """Half-precision weights are multiplied as they are (the GEMM accumulates in fp32; no fp32
    copy of the weight); fp32 and float64 models multiply in their compute dtype."""
    return weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else compute_dtype(hidden)


def _fill_padding(z: torch.Tensor, n_valid: int, value: float) -> None:
    if n_valid < z.size(1):
        z[:, n_valid:] = value


def _chunk_logits(h, weight, n_valid: int, temperature: float):
    """Tempered logits ``[chunk, vocab/TP]`` in ``h``'s compute dtype from a GEMM in ``weight``'s
    dtype, padded columns at -inf."""
    z = torch.matmul(h.to(weight.dtype), weight.t()).to(compute_dtype(h))
    if temperature != 1.0:
        z = z / temperature
    _fill_padding(z, n_valid, float("-inf"))
    return z


class _VocabParallelLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, true_vocab, temperature, chunk_size, group, with_entropy,
                keep_logits_bytes):
        tp_size = dist.get_world_size(group) if group is not None else 1
        tp_rank = dist.get_rank(group) if group is not None else 0
        vocab_local = weight.size(0)
        vocab_start = tp_rank * vocab_local
        n_valid = _valid_columns(vocab_start, vocab_local, true_vocab)
        w = weight.to(_gemm_dtype(hidden, weight))  # the weight itself unless float64 tests mix dtypes
        tokens = hidden.size(0)
        logp = torch.empty(tokens, dtype=compute_dtype(hidden), device=hidden.device)
        log_z = torch.empty_like(logp)
        mean_z = torch.empty_like(logp)
        kept = [] if keeps_logits(tokens, vocab_local, keep_logits_bytes) else None
        for start in range(0, tokens, chunk_size):
            end = min(start + chunk_size, tokens)
            # At most two [chunk, vocab/TP] buffers live at once: the logits and their exp (three
            # while the logits are kept).
            z = _chunk_logits(hidden[start:end], w, n_valid, temperature)
            if kept is not None:
                kept.append(z)
            m = z.amax(dim=-1)
            if tp_size > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            lab = labels[start:end]
            local = (lab >= vocab_start) & (lab < vocab_start + vocab_local)
            idx = (lab - vocab_start).clamp(0, vocab_local - 1)
            target = torch.where(local, z.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(m))
            z = z - m[:, None] if kept is not None else z.sub_(m[:, None])
            e = torch.exp(z)
            sum_e = e.sum(-1)
            stats = [sum_e, target]
            if with_entropy:
                _fill_padding(z, n_valid, 0.0)  # padded columns: e == 0 there, avoid 0 * -inf
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
        # Saved as autograd's saved tensors (never modified in place), so memory hooks see them.
        ctx.save_for_backward(hidden, weight, labels, log_z, mean_z, *(kept or ()))
        ctx.cfg = (temperature, chunk_size, with_entropy, vocab_start, n_valid)
        entropy = (log_z - mean_z) if with_entropy else torch.zeros_like(logp)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, labels, log_z, mean_z, *kept = ctx.saved_tensors
        temperature, chunk_size, with_entropy, vocab_start, n_valid = ctx.cfg
        vocab_local = weight.size(0)
        grad_hidden = torch.empty_like(hidden)
        dtype = compute_dtype(hidden)
        w = weight.to(_gemm_dtype(hidden, weight))
        # One fp32 accumulator for the weight gradient over all chunks (not one per chunk).
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        grad_logp = grad_logp.to(dtype)
        grad_entropy = grad_entropy.to(dtype) if with_entropy else None
        for i, start in enumerate(range(0, hidden.size(0), chunk_size)):
            end = min(start + chunk_size, hidden.size(0))
            h = hidden[start:end]
            grad_a = grad_logp[start:end, None]
            if kept:  # a new tensor: the kept logits are autograd's saved tensors, never written
                z = kept[i] - log_z[start:end, None]
            else:
                z = _chunk_logits(h, w, n_valid, temperature).sub_(log_z[start:end, None])
            p = torch.exp(z)  # softmax; 0 on padded columns
            if with_entropy:
                # g = a (onehot - p) - b p (z - E_p[z]) = p * (-a - b (z - E_p[z])) + a onehot
                _fill_padding(z, n_valid, 0.0)
                z.add_((log_z[start:end] - mean_z[start:end])[:, None])  # z - E_p[z]
                g = z.mul_(-grad_entropy[start:end, None]).sub_(grad_a).mul_(p)
                del p
            else:
                del z
                g = p.mul_(-grad_a)
            lab = labels[start:end]
            local = (lab >= vocab_start) & (lab < vocab_start + vocab_local)
            idx = (lab - vocab_start).clamp(0, vocab_local - 1)
            # Adds 0 where the label lives on another TP rank: no host-side row selection.
            onehot = torch.where(local, grad_logp[start:end], torch.zeros_like(grad_logp[start:end]))
            g.scatter_add_(1, idx[:, None], onehot[:, None])
            if temperature != 1.0:
                g.div_(temperature)
            _accumulate_grads(g, h, w, grad_hidden[start:end], grad_weight)
            del g
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None, None, None


def _accumulate_grads(g, h, weight, grad_hidden_out, grad_weight) -> None:
    """``dh = g W`` and ``dW += g^T h``, GEMMs in ``weight``'s dtype; ``dW`` accumulates over the
    chunks in ``grad_weight``'s (fp32) dtype."""
    gw = g.to(weight.dtype)
    grad_hidden_out.copy_(gw @ weight)
    if weight.dtype == grad_weight.dtype:
        grad_weight.addmm_(gw.t(), h.to(weight.dtype))
    else:
        grad_weight.add_(gw.t() @ h.to(weight.dtype))


def _records_graph(*inputs: torch.Tensor) -> bool:
    """Whether autograd will call backward: grad mode on and an input that wants a gradient (a
    scoring pass under ``no_grad`` keeps no logits)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in inputs)


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
    keep_logits_bytes: float = DEFAULT_KEEP_LOGITS_BYTES,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``labels`` and entropy per token, from the model's last hidden states.

    ``hidden``: ``[s, b, h]`` as the decoder returns it (``[s/TP, b, h]`` under sequence
    parallelism); ``weight``: this rank's ``[vocab/TP, h]`` output weight; ``labels``: ``[b, s]``
    global token ids (any value where the result is masked later).  Returns two ``[b, s]`` fp32
    tensors (float64 for float64 inputs).  Gradients flow to ``hidden`` and ``weight``.
    ``keep_logits_bytes``: keep the fp32 logits for backward when they take at most this many bytes
    on this rank (0: always recompute them).  ``tp_group``: the tensor-parallel group ``weight`` is
    split over (the layout's ``ProcessGroupCollection.tp``); None: this rank holds the whole vocabulary.
    """
    group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
    if group is None and weight.size(0) < true_vocab_size:
        raise ValueError(f"a [{weight.size(0)}, h] output weight holds only part of a {true_vocab_size}-token "
                         "vocabulary: pass the tensor-parallel group it is split over as tp_group")
    if sequence_parallel and group is not None:
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=group)
    elif group is not None:
        hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
    s, b, h = hidden.shape
    flat = hidden.transpose(0, 1).reshape(b * s, h)
    labels = labels.reshape(b * s).long()
    labels = labels.clamp(0, true_vocab_size - 1)
    logp, entropy = _VocabParallelLogProb.apply(
        flat, weight, labels, true_vocab_size, logprob_temperature(temperature), int(chunk_size), group,
        with_entropy, float(keep_logits_bytes) if _records_graph(flat, weight) else 0.0,
    )
    return logp.view(b, s), entropy.view(b, s)


def naive_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0):
    """Reference: full ``[.., vocab]`` fp32 log-softmax (what the op avoids)."""
    logits = logits.to(compute_dtype(logits))
    logp_all = torch.log_softmax(logits / logprob_temperature(temperature), dim=-1)
    logp = logp_all.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
