"""Small whole chunks read as spans of their files, one request for many items: a load of
10^4-10^5 small tensors costs a few microseconds of Python per item instead of one job, one
buffer view and one request each.

Used by ``FsspecCheckpointReader.read_whole`` for entries of ``WholeReads`` (plain CPU
targets whose box is exactly one stored chunk) that are small and have one checksum each:
the table is read as columns for all of them at once, neighbouring items of a file are
fetched by one request (``ReadTuning``'s gap and size limits; at most one verify slab where
the storage has them), and every item's digest is compared with its recorded one. A span
whose items are all at least ``DIRECT_ITEM`` bytes is read straight into its targets (one
scatter read) and verified there while still in the CPU's cache: a damaged item fails the
load, as a damaged large chunk does, though its target then holds what was read. Spans of
tinier items are staged in one buffer of at most ``SPAN_BUDGET`` bytes (one slab per reader
thread where there are slabs), reused batch after batch, and verified there before any of
an item's bytes reach its target.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xxhash

from dcpbridge.storage.backends.store import RangeRead, ScatterRead, Storage
from dcpbridge.storage.errors import CorruptCheckpointError
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.table import ItemKey, ItemTable, describe_item
from dcpbridge.storage.read.delivery import is_plain
from dcpbridge.storage.read.read_plan import ReadTuning

SMALL_ITEM = 1 << 20  # items up to this size are staged (larger ones are read in place)
SPAN_BUDGET = 64 << 20  # most staging memory of one batch of spans (each starts its threads)
# spans of items at least this large are read into their targets: measured, 20,000 x 16 KiB
# from the page cache, 4 threads, 2 cores, the read step 0.12-0.15 s against 0.26-0.32 s staged
DIRECT_ITEM = 4 << 10


def small_entries(table: ItemTable, rows: Sequence[int], block: int, *, verify: bool) -> np.ndarray:
    """Positions (in ``rows``) of the entries this module reads: found tensor chunks of 1 to
    ``SMALL_ITEM`` bytes that, when verified, have exactly one checksum."""
    at = np.asarray(rows, dtype=np.int64)
    ok = (at >= 0) & (at < table.tensor_rows)
    nbytes = table.nbytes[at[ok]]
    ok[ok] = (nbytes > 0) & (nbytes <= SMALL_ITEM)
    if verify:
        ok[ok] = table.blocks(block)[at[ok]] == 1
    return np.flatnonzero(ok)


def read_spans(
    table: ItemTable,
    keys: Sequence[ItemKey],
    rows: Sequence[int],
    targets: Sequence[torch.Tensor],
    *,
    addresses: Sequence[int] | None = None,
    store: Storage,
    path: Callable[[str], str],
    tuning: ReadTuning,
    threads: int,
    block: int,
    url: str,
) -> int:
    """Read stored rows ``rows`` (tensor chunks, see ``small_entries``) into ``targets``
    (``block``: the checksum block size, 0 to skip verification); returns the bytes fetched.
    ``addresses``: the targets' addresses where ``WholeReads.add`` checked them already.

    Raises ``CorruptCheckpointError`` naming the entry if a target is not the plain CPU
    tensor of the chunk's dtype and shape, ``ChecksumMismatchError`` naming a damaged item
    (a staged one before any of its bytes reach its target).
    """
    n = len(rows)
    if not n:
        return 0
    at = np.asarray(rows, dtype=np.int64)
    nbytes = table.nbytes[at]
    if addresses is None:
        ptrs = _checked_targets(table, keys, at, targets, nbytes, table.sizes[at].tolist(), url)
    else:
        ptrs = list(addresses)
    expected = None
    if block and table.checksums is not None:
        expected = table.checksums[table.sum_starts(block)[at]]
    order = np.lexsort((nbytes, table.offset[at], table.file[at]))  # coalesce's order
    file, start, size = table.file[at][order], table.offset[at][order], nbytes[order]
    spans = _spans(file, start, size, tuning)
    lengths = [int(start[hi - 1] + size[hi - 1] - start[lo]) for lo, hi in spans]
    direct = (np.minimum.reduceat(size, [lo for lo, _ in spans]) >= DIRECT_ITEM).tolist()
    staged = [length for length, d in zip(lengths, direct) if not d]
    budget = min(_budget(tuning, threads), sum(staged))
    buffer = np.empty(max(max(staged, default=0), budget), np.uint8)
    items = _Sorted(
        start.tolist(),
        size.tolist(),
        [ptrs[i] for i in order.tolist()],
        None if expected is None else expected[order].tolist(),
        lambda i: f"{describe_item(keys[int(order[i])])} in {table.files[int(file[i])]}",
    )
    batch: list[RangeRead | ScatterRead] = []
    used = 0
    for (lo, hi), length, straight in zip(spans, lengths, direct):
        name, at_file = path(table.files[int(file[lo])]), items.starts[lo]
        if straight:
            batch.append(ScatterRead(name, at_file, *items.in_place(lo, hi)))
            continue
        if batch and used + length > len(buffer):
            store.fetch(batch, threads)
            batch, used = [], 0
        view = memoryview(buffer)[used : used + length]
        done = items.deliver(view, buffer.ctypes.data + used, lo, hi)
        batch.append(RangeRead(name, at_file, view, done))
        used += length
    store.fetch(batch, threads)
    return sum(lengths)


def _budget(tuning: ReadTuning, threads: int) -> int:
    """Staging bytes of one batch: where the storage verifies in slabs (local disk), one slab
    per reader thread, so the reused buffer stays in the CPU's cache (a fresh 64 MiB one
    faulted in page by page and every span landed in memory the hash and copy then missed)."""
    if not tuning.verify_slab:
        return SPAN_BUDGET
    return min(SPAN_BUDGET, max(1, threads) * tuning.verify_slab)


def _checked_targets(
    table: ItemTable,
    keys: Sequence[ItemKey],
    at: np.ndarray,
    targets: Sequence[torch.Tensor],
    nbytes: np.ndarray,
    sizes: list[list[int]],
    url: str,
) -> list[int]:
    """Each target's address, once it is known to be the plain CPU tensor of its chunk's
    dtype, shape and byte count (the only memory the reads copy into)."""
    tids = np.searchsorted(table.starts, at, side="right") - 1
    dtypes, shapes = table.dtypes, table.shapes
    counts = nbytes.tolist()
    ptrs = []
    for i, (t, target) in enumerate(zip(tids.tolist(), targets)):
        dtype, nd = dtypes[t], len(shapes[t])
        if (
            target.dtype != dtype
            or target.nbytes != counts[i]
            or list(target.shape) != sizes[i][:nd]
            or not is_plain(target)
        ):
            raise CorruptCheckpointError(
                f"{url}: {describe_item(keys[i])} in {table.files[int(table.file[at[i]])]} is "
                f"stored as {dtype} {sizes[i][:nd]} of {counts[i]} bytes, which is not the "
                f"chunk its metadata describes ({target.dtype} {list(target.shape)})"
            )
        ptrs.append(target.data_ptr())
    return ptrs


def _spans(
    file: np.ndarray, start: np.ndarray, size: np.ndarray, tuning: ReadTuning
) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of the sorted items that one request reads each: ``coalesce``'s joins
    (same file, at most ``merge_gap`` apart, ``max_request`` and ``max_amplification``) over
    the columns, already in ``coalesce``'s order: where a run must end regardless is found
    for all items at once, and each run's end by one search (no Python step per item)."""
    n = len(start)
    if not n:
        return []
    # where the storage verifies in slabs (local disk), a span is one slab: its bytes are
    # hashed and copied out while still in the CPU's cache, right after its read
    most = min(tuning.max_request, tuning.verify_slab or tuning.max_request)
    amp = tuning.max_amplification
    end = start + size
    cut = np.ones(n, dtype=bool)  # item i cannot join item i - 1's request
    cut[1:] = (
        (file[1:] != file[:-1]) | (start[1:] < end[:-1]) | (start[1:] > end[:-1] + tuning.merge_gap)
    )
    needed = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(size, out=needed[1:])
    bounds = [*np.flatnonzero(cut).tolist(), n]
    out: list[tuple[int, int]] = []
    for lo, top in itertools.pairwise(bounds):
        while lo < top:
            first = int(start[lo])
            # the items whose end lies within ``max_request`` of the first one's start
            hi = lo + 1 + int(np.searchsorted(end[lo + 1 : top], first + most, side="right"))
            if int(end[hi - 1]) - first > int(needed[hi] - needed[lo]):  # gaps: amplification
                reads = end[lo + 1 : hi] - first
                ok = reads <= amp * (needed[lo + 2 : hi + 1] - needed[lo])
                if not ok.all():
                    hi = lo + 1 + int(np.argmin(ok))
            out.append((lo, hi))
            lo = hi
    return out


