"""LoRA's memory, measured: the bytes one rank really holds for a PPO actor (and its reference)
after an optimizer step, full fine-tuning against LoRA, beside what the planner counts for them
(:func:`megatron_rl.planner.memory.model_state`).

The census walks every tensor the trainer's models hold -- each parameter (the frozen reference's
and a LoRA model's frozen base included), megatron DDP's parameter and gradient buffers and
``main_grad``, and the optimizer's state and fp32 master copies -- and counts each storage once
(views into a buffer share its storage), under the first of weights, grads, optimizer that
reaches it.  Used by ``tests/test_lora_memory.py`` and ``benchmarks/lora_memory.py``.
"""

from __future__ import annotations

from typing import Optional

# Large enough that adapters sit in a realistic proportion to the base, small enough to build and
# step in a few seconds on a CPU.
MEMORY_MODEL = dict(num_layers=4, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8,
                    num_query_groups=4, vocab_size=2048, params_dtype="bfloat16")
CATEGORIES = ("weights", "grads", "optimizer")


def lora_config(rank: int, targets=("all-linear",), quantize_base: str = "none"):
    from megatron_rl.config.schema import LoRAConfig

    return LoRAConfig(rank=rank, target_modules=list(targets), quantize_base=quantize_base) if rank else None


def planned_bytes(rank: int, targets=("all-linear",), model_kw: Optional[dict] = None,
                  quantize_base: str = "none") -> dict:
    """The planner's model state of the same job on one rank (actor and, without LoRA, a reference
    copy; no critic), in the census's categories."""
    from megatron_rl.config.schema import ModelConfig
    from megatron_rl.planner.memory import model_state
    from megatron_rl.planner.option import PlanOption

    cfg = ModelConfig(**(model_kw or MEMORY_MODEL))
    models = model_state(cfg, PlanOption.of(), with_critic=False, with_reference=True, param_bytes=2,
                         actor_lora=lora_config(rank, targets, quantize_base))
    out = {c: sum(v for k, v in models.items() if k.endswith(c)) for c in CATEGORIES}
    out["total"] = sum(models.values())
    out["lines"] = models
    return out


