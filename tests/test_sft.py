"""The supervised warm-up: its learning rate, and demonstrations stepped through an environment."""

from __future__ import annotations

import torch

from megatron_rl.testing.harness import run_distributed


def sft_body(sft_lr: float, actor_lr: float, steps: int, with_env: bool):
    """Harness body: ``steps`` warm-up steps on a tiny actor; the learning rate of every step, and the
    first batch's sequences."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.data.tasks import load_task
    from megatron_rl.data.tokenizer import CharTokenizer
    from megatron_rl.engine.forward import BatchPlan
    from megatron_rl.trainer import sft
    from tests.support.helpers import small_actor

    cfg = load_config(None, [f"trainer.sft_lr={sft_lr}", f"actor.optim.lr={actor_lr}",
                             f"trainer.sft_warmup_steps={steps}", "trainer.prompts_per_step=4"])
    trainable, _ = small_actor({}, None)
    tokenizer = CharTokenizer("0123456789abcdefghijklmnopqrstuvwxyz +-*/=#.,:?()<>_{}\"\n")
    prompts = load_task("tool_mul" if with_env else "add_small", tokenizer, 16)
    make_env = None
    if with_env:
        from megatron_rl.envs.base import environment_factory

        make_env = environment_factory("tool_calling", {"timeout_s": 5.0})
    rates, batches = [], []
    step = trainable.step

    def recording_step():
        rates.append(trainable.lr)
        return step()

    trainable.step = recording_step
    original = sft._batch

    def recording_batch(*args, **kwargs):
        out = original(*args, **kwargs)
        batches.append(out)
        return out

    sft._batch = recording_batch
    try:
        sft.sft_warmup(trainable, prompts, tokenizer, cfg, BatchPlan(micro_batch_size=4), torch.device("cpu"),
                       lambda _: None, make_env=make_env)
    finally:
        sft._batch = original
    seqs, total = batches[0]
    return {"rates": rates, "seqs": [{k: v.tolist() for k, v in s.items()} for s in seqs], "total": total}


def test_every_warm_up_step_runs_at_the_warm_up_learning_rate():
    out = run_distributed(1, sft_body, 0.01, 0.0005, 4, False)[0]
    assert out["rates"] == [0.01] * 4, out["rates"]


def test_a_demonstration_is_stepped_through_the_environment_with_its_observation_masked():
    from megatron_rl.data.tokenizer import CharTokenizer

    tokenizer = CharTokenizer("0123456789abcdefghijklmnopqrstuvwxyz +-*/=#.,:?()<>_{}\"\n")
    out = run_distributed(1, sft_body, 0.01, 0.0005, 1, True)[0]
    for seq in out["seqs"]:
        tokens, mask = seq["tokens"], seq["loss_mask"]
        prompt_len = tokens.index(tokenizer.encode("=")[0]) + 1
        text = tokenizer.decode(tokens[prompt_len:])
        a, b = tokenizer.decode(tokens[:prompt_len]).rstrip("=").split("*")
        answer = str(int(a) * int(b))
        call = '<tool_call>{"name": "calculator", "arguments": {"expression": "' + f"{a}*{b}" + '"}}</tool_call>'
        observation = f"\ntool: {answer}\nassistant: "
        assert text == call + observation + answer and tokens[-1] == tokenizer.eos_id
        # the loss is on the positions predicting the call, the answer and EOS; none on the observation
        predicted = [tokens[t + 1] for t in range(len(tokens) - 1) if mask[t] == 1]
        assert predicted == tokenizer.encode(call) + tokenizer.encode(answer) + [tokenizer.eos_id]
    assert out["total"] == sum(sum(s["loss_mask"]) for s in out["seqs"])
