"""Offline resharding: rewrite any checkpoint so each target rank's box is one stored chunk.

Streams box by box (in slabs of at most ``slab_bytes``), never holding the model in memory.
Under torchrun, N workers share the boxes (a deterministic split by bytes), each writes its
own data files, and rank 0 commits ``dcpbridge.json`` once every worker has finished; a
failure on any worker is raised on all of them and nothing is committed.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from dcpbridge.engine import protocol
from dcpbridge.engine.collectives import Group
from dcpbridge.errors import InvalidArgumentError
from dcpbridge.formats.layout import Layout
from dcpbridge.formats.sources import Source
from dcpbridge.planners.boxes import Shape
from dcpbridge.storage import Location, StorageIndex, StoredItem, resolve
from dcpbridge.storage.format.document import ItemKey
from dcpbridge.storage.format.references import is_reference, parent_of, reference_dir
from dcpbridge.storage.write.items import tensor_bytes
from dcpbridge.storage.write.stream import StreamWriter, commit, discard_save, new_save_id

DEFAULT_SLAB_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One stored item of the target: a tensor box owned by ``rank``, or an object."""

    key: str
    nbytes: int
    rank: int
    offsets: Shape | None = None  # None: an object
    sizes: Shape = ()

    @property
    def index(self) -> MetadataIndex:
        return (
            MetadataIndex(self.key, self.offsets)
            if self.offsets is not None
            else MetadataIndex(self.key)
        )


@dataclass(frozen=True, slots=True)
class ReshardResult:
    destination: str
    world_size: int
    workers: int
    tensors: int
    chunks: int
    objects: int
    bytes_written: int
    seconds: float


