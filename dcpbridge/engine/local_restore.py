"""Restoring a local step in any layout: plan with the load planner, fetch missing bytes from
peers, then load through the normal reader (checksums verified) from this node's directory
and the received byte ranges.

Every exchange is a ``protocol`` step on the local tier's gloo group, so a failure on any rank
(a missing file, a short read, a bad document) is raised on every rank and nobody waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from dcpbridge.engine import protocol
from dcpbridge.engine.bridge import BridgeLoadPlanner
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.gc_pause import gc_paused
from dcpbridge.engine.local_plan import (
    Extent,
    LocalStep,
    Recoverable,
    choose_sources,
    merge_extents,
    second_try_avoid,
    transfers,
)
from dcpbridge.engine.local_tier import LocalTier, document_digest
from dcpbridge.engine.strict import Policy
from dcpbridge.errors import CorruptCheckpointError
from dcpbridge.formats.checkpoint import Checkpoint, Format
from dcpbridge.model.intake import for_load
from dcpbridge.model.per_rank import PerRankState, check_per_rank, count_requests
from dcpbridge.model.stateful import state_dicts
from dcpbridge.storage import METADATA_FILE, FsspecCheckpointReader, Location, StorageIndex
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.costs import ReadCosts
from dcpbridge.storage.backends.store import RangeRead, Read, Storage, parts_of
from dcpbridge.storage.format.document import StoredItem, decode_metadata
from dcpbridge.storage.read.read_plan import ReadTuning, chunk_grid, plan_box_read

log = logging.getLogger("dcpbridge")

Received = dict[str, list[tuple[int, memoryview]]]  # file -> (offset, bytes) ranges


class PeerStorage(Storage):
    """This node's step directory for the files it holds, received ranges for the others;
    every file's size as the survey found it (``sizes``: no listing again)."""

    def __init__(self, local: Storage, own: set[str], received: Received, sizes: dict[str, int]):
        super().__init__(local.location)
        self._local, self._own, self._received, self._sizes = local, own, received, sizes

    def read_costs(self) -> ReadCosts:
        """This node's directory's: the reader joins ranges as ``plan_load`` planned."""
        return self._local.read_costs()

    def file_sizes(self) -> dict[str, int]:
        return dict(self._sizes)

    def fetch(self, reads: Sequence[Read], threads: int) -> None:
        own: dict[str, bool] = {}  # by path: a restore's reads name few files, many times
        mine, others = [], []
        for r in reads:
            here = own.get(r.path)
            if here is None:
                here = own[r.path] = _name(r.path) in self._own
            (mine if here else others).append(r)
        if mine:
            self._local.fetch(mine, threads)
        for r in others:
            self._serve(r)

    def _serve(self, r: Read) -> None:
        name, pos = _name(r.path), r.start
        for part in parts_of(r):
            if isinstance(part, int):
                pos += part
                continue
            part[:] = self._bytes(name, pos, len(part))
            pos += len(part)
        if r.on_done is not None:
            r.on_done()

    def _bytes(self, name: str, start: int, n: int) -> memoryview:
        for offset, data in self._received.get(name, ()):
            if offset <= start and start + n <= offset + len(data):
                return data[start - offset : start - offset + n]
        raise CorruptCheckpointError(
            f"{self.location.url}: bytes {start}..{start + n} of {name} were neither in this "
            "node's directory nor received from a peer"
        )


def _name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


class PeerReader(FsspecCheckpointReader):
    """The normal reader over a ``PeerStorage``, with the already decoded document."""

    def __init__(self, location: Location, store: Storage, metadata: Metadata, **kwargs: Any):
        super().__init__(location, **kwargs)  # type: ignore[arg-type]
        self._io, self._metadata = store, metadata


@dataclass
class PeerCheckpoint(Checkpoint):
    """A local step opened for one rank: its document and its ``PeerStorage``."""

    metadata: Metadata | None = None

    def reader(self, *, thread_count: int = 4, verify_checksums: bool = True) -> StorageReader:
        assert self.metadata is not None
        return PeerReader(
            self.location,
            self.files,
            self.metadata,
            thread_count=thread_count,
            verify_checksums=True,
        )


