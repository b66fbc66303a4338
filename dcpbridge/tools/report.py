"""What a checkpoint holds and whether it is whole: ``dcpbridge inspect`` and ``validate``."""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dcpbridge.engine.stats import human_bytes
from dcpbridge.formats.checkpoint import MEGATRON_COMMON, Format
from dcpbridge.formats.sources import ProtocolSource, Source
from dcpbridge.planners import Placed, coverage_problems
from dcpbridge.planners.boxes import fmt_box
from dcpbridge.storage import StorageIndex
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.referenced import sizes_with_references
from dcpbridge.storage.format.references import is_reference
from dcpbridge.storage.read.delivery import verify_stored_items

_CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)


def shown(text: object, keep: str = "") -> str:
    """``text`` (a name or message out of a checkpoint or a listing: untrusted) with its
    control and bidirectional-override characters escaped but those in ``keep``, so that
    printing it cannot move the cursor, recolour or rewrite the terminal, or fake a line."""
    return _CONTROL.sub(
        lambda m: m.group() if m.group() in keep else m.group().encode("unicode_escape").decode(),
        str(text),
    )


@dataclass
class Findings:
    """Problems make a checkpoint invalid; notes are worth knowing but harmless."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verified_bytes: int = 0


def file_sizes(source: Source) -> dict[str, int]:
    """Size of every file directly in the checkpoint (or of the single file)."""
    loc = source.location
    store = storage_for(loc)  # requests bounded by its timeouts, faults as StorageError
    if source.format == Format.TORCH or (
        source.format == Format.SAFETENSORS and loc.root.endswith(".safetensors")
    ):
        return {loc.root.rsplit("/", 1)[-1]: store.file_size(loc.root)}
    index = getattr(getattr(source, "metadata", None), "storage_data", None)
    files = index.files if isinstance(index, StorageIndex) else ()
    return sizes_with_references(store, files)  # spread folders and referenced files included


def _extents(source: Source) -> list[tuple[str, str, int, int]]:
    """(what, file, offset, nbytes) of every stored item whose place is known."""
    out = []
    for key, t in source.tensors.items():
        for c in t.chunks:
            if c.file is not None and c.offset is not None:
                what = f"tensor {key!r} chunk {fmt_box(c.offsets, c.sizes)}"
                out.append((what, c.file, c.offset, c.stored_nbytes or 0))
    for key, o in source.objects.items():
        if o.file is not None and o.offset is not None:
            out.append((f"object {key!r}", o.file, o.offset, o.nbytes or 0))
    return out


def structure(source: Source, sizes: dict[str, int]) -> Findings:
    """Files present and long enough, and every tensor covered exactly once."""
    found = Findings()
    missing: dict[str, list[str]] = {}
    for what, file, offset, nbytes in _extents(source):
        if file not in sizes:
            missing.setdefault(file, []).append(what)
        elif offset + nbytes > sizes[file]:
            found.problems.append(
                f"{what}: bytes {offset}..{offset + nbytes} lie beyond the end of {file} "
                f"({sizes[file]} bytes; truncated?)"
            )
    for file, whats in sorted(missing.items()):
        more = f" and {len(whats) - 3} more" if len(whats) > 3 else ""
        found.problems.append(f"data file {file} is missing; it holds {', '.join(whats[:3])}{more}")
    for key, t in sorted(source.tensors.items()):
        placed = [Placed(c.offsets, c.sizes, -1 if c.rank is None else c.rank) for c in t.chunks]
        found.problems.extend(coverage_problems(key, t.shape, placed))
    if source.format == Format.TORCH_DIST and MEGATRON_COMMON not in sizes:
        found.problems.append(f"{MEGATRON_COMMON} (the common state) is missing")
    if source.format == Format.DCPBRIDGE:
        listed = set(source.header.get("files", []))
        stray = sorted(n for n in sizes if n.endswith(".bin") and n not in listed)
        if stray:
            found.notes.append(
                f"{len(stray)} data file(s) not referenced by the metadata (e.g. {stray[0]}): "
                "left over from an earlier or interrupted save"
            )
    return found


def verify_data(
    source: Source, found: Findings, on_bytes: Callable[[int], None] | None = None
) -> None:
    """Read every stored byte: check block checksums, or (formats without checksums) that
    each item is readable."""
    if source.format == Format.DCPBRIDGE:
        _verify_checksums(source, found, on_bytes)
        return
    found.notes.append(f"a {source.format.description} records no checksums; every item was read")
    for key, t in sorted(source.tensors.items()):
        for c in t.chunks:
            try:
                source.read(key, c.offsets, c.sizes)
                found.verified_bytes += c.nbytes
                if on_bytes is not None:
                    on_bytes(c.nbytes)
            except Exception as e:
                found.problems.append(f"tensor {key!r} chunk {fmt_box(c.offsets, c.sizes)}: {e}")
    for key in sorted(source.objects):
        try:
            n = len(source.object_bytes(key))
        except Exception as e:
            found.problems.append(f"object {key!r}: {e}")
            continue
        found.verified_bytes += n  # not on the progress bar: its total is the tensors' bytes


def _verify_checksums(
    source: Source, found: Findings, on_bytes: Callable[[int], None] | None
) -> None:
    assert isinstance(source, ProtocolSource)
    index = source.metadata.storage_data
    assert isinstance(index, StorageIndex)
    if not index.checksum_algorithm or not index.checksum_block_size:
        found.notes.append("this checkpoint was saved without checksums; nothing to verify")
        return

    def count(n: int) -> None:
        found.verified_bytes += n
        if on_bytes is not None:
            on_bytes(n)

    found.problems += verify_stored_items(source.location, index, on_bytes=count)


def describe(source: Source, sizes: dict[str, int], found: Findings) -> dict[str, Any]:
    """A JSON-able description: format facts, files, tensors with their chunks, objects."""
    facts = dict(source.header)
    created = facts.get("created_unix")
    tensors = {}
    for key in sorted(source.tensors):
        t = source.tensors[key]
        tensors[key] = {
            "shape": list(t.shape),
            "dtype": str(t.dtype).removeprefix("torch."),
            "bytes": t.nbytes,
            "chunks": [
                {
                    "offsets": list(c.offsets),
                    "sizes": list(c.sizes),
                    "rank": c.rank,
                    "file": c.file,
                    "offset": c.offset,
                    "bytes": c.nbytes,
                }
                for c in t.chunks
            ],
        }
    objects = {
        k: {"rank": o.rank, "file": o.file, "offset": o.offset, "bytes": o.nbytes}
        for k, o in sorted(source.objects.items())
    }
    written, reused = _written_and_reused(tensors, objects)
    return {
        "url": source.location.url,
        "format": source.format.value,
        "format_version": facts.get("format_version"),
        "complete": not found.problems,
        "problems": found.problems,
        "notes": found.notes,
        "save_id": facts.get("save_id"),
        "world_size": facts.get("world_size"),
        "created": (
            datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat()
            if created
            else None
        ),
        "checksum": (
            {"algorithm": facts["checksum"], "block_size": facts["checksum_block_size"]}
            if facts.get("checksum")
            else None
        ),
        "megatron_config": facts.get("megatron_config"),
        "files": [{"name": n, "bytes": b} for n, b in sorted(sizes.items())],
        "total_bytes": sum(sizes.values()),
        "tensor_bytes": sum(t.nbytes for t in source.tensors.values()),
        "bytes_written": written,  # stored in this checkpoint's own files
        "bytes_reused": reused,  # referenced in earlier checkpoints' files (incremental)
        "tensors": tensors,
        "objects": objects,
    }


def _written_and_reused(tensors: dict[str, Any], objects: dict[str, Any]) -> tuple[int, int]:
    """(bytes in the checkpoint's own files, bytes referenced in an earlier one's)."""
    items = [c for t in tensors.values() for c in t["chunks"]] + list(objects.values())
    stored = [(c["file"], c["bytes"] or 0) for c in items if c["file"] is not None]
    reused = sum(n for f, n in stored if is_reference(f))
    return sum(n for _, n in stored) - reused, reused


def _ranks(chunks: list[dict[str, Any]]) -> str:
    ranks = sorted({c["rank"] for c in chunks if c["rank"] is not None})
    return ",".join(map(str, ranks)) if ranks else "-"


def format_text(doc: dict[str, Any], *, max_chunks: int = 8) -> str:
    """The description as aligned, human-readable text."""
    status = "complete" if doc["complete"] else "INCOMPLETE"
    version = f" version {doc['format_version']}" if doc["format_version"] is not None else ""
    lines = [
        shown(doc["url"]),
        f"  format      {doc['format']}{version}, {status}",
    ]
    if doc["save_id"]:
        lines.append(
            f"  save id     {doc['save_id']}, written by {doc['world_size']} rank(s), {doc['created']}"
        )
    if doc["checksum"]:
        c = doc["checksum"]
        lines.append(f"  checksums   {c['algorithm']} per {human_bytes(c['block_size'])} block")
    lines.append(
        f"  size        {human_bytes(doc['total_bytes'])} in {len(doc['files'])} file(s); "
        f"{len(doc['tensors'])} tensors ({human_bytes(doc['tensor_bytes'])}), "
        f"{len(doc['objects'])} objects"
    )
    if doc.get("bytes_reused"):
        lines.append(
            f"  incremental {human_bytes(doc['bytes_written'])} written, "
            f"{human_bytes(doc['bytes_reused'])} reused from earlier checkpoint(s)"
        )
    keys = {k: shown(k) for k in doc["tensors"]}
    width = max([len(k) for k in keys.values()] + [3])
    rw = max([len(_ranks(t["chunks"])) for t in doc["tensors"].values()] + [5])
    lines.append("")
    lines.append(
        f"  {'key':<{width}}  {'dtype':<9} {'shape':<18} {'chunks':>6}  {'ranks':<{rw}}  size"
    )
    for key, t in doc["tensors"].items():
        shape = "x".join(map(str, t["shape"])) or "()"
        lines.append(
            f"  {keys[key]:<{width}}  {t['dtype']:<9} {shape:<18} {len(t['chunks']):>6}  "
            f"{_ranks(t['chunks']):<{rw}}  {human_bytes(t['bytes'])}"
        )
        for c in t["chunks"][:max_chunks]:
            where = f"{shown(c['file'])}@{c['offset']}" if c["file"] else "-"
            rank = "?" if c["rank"] is None else c["rank"]
            lines.append(
                f"  {'':<{width}}    rank {rank}: {fmt_box(c['offsets'], c['sizes'])} {where}"
            )
        if len(t["chunks"]) > max_chunks:
            lines.append(f"  {'':<{width}}    ... {len(t['chunks']) - max_chunks} more chunks")
    if doc["objects"]:
        lines.append("")
        lines.append("  objects")
        for key, o in doc["objects"].items():
            size = human_bytes(o["bytes"]) if o["bytes"] is not None else "?"
            rank = f"rank {o['rank']}, " if o["rank"] is not None else ""
            lines.append(f"    {shown(key)}  ({rank}{size}, {shown(o['file'] or '-')})")
    lines.append("")
    lines.append("  files")
    for f in doc["files"]:
        lines.append(f"    {shown(f['name']):<40} {human_bytes(f['bytes']):>10}")
    for title, items in (("problems", doc["problems"]), ("notes", doc["notes"])):
        if items:
            lines.append("")
            lines.append(f"  {title}")
            lines.extend(f"    - {shown(p)}" for p in items)
    return "\n".join(lines)


def summary_line(source: Source, found: Findings) -> str:
    chunks = sum(len(t.chunks) for t in source.tensors.values())
    nbytes = sum(t.nbytes for t in source.tensors.values())
    what = (
        f"{source.format.value}, {len(source.tensors)} tensors in {chunks} chunks "
        f"({human_bytes(nbytes)}), {len(source.objects)} objects"
    )
    if found.verified_bytes:
        what += f"; {human_bytes(found.verified_bytes)} read and verified"
    return what


def count_bytes(source: Source) -> int:
    return sum(c.nbytes for t in source.tensors.values() for c in t.chunks)
