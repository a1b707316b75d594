"""Supervised warm-up: a few steps of next-token loss on prompt + answer + EOS before RL.

It teaches a freshly initialised model the answer format, so that RL starts with rewards that
vary.  The loss covers the answer and EOS only, summed over tokens and divided once by the
step's answer-token count.  RL then starts from a new optimizer state and the RL learning rate.

With an environment (``rollout.env``) and prompts that carry demonstrations (the policy turns that
solve them, e.g. ``task:tool_mul``), a warm-up sequence is the trajectory the environment makes of
them: each turn is encoded and stepped through a fresh environment, whose observation is appended
with no loss, exactly as a rollout would build it; the last turn ends with EOS.

With an outside agent (``rollout.agent``) the policy sees what the chat endpoint serves, so the
warm-up trains on that: each record is a chat ending in a demonstration (the assistant's turns and
the tool results between them, :func:`megatron_rl.data.prompts.split_demonstration`; a ``tools``
column is offered with every request, as the agent offers it), served by a
:class:`~megatron_rl.envs.endpoint.ChatEndpoint` whose policy replies with the demonstration's turns
(:class:`DemonstrationServer`); the warm-up trains on the ids it records, the loss on the replies.
Data without such chats is refused before launch (``tools/preflight.py``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron_rl.config.schema import Config
from megatron_rl.data.prompts import PromptSampler, PromptSet, servable_demonstration
from megatron_rl.data.tokenizer import Tokenizer
from megatron_rl.distributed import faults
from megatron_rl.distributed.metrics import reduce_sums
from megatron_rl.engine.forward import BatchPlan, run_sequences
from megatron_rl.engine.trainable import Trainable, rebuild_optimizer
from megatron_rl.envs.base import observation_ids
from megatron_rl.envs.endpoint import ChatEndpoint
from megatron_rl.envs.tool_calls import CLOSE
from megatron_rl.envs.trajectories import TokenTrace
from megatron_rl.errors import DataError
from megatron_rl.models.heads import logprob_head
from megatron_rl.rollout.engine import RolloutBatch, RolloutEngineBase
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.trainer.experience import response_positions
from megatron_rl.trainer.update import scheduled_updates
from megatron_rl.utils.seeds import derive_seed

_LOG_EVERY = 10


def _targets(prompts: PromptSet, cfg: Config) -> list:
    """The answer of each prompt, or with ``sft_answers=shuffled`` another prompt's (format only)."""
    answers = list(prompts.answers)
    if cfg.trainer.sft_answers == "shuffled":
        gen = torch.Generator().manual_seed(derive_seed(cfg.run.seed, "sft_answers"))
        answers = [answers[j] for j in torch.randperm(len(answers), generator=gen).tolist()]
    return answers