def _tensors(obj, depth: int = 0):
    """Tensors inside lists, tuples and dicts (not inside other objects)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)


def _optimizer_tensors(optimizer):
    """Every tensor megatron's optimizer (chained or not) keeps: the wrapped torch optimizer's
    state and parameter groups (the fp32 master copies), and the lists megatron holds itself
    (``fp32_from_float16_groups``, the distributed optimizer's ``shard_*`` groups, ...)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        yield from _tensors(list(inner.state.values()))
        for group in inner.param_groups:
            yield from _tensors(group["params"])
        for value in vars(opt).values():
            yield from _tensors(value)


def census(models) -> dict:
    """Bytes per category of every storage the actor (DDP chunks, optimizer) and the reference
    hold on this rank, each storage counted once."""
    seen: set[int] = set()
    out = dict.fromkeys(CATEGORIES, 0)

    def count(category: str, tensors) -> None:
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[category] += storage.nbytes()

    actor = models.actor
    params = [p for chunk in actor.chunks for p in chunk.parameters()]
    params += [p for chunk in (models.reference or []) for p in chunk.parameters()]
    params += [b for chunk in actor.chunks for b in chunk.module.buffers()]  # an int8 base's row scales too
    buffers = [b for chunk in actor.chunks for b in chunk.buffers + chunk.expert_parallel_buffers]
    count("weights", params + [b.param_data for b in buffers if b.param_data is not None])
    count("grads", [b.grad_data for b in buffers if b.grad_data is not None]
          + [g for p in params for g in (getattr(p, "main_grad", None), p.grad) if g is not None])
    master = list(_optimizer_tensors(actor.optimizer))
    count("optimizer", master + [p.grad for p in master if p.grad is not None])
    out["total"] = sum(out.values())
    return out


def measure_body(rank: int, targets=("all-linear",), model_kw: Optional[dict] = None,
                 quantize_base: str = "none") -> dict:
    """Worker body (one rank): build the actor as the trainer does (``build_models``, with the
    reference a PPO run with a KL term keeps; ``quantize_base``: an int8 base), run one
    forward/backward and one optimizer step so Adam's state exists, and return :func:`census` with
    the parameter counts."""
    import torch

    from megatron_rl.config.schema import Config, ModelConfig
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.trainer.initial_weights import quantize_bases
    from megatron_rl.trainer.model_set import build_models

    cfg = Config(model=ModelConfig(**(model_kw or MEMORY_MODEL)))
    lora = lora_config(rank, targets, quantize_base)
    if lora is not None:
        cfg.actor.lora = lora
    layout = use_layout()
    plan = BatchPlan(micro_batch_size=2)
    models = build_models(cfg, layout, torch.device("cpu"), plan, use_ref=True, use_critic=False)
    quantize_bases(models, cfg, "actor")  # as the trainer does once the base is loaded
    g = torch.Generator().manual_seed(5)
    seqs = [{"tokens": torch.randint(0, cfg.model.vocab_size, (n,), generator=g)} for n in (24, 17)]
    total = float(sum(s["tokens"].numel() for s in seqs))

    def loss_fn(outs, tensors, mb):
        return -outs["logprob"].sum() / total, {}

    models.actor.zero_grad()
    run_sequences(models.actor.chunks, seqs, LogProbHead(with_entropy=False), plan, torch.device("cpu"),
                  loss_fn=loss_fn, forward_only=False)
    step = models.actor.step()
    assert step.ok, step.reason
    result = census(models)
    actor_params = [p for chunk in models.actor.chunks for p in chunk.parameters()]
    result["trained_params"] = sum(p.numel() for p in actor_params if p.requires_grad)
    result["params"] = sum(p.numel() for p in actor_params)
    result["reference"] = models.reference is not None or models.reference_is_base
    return result


def activation_body(quantize_base: str = "none", model_kw: Optional[dict] = None) -> dict:
    """Worker body (one rank): one forward/backward of a rank-8 LoRA actor on :data:`MEMORY_MODEL`,
    measuring the peak of the tensors it creates (:func:`megatron_rl.utils.memory.track_peak_memory`)
    and the bytes autograd keeps for the backward pass beside the parameters
    (:func:`megatron_rl.utils.memory.saved_for_backward`), with the base as ``quantize_base`` holds
    it; also the largest dequantized weight (a layer's, the most an int8 base adds at once)."""
    import torch

    from megatron_rl.config.schema import Config, ModelConfig
    from megatron_rl.engine.forward import BatchPlan, run_sequences
    from megatron_rl.models.heads import LogProbHead
    from megatron_rl.models.lora.int8_weights import is_quantized
    from megatron_rl.testing.layouts import use_layout
    from megatron_rl.trainer.initial_weights import quantize_bases
    from megatron_rl.trainer.model_set import build_models
    from megatron_rl.utils.memory import saved_for_backward, track_peak_memory

    cfg = Config(model=ModelConfig(**(model_kw or MEMORY_MODEL)))
    cfg.actor.lora = lora_config(8, quantize_base=quantize_base)
    plan = BatchPlan(micro_batch_size=2)
    models = build_models(cfg, use_layout(), torch.device("cpu"), plan, use_ref=False, use_critic=False)
    quantize_bases(models, cfg, "actor")
    g = torch.Generator().manual_seed(5)
    seqs = [{"tokens": torch.randint(0, cfg.model.vocab_size, (n,), generator=g)} for n in (40, 24)]
    params = [p for chunk in models.actor.chunks for p in chunk.parameters()]

    def loss_fn(outs, tensors, mb):
        return -outs["logprob"].sum(), {}

    with track_peak_memory() as peak, saved_for_backward(exclude=params) as saved:
        run_sequences(models.actor.chunks, seqs, LogProbHead(with_entropy=False), plan, torch.device("cpu"),
                      loss_fn=loss_fn, forward_only=False)
    largest = max((p.numel() * p.dequant_dtype.itemsize for p in params if is_quantized(p)), default=0)
    return {"peak": peak.peak, "saved": saved.bytes, "largest_weight": largest}
