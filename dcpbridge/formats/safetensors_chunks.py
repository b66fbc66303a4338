"""Safetensors headers read as chunks of global tensors, every number checked before use.

A plain safetensors file holds whole tensors. DCP's ``HuggingFaceStorageWriter`` writes each
rank's shards as tensors of their local shape and records, in the file's ``__metadata__``
under ``DCP_SHARDING_INFO``, each one's offsets in the global tensor (a JSON string:
``{key: {"saved_offsets": [...]}}``). The global shape is not recorded: it is the bounding
box of a key's chunks, which must then tile it exactly (no gap, no overlap), as DCP's own
reader assumes without checking.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dcpbridge.errors import CorruptCheckpointError
from dcpbridge.planners.boxes import MAX_ELEMENTS, Placed, find_gap, find_overlaps, fmt_box

Shape = tuple[int, ...]
DCP_SHARDING_INFO = "DCP_SHARDING_INFO"
SAVED_OFFSETS = "saved_offsets"
_MAX_DIMS = 64

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "C64": torch.complex64,
}
"""The safetensors dtypes whose elements are whole bytes, as the ``safetensors`` package names
them (not F4/F6: their shapes count sub-byte elements that no torch dtype holds one by one)."""


@dataclass(frozen=True, slots=True)
class FileChunk:
    """One tensor of a safetensors file: the box it fills in its global tensor, and its bytes."""

    key: str
    file: str
    dtype: torch.dtype
    offsets: Shape
    sizes: Shape
    start: int  # where its bytes begin in the file
    nbytes: int
    placed: bool  # by DCP's offsets (else a whole tensor of a plain file)


@dataclass(frozen=True, slots=True)
class GlobalTensor:
    """A tensor as the files hold it: its global shape and dtype, and its non-empty chunks."""

    key: str
    shape: Shape
    dtype: torch.dtype
    chunks: tuple[FileChunk, ...]


class DuplicateName(ValueError):
    """A JSON object that gives one name twice (which of the two is meant is unknowable)."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; raises ``DuplicateName`` if a name repeats."""
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen:
            raise DuplicateName(f"names {name!r:.200} twice")
        seen.add(name)
    return dict(pairs)


def load_json(raw: str | bytes) -> Any:
    """``raw`` parsed as JSON, refusing an object that gives a name twice (``ValueError``)."""
    return json.loads(raw, object_pairs_hook=_unique)


def _ints(value: Any, what: str, *, length: int | None = None) -> Shape:
    """``value`` as a tuple of JSON integers in [0, 2^62] (of ``length`` if given)."""
    if not isinstance(value, list) or len(value) > _MAX_DIMS:
        raise CorruptCheckpointError(f"{what} must be a list of at most {_MAX_DIMS} integers")
    if any(type(v) is not int or not 0 <= v <= MAX_ELEMENTS for v in value):
        raise CorruptCheckpointError(f"{what} must hold integers in [0, 2^62], got {value!r:.200}")
    if length is not None and len(value) != length:
        raise CorruptCheckpointError(f"{what} has {len(value)} entries, the tensor {length} dims")
    return tuple(value)


def dcp_offsets(header: dict[str, Any], name: str) -> dict[str, list[Any]] | None:
    """The ``saved_offsets`` per key that DCP's HuggingFace writer recorded in file ``name``
    (unchecked lists, checked per tensor), or None for a plain safetensors file."""
    extra = header.get("__metadata__")
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise CorruptCheckpointError(f"{name}: __metadata__ is not a JSON object")
    raw = extra.get(DCP_SHARDING_INFO)
    if raw is None:
        return None
    try:
        info = load_json(raw) if isinstance(raw, str) else None
    except DuplicateName as e:
        raise CorruptCheckpointError(f"{name}: {DCP_SHARDING_INFO} {e}") from None
    except (ValueError, RecursionError):
        info = None
    if not isinstance(info, dict):
        raise CorruptCheckpointError(f"{name}: {DCP_SHARDING_INFO} is not a JSON object")
    out = {}
    for key, entry in info.items():
        offsets = entry.get(SAVED_OFFSETS) if isinstance(entry, dict) else None
        if not isinstance(offsets, list):
            raise CorruptCheckpointError(
                f"{name}: {DCP_SHARDING_INFO} gives {key!r:.200} no {SAVED_OFFSETS} list"
            )
        out[key] = offsets
    return out


