"""Environments: multi-turn trajectories, tools, observation masking and their limits."""

from __future__ import annotations

from megatron_rl.features.base import PLANNED, TESTED_CPU, Feature, Measured, need
from megatron_rl.layout.sizes import ParallelLayout

AREA = "environments"


def _env(c) -> bool:
    return c.rollout.multi_turn


def _generator_ranks(c) -> int:
    """Ranks one generator (model replica) spans where the rollout runs."""
    lay = ParallelLayout.for_rollout(c.rollout.layout, c.parallel)
    return lay.tp * lay.pp


FEATURES = [
    Feature(
        "Multi-turn environments (rollout.env)", "environments", TESTED_CPU,
        "A class with reset(record) and step(turn_text, turn_ids) -> Turn(observation, reward, done), one instance per "
        "trajectory, named as 'module:Class' (or a built-in) and built once before launch; trajectories advance turn "
        "by turn through the rollout engine, the environments of one round answering at once in a thread pool; the "
        "score is reward.fn's grade of the last policy turn plus the environment's rewards.",
        ("tests/test_environments.py::test_a_trajectory_is_token_in_token_out_with_the_policy_mask",
         "tests/test_environments.py::test_a_multi_turn_job_trains_and_logs_env_metrics",
         "tests/test_environments.py::test_a_bad_environment_is_refused_before_launch"),
        constraints=(
            need("rollout.agent", lambda c, w: not (c.rollout.env and c.rollout.agent),
                 "an environment and an outside agent would both drive the same trajectories",
                 "set one of rollout.env and rollout.agent", "one driver of trajectories", when=_env),
            need("rollout.env", lambda c, w: _generator_ranks(c) == 1,
                 "each generator runs its own environments, so a generator must be one rank (tensor x pipeline "
                 "size 1 where it generates): ranks sharing a model would have to agree on every tool result",
                 "generate with rollout.layout.tp=1 and rollout.layout.pp=1 (or train with parallel.tp=parallel.pp=1); "
                 "data and context parallelism are fine", "one-rank generators", when=_env),
            need("algorithm.overlong_buffer", lambda c, w: not c.algorithm.overlong_buffer,
                 "the overlong penalty reads a response's length against rollout.max_new_tokens, which a trajectory of "
                 "several turns and observations is not measured by", "set algorithm.overlong_buffer=0 (bound "
                 "trajectories with rollout.max_trajectory_tokens)", "no overlong penalty", when=_env),
            need("rollout.max_trajectory_tokens",
                 lambda c, w: c.rollout.max_trajectory_tokens > c.data.max_prompt_tokens,
                 "leaves no room for a turn after the longest prompt "
                 "(data.max_prompt_tokens={c.data.max_prompt_tokens})",
                 "raise rollout.max_trajectory_tokens above data.max_prompt_tokens", "room for a turn", when=_env),
        ),
        config="rollout.env, rollout.env_kwargs",
    ),
    Feature(
        "Tool calling (Hermes / Qwen <tool_call> JSON)", "environments", TESTED_CPU,
        "rollout.env=tool_calling: a turn ends at EOS or </tool_call>; every call runs a registered Python tool "
        "(built-in: calculator; or tools: {name: 'module:function'}); a call that does not parse, an unknown tool, a "
        "tool that raises or overruns answers 'error: ...' as the observation (counted, never a crash); results come "
        "back in the plain or Qwen chat format (observation_format).",
        ("tests/test_environments.py::test_tool_calls_are_parsed_and_bad_ones_become_observations",
         "tests/test_environments.py::test_a_multi_turn_job_trains_and_logs_env_metrics"),
        config="rollout.env=tool_calling, rollout.env_kwargs.tools",
    ),
    Feature(
        "Observation masking (token-in-token-out)", "environments", TESTED_CPU,
        "The trainer trains on exactly the ids the engine sampled; observations are tokenized once and appended; "
        "their tokens carry no loss and no gradient (their log-probs, advantages and old log-probs cannot change the "
        "update), the result equals the same trajectory with them dropped from the loss by hand; the sequence reward "
        "sits on the policy's last token.",
        ("tests/test_environments.py::test_a_trajectory_is_token_in_token_out_with_the_policy_mask",
         "tests/test_environments.py::test_observation_tokens_carry_no_gradient"),
        config="rollout.env",
    ),
    Feature(
        "Trajectory limits and tool time bounds", "environments", TESTED_CPU,
        "rollout.max_turns, rollout.max_trajectory_tokens (prompt + turns + observations; the sequence length of the "
        "planner and token budgets), rollout.tool_timeout_s per call in a worker process working in a scratch "
        "directory without network; a trajectory at a limit ends where it stands, graded or scored 0 "
        "(rollout.on_limit); env/max_turns_frac, env/max_tokens_frac, env/tool_timeouts are logged.",
        ("tests/test_environments.py::test_each_limit_ends_the_trajectory_and_is_counted",
         "tests/test_environments.py::test_tools_run_bounded_in_a_sandbox_without_network"),
        config="rollout.max_turns, rollout.max_trajectory_tokens, rollout.tool_timeout_s, rollout.on_limit",
    ),
    Feature(
        "Multi-turn trajectories with context parallelism", "environments", TESTED_CPU,
        "Trajectories are packed, token-budgeted and sharded over CP ranks like long responses; with observations in "
        "the middle of a sequence, CP=2 and CP=4 losses and gradients equal CP=1's within 1e-5.",
        ("tests/test_environments.py::test_multi_turn_masks_train_the_same_at_cp2_and_cp4",),
        config="rollout.env with parallel.cp",
    ),
    Feature(
        "Multi-turn on generator ranks (one_step_off, async)", "environments", TESTED_CPU,
        "With rollout.ranks the generators run the environments (or serve the agents); requests carry each prompt's "
        "record, results the masks and what the environment reported; one_step_off trains exactly what the "
        "colocated mode trains.",
        ("tests/test_environments.py::test_multi_turn_on_a_generator_rank_trains_what_the_colocated_mode_trains",),
        config="rollout.env with rollout.ranks, trainer.mode",
    ),
    Feature(
        "Multi-turn on generators spanning several ranks", "environments", PLANNED,
        "Environments with TP or PP where the rollout runs (the ranks of one model would have to agree on every "
        "tool result); refused before launch today.",
    ),
    Feature(
        "OpenAI-compatible endpoint for outside agents (rollout.agent)", "environments", TESTED_CPU,
        "POST /v1/chat/completions served by the rollout engine (concurrent requests generated together), sessions "
        "by session_id; each session records the exact ids and log-probs served, later messages rendered once after "
        "the last reply (never the reply again), an edited history refused; rollout.agent=module:function runs an "
        "outside agent per sample in a worker process bounded by rollout.agent_timeout_s and trains on its sessions. "
        "As the openai SDK drives it: stream=True (server-sent chunks, tool-call deltas), tools rendered through the "
        "chat template, tool_choice auto/none, every request field honoured or refused by name, OpenAI-shaped "
        "errors for malformed HTTP requests.",
        ("tests/test_environments.py::test_the_endpoint_serves_two_tool_turns_and_records_the_exact_ids",
         "tests/test_environments.py::test_an_agent_job_trains_on_what_the_endpoint_served",
         "tests/test_environments.py::test_the_endpoint_and_agents_stop_at_their_limits",
         "tests/test_endpoint_clients.py::test_streamed_replies_equal_the_non_streamed_ones_and_the_trajectory_is_token_exact",
         "tests/test_endpoint_clients.py::test_hf_chat_templates_render_tools_as_transformers_does",
         "tests/test_endpoint_clients.py::test_each_request_field_is_honoured_or_refused_by_name",
         "tests/test_endpoint_clients.py::test_malformed_requests_get_openai_shaped_errors_and_nothing_on_stderr"),
        config="rollout.agent, rollout.agent_timeout_s",
    ),
    Feature(
        "Agent mode: sessions reached, warm-up on served chats, the SDK journey", "environments", TESTED_CPU,
        "A sample whose agent never named its session (plain SDK use without user= / extra_body) is counted "
        "(env/agent_no_reply, env/agent_stray_sessions) and warned about once with the fix; a step where no agent "
        "did stops the job (exit 2). trainer.sft_warmup_steps with rollout.agent trains on the ids the endpoint "
        "serves for each record's demonstrated chat (its tools column offered), or is refused before launch. An "
        "openai-SDK agent streaming with tools runs its tool loop over GRPO steps end to end.",
        ("tests/test_agent_mode.py::test_train_stops_when_no_agent_named_its_session_and_warns_when_half_did",
         "tests/test_agent_mode.py::test_the_agent_warm_up_trains_on_the_ids_the_endpoint_serves_for_the_demonstration",
         "tests/test_agent_mode.py::test_an_agent_warm_up_without_chat_demonstrations_is_refused_before_launch",
         "tests/test_agent_mode.py::test_an_openai_sdk_agent_streaming_with_tools_trains_through_a_tool_loop"),
        config="rollout.agent, trainer.sft_warmup_steps",
    ),
    Feature(
        "Multi-turn generate (evaluate a checkpoint on an environment)", "environments", TESTED_CPU,
        "megatron-rl generate with rollout.env (or rollout.agent): each input line is the environment's record; "
        "rows carry response_mask, turns, limit and the environment's reward.",
        ("tests/test_environments.py::test_a_multi_turn_job_trains_and_logs_env_metrics",),
        config="megatron-rl generate ... rollout.env=...",
    ),
    Feature(
        "A tool-use task that learns (task:tool_mul, configs/tool_calling_cpu.yaml)", "environments", TESTED_CPU,
        "Two-digit products a tiny model cannot compute without the calculator; the warm-up steps the environment "
        "through each prompt's demonstration (observations masked), then GRPO raises the share of exact answers.",
        ("tests/test_environments.py::test_grpo_with_the_calculator_tool_raises_the_reward",
         "tests/test_sft.py::test_a_demonstration_is_stepped_through_the_environment_with_its_observation_masked"),
        config="data.train_path=task:tool_mul, rollout.env=tool_calling",
        measured=(Measured("reward 0.459 (first 5 steps) -> 0.703 (last 5 of 30), 0.99 tool calls per trajectory",
                           "megatron-rl train --config configs/tool_calling_cpu.yaml"),),
    ),
]
