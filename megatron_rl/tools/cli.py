"""``megatron-rl``: the command-line front door.

    megatron-rl train    --config configs/demo_cpu.yaml [--nproc N] [key=value ...]
    megatron-rl smoke    [--nproc N] [key=value ...]
    megatron-rl score    --hf-model DIR --input IN.jsonl --output OUT.jsonl [--nproc N] [key=value ...]
    megatron-rl generate --hf-model DIR | --checkpoint CKPT --input IN.jsonl --output OUT.jsonl
                         [--nproc N] [key=value ...]
    megatron-rl convert  --hf-model DIR --out CKPT_ROOT | --checkpoint CKPT --hf-out DIR [--part critic]

CKPT is a step_XXXXXXXX directory, or a run directory or its checkpoints/ (the newest complete step).
    megatron-rl plan     --model qwen2.5-7b --response-len 32768 --nodes 1 --gpus-per-node 8 --gpu-memory 80
    megatron-rl validate CONFIG [--world-size N] [key=value ...]
    megatron-rl features [--markdown]
    megatron-rl check-layouts --config CONFIG [--layouts N] [--seed S] [--steps 2] [--world 4] [key=value ...]

Bad input (config, data, checkpoint, the paths a tool is given) prints one line naming the key
and the fix, exit code 2, before any rank starts where it can.
Distributed commands run under torchrun or srun as they are, or start ``--nproc`` local ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from megatron_rl.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, UserInputError

DISTRIBUTED_COMMANDS = ("train", "smoke", "score", "convert", "generate")
TOOL_COMMANDS = ("score", "convert", "generate")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("train", "run PPO training"), ("smoke", "parallel LM smoke job on synthetic data")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", help="YAML config file")
        p.add_argument("--nproc", type=int, help="local ranks to start (ignored under torchrun/srun)")
        p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p = sub.add_parser("score", help="per-token log-probs and entropy of an HF model on any layout")
    p.add_argument("--hf-model", required=True, help="local Hugging Face model directory")
    p.add_argument("--input", required=True, help="JSONL with input_ids or text per line")
    p.add_argument("--output", required=True, help="JSONL to write, one line per input line")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--config", help="YAML config file (parallel layout, batch)")
    p.add_argument("--nproc", type=int, help="local ranks to start (ignored under torchrun/srun)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p = sub.add_parser("generate", help="completions (tokens, text, log-probs) for a JSONL of prompts")
    p.add_argument("--hf-model", help="local Hugging Face model directory")
    p.add_argument("--checkpoint", help="megatron_rl checkpoint (step_XXXXXXXX), or a run or its checkpoints/ "
                                        "directory for the newest complete one; instead of --hf-model")
    p.add_argument("--part", default="actor", help="which model of the checkpoint (default actor)")
    p.add_argument("--input", required=True, help="JSONL with prompt_ids, prompt or messages per line")
    p.add_argument("--output", required=True, help="JSONL to write, rollout.n lines per input line")
    p.add_argument("--config", help="YAML config file (parallel layout, rollout.*)")
    p.add_argument("--nproc", type=int, help="local ranks to start (ignored under torchrun/srun)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p = sub.add_parser("convert", help="Hugging Face <-> megatron_rl checkpoints")
    p.add_argument("--hf-model", help="HF model directory to convert into a megatron_rl checkpoint")
    p.add_argument("--out", help="checkpoint root to write (with --hf-model)")
    p.add_argument("--checkpoint", help="megatron_rl checkpoint (step_XXXXXXXX) to export, or a run or its "
                                        "checkpoints/ directory for the newest complete one")
    p.add_argument("--hf-out", help="HF directory to write (with --checkpoint)")
    p.add_argument("--part", default="actor", help="which model of the checkpoint: actor (default) or critic")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA checkpoint: write the base (--hf-model, checked against the checkpoint) with the "
                        "adapters merged in, instead of a peft adapter directory")
    p.add_argument("--config", help="YAML config file (parallel layout)")
    p.add_argument("--nproc", type=int, help="local ranks to start (ignored under torchrun/srun)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p = sub.add_parser("validate", help="check a config without starting anything")
    p.add_argument("config", nargs="?", help="YAML config file")
    p.add_argument("--world-size", type=int, help="number of ranks the job will have (default: --nproc / "
                                                  "distributed.nproc)")
    p.add_argument("overrides", nargs="*")
    p = sub.add_parser("plan", help="per-GPU memory of a PPO job and the layouts that fit")
    from megatron_rl.tools.plan import add_arguments

    add_arguments(p)
    p = sub.add_parser("check-layouts", help="train the config's model, shrunk, on random layouts and compare each "
                                             "with one process")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--layouts", type=int, default=4, help="random layouts to check (default 4)")
    p.add_argument("--seed", type=int, help="seed of the draw (default: a random one, printed)")
    p.add_argument("--steps", type=int, default=2, help="training steps per layout (default 2)")
    p.add_argument("--world", type=int, default=4, help="CPU ranks of each layout (default 4)")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p = sub.add_parser("features", help="print the feature matrix and the installed versions")
    p.add_argument("--markdown", action="store_true", help="print docs/feature_matrix.md")
    return parser


def _prepare_run_directory(cfg, rank_env: dict[str, str]) -> int | None:
    """Before any rank starts: an exit code when the run has nothing left to do; with
    ``trainer.resume=never``, the previous run moved aside whole -- before this run's config.yaml
    is written over its record."""
    from megatron_rl.trainer.finished import (
        SET_ASIDE_ENV,
        finished_message,
        finished_step,
        set_aside_message,
        set_aside_previous_run,
    )

    done = finished_step(cfg)
    if done is not None:  # a re-run of a finished run: one line, no ranks started
        print(finished_message(cfg, done), flush=True)
        return 0
    if cfg.trainer.resume == "never":
        moved = set_aside_previous_run(_run_dir(cfg))
        if moved:
            print(set_aside_message(moved), flush=True)
        rank_env[SET_ASIDE_ENV] = "1"  # the ranks leave the new run's files where they are
    return None


@contextlib.contextmanager
def _environment(values: dict[str, str]):
    """``values`` in ``os.environ`` while the rank runs in this process; the caller's environment after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _under_launcher() -> bool:
    return "RANK" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