class _Sorted:
    """The staged items sorted by file and offset: where each lies, where it goes, its
    recorded digest (None: not verified) and how an error names item ``i``."""

    def __init__(
        self,
        starts: list[int],
        lens: list[int],
        ptrs: list[int],
        digests: list[int] | None,
        name: Callable[[int], str],
    ) -> None:
        self.starts, self.lens, self.ptrs, self.digests, self.name = (
            starts,
            lens,
            ptrs,
            digests,
            name,
        )

    def in_place(self, lo: int, hi: int) -> tuple[list[memoryview | int], Callable[[], None]]:
        """The parts of one scatter read of span ``[lo, hi)`` straight into its items' targets
        (an int skips the bytes between two items), and the check of every item's digest,
        run once they landed."""
        starts, lens, ptrs = self.starts, self.lens, self.ptrs
        parts: list[memoryview | int] = []
        views = []
        end = starts[lo]
        # one view over the address range of the span's targets, sliced per item (a view
        # made by ctypes per item costs ~3x a slice; nothing outside the slices is touched)
        base = min(ptrs[lo:hi])
        reach = max(p + n for p, n in zip(ptrs[lo:hi], lens[lo:hi])) - base
        memory = memoryview((ctypes.c_ubyte * reach).from_address(base)).cast("B")
        for i in range(lo, hi):
            at, n = starts[i], lens[i]
            if at > end:
                parts.append(at - end)
            end = at + n
            a = ptrs[i] - base
            view = memory[a : a + n]
            parts.append(view)
            views.append(view)

        def verify() -> None:
            digests = self.digests
            if digests is None:
                return
            digest = xxhash.xxh3_64_intdigest
            for i, view in enumerate(views, lo):
                if (got := digest(view)) != digests[i]:
                    self._mismatch(i, got)

        return parts, verify

    def deliver(self, view: memoryview, address: int, lo: int, hi: int) -> Callable[[], None]:
        """Verify every item of span ``[lo, hi)`` (its bytes in ``view``, at ``address``) and
        copy it into its target; a mismatch raises before that item is copied."""

        def done() -> None:
            memmove, digest = ctypes.memmove, xxhash.xxh3_64_intdigest
            starts, lens, ptrs, digests = self.starts, self.lens, self.ptrs, self.digests
            first = starts[lo]
            for i in range(lo, hi):
                a = starts[i] - first
                length = lens[i]
                if digests is not None and (got := digest(view[a : a + length])) != digests[i]:
                    self._mismatch(i, got)
                if length:
                    memmove(ptrs[i], address + a, length)

        return done

    def _mismatch(self, i: int, got: int) -> None:
        """Raise ``ChecksumMismatchError`` for item ``i``, whose bytes hash to ``got``."""
        assert self.digests is not None
        hexes = [f"{self.digests[i]:016x}"]
        checksum.raise_mismatch(0, f"{got:016x}", hexes, self.name(i), "the item")
