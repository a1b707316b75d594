"""Agent mode (``rollout.agent``): samples whose agent never reached its session are counted, warned
about and, when a whole step has none, stop the job; the SFT warm-up trains on what the endpoint
serves."""

from __future__ import annotations

import pytest

from megatron_rl.config.schema import ModelConfig
from megatron_rl.errors import DataError
from megatron_rl.rollout.engine import RolloutEngineBase
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.testing.weights import random_canonical
from tests.support.decoder import TorchRolloutEngine
from tests.support.helpers import TINY, read_metrics

MODEL = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
             vocab_size=64, params_dtype="float32", transformer_impl="local", max_position_embeddings=128)
AGENT_RUN = ["rollout.max_new_tokens=4", "rollout.max_turns=3", "rollout.max_trajectory_tokens=100",
             "model.max_position_embeddings=128", "trainer.steps=2"]
FIX = 'extra_body={"session_id": session_id}'


def _engine():
    cfg = ModelConfig(**MODEL)
    engine = TorchRolloutEngine(cfg, "cpu")
    engine.load_weights(random_canonical(cfg, 0, std=0.2))
    return engine


def test_samples_whose_agent_named_no_session_are_counted_with_the_stray_sessions():
    """An agent (the openai SDK) that names its session for one sample of each prompt: the other
    sample has no reply, and its request is a stray session of the endpoint."""
    from megatron_rl.data.tokenizer import CharTokenizer
    from megatron_rl.envs.agent import AgentRollout
    from megatron_rl.envs.trajectories import TrajectoryLimits

    tokenizer = CharTokenizer()
    params = SamplingParams(max_new_tokens=3, n=2, stop_token_ids=(tokenizer.eos_id,))
    rollout = AgentRollout(_engine(), tokenizer, "tests.support.envs:sdk_agent_reaching_half",
                           TrajectoryLimits(3, 100), 60.0)
    try:
        batch = rollout.generate([[2, 5], [2, 6]], params, seed=3, records=[{"prompt": "1+1="}, {"prompt": "2+2="}])
    finally:
        rollout.close()
    assert [i["agent_no_reply"] for i in batch.env_info] == [0, 1, 0, 1]
    assert [i["turns"] for i in batch.env_info] == [1, 0, 1, 0]
    # 2 stray sessions over 4 samples, spread evenly so that any subset of the samples keeps the rate
    assert [i["agent_stray_sessions"] for i in batch.env_info] == [0.5] * 4


def test_a_step_no_agent_reached_stops_and_one_some_missed_warns_once():
    from megatron_rl.trainer.reward_signal import AgentSessions

    lines: list[str] = []
    sessions = AgentSessions("my.agents:solve", lines.append)
    reached = {"agent_no_reply": 0, "agent_stray_sessions": 0.5}
    missed = {"agent_no_reply": 1, "agent_stray_sessions": 0.5}
    for _ in range(3):
        sessions.check([reached, missed, reached, missed])
    assert len(lines) == 1, lines
    assert lines[0].startswith("warning: rollout.agent=my.agents:solve: 2 of this step's 4 samples never reached "
                               "their session (the endpoint served 2 sessions that belong to no sample)")
    assert FIX in lines[0] and "user=session_id" in lines[0]
    with pytest.raises(DataError) as info:
        sessions.check([missed] * 4)
    line = info.value.one_line()
    assert line.startswith("data error: rollout.agent=my.agents:solve: none of this step's 4 samples reached its "
                           "session (the endpoint served 2 sessions that belong to no sample)")
    assert FIX in line and "\n" not in line
    AgentSessions("", lines.append).check([missed] * 4)  # not agent mode: nothing to check
    AgentSessions("my.agents:solve", lines.append).check([])