# Commands that generate nothing: the limits of generating do not apply to them.
NON_GENERATING = ("score", "convert", "smoke")


def _load(config: str | None, overrides: list[str], world: int | None, hf_model: str | None = None,
          command: str | None = "train", tool_args=None):
    """Load, take the architecture from an HF model directory when one is given, validate; for
    training also check what the config points at (prompt file, reward, tokenizer); for
    ``generate`` (``tool_args``) validate with the prompts of its input and the model it generates
    with.  Returns the config and what validation resolved it to."""
    from megatron_rl.config.loader import load_config
    from megatron_rl.resolve import Job
    from megatron_rl.validation import validate

    cfg = load_config(config, overrides, world_size=world)
    if command not in ("train", "validate", None):
        cfg.rollout.ranks = 0  # only training has generator ranks of their own; tools generate on every rank
    if hf_model:
        cfg.model.hf_path = hf_model
    if cfg.model.hf_path:
        from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config

        cfg.model = model_config_from_hf(read_hf_config(cfg.model.hf_path), cfg.model)
    job = _generation_job(cfg, tool_args) if command == "generate" and tool_args is not None else Job()
    resolution = validate(cfg, world, generates=command not in NON_GENERATING, job=job)
    if command is not None:
        from megatron_rl.compat.versions import require_tested_megatron_core

        require_tested_megatron_core(cfg.run.allow_untested_megatron_core)
    if command in ("train", "validate"):
        from megatron_rl.tools.preflight import check_training_inputs

        check_training_inputs(cfg)
    return cfg, resolution


def _generation_job(cfg, args):
    """What ``generate`` knows beyond the config: its input's prompts and the model it generates
    with (the checkpoint's), kept in ``args`` so the command reads them once."""
    from megatron_rl.tools.generate import read_generation_input

    args.generation_input = read_generation_input(cfg, args.input, args.hf_model, args.checkpoint, args.part)
    cfg.model = args.generation_input.model
    return args.generation_input.job(cfg)


def _run_dir(cfg) -> str:
    path = os.path.join(cfg.run.dir, cfg.run.name)
    os.makedirs(path, exist_ok=True)
    return path


