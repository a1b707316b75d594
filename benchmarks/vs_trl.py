"""Time per GRPO step: megatron_rl against Hugging Face TRL's ``GRPOTrainer``, same workload, CPU.

    python benchmarks/vs_trl.py                  # every row, 2 runs of 20 steps each (about 5 min on 2 cores)
    python benchmarks/vs_trl.py --steps 8 --rounds 1     # shorter
    python benchmarks/vs_trl.py --rows default,trl --json out.json
    python benchmarks/vs_trl.py --omp-passive    # a busy shared machine: sleeping, not spinning, OpenMP waits

The workload (:mod:`trl_workload`, built into a temporary directory): a tiny random-init Qwen2
(``save_pretrained``) with a character-level ``PreTrainedTokenizerFast`` beside it, 512 addition
prompts ("12+7=" -> "19") as JSONL, and one reward function both trainers call.  Each step is GRPO
on 16 prompts x 8 samples, at most 4 new tokens, temperature 1, fp32, no KL term (no reference
model), one optimizer step.  The settings given to each trainer are printed before the table.

Rows (``--rows``; each run is its own subprocess, whose process tree's memory is sampled for the
peak; the rows run ``--rounds`` times, interleaved, so that a burst of load from elsewhere on a
shared machine hits every row rather than one):

* ``default``  -- ``megatron-rl train`` with its defaults for everything the workload does not fix;
* ``dynamic``  -- the defaults with ``rollout.batching=dynamic`` (megatron-core's dynamic inference
  engine where the CPU default is its static batching);
* ``nproc2``   -- the same with ``--nproc 2`` (data parallel over 2 gloo ranks);
* ``tuned``    -- the defaults plus ``batch.micro_batch_size=128 rollout.max_batch_size=128``;
* ``unpacked`` -- the defaults plus ``batch.packing=false``;
* ``trl``      -- ``trl.GRPOTrainer`` (``pip install -e .[bench]``), timed by a ``TrainerCallback``
  from ``on_step_begin`` to ``on_step_end``.

megatron_rl's time per step is ``timing/step_s`` from ``<run dir>/metrics.jsonl`` (rollout, reward,
old log-probs and the update; not the console line or the final checkpoint).  The s/step column is
the median over the steps after the first ``--warmup`` of every run.  Without TRL installed the script says so in
one line, runs the megatron_rl rows, and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import trl_workload  # beside this script: sys.path[0] when it runs as one

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 4
TEMPERATURE = 1.0
CLIP = 0.2
GRAD_CLIP = 1.0
SEED = 1234

ALL_ROWS = ("default", "dynamic", "nproc2", "tuned", "unpacked", "trl")
MEGATRON_ROWS = {
    # name: (label, --nproc, extra overrides)
    "default": ("megatron_rl defaults, nproc 1", 1, []),
    "dynamic": ("megatron_rl defaults, rollout.batching=dynamic", 1, ["rollout.batching=dynamic"]),
    "nproc2": ("megatron_rl defaults, nproc 2", 2, []),
    "tuned": ("megatron_rl tuned (mbs 128, rollout batch 128)", 1,
              ["batch.micro_batch_size=128", "rollout.max_batch_size=128"]),
    "unpacked": ("megatron_rl batch.packing=false", 1, ["batch.packing=false"]),
}
TRL_LABEL = "TRL GRPOTrainer"

GENERATED_TOKENS_KEYS = ("throughput/generated_tokens_per_s",)
# megatron_rl's top-level phases of a step (timing/<name>_s); "experience" holds the log-prob passes.
TOP_PHASES = ("weight_sync", "rollout", "reward", "experience", "actor_update", "critic_update")
EXPERIENCE_PHASES = ("old_logprob", "ref_logprob", "values")


def have_trl() -> bool:
    return importlib.util.find_spec("trl") is not None


# ----------------------------------------------------------------------------- settings of both sides


def megatron_overrides(workload: dict, steps: int, lr: float, run_dir: str, run_name: str) -> list[str]:
    """The workload and algorithm settings; every other key keeps megatron_rl's default."""
    return [
        f"model.hf_path={workload['model_dir']}",
        f"data.train_path={workload['prompts']}", "data.prompt_key=prompt", "data.answer_key=answer",
        "reward.fn=trl_workload:addition_reward",
        f"rollout.n={SAMPLES_PER_PROMPT}", f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        f"rollout.temperature={TEMPERATURE}",
        f"trainer.prompts_per_step={PROMPTS_PER_STEP}", f"trainer.steps={steps}",
        "algorithm.advantage=grpo", "algorithm.kl_coef=0.0",
        f"algorithm.clip_low={CLIP}", f"algorithm.clip_high={CLIP}", "algorithm.loss_agg=token-mean",
        f"actor.optim.lr={lr}", "actor.optim.schedule=constant", f"actor.optim.clip_grad={GRAD_CLIP}",
        f"run.seed={SEED}", f"run.dir={run_dir}", f"run.name={run_name}",
        "trainer.plot=false", "trainer.resume=never",
    ]


