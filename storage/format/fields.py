"""Readers of a metadata document's JSON fields: each checks a type and range before use and
raises ``CorruptCheckpointError`` naming the field (shared by the packed and row layouts)."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any

import torch

from dcpbridge.storage.errors import CorruptCheckpointError
from dcpbridge.storage.format.table import MAX_NDIM, MAX_SIZE, TensorHeader, shown_value

_DTYPES: dict[str, torch.dtype] = {}
# Tensors of these dtypes are only meaningful with their scale and zero point, which no stored
# tensor entry records: dcpbridge refuses to save them, and a document naming one is corrupt.
QUANTIZED_DTYPES = frozenset(
    {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
)

_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (as ``dtype_name`` writes it); refuses anything else."""
    dtype = _DTYPES.get(name) if isinstance(name, str) else None
    if dtype is not None:
        return dtype
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if (
        not isinstance(dtype, torch.dtype)
        or dtype_name(dtype) != name
        or dtype.itemsize < 1
        or dtype in QUANTIZED_DTYPES
    ):
        raise CorruptCheckpointError(f"unknown dtype {shown_value(name)}")
    _DTYPES[name] = dtype
    return dtype


def _int(value: Any, what: str, lo: int = 0, hi: int = MAX_SIZE) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise CorruptCheckpointError(
            f"{what} must be an integer in [{lo}, {hi}], got {shown_value(value)}"
        )
    return value


def _ints(values: Any, what: str, n: int | None = None) -> list[int]:
    if type(values) is not list or (n is not None and len(values) != n):
        need = f"{n} integers" if n is not None else "integers"
        raise CorruptCheckpointError(f"{what} must be a list of {need}, got {shown_value(values)}")
    if len(values) > MAX_NDIM:
        raise CorruptCheckpointError(f"{what} has {len(values)} dimensions (at most {MAX_NDIM})")
    return [_int(v, what) for v in values]


def _dict(value: Any, what: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise CorruptCheckpointError(f"{what} must be a JSON object, got {shown_value(value)}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if type(value) is not list:
        raise CorruptCheckpointError(f"{what} must be a JSON list, got {shown_value(value)}")
    return value


def _field(entry: dict[str, Any], name: str, what: str) -> Any:
    if name not in entry:
        raise CorruptCheckpointError(f"{what}: field {name!r} is missing")
    return entry[name]


def _plain_shape(shape: Any) -> bool:
    """A list of at most MAX_NDIM ints in [0, MAX_SIZE] (a plain loop: the per-tensor check)."""
    if type(shape) is not list or len(shape) > MAX_NDIM:
        return False
    for v in shape:
        if type(v) is not int or not 0 <= v <= MAX_SIZE:
            break
    else:
        return True
    return False


def tensor_headers(
    names: Sequence[Any], dtypes: Sequence[Any], shapes: Sequence[Any]
) -> list[TensorHeader]:
    """Validated tensor headers: string names, known dtypes, shapes of at most 2**62 bytes."""
    parsed = check_tensor_headers(names, dtypes, shapes)
    return list(map(TensorHeader, names, parsed, map(tuple, shapes)))


def check_tensor_headers(
    names: Sequence[Any], dtypes: Sequence[Any], shapes: Sequence[Any]
) -> list[torch.dtype]:
    """Check what ``tensor_headers`` checks; returns the parsed dtypes. Well-formed headers
    are checked a column at a time, anything else one by one (naming the bad tensor)."""
    if len(names) == len(dtypes) == len(shapes) and _plain_columns(names, dtypes, shapes):
        by_name = {text: _parsed_or_none(text) for text in set(dtypes)}  # refused below
        parsed = list(map(by_name.__getitem__, dtypes))
        counts = list(map(math.prod, shapes))
        widths = map(operator.attrgetter("itemsize"), parsed)
        if (
            None not in by_name.values()
            and max(counts, default=0) <= MAX_SIZE
            and all(n * w <= MAX_SIZE for n, w in zip(counts, widths))
        ):
            return parsed
    return [_checked_header(*h) for h in zip(names, dtypes, shapes)]


def _plain_columns(names: Sequence[Any], dtypes: Sequence[Any], shapes: Sequence[Any]) -> bool:
    """String names and dtypes, and shapes that are lists of at most MAX_NDIM ints in
    [0, MAX_SIZE] (each column's element types gathered in one C-level pass)."""
    if not set(map(type, names)) <= _STR or not set(map(type, dtypes)) <= _STR:
        return False
    if not set(map(type, shapes)) <= _LIST or max(map(len, shapes), default=0) > MAX_NDIM:
        return False
    flat = list(itertools.chain.from_iterable(shapes))
    return set(map(type, flat)) <= _INT and (not flat or (min(flat) >= 0 and max(flat) <= MAX_SIZE))


def _parsed_or_none(text: str) -> torch.dtype | None:
    try:
        return parse_dtype(text)
    except CorruptCheckpointError:
        return None


_STR, _LIST, _INT = frozenset({str}), frozenset({list}), frozenset({int})


def _checked_header(name: Any, dtype_text: Any, shape: Any) -> torch.dtype:
    """One tensor's header checked, its problem worded; returns its dtype."""
    if type(name) is not str:
        raise CorruptCheckpointError(f"tensor name {shown_value(name)} is not a string")
    dtype = parse_dtype(dtype_text)
    if not _plain_shape(shape):  # checked again, naming the tensor on failure
        what = f"tensor {name!r}"
        if type(shape) is not list or len(shape) > MAX_NDIM:
            shape = _ints(shape, f"{what} shape")
        if not all(type(v) is int and 0 <= v <= MAX_SIZE for v in shape):
            _ints(shape, f"{what} shape")
    n = math.prod(shape)
    if n > MAX_SIZE or n * dtype.itemsize > MAX_SIZE:
        raise CorruptCheckpointError(f"tensor {name!r} shape: {shape} elements are too many")
    return dtype


def check_names(tensors: Sequence[str], objects: Sequence[str]) -> None:
    """Every stored name appears once (a tensor and an object may not share one)."""
    if len(set(tensors)) != len(tensors):
        raise CorruptCheckpointError("a tensor is listed twice")
    seen = set(tensors)
    for fqn in objects:
        if type(fqn) is not str:
            raise CorruptCheckpointError(f"object name {shown_value(fqn)} is not a string")
        if fqn in seen:
            raise CorruptCheckpointError(f"{fqn!r} is both a tensor and an object")
        seen.add(fqn)
