"""Reads torch's own DCP files (plain DCP, Megatron-Core torch_dist) through a checkpoint's byte I/O.

torch's readers open their own filesystem (``FileSystemReader`` locally, ``FsspecReader``
elsewhere); this one reads through the same ``Storage`` as everything else of an opened
checkpoint, so storage options, faults (``StorageError``) and concurrency are dcpbridge's.
The format is torch's: a pickled ``.metadata``, read by default without running code (only
the classes DCP metadata is made of, then checked, see ``dcp_pickle`` and ``dcp_checks``),
whose ``storage_data`` places each item in a ``.distcp`` file; tensors are ``torch.save``
bytes of the whole stored chunk (loaded with ``weights_only=True``), objects raw bytes.
"""

from __future__ import annotations

import functools
import io
import math
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dcpbridge.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    PickleRefusedError,
)
from dcpbridge.formats.dcp_checks import check_metadata
from dcpbridge.formats.dcp_pickle import loads_dcp_metadata
from dcpbridge.formats.dcp_transforms import (
    TORCH_SAVE_SLACK,
    decode,
    descriptors_of,
    object_limit,
)
from dcpbridge.storage.backends.store import RangeRead, Storage
from dcpbridge.storage.format.paths import Location

DCP_METADATA = ".metadata"
_BATCH_BYTES = 256 << 20  # bytes fetched at once


def read_dcp_metadata(
    location: Location, files: Storage, *, allow_pickle: bool = False
) -> Metadata:
    """``.metadata``, unpickled without running code and checked against the files.

    A pickle that needs classes beyond DCP's raises ``PickleRefusedError``, unless
    ``allow_pickle``: then it is unpickled with ``pickle`` (the caller trusts the checkpoint).
    """
    raw = files.read_file(f"{location.root.rstrip('/')}/{DCP_METADATA}")  # a hidden name
    where = f"{location.url}/{DCP_METADATA}"
    try:
        metadata = loads_dcp_metadata(raw, where)
    except PickleRefusedError:
        if not allow_pickle:
            raise
        return _trusted_metadata(raw, location)
    return check_metadata(metadata, where, files.file_sizes())


