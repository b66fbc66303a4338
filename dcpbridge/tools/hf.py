"""``save_hf``: a sharded state dict written as Hugging Face safetensors by every rank at once.

One exchange of what each rank holds (key, global shape, dtype, the boxes it writes); then
every rank computes the same plan (``plan_hf``: export's file split, so the names and the
index are those of a one-process export) and writes its own boxes' bytes straight to their
places in the files (positional writes, so a local or shared file system), each file's
header by the rank the plan names. Memory stays bounded: a box is written from the rank's
own tensor, copied only slab by slab where it is not contiguous on the CPU. Each file is
written as ``<name>.partial``; the coordinator publishes last, once every rank has fsynced
its writes: it removes an earlier export's index, renames the files into place, then writes
the index (several files). An earlier export in the folder stays whole until then. A failure
on any rank raises on every rank and leaves no index.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dcpbridge.engine import protocol
from dcpbridge.engine.collectives import Group
from dcpbridge.errors import InvalidArgumentError
from dcpbridge.formats.checkpoint import SAFETENSORS_INDEX
from dcpbridge.formats.sources import TensorInfo
from dcpbridge.model.intake import for_save
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.planners.boxes import Placed, Shape, coverage_problems
from dcpbridge.planners.distribution import is_main_replica
from dcpbridge.planners.errors import SerializationError, ShardingValidationError
from dcpbridge.planners.protocol import chunk_sizes, chunk_view
from dcpbridge.planners.save_planner import check_data
from dcpbridge.storage import resolve
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.regions import narrow_box, plan_extents
from dcpbridge.storage.errors import storage_faults
from dcpbridge.storage.write.items import tensor_bytes
from dcpbridge.tools.export import (
    PARTIAL,
    ExportResult,
    _remove_present,
    _remove_quietly,
    _sync_dir,
    plan_files,
    remove_export,
    safetensors_header,
    safetensors_index,
    same_split,
    stale_exports,
)
from dcpbridge.tools.reshard import DEFAULT_SLAB_BYTES, new_folders, slabs


@dataclass(frozen=True, slots=True)
class Held:
    """A box of a global tensor one rank holds; ``plain``: a whole tensor every holder has."""

    key: str
    shape: Shape
    dtype: torch.dtype
    offsets: Shape
    sizes: Shape
    main: bool
    plain: bool


@dataclass(frozen=True, slots=True)
class BoxWrite:
    """Box ``offsets``+``sizes`` of ``key``, written into ``file`` whose data for the tensor
    starts at byte ``start``."""

    key: str
    file: str
    start: int
    shape: Shape
    offsets: Shape
    sizes: Shape


@dataclass
class HfPlan:
    """Every rank's part of one export: file headers, box writes, and what the index says."""

    files: list[tuple[str, int]]  # (name, size in bytes)
    headers: dict[int, list[tuple[str, bytes]]]  # rank -> (file.partial, header) it writes
    writes: dict[int, list[BoxWrite]]  # rank -> boxes it writes
    weight_map: dict[str, str] = field(default_factory=dict)
    total: int = 0


def _tensor_table(everyone: list[list[Held]]) -> dict[str, TensorInfo]:
    """Each key's global shape and dtype; raises where ranks disagree."""
    table: dict[str, TensorInfo] = {}
    for rank, held in enumerate(everyone):
        for h in held:
            known = table.setdefault(h.key, TensorInfo(h.key, h.shape, h.dtype, ()))
            if (known.shape, known.dtype) != (h.shape, h.dtype):
                raise ShardingValidationError(
                    f"{h.key!r}: rank {rank} holds it as {h.dtype} {h.shape}, another rank as "
                    f"{known.dtype} {known.shape}"
                )
    return table


