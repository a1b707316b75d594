"""A part's legacy ``common.pt`` is read weights-only, whatever the environment says.

megatron-core 0.19.2 (``>=0.19.2,<0.20``): ``dist_checkpointing.load`` reads ``<part>/common.pt``
whenever that file exists (``serialization.load_common_state_dict`` ->
``strategies.common.load_common``), with a ``torch.load`` that does not pass ``weights_only``.
torch then takes it from the environment: ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``, which some
clusters' images set, makes it a plain unpickle, and a crafted ``common.pt`` runs code.

This project never writes ``common.pt`` (torch_dist keeps the common state inside the ``.distcp``
files), and :func:`megatron_rl.engine.checkpoint.check_checkpoint` refuses a file ``meta.json``
does not list; this patch covers a ``common.pt`` that a checkpoint's author listed: it is read
with ``torch.load(weights_only=True)`` (an explicit ``weights_only`` is one the environment
cannot override), and anything but tensors and plain data raises
:class:`~megatron_rl.compat.safe_unpickling.UnsafeCheckpointFile`.  Local paths only: megatron's
multi-storage-client paths are not used here.
"""

from __future__ import annotations

import os
import pickle

import torch

from megatron_rl.compat.records import MEGATRON_TESTED, TORCH_TESTED, Patch, register_patch
from megatron_rl.compat.safe_unpickling import UnsafeCheckpointFile


def load_common(checkpoint_dir: str):
    """megatron's ``load_common``, weights-only."""
    from megatron.core.dist_checkpointing.mapping import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as err:
        raise CheckpointingException(f"Common file {path} does not exist") from err
    except pickle.UnpicklingError as err:
        first = (str(err).splitlines() or [""])[0]
        raise UnsafeCheckpointFile(f"{COMMON_STATE_FNAME} is not plain data ({first[:160]})") from None


def install() -> None:
    """Replace megatron's ``load_common`` where it is defined and where ``serialization`` imported
    it (idempotent).  Registered as a patch, and called by the checkpoint loader too."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common

    common.load_common = load_common
    serialization.load_common = load_common


register_patch(
    Patch(
        name="dist_checkpointing.common_pt_weights_only",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
        reason=(
            "megatron-core's dist_checkpointing.strategies.common.load_common reads a part's common.pt with "
            "torch.load without weights_only, so TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 turns it into a plain "
            "unpickle that runs code from the file; it is read with weights_only=True instead"
        ),
        apply=install,
    )
)
