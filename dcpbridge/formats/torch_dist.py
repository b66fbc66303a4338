"""Save in Megatron-Core's ``torch_dist`` format, which ``dist_checkpointing.load`` reads.

On disk: torch's own DCP data files (``__{rank}_{i}.distcp``) and pickled ``.metadata``,
tensors under their ShardedTensor keys, each ShardedObject under its unique key stored as a
one-element list, the common state in ``common.pt``, and ``metadata.json`` naming the
backend, written last (Megatron treats a directory without it as unfinished).

Every file holds torch and Python standard-library types only, so Megatron-Core, ``dcp.load``
and ``torch.load(weights_only=True)`` read it where dcpbridge is not installed: ``.metadata``
is rebuilt from DCP's own classes (``portable_metadata``) before it is pickled.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from dcpbridge.errors import (
    CorruptCheckpointError,
    InvalidArgumentError,
    SerializationError,
    ShardingValidationError,
)
from dcpbridge.formats.checkpoint import MEGATRON_COMMON, MEGATRON_CONFIG
from dcpbridge.formats.dcp_checks import check_tiling
from dcpbridge.formats.dcp_files import DCP_METADATA
from dcpbridge.model.intake import SaveParts
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.planners import ShardedSavePlanner
from dcpbridge.planners.save_planner import serialize_object
from dcpbridge.storage import METADATA_FILE, Location, resolve
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.errors import (
    StorageError,
    is_storage_fault,
    storage_error,
    storage_faults,
)
from dcpbridge.storage.format.paths import fsspec_options
from dcpbridge.storage.write.commit import remove_stale_files

MEGATRON_CHECKPOINT_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


class TorchDistSavePlanner(ShardedSavePlanner):
    """Our save planning, with each ShardedObject stored as ``[data]`` as Megatron stores it."""

    list_wrapped_objects = True

    def create_local_plan(self) -> SavePlan:
        """The plan, refusing tensors torch's writer cannot size: while planning, before the
        directory's older checkpoint is unpublished."""
        plan = super().create_local_plan()
        for item in plan.items:
            if item.tensor_data is not None:
                _check_writable(item.index.fqn, item.tensor_data.properties.dtype)
        return plan


def _check_writable(key: str, dtype: torch.dtype) -> None:
    """Raise ``SerializationError`` naming ``key`` unless torch's DCP writer can size elements
    of ``dtype`` (it cannot for bits, uint1..7 and int1..7: its ``_element_size`` raises)."""
    try:
        torch._utils._element_size(dtype)
    except (TypeError, RuntimeError) as e:
        raise SerializationError(
            f"{key!r}: torch's DCP writer cannot store {dtype} elements (format "
            "'torch_dist'); save with format='dcpbridge', or view the tensor as an integer "
            "dtype of the same size"
        ) from e


def sharded_part(parts: SaveParts) -> list[Any]:
    """The shards a torch_dist save writes to its DCP files: all but the boxes of the common
    state's plain tensors, which go to ``common.pt`` with the rest of the common state. A
    shard stored under a key of the common state is refused, as dcpbridge's own format
    does: a load could not tell them apart (and the plain tensor's box would hide it)."""
    common, plain = parts.paths, parts.plain
    if not common:
        return parts.shards
    names = Counter(n for n in map(_stored_key, parts.shards) if n in common)
    clash = sorted(n for n, count in names.items() if count > (n in plain))  # a plain box: 1
    if clash:
        raise ShardingValidationError(
            f"{', '.join(map(repr, clash))}: a ShardedTensor or ShardedObject is stored under "
            "the key (dotted path) of a value of the common state; a torch_dist checkpoint "
            "cannot tell them apart on load: rename one of them"
        )
    return [s for s in parts.shards if not (isinstance(s, ShardedTensor) and s.key in plain)]


def _stored_key(shard: Any) -> str:
    """The DCP key a ShardedTensor or ShardedObject is stored under."""
    return shard.key if isinstance(shard, ShardedTensor) else shard.unique_key


