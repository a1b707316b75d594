"""Generate the docs that must never drift from the code.

    python -m megatron_rl.tools.docs_gen --write     # rewrite them
    python -m megatron_rl.tools.docs_gen --check     # exit 1 if any is stale (what the tests do)

* ``docs/feature_matrix.md`` -- from the feature registry;
* ``docs/config.md`` -- every config key with type, default and meaning, from the schema;
* ``docs/troubleshooting.md`` -- every error config validation can raise (from the registry's
  constraints) with its fix, plus the runtime errors, from this module's table;
* the key-name section of ``docs/coming_from_trl_verl.md`` -- from the TRL/verl alias tables (the
  file's other sections are written by hand and kept).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing

from megatron_rl.config.rules import bounds_text, registry_choices
from megatron_rl.config.schema import Config, iter_fields, leaf_types, literal_choices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Errors raised after validation, while reading data, checkpoints or running user code.
RUNTIME_ERRORS = [
    ("training error: <part>.optim.lr=...: all N <part> optimizer steps of PPO step S were skipped",
     "Every gradient of that phase was non-finite, so training cannot progress.",
     "Lower the learning rate, or train in float32 (`model.params_dtype=float32`) if bfloat16 overflows."),
    ("data error: <file>:<line>: ...", "A prompt or score input line is malformed (bad JSON, missing prompt/messages, "
     "wrong type, token id outside the vocabulary).", "Fix that line; the message names the key."),
    ("data error: batch.max_tokens_per_rank=...: a sequence of N tokens needs M tokens per rank at cp=K",
     "One sequence does not fit the token budget even split over the CP group.",
     "Raise `batch.max_tokens_per_rank`, raise `parallel.cp`, or lower `rollout.max_new_tokens`."),
    ("data error: batch=...: the interleaved pipeline schedule needs N micro-batches here",
     "Virtual pipeline parallelism needs a multiple of `pp`, and at least `2*pp` in a training pass, micro-batches "
     "on every DP rank (megatron-core's schedule hangs with exactly `pp`).",
     "Use more sequences per step (`trainer.prompts_per_step` x `rollout.n`) or `parallel.vpp=null`."),
    ("data error: data.max_prompt_tokens=...: all N prompts in <file> are longer than ... tokens (the longest has "
     "L, the shortest S)",
     "Every prompt exceeds `data.max_prompt_tokens`, so training would have none; `validate` and `train` say so "
     "before launch (files up to 1 GiB are measured whole).",
     "Raise `data.max_prompt_tokens` to S or more (L keeps every prompt), or shorten the prompts."),
    ("data error: rollout.agent=<fn>: none of this step's N samples reached its session",
     "No agent call of the step sent a request with its sample's session id (a request without one is a session "
     "of its own: `env/agent_stray_sessions`), so nothing would train. When only some missed, one warning says so "
     "and they train nothing (`env/agent_no_reply`).",
     'Pass the session id the agent is called with: `extra_body={"session_id": session_id}` or `user=session_id`.'),
    ("config error: trainer.sft_warmup_steps=N: with rollout.agent the warm-up trains on the chat the endpoint "
     "serves, and ... is not a 'messages' chat ending in a demonstration",
     "In agent mode the warm-up trains on demonstrated chats as the endpoint serves them; the data has none "
     "(a built-in task, a text prompt, a chat not ending in the assistant's turns).",
     "End every `messages` chat with the assistant's demonstration (docs/environments.md), or "
     "`trainer.sft_warmup_steps=0`."),
    ("reward error: reward.fn=<name>: raised <Error> on prompt index N", "The reward function failed on that prompt.",
     "Fix the function or the data line N; the run stops before any update uses the bad reward."),
    ("reward error: reward.fn=<name>: returned N values for M responses / a non-finite value",
     "The reward function's output has the wrong length or NaN/inf.", "Return one finite number per response."),
    ("checkpoint error: checkpoint=<dir>: meta.json is missing (the save did not finish)",
     "A save was interrupted; the directory was never renamed into place.",
     "Nothing to do: `trainer.resume=auto` skips it and uses the previous checkpoint."),
    ("checkpoint error: checkpoint=<dir>: not a checkpoint (no meta.json here)",
     "The directory is neither a step directory, nor (for `convert`/`generate --checkpoint`) a run or its "
     "checkpoints/ with a step in it.",
     "Pass `runs/<name>` or `runs/<name>/checkpoints` (the newest complete step is taken) or a step directory."),
    ("storage error: --hf-out=<dir>: already exists and is not an empty directory",
     "Files of another model there would mix with the export (stale shards, another tokenizer).",
     "Choose a new directory, or remove that one first."),
    ("checkpoint error: checkpoint=<dir>: file ... is truncated or altered / does not match its sha256 checksum",
     "A checkpoint file changed after it was written (disk or copy problem); every file's sha256 is in meta.json.",
     "`trainer.resume=auto` falls back to the newest checkpoint that loads; or pass another path."),
    ("checkpoint error: checkpoint=<dir>: file <name> is not listed in meta.json / <name> is a symbolic link",
     "A file was added to the step directory after the save, or the checkpoint was copied with its links; a "
     "checkpoint loads only the files its manifest lists with their sha256, and never follows a link.",
     "Remove the added file, or copy the checkpoint with its files (`cp -rL`); `trainer.resume=auto` falls back to "
     "the previous complete step."),
    ("checkpoint error: checkpoint=<dir>: meta.json is corrupt (not a manifest file) / <field> is ..., expected ...",
     "The manifest does not have the shape megatron_rl writes (edited, truncated, or from another tool).",
     "`trainer.resume=auto` skips the step with one warning and loads the previous one; or pass another path."),
    ("checkpoint error: checkpoint=<dir>: ... was refused: it names <module>.<name> / asks to load code or classes",
     "A checkpoint file would run code when loaded (a crafted or foreign file); nothing from it ran.",
     "Load only checkpoints megatron_rl wrote; convert others from Hugging Face safetensors."),
    ("checkpoint error: model.<key>=...: the checkpoint's <part> was saved with model.<key>=...",
     "The run builds a model of another shape than the checkpoint holds.",
     "Use the checkpoint's setting, or start a new run (`run.name=<new name>`)."),
    ("checkpoint error: checkpoint=<dir>: the <part> weights hold NaN or infinite values; nothing was written",
     "Training made the weights non-finite; the save was refused and the last good checkpoint kept.",
     "Resume from the last checkpoint with a lower learning rate (or float32 if bfloat16 overflows)."),
    ("storage error: <dir>/checkpoints: not enough disk space for the step N checkpoint: ... free, it needs about ...",
     "The checkpoint does not fit on the disk (checked before writing), or the disk filled during the write; nothing "
     "partial was kept.",
     "Free space, lower `trainer.keep_last`, or move `run.dir` to a larger disk; the same command resumes from the "
     "last good checkpoint."),
    ("storage error: <run dir>/<file>: the disk is full: writing <what> needs N KiB, M KiB free",
     "The disk filled outside a checkpoint save: the run's config, a step's metrics line, its sample log, "
     "TensorBoard's events or the plot did not fit. Nothing was left half-written; the last checkpoint is intact.",
     "Free space, or move `run.dir` to a disk with space; the same command resumes from the last checkpoint."),
    ("storage error: <run dir>/<file>: cannot write <what>",
     "The run directory is not writable.",
     "Make it writable, or choose another `run.dir`."),
    ("reward error: reward.fn=<name>: did not return within N s", "A plain reward function got `reward.timeout_s` "
     "per response of its batch and did not return; the run stopped.",
     "Make it return in time, raise `reward.timeout_s`, or build it from `@grader` functions (a late sample "
     "scores 0)."),
    ("megatron-rl: aborting the job (a second stop signal / the ranks were still running N s after the stop signal)",
     "A second Ctrl-C or SIGTERM, or ranks that did not reach a step boundary within `distributed.timeout_s`.",
     "The last checkpoint written is intact; resume with `trainer.resume=auto`."),
    ("checkpoint error: model.hf_path=<dir>: tensor ... is missing / HF gives (..) the model expects (..)",
     "The HF checkpoint does not match its config.json.", "Re-download or re-save the model."),
    ("config error: model.hf_path=...: unsupported architecture / rope_scaling / sliding_window",
     "The HF model uses something the Megatron model cannot reproduce exactly.",
     "Use a supported architecture (see the feature matrix); RoPE scaling: yarn or llama3 (linear / dynamic are "
     "not supported)."),
    ("config error: --input=...: its longest prompt (line N, ... tokens) + rollout.max_new_tokens ... exceed the "
     "model's N positions",
     "`generate`: a prompt of the input and the response it may grow do not fit the model's positions (checked on "
     "the prompts read, the same on every layout).",
     "Shorten that prompt, lower `rollout.max_new_tokens`, or enable YaRN (`model.rope_scaling`, "
     "docs/long_context.md)."),
    ("config error: rollout.max_new_tokens=...: data.max_prompt_tokens ... + rollout.max_new_tokens ... exceed the "
     "model's N positions",
     "The longest prompt + response does not fit the window the model's RoPE is meant for.",
     "Enable YaRN past the native window (`model.rope_scaling`, docs/long_context.md) or lower the lengths."),
    ("config error: model.vocab_size=...: smaller than the tokenizer's vocabulary",
     "Token ids would fall outside the embedding.", "Raise `model.vocab_size`."),
    ("megatron-rl: rank N failed (exit code N); stopped the other K rank(s)",
     "A rank raised; its traceback follows, printed once.", "Read the traceback; it is the first failure."),
    ("rank N waited longer than distributed.timeout_s for a collective",
     "Another rank is hung or dead, or a step takes longer than the timeout.",
     "Look at the other ranks' logs; raise `distributed.timeout_s` only if steps are genuinely that slow."),
    ("megatron-rl: rank N died (signal 9) without a Python traceback",
     "The rank was killed, usually by the out-of-memory killer.",
     "Lower memory per rank: `batch.max_tokens_per_rank`, recompute, more parallelism (`megatron-rl plan`)."),
    ("rank N ended early: os._exit(0) was called at <file>:<line> in <fn>() while in step S, <phase>",
     "A reward function, tool or library it imports ended the process with exit code 0 while the job was "
     "working; the job fails (exit 1) instead of ending 0 having trained nothing.",
     "Make that code return or raise instead of exiting."),
    ("megatron-rl: rank N exited with code 0 before its work was done (in step S, <phase>)",
     "The same from C code (a library's exit(0)): no Python frame to name, only the step and phase the rank was in. "
     "Seen where the launcher watches the ranks (--nproc 2 and more); a one-process run sees only os._exit.",
     "Find what that phase runs (the reward function for `reward`, the tool for a multi-turn step) and make it "
     "return."),
]


def _default_text(default) -> str:
    return default if isinstance(default, str) else json.dumps(default)


def _type_text(tp, field) -> str:
    """``int (>= 1)``, ``one of `a`, `b```, ``str or null``: what the key accepts, from the schema."""
    optional = typing.get_origin(tp) is typing.Union and type(None) in typing.get_args(tp)
    choices = literal_choices(tp)
    if field.metadata.get("choices"):
        choices = registry_choices(field.metadata["choices"])
    if choices:
        text = "one of " + ", ".join(f"`{c}`" for c in choices)
    else:
        inner = next((a for a in typing.get_args(tp) if a is not type(None)), tp) if optional else tp
        text = getattr(inner, "__name__", str(inner))
    bounds = field.metadata.get("bounds")
    if bounds:
        text += f" ({bounds_text(bounds)})"
    return text + (" or null" if optional else "")


def config_markdown() -> str:
    lines = ["# Configuration reference", "",
             "Generated from `megatron_rl/config/schema.py` by `python -m megatron_rl.tools.docs_gen --write`;",
             "do not edit by hand. Set keys in a YAML file (`--config FILE`) or on the command line",
             "(`key=value`, e.g. `parallel.tp=2 actor.optim.lr=1e-6`). Unknown keys, wrong types, values",
             "outside a key's choices or range are rejected before any process starts, with a one-line",
             "error naming the key (exit code 2); every refused key of the file and the command line comes in",
             "that one error, a line each with its fix. TRL and verl names are read the same in a file and on",
             "the command line ([coming_from_trl_verl.md](coming_from_trl_verl.md)).", ""]
    types = leaf_types(Config)
    keys = [k for k, _, _ in iter_fields(Config)]
    section = None
    for key, field, default in iter_fields(Config):
        top = key.split(".")[0]
        if top != section:
            section = top
            lines += [f"## `{section}`", "", "| Key | Type | Default | Meaning |", "|---|---|---|---|"]
        lines.append(f"| `{key}` | {_type_text(types[key], field)} | `{_default_text(default)}` | "
                     f"{field.metadata.get('help', '')} |")
        if key == [k for k in keys if k.startswith(section + ".")][-1]:
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def troubleshooting_markdown() -> str:
    from megatron_rl.features import FEATURES

    lines = ["# Troubleshooting", "",
             "Generated by `python -m megatron_rl.tools.docs_gen --write` from the feature registry and the",
             "runtime error table in `megatron_rl/tools/docs_gen.py`. Every error below is one line, names the",
             "key and says the fix; bad input exits with code 2. Check a config without starting anything:",
             "`megatron-rl validate CONFIG --world-size N`.", "",
             "## Config validation (before any process starts)", "",
             "| Feature (matrix row) | Rule | Key in the error |", "|---|---|---|"]
    for feat in FEATURES:
        for con in feat.constraints:
            lines.append(f"| {feat.name} | {con.text} | `{con.key}` |")
    lines += ["", "## Errors while running", "", "| Message starts with | Meaning | Fix |", "|---|---|---|"]
    for message, meaning, fix in RUNTIME_ERRORS:
        lines.append(f"| `{message}` | {meaning} | {fix} |")
    return "\n".join(lines) + "\n"


KEY_NAMES_BEGIN = "<!-- key names: generated by python -m megatron_rl.tools.docs_gen --write -->"
KEY_NAMES_END = "<!-- end of key names -->"


def _alias_rows(table, kind: str) -> list[str]:
    """Markdown rows of ``table``'s aliases of one kind; the note column only where there are notes."""
    rows = []
    for name, alias in table.items():
        if alias.kind == kind:
            note = f" {alias.note.replace('{value}', 'N')} |" if alias.note else ""
            rows.append(f"| `{name}` | {alias.origin} | `{alias.ours}` |{note}")
    return rows