def fetch(
    group: Group, location: Location, wanted: Callable[[], dict[int, list[Extent]]], what: str
) -> Received:
    """Receive the extents ``wanted()`` names (source rank -> extents) from their sources, and
    serve what the other ranks want of this rank's node directory (collective)."""
    requests = protocol.agree(group, f"{what}: requests", wanted)
    plan = transfers(requests)
    if not plan:  # every rank reads its own node's files only (all ranks see the same plan)
        return {}
    store = storage_for(location)
    failure: list[BaseException] = []
    sends = []
    for dst, extents in sorted(plan.get(group.rank, {}).items()):
        buf = torch.empty(sum(e.nbytes for e in extents), dtype=torch.uint8)  # read over
        view, pos = memoryview(buf.numpy()), 0
        reads = []
        for e in extents:
            reads.append(
                RangeRead(
                    location.data_path(e.name)
                    if e.name != METADATA_FILE
                    else location.path(e.name),
                    e.offset,
                    view[pos : pos + e.nbytes],
                )
            )
            pos += e.nbytes
        try:
            store.fetch(reads, threads=2)
        except Exception as err:  # still sent (zeros), so no peer waits; raised below on all
            failure.append(err)
            buf.zero_()
        sends.append((buf, dst, 0))
    recvs, mine = [], requests[group.rank]
    bufs: dict[int, torch.Tensor] = {}
    for src, extents in sorted(mine.items()):
        if src != group.rank and extents:
            bufs[src] = torch.empty(sum(e.nbytes for e in extents), dtype=torch.uint8)
            recvs.append((bufs[src], src, 0))
    group.exchange([s for s in sends if s[0].numel()], [r for r in recvs if r[0].numel()])

    def served() -> None:
        if failure:
            raise failure[0]

    protocol.agree(group, f"{what}: served", served)
    out: Received = {}
    for src, buf in bufs.items():
        view, pos = memoryview(buf.numpy()), 0
        for e in mine[src]:
            out.setdefault(e.name, []).append((e.offset, view[pos : pos + e.nbytes]))
            pos += e.nbytes
    return out


def _by_source(
    extents: list[Extent], sources: dict[str, int], rank: int
) -> dict[int, list[Extent]]:
    out: dict[int, list[Extent]] = {}
    for e in merge_extents(extents):
        if sources[e.name] != rank:
            out.setdefault(sources[e.name], []).append(e)
    return out


def planned_extents(
    planner: BridgeLoadPlanner, plan: LoadPlan, metadata: Metadata, location: Location
) -> list[Extent]:
    """The byte ranges a made load plan (its read items and whole-chunk columns) reads."""
    index = metadata.storage_data
    assert isinstance(index, StorageIndex)
    tuning = ReadTuning.for_storage(storage_for(location))  # PeerStorage states the same costs
    out = []
    for item in plan.items:
        stored = index.get(item.storage_index)
        if stored is not None:
            out.extend(_item_extents(item, stored, index, tuning))
    whole = planner.whole_reads
    if whole:
        for stored in FsspecCheckpointReader._lookup(whole.keys, index):
            if stored is not None:
                out.append(Extent(stored.file, stored.offset, stored.nbytes))
    return out


def _item_extents(
    item: ReadItem, stored: StoredItem, index: StorageIndex, tuning: ReadTuning
) -> list[Extent]:
    """The file ranges the reader fetches for ``item`` (``read_plan.plan_chunk_read``, as
    the reader plans it; the whole stored item for objects and whole chunks)."""
    whole = [Extent(stored.file, stored.offset, stored.nbytes)]
    if item.type == LoadItemType.BYTE_IO or stored.sizes is None or stored.dtype is None:
        return whole
    if tuple(item.lengths) == tuple(stored.sizes) and not any(item.storage_offsets):
        return whole
    block = index.checksum_block_size if stored.checksums else 0
    itemsize = stored.dtype.itemsize
    grid = chunk_grid(stored.sizes, itemsize, block, tiled=index.tiled_checksums)
    chunk = plan_box_read(stored.sizes, itemsize, item.storage_offsets, item.lengths, grid, tuning)
    return [Extent(stored.file, stored.offset + p.start, p.stop - p.start) for p in chunk.pieces]


@dataclass
class OpenedStep:
    """A local step opened for one rank; with ``planner``, its load already planned (and the
    plan checked on every rank): ``load_planned`` reads it without a planning step."""

    checkpoint: PeerCheckpoint
    planner: BridgeLoadPlanner | None = None
    plan: LoadPlan | None = None
    reader: PeerReader | None = None


@dataclass
class PlannedLoad:
    """A rank's load of one local step planned by the load planner: the byte ranges it reads."""

    planner: BridgeLoadPlanner
    plan: LoadPlan
    extents: list[Extent]


