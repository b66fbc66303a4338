"""Write results as columns: each rank's writer reports its items by their position in the
plan it wrote, as arrays, next to the ``WriteResult`` objects; the coordinator joins every
rank's into the commit document's item table with array operations.

Positions only mean something for the plan the coordinator validated: a rank's results carry
the fingerprint of its plan (the save planner's columns), the planned chunks remember which
rank's item at which position each one is (``Sources``), and when a fingerprint, a position
or a count does not match, the table is made from the ``WriteResult`` objects instead.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from dcpbridge.storage.errors import InvalidArgumentError
from dcpbridge.storage.format.document import planned_boxes
from dcpbridge.storage.format.packed import PackedRows, index_columns
from dcpbridge.storage.format.table import (
    ItemTable,
    PlannedBoxes,
    StoredItem,
    TensorHeader,
    hex_to_ints,
    ragged_order,
    table_from_written,
)

_STORED = operator.attrgetter("storage_data")
_INDEX, _SIZE = operator.attrgetter("index"), operator.attrgetter("size_in_bytes")
_FIELDS = operator.attrgetter("file", "offset", "nbytes", "rank", "checksums", "sizes", "dtype")
_FILE, _PLACE = operator.attrgetter("file"), operator.attrgetter("offset", "nbytes", "rank")
_CHECKSUMS = operator.attrgetter("checksums")


@dataclass(slots=True, eq=False)
class WrittenColumns:
    """One rank's write results as arrays, in the order of its ``WriteResult`` list."""

    digest: bytes  # fingerprint of the plan whose items these are (positions refer to it)
    files: tuple[str, ...]
    position: np.ndarray  # each result's item position in the plan
    file: np.ndarray  # index into ``files``
    offset: np.ndarray
    nbytes: np.ndarray
    rank: np.ndarray
    sums: np.ndarray | None  # every result's block checksums, in order (uint64)
    sum_counts: np.ndarray | None  # checksums per result


class WrittenResults(list):  # type: ignore[type-arg]
    """A rank's ``WriteResult`` list that also carries them as ``columns`` (or None).

    It pickles (gathered to the coordinator) as a ``PackedResults``: DCP's ``MetadataIndex``
    and its ``torch.Size`` cost ~50 us a result to pickle and unpickle, so a rank of 20,000
    tensors spent a second on objects the coordinator then reads only as columns."""

    columns: WrittenColumns | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedResults, _packed(self, self.columns))