class _PortableStorageMeta:
    """A torch writer whose ``.metadata`` names its checkpoint by a string, not a ``Path``
    (a pickled ``PosixPath`` cannot be unpickled on Windows)."""

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()  # type: ignore[misc]
        if meta is not None and meta.checkpoint_id is not None:
            meta.checkpoint_id = os.fspath(meta.checkpoint_id)
        return meta


class _FileWriter(_PortableStorageMeta, FileSystemWriter):
    """torch's local writer, with a portable ``StorageMeta``."""


class _FsspecWriter(_PortableStorageMeta, FsspecWriter):
    """torch's fsspec writer, with a portable ``StorageMeta``."""


class TorchDistWriter(StorageWriter):
    """torch's DCP writer for the data, plus Megatron's ``common.pt`` and ``metadata.json``.

    The coordinator removes the commit files of an earlier save to the directory before any
    data is written, then writes ``common.pt`` before the DCP metadata and ``metadata.json``
    after it.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        common_state: Any,
        *,
        storage_options: dict[str, Any] | None = None,
        thread_count: int = 1,
        sync_files: bool = True,
    ) -> None:
        super().__init__()
        self.location: Location = resolve(path, storage_options)
        self.common_state = common_state
        self.sync_files = sync_files
        self.store = storage_for(self.location)
        self._created: list[Any] = []  # data files this save opened (removed if it fails)
        self._committed: list[str] = []  # commit files it wrote, likewise
        if self.location.is_local:
            self.inner: StorageWriter = _FileWriter(
                self.location.root, thread_count=thread_count, sync_files=sync_files
            )
        else:  # os.sync() per file is pointless on object stores
            self.inner = _FsspecWriter(
                self.location.url,
                thread_count=thread_count,
                sync_files=False,
                **fsspec_options(storage_options),
            )

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and os.fspath(checkpoint_id) != self.location.url:
            raise InvalidArgumentError("TorchDistWriter is bound to one checkpoint location")
        self.inner.reset(None)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)

    def storage_meta(self) -> StorageMeta | None:
        return self.inner.storage_meta()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Before any data is overwritten, unpublish what this directory held, so that an
        # interrupted save leaves an incomplete checkpoint rather than a corrupt one: the old
        # DCP metadata and common state too (``dcp.load`` reads ``.metadata`` alone, and
        # would read the new data files through it).
        store = self.store
        names = (MEGATRON_CONFIG, METADATA_FILE, MEGATRON_COMMON)
        stale = [n for n in names if store.exists(n)]
        store.remove(stale[:1])  # metadata.json first: Megatron's mark of a finished save
        fs: Any = self.inner.fs  # type: ignore[attr-defined]
        dcp_metadata = fs.concat_path(self.inner.path, DCP_METADATA)  # type: ignore[attr-defined]
        with storage_faults(f"{self.location.url}: remove {DCP_METADATA}"):
            if fs.exists(dcp_metadata):  # a dot name, which dcpbridge's storage layer refuses
                fs.rm_file(dcp_metadata)
        store.remove(stale[1:])
        if METADATA_FILE in stale:
            remove_stale_files(store, save_id="")
        return self.inner.prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """torch's writer, made to fail when any of its files failed.

        torch's extra writer threads drop their exceptions and their files' results, so a
        full disk would commit a checkpoint missing those items; and its ``torch.save``
        reports a failed write as a ``RuntimeError``. Failures inside each file's stream are
        recorded here and raised (storage faults as ``StorageError`` naming the file).
        """
        failed: list[tuple[str, BaseException]] = []
        fs: Any = self.inner.fs  # type: ignore[attr-defined]
        create_stream = fs.create_stream

        @contextlib.contextmanager
        def recording(path: Any, mode: str) -> Iterator[Any]:
            self._created.append(path)
            try:
                with create_stream(path, mode) as stream:
                    yield stream
            except BaseException as e:
                failed.append((os.path.basename(str(path)), e))
                raise

        fs.create_stream = recording
        results: list[WriteResult] = []
        try:
            results = self.inner.write_data(plan, planner).wait()
        except Exception as e:
            if not failed:
                failed.append(("", e))
        finally:
            del fs.create_stream
        written = {r.index for r in results}
        missing = [item.index.fqn for item in plan.items if item.index not in written]
        if failed:
            raise _write_failure(self.location.url, *failed[0])
        if missing:
            raise StorageError(
                f"{self.location.url}: {len(missing)} item(s) were not written "
                f"(e.g. {missing[0]!r}): a writer thread failed"
            )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        portable = portable_metadata(metadata)
        for key, md in portable.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):  # what a load would refuse (overlaps:
                try:  # ranks' shards with validate_access_integrity=False) is not committed
                    check_tiling(key, tuple(md.size), md.chunks)
                except CorruptCheckpointError as e:
                    raise InvalidArgumentError(
                        f"{self.location.url}: refusing to commit invalid metadata: {e}"
                    ) from e
        store = self.store
        common = serialize_object(self.common_state, "the common state").getvalue()
        self._committed.append(MEGATRON_COMMON)
        store.commit_file(MEGATRON_COMMON, common, f"{MEGATRON_COMMON}.tmp", sync=self.sync_files)
        self.inner.finish(portable, results)
        config = json.dumps(MEGATRON_CHECKPOINT_CONFIG).encode()
        store.commit_file(MEGATRON_CONFIG, config, f"{MEGATRON_CONFIG}.tmp", sync=self.sync_files)

    def abort(self) -> None:
        """Remove what this failed save wrote: its data files and ``common.pt`` (the previous
        checkpoint's commit files were removed before any data was written)."""
        fs: Any = self.inner.fs  # type: ignore[attr-defined]
        for path in self._created:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)
        self._created.clear()
        self.store.remove([n for n in self._committed if self.store.exists(n)])
        self._committed.clear()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return bool(os.fspath(checkpoint_id))


