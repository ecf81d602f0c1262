"""Read DCP checkpoints as data: a restricted unpickler for `.metadata`, weights-only for every blob.

DCP's FileSystemReader reads `.metadata` with plain `pickle.load`, and DefaultLoadPlanner reads
non-tensor values (the optimizer's param_groups) with `torch.load(weights_only=False)`: a crafted
checkpoint directory would run code in either. Every meshrun read goes through `SafeReader` and
`SafePlanner` instead (`read_metadata`, `load`), which accept only the classes a Metadata holds
on torch 2.13 (found by recording `find_class` while reading real checkpoints) and plain values.
Early Python 3.11 releases pickle an Enum member by name, as `getattr(TheEnum, "NAME")` (3.11.2,
Debian 12's python3.11, does; 3.11.7 and 3.12 pickle it by value). Both read: `getattr` resolves to
a function that returns a member of an allow-listed Enum and refuses every other attribute.
"""

from __future__ import annotations

import enum
import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from meshrun.checkpoint.manifest import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) -> exactly what a pickled Metadata refers to; nothing else resolves.
_ALLOWED = {
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # str -> torch.layout, a table lookup
    ("torch", "Size"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
}
MAX_METADATA_BYTES = 1 << 30


def _enum_member(cls: object, name: object) -> enum.Enum:
    """`getattr` as an Enum member pickled by name uses it, and nothing more: `cls` came through
    find_class (an allow-listed class), and only one of its members comes back."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"builtins.getattr is allowed in DCP metadata only for an Enum member, "
                                 f"not {getattr(cls, '__name__', type(cls).__name__)}.{name!r}")


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # vars: no lazy imports
            return vars(torch)[name]
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed in DCP metadata")


def loads_metadata(data: bytes) -> Metadata:
    """Unpickle DCP metadata bytes, resolving only the allow-listed classes; anything else raises."""
    metadata = _RestrictedUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not a DCP Metadata")
    for info in metadata.storage_data.values():  # where the data lies: a file of this directory only
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise pickle.UnpicklingError(f"names the data file {rel!r}, not a file of the checkpoint directory")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through the restricted unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        size = path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise pickle.UnpicklingError(f"{path} is {size} bytes, more than DCP metadata ever is")
        metadata = loads_metadata(path.read_bytes())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that reads non-tensor values with weights_only=True (plain values only)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_metadata(path: Path) -> Metadata:
    """DCP metadata of the checkpoint at `path`, as a one-line CheckpointError when unreadable."""
    try:
        return SafeReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same user problem
        raise CheckpointError(f"{path} has no readable DCP metadata ({type(exc).__name__}: {exc}); "
                              "give a checkpoint directory such as RUN/checkpoints/step-00000010") from None


def load(state_dict: dict, path: Path, *, no_dist: bool = False) -> None:
    """`dcp.load` into `state_dict` in place, through SafeReader and SafePlanner."""
    with warnings.catch_warnings():  # no_dist: "assuming the intent is to load in a single process": it is
        if no_dist:
            warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state_dict, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=no_dist)
        except CheckpointException as exc:  # one line for the user, not a traceback per rank
            failures = list(getattr(exc, "failures", {}).values())
            cause = failures[0] if failures else exc  # (exception, traceback frames) per failed rank
            cause = cause[0] if isinstance(cause, tuple) and cause else cause
            text = str(cause).strip().splitlines()
            detail = next((line for line in reversed(text) if "GLOBAL" in line), text[0] if text else "")
            raise CheckpointError(f"{path} does not load ({type(cause).__name__}: {detail.strip()})") from None
