"""Rows kept as parallel lists of plain values: what a rank sends its coordinator (plan items,
write results) pickles fast that way, and the receiver makes a row's object only when it is
asked for (``planners.wire.ReceivedItems``, ``storage.write.written.PackedResults``)."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, overload

T = TypeVar("T")

_FQN, _OFFSET, _HINT = (operator.attrgetter(n) for n in ("fqn", "offset", "index"))


def index_columns(indexes: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """DCP ``MetadataIndex``es as three parallel lists of plain values: each one's fqn,
    offset (a tuple, or None) and index hint (``MetadataIndex(*row)`` makes it again)."""
    return (
        list(map(_FQN, indexes)),
        [None if o is None else tuple(o) for o in map(_OFFSET, indexes)],
        list(map(_HINT, indexes)),
    )


class PackedRows(Sequence[T]):
    """``width`` parallel lists of one length; row ``i``'s object is ``_make(*row i)``, made
    the first time it is asked for and kept (the same object for the same position)."""

    __slots__ = ("_fields", "_made")
    width = 0

    def __init__(self, *fields: list[Any]) -> None:
        if len(fields) != self.width or len({len(f) for f in fields}) > 1:
            raise ValueError(f"{type(self).__name__}: {self.width} fields of one length expected")
        self._fields = fields
        self._made: dict[int, T] = {}

    def _make(self, *row: Any) -> T:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._fields[0])

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        i %= n
        made = self._made.get(i)
        if made is None:
            made = self._made[i] = self._make(*(f[i] for f in self._fields))
        return made

    def __iter__(self) -> Iterator[T]:
        return map(self.__getitem__, range(len(self)))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self._fields)
