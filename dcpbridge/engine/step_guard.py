"""Hold ``optimizer.step()`` until a background-staged save has copied the state it saves."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from dcpbridge.engine.async_save import AsyncSaveHandle
from dcpbridge.errors import InvalidArgumentError


class StepGuard:
    """Step pre-hooks on the watched optimizers: each step first waits until the saves
    ``pending()`` returns are staged, and its GPU work for their staging copies (saves made
    with ``defer_stream_wait``); ``waited`` sums the seconds steps waited on the host."""

    def __init__(self, pending: Callable[[], list[AsyncSaveHandle]]) -> None:
        self._pending = pending
        self._hooks: list[tuple[weakref.ref[Any], Any]] = []  # (optimizer, its hook's handle)
        self.waited = 0.0

    @property
    def watching(self) -> bool:
        return bool(self._hooks)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Guard ``optimizer``'s steps (once, however often it is watched)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(
                f"watch() takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not any(ref() is optimizer for ref, _ in self._hooks):
            hook = optimizer.register_step_pre_hook(self._before_step)
            self._hooks.append((weakref.ref(optimizer), hook))

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for handle in self._pending():
            if not handle.staged:
                start = time.perf_counter()
                handle.wait_staged()
                self.waited += time.perf_counter() - start
            handle.hold_streams()

    def close(self) -> None:
        """Remove the hooks."""
        for _, hook in self._hooks:
            hook.remove()
        self._hooks.clear()
