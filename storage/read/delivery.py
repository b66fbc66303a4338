"""Carrying planned reads out: fetch byte ranges into their targets, verify, hand over.

Each job (one tensor read or one object) owns its target buffer: the destination tensor
itself when the planned box is exactly the request and the tensor is plain CPU memory, else
a staging buffer. Ranges of all jobs in a batch are coalesced into requests (``read_plan``);
a request fills its members' buffers in order, so joined reads still land straight in their
destinations. When a job's last range landed it is verified (``checksum.verify``), copied
into the destination if staged, and handed over. Staging memory is bounded by batching; a
GPU destination is staged in pinned memory and copied asynchronously (the load waits for
those copies before it returns).
A request for a whole stored chunk into plain memory (most reads of a same-layout load) is a
``WholeJob``: no plan, no staging, whole items of a file read back to back by one request.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.device_copy import host_target, wait_for_device_copies
from dcpbridge.storage.backends.regions import c_strides, narrow_box
from dcpbridge.storage.backends.store import RangeRead, ScatterRead, Storage
from dcpbridge.storage.errors import CheckpointError
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import StorageIndex, StoredItem
from dcpbridge.storage.format.paths import Location
from dcpbridge.storage.read.read_plan import ChunkRead, ReadTuning, coalesce

# Memory held by staging buffers at once (reads straight into destination tensors need none).
STAGING_BUDGET = 256 << 20

Slot = tuple["Job", int, memoryview]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def holds_its_values(t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether ``t``'s memory holds the values it shows: not a conjugate or negative view,
    whose memory holds them unconjugated or unnegated (its bytes are not its values).
    ``dtype``: ``t``'s, where the caller has it (only a complex tensor has a conjugate bit)."""
    return not (t.is_neg() or ((dtype or t.dtype).is_complex and t.is_conj()))