def slabs(
    offsets: Shape, sizes: Shape, itemsize: int, budget: int
) -> Iterator[tuple[Shape, Shape]]:
    """Sub-boxes of a box, each at most ``budget`` bytes where possible, whose bytes in order
    are the box's bytes in C order (cuts along the first axis longer than 1)."""
    if math.prod(sizes) * itemsize <= budget or all(n <= 1 for n in sizes):
        yield offsets, sizes
        return
    d = next(i for i, n in enumerate(sizes) if n > 1)
    row = math.prod(sizes[d + 1 :]) * itemsize
    step = max(1, budget // row) if row else sizes[d]
    for start in range(0, sizes[d], step):
        n = min(step, sizes[d] - start)
        o = (*offsets[:d], offsets[d] + start, *offsets[d + 1 :])
        s = (*sizes[:d], n, *sizes[d + 1 :])
        if n == 1 and row > budget:
            yield from slabs(o, s, itemsize, budget)
        else:
            yield o, s


def box_bytes(
    source: Source, key: str, offsets: Shape, sizes: Shape, budget: int
) -> Iterator[memoryview]:
    """The bytes of a box of ``key`` in C order, read slab by slab (one read for box sources)."""
    itemsize = source.tensors[key].dtype.itemsize
    if source.reads_whole_chunks:
        budget = max(budget, math.prod(sizes) * itemsize)
    for o, s in slabs(offsets, sizes, itemsize, budget):
        yield tensor_bytes(source.read(key, o, s))


def counted(
    parts: Iterable[memoryview], on_bytes: Callable[[int], None] | None
) -> Iterator[memoryview]:
    """``parts`` in order, each one's length passed to ``on_bytes`` (if given) once consumed."""
    for part in parts:
        yield part
        if on_bytes is not None:
            on_bytes(len(part))


def plan_work(source: Source, layout: Layout) -> list[WorkItem]:
    """Every target item: each tensor's boxes in ``layout`` (by key, then offset), then objects."""
    work = []
    for key in sorted(source.tensors):
        info = source.tensors[key]
        for box in layout.boxes(key, info.shape):
            work.append(
                WorkItem(key, box.numel * info.dtype.itemsize, box.rank, box.offsets, box.sizes)
            )
    for key in sorted(source.objects):
        obj = source.objects[key]
        rank = obj.rank if obj.rank is not None and obj.rank < layout.world_size else 0
        work.append(WorkItem(key, obj.nbytes or 0, rank))
    return work


def assign(work: list[WorkItem], workers: int) -> list[list[WorkItem]]:
    """Split ``work`` over ``workers`` by bytes: largest first to the least-loaded worker (ties
    to the lowest index); each worker keeps plan order. Deterministic on every rank."""
    loads = [0] * workers
    owner = [0] * len(work)
    for i in sorted(range(len(work)), key=lambda i: (-work[i].nbytes, i)):
        w = min(range(workers), key=lambda w: (loads[w], w))
        owner[i] = w
        loads[w] += work[i].nbytes
    return [[item for i, item in enumerate(work) if owner[i] == w] for w in range(workers)]


def target_state(source: Source, work: list[WorkItem]) -> dict[str, STORAGE_TYPES]:
    """DCP state metadata of the target: every tensor (even one without chunks) and object."""
    state: dict[str, STORAGE_TYPES] = {}
    chunks: dict[str, list[ChunkStorageMetadata]] = {k: [] for k in source.tensors}
    for item in work:
        if item.offsets is None:
            state[item.key] = BytesStorageMetadata()
        else:
            chunks[item.key].append(
                ChunkStorageMetadata(torch.Size(item.offsets), torch.Size(item.sizes))
            )
    for key, info in source.tensors.items():
        state[key] = TensorStorageMetadata(
            TensorProperties(dtype=info.dtype),
            torch.Size(info.shape),
            sorted(chunks[key], key=lambda c: tuple(c.offsets)),
        )
    return state


def write_items(
    source: Source,
    writer: StreamWriter,
    items: list[WorkItem],
    *,
    slab_bytes: int,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[ItemKey, StoredItem]:
    """Copy ``items`` from ``source`` into ``writer`` (left open); returns where each landed."""
    for item in items:
        if item.offsets is None:
            blob = memoryview(source.object_bytes(item.key))
            writer.write_item(item.index, [blob], nbytes=len(blob), rank=item.rank)
            if on_bytes is not None:
                on_bytes(len(blob))
            continue
        parts = box_bytes(source, item.key, item.offsets, item.sizes, slab_bytes)
        writer.write_item(
            item.index,
            counted(parts, on_bytes),
            nbytes=item.nbytes,
            rank=item.rank,
            sizes=item.sizes,
            dtype=source.tensors[item.key].dtype,
        )
    return writer.items


def new_folders(location: Location) -> list[str]:
    """The local folders writing at ``location`` creates, deepest first: its root and each
    missing folder above it (none on other storage)."""
    out: list[str] = []
    path = location.root.rstrip("/")
    while location.is_local and path and not os.path.exists(path):
        out.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return out


def remove_new_folders(folders: list[str]) -> None:
    """Remove the folders ``new_folders`` listed, deepest first, while they are empty (a
    folder holding anything, another's files, stays with everything above it)."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


def _same_place(a: Location, b: Location) -> bool:
    return type(a.fs) is type(b.fs) and a.root.rstrip("/") == b.root.rstrip("/")


def _referenced_folders(source: Source) -> set[str]:
    """Sibling checkpoint folders whose data files ``source`` (an incremental save) reads."""
    index = getattr(getattr(source, "metadata", None), "storage_data", None)
    if not isinstance(index, StorageIndex):
        return set()
    refs = [f for f in index.files if is_reference(f)]
    return {f"{parent_of(source.location.root)}/{reference_dir(f)}" for f in refs}


def reshard(
    source: Source,
    destination: str | os.PathLike[str],
    layout: Layout,
    *,
    storage_options: dict[str, Any] | None = None,
    group: Group | None = None,
    checksums: bool = True,
    sync_files: bool = True,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
    max_file_bytes: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
    work: list[WorkItem] | None = None,
) -> ReshardResult:
    """Write ``source`` to ``destination`` as a dcpbridge checkpoint in ``layout``.

    Every rank of ``group`` (one process if None) calls it with the same arguments; ``work``
    is ``plan_work(source, layout)`` when the caller has it already. A failure on any rank
    raises on every rank and removes every file the reshard wrote (and the destination
    directory if the reshard created it).
    """
    group = group or Group(None, 0, 1, 0)
    started = time.perf_counter()

    location: Location

    def plan() -> tuple[str | None, list[str]]:
        nonlocal location, work
        location = resolve(destination, storage_options)
        if _same_place(location, source.location):
            raise InvalidArgumentError(
                f"the destination {location.url} is the source checkpoint itself"
            )
        same_fs = type(location.fs) is type(source.location.fs)
        if same_fs and location.root.rstrip("/") in _referenced_folders(source):
            raise InvalidArgumentError(
                f"the destination {location.url} holds data files that the source "
                f"{source.location.url} references (an incremental save): writing there "
                "would delete them; choose another destination"
            )
        created = new_folders(location)  # before any write
        work = work if work is not None else plan_work(source, layout)
        return (new_save_id() if group.is_coordinator else None), created

    save_id, fresh = protocol.agree(group, "plan", plan)[0]
    assert work is not None
    mine = assign(work, group.size)[group.rank]

    def run() -> dict[ItemKey, StoredItem]:
        writer = StreamWriter(
            location,
            save_id=save_id,
            worker=group.rank,
            checksums=checksums,
            sync_files=sync_files,
            max_file_bytes=max_file_bytes,
        )
        with writer:  # a failure removes this worker's files
            return write_items(source, writer, mine, slab_bytes=slab_bytes, on_bytes=on_bytes)

    committed = False

    def publish(written: list[dict[ItemKey, StoredItem]]) -> None:
        nonlocal committed
        assert work is not None
        planner_data = source.header.get("planner_data")
        commit(
            location,
            target_state(source, work),
            {k: v for part in written for k, v in part.items()},
            save_id=save_id,
            world_size=layout.world_size,
            checksums=checksums,
            planner_data=planner_data if isinstance(planner_data, dict) else None,
            sync=sync_files,
        )
        committed = True

    try:
        protocol.commit(group, "write", run, publish)
    except Exception:
        # The coordinator has gathered every worker (or lost one): remove all of this
        # reshard's files unless it committed them.
        if group.is_coordinator and not committed:
            discard_save(location, save_id)
            remove_new_folders(fresh)
        raise
    return ReshardResult(
        destination=location.url,
        world_size=layout.world_size,
        workers=group.size,
        tensors=len(source.tensors),
        chunks=sum(1 for w in work if w.offsets is not None),
        objects=sum(1 for w in work if w.offsets is None),
        bytes_written=sum(w.nbytes for w in work),
        seconds=time.perf_counter() - started,
    )
