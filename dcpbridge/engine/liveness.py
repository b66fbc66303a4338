"""Peer liveness for store-backed exchanges: a heartbeat per process, and waits that see it stop.

A key-value store cannot tell a slow peer from a dead one: a ``get`` of a key a killed rank
would have set waits for the store's whole timeout (30 minutes by default). Each process that
takes part in such exchanges therefore raises a counter in the store every ``period()``
seconds (5 s by default: 16,384 ranks then cost the store about 3,300 requests a second) from
a thread of its own; a waiter blocks in the store for its keys (one request per period, woken
by them) and between two such waits gives up on a peer whose counter has not
moved for ``peer_timeout()`` seconds. Only local clocks are compared, so nodes' clocks may
disagree.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dcpbridge.errors import CollectiveError, InvalidArgumentError

PEER_TIMEOUT_ENV = "DCPB_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT = 60.0
"""Seconds without a beat after which a waited-for peer counts as dead (the environment
variable overrides it; at least 1 s)."""

_PREFIX = "dcpbridge/alive/"


def peer_timeout() -> float:
    """How long a peer may stay silent: ``$DCPB_PEER_TIMEOUT`` or 60 s, at least 1 s."""
    raw = os.environ.get(PEER_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_PEER_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{PEER_TIMEOUT_ENV}={raw!r}: expected seconds, a number > 0")
    return max(value, 1.0)


def period() -> float:
    """Seconds between two beats: a twelfth of the peer timeout, within 0.25 s and 5 s."""
    return min(5.0, max(0.25, peer_timeout() / 12))


class Heartbeat:
    """This process's beat in one store: ``dcpbridge/alive/<global rank>``, raised each period.

    One per process and store, started by the first store-backed group; it beats on a clone of
    the store (a store call blocks the client it runs on) from a daemon thread, and stops at
    exit or at the first failing call (the store is gone with its job). It holds the store
    weakly: a destroyed process group's store (rank 0's server with its port) goes with it.
    """

    _current: Heartbeat | None = None
    _lock = threading.Lock()

    def __init__(self, store: Any, rank: int) -> None:
        self._store = dist.PrefixStore(_PREFIX, store.clone())
        self._key = str(rank)
        self._pid = os.getpid()
        self._source = weakref.ref(store)
        self._stop = threading.Event()
        self._period = period()
        self._store.add(self._key, 1)  # a first beat at once: the peers see it started
        self._thread = threading.Thread(target=self._run, name="dcpbridge-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def ensure(cls, store: Any, rank: int) -> bool:
        """Make sure this process beats in ``store``; False where the store cannot carry it
        (a store that cannot be cloned: its waits then end at the store's timeout only)."""
        with cls._lock:
            beat = cls._current
            if (
                beat is not None
                and beat._pid == os.getpid()
                and beat._source() is store
                and beat._thread.is_alive()
            ):
                return True
            if beat is not None and beat._pid == os.getpid():
                beat.stop()
            try:
                cls._current = Heartbeat(store, rank)
            except (RuntimeError, NotImplementedError, AttributeError):
                cls._current = None
                return False
            return True

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store (and with it the job) is gone: nothing to tell
                return
            # the peers judge by the timeout they read now: beat by the same one
            with contextlib.suppress(InvalidArgumentError):  # a bad value keeps the last
                self._period = period()

    def stop(self) -> None:
        """Stop beating (peers waiting for this process then give up on it)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._period)


@atexit.register
def _stop_at_exit() -> None:
    beat = Heartbeat._current
    if beat is not None and beat._pid == os.getpid():
        beat.stop()


class PeerWatch:
    """The heartbeats of the peers one wait depends on, and which of them stopped."""

    def __init__(self, store: Any, ranks: Sequence[int], timeout: float) -> None:
        self._store = dist.PrefixStore(_PREFIX, store)
        self._timeout = timeout
        now = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {r: (-1, now) for r in ranks}

    def silent(self, ranks: Sequence[int]) -> list[int]:
        """Which of ``ranks`` have not beaten for longer than the timeout, by local time."""
        now = time.monotonic()
        out = []
        for r in ranks:
            count = self._store.add(str(r), 0)  # reads the counter (0 if it never beat)
            last, since = self._seen.get(r, (-1, now))
            if count != last:
                self._seen[r] = (count, now)
            elif now - since > self._timeout:
                out.append(r)
        return out


def wait_for_keys(
    store: Any,
    keys: Sequence[str],
    owners: Sequence[int],
    *,
    heartbeats: Any | None,
    what: str,
) -> None:
    """Return once every ``keys[i]`` is set (by global rank ``owners[i]``).

    Raises ``CollectiveError`` when an owner whose key is missing stops beating in
    ``heartbeats`` (the store the heartbeats live in; None: no liveness check), or when the
    store's own timeout passes, as a blocking ``get`` would.
    """
    keys = list(keys)
    timeout = getattr(store, "timeout", None)
    budget = timeout.total_seconds() if isinstance(timeout, timedelta) else math.inf
    start = time.monotonic()
    patience, look_every = peer_timeout(), period()
    watch = PeerWatch(heartbeats, owners, patience) if heartbeats is not None else None
    while True:
        # blocks in the store (woken by the keys, one request) until the next look
        step = min(look_every, max(budget - (time.monotonic() - start), 0.001))
        try:
            store.wait(keys, timedelta(seconds=step))
            return
        except dist.DistStoreError:  # the step passed with a key still missing
            pass
        now = time.monotonic()
        waiting = sorted({o for k, o in zip(keys, owners) if not store.check([k])})
        if not waiting:
            return
        dead = watch.silent(waiting) if watch is not None else []
        if dead:
            raise CollectiveError(
                f"{what}: rank(s) {dead} stopped answering (no heartbeat for "
                f"{patience:g} s, ${PEER_TIMEOUT_ENV}): the process died or hangs"
            )
        if now - start >= budget:
            raise CollectiveError(
                f"{what}: rank(s) {waiting} did not answer within the store's timeout "
                f"({budget:.0f} s)"
            )
