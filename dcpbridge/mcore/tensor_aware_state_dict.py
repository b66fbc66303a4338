"""What one rank keeps of a sharded state dict, with its tensors separable: for node-local saves.

A node-local checkpoint manager builds a ``TensorAwareStateDict``, pops its tensors to store
them its own way (``torch.save`` per rank, a replica on a peer node, ...), stores the hollow
rest, and to restore inserts the tensors back and calls ``to_state_dict``. With
``algo="fully_parallel"`` each shard the parallelization group holds (e.g. data-parallel
replicas) is kept by exactly one member, balancing bytes, and ``to_state_dict`` sends each
member the shards it needs from the member that kept them. With ``algo="atomic"`` every rank
keeps all it holds and restores alone. Collectives carry failures: a rank that fails makes
every member raise, never wait.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dcpbridge.engine import protocol
from dcpbridge.engine.cache import structure_of
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.ownership import WriteId, shard_id, write_id
from dcpbridge.engine.save import split_for_save
from dcpbridge.engine.staging import allocated
from dcpbridge.errors import (
    HollowStateError,
    InvalidArgumentError,
    InvalidShardError,
)
from dcpbridge.mcore.restore_plan import Manifest, RestorePlan, ShardMeta, plan_restore
from dcpbridge.model.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    is_main_replica,
)
from dcpbridge.model.state import (
    HOLE,
    apply_factories,
    assemble,
    extract,
    is_nonpersistent,
    is_sharded,
    leaves,
    map_leaves,
)
from dcpbridge.model.ties import Ties, untie_checked
from dcpbridge.planners import StrictMode
from dcpbridge.planners.distribution import Holding, distribute
from dcpbridge.planners.strict import Policy, decide, parse_strict
from dcpbridge.storage.read.delivery import as_shown, holds_its_values

log = logging.getLogger(__name__)

ALGOS = ("fully_parallel", "atomic")
EXCHANGE_ALGOS = ("broadcast", "p2p")
# What the stored state is, in key-mismatch messages.
KEPT_BY_GROUP = "the state kept by the group"
KEPT_BY_EACH = "the state each rank kept itself (algo='atomic' restores only that)"


@dataclass(frozen=True)
class ShardDistribution:
    """Which member of the parallelization group keeps each shard (``from_state_dict``'s cache).

    ``keepers`` maps a shard id ``(key, global_offset, box size)`` (``ownership.write_id``:
    a replica sharded otherwise than its main, at its offset, is another shard) to a group
    rank; ``structure``
    fingerprints the shards and group of the rank that computed it, so reusing it for another
    structure is refused instead of silently keeping the wrong shards. Per rank, in memory.
    """

    keepers: dict[WriteId, int]
    structure: int
    mains: frozenset[WriteId] | None = None
    """The shards some member holds as a main replica: the kept copies a save writes (None:
    every kept shard, as before this field existed)."""


_KEPT = "__tensor_aware_kept__"  # where sharded_state_dict_for_save puts the kept shards


class TensorAwareStateDict:
    """One rank's common state, kept shards and (unless hollow) their tensors; picklable."""

    def __init__(
        self,
        common: Any,
        shards: list[Any],
        algo: str,
        empty: list[Any] = (),
        mains: frozenset[WriteId] | None = None,
    ) -> None:
        self.common = common
        self.shards = shards  # kept ShardedTensors and ShardedObjects, in state-dict order
        self.empty = list(empty)  # fully_parallel: main replicas of empty tensors (saved, no bytes)
        self.algo = algo
        self.mains = mains  # fully_parallel: the kept shards a save writes (None: all)
        self._popped_devices: list[torch.device] | None = None  # set while hollow
        self._orig_devices: list[torch.device] | None = None  # set by copy_tensors_to_cpu

    @classmethod
    def from_state_dict(
        cls,
        sharded_state_dict: ShardedStateDict,
        algo: str = "fully_parallel",
        parallelization_group: dist.ProcessGroup | None = None,
        cached_metadata: ShardDistribution | None = None,
    ) -> tuple[TensorAwareStateDict, ShardDistribution | None]:
        """This rank's part of ``sharded_state_dict`` and the distribution to cache.

        Factories are built and LocalNonpersistentObjects dropped (as for ``save``); the
        shards share their tensors with ``sharded_state_dict``. ``fully_parallel`` (a
        collective over ``parallelization_group``, default: the world) keeps each non-empty
        tensor shard some member holds on one member, main replica or not, so the group can
        restore without the others; ``cached_metadata`` (the distribution a previous call
        for the same structure returned) skips that exchange. ShardedObjects and the common
        state stay on every rank. ``atomic`` keeps everything and returns no distribution.
        """
        algo = _check_algo(algo)
        error: BaseException | None = None
        common: Any = {}
        shards: list[Any] = []
        try:
            common, shards = split_for_save(sharded_state_dict)
            for s in shards:
                if isinstance(s, ShardedTensor) and s.data is None:
                    raise InvalidShardError(f"ShardedTensor {s.key!r} has no data to keep")
        except Exception as e:  # raised on every member by the exchange below
            error = e
        if algo == "atomic":
            if error is not None:
                raise error
            return cls(common, [copy.copy(s) for s in shards], algo), None
        group = Group.resolve(parallelization_group)
        if cached_metadata is not None:
            if error is not None:
                raise error
            if cached_metadata.structure != structure_of(shards, group):
                raise InvalidArgumentError(
                    "cached_metadata was computed for other shards or another "
                    "parallelization group; call from_state_dict without it"
                )
            distribution = cached_metadata
        else:
            held = protocol.agree(group, "fully-parallel exchange", lambda: _held(error, shards))
            mains = frozenset(h.shard for mine in held for h in mine if h.main)
            keepers = distribute(held, only_main=False)
            distribution = ShardDistribution(keepers, structure_of(shards, group), mains)
        kept = [copy.copy(s) for s in shards if _keeps(s, distribution.keepers, group.rank)]
        empty = [
            copy.copy(s)
            for s in shards
            if isinstance(s, ShardedTensor) and s.numel == 0 and is_main_replica(s.replica_id)
        ]
        return cls(common, kept, algo, empty, distribution.mains), distribution

    def __repr__(self) -> str:
        return (
            f"TensorAwareStateDict(algo={self.algo!r}, shards={len(self.shards)}, "
            f"tensors={len(self._tensor_shards())}, hollow={self.is_hollow})"
        )

    # -- tensors ---------------------------------------------------------------------------

    def _tensor_shards(self) -> list[ShardedTensor]:
        return [s for s in self.shards if isinstance(s, ShardedTensor)]

    def _need_tensors(self, op: str) -> list[ShardedTensor]:
        if self.is_hollow:
            raise HollowStateError(
                f"{op}: the tensors were popped; insert_tensors or init_tensors first"
            )
        return self._tensor_shards()

    @property
    def is_hollow(self) -> bool:
        """True from ``pop_tensors`` until ``insert_tensors`` or ``init_tensors``."""
        return self._popped_devices is not None

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        """The kept tensors, in the order ``pop_tensors`` returns them."""
        return iter([s.data for s in self._need_tensors("tensors")])  # type: ignore[misc]

    @property
    def common_state_dict(self) -> StateDict:
        return self.common

    def pop_tensors(self) -> list[torch.Tensor]:
        """Take the tensors out, leaving shapes, dtypes and devices (the state becomes hollow)."""
        shards = self._need_tensors("pop_tensors")
        out = [s.data for s in shards]
        self._popped_devices = [t.device for t in out]  # type: ignore[union-attr]
        for s in shards:
            s.data = None
        return out  # type: ignore[return-value]

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put back what ``pop_tensors`` returned (or tensors of the same shapes and dtypes)."""
        if not self.is_hollow:
            raise HollowStateError("insert_tensors: the state dict still holds its tensors")
        data = list(tensor_data)
        shards = self._tensor_shards()
        if len(data) != len(shards):
            raise InvalidShardError(
                f"insert_tensors got {len(data)} tensors for {len(shards)} kept shards"
            )
        for s, t in zip(shards, data):
            if not isinstance(t, torch.Tensor) or (tuple(t.shape), t.dtype) != (
                s.local_shape,
                s.dtype,
            ):
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t)
                raise InvalidShardError(
                    f"insert_tensors: ShardedTensor {s.key!r} at offset {s.global_offset} "
                    f"needs shape {s.local_shape} and {s.dtype}, got {got}"
                )
        for s, t in zip(shards, data):
            s.data = t
        self._popped_devices = None

    def init_tensors(self) -> None:
        """Fill a hollow state with uninitialised tensors like the popped ones (e.g. to receive)."""
        if self._popped_devices is None:
            raise HollowStateError("init_tensors: the state dict still holds its tensors")
        for s, device in zip(self._tensor_shards(), self._popped_devices):
            s.data = torch.empty(s.local_shape, dtype=s.dtype, device=device)
        self._popped_devices = None

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by compact CPU copies; ``restore_tensor_device`` moves them back.

        The originals are left untouched (later updates of them do not reach the copies).
        With ``non_blocking``, copies from an accelerator go to pinned memory asynchronously:
        synchronize the device before reading them.
        """
        shards = self._need_tensors("copy_tensors_to_cpu")
        if self._orig_devices is None:
            self._orig_devices = [s.data.device for s in shards]  # type: ignore[union-attr]
        for s in shards:
            assert s.data is not None
            s.data = _cpu_copy(s.data, non_blocking)

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move the tensors back to where ``copy_tensors_to_cpu`` found them."""
        shards = self._need_tensors("restore_tensor_device")
        if self._orig_devices is None:
            return
        for s, device in zip(shards, self._orig_devices):
            assert s.data is not None
            if s.data.device != device:
                s.data = s.data.to(device, non_blocking=non_blocking)
        self._orig_devices = None

    def sharded_state_dict_for_save(self) -> dict[str, Any]:
        """This rank's part as a sharded state dict that ``save``, ``async_save`` and the
        manager (local tier included) write: the common state and the kept shards, each kept
        tensor shard marked this rank's to write (``fully_parallel`` keeps each on one member)
        where its group holds it as a main replica (where the group is a data-parallel group,
        another group writes the others)."""
        self._need_tensors("sharded_state_dict_for_save")  # not while hollow
        fully_parallel = self.algo != "atomic"  # atomic keeps every replica: the save picks
        mains = getattr(self, "mains", None)  # states pickled before ``mains`` write all

        def marked(s: Any) -> Any:
            if not fully_parallel or not isinstance(s, ShardedTensor):
                return s
            return dataclasses.replace(s, replica_id=0 if mains is None or _in(mains, s) else 1)

        shards = [marked(s) for s in self.shards] + getattr(self, "empty", [])
        common = self.common if isinstance(self.common, Mapping) else {"common": self.common}
        if _KEPT in common:
            raise InvalidArgumentError(f"the common state may not hold the key {_KEPT!r}")
        return {**common, _KEPT: shards}

    # -- restore ---------------------------------------------------------------------------

    def to_state_dict(
        self,
        sharded_state_dict: ShardedStateDict,
        algo: str | None = None,
        exchange_algo: str = "broadcast",
        validate_access_integrity: bool = True,
        parallelization_group: dist.ProcessGroup | None = None,
        strict: StrictMode | str | Any = StrictMode.RAISE_MISSING,
        return_mismatch_keys: bool | None = None,
    ) -> StateDict | tuple[StateDict, set[str], set[str]]:
        """The state dict ``sharded_state_dict`` asks for, like ``load`` does from dcpbridge.storage.

        Each requested ShardedTensor gets the kept tensor of the same key, global offset and
        size:
        this rank's own, or (``fully_parallel``, the default for a state built with it) the
        one another member of ``parallelization_group`` kept, sent by ``exchange_algo``:
        ``"broadcast"`` (one broadcast per shard to the group) or ``"p2p"`` (point-to-point,
        only to the members that need it). Template tensors are filled in place; where a
        template has no data the result holds the kept or received tensor; keys tied in the
        template (one memory) must have been kept alike, else every member raises
        ``TiedTensorsError`` naming both, as ``load`` does (keys sharing only part of one
        memory, or in another dtype or shape, raise ``InvalidRequestError``). ShardedObjects
        come from this rank's kept ones, factories are merged, the common state and the
        template's non-persistent objects are added. ``validate_access_integrity`` checks
        first, on every member, that no shard was kept twice in the group; shape or dtype
        disagreements always raise.

        ``strict`` takes ``load``'s policies with ``load``'s meaning (Megatron's;
        ``dcpbridge.planners.strict``), the kept state standing for the checkpoint: a key is
        requested-not-stored (Megatron's *unexpected*) on a rank that requests a shard of it
        no usable member kept (with ``atomic``, only the rank itself is usable), and
        stored-not-requested (Megatron's *missing*) when a member kept it and no member
        requests it. ShardedObjects are named by their key. Every member raises the same
        error, except that ``atomic`` without validation and with a policy that needs no
        other rank's request runs no collective: a rank then raises alone, as in Megatron.
        ``return_mismatch_keys`` (Megatron's argument) returns ``(state_dict, missing,
        unexpected)`` as Megatron's ``to_state_dict`` does; left None, the ``return_*``
        policies return it, as ``load`` does.
        """
        algo = _check_algo(self.algo if algo is None else algo)
        if exchange_algo not in EXCHANGE_ALGOS:
            raise InvalidArgumentError(
                f"exchange_algo must be one of {EXCHANGE_ALGOS}, got {exchange_algo!r}"
            )
        policy = parse_strict(strict)
        local_only = algo == "atomic"
        group = Group.resolve(parallelization_group)
        nonpersistent, tree = extract(sharded_state_dict, is_nonpersistent)
        sharded: Any = HOLE
        requests: list[Any] = []
        ties = Ties()
        scratch: dict[int, ShardedTensor] = {}  # tied shard -> its copy filled into scratch
        mine: Manifest | BaseException
        try:
            shards = self._need_tensors("to_state_dict")
            sharded, _ = extract(apply_factories(tree), is_sharded)
            asked = leaves(sharded) if sharded is not HOLE else []
            # tied keys' shards are filled into scratch; other memory shared by two requests:
            requests, ties = untie_checked(asked)  # refused, as by load
            scratch = {id(s): u for s, u in zip(asked, requests) if u is not s}
            mine = Manifest(
                kept=tuple(ShardMeta.of(s) for s in shards if s.numel > 0),
                wanted=tuple(
                    ShardMeta.of(s) for s in requests if isinstance(s, ShardedTensor) and s.numel
                ),
                kept_objects=tuple(s.unique_key for s in self.shards if _is_object(s)),
                wanted_objects=tuple(s.unique_key for s in requests if _is_object(s)),
                tied=bool(ties.pairs),
            )
        except Exception as e:  # raised on every member by the exchange below
            mine = e
        alone = local_only and not validate_access_integrity and not policy.needs_stored
        if alone:  # no collective: this rank's failures raise here alone
            if isinstance(mine, BaseException):
                raise mine
            manifests = {group.rank: mine}
        else:
            everyone = protocol.agree(group, "restore exchange", lambda: _mine(mine))
            manifests = dict(enumerate(everyone))
        plan = plan_restore(manifests, local_only=local_only)
        plan.check(validate=validate_access_integrity and not local_only)
        mismatch = _judge(policy, plan, group.rank, KEPT_BY_EACH if local_only else KEPT_BY_GROUP)
        sources = self._sources(group, plan, requests, exchange_algo)
        objects = {s.unique_key: s.data for s in self.shards if _is_object(s)}
        unfilled: set[str] = set()  # keys of shards missing (strict="return_all")

        def value(x: Any) -> Any:
            if isinstance(x, ShardedObject):
                return objects.get(x.unique_key, HOLE)
            if x.numel == 0:
                x.init_data()
                return x.data
            src = sources.get(write_id(x))
            if src is None:
                unfilled.add(x.key)
                return HOLE  # missing, with strict="return_all"
            into = scratch.get(id(x), x)  # a tied key's shard: its scratch, checked below
            if into.data is None:
                into.data = src
            elif into.data is not src:
                with torch.no_grad():  # a template Parameter is filled like a load fills it
                    into.data.copy_(src)
            return x.data

        def fill() -> Any:
            """The requested values, tied keys checked to be kept alike (``TiedTensorsError``)."""
            loaded = map_leaves(sharded, value) if sharded is not HOLE else HOLE
            ties.settle(unfilled)
            return loaded

        if not alone and any(m.tied for m in manifests.values()):  # raised on every member
            done: list[Any] = []
            protocol.agree(group, "restore ties", lambda: done.append(fill()))
            loaded = done[0]
        else:
            loaded = fill()
        result = assemble(self.common, loaded, tree, nonpersistent)
        if return_mismatch_keys or (return_mismatch_keys is None and policy.returns):
            return result, *mismatch
        return result

    def _sources(
        self, group: Group, plan: RestorePlan, requests: list[Any], exchange_algo: str
    ) -> dict[WriteId, torch.Tensor]:
        """Every shard this rank needs: its own kept tensors, and the ones sent to it.

        The buffers the exchange needs are made inside a collective step (the plan is the
        same on every member, so all take it or none): a member that cannot allocate one
        raises ``StagingError`` on every member instead of leaving them in the exchange.
        """
        sources: dict[WriteId, torch.Tensor] = {}
        for s in self._tensor_shards():
            assert s.data is not None
            sources.setdefault(write_id(s), s.data)
        if not plan.transfers:
            return sources
        device = group.tensor_device
        into = {
            write_id(s): s.data
            for s in requests
            if isinstance(s, ShardedTensor) and _receivable(s.data, device)
        }
        sends: list[tuple[torch.Tensor, int, int]] = []
        recvs: list[tuple[torch.Tensor, int, int]] = []
        scratch: list[torch.Tensor] = []

        def allocate() -> None:
            for tag, t in enumerate(plan.transfers):
                shard = t.meta.shard
                if t.src == group.rank:
                    data = _allocated("send buffer", t.meta, device, _sent(sources[shard], device))
                    sends.extend((data, dst, tag) for dst in t.dsts)
                elif group.rank in t.dsts:
                    buf = into.get(shard)
                    if buf is None:
                        buf = _allocated("receive buffer", t.meta, device, _empty(t.meta, device))
                    sources[shard] = buf
                    recvs.append((buf.detach(), t.src, tag))  # a Parameter receives in place
            if exchange_algo == "broadcast":
                scratch.extend(_scratch(group.rank, plan, device))

        protocol.agree(group, "restore buffers", allocate)
        if exchange_algo == "p2p":
            group.exchange(sends, recvs)
        else:
            _broadcast_all(group, plan, sends, recvs, scratch)
        return sources


def _broadcast_all(
    group: Group,
    plan: RestorePlan,
    sends: list[tuple[torch.Tensor, int, int]],
    recvs: list[tuple[torch.Tensor, int, int]],
    scratch: list[torch.Tensor],
) -> None:
    """One broadcast per transfer, from its keeper to the whole group (bystanders use
    ``scratch``, the one buffer ``_scratch`` made)."""
    mine = {tag: t for t, _, tag in sends} | {tag: t for t, _, tag in recvs}
    for tag, t in enumerate(plan.transfers):
        buf = mine.get(tag)
        group.broadcast_tensor(buf if buf is not None else scratch[0][: t.meta.nbytes], src=t.src)


def _scratch(rank: int, plan: RestorePlan, device: torch.device) -> list[torch.Tensor]:
    """The buffer (none or one) the broadcasts that ``rank`` neither sends nor receives land in:
    the size of the largest."""
    spare = [t.meta for t in plan.transfers if t.src != rank and rank not in t.dsts]
    if not spare:
        return []
    largest = max(spare, key=lambda m: m.nbytes)
    return [
        allocated(
            lambda: torch.empty(largest.nbytes, dtype=torch.uint8, device=device),
            "to_state_dict",
            f"the broadcast scratch buffer ({largest.nbytes} bytes, for {largest.key!r} at "
            f"offset {largest.offset}) on {device}",
        )
    ]


def _empty(meta: ShardMeta, device: torch.device) -> Callable[[], torch.Tensor]:
    """A receive buffer for ``meta``, made when called."""
    return lambda: torch.empty(meta.local_shape, dtype=meta.dtype, device=device)


def _sent(src: torch.Tensor, device: torch.device) -> Callable[[], torch.Tensor]:
    """What travels of kept tensor ``src`` (on ``device``, contiguous, its shown values)."""
    return lambda: as_shown(src.detach().to(device)).contiguous()


def _allocated(
    what: str, meta: ShardMeta, device: torch.device, make: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``make()``, or ``StagingError`` naming the shard where it cannot be allocated."""
    return allocated(
        make,
        "to_state_dict",
        f"the {what} of {meta.key!r} (offset {meta.offset}, {meta.local_shape} {meta.dtype}, "
        f"{meta.nbytes} bytes) on {device}",
    )


def _check_algo(algo: str) -> str:
    if algo not in ALGOS:
        raise InvalidArgumentError(f"algo must be one of {ALGOS}, got {algo!r}")
    return algo


def _judge(policy: Policy, plan: RestorePlan, rank: int, where: str) -> tuple[set[str], set[str]]:
    """Raise the plan's key mismatches as ``policy`` says (the same error on every member) or
    log this rank's; Megatron's ``(missing, unexpected)`` for this rank."""
    requested = plan.requested_not_kept()
    stored = plan.kept_not_requested() if policy.needs_stored else set()
    error = decide(policy, requested, stored, where).error
    if error is not None:
        raise error
    mine = requested.get(rank, set())
    warning = decide(policy, {rank: mine}, stored, where).warning
    if warning:
        log.warning("dcpbridge to_state_dict: %s", warning)
    return policy.reported(mine, stored)


def _is_object(x: Any) -> bool:
    return isinstance(x, ShardedObject)


def _held(error: BaseException | None, shards: list[Any]) -> list[Holding]:
    """What this rank holds for the keepers' exchange (or its failure, raised in it)."""
    if error is not None:
        raise error
    return [
        Holding(write_id(s), s.numel * s.dtype.itemsize, is_main_replica(s.replica_id))
        for s in shards
        if isinstance(s, ShardedTensor) and s.numel > 0
    ]


def _mine(manifest: Manifest | BaseException) -> Manifest:
    if isinstance(manifest, BaseException):
        raise manifest
    return manifest


def _keeps(s: Any, keepers: dict[WriteId, int], rank: int) -> bool:
    """Whether this rank keeps ``s`` (objects always; empty tensors never: nothing to keep)."""
    if not isinstance(s, ShardedTensor):
        return True
    return s.numel > 0 and keepers.get(write_id(s)) == rank


def _in(mains: frozenset[Any], s: ShardedTensor) -> bool:
    """Whether ``s`` is one of ``mains`` (a state pickled when shards were named by key and
    offset only holds those)."""
    return write_id(s) in mains or shard_id(s) in mains


def _receivable(t: torch.Tensor | None, device: torch.device) -> bool:
    return t is not None and t.is_contiguous() and t.device == device and holds_its_values(t)


def _cpu_copy(t: torch.Tensor, non_blocking: bool) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=non_blocking)
    return out.copy_(t, non_blocking=non_blocking)