def as_shown(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a conjugate or negative view a copy of the values it shows."""
    return t if holds_its_values(t) else t.resolve_conj().resolve_neg()


def is_plain(t: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
    """Whether ``t`` is a plain, dense, contiguous CPU tensor whose memory holds the values it
    shows (a meta tensor is not is_cpu); ``dtype``: ``t``'s, where the caller has it."""
    return (
        type(t) in _PLAIN
        and t.is_cpu
        and t.layout is torch.strided
        and t.is_contiguous()
        and holds_its_values(t, dtype)
    )


def byte_view(t: torch.Tensor) -> memoryview | None:
    """Writable bytes of ``t`` if it is a plain, dense, contiguous CPU tensor, else None.

    Only then is ``data_ptr()`` the address of its elements: a tensor subclass (DTensor...)
    is filled through torch (``copy_``) from a staging buffer instead. The view aliases
    ``t``'s memory; callers keep ``t`` alive while using it.
    """
    if not is_plain(t):
        return None
    n = t.nbytes
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def _bytes_of(t: torch.Tensor) -> memoryview:
    view = byte_view(t)
    assert view is not None
    return view


class Job:
    """One item's reads: ``open`` allocates buffers for its ranges (item-relative bytes),
    ``landed`` is called once per range, and the last one finishes the job."""

    file: str
    base: int  # the item's offset in its file
    staged_bytes: int

    def __init__(self) -> None:
        self._left = 0
        self._lock = threading.Lock()

    def open(self) -> list[tuple[int, int, memoryview]]:
        raise NotImplementedError

    def piece_landed(self, index: int) -> None:
        """Bytes of range ``index`` are in place (for staged pieces: copy them on)."""

    def finish(self) -> None:
        raise NotImplementedError

    def landed(self, index: int) -> None:
        self.piece_landed(index)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.finish()


class TensorJob(Job):
    """Reads a planned box of a stored chunk into ``dest``; ``commit(dest)`` hands it over."""

    def __init__(
        self,
        stored: StoredItem,
        plan: ChunkRead,
        dest: torch.Tensor,
        commit: Callable[[torch.Tensor], None],
        digests: Sequence[str] | None,
        describe: Callable[[], str],
    ) -> None:
        super().__init__()
        assert stored.sizes is not None and stored.dtype is not None
        self.file, self.base = stored.file, stored.offset
        self.stored, self.plan, self.dest, self.commit = stored, plan, dest, commit
        self.digests, self.describe = digests, describe
        self.dtype = stored.dtype
        self._direct = not plan.widened and byte_view(dest) is not None
        self.to_device = dest.is_cuda  # then copied from pinned memory, asynchronously
        self._target: torch.Tensor | None = None
        self._bounce: dict[int, memoryview] = {}

    def open(self) -> list[tuple[int, int, memoryview]]:
        if self._direct:
            self._target = self.dest
        else:  # pinned when the destination is on a GPU: no pageable intermediate copy
            self._target = host_target(self.plan.box[1], self.dtype, self.to_device)
        view = _bytes_of(self._target)
        ranges = []
        for i, p in enumerate(self.plan.pieces):
            if p.at is not None:
                out = view[p.at : p.at + p.stop - p.start]
            else:
                out = self._bounce[i] = memoryview(np.empty(p.stop - p.start, np.uint8)).cast("B")
            ranges.append((p.start, p.stop, out))
        self._left = len(ranges)
        return ranges

    @property
    def staged_bytes(self) -> int:  # type: ignore[override]
        box_bytes = math.prod(self.plan.box[1]) * self.dtype.itemsize
        return (0 if self._direct else box_bytes) + self.plan.bounce_bytes

    @property
    def strided(self) -> bool:
        """Whether the box is not one contiguous run of the chunk (row pieces or a joined
        span): then a mapped file serves it better than reads (``copy_from``)."""
        return not self.plan.contiguous

    def copy_from(self, item: np.ndarray) -> None:
        """Fill the box from ``item``, the stored chunk's bytes in a mapped file, verifying
        each checksum tile in a scratch copy before it lands (``checksum.copy_verified``;
        without checksums one strided copy), then hand ``dest`` over: no read syscalls, no
        bounce buffers, the bytes between the pieces never touched."""
        plan = self.plan
        if self._direct:
            target = self.dest
        else:
            target = host_target(plan.box[1], self.dtype, self.to_device)
        out = _bytes_of(target)
        grid = plan.grid
        if self.digests is not None and grid is not None:
            checksum.copy_verified(
                grid, item, out, *plan.verify_box, self.digests, what=self.describe
            )
        else:
            _copy_box(item, out, self.stored.sizes, self.dtype.itemsize, *plan.box)
        self._target = target
        self._finish(verified=True)

    def piece_landed(self, index: int) -> None:
        buf = self._bounce.pop(index, None)
        if buf is None:
            return
        ext = self.plan.pieces[index].extent
        assert ext is not None and self._target is not None
        src = torch.frombuffer(buf, dtype=torch.uint8).view(self.dtype)
        box = narrow_box(self._target, ext.box_offsets, ext.box_lengths)
        box.copy_(src.as_strided(ext.box_lengths, c_strides(self.stored.sizes)))

    def finish(self) -> None:
        self._finish(verified=False)

    def _finish(self, *, verified: bool) -> None:
        target, self._target = self._target, None
        assert target is not None
        if not verified and self.digests is not None and self.plan.grid is not None:
            checksum.verify(
                self.plan.grid,
                _bytes_of(target),
                *self.plan.verify_box,
                self.digests,
                what=self.describe,
            )
        if target is not self.dest:
            (req_off, req_len), (box_off, _) = self.plan.request, self.plan.box
            inner = [r - b for r, b in zip(req_off, box_off)]
            # from pinned memory this copy is asynchronous (ordered on the current stream,
            # overlapping the next reads); the allocator keeps ``target`` until it completes
            self.dest.copy_(narrow_box(target, inner, req_len), non_blocking=target.is_pinned())
        self.commit(self.dest)


class WholeJob(Job):
    """Reads a whole stored chunk straight into ``view``, the bytes of ``dest`` (same box and
    dtype), verifies it with one hash per tile and hands ``dest`` over: the path of most reads,
    so it allocates nothing and plans nothing per item."""

    def __init__(
        self,
        stored: StoredItem,
        view: memoryview,
        dest: torch.Tensor,
        commit: Callable[[torch.Tensor], None],
        grid: checksum.Grid | None,
        describe: Callable[[], str],
    ) -> None:
        self.file, self.base, self.staged_bytes = stored.file, stored.offset, 0
        self.stored, self.view, self.dest, self.commit = stored, view, dest, commit
        self.grid, self.describe = grid, describe

    def open(self) -> list[tuple[int, int, memoryview]]:
        return [(0, len(self.view), self.view)]

    def landed(self, index: int) -> None:  # one range: it is the last
        if self.grid is not None and self.stored.checksums is not None:
            checksum.verify(
                self.grid,
                self.view,
                (0,) * len(self.grid.sizes),
                self.grid.sizes,
                self.stored.checksums,
                what=self.describe,
            )
        self.commit(self.dest)

    def slabs(self, size: int) -> list[tuple[int, int, int, int]] | None:
        """``(start, stop, first row, rows)``: the chunk's bytes cut into slabs of whole rows
        of checksum tiles along dim 0, about ``size`` bytes each; None where it is one slab
        (small, unverified, or not cut along dim 0)."""
        grid, n = self.grid, len(self.view)
        if grid is None or self.stored.checksums is None or not grid.sizes or n <= size:
            return None
        rows = grid.sizes[0]
        row_bytes = n // rows if rows else 0
        step = grid.tile[0] * max(1, size // max(1, grid.tile[0] * row_bytes))
        if step >= rows:
            return None
        return [
            (r * row_bytes, min(r + step, rows) * row_bytes, r, min(step, rows - r))
            for r in range(0, rows, step)
        ]

    def slab_landed(self, first: int, rows: int, data: memoryview, left: list[int]) -> None:
        """Verify one slab as it lands; the last one (``left`` counts them) hands ``dest`` over."""
        assert self.grid is not None and self.stored.checksums is not None
        offsets = (first,) + (0,) * (len(self.grid.sizes) - 1)
        lengths = (rows, *self.grid.sizes[1:])
        checksum.verify(
            self.grid, data, offsets, lengths, self.stored.checksums, what=self.describe
        )
        with _SLAB_LOCK:
            left[0] -= 1
            last = left[0] == 0
        if last:
            self.commit(self.dest)


_SLAB_LOCK = threading.Lock()


class BytesJob(Job):
    """Reads a stored object's bytes, verifies them and hands them to ``deliver``."""

    def __init__(
        self,
        stored: StoredItem,
        deliver: Callable[[bytes], None],
        grid: checksum.Grid | None,
        describe: str,
    ) -> None:
        super().__init__()
        self.file, self.base, self.staged_bytes = stored.file, stored.offset, stored.nbytes
        self.stored, self.deliver, self.grid, self.describe = stored, deliver, grid, describe
        self._buf: memoryview | None = None

    def open(self) -> list[tuple[int, int, memoryview]]:
        self._buf = memoryview(bytearray(self.stored.nbytes))
        self._left = 1
        return [(0, self.stored.nbytes, self._buf)]

    def finish(self) -> None:
        buf, self._buf = self._buf, None
        assert buf is not None
        if self.grid is not None and self.stored.checksums is not None:
            n = self.stored.nbytes
            checksum.verify(self.grid, buf, (0,), (n,), self.stored.checksums, what=self.describe)
        self.deliver(bytes(buf))


def _batches(jobs: Sequence[Job], budget: int) -> list[list[Job]]:
    """Consecutive jobs whose staging buffers together stay under ``budget`` (one at least)."""
    batches: list[list[Job]] = []
    batch: list[Job] = []
    staged = 0
    for job in jobs:
        if batch and staged + job.staged_bytes > budget:
            batches.append(batch)
            batch, staged = [], 0
        batch.append(job)
        staged += job.staged_bytes
    if batch:
        batches.append(batch)
    return batches


def _copy_box(
    item: np.ndarray,
    out: memoryview,
    sizes: Sequence[int],
    itemsize: int,
    offsets: Sequence[int],
    lengths: Sequence[int],
) -> None:
    """Copy box ``offsets``+``lengths`` of a C-order chunk of ``sizes`` (bytes ``item``) into
    ``out``, the box's bytes in C order: one strided copy."""
    src = checksum.byte_array(item, sizes, itemsize)
    dst = checksum.byte_array(out, lengths, itemsize)
    np.copyto(dst, src[checksum.box_index(offsets, lengths, itemsize)])


def run_jobs(
    jobs: Sequence[Job],
    store: Storage,
    path: Callable[[str], str],
    tuning: ReadTuning,
    threads: int,
    budget: int = STAGING_BUDGET,
) -> int:
    """Fetch, verify and hand over every job; returns the bytes requested from storage."""
    devices = {job.dest.device for job in jobs if type(job) is TensorJob and job.to_device}
    whole = [job for job in jobs if type(job) is WholeJob]
    fetched = 0
    strided = [job for job in jobs if type(job) is TensorJob and job.strided]
    if strided:
        with store.mapped_files() as maps:
            copied: set[int] = set()
            if maps is not None:  # the disk reads the coming boxes while earlier ones copy
                spans = [
                    (job.base + job.plan.span[0], job.base + job.plan.span[1]) for job in strided
                ]
                maps.prefetch([(path(job.file), lo, hi) for job, (lo, hi) in zip(strided, spans)])
            for job in strided if maps is not None else ():
                item = maps.item(path(job.file), job.base, job.stored.nbytes, job.plan.span)
                if item is None:
                    break  # not here: read them
                job.copy_from(item)
                fetched += math.prod(job.plan.box[1]) * job.dtype.itemsize
                copied.add(id(job))
            jobs = [job for job in jobs if id(job) not in copied]
    if whole:
        reads, nbytes = _whole_reads(whole, path, tuning)
        fetched += nbytes
        store.fetch(reads, threads)
        if len(whole) == len(jobs) and not devices:
            return fetched
        jobs = [job for job in jobs if type(job) is not WholeJob]
    for batch in _batches(jobs, budget):
        ranges: list[tuple[str, int, int, Slot]] = []
        for job in batch:
            for i, (start, stop, out) in enumerate(job.open()):
                ranges.append((job.file, job.base + start, job.base + stop, (job, i, out)))
        requests = coalesce(
            ranges,
            merge_gap=tuning.merge_gap,
            max_request=tuning.max_request,
            max_amplification=tuning.max_amplification,
        )
        reads: list[RangeRead | ScatterRead] = []
        for req in requests:
            fetched += req.stop - req.start
            slots = [slot for _, _, slot in req.members]
            done = _landed(slots)
            if len(slots) == 1:
                reads.append(RangeRead(path(req.file), req.start, slots[0][2], done))
                continue
            parts: list[memoryview | int] = []
            pos = req.start
            for start, stop, (_, _, out) in req.members:
                if start > pos:
                    parts.append(start - pos)
                parts.append(out)
                pos = stop
            reads.append(ScatterRead(path(req.file), req.start, parts, done))
        store.fetch(reads, threads)
    if devices:
        wait_for_device_copies(devices)  # the loaded tensors are ready for any stream
    return fetched


def _whole_reads(
    jobs: list[WholeJob], path: Callable[[str], str], tuning: ReadTuning
) -> tuple[list[ScatterRead], int]:
    """Requests that read whole items of one file back to back (at most ``merge_gap`` bytes
    apart, at most ``max_request`` bytes and ``max_amplification`` times the bytes they need
    each) straight into their targets; and their bytes."""
    reads: list[ScatterRead] = []
    fetched = 0
    if tuning.verify_slab:
        rest = []
        for job in jobs:
            cut = job.slabs(tuning.verify_slab)
            if cut is None:
                rest.append(job)
                continue
            left = [len(cut)]
            for start, stop, first, rows in cut:
                view = job.view[start:stop]
                done = functools.partial(job.slab_landed, first, rows, view, left)
                reads.append(ScatterRead(path(job.file), job.base + start, [view], done))
            fetched += len(job.view)
        jobs = rest
    requests = coalesce(
        [(job.file, job.base, job.base + len(job.view), job) for job in jobs],
        merge_gap=tuning.merge_gap,
        max_request=tuning.max_request,
        max_amplification=tuning.max_amplification,
    )
    for req in requests:
        parts: list[memoryview | int] = []
        pos = req.start
        for start, stop, job in req.members:
            if start > pos:
                parts.append(start - pos)
            parts.append(job.view)
            pos = stop
        fetched += req.stop - req.start
        members = [job for _, _, job in req.members]
        reads.append(ScatterRead(path(req.file), req.start, parts, _all_landed(members)))
    return reads, fetched


def _all_landed(jobs: list[WholeJob]) -> Callable[[], None]:
    def done() -> None:
        for job in jobs:
            job.landed(0)

    return done


def _landed(slots: list[Slot]) -> Callable[[], None]:
    def done() -> None:
        for job, index, _ in slots:
            job.landed(index)

    return done


def read_bytes(
    store: Storage,
    path: str,
    stored: StoredItem,
    block: int,
    *,
    verify: bool,
    describe: str,
) -> bytes:
    """The bytes of one stored object, verified against its checksums when ``verify``."""
    out: list[bytes] = []
    grid = checksum.flat_grid(stored.nbytes, block) if verify and block else None
    job = BytesJob(stored, out.append, grid, describe)
    tuning = ReadTuning(min_piece_bytes=0, merge_gap=0, max_request=1 << 62)
    run_jobs([job], store, lambda _: path, tuning, threads=1)
    return out[0]


def verify_stored_items(
    location: Location,
    index: StorageIndex,
    *,
    on_bytes: Callable[[int], None] | None = None,
    piece: int = 64 << 20,
) -> list[str]:
    """Read every item of ``index`` and check all its checksums, in slabs of about ``piece``
    bytes (whole tile rows, so memory stays bounded); returns one problem per bad item."""
    block = index.checksum_block_size
    store = storage_for(location)
    problems: list[str] = []
    for (fqn, offsets), item in sorted(
        index.items.items(), key=lambda kv: (kv[1].file, kv[1].offset)
    ):
        where = f"[{', '.join(map(str, offsets))}]" if offsets is not None else ""
        what = f"{fqn!r}{where} in {item.file}"
        if not item.checksums:
            problems.append(f"{what}: no checksums recorded for this item")
            continue
        grid = checksum.item_grid(
            item.nbytes, item.sizes, item.dtype, block, tiled=index.tiled_checksums
        )
        try:
            for lo, hi, box in _slabs(grid, piece):
                buf = memoryview(bytearray(hi - lo))
                path = location.data_path(item.file, index.prefixes)
                store.fetch([RangeRead(path, item.offset + lo, buf)], 1)
                checksum.verify(grid, buf, *box, item.checksums, what=what)
                if on_bytes is not None:
                    on_bytes(hi - lo)
        except (CheckpointError, OSError) as e:
            problems.append(str(e))
    return problems


def _slabs(grid: checksum.Grid, piece: int) -> list[tuple[int, int, checksum.Box]]:
    """Item bytes ``[lo, hi)`` and their box: whole rows of tiles along dim 0, about ``piece``
    bytes each (one tile row at least)."""
    if not grid.sizes or grid.nbytes == 0:
        return [(0, grid.nbytes, ((0,) * len(grid.sizes), grid.sizes))]
    rows, step = grid.sizes[0], grid.tile[0]
    row_bytes = grid.nbytes // rows
    step *= max(1, piece // max(1, step * row_bytes))
    out = []
    for r in range(0, rows, step):
        n = min(step, rows - r)
        out.append(
            (
                r * row_bytes,
                (r + n) * row_bytes,
                ((r,) + (0,) * (len(grid.sizes) - 1), (n, *grid.sizes[1:])),
            )
        )
    return out