def trl_config_kwargs(steps: int, lr: float, output_dir: str) -> dict:
    """``GRPOConfig`` keyword arguments matching :func:`megatron_overrides`."""
    return dict(
        output_dir=output_dir, use_cpu=True, bf16=False, fp16=False, seed=SEED,
        num_generations=SAMPLES_PER_PROMPT,
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES_PER_PROMPT, gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, top_p=1.0, top_k=0,
        beta=0.0, epsilon=CLIP, epsilon_high=CLIP, loss_type="dapo", scale_rewards="group", num_iterations=1,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=GRAD_CLIP,
        max_steps=steps, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )


def print_settings(lr: float) -> None:
    print("settings (both): GRPO, group-normalised advantages (mean and std of the 8 samples), PPO clip "
          f"{CLIP}/{CLIP}, token-mean loss, no KL / reference model, 1 optimizer step per step, "
          f"AdamW lr {lr:g} constant, grad clip {GRAD_CLIP}, {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} "
          f"samples, {MAX_NEW_TOKENS} new tokens, temperature {TEMPERATURE}, fp32, seed {SEED}")
    print("  megatron_rl: megatron-rl train " + " ".join(
        o for o in megatron_overrides({"model_dir": "<model>", "prompts": "<prompts.jsonl>"}, 0, lr, "<tmp>", "<row>")
        if not o.startswith(("run.", "trainer.steps"))))
    kw = trl_config_kwargs(0, lr, "<tmp>")
    print("  TRL: GRPOConfig(" + ", ".join(f"{k}={v!r}" for k, v in kw.items() if k not in ("output_dir", "max_steps"))
          + ")")


# ----------------------------------------------------------------------------- measuring a subprocess


