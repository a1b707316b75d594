"""Every layout ``megatron-rl plan`` proposes passes ``megatron-rl validate``: the planner's search and
the checks before launch read one rule table (megatron_rl/layout/rules.py), so a plan never
suggests a layout the launch refuses -- over dense, GQA and MoE models, FFN sizes that only some
TP sizes divide, and 1 to 16 GPUs."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.config.loader import load_config
from megatron_rl.config.schema import ModelConfig, MoEConfig
from megatron_rl.errors import ConfigError
from megatron_rl.planner.search import plan, preset
from megatron_rl.validation import validate

PROMPT, RESPONSE = 512, 512

ODD_FFN = ModelConfig(num_layers=12, hidden_size=1024, ffn_hidden_size=2732, num_attention_heads=16,
                      num_query_groups=8, vocab_size=32000)  # 2732: TP 1, 2, 4 divide it, 8 does not
ODD_MOE = ModelConfig(num_layers=8, hidden_size=1024, ffn_hidden_size=2730, num_attention_heads=16,
                      num_query_groups=4, vocab_size=32000,
                      moe=MoEConfig(num_experts=8, router_topk=2, ffn_hidden_size=1366))  # 2730, 1366: only TP 2

MODELS = {
    "dense small": preset("qwen2.5-0.5b"),
    "dense large": preset("llama3-70b"),
    "GQA": preset("llama3-8b"),
    "odd FFN": ODD_FFN,
    "MoE": preset("qwen3-30b-a3b"),
    "odd MoE": ODD_MOE,
}
GPUS = (1, 2, 4, 8, 16)


BASE = load_config(None, [f"data.max_prompt_tokens={PROMPT}", f"rollout.max_new_tokens={RESPONSE}"])


def _set(node, path: list[str], value):
    head, *rest = path
    return dataclasses.replace(node, **{head: _set(getattr(node, head), rest, value) if rest else value})


def _config(model: ModelConfig, settings: dict):
    """The base config with ``model`` and every key the plan decides, as a user writes them into one."""
    cfg = dataclasses.replace(BASE, model=model)
    for key, value in settings.items():
        cfg = _set(cfg, key.split("."), value)
    return cfg


@pytest.mark.parametrize("name", list(MODELS))
def test_every_planned_layout_passes_validation(name):
    model, refused, checked = MODELS[name], {}, set()
    for gpus in GPUS:
        nodes, per_node = (gpus // 8, 8) if gpus > 8 else (1, gpus)
        result = plan(model, prompt_len=PROMPT, response_len=RESPONSE, nodes=nodes, gpus_per_node=per_node,
                      gpu_memory_gib=80, with_critic=False, search_nodes=0)
        assert result.candidates, (name, gpus)
        for candidate in result.candidates:
            settings = candidate.settings(with_critic=False)
            if not candidate.fits:  # it generates nothing: no batch size is proposed for it
                del settings["rollout.max_batch_size"]
            if (gpus, repr(settings)) in checked:
                continue
            checked.add((gpus, repr(settings)))
            try:
                validate(_config(model, settings), world_size=gpus)
            except ConfigError as err:
                refused.setdefault(str(err), (gpus, candidate.overrides(with_critic=False)))
    assert not refused, "\n".join(f"{gpus} GPUs {' '.join(o)}: {err}" for err, (gpus, o) in refused.items())