def _writers(everyone: list[list[Held]]) -> dict[str, list[Placed]]:
    """Who writes each box: a shard's main replica; a plain tensor the least-loaded holder
    (largest first, ties to the lowest rank), so replicated weights spread over the ranks."""
    boxes: dict[str, list[Placed]] = {}
    loads = [0] * len(everyone)
    plain: dict[str, list[int]] = {}
    nbytes: dict[str, int] = {}
    shapes: dict[str, Shape] = {}  # the same on every holder (``_tensor_table`` checked)
    for rank, held in enumerate(everyone):
        for h in held:
            if h.plain:
                plain.setdefault(h.key, []).append(rank)
                nbytes[h.key] = math.prod(h.shape) * h.dtype.itemsize
                shapes[h.key] = h.shape
            elif h.main:
                boxes.setdefault(h.key, []).append(Placed(h.offsets, h.sizes, rank))
                loads[rank] += math.prod(h.sizes) * h.dtype.itemsize
    for key in sorted(plain, key=lambda k: (-nbytes[k], k)):
        rank = min(plain[key], key=lambda r: (loads[r], r))
        loads[rank] += nbytes[key]
        shape = shapes[key]
        boxes.setdefault(key, []).append(Placed((0,) * len(shape), shape, rank))
    return boxes


def plan_hf(everyone: list[list[Held]], max_shard_bytes: int) -> HfPlan:
    """The whole export from every rank's holdings (pure: every rank computes the same)."""
    table = _tensor_table(everyone)
    boxes = _writers(everyone)
    problems = [
        p for k in sorted(table) for p in coverage_problems(k, table[k].shape, boxes.get(k, []))
    ]
    if problems:
        raise ShardingValidationError("save_hf: " + "; ".join(problems[:5]))
    files = plan_files(list(table.values()), max_shard_bytes)
    plan = HfPlan([], {}, {r: [] for r in range(len(everyone))})
    for i, (name, tensors) in enumerate(files):
        head, ordered = safetensors_header(tensors)
        stored = name + PARTIAL  # renamed to ``name`` once every rank's writes are durable
        plan.headers.setdefault(i % len(everyone), []).append((stored, head))
        pos = len(head)
        for t in ordered:
            for box in boxes.get(t.key, []):
                if math.prod(box.sizes):
                    plan.writes[box.rank].append(
                        BoxWrite(t.key, stored, pos, t.shape, box.offsets, box.sizes)
                    )
            plan.weight_map[t.key] = name
            pos += t.nbytes
        plan.files.append((name, pos))
        plan.total += pos - len(head)
    return plan


def _holdings(state_dict: Any) -> tuple[list[Held], dict[tuple[str, Shape], ShardedTensor]]:
    """What this rank holds (tensors only: anything else is refused by name)."""
    parts = for_save(state_dict)
    held, data = [], {}
    plain_seen: set[str] = set()
    for s in parts.shards:
        if not isinstance(s, ShardedTensor):
            raise SerializationError(
                f"save_hf stores tensors only; {s.key!r} is a ShardedObject (leave it out)"
            )
        if is_main_replica(s.replica_id):  # its data is written: checked as db.save does
            check_data(s)
        offsets, sizes = tuple(s.global_offset), chunk_sizes(s)
        plain = s.key in parts.plain
        if plain:  # a plain tensor is one shard: another under its key is a second value
            if s.key in plain_seen:
                raise ShardingValidationError(
                    f"save_hf: {s.key!r} is both a plain tensor and a ShardedTensor key on "
                    "this rank: two values under one key"
                )
            plain_seen.add(s.key)
        held.append(
            Held(
                s.key,
                tuple(s.global_shape),
                s.dtype,
                offsets,
                sizes,
                is_main_replica(s.replica_id),
                plain,
            )
        )
        if (s.key, offsets) not in data or is_main_replica(s.replica_id):
            data[(s.key, offsets)] = s  # a box held twice: the main replica's data is written
    if parts.objects:
        names = ", ".join(sorted(parts.objects)[:5])
        raise SerializationError(
            f"save_hf stores tensors only; leave out the non-tensor values: {names}"
        )
    return held, data


def _box_parts(
    shard: ShardedTensor, w: BoxWrite, itemsize: int, slab_bytes: int
) -> Iterator[tuple[int, memoryview]]:
    """(file offset, bytes) of box ``w`` from this rank's data: one run per contiguous extent
    of the global tensor, each cut into slabs (copied only if not contiguous on the CPU)."""
    view = chunk_view(shard)
    for ext in plan_extents(w.shape, w.offsets, w.sizes, itemsize, min_piece_bytes=0, slack=1.0):
        pos = w.start + ext.start * itemsize
        for o, s in slabs(ext.box_offsets, ext.box_lengths, itemsize, slab_bytes):
            part = tensor_bytes(narrow_box(view, o, s))
            yield pos, part
            pos += len(part)


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, pos)
        data, pos = data[n:], pos + n