def _trusted_metadata(raw: bytes, location: Location) -> Metadata:
    """``pickle.loads`` of ``.metadata``, which the caller allowed."""
    try:
        metadata = pickle.loads(raw)
    except Exception as e:
        raise CorruptCheckpointError(f"{location.url}: {DCP_METADATA} cannot be read: {e}") from e
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(
            f"{location.url}: {DCP_METADATA} holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


def stored_place(location: Location, metadata: Metadata, index: MetadataIndex) -> Any:
    """Where ``index``'s bytes are: torch's ``_StorageInfo`` (file, offset, length)."""
    storage = metadata.storage_data or {}
    info = storage.get(index)
    if info is None:
        raise CorruptCheckpointError(f"{location.url}: no stored bytes for {index.fqn!r}")
    return info


def stored_chunks(
    metadata: Metadata,
) -> dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and sizes of each stored tensor chunk, by (key, offsets)."""
    out = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for c in md.chunks:
                out[(fqn, tuple(c.offsets))] = (md.properties.dtype, tuple(c.sizes))
    return out


def chunk_limit(dtype: torch.dtype, sizes: tuple[int, ...]) -> int:
    """The most bytes a stored tensor chunk's ``torch.save`` blob may decode to."""
    return math.prod(sizes) * dtype.itemsize + TORCH_SAVE_SLACK


def _decoded_limit(stored: tuple[torch.dtype, tuple[int, ...]] | None) -> int | None:
    """What a read item's stored bytes may decode to: its chunk's ``chunk_limit`` (None for
    an object)."""
    return None if stored is None else chunk_limit(*stored)


def undo_transforms(
    info: Any, raw: memoryview, what: str, limit: Callable[[], int | None]
) -> bytes | memoryview:
    """An item's stored bytes with DCP's stream extensions undone (``raw`` if it has none);
    ``limit()`` bounds what it may decode to (None: an object, bounded by its stored size)."""
    descriptors = descriptors_of(info, what)
    if not descriptors:
        return raw
    bound = limit()
    return decode(
        raw, descriptors, limit=object_limit(len(raw)) if bound is None else bound, what=what
    )


class DcpFileReader(StorageReader):
    """DCP ``StorageReader`` for torch's file format over one opened checkpoint's byte I/O."""

    def __init__(
        self,
        location: Location,
        files: Storage,
        *,
        thread_count: int = 4,
        allow_pickle: bool = False,
    ) -> None:
        super().__init__()
        self.location, self.files = location, files
        self.allow_pickle = allow_pickle
        self.thread_count = max(1, thread_count)
        self.metadata: Metadata | None = None
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] | None
        self._chunks = None  # stored_chunks of the metadata, once asked for

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None and str(checkpoint_id) != self.location.url:
            raise InvalidArgumentError(
                "a DcpFileReader is bound to the checkpoint it was opened for"
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return bool(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is None:
            self.metadata = read_dcp_metadata(
                self.location, self.files, allow_pickle=self.allow_pickle
            )
            if getattr(self.metadata, "storage_meta", None) is None:
                self.metadata.storage_meta = StorageMeta()
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, **_: Any) -> None:
        if metadata is not self.metadata:
            self._chunks = None
        self.metadata = metadata

    def _chunk(self, item: ReadItem) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """The dtype and sizes of the stored chunk ``item`` reads (None for an object)."""
        if item.type == LoadItemType.BYTE_IO:
            return None
        if self._chunks is None:
            self._chunks = stored_chunks(self.read_metadata())
        index = item.storage_index
        found = self._chunks.get((index.fqn, tuple(index.offset or ())))
        if found is None:
            raise CorruptCheckpointError(
                f"{self.location.url}: {index.fqn!r} has no chunk at {list(index.offset or ())}"
            )
        return found

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        metadata = self.read_metadata()
        batch: list[RangeRead] = []
        size = 0
        for item in plan.items:
            info = stored_place(self.location, metadata, item.storage_index)
            buf = memoryview(bytearray(int(info.length)))
            path = self.location.path(str(info.relative_path))
            what = f"{self.location.url}: {item.storage_index.fqn!r} in {info.relative_path}"
            stored = self._chunk(item)
            limit = functools.partial(_decoded_limit, stored)
            decoded = functools.partial(undo_transforms, info, what=what, limit=limit)
            deliver = _delivery(item, buf, planner, decoded, what, stored)
            batch.append(RangeRead(path, int(info.offset), buf, deliver))
            size += len(buf)
            if size >= _BATCH_BYTES:
                self.files.fetch(batch, self.thread_count)
                batch, size = [], 0
        if batch:
            self.files.fetch(batch, self.thread_count)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _delivery(
    item: ReadItem,
    raw: memoryview,
    planner: LoadPlanner,
    decoded: Callable[[memoryview], bytes | memoryview],
    what: str,
    stored: tuple[torch.dtype, tuple[int, ...]] | None,
) -> Any:
    """What to do with ``item``'s fetched bytes (``decoded`` undoes DCP's transforms): hand
    an object over, or copy a tensor's box out of the chunk, which must be the ``stored``
    dtype and sizes its metadata names (a blob of another tensor is refused, never cast or cut)."""

    def deliver() -> None:
        data = decoded(raw)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(bytes(data)))
            return
        try:
            chunk = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CorruptCheckpointError(f"{what}: not a stored tensor: {e}") from e
        if not isinstance(chunk, torch.Tensor):
            raise CorruptCheckpointError(f"{what}: holds a {type(chunk).__name__}, not a tensor")
        assert stored is not None
        if (chunk.dtype, tuple(chunk.shape)) != stored:
            raise CorruptCheckpointError(
                f"{what}: holds a {chunk.dtype} tensor of shape {tuple(chunk.shape)} where its "
                f"metadata names a {stored[0]} chunk of {stored[1]}"
            )
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            chunk = chunk.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.shape != chunk.shape:
            raise CorruptCheckpointError(
                f"{item.storage_index.fqn!r}: stored chunk gives {tuple(chunk.shape)}, "
                f"the read needs {tuple(target.shape)}"
            )
        target.copy_(chunk)
        planner.commit_tensor(item, target)

    return deliver
