"""The one place dcpbridge calls torch.distributed: object and tensor collectives on one group."""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dcpbridge.engine.liveness import DEAD, Heartbeat, get_all, loads
from dcpbridge.errors import CheckpointError, CollectiveError, InvalidArgumentError

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def _exchanging(group: Group, op: str) -> Iterator[None]:
    """Raise a failed exchange (a peer died, timed out or left) as ``CollectiveError``."""
    try:
        yield
    except CheckpointError:
        raise
    except (RuntimeError, OSError) as e:  # torch's DistError family and socket errors
        raise CollectiveError(
            f"rank {group.rank} of {group.size}: {op} with the other ranks failed (a rank "
            f"died, hung past the process group's timeout or left): {type(e).__name__}: {e}"
        ) from e
    except ValueError as e:  # torch's answer for a group destroyed meanwhile
        if group.pg is None or not Group.destroyed(group.pg):
            raise
        raise CollectiveError(
            f"rank {group.rank} of {group.size}: {op} with the other ranks failed: the "
            f"process group was destroyed: {e}"
        ) from e


def collective(op: str) -> Callable[[F], F]:
    """Run a ``Group`` method inside ``_exchanging``, naming the exchange ``op``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(self: Group, *args: Any, **kwargs: Any) -> Any:
            with _exchanging(self, op):
                return fn(self, *args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


@dataclass(frozen=True)
class Group:
    """A process group (or a single process) and this process's place in it."""

    pg: dist.ProcessGroup | None
    rank: int
    size: int
    coordinator: int  # global rank of the group's rank 0

    @staticmethod
    def resolve(process_group: dist.ProcessGroup | None = None) -> Group:
        """``process_group``, the default group, or one process when distributed is not up."""
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise InvalidArgumentError(
                    "a process_group was given but torch.distributed is not initialized"
                )
            return Group(None, 0, 1, 0)
        pg = process_group or dist.group.WORLD
        rank = dist.get_rank(pg)
        if rank < 0:
            raise InvalidArgumentError("this process is not a member of the given process_group")
        return Group(pg, rank, dist.get_world_size(pg), dist.get_global_rank(pg, 0))

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @staticmethod
    def destroyed(pg: dist.ProcessGroup) -> bool:
        """Whether ``pg`` was destroyed (``destroy_process_group``), here or with the job."""
        if not (dist.is_available() and dist.is_initialized()):
            return True
        return pg not in dist.distributed_c10d._world.pg_map

    @property
    def distributed(self) -> bool:
        return self.pg is not None and self.size > 1

    @collective("gather")
    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the coordinator (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=self.coordinator, group=self.pg)
        return out

    @collective("scatter")
    def scatter(self, objs: list[Any] | None) -> Any:
        """Rank ``i`` receives ``objs[i]`` from the coordinator."""
        if not self.distributed:
            assert objs is not None
            return objs[0]
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs, src=self.coordinator, group=self.pg)
        return out[0]

    @collective("broadcast")
    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.coordinator, group=self.pg)
        return box[0]

    @collective("all_gather")
    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    @collective("broadcast_tensor")
    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite ``tensor`` (contiguous, same byte size everywhere) with group rank ``src``'s.

        Sent as raw bytes, so any dtype travels (gloo lacks bool, float8, ... reductions).
        """
        if not self.distributed or tensor.numel() == 0:
            return
        data = _as_bytes(tensor, "broadcast_tensor needs a contiguous tensor")
        root = dist.get_global_rank(self.pg, src) if src else self.coordinator
        dist.broadcast(data, src=root, group=self.pg)

    @collective("exchange")
    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int, int]],
        recvs: list[tuple[torch.Tensor, int, int]],
    ) -> None:
        """Point-to-point: send each ``(tensor, dst, tag)``, receive each ``(tensor, src, tag)``.

        Ranks are group ranks; tensors must be contiguous; any dtype travels as bytes.
        """
        if not (sends or recvs):
            return
        ops = [
            dist.P2POp(dist.isend, _as_bytes(t), dist.get_global_rank(self.pg, dst), self.pg, tag)
            for t, dst, tag in sends
        ] + [
            dist.P2POp(dist.irecv, _as_bytes(t), dist.get_global_rank(self.pg, src), self.pg, tag)
            for t, src, tag in recvs
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    @property
    def tensor_device(self) -> torch.device:
        """Where tensors must live to travel through this group's backend."""
        if not self.distributed:
            return torch.device("cpu")
        backend = str(dist.get_backend(self.pg)).lower()
        if "nccl" in backend and "gloo" not in backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _as_bytes(
    t: torch.Tensor, error: str = "point-to-point transfers need contiguous tensors"
) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view; raises ``InvalidArgumentError(error)`` if ``t`` is
    not contiguous. Flattened by its elements' run, not ``reshape``: a contiguous tensor's
    size-1 dims may have any stride, which ``reshape(-1)`` of one element keeps."""
    if not t.is_contiguous():
        raise InvalidArgumentError(error)
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def own_client(store: Any) -> Any:
    """A new client of ``store`` (``store`` itself where it cannot be cloned).

    A store call holds the client it runs on until it returns, so a group that waits for its
    peers in the background must not wait on the job's client: the job's own store calls
    (creating a process group, a barrier) would queue behind the wait. A clone also does not
    keep rank 0's store server (and its port) alive once the job destroys its process group.
    """
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError, AttributeError):
        return store


class StoreGroup(Group):
    """The same object collectives over the job's key-value store instead of a process group.

    Background saves use it: store requests are independent RPCs, so they never interleave
    with the training loop's collectives, and no process group has to be created (which
    torch cannot do reliably from inside a sub-group of an already running job). It talks
    to the store through a client of its own (``own_client``).
    """

    def __init__(
        self,
        group: Group,
        store: Any,
        name: str,
        members: tuple[int, ...] | None = None,
        beat: Heartbeat | None = None,
    ) -> None:
        """``members``: the global ranks of the group's ranks; ``beat``: this process's
        heartbeat in ``store`` (see ``liveness``; None: waits cannot tell a dead member from
        a slow one)."""
        super().__init__(None, group.rank, group.size, 0)
        store = own_client(store)  # its waits never hold up the job's calls on ``store``
        object.__setattr__(self, "_client", store)
        prefix = f"dcpbridge/{name}/"
        object.__setattr__(self, "_store", dist.PrefixStore(prefix, store))
        object.__setattr__(self, "_seq", iter(range(1 << 62)))
        object.__setattr__(self, "_members", members or tuple(range(group.size)))
        object.__setattr__(self, "_beat", beat)
        # the group's keys through the heartbeat's client, which marks a dead rank's ones
        view = dist.PrefixStore(prefix, beat.base) if beat is not None else None
        object.__setattr__(self, "_view", view)

    _created: Counter[tuple[str, tuple[int, ...]]] = Counter()

    @classmethod
    def for_group(cls, group: Group, purpose: str) -> Group:
        """A store-backed twin of ``group`` (one process alone when there is nothing to sync).

        Its key prefix depends only on ``purpose``, the member ranks and how many twins for
        them this process made before, so every member derives the same one unaided. It
        holds no reference to ``group``'s process group.
        """
        if not group.distributed:
            return Group(None, group.rank, group.size, group.coordinator)
        store = dist.distributed_c10d._get_default_store()
        ranks = tuple(dist.get_process_group_ranks(group.pg))
        serial = StoreGroup._created[(purpose, ranks)]
        StoreGroup._created[(purpose, ranks)] += 1
        beat = Heartbeat.ensure(store, dist.get_rank())
        return cls(group, store, f"{purpose}/{'-'.join(map(str, ranks))}/{serial}", ranks, beat)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def _next(self, op: str) -> str:
        return f"{next(self._seq)}/{op}"

    def _get(self, keys: list[str], owners: list[int], op: str) -> list[Any]:
        """The values group ranks ``owners`` set at ``keys``, waiting for them; raises
        ``CollectiveError`` where one of them stopped beating (see ``liveness``)."""
        what = self._what(op)
        return [loads(v, what) for v in self._wait(keys, owners, op)]

    def _wait(self, keys: list[str], owners: list[int], op: str) -> list[bytes]:
        """``_get``'s raw values: each a pickle or a ``DEAD`` mark (read with ``loads``)."""
        beat = self._beat if self._beat is not None and self._beat.alive else None
        members = [self._members[r] for r in owners]
        return get_all(self._store, keys, members, beat=beat, view=self._view, what=self._what(op))

    def _what(self, op: str) -> str:
        return f"rank {self.rank} of {self.size}: {op}"

    def _forget(self, keys: list[str]) -> None:
        """Delete the keys of a failed exchange that no other rank reads (no rank would count
        out of them); stops at the first failing call (the store is gone with its keys)."""
        for key in keys:
            try:
                self._store.delete_key(key)
            except Exception:
                return

    def _publish(self, key: str, obj: Any, op: str) -> None:
        """Set this rank's ``key`` to ``obj`` unless a peer's heartbeat thread already marked it
        ``DEAD`` (this rank was silent too long): then raise, as every reader of the mark does.

        Set only where unset, never over a mark: every reader of a broadcast or all-gather
        sees the same value at each key (which ``_count_out`` relies on), and a slow rank its
        peers gave up on fails with them instead of carrying on alone.
        """
        raw = pickle.dumps(obj)
        got = self._store.compare_set(key, "", raw)
        if got != raw:
            why = got[len(DEAD) :].decode(errors="replace") if got.startswith(DEAD) else "set"
            raise CollectiveError(
                f"{self._what(op)}: the other ranks gave up on this rank before it answered ({why})"
            )

    def _count_out(self, key: str, names: list[str], readers: int, failed: bool) -> None:
        """Count this rank out of ``key``'s values ``names``, read by ``readers`` ranks: the last
        one deletes them, so a rank never waits for a key another rank already deleted.

        A failed exchange counts out as well (its keys would stay in the job's store for good
        otherwise): every reader saw the same ``DEAD`` marks (``_publish``), so the readers
        that count out are the same on every rank. ``failed``: best effort, the store may be
        gone, and the exchange's own error is the one to raise.
        """
        try:
            if self._store.add(f"{key}/readers", 1) == readers:
                for n in [*names, f"{key}/readers"]:
                    self._store.delete_key(n)
        except Exception:
            if not failed:
                raise

    @collective("gather")
    def gather(self, obj: Any) -> list[Any] | None:
        key = self._next("gather")
        if not self.is_coordinator:
            self._store.set(f"{key}/{self.rank}", pickle.dumps(obj))
            return None
        keys = [f"{key}/{r}" for r in range(1, self.size)]
        try:
            out = [obj, *self._get(keys, list(range(1, self.size)), "gather")]
        except BaseException:
            self._forget(keys)  # the coordinator alone reads a gather's values
            raise
        for k in keys:
            self._store.delete_key(k)
        return out

    @collective("scatter")
    def scatter(self, objs: list[Any] | None) -> Any:
        key = self._next("scatter")
        if self.is_coordinator:
            assert objs is not None
            for r in range(1, self.size):
                self._store.set(f"{key}/{r}", pickle.dumps(objs[r]))
            return objs[0]
        try:
            (value,) = self._get([f"{key}/{self.rank}"], [0], "scatter")
        except BaseException:
            self._forget([f"{key}/{self.rank}"])  # read by this rank alone
            raise
        self._store.delete_key(f"{key}/{self.rank}")
        return value

    @collective("broadcast")
    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank; the other ranks read it and count out."""
        key = self._next("broadcast")
        value = f"{key}/value"
        if self.is_coordinator:
            self._publish(value, obj, "broadcast")
            return obj
        (raw,) = self._wait([value], [0], "broadcast")
        self._count_out(key, [value], self.size - 1, failed=raw.startswith(DEAD))
        return loads(raw, self._what("broadcast"))

    @collective("broadcast_tensor")
    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> None:
        raise InvalidArgumentError(
            "a StoreGroup carries objects only; broadcast tensors on a process group"
        )

    @collective("all_gather")
    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on every rank; a rank marked dead never counts out of it."""
        key = self._next("all_gather")
        keys = [f"{key}/{r}" for r in range(self.size)]
        self._publish(keys[self.rank], obj, "all_gather")
        raw = self._wait(keys, list(range(self.size)), "all_gather")
        dead = sum(v.startswith(DEAD) for v in raw)
        self._count_out(key, keys, self.size - dead, failed=dead > 0)
        what = self._what("all_gather")
        return [loads(v, what) for v in raw]