def _check_tool_paths(args, argv: list[str]) -> list[str]:
    """Check the flags and paths a tool is given before any rank starts; a run directory or ``checkpoints/``
    given as ``--checkpoint`` becomes its newest complete step directory, said once and passed to
    the ranks as such.  Returns the command line the ranks get."""
    from megatron_rl.tools.tool_paths import check_tool_paths

    if args.command == "convert" and not ((args.hf_model and args.out) or (args.checkpoint and args.hf_out)):
        raise UserInputError("convert --hf-model/--checkpoint", None,
                             "needs --hf-model with --out, or --checkpoint with --hf-out",
                             "e.g. megatron-rl convert --hf-model ./Qwen2.5-0.5B --out ./ckpt")
    if args.command == "generate" and bool(args.hf_model) == bool(args.checkpoint):
        raise UserInputError("generate --hf-model/--checkpoint", None, "needs exactly one of them",
                             "e.g. megatron-rl generate --hf-model ./Qwen2.5-0.5B --input p.jsonl --output o.jsonl")
    step = check_tool_paths(args)
    if step is None or step == args.checkpoint:
        return argv
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"--checkpoint {args.checkpoint}: using {step}, the newest complete checkpoint under it", flush=True)
    args.checkpoint = step
    out = []
    for i, arg in enumerate(argv):
        if i > 0 and argv[i - 1] == "--checkpoint":
            arg = step
        elif arg.startswith("--checkpoint="):
            arg = "--checkpoint=" + step
        out.append(arg)
    return out


