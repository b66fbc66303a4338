"""The local tier's decisions, as pure functions over plain data (no process group, no I/O).

Nodes are the failure domain: ranks ``n * ranks_per_node ...`` form node ``n``. These functions
decide where copies of each rank's files go, whether the nodes have room for a local step, which
committed step the surviving nodes can still recover, and which rank serves each byte range a
restoring rank needs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from dcpbridge.errors import CorruptCheckpointError, InvalidArgumentError
from dcpbridge.storage.format.document import DATA_FILE_RE

__all__ = [
    "Extent",
    "LocalStep",
    "Nodes",
    "Recoverable",
    "ReportedSizes",
    "choose_sources",
    "copy_targets",
    "lacking_space",
    "merge_extents",
    "newest_recoverable",
    "node_needs",
    "second_try_avoid",
    "transfers",
    "writer_rank",
]


@dataclass(frozen=True, slots=True)
class Nodes:
    """``world_size`` ranks cut into nodes of ``ranks_per_node`` consecutive ranks (the last
    node may be smaller)."""

    world_size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        for name in ("world_size", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")

    @property
    def count(self) -> int:
        """How many nodes."""
        return -(-self.world_size // self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        """The node of ``rank``."""
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> range:
        """The ranks of ``node``."""
        start = node * self.ranks_per_node
        return range(start, min(start + self.ranks_per_node, self.world_size))

    def lead(self, node: int) -> int:
        """The rank that writes ``node``'s shared files (document, commit marker, removals)."""
        return node * self.ranks_per_node


def copy_targets(rank: int, nodes: Nodes, replicas: int) -> list[int]:
    """The ranks that keep copies of ``rank``'s files: one on each of the next ``replicas``
    nodes (fewer when the world has fewer other nodes), at ``rank``'s place in that node."""
    home = nodes.node_of(rank)
    place = rank - nodes.lead(home)
    out = []
    for k in range(1, min(replicas, nodes.count - 1) + 1):
        members = nodes.ranks_of((home + k) % nodes.count)
        out.append(members[place % len(members)])
    return out


def node_needs(shares: Sequence[int], nodes: Nodes, replicas: int) -> list[int]:
    """Bytes each node's directory takes for one local step: its ranks' shares plus the
    copies of other ranks' shares placed on it (``shares[r]``: what rank r writes)."""
    need = [0] * nodes.count
    for rank, share in enumerate(shares):
        need[nodes.node_of(rank)] += share
        for target in copy_targets(rank, nodes, replicas):
            need[nodes.node_of(target)] += share
    return need


def lacking_space(
    shares: Sequence[int], free: Sequence[int | None], nodes: Nodes, replicas: int
) -> dict[int, tuple[int, int]]:
    """Nodes without room for a local step: ``{node: (free, needed)}``; ``free[r]`` is what
    rank r sees free in its node's directory (None: unknown, taken as enough)."""
    need = node_needs(shares, nodes, replicas)
    out = {}
    for rank, room in enumerate(free):
        node = nodes.node_of(rank)
        if room is not None and room < need[node] and node not in out:
            out[node] = (room, need[node])
    return out


@dataclass(frozen=True, slots=True)
class LocalStep:
    """A committed local step as one node holds it: the step's identity (step, save id and
    the digest of its document), how many data files its document names, and those of the
    step's files (its data files and document) present in the node's directory, with their
    sizes. A count, not the names: every rank reports this, so at 16,384 ranks a list of
    every data file would make the exchange quadratic."""

    step: int
    save_id: str
    digest: str
    nfiles: int
    held: Mapping[str, int] = field(default_factory=dict)


class ReportedSizes(Mapping[tuple[str, int], int]):
    """``(file, rank) -> size`` as ``rank`` reported it, read from the reports themselves
    (every rank agrees over every report: one dict entry per file and rank would double it)."""

    __slots__ = ("_held",)

    def __init__(self, held: Mapping[int, Mapping[str, int]]) -> None:
        self._held = held

    def __getitem__(self, key: tuple[str, int]) -> int:
        name, rank = key
        return self._held[rank][name]

    def __iter__(self) -> Iterator[tuple[str, int]]:
        for rank, held in self._held.items():
            for name in held:
                yield name, rank

    def __len__(self) -> int:
        return sum(len(held) for held in self._held.values())


@dataclass(frozen=True, slots=True)
class Recoverable:
    """A local step every part of which some rank can serve: per file, the ranks whose
    node holds it (ascending) and the size each reports."""

    step: int
    save_id: str
    digest: str
    holders: dict[str, list[int]]
    sizes: Mapping[tuple[str, int], int]

    def holds(self, rank: int, name: str) -> bool:
        """Whether ``rank``'s own node directory holds ``name``."""
        return rank in self.holders.get(name, ())


