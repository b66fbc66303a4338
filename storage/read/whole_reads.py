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
from dcpbridge.storage.read.delivery import WholeJob, byte_view, is_plain


@dataclass(slots=True)
class WholeReads:
    """Requests that are each one whole stored chunk, as columns (entry ``i`` of each list).

    ``targets[i]`` is a plain, contiguous CPU tensor of the chunk's dtype and sizes;
    ``copies[i]`` lists further tensors asking for the same box (copied from the target once
    it is read and verified). Entries recorded by ``add`` were checked to be that against
    ``table``, and keep their row and address: the reader neither looks them up nor checks
    them again (entries are never replaced once recorded).
    """

    keys: list[ItemKey] = field(default_factory=list)  # (fqn, chunk offsets)
    targets: list[torch.Tensor] = field(default_factory=list)
    copies: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)  # by ``add``: each entry's row in ``table``
    table: ItemTable | None = None  # the table ``add`` checked every entry against
    _addresses: list[int] = field(default_factory=list)  # by ``add``: each target's address

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: ItemKey, target: torch.Tensor, chunks: Any) -> bool:
        """Record entry ``key`` -> ``target`` if ``target`` is a plain CPU tensor that is
        exactly the chunk at ``key``'s offsets of ``chunks`` (the decoded ``ChunkList`` of
        ``key``'s tensor): its dtype and sizes. False (nothing recorded) otherwise."""
        table = chunks.table
        return isinstance(table, ItemTable) and not self.add_many(
            table, [chunks.t], [key], [target]
        )

    def add_many(
        self,
        table: ItemTable,
        ts: Sequence[int],
        keys: Sequence[ItemKey],
        targets: Sequence[torch.Tensor],
    ) -> list[int]:
        """``add`` of many entries at once, each key's tensor given by its index ``ts[i]`` in
        ``table`` (its ``ChunkList``'s), in one pass over them. Returns the positions
        not recorded: those ``add`` would refuse, and repeats of a chunk this call records."""
        if self.keys and table is not self.table:
            return list(range(len(keys)))
        only, bounds, dtypes, names = table.only_boxes(), table.bounds, table.dtypes, table.tensors
        found: list[int | None] = []  # each entry's row, None where refused
        addresses: list[int] = []  # of each entry found, in order
        note, located = found.append, addresses.append
        for t, key, target in zip(ts, keys, targets):
            box = only[t]
            if box is not None:  # a one-chunk tensor (most): its chunk is the box, or none is
                sizes = box[1]
                fits = box[0] == key[1] and sizes == target.shape and 0 not in sizes
                row = bounds[t] if fits else None
            else:
                row = table.chunk_row(t, key[1], target.shape)
                if row is not None and not target.numel():
                    row = None
            if row is not None:
                dtype = target.dtype
                if dtype != dtypes[t] or names[t] != key[0] or not is_plain(target, dtype):
                    row = None
                else:
                    located(target.data_ptr())
            note(row)
        if len(addresses) != len(found) or len(set(found)) != len(found):  # refused, repeated
            return self._record_some(table, keys, targets, found)
        if found:
            self._record(table, keys, targets, found, addresses)  # type: ignore[arg-type]
        return []

    def _record_some(
        self,
        table: ItemTable,
        keys: Sequence[ItemKey],
        targets: Sequence[torch.Tensor],
        found: list[int | None],
    ) -> list[int]:
        """``add_many``'s records where some entries are refused or repeat a chunk an earlier
        entry of the call takes; returns the positions not recorded."""
        refused: list[int] = []
        took: list[int] = []
        taken: set[int] = set()
        for i, row in enumerate(found):
            if row is None or row in taken:
                refused.append(i)
            else:
                took.append(i)
                taken.add(row)
        if took:
            self._record(
                table,
                [keys[i] for i in took],
                [targets[i] for i in took],
                [found[i] for i in took],  # type: ignore[misc]
            )
        return refused

    def _record(
        self,
        table: ItemTable,
        keys: Sequence[ItemKey],
        targets: Sequence[torch.Tensor],
        rows: Sequence[int],
        addresses: Sequence[int] | None = None,
    ) -> None:
        """Append entries checked against ``table`` with their rows and target addresses
        (``addresses``: where the caller has them)."""
        self.table = table
        self.keys.extend(keys)
        self.targets.extend(targets)
        self.rows.extend(rows)
        self._addresses.extend(addresses or [t.data_ptr() for t in targets])

    def checked(self, table: ItemTable) -> tuple[list[int], list[int]] | None:
        """(rows, target addresses) of every entry if ``add`` recorded each against ``table``
        (the very object the reader reads by), else None: then every entry is looked up and
        checked by the reader."""
        n = len(self.keys)
        if self.table is not table or len(self.rows) != n or len(self._addresses) != n:
            return None
        return self.rows, self._addresses

    def nbytes(self) -> int:
        """Bytes these reads fill (copies not counted)."""
        return sum(t.nbytes for t in self.targets)

    def without(self, done: list[int]) -> WholeReads:
        """The entries not in ``done`` (sorted positions), with their copies."""
        skip = set(done)
        keep = [i for i in range(len(self.keys)) if i not in skip]
        recorded = len(self.rows) == len(self._addresses) == len(self.keys)
        return WholeReads(
            [self.keys[i] for i in keep],
            [self.targets[i] for i in keep],
            {j: self.copies[i] for j, i in enumerate(keep) if i in self.copies},
            [self.rows[i] for i in keep] if recorded else [],
            self.table if recorded else None,
            [self._addresses[i] for i in keep] if recorded else [],
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