SIDE_TIMEOUT = timedelta(minutes=5)
"""How long a side group's byte transfer waits for a silent peer (a dead one fails at once)."""


class SideGroup(StoreGroup):
    """A ``StoreGroup`` that also moves bytes, over a private gloo backend of its members.

    The local tier's copies and peer fetches travel here, never on the training group, from
    a background thread too: like every ``StoreGroup`` it has its own store client (a
    blocking ``get`` holds the client it runs on, so sharing async_save's would deadlock).
    The backend is made directly (not with ``new_group``, whose names depend on how many
    groups each rank created before), rendezvousing under the group's own store prefix.
    """

    def __init__(
        self,
        group: Group,
        store: Any,
        name: str,
        members: tuple[int, ...] | None = None,
        beat: Heartbeat | None = None,
    ) -> None:
        super().__init__(group, store, name, members, beat)
        prefix = dist.PrefixStore(f"dcpbridge/{name}/gloo/", self._client)
        with _exchanging(self, "connecting the side group"):
            backend = dist.ProcessGroupGloo(prefix, group.rank, group.size, SIDE_TIMEOUT)
        object.__setattr__(self, "_gloo", backend)

    @collective("exchange")
    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int, int]],
        recvs: list[tuple[torch.Tensor, int, int]],
    ) -> None:
        """Point-to-point over the side backend (group ranks), as ``Group.exchange``."""
        if self._gloo is None:
            raise InvalidArgumentError("the side group was closed: it moves no more bytes")
        works = [self._gloo.send([_as_bytes(t)], dst, tag) for t, dst, tag in sends]
        works += [self._gloo.recv([_as_bytes(t)], src, tag) for t, src, tag in recvs]
        for work in works:
            work.wait()

    def close(self) -> None:
        """Shut the side backend down and drop it, here and now (idempotent).

        Left to the collector, a closed owner's reference cycles kept it alive until some
        later collection, which may run in a forked child (a DataLoader worker) that lacks
        the backend's threads: destroying it there hung or crashed the child.
        """
        backend = self._gloo
        if backend is None:
            return
        object.__setattr__(self, "_gloo", None)
        backend.shutdown()