class DemonstrationServer(RolloutEngineBase):
    """The chat endpoint of agent mode with a policy that replies with a demonstration's turns: what it
    records for the demonstrated chat is what it records when the policy replies so to an agent.

    A reply is the turn's text encoded, then EOS unless it ends with ``</tool_call>`` (where the
    endpoint stops a reply that calls tools)."""

    SESSION = "demonstration"

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.replies: list[list[int]] = []
        params = SamplingParams(max_new_tokens=1 << 30, stop_token_ids=(tokenizer.eos_id,))
        self.endpoint = ChatEndpoint(self, tokenizer, params, max_turns=1 << 30)

    def close(self) -> None:
        self.endpoint.close()

    def generate(self, contexts, params, seed) -> RolloutBatch:
        """The engine's side: the next demonstrated reply (the endpoint asks one at a time)."""
        ids = self.replies.pop(0)
        return RolloutBatch([0], [list(contexts[0])], [ids], [[0.0] * len(ids)], ["stop"])

    def serve(self, chat: list[dict], demonstration: list[dict],
              tools: Optional[list] = None) -> tuple[list[int], list[int], list[int]]:
        """``(prompt ids, response ids, loss mask)`` the endpoint records when an agent sends ``chat``
        (with the record's ``tools``, as the agent would pass them), then each message of
        ``demonstration`` that is not the assistant's, after the reply before it."""
        self.endpoint.reset()
        offered = {"tools": tools} if tools else {}
        self.replies = [self._reply_ids(m["content"]) for m in demonstration if m["role"] == "assistant"]
        messages = [dict(m) for m in chat]
        for message in demonstration:
            if message["role"] != "assistant":
                messages.append(dict(message))
                continue
            _, reply = self.endpoint.complete({"messages": messages, "session_id": self.SESSION, **offered})
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
        (served,) = self.endpoint.trajectories([self.SESSION])
        return served["prompt_ids"], served["response_ids"], served["mask"]

    def _reply_ids(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        return ids if text.endswith(CLOSE) else ids + [self.tokenizer.eos_id]


def _served(i: int, prompts: PromptSet, server: DemonstrationServer) -> tuple[list[int], list[int], list[int]]:
    """Prompt ``i``'s demonstration as the endpoint serves it; a record without one stops the run (the
    check before launch reads the first GiB of a file)."""
    chat = prompts.chats[i] if i < len(prompts.chats) else None
    demonstration = prompts.chat_demonstrations[i] if chat is not None else []
    if not servable_demonstration(demonstration):
        raise DataError("trainer.sft_warmup_steps", None,
                        f"with rollout.agent the warm-up trains on the chat the endpoint serves, and record "
                        f"{prompts.source_index[i]} of {prompts.path} is not a chat ending in a demonstration",
                        "end every 'messages' chat with the assistant's demonstration, or set "
                        "trainer.sft_warmup_steps=0")
    return server.serve(chat, demonstration, prompts.record_fields([i])[0].get("tools"))


def _batch(indices: list[int], prompts: PromptSet, answers: list, tokenizer: Tokenizer,
           make_env: Optional[Callable] = None,
           server: Optional[DemonstrationServer] = None) -> tuple[list[dict], float]:
    """Sequences with a loss mask on the positions that predict the policy's tokens (answer + EOS, or
    a demonstration's turns), and their token count."""
    seqs, total = [], 0
    for i in indices:
        prompt = prompts.prompt_ids[i]
        if server is not None:
            prompt, response, policy = _served(i, prompts, server)
        elif make_env is not None and prompts.demonstrations:
            response, policy = _demonstrated(prompts.demonstrations[i], make_env, tokenizer)
        else:
            response = tokenizer.encode(answers[i] or "") + [tokenizer.eos_id]
            policy = [1] * len(response)
        tokens = torch.tensor(prompt + response)
        mask = torch.zeros(len(tokens))
        mask[response_positions(len(prompt), len(response))] = torch.tensor(policy, dtype=mask.dtype)
        seqs.append({"tokens": tokens, "loss_mask": mask})
        total += sum(policy)
    return seqs, float(total)


def _demonstrated(turns: list[str], make_env: Callable, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:
    """The response ids of a demonstration stepped through a fresh environment, and its policy mask."""
    env = make_env()
    env.reset({})
    trace = TokenTrace(prompt=[])  # the record a rollout keeps (no log-probs here)
    for k, text in enumerate(turns):
        ids = tokenizer.encode(text) + ([tokenizer.eos_id] if k + 1 == len(turns) else [])
        trace.add_turn(ids, [0.0] * len(ids))
        if k + 1 < len(turns):
            trace.add_observation(observation_ids(env.step(text, ids).observation, tokenizer.encode))
    return trace.response, trace.mask


def _nll(total_tokens: float) -> Callable:
    """Next-token loss of the masked positions for ``run_sequences``, divided by the step's token count."""

    def loss_fn(outs, t, mb):
        loss = -(outs["logprob"] * t["loss_mask"]).sum() / total_tokens
        return loss, {"sft/loss": loss.detach()}

    return loss_fn


def sft_warmup(actor: Trainable, prompts: PromptSet, tokenizer: Tokenizer, cfg: Config, plan: BatchPlan, device,
               log: Callable[[str], None], make_env: Optional[Callable] = None) -> Trainable:
    """Run ``trainer.sft_warmup_steps`` supervised steps on ``actor``'s weights (``make_env``: the
    environment demonstrations are stepped through).

    Returns the actor with a rebuilt optimizer and schedule for RL; ``actor``'s optimizer is dead
    afterwards, so whoever keeps the actor (offloaders, checkpoint parts) must take the returned one.
    """
    sampler = PromptSampler(prompts, cfg.trainer.prompts_per_step, derive_seed(cfg.run.seed, "sft_prompts"), True)
    answers = _targets(prompts, cfg)
    head = logprob_head(cfg, temperature=1.0, with_entropy=False)
    server = DemonstrationServer(tokenizer) if cfg.rollout.agent else None
    try:
        _steps(actor, sampler, prompts, answers, tokenizer, cfg, plan, device, log, make_env, server, head)
    finally:
        if server is not None:
            server.close()
    return rebuild_optimizer(actor.chunks, cfg.actor.optim, scheduled_updates(cfg))


def _steps(actor: Trainable, sampler: PromptSampler, prompts: PromptSet, answers: list, tokenizer: Tokenizer,
           cfg: Config, plan: BatchPlan, device, log: Callable[[str], None], make_env: Optional[Callable],
           server: Optional[DemonstrationServer], head) -> None:
    steps = cfg.trainer.sft_warmup_steps
    for step in range(steps):
        faults.maybe_inject(step + 1, phase="sft")
        seqs, total = _batch(sampler.next_batch(), prompts, answers, tokenizer, make_env, server)
        actor.zero_grad()
        _, logs = run_sequences(actor.chunks, seqs, head, plan, device, loss_fn=_nll(total), forward_only=False)
        # Every step: the actor's scheduler sets the RL schedule's rate after each step it takes.
        for group in actor.optimizer.param_groups:
            group["lr"] = cfg.trainer.sft_lr
        actor.step()
        loss = reduce_sums(logs, ["sft/loss"])["sft/loss"]
        if step == 0 or (step + 1) % _LOG_EVERY == 0 or step + 1 == steps:
            log(f"sft warm-up {step + 1}/{steps}  loss {loss:.4f}")
