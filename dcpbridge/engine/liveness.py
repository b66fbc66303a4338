"""Peer liveness for store-backed exchanges: a heartbeat per process, and waits that see it stop.

A key-value store cannot tell a slow peer from a dead one: a ``get`` of a key a killed rank
would have set waits for the store's whole timeout (30 minutes by default). Each process that
takes part in such exchanges therefore raises a counter in the store every ``period()``
seconds (5 s by default: 16,384 ranks then cost the store about 3,300 requests a second) from
a thread of its own. A waiter blocks in the store for its keys (one request, woken by them,
no polling); while it waits, its process's heartbeat thread looks at the counters of the
ranks whose keys are missing once a period, and when one has not moved for
``peer_timeout()`` seconds it sets that rank's missing keys to a ``DEAD`` mark, which wakes
the waiter (and every other rank waiting for them) to raise. Only local clocks are compared,
so nodes' clocks may disagree.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import pickle
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
DEAD = b"\x00dcpbridge-dead:"
"""What the heartbeat thread sets a dead rank's awaited key to (a pickle never starts so)."""


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
        self.base = store.clone()  # this thread's client of ``store``: beats and marks
        self._store = dist.PrefixStore(_PREFIX, self.base)
        self._waits: dict[int, _Watched] = {}
        self._waits_lock = threading.Lock()
        self._key = str(rank)
        self._pid = os.getpid()
        self._source = weakref.ref(store)
        self._stop = threading.Event()
        self._period = period()
        self._store.add(self._key, 1)  # a first beat at once: the peers see it started
        self._thread = threading.Thread(target=self._run, name="dcpbridge-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def ensure(cls, store: Any, rank: int) -> Heartbeat | None:
        """This process's heartbeat in ``store``, started if need be; None where the store
        cannot carry one (it cannot be cloned: waits then end at the store's timeout only)."""
        with cls._lock:
            beat = cls._current
            if beat is not None and beat.alive and beat._source() is store:
                return beat
            if beat is not None and beat._pid == os.getpid():
                beat.stop()
            try:
                cls._current = Heartbeat(store, rank)
            except (RuntimeError, NotImplementedError, AttributeError):
                cls._current = None
            return cls._current

    @property
    def alive(self) -> bool:
        return self._pid == os.getpid() and self._thread.is_alive()

    def watch(self, view: Any, keys: list[str], owners: list[int]) -> int:
        """Look after one wait: ``keys`` (in ``view``, a client of this heartbeat's ``base``
        that addresses them as the waiter's store does), set by global ranks ``owners``."""
        watched = _Watched(view, keys, owners, PeerWatch(self.base, owners, peer_timeout()))
        with self._waits_lock:
            self._waits[id(watched)] = watched
        return id(watched)

    def unwatch(self, token: int) -> None:
        with self._waits_lock:
            self._waits.pop(token, None)

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._store.add(self._key, 1)
            except Exception:  # the store (and with it the job) is gone: nothing to tell
                return
            # the peers judge by the timeout they read now: beat by the same one
            with contextlib.suppress(InvalidArgumentError):  # a bad value keeps the last
                self._period = period()
            with self._waits_lock:
                waits = list(self._waits.values())
            for watched in waits:
                try:
                    watched.look()
                except Exception:  # the store is gone: its waiters raise on their own
                    return

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
        self.timeout = timeout
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
            elif now - since > self.timeout:
                out.append(r)
        return out


class _Watched:
    """One wait the heartbeat thread looks after."""

    def __init__(self, view: Any, keys: list[str], owners: list[int], peers: PeerWatch) -> None:
        self.view, self.keys, self.owners, self.peers = view, keys, owners, peers

    def look(self) -> None:
        """Mark the missing keys of ranks that stopped beating ``DEAD`` (only where still
        unset: a late real value is never replaced), which wakes their waiters."""
        missing = [(k, o) for k, o in zip(self.keys, self.owners) if not self.view.check([k])]
        dead = self.peers.silent(sorted({o for _, o in missing}))
        if not dead:
            return
        mark = (
            DEAD
            + (
                f"rank(s) {dead} stopped answering (no heartbeat for {self.peers.timeout:g} s, "
                f"${PEER_TIMEOUT_ENV}): the process died or hangs"
            ).encode()
        )
        for key, owner in missing:
            if owner in dead:
                self.view.compare_set(key, "", mark)


def get_all(
    store: Any,
    keys: Sequence[str],
    owners: Sequence[int],
    *,
    beat: Heartbeat | None,
    view: Any | None,
    what: str,
) -> list[bytes]:
    """The values of ``keys`` in ``store``, waiting for each (one request where the store
    offers ``multi_get``): set by its owner (global rank ``owners[i]``), or marked ``DEAD``
    by ``beat``'s thread when that owner stopped beating (``view``: the same keys through
    ``beat``'s client; None, or no ``beat``: no liveness look). Read them with ``loads``.
    Raises ``CollectiveError`` when the store's own timeout passes first."""
    keys = list(keys)
    token = beat.watch(view, keys, list(owners)) if beat is not None and view is not None else None
    try:
        if hasattr(store, "multi_get"):  # 8 ranks on 2 cores: an all-gather in 4.9 ms, not 14.3
            return store.multi_get(keys)
        return [store.get(k) for k in keys]
    except dist.DistStoreError as e:
        waiting = sorted({o for k, o in zip(keys, owners) if not store.check([k])})
        raise CollectiveError(
            f"{what}: rank(s) {waiting} did not answer within the store's timeout "
            f"({_seconds(store)})"
        ) from e
    finally:
        if token is not None:
            beat.unwatch(token)  # type: ignore[union-attr]


def loads(raw: bytes, what: str) -> Any:
    """A value set by an exchange's rank (a pickle), or raise ``CollectiveError`` where the
    heartbeat thread marked it ``DEAD`` (its rank stopped beating)."""
    if raw.startswith(DEAD):
        raise CollectiveError(f"{what}: {raw[len(DEAD) :].decode(errors='replace')}")
    return pickle.loads(raw)


def _seconds(store: Any) -> str:
    timeout = getattr(store, "timeout", None)
    return f"{timeout.total_seconds():.0f} s" if isinstance(timeout, timedelta) else "its timeout"