def save_hf(
    state_dict: Any,
    out_dir: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    max_shard_bytes: int = 5 * 10**9,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> ExportResult:
    """Write ``state_dict`` (DTensors, ShardedTensors, plain tensors) to ``out_dir`` as
    Hugging Face safetensors, every rank of ``process_group`` writing the boxes it holds.

    The files and index are those ``dcpbridge convert --to safetensors`` writes for the same
    tensors. ``out_dir`` is a local or shared file system path, the same on every rank.
    """
    group = Group.resolve(process_group)
    location = resolve(out_dir)
    if not location.is_local:
        raise InvalidArgumentError(
            f"save_hf writes in place on a local or shared file system, not {location.url}; "
            "save with db.save and run `dcpbridge convert --to safetensors` for object stores"
        )
    store = storage_for(location)
    data: dict[tuple[str, Shape], ShardedTensor] = {}

    def exchange() -> tuple[list[Held], list[str], int]:
        nonlocal data
        held, data = _holdings(state_dict)
        return held, new_folders(location), max_shard_bytes

    everyone = protocol.agree(group, "plan", exchange)
    created = everyone[0][1]
    same_split("save_hf", [m for _, _, m in everyone])  # else each rank plans other files
    plan = plan_hf([h for h, _, _ in everyone], max_shard_bytes)  # the same on every rank

    protocol.on_coordinator(group, "prepare", store.makedirs)  # before any rank writes
    stored = {name + PARTIAL: n for name, n in plan.files}
    published: list[str] = []  # the coordinator's: final names this save has replaced

    def write() -> int:
        with storage_faults(lambda: f"{location.url}: write {current[0]}"):
            return write_boxes()

    current = [""]  # the file being written, for the error

    def write_boxes() -> int:
        store.makedirs()  # the coordinator's may not be visible here yet
        fds: dict[str, int] = {}

        def fd_of(name: str) -> int:
            current[0] = name
            if name not in fds:
                fds[name] = os.open(location.path(name), os.O_WRONLY | os.O_CREAT, 0o644)
            return fds[name]

        written = 0
        try:
            for name, head in plan.headers.get(group.rank, []):
                fd = fd_of(name)
                os.ftruncate(fd, stored[name])  # never below another rank's bytes
                _pwrite_all(fd, memoryview(head), 0)
            for w in plan.writes[group.rank]:
                shard = data[(w.key, w.offsets)]
                for pos, part in _box_parts(shard, w, shard.dtype.itemsize, slab_bytes):
                    _pwrite_all(fd_of(w.file), part, pos)
                    written += len(part)
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        return written

    def publish(_: list[int]) -> None:
        # an earlier export's index would name this one's shards among its own
        published.append(SAFETENSORS_INDEX)
        _remove_present(store, [SAFETENSORS_INDEX])
        for name, _size in plan.files:
            with storage_faults(f"{location.url}: publish {name}"):
                os.replace(location.path(name + PARTIAL), location.path(name))
            published.append(name)
        _sync_dir(location.root)
        if len(plan.files) > 1:
            raw = safetensors_index(plan.weight_map, plan.total)
            store.commit_file(SAFETENSORS_INDEX, raw, f"{SAFETENSORS_INDEX}.tmp", sync=True)

    try:
        protocol.commit(group, "write", write, publish)
    except BaseException:  # every rank has stopped writing: the coordinator removes the files
        if group.is_coordinator:
            # (commit_file removes its own temp file)
            remove_export(store, [*stored, *published], created)
        raise
    names = [name for name, _ in plan.files]
    written = names + ([SAFETENSORS_INDEX] if len(names) > 1 else [])
    if group.is_coordinator:  # committed: a leftover is logged, not raised on one rank only
        # (stale_exports: the .partial files of a killed earlier save too)
        _remove_quietly(store, stale_exports(store, written))
    return ExportResult(location.url, written, len(plan.weight_map), plan.total, [])
