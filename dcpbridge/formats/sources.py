"""Any checkpoint format opened for offline tools: its tensors, objects and box reads.

``open_source`` reads metadata only. ``Source.read`` returns one box of a tensor through the
same load planner as ``dcpbridge.load``: dcpbridge checkpoints and safetensors files fetch just
the box's byte ranges; plain DCP and torch_dist files store whole chunks as ``torch.save``
blobs, which are read whole (so callers read those box by box, see ``reads_whole_chunks``);
``torch.save`` files are memory-mapped. Every format is opened once by
``dcpbridge.formats.checkpoint.open_checkpoint``, whose handle also reads the objects.
"""

from __future__ import annotations

import io
import json
import math
import operator
import os
import pickle
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import StorageReader

from dcpbridge.errors import (
    CorruptCheckpointError,
    InvalidShardError,
    MissingEntryError,
    NotACheckpointError,
    PickleRefusedError,
)
from dcpbridge.formats.checkpoint import (
    MEGATRON_COMMON,
    MEGATRON_CONFIG,
    Checkpoint,
    Format,
    load_torch_file,
    open_checkpoint,
)
from dcpbridge.formats.dcp_files import stored_place
from dcpbridge.formats.safetensors_files import SafetensorsReader, open_safetensors
from dcpbridge.model.mapping import COMMON_KEY, ShardedTensor
from dcpbridge.model.state import HOLE, extract, fill_holes
from dcpbridge.planners import ShardedLoadPlanner, load_object
from dcpbridge.planners.errors import SerializationError
from dcpbridge.planners.leaves import not_dense
from dcpbridge.planners.walk import iter_leaves
from dcpbridge.storage import Location, StorageIndex

Shape = tuple[int, ...]
_DISTCP = re.compile(r"^__(\d+)_\d+\.distcp\Z")