def plan_load(
    template: Any,
    metadata: Metadata,
    group: Group,
    location: Location,
    *,
    strict: Policy,
    allow_pickle: bool,
    allow_dtype_cast: bool,
    reshard_data_state: str = "raise",
) -> PlannedLoad:
    """The load's own planning of ``template`` against a local step's document (a dry run)."""
    parts = for_load(state_dicts(_dry_template(template, metadata, reshard_data_state)))
    planner = BridgeLoadPlanner(
        parts,
        parts.shards,
        legacy_common=False,
        allow_dtype_cast=allow_dtype_cast,
        strict=strict,
        allow_pickle=allow_pickle,
    )
    planner.set_up_planner(None, metadata, group.is_coordinator)
    planner.collect_whole_reads = True
    plan = planner.create_local_plan()
    return PlannedLoad(planner, plan, planned_extents(planner, plan, metadata, location))


def _dry_template(template: Any, metadata: Metadata, mode: str) -> Any:
    """``template`` as the load will read it: per-rank states that start fresh on a layout
    change (``reshard_data_state="drop"``) left out, the sample counts it then reads for its
    warning requested instead (raises as the load does where a state cannot follow)."""
    if not _per_rank(template):
        return template
    states = {k: v for k, v in template.items() if isinstance(v, PerRankState)}
    dropped = check_per_rank(states, metadata.state_dict_metadata, mode)
    gone = {d.path for d in dropped}
    out = {k: v for k, v in template.items() if k not in gone}
    for i, d in enumerate(dropped):
        for r, request in count_requests(d).items():
            out[f"__dcpb_samples_{i}_{r}"] = request
    return out


def planning_ahead(
    tier: LocalTier,
    template: Any,
    *,
    strict: Policy,
    allow_pickle: bool,
    allow_dtype_cast: bool,
) -> Callable[[LocalStep, Metadata], tuple[PlannedLoad, bool]] | None:
    """``LocalTier.survey``'s ``ahead`` for a load of ``template``: its plan of a held step
    and whether every byte it reads is in this node's directory (None where the load is
    planned otherwise: per-rank states, a policy that needs what is stored)."""
    if strict.needs_stored or _per_rank(template):
        return None

    @gc_paused
    def ahead(held: LocalStep, metadata: Metadata) -> tuple[PlannedLoad, bool]:
        location = tier._location(held.step)
        planned = plan_load(
            template,
            metadata,
            tier.group,
            location,
            strict=strict,
            allow_pickle=allow_pickle,
            allow_dtype_cast=allow_dtype_cast,
        )
        return planned, all(e.name in held.held for e in planned.extents)

    return ahead


def open_local_step(
    tier: LocalTier,
    chosen: Recoverable,
    template: Any,
    *,
    strict: Policy,
    allow_pickle: bool,
    allow_dtype_cast: bool,
    retry: bool = False,
    failed: bool = True,
    thread_count: int = 4,
    reshard_data_state: str = "raise",
) -> OpenedStep:
    """This rank's view of local step ``chosen``: its document (fetched if the node lacks
    it, decoded once: the survey's where it holds it) and every byte range its load will
    read, local or received (collective: one all-gather where every rank's node holds the
    document and every byte it reads; transfers only where some rank needs them). Where the
    survey found that every rank reads the step from its own node's directory (the plan made
    during the survey), no exchange at all: a failure is then raised on every rank by the
    read's. ``retry``: a second try after the first failed on some rank; where it failed on
    this one (``failed``), each file comes from another node's copy than the first time, where
    there is one (the ranks whose first try succeeded read what they read then)."""
    group = tier.group
    location = tier._location(chosen.step)
    rank = group.rank
    key = (chosen.step, chosen.save_id, chosen.digest)
    ahead = tier.take_ahead(key) if not retry else None
    if ahead is not None and tier.read_locally == key:  # alike on every rank
        metadata = tier.documents[(chosen.step, chosen.digest)]
        needed = choose_sources({e.name for e in ahead.extents}, rank, chosen)
        log.debug("dcpbridge: local step %d: every rank reads its own node's files", chosen.step)
        return _opened(chosen, location, metadata, ahead, needed, {}, group, thread_count, False)
    got: Received = {}
    if len(chosen.holders.get(METADATA_FILE, ())) < group.size:  # some node lacks it

        def want_document() -> dict[int, list[Extent]]:
            if chosen.holds(rank, METADATA_FILE):
                return {}
            src = choose_sources([METADATA_FILE], rank, chosen)[METADATA_FILE]
            return {src: [Extent(METADATA_FILE, 0, chosen.sizes[(METADATA_FILE, src)])]}

        got = fetch(group, location, want_document, f"local step {chosen.step}: document")
    opened: list[OpenedStep] = []
    received: Received = {}
    planned = not strict.needs_stored and not _per_rank(template)

    def want_data() -> dict[int, list[Extent]]:
        metadata = _document(tier, chosen, location, got)
        # the load's own planning, here: its failure raised on every rank (where the load
        # plans again, per rank or with what is stored, only its byte ranges are kept)
        made = ahead or plan_load(
            template,
            metadata,
            group,
            location,
            strict=strict,
            allow_pickle=allow_pickle,
            allow_dtype_cast=allow_dtype_cast,
            reshard_data_state=reshard_data_state,
        )
        names = {e.name for e in made.extents}
        sources = choose_sources(names, rank, chosen)  # the first try's (deterministic)
        if retry and failed:
            avoid = second_try_avoid(sources, tier.nodes)
            sources = choose_sources(names, rank, chosen, avoid=avoid)
        kept = made if planned else None
        opened.append(
            _opened(chosen, location, metadata, kept, sources, received, group, thread_count, True)
        )
        return _by_source(made.extents, sources, rank)

    received.update(fetch(group, location, want_data, f"local step {chosen.step}: data"))
    log.info(
        "dcpbridge: local step %d: rank %d received %d bytes from peers",
        chosen.step,
        rank,
        sum(len(data) for ranges in received.values() for _, data in ranges),
    )
    return opened[0]


