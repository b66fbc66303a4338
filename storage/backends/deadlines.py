"""How long each object store request may wait, so that a stalled store fails an operation in a
known time: ``request_timeout`` per request until one times out, then a short shared budget.

Once a request has timed out, the operation is failing: what follows is cleanup (abort the
multipart upload, read the commit file to see whether the save landed, list and remove its
files). Each such request on the same storage shares what is left of ``cleanup_timeout``
seconds, counted from the first timeout, and one asked for after that budget is spent fails at
once, unsent. A stalled store thus fails a save or load within ``request_timeout +
cleanup_timeout`` (``failure_bound``), however many cleanup requests follow. ``restart`` (a new
save or load through the same storage) gives requests their full ``request_timeout`` again.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable
from typing import Any

DEFAULT_REQUEST_TIMEOUT = 120.0  # seconds; well under torch's 30 min collective timeout
DEFAULT_CLEANUP_TIMEOUT = 30.0  # seconds shared by all requests after a timeout


def failure_bound(request_timeout: float, cleanup_timeout: float) -> float:
    """Seconds within which a stalled store fails an operation on the rank it stalls."""
    return request_timeout + cleanup_timeout


class RequestTimeoutError(OSError):
    """An object store request (retries included) did not finish within its timeout."""


class RequestBudget:
    """The timeout of each request of one storage: full until a request times out, then what
    is left of the cleanup budget (thread-safe: requests run on several threads)."""

    def __init__(self, request_timeout: float, cleanup_timeout: float) -> None:
        self.request_timeout = request_timeout
        self.cleanup_timeout = cleanup_timeout
        self._lock = threading.Lock()
        self._cleanup_ends: float | None = None  # monotonic time; None: no timeout yet

    def restart(self) -> None:
        """A new operation begins: requests get their full ``request_timeout`` again."""
        with self._lock:
            self._cleanup_ends = None

    def timeout(self) -> float:
        """Seconds the next request may take (0: the cleanup budget is spent)."""
        with self._lock:
            if self._cleanup_ends is None:
                return self.request_timeout
            left = self._cleanup_ends - time.monotonic()
        return max(0.0, min(self.request_timeout, left))

    def timed_out(self, waited: float, what: str) -> RequestTimeoutError:
        """Record that request ``what`` got no answer within ``waited`` s; the error to raise."""
        with self._lock:
            first = self._cleanup_ends is None
            if first:
                self._cleanup_ends = time.monotonic() + self.cleanup_timeout
        if first or waited >= self.request_timeout:
            return RequestTimeoutError(
                f"no answer within {waited:g} s ({what}; storage option request_timeout): the "
                "object store or the network to it is stalled"
            )
        return RequestTimeoutError(
            f"no answer within {waited:g} s ({what}), the rest of the cleanup budget after a "
            f"request timed out (storage option cleanup_timeout = {self.cleanup_timeout:g} s)"
        )

    def spent(self, what: str) -> RequestTimeoutError:
        """The error for request ``what`` not sent because the cleanup budget is spent."""
        return RequestTimeoutError(
            f"{what} not sent: a request timed out and the {self.cleanup_timeout:g} s cleanup "
            "budget after it is spent (storage option cleanup_timeout)"
        )

    async def bounded(self, awaitable: Awaitable[Any], what: str) -> Any:
        """``awaitable``, cancelled and failed with ``RequestTimeoutError`` at its timeout."""
        timeout = self.timeout()
        if timeout <= 0:
            _close(awaitable)
            raise self.spent(what)
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError:
            raise self.timed_out(timeout, what) from None


def _close(awaitable: Awaitable[Any]) -> None:
    """Discard a coroutine that will not be awaited (no "never awaited" warning)."""
    close = getattr(awaitable, "close", None)
    if close is not None:
        close()
