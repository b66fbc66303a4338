"""Count the collectives dcpbridge issues, by wrapping ``Group``'s methods for a test's duration."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from dcpbridge.engine.collectives import Group, StoreGroup


def _issues(method: str, group: Group, args: tuple[Any, ...]) -> bool:
    """Whether this call reaches torch.distributed (or the store) at all."""
    if method == "exchange":
        return bool(args[0] or args[1])
    if method == "broadcast_tensor":
        return group.distributed and args[0].numel() > 0
    return group.distributed


_NAMES = {"exchange": "p2p"}
_METHODS = ("gather", "scatter", "broadcast", "all_gather", "broadcast_tensor", "exchange")


@contextlib.contextmanager
def _on_each_call(note: Callable[[str, Group], None]) -> Iterator[None]:
    """Within the block, ``note(method, group)`` for every collective issued."""

    def wrap(method: str, original: Callable[..., Any]) -> Any:
        @functools.wraps(original)
        def wrapped(self: Group, *args: Any, **kwargs: Any) -> Any:
            if _issues(method, self, args):
                note(method, self)
            return original(self, *args, **kwargs)

        return wrapped

    saved = [
        (cls, m, cls.__dict__[m])
        for cls in (Group, StoreGroup)
        for m in _METHODS
        if m in cls.__dict__
    ]
    for cls, method, original in saved:
        setattr(cls, method, wrap(method, original))
    try:
        yield
    finally:
        for cls, method, original in saved:
            setattr(cls, method, original)


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter[str]]:
    """Within the block, count every collective issued, by method (``exchange`` as ``p2p``)."""
    calls: Counter[str] = Counter()

    def note(method: str, group: Group) -> None:
        calls[_NAMES.get(method, method)] += 1

    with _on_each_call(note):
        yield calls


@contextlib.contextmanager
def record_collectives() -> Iterator[list[tuple[str, str, str]]]:
    """Within the block, record every collective issued as (method, thread name, group class)."""
    calls: list[tuple[str, str, str]] = []

    def note(method: str, group: Group) -> None:
        calls.append((method, threading.current_thread().name, type(group).__name__))

    with _on_each_call(note):
        yield calls