@pytest.mark.slow
def test_train_stops_when_no_agent_named_its_session_and_warns_when_half_did(tmp_path):
    from megatron_rl.testing.cli_runner import timed_cli as cli  # a process, without the import of one

    proc, seconds = cli("train", *TINY, *AGENT_RUN, "rollout.agent=tests.support.envs:sdk_agent_without_session_id",
                        f"run.dir={tmp_path}", "run.name=none")
    print(f"no session id: exit {proc.returncode} in {seconds:.1f}s")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("data error: rollout.agent=tests.support.envs:sdk_agent_without_session_id: none of "
                           "this step's 8 samples reached its session") and FIX in last, last

    proc, seconds = cli("train", *TINY, *AGENT_RUN, "rollout.agent=tests.support.envs:sdk_agent_reaching_half",
                        f"run.dir={tmp_path}", "run.name=half")
    print(f"half: exit {proc.returncode} in {seconds:.1f}s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "never reached their session" in line]
    assert len(warnings) == 1 and FIX in warnings[0], proc.stderr[-3000:]
    for m in read_metrics(tmp_path / "half"):
        assert m["env/agent_no_reply"] == 0.5 and m["env/agent_stray_sessions"] == 0.5


# ------------------------------------------------------------------ the SFT warm-up in agent mode

JOURNEY_WARMUP = 100  # warm-up steps (at JOURNEY_SFT_LR) after which the tiny model writes calculator calls
JOURNEY_SFT_LR = 0.003
TOOL_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=#.,:?()<>_{}\"\n"


def _call(expression: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expression + '"}}</tool_call>'


def _demonstrated_chat() -> list[dict]:
    return [{"role": "user", "content": "what is 12*3+4?"},
            {"role": "assistant", "content": _call("12*3")}, {"role": "tool", "content": "36"},
            {"role": "assistant", "content": _call("36+4")}, {"role": "tool", "content": "40"},
            {"role": "assistant", "content": "40"}]


def _write_chats(path, chats: list) -> str:
    import json

    path.write_text("".join(json.dumps({"messages": chat, "answer": "40"}) + "\n" for chat in chats))
    return str(path)


class _Policy(RolloutEngineBase):
    """A rollout engine whose replies are given ids, one per call (the policy the test plays)."""

    def __init__(self, replies: list[list[int]]):
        self.replies = list(replies)

    def generate(self, contexts, params, seed):
        from megatron_rl.rollout.engine import RolloutBatch

        ids = self.replies.pop(0)
        return RolloutBatch([0], [list(contexts[0])], [ids], [[0.0] * len(ids)], ["stop"])


def test_the_agent_warm_up_trains_on_the_ids_the_endpoint_serves_for_the_demonstration(tmp_path):
    """A chat record ending in a two-tool-call demonstration: the warm-up sequence is, token for token,
    what the endpoint records when an agent (the openai SDK, over HTTP) sends the record's messages and
    the policy replies with the demonstration's turns; the loss is exactly on the served replies."""
    from openai import OpenAI

    from megatron_rl.data.prompts import load_prompts
    from megatron_rl.data.tokenizer import CharTokenizer
    from megatron_rl.envs.endpoint import ChatEndpoint
    from megatron_rl.trainer.sft import DemonstrationServer, _batch

    tokenizer = CharTokenizer(TOOL_ALPHABET)
    chat = _demonstrated_chat()
    prompts = load_prompts(_write_chats(tmp_path / "chats.jsonl", [chat]), tokenizer, 64)
    record = prompts.records([0])[0]
    assert record["messages"] == chat[:1] and prompts.prompt_ids[0] == tokenizer.apply_chat_template(chat[:1])

    server = DemonstrationServer(tokenizer)
    try:
        (seq,), total = _batch([0], prompts, prompts.answers, tokenizer, server=server)
    finally:
        server.close()

    replies = [tokenizer.encode(_call("12*3")), tokenizer.encode(_call("36+4")), tokenizer.encode("40") + [1]]
    params = SamplingParams(max_new_tokens=200, stop_token_ids=(tokenizer.eos_id,))
    endpoint = ChatEndpoint(_Policy(replies), tokenizer, params, max_turns=8)
    try:
        client = OpenAI(base_url=endpoint.base_url, api_key="unused", max_retries=0, timeout=60)
        messages = record["messages"]
        for tool_result in ("36", "40", None):
            reply = client.chat.completions.create(model="megatron_rl", messages=messages, user="s")
            messages = messages + [{"role": "assistant", "content": reply.choices[0].message.content}]
            if tool_result is not None:
                messages.append({"role": "tool", "content": tool_result})
        (served,) = endpoint.trajectories(["s"])
    finally:
        endpoint.close()

    tokens, mask = seq["tokens"].tolist(), seq["loss_mask"].tolist()
    assert tokens == served["prompt_ids"] + served["response_ids"]
    # by hand: the chat template's prompt, each reply as given, each tool message rendered once
    between = [tokenizer.encode(f"\ntool: {r}\nassistant: ") for r in ("36", "40")]
    assert tokens == (tokenizer.apply_chat_template(chat[:1]) + replies[0] + between[0] + replies[1] + between[1]
                      + replies[2])
    # the loss is on the positions that predict the served replies' ids, nowhere else
    n_prompt = len(served["prompt_ids"])
    assert mask == [0.0] * (n_prompt - 1) + [float(m) for m in served["mask"]] + [0.0]
    assert total == sum(served["mask"]) == sum(map(len, replies))


def test_an_agent_warm_up_without_chat_demonstrations_is_refused_before_launch(tmp_path):
    from tests.test_cli import cli

    run = ["train", *TINY, *AGENT_RUN, "rollout.agent=tests.support.envs:two_tool_turns",
           "trainer.sft_warmup_steps=2", f"run.dir={tmp_path}"]
    proc, seconds = cli(*run, "run.name=task")
    print(f"built-in task: exit {proc.returncode} in {seconds:.1f}s")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("config error: trainer.sft_warmup_steps=2: with rollout.agent the warm-up trains on "
                           "the chat the endpoint serves, and data.train_path=task:add_small is a built-in task, "
                           "not 'messages' chats ending in a demonstration"), line
    assert "or set trainer.sft_warmup_steps=0" in line
    assert not (tmp_path / "task").exists()  # refused before any process started

    # the same check before launch (the function the CLI calls), in process: a chats file whose second
    # record has no demonstration
    from megatron_rl.config.loader import load_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.tools.preflight import check_training_inputs

    chats = [_demonstrated_chat(), _demonstrated_chat()[:1]]
    cfg = load_config(None, [*run[1:], f"data.train_path={_write_chats(tmp_path / 'chats.jsonl', chats)}",
                             "data.max_prompt_tokens=64", "run.name=file"])
    with pytest.raises(ConfigError) as info:
        check_training_inputs(cfg)
    line = info.value.one_line()
    assert line.startswith("config error: trainer.sft_warmup_steps=2: with rollout.agent the warm-up trains on "
                           "the chat the endpoint serves") and "\n" not in line, line
    assert f"and {tmp_path / 'chats.jsonl'}:2 is not a 'messages' chat ending in a demonstration" in line, line


@pytest.mark.slow
def test_an_agent_job_warms_up_on_demonstrated_chats(tmp_path):
    from megatron_rl.testing.cli_runner import timed_cli as cli  # a process, without the import of one

    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "add"},
            {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2"}]
    proc, seconds = cli("train", *TINY, *AGENT_RUN, "rollout.agent=tests.support.envs:two_tool_turns",
                        f"data.train_path={_write_chats(tmp_path / 'chats.jsonl', [chat] * 4)}",
                        "data.max_prompt_tokens=32", "trainer.sft_warmup_steps=2", "trainer.steps=1",
                        f"run.dir={tmp_path}", "run.name=warm")
    print(f"agent job with warm-up: exit {proc.returncode} in {seconds:.1f}s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sft warm-up 2/2" in proc.stdout
    assert read_metrics(tmp_path / "warm")[0]["env/agent_no_reply"] == 0


TOOL_TOKENIZER = "char:" + TOOL_ALPHABET


def write_tool_chats(path, count: int, seed: int = 0) -> str:
    """``count`` products in OpenAI chat form: the question, then the demonstration (a calculator
    call, its result, the answer), with the tool's definition in a ``tools`` column."""
    import json
    import random

    from megatron_rl.data.tasks import tool_call_text
    from tests.support.envs import CALCULATOR

    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            a, b = rng.randrange(10, 100), rng.randrange(10, 100)
            messages = [{"role": "user", "content": f"{a}*{b}="},
                        {"role": "assistant", "content": tool_call_text("calculator", {"expression": f"{a}*{b}"})},
                        {"role": "tool", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]
            f.write(json.dumps({"messages": messages, "tools": [CALCULATOR], "answer": str(a * b)}) + "\n")
    return str(path)


def sdk_tool_journey(tmp_path, warmup_steps: int, steps: int, name: str = "journey"):
    """An openai-SDK agent with streaming and tools driving GRPO through the endpoint, after a warm-up
    on the chats the endpoint serves: ``(process, seconds, metrics)``."""
    from megatron_rl.testing.cli_runner import timed_cli as cli  # a process, without the import of one

    data = write_tool_chats(tmp_path / "tool_chats.jsonl", 256)
    proc, seconds = cli(
        "train", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=64",
        "model.max_position_embeddings=512", f"data.tokenizer={TOOL_TOKENIZER}", f"data.train_path={data}",
        "data.max_prompt_tokens=32", "rollout.agent=tests.support.envs:sdk_streaming_tool_agent",
        "rollout.max_turns=3", "rollout.max_new_tokens=96", "rollout.max_trajectory_tokens=480", "rollout.n=4",
        "reward.fn=tests.support.helpers:answer_digits_in_place", "algorithm.advantage=grpo", "algorithm.kl_coef=0.0",
        "algorithm.mini_batches=1",
        "actor.optim.lr=0.0003", "actor.optim.clip_grad=1.0", "trainer.prompts_per_step=8",
        f"trainer.sft_warmup_steps={warmup_steps}", f"trainer.sft_lr={JOURNEY_SFT_LR}", f"trainer.steps={steps}",
        "trainer.plot=false", f"run.dir={tmp_path}", f"run.name={name}", timeout=1800)
    return proc, seconds, (read_metrics(tmp_path / name) if proc.returncode == 0 else [])


@pytest.mark.slow
def test_an_openai_sdk_agent_streaming_with_tools_trains_through_a_tool_loop(tmp_path):
    """The agent as its users write it (openai SDK, stream=True, tools=[...], tool results sent back)
    over GRPO steps: after the warm-up on the served chats, the agent's streamed replies call the
    calculator, the tool results come back as observations, and the run trains on the sessions."""
    proc, seconds, metrics = sdk_tool_journey(tmp_path, warmup_steps=JOURNEY_WARMUP, steps=2)
    print(f"exit {proc.returncode} in {seconds:.1f}s;",
          [{k: round(v, 3) for k, v in m.items() if k.startswith(("env/", "reward/mean"))} for m in metrics])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for m in metrics:
        assert m["env/agent_no_reply"] == 0 and m["env/agent_stray_sessions"] == 0
        assert m["env/turns_mean"] > 1.25  # most trajectories call the tool and answer after its result
        assert m["env/observation_tokens_mean"] > 0
    # the final replies earn partial credit that differs within groups: the steps trained on something
    assert all(m["reward/mean"] > 0 for m in metrics) and any(m["actor/grad_norm"] > 0 for m in metrics)
