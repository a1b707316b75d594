"""benchmarks/vs_trl.py: its workload builder, and a 2-step megatron_rl-only run that fills the table."""

from __future__ import annotations

import json
import math

import pytest

from megatron_rl.testing.benchmarks import load_benchmark

pytest.importorskip("transformers")


def test_workload_builder_writes_model_tokenizer_and_prompts(tmp_path):
    import transformers

    workload = load_benchmark("trl_workload")
    info = workload.build_workload(str(tmp_path), num_prompts=32)
    with open(info["prompts"]) as fh:
        rows = [json.loads(line) for line in fh]
    assert len(rows) == 32 and all(r["prompt"].endswith("=") for r in rows)
    a, b = rows[0]["prompt"][:-1].split("+")
    assert rows[0]["answer"] == str(int(a) + int(b))
    tok = transformers.AutoTokenizer.from_pretrained(info["model_dir"])
    ids = tok(rows[0]["prompt"])["input_ids"]
    assert len(ids) == len(rows[0]["prompt"]) and tok.decode(ids) == rows[0]["prompt"]  # one token per char, no BOS
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == rows[0]["prompt"]
    config = transformers.AutoConfig.from_pretrained(info["model_dir"])
    assert config.model_type == "qwen2" and config.vocab_size == len(tok)
    assert workload.addition_reward(["1+2="] * 4, ["3", "3+", "", "x"], ["3"] * 4) == [1.0, 0.25, 0.0, 0.0]
    assert workload.trl_addition_reward(["1+2="], ["3"], answer=["3"]) == [1.0]


def test_table_ratio_against_trl():
    bench = load_benchmark("vs_trl")
    base = {"step_s": [9.0, 2.0, 2.0], "gen_tok_s": [1.0, 200.0, 200.0], "reward": [0.1, 0.2, 0.3],
            "peak_rss_bytes": 2**30, "peak_pss_bytes": 2**29, "wall_s": 10.0, "load_after": 1.0}
    mega = bench.summarise([dict(base, row="default", label="megatron_rl defaults, nproc 1",
                                timings={"timing/step_s": [9.0, 2.0, 2.0], "timing/rollout_s": [1, 0.5, 0.5],
                                         "timing/experience_s": [1, 0.5, 0.5], "timing/old_logprob_s": [1, 0.4, 0.4],
                                         "timing/actor_update_s": [1, 0.8, 0.8]})], warmup=1)
    trl_run = dict(base, row="trl", label="TRL GRPOTrainer", step_s=[9.0, 1.0, 1.0],
                   trl_phases={"generate": [0, 0.2, 0.2], "reward": [0, 0, 0], "experience": [0, 0.3, 0.3]})
    # Two runs: the steps after the warm-up of both are pooled, the peak is the larger one.
    trl = bench.summarise([trl_run, dict(trl_run, step_s=[9.0, 1.0, 3.0], peak_rss_bytes=2**31)], warmup=1)
    assert trl["step_s"] == [1.0, 1.0, 1.0, 3.0] and trl["round_medians"] == [1.0, 2.0]
    table = bench.format_table([mega, trl], 1, 3, (1.0, 1.0, 1.0), (2.0, 2.0, 2.0), rounds=2)
    assert "| megatron_rl defaults, nproc 1 | 2.000 | 2.000 | 2.000 | 200 | 1024 | 512 | 2.00x |" in table
    assert "| TRL GRPOTrainer | 1.000 | 1.000 2.000 | 1.000 | 200 | 2048 |" in table
    assert "1.00/1.00/1.00 at start" in table
    breakdown = bench.format_breakdown([mega, trl])
    assert "rollout 0.500 (25%)" in breakdown and "old_logprob 0.400 (20%)" in breakdown
    assert "other 0.200 (10%)" in breakdown and "loss+backward+optimizer 0.700 (70%)" in breakdown


@pytest.mark.slow
def test_two_megatron_steps_fill_the_table(tmp_path, capsys, monkeypatch):
    """The whole path of one megatron_rl row: build, launch, read metrics.jsonl, peak RSS, table."""
    bench = load_benchmark("vs_trl")
    monkeypatch.setattr(bench, "have_trl", lambda: False)
    rc = bench.main(["--rows", "tuned,trl", "--steps", "2", "--warmup", "1", "--rounds", "1", "--timeout", "120",
                     "--workdir", str(tmp_path), "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "trl is not installed" in out and "| megatron_rl tuned" in out and "n/a" in out
    (result,) = json.loads((tmp_path / "out.json").read_text())
    assert len(result["runs"][0]["step_s"]) == 2 and len(result["step_s"]) == 1
    assert math.isfinite(result["median_step_s"]) and result["median_step_s"] > 0
    assert result["peak_rss_bytes"] > 50 * 2**20 and math.isfinite(result["median_gen_tok_s"])