def key_names_markdown() -> str:
    """The key-name section of docs/coming_from_trl_verl.md (the rest of that file is written by hand)."""
    from megatron_rl.config.aliases import BY_VALUE, DIFFERENT, GENERATION, NO_EQUIVALENT, SAME, TRL
    from megatron_rl.config.verl_keys import VERL, VERL_GROUPS, VERL_NAMES

    head = "| Their name | From | Ours | How it differs |"
    same_head = "| Their name | From | Ours |"
    lines = [
        KEY_NAMES_BEGIN, "## Key names", "",
        "Generated from `megatron_rl/config/aliases.py` and `megatron_rl/config/verl_keys.py`, which cover every "
        "key path of verl's `ppo_megatron_trainer.yaml`. On the command line and in a YAML config file (top level "
        "or nested in sections, `data: {train_files: ...}`) a name with the same meaning is "
        "accepted and rewritten to ours with one note (`config: verl key actor_rollout_ref.actor.optim.lr read as "
        "our actor.optim.lr=1e-6`). A name read by its value is accepted, with one note, where its value means what "
        "ours does, and refused where it cannot. Every refused name of a run is reported in one error, a line "
        "each with its fix (exit code 2). Every other verl name is refused: a different meaning points at "
        "our key and says how it differs; a generation-side key says what sets it here; a key "
        "with no equivalent says so. verl's full paths are matched exactly; a bare name (`ppo_epochs`, "
        "`algorithm.beta`) is matched on its last one or two dotted parts, and applied only when it does not sit "
        "in another section (`critic.tensor_model_parallel_size` is refused, pointing at `parallel.tp`). Two names "
        "for one key with different values (`actor_rollout_ref.actor.optim.lr=1e-6 actor.optim.lr=2e-6`) are "
        "refused naming both. Every key of ours is in [the config reference](config.md).", "",
        "### Parallel layout", "",
        "- verl's `ulysses_sequence_parallel_size=N` (Ulysses sequence parallelism) is our context parallelism "
        "with all-to-all attention: `parallel.cp=N parallel.cp_comm_type=a2a`. It is refused with that fix, not "
        "rewritten, because `parallel.cp` alone is ring attention.",
        "- `parallel.sequence_parallel` is Megatron's sequence parallelism: activations outside attention and MLP "
        "sharded over the TP group (needs `parallel.tp` > 1). It does not split sequences over ranks.",
        "- `actor_rollout_ref.actor.megatron.{tensor,pipeline,virtual_pipeline,context,expert}_model_parallel_size` "
        "and `expert_tensor_parallel_size` are `parallel.tp`, `pp`, `vpp`, `cp`, `ep`, `etp`. The critic and the "
        "reference model train and run on the same layout, so their `megatron.*` sizes are accepted when they equal "
        "the actor's and refused otherwise.",
        "- `actor_rollout_ref.rollout.{tensor_model_parallel_size,pipeline_model_parallel_size,"
        "expert_parallel_size}` set the inference engine's layout, as in verl: they are `rollout.layout.tp`, `pp`, "
        "`ep` (megatron-core's engine on a layout of its own, refit from the training shards; docs/rollout.md), "
        "never `parallel.*`. The rollout's data-parallel size is what its layout leaves of the ranks, so "
        "`actor_rollout_ref.rollout.data_parallel_size` is refused.", "",
        "### Same meaning (accepted)", "", same_head, "|---|---|---|"]
    lines += _alias_rows(TRL, SAME) + _alias_rows(VERL_NAMES, SAME) + _alias_rows(VERL, SAME)
    lines += ["", "### Read by value (accepted where the value means ours)", "", head.replace("How it differs",
                                                                                              "How it is read"),
              "|---|---|---|---|"]
    lines += _alias_rows(TRL, BY_VALUE) + _alias_rows(VERL_NAMES, BY_VALUE) + _alias_rows(VERL, BY_VALUE)
    lines += ["", "### Different meaning (refused, pointing at ours)", "", head, "|---|---|---|---|"]
    lines += _alias_rows(TRL, DIFFERENT) + _alias_rows(VERL_NAMES, DIFFERENT) + _alias_rows(VERL, DIFFERENT)
    lines += ["", "### Generation side (refused)", "", "| verl key | Why |", "|---|---|"]
    lines += [f"| `{name}` | {alias.note} |" for name, alias in VERL.items() if alias.kind == GENERATION]
    lines += ["", "### No equivalent (refused)", "", "| verl key or pattern | Why |", "|---|---|"]
    lines += [f"| `{name}` | {alias.note or 'no counterpart here'} |" for name, alias in VERL.items()
              if alias.kind == NO_EQUIVALENT]
    lines += ["", "### Groups of verl keys (refused)", "",
              "Keys not listed above are matched against these patterns (`*` spans dots), first match first.", "",
              "| Pattern | Why |", "|---|---|"]
    lines += [f"| `{pattern}` | {alias.note or 'no counterpart here'} |" for pattern, alias in VERL_GROUPS]
    return "\n".join(lines + [KEY_NAMES_END]) + "\n"