def _opened(
    chosen: Recoverable,
    location: Location,
    metadata: Metadata,
    made: PlannedLoad | None,
    sources: dict[str, int],
    received: Received,
    group: Group,
    thread_count: int,
    check: bool,
) -> OpenedStep:
    """The step opened over this node's files (those ``sources`` names this rank for) and
    ``received`` ranges; with ``made``, its reader set up (``check``: every item's range
    checked now; else the reads check theirs)."""
    index = metadata.storage_data
    assert isinstance(index, StorageIndex)
    own = {n for n in index.files if sources.get(n) == group.rank}
    sizes = {  # every file's as its source reported it; a file this rank does not read: its
        # largest copy's (the document's ranges are checked for every file, and one damaged
        # copy this rank never reads must not fail its load)
        name: chosen.sizes[(name, src)]
        if (src := sources.get(name)) is not None
        else max(chosen.sizes[(name, h)] for h in chosen.holders[name])
        for name in index.files
    }
    store = PeerStorage(storage_for(location), own, received, sizes)
    checkpoint = PeerCheckpoint(location, Format.DCPBRIDGE, store, metadata=metadata)
    if made is None:
        return OpenedStep(checkpoint)
    reader = checkpoint.reader(thread_count=thread_count)
    assert isinstance(reader, PeerReader)
    reader.set_up_storage_reader(metadata, group.is_coordinator)
    if check:
        reader.check_ranges()  # before any buffer is sized by the document
    return OpenedStep(checkpoint, made.planner, made.plan, reader)


def _document(tier: LocalTier, chosen: Recoverable, location: Location, got: Received) -> Metadata:
    """Local step ``chosen``'s decoded document: the survey's, where this node holds it, else
    the bytes read or received, checked against the agreed digest and decoded."""
    if chosen.holds(tier.group.rank, METADATA_FILE):
        known = tier.documents.get((chosen.step, chosen.digest))
        if known is not None:
            return known
        raw = storage_for(location).read_file(location.path(METADATA_FILE))
    else:
        raw = bytes(got[METADATA_FILE][0][1])
    if document_digest(raw) != chosen.digest:
        raise CorruptCheckpointError(
            f"{location.url}: the document of local step {chosen.step} changed"
        )
    return decode_metadata(raw, where=location.path(METADATA_FILE))


def _per_rank(template: Any) -> bool:
    """Whether ``template`` has per-rank states (their layout is read before planning)."""
    return isinstance(template, dict) and any(
        isinstance(v, PerRankState) for v in template.values()
    )


__all__ = [
    "OpenedStep",
    "PeerCheckpoint",
    "PeerReader",
    "PeerStorage",
    "PlannedLoad",
    "fetch",
    "open_local_step",
    "plan_load",
    "planned_extents",
    "planning_ahead",
]