def newest_recoverable(
    reports: Sequence[Iterable[LocalStep]],
    document: str,
    after: int | None = None,
    step: int | None = None,
) -> Recoverable | None:
    """The newest local step (at least ``after``; exactly ``step`` if given) whose document
    (file name ``document``) and every data file some rank's node holds; ``reports[r]``: the
    steps rank r's node holds (held names: the document's files only). Steps are told apart
    by save id and document digest, so two saves of one step never mix."""
    found: dict[tuple[int, str, str], tuple[int, defaultdict[str, list[int]]]] = {}
    held_by: dict[tuple[int, str, str], dict[int, Mapping[str, int]]] = {}
    for rank, steps in enumerate(reports):
        for s in steps:
            if step is not None and s.step != step:
                continue
            key = (s.step, s.save_id, s.digest)
            if key not in found:
                found[key] = (s.nfiles, defaultdict(list))
            nfiles, holders = found[key]
            if s.nfiles != nfiles:  # one digest, one document: a report that disagrees is void
                continue
            for name in s.held:
                holders[name].append(rank)
            held_by.setdefault(key, {})[rank] = s.held
    for key in sorted(found, reverse=True):
        step, save_id, digest = key
        if after is not None and step < after:
            break
        nfiles, holders = found[key]
        if document in holders and len(holders) - 1 == nfiles:
            sizes = ReportedSizes(held_by.get(key, {}))
            return Recoverable(step, save_id, digest, dict(holders), sizes)
    return None


def choose_sources(
    needed: Iterable[str],
    rank: int,
    chosen: Recoverable,
    *,
    avoid: Mapping[str, Collection[int]] | None = None,
) -> dict[str, int]:
    """Who serves each file ``rank`` needs: ``rank`` itself where its node holds the file,
    else one of the holders, spread over them by the file's place and ``rank``. Holders in
    ``avoid[name]`` (on a second try, the node that served the file to a rank whose first
    try failed: ``second_try_avoid``) serve it only where nobody else holds it."""
    avoid = avoid or {}
    out = {}
    for i, name in enumerate(sorted(set(needed))):
        holders = chosen.holders.get(name)
        if not holders:
            raise InvalidArgumentError(f"no rank holds {name} of local step {chosen.step}")
        shunned = avoid.get(name, ())
        others = [h for h in holders if h not in shunned]
        if not others or (rank in others):
            out[name] = rank if rank in holders else holders[(i + rank) % len(holders)]
        else:
            out[name] = others[(i + rank) % len(others)]
    return out


def second_try_avoid(first: Mapping[str, int], nodes: Nodes) -> dict[str, range]:
    """For a rank whose first read of a local step failed (a part failed verification, or
    lay outside its file): the node whose directory served each file then, to be avoided
    (each of its ranks reads the same copy); its other files come from another copy too."""
    return {name: nodes.ranks_of(nodes.node_of(src)) for name, src in first.items()}


@dataclass(frozen=True, slots=True, order=True)
class Extent:
    """Bytes ``[offset, offset + nbytes)`` of file ``name``."""

    name: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def merge_extents(extents: Iterable[Extent], gap: int = 4096) -> list[Extent]:
    """Sorted extents, overlapping ones and those less than ``gap`` bytes apart joined."""
    out: list[Extent] = []
    for e in sorted(set(extents)):
        last = out[-1] if out else None
        if last is not None and last.name == e.name and e.offset <= last.end + gap:
            end = max(last.end, e.end)
            out[-1] = Extent(last.name, last.offset, end - last.offset)
        else:
            out.append(e)
    return out


def transfers(requests: Sequence[Mapping[int, Sequence[Extent]]]) -> dict[int, dict[int, list]]:
    """``requests[dst]`` (source rank -> extents ``dst`` wants from it) turned around:
    ``{src: {dst: extents}}``, the extents in request order."""
    out: dict[int, dict[int, list]] = {}
    for dst, wanted in enumerate(requests):
        for src, extents in sorted(wanted.items()):
            if src != dst and extents:
                out.setdefault(src, {})[dst] = list(extents)
    return out


def writer_rank(name: str) -> int:
    """The rank that wrote data file ``name``."""
    m = DATA_FILE_RE.match(name)
    if m is None:
        raise CorruptCheckpointError(f"{name!r} is not a data file name")
    return int(m.group(1))