def aliases_markdown(current: str = "") -> str:
    """docs/coming_from_trl_verl.md: the key-name section replaced in place, other sections kept."""
    section = key_names_markdown()
    if KEY_NAMES_BEGIN in current and KEY_NAMES_END in current:
        before = current[:current.index(KEY_NAMES_BEGIN)]
        after = current[current.index(KEY_NAMES_END) + len(KEY_NAMES_END):].lstrip("\n")
        return before + section + ("\n" + after if after else "")
    return "# Coming from TRL or verl\n\n" + section


def _read(rel: str) -> str:
    path = os.path.join(ROOT, rel)
    return open(path).read() if os.path.isfile(path) else ""


def generated() -> dict[str, str]:
    from megatron_rl.tools.features_cmd import matrix_markdown

    return {
        "docs/feature_matrix.md": matrix_markdown(),
        "docs/config.md": config_markdown(),
        "docs/troubleshooting.md": troubleshooting_markdown(),
        "docs/coming_from_trl_verl.md": aliases_markdown(_read("docs/coming_from_trl_verl.md")),
    }


def stale() -> list[str]:
    out = []
    for rel, text in generated().items():
        path = os.path.join(ROOT, rel)
        if not os.path.isfile(path) or open(path).read() != text:
            out.append(rel)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    if args.write:
        for rel, text in generated().items():
            with open(os.path.join(ROOT, rel), "w") as fh:
                fh.write(text)
            print(f"wrote {rel}")
        return 0
    bad = stale()
    for rel in bad:
        print(f"stale: {rel} (run python -m megatron_rl.tools.docs_gen --write)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