@dataclass(frozen=True, slots=True)
class ChunkInfo:
    """One stored chunk of a tensor: its box, the rank that wrote it, and where it lives."""

    offsets: Shape
    sizes: Shape
    nbytes: int
    rank: int | None = None
    file: str | None = None
    offset: int | None = None
    stored_nbytes: int | None = None  # bytes in the file (torch.save framing for DCP)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    key: str
    shape: Shape
    dtype: torch.dtype
    chunks: tuple[ChunkInfo, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    nbytes: int | None = None
    rank: int | None = None
    file: str | None = None
    offset: int | None = None


@dataclass
class Source:
    """A checkpoint opened for reading without a process group: what it stores, box by box."""

    checkpoint: Checkpoint
    tensors: dict[str, TensorInfo]
    objects: dict[str, ObjectInfo]
    header: dict[str, Any] = field(default_factory=dict)  # what the checkpoint says of itself
    # A read loads whole stored chunks (torch's DCP files): read each box at once, not in slabs.
    reads_whole_chunks: bool = False

    @property
    def location(self) -> Location:
        return self.checkpoint.location

    @property
    def format(self) -> Format:
        return self.checkpoint.format

    @property
    def allow_pickle(self) -> bool:
        return self.checkpoint.allow_pickle

    def read(self, key: str, offsets: Shape, sizes: Shape) -> torch.Tensor:
        """Elements ``offsets``+``sizes`` of tensor ``key`` (a new or memory-mapped tensor)."""
        raise NotImplementedError

    def box(self, key: str, offsets: Shape, sizes: Shape) -> TensorInfo:
        """Tensor ``key``'s facts once the box is known to lie inside it: an absent key raises
        ``MissingEntryError``, a box outside it ``InvalidShardError``, never a short read."""
        info = self.tensors.get(key)
        if info is None:
            raise MissingEntryError(f"{self.location.url}: the checkpoint has no tensor {key!r}")
        try:
            offsets, sizes = tuple(map(operator.index, offsets)), tuple(map(operator.index, sizes))
        except TypeError:
            raise InvalidShardError(f"{key!r}: a box needs integer offsets and sizes") from None
        if any(n < 0 for n in sizes):
            raise InvalidShardError(f"{key!r}: the box's sizes {sizes} must be >= 0")
        ShardedTensor.from_box(key, torch.empty(sizes, device="meta"), info.shape, offsets)
        return info

    def object_bytes(self, key: str) -> bytes:
        """Object ``key`` as ``torch.save`` bytes, the way a dcpbridge checkpoint stores it."""
        raise NotImplementedError

    def object(self, key: str) -> Any:
        """Object ``key`` unpickled (``weights_only`` unless the source allows pickle)."""
        blob = self.object_bytes(key)
        return load_object(io.BytesIO(blob), allow_pickle=self.allow_pickle, what=f"{key!r}")

    def common_state(self) -> Any:
        """The common state kept as one object (an older dcpbridge's ``__common__``,
        torch_dist's common.pt, a torch file's other values); {} where there is none."""
        return self.object(COMMON_KEY) if COMMON_KEY in self.objects else {}

    def close(self) -> None:
        """Release what the source holds open (files, scratch space)."""


class ProtocolSource(Source):
    """Reads boxes with ``ShardedLoadPlanner`` and the checkpoint's DCP reader, set up once."""

    reader: StorageReader
    metadata: Metadata

    def bind(self, reader: StorageReader, metadata: Metadata) -> None:
        self.reader, self.metadata = reader, metadata
        reader.set_up_storage_reader(metadata, True)

    def read(self, key: str, offsets: Shape, sizes: Shape) -> torch.Tensor:
        info = self.box(key, offsets, sizes)
        out = torch.empty(sizes, dtype=info.dtype)
        if out.numel() == 0:
            return out
        planner = ShardedLoadPlanner()
        planner.set_up_planner(
            {"t": ShardedTensor.from_box(key, out, info.shape, offsets)}, self.metadata
        )
        self.reader.read_data(planner.create_local_plan(), planner).wait()
        return out

    def object_bytes(self, key: str) -> bytes:
        return self.checkpoint.object_bytes(self.metadata, key)

    def common_state(self) -> Any:
        if self.format == Format.TORCH_DIST:
            return self.checkpoint.read_common()
        return super().common_state()


class _TorchFileSource(Source):
    """A ``torch.save`` file: tensor leaves by dotted path, everything else common state."""

    values: dict[str, torch.Tensor]
    common: Any
    scratch: tempfile.TemporaryDirectory[str] | None = None

    def read(self, key: str, offsets: Shape, sizes: Shape) -> torch.Tensor:
        self.box(key, offsets, sizes)
        box = self.values[key][tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        return box.resolve_conj().resolve_neg()  # the values a conjugate/negative view shows

    def object_bytes(self, key: str) -> bytes:
        buf = io.BytesIO()
        torch.save(self.common_state(), buf)
        return buf.getvalue()

    def common_state(self) -> Any:
        return self.common

    def close(self) -> None:
        self.values, self.common = {}, {}
        if self.scratch is not None:
            self.scratch.cleanup()
            self.scratch = None


# -- opening ---------------------------------------------------------------------------------


def _chunks_by_fqn(metadata: Metadata, where: Callable[[MetadataIndex], ChunkInfo | None]) -> dict:
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        chunks = []
        for c in md.chunks:
            placed = where(MetadataIndex(fqn, c.offsets))
            nbytes = math.prod(c.sizes) * md.properties.dtype.itemsize
            chunks.append(
                ChunkInfo(
                    tuple(c.offsets),
                    tuple(c.sizes),
                    nbytes,
                    placed.rank if placed else None,
                    placed.file if placed else None,
                    placed.offset if placed else None,
                    placed.nbytes if placed else None,
                )
            )
        out[fqn] = TensorInfo(fqn, tuple(md.size), md.properties.dtype, tuple(chunks))
    return out


def _open_dcpbridge(checkpoint: Checkpoint, verify: bool) -> Source:
    reader = checkpoint.reader(verify_checksums=verify)
    metadata = reader.read_metadata()
    index = metadata.storage_data
    assert isinstance(index, StorageIndex)

    def where(mi: MetadataIndex) -> ChunkInfo | None:
        it = index.get(mi)
        return ChunkInfo((), (), it.nbytes, it.rank, it.file, it.offset) if it else None

    objects = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            it = index.get(MetadataIndex(fqn))
            objects[fqn] = ObjectInfo(
                fqn, *((it.nbytes, it.rank, it.file, it.offset) if it else ())
            )
    header = {
        "format_version": int(str(metadata.version).rsplit("-", 1)[-1]),
        "save_id": index.save_id,
        "world_size": index.world_size,
        "created_unix": index.created_unix,
        "checksum": index.checksum_algorithm,
        "checksum_block_size": index.checksum_block_size,
        "files": list(index.files),
        "planner_data": metadata.planner_data,
    }
    src = ProtocolSource(checkpoint, _chunks_by_fqn(metadata, where), objects, header)
    src.bind(reader, metadata)
    return src


def _open_dcp(checkpoint: Checkpoint) -> Source:
    location = checkpoint.location
    reader = checkpoint.reader()
    metadata = reader.read_metadata()
    storage = metadata.storage_data or {}

    def place(mi: MetadataIndex) -> tuple[str | None, int | None, int | None, int | None]:
        if mi not in storage:
            return None, None, None, None
        info = stored_place(location, metadata, mi)
        m = _DISTCP.match(os.path.basename(str(info.relative_path)))
        rank = int(m.group(1)) if m else None
        return str(info.relative_path), int(info.offset), int(info.length), rank

    def where(mi: MetadataIndex) -> ChunkInfo | None:
        file, offset, length, rank = place(mi)
        return ChunkInfo((), (), length or 0, rank, file, offset) if file else None

    objects = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            if checkpoint.is_legacy_shard_list(metadata, fqn):
                continue
            file, offset, length, rank = place(MetadataIndex(fqn))
            objects[fqn] = ObjectInfo(fqn, length, rank, file, offset)
    files = sorted({str(i.relative_path) for i in storage.values()})
    header: dict[str, Any] = {"files": files, "format_version": getattr(metadata, "version", None)}
    if checkpoint.format == Format.TORCH_DIST:
        common = checkpoint.files.file_size(location.path(MEGATRON_COMMON))
        objects[COMMON_KEY] = ObjectInfo(COMMON_KEY, common, file=MEGATRON_COMMON)
        header["megatron_config"] = json.loads(
            checkpoint.files.read_file(location.path(MEGATRON_CONFIG))
        )
    tensors = _chunks_by_fqn(metadata, where)
    src = ProtocolSource(checkpoint, tensors, objects, header, reads_whole_chunks=True)
    src.bind(reader, metadata)
    return src


def _open_safetensors(checkpoint: Checkpoint) -> Source:
    files = open_safetensors(checkpoint.location, checkpoint.files, checkpoint.storage_options)
    tensors = {}
    for key, t in files.tensors.items():
        infos = (
            ChunkInfo(c.offsets, c.sizes, c.nbytes, None, c.file, c.start, c.nbytes)
            for c in t.chunks
        )
        tensors[key] = TensorInfo(key, t.shape, t.dtype, tuple(infos))
    reader = SafetensorsReader(files, storage_options=checkpoint.storage_options)
    src = ProtocolSource(checkpoint, tensors, {}, {"files": files.names})
    src.bind(reader, files.metadata)
    return src


def _open_torch_file(checkpoint: Checkpoint) -> Source:
    location, allow_pickle = checkpoint.location, checkpoint.allow_pickle
    scratch = None
    path = location.root
    if not location.is_local:  # memory-map a local copy
        scratch = tempfile.TemporaryDirectory(prefix="dcpbridge-")
        path = os.path.join(scratch.name, "checkpoint.pt")
        location.fs.get_file(location.root, path)
    try:
        loaded = load_torch_file(path, weights_only=not allow_pickle)
    except Exception as e:
        refused = isinstance(e, pickle.UnpicklingError) and not allow_pickle and _pickled(path)
        if scratch is not None:
            scratch.cleanup()
        if refused:
            raise PickleRefusedError(
                f"{location.url} holds Python objects that safe (weights_only) loading "
                "refuses; if you trust this file, pass allow_pickle=True (CLI: --allow-pickle)"
            ) from None
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise CorruptCheckpointError(
            f"{location.url}: not a readable torch.save file (damaged, cut short or another "
            f"format): {first:.200}"
        ) from e
    if not isinstance(loaded, dict):
        raise NotACheckpointError(
            f"{location.url} holds a {type(loaded).__name__}, not a state dict"
        )
    values: dict[str, torch.Tensor] = {}
    for leaf in iter_leaves(loaded):
        if isinstance(leaf.value, torch.Tensor):
            if leaf.path in values:
                raise CorruptCheckpointError(f"{location.url}: two tensors are named {leaf.path!r}")
            _check_dense(location.url, leaf.path, leaf.value)
            values[leaf.path] = leaf.value
    _, rest = extract(loaded, lambda x: isinstance(x, torch.Tensor))
    tensors = {
        k: TensorInfo(
            k,
            tuple(t.shape),
            t.dtype,
            (ChunkInfo((0,) * t.dim(), tuple(t.shape), t.numel() * t.element_size()),),
        )
        for k, t in values.items()
    }
    common = fill_holes(rest) if rest is not HOLE else {}
    objects = {COMMON_KEY: ObjectInfo(COMMON_KEY)} if common else {}
    src = _TorchFileSource(checkpoint, tensors, objects, {"files": [location.root]})
    src.values, src.common, src.scratch = values, common, scratch
    return src


def _check_dense(url: str, key: str, t: torch.Tensor) -> None:
    """Refuse a tensor whose elements are no dense bytes (sparse, nested, quantized: their
    bytes alone would lose the rest; meta: none), as a save refuses it, naming it."""
    if (what := not_dense(t)) is not None:
        meta = "meta " if t.is_meta else ""
        raise SerializationError(
            f"{url}: tensor {key!r} is a {what} {meta}tensor, which has no dense data to read"
        )


def _pickled(path: str) -> bool:
    """Whether safe loading refused ``path`` for what a torch.save file holds (a zip archive
    or a legacy pickle), not because its bytes are no torch.save file at all."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head.startswith((b"PK\x03\x04", b"\x80"))


def open_source(
    url: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    allow_pickle: bool = False,
    verify_checksums: bool = True,
) -> Source:
    """Open the checkpoint or file at ``url`` (any supported format), reading metadata only."""
    checkpoint = open_checkpoint(url, storage_options=storage_options, allow_pickle=allow_pickle)
    if checkpoint.format == Format.DCPBRIDGE:
        return _open_dcpbridge(checkpoint, verify_checksums)
    if checkpoint.format.pickled_metadata:
        return _open_dcp(checkpoint)
    if checkpoint.format == Format.SAFETENSORS:
        return _open_safetensors(checkpoint)
    return _open_torch_file(checkpoint)
