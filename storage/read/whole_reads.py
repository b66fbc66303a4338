"""Whole stored chunks read into plain CPU tensors, planned as columns instead of ReadItems.

When dcpbridge's load planner and reader run together under dcpbridge's driver, a request
that is exactly one stored chunk (the same layout as at save: most requests of most loads)
needs no DCP ``ReadItem``, no ``MetadataIndex`` and no resolve/commit round trip: the planner
records its key and destination here, and the reader looks every entry up at once and reads
each chunk straight into its destination's memory, verifying its checksums as before. Plain
``dcp.load`` never sees these columns: it gets ``ReadItem``s as always.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpbridge.storage.errors import CorruptCheckpointError
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.table import ItemKey, ItemTable, StoredItem, describe_item
from dcpbridge.storage.read.delivery import WholeJob, byte_view


@dataclass(slots=True)
class WholeReads:
    """Requests that are each one whole stored chunk, as columns (entry ``i`` of each list).

    ``targets[i]`` is a plain, contiguous CPU tensor of the chunk's dtype and sizes;
    ``copies[i]`` lists further tensors asking for the same box (copied from the target once
    it is read and verified).
    """

    keys: list[ItemKey] = field(default_factory=list)  # (fqn, chunk offsets)
    targets: list[torch.Tensor] = field(default_factory=list)
    copies: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)  # each key's row in ``table``, as planned
    table: ItemTable | None = None  # the table ``rows`` index (None: look every key up)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: ItemKey, target: torch.Tensor, table: Any, row: int) -> None:
        """Record entry ``key`` -> ``target``, found at ``row`` of ``table`` (an ``ItemTable``
        or another chunk index: then the reader looks every key up itself)."""
        if not self.keys:
            self.table = table if isinstance(table, ItemTable) else None
        elif table is not self.table:
            self.table = None
        self.keys.append(key)
        self.targets.append(target)
        self.rows.append(row)

    def table_rows(self, table: ItemTable) -> list[int] | None:
        """The planned rows, if they index ``table`` (the very object the planner searched)."""
        return self.rows if self.table is table and len(self.rows) == len(self.keys) else None

    def nbytes(self) -> int:
        """Bytes these reads fill (copies not counted)."""
        return sum(t.nbytes for t in self.targets)

    def without(self, done: list[int]) -> WholeReads:
        """The entries not in ``done`` (sorted positions), with their copies."""
        skip = set(done)
        keep = [i for i in range(len(self.keys)) if i not in skip]
        return WholeReads(
            [self.keys[i] for i in keep],
            [self.targets[i] for i in keep],
            {j: self.copies[i] for j, i in enumerate(keep) if i in self.copies},
            [self.rows[i] for i in keep] if len(self.rows) == len(self.keys) else [],
            self.table,
        )


def _done(_: torch.Tensor) -> None:
    """Nothing to hand over: the chunk was read into its only destination."""


def _copier(copies: list[torch.Tensor]) -> Callable[[torch.Tensor], None]:
    def commit(target: torch.Tensor) -> None:
        for view in copies:
            view.copy_(target)

    return commit


class _Describe:
    """How a failed check names the entry (built only when one fails)."""

    __slots__ = ("file", "key")

    def __init__(self, key: ItemKey, file: str) -> None:
        self.key, self.file = key, file

    def __call__(self) -> str:
        return f"{describe_item(self.key)} in {self.file}"


def whole_jobs(
    reads: WholeReads,
    found: Sequence[StoredItem | None],
    *,
    block: int,
    tiled: bool,
    url: str,
) -> list[WholeJob]:
    """One ``WholeJob`` per entry of ``reads``, given each entry's ``StoredItem`` (``block``:
    the checksum block size, 0 to skip verification). Raises ``CorruptCheckpointError``
    naming the entry if the checkpoint does not store it as a chunk of its target's layout."""
    jobs = []
    copies = reads.copies
    for i, (key, target, stored) in enumerate(zip(reads.keys, reads.targets, found)):
        if stored is None:
            raise CorruptCheckpointError(
                f"{url}: metadata has no stored bytes for {describe_item(key)}"
            )
        sizes, dtype = stored.sizes, stored.dtype
        view = byte_view(target)
        if (
            sizes is None
            or dtype != target.dtype
            or sizes != target.shape
            or view is None
            or len(view) != stored.nbytes
        ):
            raise CorruptCheckpointError(
                f"{url}: {describe_item(key)} in {stored.file} is stored as "
                f"{'an object' if sizes is None else f'{dtype} {list(sizes)}'} of "
                f"{stored.nbytes} bytes, which is not the chunk its metadata describes "
                f"({target.dtype} {list(target.shape)})"
            )
        grid = (
            checksum.tensor_grid(sizes, dtype.itemsize, block, tiled=tiled)
            if block and stored.checksums
            else None
        )
        more = copies.get(i) if copies else None
        commit = _done if more is None else _copier(more)
        jobs.append(WholeJob(stored, view, target, commit, grid, _Describe(key, stored.file)))
    return jobs