def file_chunks(
    header: dict[str, Any], name: str, data_start: int, file_size: int
) -> list[FileChunk]:
    """Every tensor in the header of safetensors file ``name`` (data from ``data_start`` to
    ``file_size``), placed by DCP's offsets where the file records them."""
    placed = dcp_offsets(header, name)
    chunks = []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        what = f"{name}: tensor {key!r:.200}"
        if not isinstance(entry, dict):
            raise CorruptCheckpointError(f"{what}: its header entry is not a JSON object")
        name_of_dtype = entry.get("dtype")
        dtype = SAFETENSORS_DTYPES.get(name_of_dtype) if isinstance(name_of_dtype, str) else None
        if dtype is None:
            raise CorruptCheckpointError(f"{what} has unsupported dtype {entry.get('dtype')!r:.50}")
        sizes = _ints(entry.get("shape"), f"{what}: shape")
        begin, end = _ints(entry.get("data_offsets"), f"{what}: data_offsets", length=2)
        numel = math.prod(sizes)
        if numel > MAX_ELEMENTS or end - begin != numel * dtype.itemsize:
            raise CorruptCheckpointError(f"{what}: byte range does not match its shape")
        if data_start + end > file_size:
            raise CorruptCheckpointError(
                f"{what}: bytes {data_start + begin}..{data_start + end} lie past the end of "
                f"the file ({file_size} bytes)"
            )
        if placed is None:
            offsets: Shape = (0,) * len(sizes)
        elif key in placed:
            offsets = _ints(placed[key], f"{what}: {SAVED_OFFSETS}", length=len(sizes))
            if any(o + s > MAX_ELEMENTS for o, s in zip(offsets, sizes)):
                raise CorruptCheckpointError(f"{what}: {SAVED_OFFSETS} reach past 2^62")
        else:
            raise CorruptCheckpointError(f"{what}: {DCP_SHARDING_INFO} gives it no offsets")
        chunks.append(
            FileChunk(
                key,
                name,
                dtype,
                offsets,
                sizes,
                data_start + begin,
                end - begin,
                placed is not None,
            )
        )
    _check_layout(chunks, name, data_start, file_size)
    return chunks


def _check_layout(chunks: list[FileChunk], name: str, data_start: int, file_size: int) -> None:
    """Raise unless the tensors' bytes tile the file's data exactly, as the format requires
    (and the ``safetensors`` package checks): no two share bytes, no bytes between or after
    them that no tensor accounts for (a file with such bytes is damaged, or made to be read
    as something else too)."""
    at, last = data_start, None
    for start, end, key in sorted((c.start, c.start + c.nbytes, c.key) for c in chunks):
        if start < at:
            raise CorruptCheckpointError(
                f"{name}: tensors {last!r:.200} and {key!r:.200} share bytes {start}..{at}"
            )
        if start > at:
            raise CorruptCheckpointError(
                f"{name}: bytes {at}..{start} before tensor {key!r:.200} belong to no tensor"
            )
        at, last = end, key
    if at != file_size:
        raise CorruptCheckpointError(
            f"{name}: bytes {at}..{file_size} at the end of the file belong to no tensor"
        )


def global_tensors(chunks: Iterable[FileChunk], where: str) -> dict[str, GlobalTensor]:
    """The chunks grouped into global tensors; raises unless each key's chunks agree on
    dtype and rank and tile its bounding box exactly once."""
    by_key: dict[str, list[FileChunk]] = {}
    for c in chunks:
        by_key.setdefault(c.key, []).append(c)
    out = {}
    for key, group in by_key.items():
        first = group[0]
        if len(group) > 1 and not all(c.placed for c in group):
            files = sorted({c.file for c in group})
            raise CorruptCheckpointError(
                f"{where}: tensor {key!r} is in {len(group)} places ({', '.join(files)}) "
                f"without DCP's {SAVED_OFFSETS} placing each"
            )
        for c in group[1:]:
            if c.dtype != first.dtype or len(c.sizes) != len(first.sizes):
                raise CorruptCheckpointError(
                    f"{where}: chunks of {key!r} disagree: {first.dtype} {len(first.sizes)}-d "
                    f"in {first.file}, {c.dtype} {len(c.sizes)}-d in {c.file}"
                )
        shape = tuple(
            max(c.offsets[d] + c.sizes[d] for c in group) for d in range(len(first.sizes))
        )
        kept = tuple(c for c in group if math.prod(c.sizes))
        _check_tiling(key, shape, kept, where)
        if not kept:  # an empty tensor: one whole (empty) chunk stands for it
            kept = (dataclasses.replace(first, offsets=(0,) * len(shape), sizes=shape),)
        out[key] = GlobalTensor(key, shape, first.dtype, kept)
    return out


def _check_tiling(key: str, shape: Shape, chunks: tuple[FileChunk, ...], where: str) -> None:
    """Raise unless ``chunks`` cover ``shape`` exactly once."""
    boxes = [Placed(c.offsets, c.sizes, i) for i, c in enumerate(chunks)]
    for a, b in find_overlaps(boxes, limit=1):
        ca, cb = chunks[a.rank], chunks[b.rank]
        raise CorruptCheckpointError(
            f"{where}: chunks of tensor {key!r} overlap: {fmt_box(a.offsets, a.sizes)} in "
            f"{ca.file} and {fmt_box(b.offsets, b.sizes)} in {cb.file}"
        )
    if sum(c.numel for c in boxes) != math.prod(shape):
        gap = find_gap(shape, boxes)
        hole = f" elements {fmt_box(*gap)}" if gap else " some elements"
        raise CorruptCheckpointError(
            f"{where}: tensor {key!r} (shape {shape} from DCP's {SAVED_OFFSETS}) has{hole} "
            f"in no file (chunks in {', '.join(sorted({c.file for c in chunks}))})"
        )