class PackedResults(PackedRows[WriteResult]):
    """A rank's write results as received by the coordinator: their fields as parallel lists
    of plain values, and the ``columns``; the ``WriteResult`` at a position is made when it
    is asked for (the item-by-item path, an object's name), never all of them up front."""

    __slots__ = ("columns",)
    width = 11

    def __init__(self, columns: WrittenColumns | None, *fields: list[Any]) -> None:
        super().__init__(*fields)
        self.columns = columns

    def _make(self, *row: Any) -> WriteResult:
        fqn, offset, hint, size, file, start, nbytes, rank, sums, sizes, dtype = row
        return WriteResult(
            index=MetadataIndex(fqn, offset, hint),
            size_in_bytes=size,
            storage_data=StoredItem(file, start, nbytes, rank, sums, sizes, dtype),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (PackedResults, (self.columns, *self._fields))


def _packed(results: Sequence[WriteResult], columns: WrittenColumns | None) -> tuple[Any, ...]:
    """``PackedResults``' arguments for ``results`` (each one's storage data a ``StoredItem``)."""
    fields = list(map(_FIELDS, map(_STORED, results)))
    stored = [list(f) for f in zip(*fields)] if fields else [[] for _ in range(7)]
    indexes = index_columns(list(map(_INDEX, results)))
    return (columns, *indexes, list(map(_SIZE, results)), *stored)


def written_columns(
    results: list[WriteResult], positions: Sequence[int] | np.ndarray, digest: bytes | None
) -> list[WriteResult]:
    """``results`` (``StoredItem``s, of the items at ``positions`` in the plan whose
    fingerprint is ``digest``) with their columns attached; unchanged if there is no digest
    or a result is not a ``StoredItem``."""
    stored = list(map(_STORED, results))
    if digest is None or not all(type(s) is StoredItem for s in stored):
        return results
    n = len(stored)
    names = list(map(_FILE, stored))
    files = sorted(set(names))
    ids = {name: i for i, name in enumerate(files)}
    places = np.fromiter(itertools.chain.from_iterable(map(_PLACE, stored)), np.int64, 3 * n)
    places = places.reshape(n, 3)
    recorded = list(map(_CHECKSUMS, stored))
    sums = counts = None
    if None not in recorded:
        counts = np.fromiter(map(len, recorded), np.int64, n)
        sums = hex_to_ints(list(itertools.chain.from_iterable(recorded)))
    out = WrittenResults(results)
    out.columns = WrittenColumns(
        digest=digest,
        files=tuple(files),
        position=np.fromiter(positions, np.int64, n),
        file=np.fromiter(map(ids.__getitem__, names), np.int64, n),
        offset=places[:, 0].copy(),
        nbytes=places[:, 1].copy(),
        rank=places[:, 2].copy(),
        sums=sums,
        sum_counts=counts,
    )
    return out


def columns_table(
    tensors: Sequence[TensorHeader],
    objects: Sequence[str],
    boxes: PlannedBoxes | None,
    results: Sequence[Sequence[WriteResult]],
    *,
    checksums: bool,
) -> ItemTable | None:
    """The item table from every rank's written columns: chunk rows are the planned boxes,
    placed by (rank, position); None unless every rank reported columns for the plan the
    coordinator validated and they name each planned chunk and each object exactly once."""
    sources = boxes.sources if boxes is not None else None
    if sources is None or len(results) != len(sources.digests):
        return None
    cols = [getattr(r, "columns", None) for r in results]
    for rank, c in enumerate(cols):
        if (
            c is None
            or c.digest != sources.digests[rank]
            or len(c.position) != len(results[rank])
            or (checksums and c.sums is None)
        ):
            return None
        n_items = sources.starts[rank + 1] - sources.starts[rank]
        if c.position.size and (c.position.min() < 0 or c.position.max() >= n_items):
            return None
    assert boxes is not None
    where = np.concatenate(
        [sources.starts[r] + c.position for r, c in enumerate(cols)] or [np.zeros(0, np.int64)]
    )
    row = sources.row[where]
    nt = int(boxes.offsets.shape[0])
    chunk = row >= 0
    if int(chunk.sum()) != nt or not np.array_equal(
        np.bincount(row[chunk], minlength=nt), np.ones(nt, dtype=np.int64)
    ):
        return None
    order = np.empty(nt + len(objects), dtype=np.int64)
    order[row[chunk]] = np.flatnonzero(chunk)
    object_ids = {name: i for i, name in enumerate(objects, nt)}
    starts = np.cumsum([0] + [len(r) for r in results])
    taken = set()
    for i in np.flatnonzero(~chunk).tolist():
        rank = int(np.searchsorted(starts, i, side="right")) - 1
        slot = object_ids.get(results[rank][i - int(starts[rank])].index.fqn)
        if slot is None or slot in taken:
            return None
        taken.add(slot)
        order[slot] = i
    if len(taken) != len(objects):
        return None
    files = sorted(set(itertools.chain.from_iterable(c.files for c in cols)))
    ids = {name: i for i, name in enumerate(files)}
    file = np.concatenate(
        [np.fromiter(map(ids.__getitem__, c.files), np.int64, len(c.files))[c.file] for c in cols]
        or [np.zeros(0, np.int64)]
    )
    sums = None
    if checksums:
        counts = np.concatenate([c.sum_counts for c in cols])
        flat = np.concatenate([c.sums for c in cols])
        sums = flat[ragged_order(counts, order)]
    return ItemTable(
        tensors=[h.name for h in tensors],
        dtypes=[h.dtype for h in tensors],
        shapes=[tuple(h.shape) for h in tensors],
        counts=boxes.counts.copy(),
        objects=list(objects),
        files=tuple(files),
        file=file[order],
        offset=np.concatenate([c.offset for c in cols])[order],
        nbytes=np.concatenate([c.nbytes for c in cols])[order],
        rank=np.concatenate([c.rank for c in cols])[order],
        offsets=boxes.offsets,
        sizes=boxes.sizes,
        checksums=sums,
    )


def written_table(
    metadata: Metadata, results: Sequence[Sequence[WriteResult]], *, checksums: bool
) -> ItemTable:
    """The item table of ``metadata`` from every rank's write results (each a ``StoredItem``
    in ``storage_data``), in any order: from the results' columns when every rank reported
    them for the plan the coordinator validated, else every field gathered from the
    ``WriteResult`` objects in one C-level pass."""
    tensors, objects = [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors.append(TensorHeader(fqn, md.properties.dtype, tuple(md.size)))
        else:
            objects.append(fqn)
    planned = planned_boxes(metadata)
    table = columns_table(tensors, objects, planned, results, checksums=checksums)
    if table is not None:
        return table
    flat = list(itertools.chain.from_iterable(results))
    indexes = list(map(operator.attrgetter("index"), flat))
    fqns = list(map(operator.attrgetter("fqn"), indexes))
    offsets = list(map(operator.attrgetter("offset"), indexes))
    items = list(map(operator.attrgetter("storage_data"), flat))
    files = sorted(set(map(operator.attrgetter("file"), items)))
    try:
        return table_from_written(
            tensors,
            objects,
            files,
            fqns,
            offsets,
            items,
            checksums=checksums,
            planned=planned,
        )
    except KeyError as e:
        raise InvalidArgumentError(
            f"stored bytes for {e.args[0]!r}, which is not planned"
        ) from None
    except ValueError as e:
        raise InvalidArgumentError(f"stored bytes do not match the plan: {e}") from None