def _write_failure(url: str, name: str, error: BaseException) -> BaseException:
    """A failed file write as raised to the caller: the storage fault behind it (torch.save
    wraps it in a ``RuntimeError``) as ``StorageError``, anything else as it was."""
    fault: BaseException | None = error
    while fault is not None and not is_storage_fault(fault):
        fault = fault.__cause__ or fault.__context__
    if fault is None:
        return error
    where = f"{url}: write {name}" if name else f"{url}: write"
    return storage_error(where, fault)


def portable_metadata(metadata: Metadata) -> Metadata:
    """``metadata`` rebuilt from DCP's classes, ``torch.Size``, dtypes and plain Python values
    only (a dcpbridge planner's chunk views become lists), for torch's writer to complete and
    pickle."""
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            state[key] = BytesStorageMetadata()
            continue
        p = md.properties
        state[key] = TensorStorageMetadata(
            properties=TensorProperties(
                dtype=p.dtype,
                layout=p.layout,
                requires_grad=bool(p.requires_grad),
                memory_format=p.memory_format,
                pin_memory=bool(p.pin_memory),
            ),
            size=torch.Size(md.size),
            chunks=[
                ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in md.chunks
            ],
        )
    return Metadata(
        state_dict_metadata=state, planner_data=_plain(metadata.planner_data, "planner_data")
    )


def _plain(value: Any, what: str, depth: int = 0) -> Any:
    """A copy of ``value`` made of None, bools, numbers, strings, lists, tuples and dicts."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if depth > 32:
        raise SerializationError(f"{what} is nested too deeply for a portable .metadata")
    if type(value) in (list, tuple):
        return type(value)(_plain(v, what, depth + 1) for v in value)
    if isinstance(value, dict):
        return {_plain(k, what, depth + 1): _plain(v, what, depth + 1) for k, v in value.items()}
    raise SerializationError(
        f"{what} holds a {type(value).__name__}, which only its own package could unpickle; "
        "a torch_dist .metadata holds torch and Python types only"
    )
