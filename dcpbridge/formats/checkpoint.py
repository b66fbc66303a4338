"""How a checkpoint is opened: once, into a ``Checkpoint`` that knows its format and reads its bytes.

``open_checkpoint`` resolves the URL and detects the format once; the handle owns the
location and its byte I/O and serves every reader: DCP-protocol loads (``reader``), the
offline tools (``dcpbridge.formats.sources``), and each format's conventions (torch_dist's
objects stored as one-element lists and its ``common.pt``). Formats: dcpbridge
(``dcpbridge.json``), plain DCP (pickled ``.metadata`` + ``.distcp``), Megatron-Core
``torch_dist`` (DCP plus ``metadata.json`` and ``common.pt``), and single files
(``torch.save``, safetensors); a safetensors folder (Hugging Face's layout, or DCP's
``HuggingFaceStorageWriter`` shards) also loads with ``dcpbridge.load``.
"""

from __future__ import annotations

import enum
import io
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import StorageReader

from dcpbridge.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NotACheckpointError,
)
from dcpbridge.formats.dcp_files import DCP_METADATA, DcpFileReader, stored_place, undo_transforms
from dcpbridge.formats.safetensors_files import (
    SAFETENSORS_INDEX,
    SafetensorsReader,
    open_safetensors,
)
from dcpbridge.model.mapping import COMMON_KEY
from dcpbridge.planners import load_object
from dcpbridge.storage import METADATA_FILE, FsspecCheckpointReader, Location, resolve
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.store import RangeRead, Storage
from dcpbridge.storage.read.reader import diagnose_missing_metadata, read_object_bytes

MEGATRON_CONFIG = "metadata.json"
MEGATRON_COMMON = "common.pt"


class Format(str, enum.Enum):
    """The checkpoint formats dcpbridge reads."""

    DCPBRIDGE = "dcpbridge"
    DCP = "dcp"
    TORCH_DIST = "torch_dist"
    TORCH = "torch"
    SAFETENSORS = "safetensors"

    @property
    def pickled_metadata(self) -> bool:
        return self in (Format.DCP, Format.TORCH_DIST)

    @property
    def description(self) -> str:
        return {
            Format.DCPBRIDGE: "dcpbridge checkpoint",
            Format.DCP: "torch.distributed.checkpoint checkpoint",
            Format.TORCH_DIST: "Megatron-Core torch_dist checkpoint",
            Format.TORCH: "torch.save file",
            Format.SAFETENSORS: "safetensors checkpoint",
        }[self]


def _is_file(location: Location) -> bool:
    try:
        return bool(location.fs.isfile(location.root))
    except OSError:
        return False


def _file_format(location: Location) -> Format:
    if location.root.endswith(".safetensors"):
        return Format.SAFETENSORS
    with location.fs.open(location.root, "rb") as f:
        head = f.read(9)
    # safetensors: an 8-byte little-endian header length, then the JSON header
    if len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") < 1 << 30:
        return Format.SAFETENSORS
    return Format.TORCH


def _megatron_backend(location: Location, files: Storage) -> str:
    raw = files.read_file(location.path(MEGATRON_CONFIG))
    try:
        backend = json.loads(raw).get("sharded_backend")
    except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, too deep
        raise CorruptCheckpointError(
            f"{location.url}: {MEGATRON_CONFIG} is not a Megatron-Core checkpoint config"
        ) from None
    return str(backend)


def detect(location: Location, files: Storage | None = None) -> Format:
    """The format stored at ``location``; raises if it holds none (naming what it found)."""
    store = files or storage_for(location)
    if store.exists(METADATA_FILE):
        return Format.DCPBRIDGE
    if _is_file(location):
        return _file_format(location)
    names = set(store.list_names())
    if MEGATRON_CONFIG in names:
        backend = _megatron_backend(location, store)
        if backend != "torch_dist":
            raise NotACheckpointError(
                f"{location.url} is a Megatron-Core checkpoint with the {backend!r} backend; "
                "dcpbridge reads the 'torch_dist' backend only"
            )
        if DCP_METADATA not in names:
            raise IncompleteCheckpointError(f"{location.url}: {DCP_METADATA} is missing")
        return Format.TORCH_DIST
    if DCP_METADATA in names:
        if MEGATRON_COMMON in names:
            raise IncompleteCheckpointError(
                f"{location.url} looks like a Megatron-Core torch_dist checkpoint whose save did "
                f"not finish: {MEGATRON_COMMON} and {DCP_METADATA} exist but {MEGATRON_CONFIG}, "
                "written last, does not"
            )
        return Format.DCP
    if SAFETENSORS_INDEX in names or any(n.endswith(".safetensors") for n in names):
        return Format.SAFETENSORS
    distcp = sorted(n for n in names if n.endswith(".distcp"))
    if distcp:
        raise IncompleteCheckpointError(
            f"{location.url} is an incomplete torch.distributed.checkpoint checkpoint: "
            f"{len(distcp)} data file(s) (e.g. {distcp[0]}) exist but {DCP_METADATA} does not"
        )
    raise diagnose_missing_metadata(store, location.url)