class PeakRSS:
    """Peak memory of a process and all its descendants, summed over the tree.

    RSS is sampled every ``interval`` seconds.  Summed RSS counts the pages a process shares with
    its parent or siblings (torch's libraries, fork-shared memory) once per process, so the
    proportional set size (PSS, shared pages split between their users) is sampled as well, every
    ``pss_every`` samples (it reads /proc/<pid>/smaps_rollup: milliseconds per process, not
    microseconds, and a short spike between two readings is missed).
    """

    def __init__(self, pid: int, interval: float = 0.05, pss_every: int = 10):
        import psutil

        self._psutil = psutil
        self.root = psutil.Process(pid)
        self.interval = interval
        self.pss_every = pss_every
        self.peak = 0
        self.peak_pss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree(self) -> list:
        try:
            return [self.root] + self.root.children(recursive=True)
        except self._psutil.Error:
            return []

    def _sum(self, procs: list, pss: bool) -> int:
        total = 0
        for p in procs:
            with contextlib.suppress(self._psutil.Error, AttributeError):
                total += p.memory_full_info().pss if pss else p.memory_info().rss
        return total

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            procs = self._tree()
            self.peak = max(self.peak, self._sum(procs, pss=False))
            if n % self.pss_every == 0:
                self.peak_pss = max(self.peak_pss, self._sum(procs, pss=True))
            n += 1
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_measured(cmd: list[str], log_path: str, env: dict, cwd: str, timeout_s: float) -> dict:
    """Run ``cmd`` with its output in ``log_path``; its exit code, wall time and peak tree RSS."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        with PeakRSS(proc.pid) as rss:
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    return {"rc": rc, "wall_s": time.perf_counter() - start, "peak_rss_bytes": rss.peak, "peak_pss_bytes": rss.peak_pss,
            "load_after": os.getloadavg()[0]}


OMP_PASSIVE = False  # --omp-passive: OMP_WAIT_POLICY=PASSIVE in every row's environment


def _env() -> dict:
    env = dict(os.environ)
    if OMP_PASSIVE:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, REPO, env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as fh:
        return "".join(fh.readlines()[-lines:])


# ----------------------------------------------------------------------------- the two sides


def read_metrics(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def generated_tokens_per_s(record: dict) -> float:
    for key in GENERATED_TOKENS_KEYS:
        if key in record:
            return float(record[key])
    samples = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    return record["response_length/mean"] * samples / record["timing/step_s"]


def run_megatron(row: str, workload: dict, steps: int, lr: float, workdir: str, timeout_s: float,
                 name: str | None = None) -> dict:
    label, nproc, extra = MEGATRON_ROWS[row]
    name = name or row
    run_dir = os.path.join(workdir, "runs")
    cmd = [sys.executable, "-m", "megatron_rl.tools.cli", "train", "--nproc", str(nproc)]
    cmd += megatron_overrides(workload, steps, lr, run_dir, name) + extra
    log = os.path.join(workdir, f"{name}.log")
    out = run_measured(cmd, log, _env(), workdir, timeout_s)
    out.update(row=row, label=label, log=log, extra=extra)
    metrics_path = os.path.join(run_dir, name, "metrics.jsonl")
    if out["rc"] != 0 or not os.path.exists(metrics_path):
        out["error"] = f"exit code {out['rc']}; last lines of {log}:\n{_tail(log)}"
        return out
    records = read_metrics(metrics_path)
    out["step_s"] = [r["timing/step_s"] for r in records]
    out["gen_tok_s"] = [generated_tokens_per_s(r) for r in records]
    out["reward"] = [r["reward/mean"] for r in records]
    out["timings"] = {k: [r.get(k, 0.0) for r in records] for k in sorted({k for r in records for k in r})
                      if k.startswith("timing/")}
    return out


def run_trl(workload: dict, steps: int, lr: float, workdir: str, timeout_s: float, name: str = "trl") -> dict:
    result_path = os.path.join(workdir, f"{name}_result.json")
    spec = {"workload": workload, "steps": steps, "lr": lr, "output_dir": os.path.join(workdir, f"{name}_out"),
            "result": result_path}
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", json.dumps(spec)]
    log = os.path.join(workdir, f"{name}.log")
    out = run_measured(cmd, log, _env(), workdir, timeout_s)
    out.update(row="trl", label=TRL_LABEL, log=log)
    if out["rc"] != 0 or not os.path.exists(result_path):
        out["error"] = f"exit code {out['rc']}; last lines of {log}:\n{_tail(log)}"
        return out
    with open(result_path) as fh:
        out.update(json.load(fh))
    return out


def trl_worker(spec: dict) -> None:
    """In the TRL subprocess: train ``spec['steps']`` steps, write per-step times and logs as JSON."""
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    workload = spec["workload"]
    with open(workload["prompts"]) as fh:
        rows = [json.loads(line) for line in fh]
    tokenizer = transformers.AutoTokenizer.from_pretrained(workload["model_dir"])
    model = transformers.AutoModelForCausalLM.from_pretrained(workload["model_dir"], dtype=torch.float32)
    args = GRPOConfig(**trl_config_kwargs(spec["steps"], spec["lr"], spec["output_dir"]))

    steps: list[float] = []
    trl_logs: list[dict] = []
    phases: dict[str, list[float]] = {"generate": [], "reward": [], "experience": []}
    current = {name: 0.0 for name in phases}

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()
            for name in current:
                current[name] = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            steps.append(time.perf_counter() - self.t0)
            for name, value in current.items():
                phases[name].append(value)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                trl_logs.append({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    trainer = GRPOTrainer(model=model, reward_funcs=trl_workload.trl_addition_reward, args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          callbacks=[StepTimer()])

    def timed_method(name: str, phase: str) -> None:
        inner = getattr(trainer, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                current[phase] += time.perf_counter() - t0

        setattr(trainer, name, wrapper)

    timed_method("_generate_single_turn", "generate")
    timed_method("_calculate_rewards", "reward")
    timed_method("_generate_and_score_completions", "experience")
    trainer.train()
    samples = PROMPTS_PER_STEP * SAMPLES_PER_PROMPT
    lengths = [entry.get("completions/mean_length", float("nan")) for entry in trl_logs]
    result = {
        "step_s": steps, "reward": [entry["reward"] for entry in trl_logs],
        "gen_tok_s": [length * samples / s for length, s in zip(lengths, steps)],
        "trl_phases": phases, "threads": torch.get_num_threads(),
        "versions": {"trl": importlib.import_module("trl").__version__, "transformers": transformers.__version__,
                     "torch": torch.__version__},
    }
    with open(spec["result"], "w") as fh:
        json.dump(result, fh)


# ----------------------------------------------------------------------------- the table


def summarise(rounds: list[dict], warmup: int) -> dict:
    """One row from its runs (rounds): the steps after the first ``warmup`` of every run pooled."""
    first = rounds[0]
    failed = next((r for r in rounds if "error" in r), None)
    if failed is not None:
        return dict(failed, rounds=len(rounds))

    def pooled(values_of_run) -> list[float]:
        return [v for values in values_of_run for v in (values[warmup:] or values)]

    out = {k: first[k] for k in ("row", "label") if k in first}
    out["step_s"] = pooled(r["step_s"] for r in rounds)
    out["gen_tok_s"] = pooled(r["gen_tok_s"] for r in rounds)
    if "timings" in first:
        out["timings"] = {k: pooled(r["timings"].get(k, [0.0] * len(r["step_s"])) for r in rounds)
                          for k in sorted({k for r in rounds for k in r["timings"]})}
    if "trl_phases" in first:
        out["trl_phases"] = {k: pooled(r["trl_phases"][k] for r in rounds) for k in first["trl_phases"]}
    out["round_medians"] = [statistics.median(r["step_s"][warmup:] or r["step_s"]) for r in rounds]
    out["median_step_s"] = statistics.median(out["step_s"])
    out["median_gen_tok_s"] = statistics.median(out["gen_tok_s"])
    out["peak_rss_bytes"] = max(r["peak_rss_bytes"] for r in rounds)
    out["peak_pss_bytes"] = max(r["peak_pss_bytes"] for r in rounds)
    out["wall_s"] = statistics.median(r["wall_s"] for r in rounds)
    out["load_after"] = [r["load_after"] for r in rounds]
    rewards = first["reward"]  # every round is the same seeded run: the first one's rewards
    out["reward"] = rewards
    out["reward_first"], out["reward_last"] = rewards[0], sum(rewards[-3:]) / len(rewards[-3:])
    out["steps_kept"] = len(out["step_s"])
    out["rounds"] = len(rounds)
    out["runs"] = rounds
    return out


def format_table(results: list[dict], warmup: int, steps: int, load_start, load_end, rounds: int = 1) -> str:
    trl = next((r for r in results if r["row"] == "trl" and "error" not in r), None)
    lines = [
        f"GRPO per-step time, {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples x {MAX_NEW_TOKENS} new "
        f"tokens; each row {rounds} run(s) of {steps} steps (rows interleaved), median over steps "
        f"{warmup + 1}..{steps} "
        f"of every run; {os.cpu_count()} CPUs{', OMP_WAIT_POLICY=PASSIVE' if OMP_PASSIVE else ''}, load "
        f"average (1/5/15 min) {'/'.join(f'{x:.2f}' for x in load_start)} at start, "
        f"{'/'.join(f'{x:.2f}' for x in load_end)} at end",
        "",
        "| trainer | s/step (median) | per-run medians | fastest step | generated tok/s | peak RSS (MiB) | "
        "peak PSS (MiB) | s/step vs TRL | reward first -> last | process wall s | load after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: exit code {r['rc']} | | | | | | | | {r['wall_s']:.0f} | |")
            continue
        ratio = f"{r['median_step_s'] / trl['median_step_s']:.2f}x" if trl else "n/a"
        lines.append(
            f"| {r['label']} | {r['median_step_s']:.3f} | {' '.join(f'{m:.3f}' for m in r['round_medians'])} | "
            f"{min(r['step_s']):.3f} | {r['median_gen_tok_s']:.0f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} | {r['peak_pss_bytes'] / 2**20:.0f} | {ratio} | "
            f"{r['reward_first']:.3f} -> {r['reward_last']:.3f} | "
            f"{r['wall_s']:.0f} | {' '.join(f'{x:.1f}' for x in r['load_after'])} |")
    lines += ["", "s/step: megatron_rl's timing/step_s, TRL's on_step_begin -> on_step_end; fastest step: the least "
              "disturbed by other load (same steps); generated tok/s: response "
              "tokens (EOS included) per second of step; peak RSS / PSS: summed over the process tree (launcher, "
              "ranks, helpers), sampled every 50 ms / 0.5 s, the largest of the runs; process wall s: the whole "
              "subprocess, start-up and final checkpoint included (median of the runs); reward: first step -> mean "
              "of the last 3 (first run); load after: 1-minute load average at the end of each run."]
    return "\n".join(lines)


def _median(values: list[float], warmup: int) -> float:
    kept = values[warmup:] or values
    return statistics.median(kept) if kept else 0.0


def format_breakdown(results: list[dict], warmup: int = 0) -> str:
    """Median seconds per phase of each row's step (megatron_rl's timing/* keys; TRL's wrapped methods);
    ``warmup`` steps are dropped from lists that still hold them (:func:`summarise` has dropped them)."""
    lines = ["", "Where a step's time goes (median s over the same steps):", ""]
    for r in results:
        if "error" in r:
            continue
        step = r["median_step_s"]
        parts: list[tuple[str, float]] = []
        if "timings" in r:
            t = {k[len("timing/"):-len("_s")]: _median(v, warmup) for k, v in r["timings"].items()}
            top = 0.0
            for phase in TOP_PHASES:
                if phase not in t:
                    continue
                top += t[phase]
                if phase == "experience":
                    inner = [(sub, t[sub]) for sub in EXPERIENCE_PHASES if sub in t]
                    parts += inner
                    rest = t[phase] - sum(v for _, v in inner)
                    if rest > 0.0005:
                        parts.append(("experience (rest)", rest))
                else:
                    parts.append((phase, t[phase]))
            steps_s = r["timings"].get("timing/step_s", [])
            listed = [k for k in (f"timing/{phase}_s" for phase in TOP_PHASES) if k in r["timings"]]
            per_step_other = [s_ - sum(r["timings"][k][i] for k in listed) for i, s_ in enumerate(steps_s)]
            parts.append(("other", _median(per_step_other, warmup) if per_step_other else step - top))
            known = set(TOP_PHASES + EXPERIENCE_PHASES + ("step",))
            parts += [(f"[{k}, inside the above]", v) for k, v in t.items() if k not in known]
        elif "trl_phases" in r:
            p = {k: _median(v, warmup) for k, v in r["trl_phases"].items()}
            ph = r["trl_phases"]
            rest = [e - g - w for e, g, w in zip(ph["experience"], ph["generate"], ph["reward"])]
            train = [s_ - e for s_, e in zip(r["step_s"], ph["experience"])]
            parts = [("generate", p["generate"]), ("reward", p["reward"]),
                     ("experience (rest)", _median(rest, warmup)), ("loss+backward+optimizer", _median(train, warmup))]
        text = ", ".join(f"{name} {value:.3f} ({100 * value / step:.0f}%)" for name, value in parts)
        lines.append(f"- {r['label']} ({step:.3f} s): {text}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def wait_for_load(max_load: float | None, max_wait_s: float, poll_s: float = 5.0) -> float:
    """Wait (at most ``max_wait_s``) until the 1-minute load average is at most ``max_load``; seconds waited."""
    if max_load is None:
        return 0.0
    start = time.perf_counter()
    while os.getloadavg()[0] > max_load and time.perf_counter() - start < max_wait_s:
        time.sleep(poll_s)
    return time.perf_counter() - start


def run_benchmark(rows: list[str], steps: int, warmup: int, lr: float, workdir: str, timeout_s: float,
                  rounds: int = 1, num_prompts: int = 512, log=print, max_load: float | None = None,
                  max_wait_s: float = 600.0) -> tuple[list[dict], str]:
    """Build the workload under ``workdir``, run ``rows`` ``rounds`` times (interleaved, so that a burst
    of load from elsewhere hits every row); the summarised rows and the printed report."""
    load_start = os.getloadavg()
    workload = trl_workload.build_workload(os.path.join(workdir, "workload"), num_prompts=num_prompts, seed=0)
    log(f"workload: Qwen2 {workload['params']} parameters, vocabulary {workload['vocab_size']}, "
        f"{workload['num_prompts']} prompts in {workload['prompts']}")
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    for k in range(rounds):
        for row in rows:
            if runs[row] and "error" in runs[row][-1]:
                continue
            waited = wait_for_load(max_load, max_wait_s)
            log(f"round {k + 1}/{rounds}: {row} ..." + (f" (waited {waited:.0f} s for the load)" if waited else ""))
            name = f"{row}_r{k + 1}"
            if row == "trl":
                result = run_trl(workload, steps, lr, workdir, timeout_s, name=name)
            else:
                result = run_megatron(row, workload, steps, lr, workdir, timeout_s, name=name)
            runs[row].append(result)
            if "error" in result:
                log(f"  {row} failed: {result['error']}")
            else:
                median = statistics.median(result["step_s"][warmup:] or result["step_s"])
                log(f"  {row}: {median:.3f} s/step, peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB, "
                    f"wall {result['wall_s']:.0f} s, load {result['load_after']:.1f}")
    results = [summarise(runs[row], warmup) for row in rows]
    report = (format_table(results, warmup, steps, load_start, os.getloadavg(), rounds) + "\n"
              + format_breakdown(results))
    return results, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="first steps of each run left out of the medians (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per row, rows interleaved (default 2)")
    parser.add_argument("--rows", default=",".join(ALL_ROWS), help=f"comma-separated subset of {','.join(ALL_ROWS)}")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate of both trainers (default 1e-3)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one row may run (default 900)")
    parser.add_argument("--workdir", help="keep the workload, logs and run dirs here (default: a temp dir)")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--max-load", type=float, help="on a shared machine: before each run, wait until the "
                        "1-minute load average is at most this (default: do not wait)")
    parser.add_argument("--max-wait", type=float, default=600,
                        help="longest wait for --max-load per run (default 600 s)")
    parser.add_argument("--omp-passive", action="store_true", help="on a busy machine: OMP_WAIT_POLICY=PASSIVE for "
                        "every row, so that an OpenMP thread waiting for a descheduled sibling sleeps instead of "
                        "spinning on the core the sibling needs")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker:
        trl_worker(json.loads(args.trl_worker))
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ALL_ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {','.join(ALL_ROWS)}")
    if args.warmup >= args.steps:
        parser.error("--warmup must be smaller than --steps")
    if "trl" in rows and not have_trl():
        print("trl is not installed (pip install -e .[bench]): running the megatron_rl rows only")
        rows = [r for r in rows if r != "trl"]
    global OMP_PASSIVE
    OMP_PASSIVE = args.omp_passive
    print_settings(args.lr)
    with contextlib.ExitStack() as stack:
        workdir = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="vs_trl_"))
        os.makedirs(workdir, exist_ok=True)
        results, report = run_benchmark(rows, args.steps, args.warmup, args.lr, workdir, args.timeout, args.rounds,
                                        max_load=args.max_load, max_wait_s=args.max_wait)
    print()
    print(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
