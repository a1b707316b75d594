"""Multi-turn environments: token-in-token-out trajectories, the policy mask, limits, tools, and
training on multi-turn masks (no gradient through observations; CP parity)."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from megatron_rl.config.schema import ModelConfig
from megatron_rl.envs.base import Turn, environment_factory
from megatron_rl.envs.tool_calls import parse_tool_calls
from megatron_rl.envs.tool_env import ToolCallingEnv
from megatron_rl.envs.tools import ToolTimeout, call_tool, calculator
from megatron_rl.envs.trajectories import MAX_TOKENS, MAX_TURNS, EnvironmentRollout, TrajectoryLimits, env_metrics
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.decoder import random_canonical
from megatron_rl.rollout.engine import make_engine
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.trainer.experience import Samples, token_rewards_from_scores
from tests.support.envs import OBSERVATION, ScriptedEnv

MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             vocab_size=64, params_dtype="float32", transformer_impl="local", max_position_embeddings=128)
PROMPTS = [[2, 5, 17, 3], [2, 9, 12, 44, 61, 7]]
EOS = 1


def _engine():
    cfg = ModelConfig(**MODEL)
    engine = make_engine("torch", cfg, "cpu")
    engine.load_weights(random_canonical(cfg, 0, std=0.2))
    return engine


def _rollout(make_env, max_turns=4, max_tokens=100, zero=False, engine=None):
    return EnvironmentRollout(engine or _engine(), make_env, encode=lambda s: [4 + ord(c) % 50 for c in s],
                              decode=lambda ids: "".join(chr(97 + i % 26) for i in ids),
                              limits=TrajectoryLimits(max_turns, max_tokens, zero))


def _full_forward_logprobs(engine, prompt, response, temperature):
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = engine.model(seq, torch.arange(seq.size(1))[None])[0]
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
    return ref.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_a_trajectory_is_token_in_token_out_with_the_policy_mask():
    """Every turn's ids are the engine's, observations are appended as given, the mask is 1 exactly on
    the policy's tokens, and each policy token's log-prob is the full forward's over the whole
    trajectory (so the engine saw exactly the ids the trainer will train on)."""
    engine = _engine()
    rollout = _rollout(lambda: ScriptedEnv(turns=3), engine=engine)
    params = SamplingParams(temperature=0.8, max_new_tokens=5, n=2, stop_token_ids=(EOS,))
    batch = rollout.generate(PROMPTS, params, seed=3)
    assert len(batch) == 4 and batch.prompt_index == [0, 0, 1, 1]
    worst, turns_seen = 0.0, []
    for k in range(len(batch)):
        resp, mask, logp, info = (batch.response_ids[k], batch.response_mask[k], batch.response_logprobs[k],
                                  batch.env_info[k])
        assert len(resp) == len(mask) == len(logp)
        # Walk the trajectory: policy runs (mask 1) separated by exactly OBSERVATION (mask 0).
        policy_runs, i = [], 0
        while i < len(resp):
            j = i
            while j < len(resp) and mask[j] == 1:
                j += 1
            policy_runs.append(resp[i:j])
            if j < len(resp):
                assert resp[j : j + len(OBSERVATION)] == OBSERVATION
                assert mask[j : j + len(OBSERVATION)] == [0] * len(OBSERVATION)
                assert logp[j : j + len(OBSERVATION)] == [0.0] * len(OBSERVATION)
                j += len(OBSERVATION)
            i = j
        assert info["turns"] == len(policy_runs)
        assert info["final_turn"] == [len(resp) - len(policy_runs[-1]), len(resp)]
        turns_seen.append(info["turns"])
        # 0.25 per environment step: every turn was answered, the last (ending at EOS or done) too.
        assert info["env_reward"] == pytest.approx(0.25 * info["turns"])
        ref = _full_forward_logprobs(engine, batch.prompt_ids[k], resp, 0.8)
        policy = torch.tensor(mask, dtype=torch.bool)
        worst = max(worst, float((ref[policy] - torch.tensor(logp)[policy]).abs().max()))
    print(f"turns {turns_seen}; max |engine log-prob - full forward over the trajectory| = {worst:.2e}")
    assert worst <= 1e-5
    assert max(turns_seen) == 3  # the environment ended them (no EOS in 3 turns for most)
    assert all(r in ("stop", "length") for r in batch.finish_reason)
    # The same seed gives the same trajectories.
    again = rollout.generate(PROMPTS, params, seed=3)
    assert again.response_ids == batch.response_ids and again.response_mask == batch.response_mask

    # The trainer's view: the mask, and the sequence reward on the policy's last token.
    samples = Samples.from_rollout(batch, [0, 1])
    mask = samples.response_mask()
    for k, m in enumerate(batch.response_mask):
        assert mask[k, : len(m)].tolist() == [float(x) for x in m]
    rewards = token_rewards_from_scores(torch.ones(len(batch)), mask)
    for k, m in enumerate(batch.response_mask):
        last_policy = max(i for i, x in enumerate(m) if x)
        assert rewards[k].nonzero().flatten().tolist() == [last_policy]


def test_each_limit_ends_the_trajectory_and_is_counted():
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, stop_token_ids=())
    # max_turns: the environment never says done.
    batch = _rollout(lambda: ScriptedEnv(turns=99), max_turns=2).generate(PROMPTS, params, seed=1)
    assert batch.finish_reason == [MAX_TURNS] * 4
    assert [i["turns"] for i in batch.env_info] == [2] * 4
    assert [i["limit"] for i in batch.env_info] == [MAX_TURNS] * 4
    # Two full turns, one observation between them (the one after the last turn is never appended).
    assert [len(r) for r in batch.response_ids] == [4 + len(OBSERVATION) + 4] * 4
    # max_tokens: prompt + turns + observations never pass the limit; the turn is cut at it.
    limit = 12
    batch = _rollout(lambda: ScriptedEnv(turns=99), max_turns=10, max_tokens=limit).generate(PROMPTS, params, seed=1)
    for k in range(len(batch)):
        assert len(batch.prompt_ids[k]) + len(batch.response_ids[k]) <= limit
        assert batch.env_info[k]["limit"] == MAX_TOKENS
    # prompt 0 (4 tokens): turn 4 + obs 3 -> 11, then a 1-token turn fills the room.
    assert [len(r) for r in batch.response_ids[:2]] == [8, 8]
    # prompt 1 (6 tokens): turn 4 -> 10, the observation would reach 13 > 12: not appended.
    assert [len(r) for r in batch.response_ids[2:]] == [4, 4]
    assert batch.finish_reason == [MAX_TOKENS] * 4
    # on_limit=zero marks them; the metrics count each limit.
    zeroed = _rollout(lambda: ScriptedEnv(turns=99), max_turns=1, zero=True).generate(PROMPTS, params, seed=1)
    assert all(i["zero_at_limit"] for i in zeroed.env_info)
    from megatron_rl.envs.trajectories import trajectory_scores

    assert trajectory_scores(zeroed, torch.ones(4)).tolist() == [0.0] * 4
    metrics = env_metrics(Samples.from_rollout(batch, [0, 1]))
    assert metrics["env/max_tokens_frac"] == 1.0 and metrics["env/max_turns_frac"] == 0.0
    assert metrics["env/observation_tokens_mean"] == pytest.approx(1.5)  # prompt 0's two samples have one
    # A tool that overruns its bound is killed and answered with an error observation, counted.
    env = ToolCallingEnv(tools={"slow": "tests.support.envs:slow_tool"}, timeout_s=0.5)
    start = time.monotonic()
    turn = env.step('<tool_call>{"name": "slow", "arguments": {"seconds": 30}}</tool_call>', [])
    assert time.monotonic() - start < 10
    assert "timed out after 0.5 s" in turn.observation and turn.info["tool_timeouts"] == 1 and not turn.done


def test_tool_calls_are_parsed_and_bad_ones_become_observations():
    calls = parse_tool_calls('think <tool_call>{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}'
                             '</tool_call> and <tool_call>{"name": "calculator", "arguments": "{\\"expression\\": '
                             '\\"2**10\\"}"}</tool_call><tool_call>{oops</tool_call><tool_call>[1]</tool_call>')
    assert [c.name for c in calls[:2]] == ["calculator", "calculator"]
    assert calls[0].arguments == {"expression": "12*(3+4)"} and calls[1].arguments == {"expression": "2**10"}
    assert "not JSON" in calls[2].error and "needs" in calls[3].error
    assert parse_tool_calls("no call here") == []
    assert calculator("12*(3+4)") == "84" and calculator("7/2") == "3.5" and calculator("-(2**10)") == "-1024"
    with pytest.raises(ValueError):
        calculator("__import__('os')")
    env = ToolCallingEnv(timeout_s=5.0)
    env.reset({})
    turn = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>', [])
    assert turn.observation == "\ntool: 1776\nassistant: " and not turn.done and turn.info["tool_calls"] == 1
    turn = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
                    '<tool_call>{"name": "search", "arguments": {}}</tool_call><tool_call>{bad}</tool_call>', [])
    lines = turn.observation.split("\n")[1:-1]
    assert lines[0].startswith("tool: error: ZeroDivisionError") and "unknown tool 'search'" in lines[1]
    assert "not JSON" in lines[2]
    assert (turn.info["tool_errors"], turn.info["tool_parse_errors"]) == (2, 1)
    assert env.step("the answer is 1776", []).done
    qwen = ToolCallingEnv(observation_format="qwen", timeout_s=5.0).step(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>', [])
    assert qwen.observation.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response>")


def test_tools_run_bounded_in_a_sandbox_without_network():
    where = call_tool("tests.support.envs:where_tool", {}, timeout_s=30)
    assert os.path.basename(where).startswith("megatron_rl_tool_") and where != os.getcwd()
    with pytest.raises(Exception, match="without network access"):
        call_tool("tests.support.envs:network_tool", {}, timeout_s=30)
    start = time.monotonic()
    with pytest.raises(ToolTimeout):
        call_tool("tests.support.envs:slow_tool", {"seconds": 30}, timeout_s=0.5)
    assert time.monotonic() - start < 10
    assert call_tool("megatron_rl.envs.tools:calculator", {"expression": "6*7"}, timeout_s=30) == "42"


def test_environment_factory_refuses_what_cannot_run():
    with pytest.raises(ConfigError, match="rollout.env=nope.module:Env: cannot import"):
        environment_factory("nope.module:Env")
    with pytest.raises(ConfigError, match="not a built-in environment"):
        environment_factory("calculator")
    with pytest.raises(ConfigError, match="not a class with reset"):
        environment_factory("tests.support.envs:slow_tool")
    with pytest.raises(ConfigError, match="rollout.env_kwargs"):
        environment_factory("tests.support.envs:ScriptedEnv", {"colour": "red"})
    make = environment_factory("tool_calling", {"tools": ["calculator"]}, defaults={"timeout_s": 1.5})
    assert make().timeout_s == 1.5 and make() is not make()
    assert isinstance(Turn(), Turn)
