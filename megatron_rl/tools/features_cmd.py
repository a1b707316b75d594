"""``megatron-rl features``: the feature matrix plus what is installed here."""

from __future__ import annotations

import importlib.metadata as md
import os
import re


def installed_versions() -> dict[str, str]:
    from megatron_rl.capabilities import te_version
    from megatron_rl.compat import cuda_available

    def version(pkg: str) -> str:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return "not installed"

    return {
        "torch": version("torch"),
        "megatron-core": version("megatron-core"),
        "transformer-engine": te_version() or "not installed",
        "apex": version("apex"),
        "CUDA": "available" if cuda_available() else "not available",
    }


def tested_stack() -> dict[str, str]:
    """The pinned CPU stack (requirements-cpu.txt): the versions the matrix was generated with."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pins = {}
    with open(os.path.join(root, "requirements-cpu.txt")) as fh:
        for line in fh:
            m = re.match(r"^(torch|megatron-core)==(\S+)", line.strip())
            if m:
                pins[m.group(1)] = m.group(2)
    pins["Python"] = "3.12"
    pins["TransformerEngine"] = "not installed (GPU rows say so)"
    return pins


def matrix_markdown() -> str:
    from megatron_rl.features import render_markdown

    return render_markdown(tested_stack()) + "\n"


def print_features(markdown: bool = False) -> None:
    if markdown:
        print(matrix_markdown(), end="")
        return
    from megatron_rl.features import FEATURES

    print("Installed: " + ", ".join(f"{k} {v}" for k, v in installed_versions().items()))
    print()
    width = max(len(f.name) for f in FEATURES)
    area = None
    for f in FEATURES:
        if f.area != area:
            area = f.area
            print(f"[{area}]")
        print(f"  {f.name:<{width}}  {f.status:<26}  {f.config}")
    print()
    print_compat_records()


def print_compat_records() -> None:
    """Every compat record, with ``UNTESTED`` where the installed versions are outside its range."""
    from megatron_rl.compat.registry import all_known_warnings, all_patches, all_workarounds, is_tested

    def versions(record) -> str:
        ranges = [f"{name} {spec}" for name, spec in (("megatron-core", record.megatron_versions),
                                                      ("torch", record.torch_versions)) if spec]
        return ", ".join(ranges or ["any version"]) + ("" if is_tested(record) else "; UNTESTED here")

    print("Patches applied by megatron_rl.compat.enable_compat():")
    for patch in all_patches():
        where = "CPU only" if patch.cpu_only else "always"
        print(f"  {patch.name} [{where}; {versions(patch)}]: {patch.reason}")
    print()
    print("Workarounds in the code (megatron_rl/compat, used where named):")
    for w in all_workarounds():
        print(f"  {w.name} [{versions(w)}; used in {w.used_in}]: {w.reason}")
    print()
    print("Known warnings silenced by message (megatron_rl/compat/warning_filters.py):")
    for k in all_known_warnings():
        where = "CPU only" if k.cpu_only else "always"
        print(f"  {k.name} [{where}; {k.category.__name__}; {versions(k)}]: {k.reason}")