def _rank_main(args) -> int:
    from megatron_rl.distributed.env import detect_launch_env
    from megatron_rl.distributed.guard import run_guarded, stop_watching, watch_early_exit
    from megatron_rl.distributed.placement import GENERATOR
    from megatron_rl.distributed.runtime import init_distributed

    launch = detect_launch_env()

    def work() -> int:
        cfg, _ = _load(args.config, args.overrides, launch.world_size, getattr(args, "hf_model", None), args.command,
                       args)
        where = init_distributed(cfg.distributed, launch, generators=cfg.rollout.ranks)
        if where.role == GENERATOR:
            return _serve_generation(cfg, where)
        return _COMMANDS[args.command](cfg, args)

    if launch.world_size > 1 or os.environ.get("MEGATRON_RL_LAUNCHER"):
        run_guarded(work)  # never returns
    import torch.distributed as dist

    from megatron_rl.distributed.runtime import shutdown_distributed

    started_here = not dist.is_initialized()  # a caller's own process groups (a test worker) are its to keep
    watch_early_exit()  # os._exit from a reward or a library: a failure with its call site, not exit 0
    try:
        return work() or 0
    except KeyboardInterrupt:  # Ctrl-C before training started, or twice during it
        print("aborted (Ctrl-C); no checkpoint of the current step", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        stop_watching()
        if started_here:
            shutdown_distributed()  # back to the interpreter: no gloo thread may outlive the groups


def _serve_generation(cfg, where) -> int:
    from megatron_rl.data.sources import tokenizer_spec
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.envs.build import with_environment
    from megatron_rl.resolve import resolve
    from megatron_rl.rollout.generator_service import serve_generation

    cfg = resolve(cfg, where.trainers).config
    wrap = None
    if cfg.rollout.multi_turn:  # the generators run the environments (or serve the agents)
        tokenizer = load_tokenizer(tokenizer_spec(cfg.data, cfg.model.hf_path))
        wrap = lambda engine: with_environment(cfg, engine, tokenizer)  # noqa: E731
    serve_generation(cfg, log=lambda line: print(line, flush=True), wrap_engine=wrap)
    return 0


def _smoke(cfg, args) -> int:
    from megatron_rl.tools.smoke import run_smoke

    run_smoke(cfg, log=lambda line: print(line, flush=True))
    return 0


def _train(cfg, args) -> int:
    from megatron_rl.trainer.ppo import run_ppo

    run_ppo(cfg, log=lambda line: print(line, flush=True))
    return 0


def _score(cfg, args) -> int:
    from megatron_rl.tools.score import run_score

    return run_score(cfg, args.hf_model, args.input, args.output, args.temperature)


def _convert(cfg, args) -> int:
    from megatron_rl.tools import convert

    if args.hf_model and args.out:
        convert.hf_to_megatron(cfg, args.hf_model, args.out)
    else:
        convert.megatron_to_hf(cfg, args.checkpoint, args.hf_out, args.part, merge=args.merge,
                               base_dir=args.hf_model)
    return 0


def _generate(cfg, args) -> int:
    from megatron_rl.tools.generate import run_generate

    return run_generate(cfg, args.input, args.output, args.hf_model, args.checkpoint, args.part,
                        getattr(args, "generation_input", None))


_COMMANDS = {"train": _train, "smoke": _smoke, "score": _score, "convert": _convert, "generate": _generate}


def _features(args) -> int:
    from megatron_rl.tools.features_cmd import print_features

    print_features(markdown=args.markdown)
    return 0


def _validate(args) -> int:
    from megatron_rl.config.loader import to_yaml

    cfg, _ = _load(args.config, args.overrides, None, command=None)
    world = args.world_size or cfg.distributed.nproc
    _load(args.config, args.overrides, world, command="validate")
    print(f"config OK for {world} rank(s)")
    if os.environ.get("MEGATRON_RL_PRINT_CONFIG"):
        print(to_yaml(cfg))
    return 0


def _check_layouts(args) -> int:
    from megatron_rl.tools.check_layouts import run_check_layouts

    cfg, _ = _load(args.config, args.overrides, None, command=None)
    return run_check_layouts(cfg, args, log=lambda line: print(line, flush=True))


def _import_from_the_working_directory() -> None:
    """``reward.fn=my_rewards:score`` resolves the same for every launch: ``python -m`` (the local
    launcher's ranks) puts the working directory first on ``sys.path``, the ``megatron-rl`` script
    and torchrun's entry point do not, so without this a module beside the config imported with
    ``--nproc 2`` and not with ``--nproc 1``."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _import_from_the_working_directory()
    parser = _parser()
    # Overrides may come before and after options (`train --nproc 2 a=1 --config f b=2`):
    # whatever argparse leaves over must be key=value overrides.
    args, extra = parser.parse_known_args(argv)
    flags = [e for e in extra if e.startswith("-")]
    if flags:
        parser.error(f"unrecognized arguments: {' '.join(flags)}")
    if hasattr(args, "overrides"):
        args.overrides = list(args.overrides or []) + extra
        if args.command == "validate" and args.config and "=" in args.config and not os.path.isfile(args.config):
            args.overrides.insert(0, args.config)
            args.config = None
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from megatron_rl.compat import quiet_known_warnings  # imports torch: not for --help

    quiet_known_warnings()
    try:
        if args.command == "features":
            return _features(args)
        if args.command == "validate":
            return _validate(args)
        if args.command == "check-layouts":
            return _check_layouts(args)
        if args.command == "plan":
            from megatron_rl.tools.plan import run_plan

            return run_plan(args)
        if args.command in TOOL_COMMANDS:
            argv = _check_tool_paths(args, argv)
        if _under_launcher():
            return _rank_main(args)
        # Launcher side: validate for the world we are about to start, then start it.
        from megatron_rl.config.loader import load_config
        from megatron_rl.utils.run_files import save_config

        cfg0 = load_config(args.config, args.overrides)
        nproc = args.nproc or cfg0.distributed.nproc
        cfg, resolution = _load(args.config, args.overrides, nproc, getattr(args, "hf_model", None), args.command,
                                args)
        rank_env: dict[str, str] = {}  # what the launcher side tells the ranks it started
        if args.command == "train":
            done = _prepare_run_directory(cfg, rank_env)
            if done is not None:
                return done
        if args.command in ("train", "smoke"):
            from megatron_rl.engine.checkpoint_space import remove_stale_temporaries
            from megatron_rl.utils.run_files import remove_run_temporaries

            cfg.distributed.nproc = nproc  # the record says how the job was launched, --nproc included
            remove_stale_temporaries(os.path.join(_run_dir(cfg), "checkpoints"))  # a failed save's leftovers
            remove_run_temporaries(_run_dir(cfg))  # and a killed writer's (metrics, samples, plot)
            resolved = ["resolved at launch for this machine and world size:"] + [
                f"  {line}" for line in resolution.lines()]
            save_config(cfg, os.path.join(_run_dir(cfg), "config.yaml"), resolved)
        if nproc > 1:
            from megatron_rl.distributed.launcher import launch_local

            rank_argv = [a for a in argv if not a.startswith("--nproc")]
            if "--nproc" in argv:
                i = argv.index("--nproc")
                rank_argv = argv[:i] + argv[i + 2 :]
            from megatron_rl.distributed.placement import rank_names

            return launch_local(rank_argv, nproc, extra_env=rank_env,
                                grace_s=max(60.0, float(cfg.distributed.timeout_s)),
                                rank_names=rank_names(nproc, cfg.rollout.ranks))
        with _environment(rank_env):
            return _rank_main(args)
    except UserInputError as err:
        print(str(err), file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