@dataclass
class Checkpoint:
    """A checkpoint opened once: where it is, its format, and the byte I/O every read uses."""

    location: Location
    format: Format
    files: Storage
    storage_options: dict[str, Any] | None = None
    allow_pickle: bool = False

    def reader(self, *, thread_count: int = 4, verify_checksums: bool = True) -> StorageReader:
        """A DCP ``StorageReader`` of this checkpoint (DCP metadata read without running code,
        or with ``pickle`` where ``allow_pickle`` and other classes are needed)."""
        if self.format == Format.DCPBRIDGE:
            return FsspecCheckpointReader(
                self.location,  # type: ignore[arg-type]  (resolved already)
                storage_options=self.storage_options,
                thread_count=thread_count,
                verify_checksums=verify_checksums,
            )
        if self.format == Format.SAFETENSORS:
            files = open_safetensors(self.location, self.files, self.storage_options)
            return SafetensorsReader(
                files, storage_options=self.storage_options, thread_count=thread_count
            )
        if not self.format.pickled_metadata:
            raise NotACheckpointError(
                f"{self.location.url} is a single {self.format.description}, not a sharded "
                "checkpoint; turn it into one with `dcpbridge convert SRC DST --to dcpbridge`"
            )
        return DcpFileReader(
            self.location, self.files, thread_count=thread_count, allow_pickle=self.allow_pickle
        )

    def loaded_objects(self, loaded: dict[str, Any]) -> dict[str, Any]:
        """Loaded objects by storage key, unwrapped from torch_dist's one-element lists."""
        if self.format != Format.TORCH_DIST:
            return loaded
        return {k: unwrap_megatron_object(k, v) for k, v in loaded.items()}

    def common_state(self, objects: dict[str, Any]) -> Any:
        """The common state as one object: the ``__common__`` object of older dcpbridge
        saves, or Megatron's ``common.pt``; None where entries are stored by key."""
        if self.format != Format.TORCH_DIST:
            return objects.get(COMMON_KEY)
        return self.read_common()

    def read_common(self) -> Any:
        """``common.pt`` of a torch_dist checkpoint (safe loading unless ``allow_pickle``):
        a dict, as Megatron-Core and dcpbridge write it."""
        what = self.location.path(MEGATRON_COMMON)
        common = load_object(
            io.BytesIO(self.common_bytes()), allow_pickle=self.allow_pickle, what=what
        )
        if not isinstance(common, dict):
            raise CorruptCheckpointError(
                f"{what} holds a {type(common).__name__}, not the dict of a common state"
            )
        return common

    def common_bytes(self) -> bytes:
        try:
            return self.files.read_file(self.location.path(MEGATRON_COMMON))
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"{self.location.url}: {MEGATRON_COMMON} is missing"
            ) from None

    def object_bytes(self, metadata: Metadata, key: str) -> bytes:
        """Object ``key`` as ``torch.save`` bytes, the way a dcpbridge checkpoint stores it."""
        if self.format == Format.DCPBRIDGE:
            return read_object_bytes(self.location, metadata, key)
        if self.format == Format.TORCH_DIST and key == COMMON_KEY:
            return self.common_bytes()
        blob = self._stored_blob(metadata, key)
        if self.format != Format.TORCH_DIST:
            return blob
        buf = io.BytesIO()
        torch.save(unwrap_megatron_object(key, self._stored_value(blob, key)), buf)
        return buf.getvalue()

    def is_legacy_shard_list(self, metadata: Metadata, key: str) -> bool:
        """Whether torch_dist object ``key`` is the empty ``shards`` list that older dcpbridge
        saves without sharded state stored (DCP keeps a list without tensors as an object):
        no object of the checkpoint, which offline tools skip."""
        if self.format != Format.TORCH_DIST or key != LEGACY_SHARD_LIST:
            return False
        return self._stored_value(self._stored_blob(metadata, key), key) == []

    def _stored_blob(self, metadata: Metadata, key: str) -> bytes:
        """Object ``key``'s stored bytes (DCP's transforms undone)."""
        info = stored_place(self.location, metadata, MetadataIndex(key))
        path = self.location.path(str(info.relative_path))
        buf = memoryview(bytearray(int(info.length)))
        self.files.fetch([RangeRead(path, int(info.offset), buf)], threads=1)
        what = f"{self.location.url}: {key!r} in {info.relative_path}"
        return bytes(undo_transforms(info, buf, what, limit=lambda: None))

    def _stored_value(self, blob: bytes, key: str) -> Any:
        return load_object(io.BytesIO(blob), allow_pickle=self.allow_pickle, what=f"{key!r}")


LEGACY_SHARD_LIST = "shards"  # see ``Checkpoint.is_legacy_shard_list``


def unwrap_megatron_object(key: str, value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise CorruptCheckpointError(
            f"object {key!r}: a torch_dist checkpoint stores each object as a list, "
            f"found {type(value).__name__}"
        )
    return value[0]


def load_torch_file(path: str, *, weights_only: bool) -> Any:
    """``torch.load`` of local file ``path`` onto the CPU, memory-mapped where the file allows."""
    try:
        return torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=weights_only)


def open_checkpoint(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> Checkpoint:
    """Open the checkpoint or file at ``url``: resolve it and detect its format, once."""
    location = resolve(url, storage_options)
    files = storage_for(location)
    return Checkpoint(location, detect(location, files), files, storage_options, allow_pickle)
