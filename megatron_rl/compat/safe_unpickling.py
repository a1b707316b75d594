"""Loading a checkpoint never runs code from it.

torch's distributed checkpoint reads two kinds of pickles that can name any Python callable, and
megatron-core's ``dist_checkpointing.load`` reaches both:

* each part's ``.metadata``: ``FileSystemReader.read_metadata`` is a plain ``pickle.load``;
* ``_extra_state`` and other byte items inside ``.distcp`` files: ``DefaultLoadPlanner.load_bytes``
  calls ``torch.load(weights_only=False)``.

A crafted checkpoint could run a command through either.  Here ``.metadata`` is read by an
unpickler that admits only the classes torch's metadata is made of (:data:`METADATA_GLOBALS`), and
byte items are read with ``torch.load(weights_only=True)`` (tensors, containers and numbers).  A
file that names anything else raises :class:`UnsafeCheckpointFile`, which the checkpoint loader
turns into one ``CheckpointError`` line; nothing it names is imported or called.

Our own files (``trainer_state.pt``, ``rng/*.pt``) are read with ``weights_only=True`` by
:mod:`megatron_rl.engine.checkpoint`; a part's legacy ``common.pt``, which megatron-core reads
without ``weights_only``, by :mod:`megatron_rl.compat.weights_only_common`.
"""

from __future__ import annotations

import io
import pickle

import torch

from megatron_rl.compat.records import MEGATRON_TESTED, TORCH_TESTED, Patch, register_patch


class UnsafeCheckpointFile(pickle.UnpicklingError):
    """A checkpoint file asks to load something a checkpoint may not (a callable, a class outside
    the allow-list)."""


_DCP = "torch.distributed.checkpoint"
# What torch 2.13's distributed checkpoint metadata is made of, as written by megatron-core 0.19.2
# (listed from the metadata of TP/PP/DP/distributed-optimizer checkpoints).  Each is a dataclass,
# an enum or torch's own layout helper: constructing one runs no code of the file's choosing.
METADATA_GLOBALS = frozenset({
    (f"{_DCP}.metadata", "Metadata"),
    (f"{_DCP}.metadata", "MetadataIndex"),
    (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"),
    (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),
    (f"{_DCP}.planner", "SavePlan"),
    (f"{_DCP}.planner", "WriteItem"),
    (f"{_DCP}.planner", "WriteItemType"),
    (f"{_DCP}.planner", "TensorWriteData"),
    (f"{_DCP}.planner", "BytesIOWriteData"),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
})


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler for torch distributed-checkpoint metadata: :data:`METADATA_GLOBALS` and torch
    dtypes, nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointFile(f"it names {module}.{name}, which checkpoint metadata never holds")


def load_metadata(stream) -> object:
    """Unpickle a ``.metadata`` stream with :class:`MetadataUnpickler`."""
    return MetadataUnpickler(stream).load()


def check_metadata_file(path: str) -> None:
    """Read a ``.metadata`` file with :class:`MetadataUnpickler` before torch does: torch answers a
    failed read by looking for per-rank metadata and logs both tracebacks, so the refusal is made
    here, first, with one line."""
    with open(path, "rb") as fh:
        load_metadata(fh)


def load_byte_item(value: io.BytesIO) -> object:
    """``torch.load`` of a checkpoint's byte item, refusing anything but tensors and plain data."""
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointFile(f"a byte item is not plain data ({str(err).splitlines()[0][:160]})") from None


def install() -> None:
    """Make checkpoint reads safe in this process (idempotent).  Registered as a patch, and called
    by the checkpoint loader too, so a library user who never enabled compat is covered."""
    from torch.distributed.checkpoint import default_planner, filesystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    reader = filesystem.FileSystemReader
    if getattr(reader.read_metadata, "_megatron_rl_safe", False):
        return

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = load_metadata(metadata_file)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = load_byte_item(value)
        if self.flatten_state_dict:
            default_planner.set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded

    read_metadata._megatron_rl_safe = True
    reader.read_metadata = read_metadata
    default_planner.DefaultLoadPlanner.load_bytes = load_bytes


register_patch(
    Patch(
        name="dcp.no_code_from_checkpoints",
        megatron_versions=MEGATRON_TESTED,
        torch_versions=TORCH_TESTED,
        reason=(
            "torch.distributed.checkpoint FileSystemReader.read_metadata is a plain pickle.load and "
            "DefaultLoadPlanner.load_bytes is torch.load(weights_only=False), both reached through "
            "megatron's dist_checkpointing.load: a crafted checkpoint would run code; an allow-list "
            "unpickler and weights_only=True replace them"
        ),
        apply=install,
    )
)
