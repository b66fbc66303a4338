"""Export any checkpoint to single-file formats, streaming (one slab in memory at a time).

- Hugging Face style safetensors: one ``model.safetensors`` (no index) when everything fits in
  ``max_shard_bytes``, else ``model-0000i-of-0000n.safetensors`` shards (a larger tensor gets a
  shard of its own) and ``model.safetensors.index.json``, written last. Tensors only. Tied
  weights (one storage under several names, as in a ``torch.save`` of a model whose head
  shares the input embedding) are written once, under the first name in the file's order (the
  one ``transformers`` keeps and re-ties from on load); each dropped name is recorded in the
  shard's ``__metadata__`` as ``{dropped: kept}``, as ``safetensors.torch.save_model`` does.
  Each file is written under a temp name (``<name>.partial``) and renamed into place only
  once every file is durable, so an earlier export in the folder stays whole while one is
  written; a failed export removes the files it wrote.
- One ``torch.save`` file: ``{key: tensor}`` plus the objects by key and the common state's
  top-level entries. The file is laid out by ``torch.save`` without data
  (``torch.serialization.skip_data``), then each tensor's bytes are written in place, and the
  zip records' CRC-32 values are set so that zip tools accept the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import shutil
import struct
import tempfile
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dcpbridge.engine import protocol
from dcpbridge.engine.collectives import Group
from dcpbridge.errors import CheckpointError, InvalidArgumentError, PickleRefusedError
from dcpbridge.formats.checkpoint import SAFETENSORS_INDEX, Format
from dcpbridge.formats.safetensors_chunks import SAFETENSORS_DTYPES
from dcpbridge.formats.sources import (
    ChunkInfo,
    Source,
    TensorInfo,
    _check_dense,
    _TorchFileSource,
)
from dcpbridge.model.mapping import COMMON_KEY
from dcpbridge.planners.errors import SerializationError
from dcpbridge.planners.walk import iter_leaves
from dcpbridge.storage import Location, resolve
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.errors import storage_error, storage_faults
from dcpbridge.storage.write.coalesce import CoalescingFile
from dcpbridge.storage.write.items import tensor_bytes
from dcpbridge.tools.reshard import (
    DEFAULT_SLAB_BYTES,
    WorkItem,
    assign,
    box_bytes,
    counted,
    new_folders,
    remove_new_folders,
)

log = logging.getLogger(__name__)
SAFETENSORS_SINGLE = "model.safetensors"
PARTIAL = ".partial"  # a file's name until the coordinator publishes the export
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class ExportResult:
    destination: str
    files: list[str]
    tensors: int
    bytes_written: int
    skipped: list[str]
    aliases: dict[str, str] = field(default_factory=dict)


def common_tensors(source: Source) -> dict[str, torch.Tensor]:
    """The tensors a source keeps inside its common-state object (a torch_dist checkpoint's
    ``common.pt``), by dotted path: tensors too, which a safetensors export must not skip.
    A common state that safe loading refuses is skipped with a warning (it is not read)."""
    if COMMON_KEY not in source.objects or isinstance(source, _TorchFileSource):
        return {}  # a torch.save file's tensors are source tensors already
    try:
        common = source.common_state()
    except PickleRefusedError as e:
        log.warning("%s: common state not read, its tensors are not exported: %s", COMMON_KEY, e)
        return {}
    held: dict[str, torch.Tensor] = {}
    for leaf in iter_leaves(common):
        if isinstance(leaf.value, torch.Tensor):
            if leaf.path in source.tensors or leaf.path in held:
                raise CheckpointError(f"{leaf.path!r} is both a tensor and a common-state entry")
            _check_dense(source.location.url, leaf.path, leaf.value)
            held[leaf.path] = leaf.value.resolve_conj().resolve_neg()
    return held


def _whole(source: Source, key: str, slab_bytes: int):
    info = source.tensors[key]
    return box_bytes(source, key, (0,) * len(info.shape), info.shape, slab_bytes)


def _info(key: str, t: torch.Tensor) -> TensorInfo:
    """A whole in-memory tensor as a source's one-chunk tensor."""
    shape = tuple(t.shape)
    return TensorInfo(key, shape, t.dtype, (ChunkInfo((0,) * t.dim(), shape, t.nbytes),))


def plan_shards(tensors: list[TensorInfo], max_shard_bytes: int) -> list[list[TensorInfo]]:
    """Consecutive tensors grouped into shards of at most ``max_shard_bytes`` each."""
    shards: list[list[TensorInfo]] = []
    size = 0
    for t in tensors:
        if not shards or (size + t.nbytes > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def safetensors_header(
    tensors: list[TensorInfo], aliases: dict[str, str] | None = None
) -> tuple[bytes, list[TensorInfo]]:
    """The header (length prefix included, padded to 8 bytes) and the tensors in data order;
    ``aliases`` (dropped name -> kept name) of tensors in this shard go to ``__metadata__``."""
    ordered = sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.key))
    here = {t.key for t in tensors}
    tied = {a: k for a, k in sorted((aliases or {}).items()) if k in here}
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **tied}}
    pos = 0
    for t in ordered:
        if t.key == "__metadata__":  # it would replace the header's metadata entry
            raise SerializationError(f"tensor {t.key!r}: safetensors reserves that name")
        name = _SAFETENSORS_NAMES.get(t.dtype)
        if name is None:
            raise SerializationError(f"tensor {t.key!r}: safetensors cannot store dtype {t.dtype}")
        header[t.key] = {
            "dtype": name,
            "shape": list(t.shape),
            "data_offsets": [pos, pos + t.nbytes],
        }
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, ordered


def tied_aliases(source: Source) -> dict[str, str]:
    """Names sharing one storage (same bytes, shape, dtype and conjugate/negative bits) with an
    earlier name in the file's order: alias -> kept name. Only ``torch.save`` files keep
    storage identity."""
    if not isinstance(source, _TorchFileSource):
        return {}
    first: dict[tuple[Any, ...], str] = {}
    aliases = {}
    for key, t in source.values.items():
        if t.numel() == 0:
            continue
        identity = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            t.shape,
            t.stride(),
            t.dtype,
            t.is_conj(),  # a conjugate or negative view shows other values from one storage
            t.is_neg(),
        )
        if identity in first:
            aliases[key] = first[identity]
        else:
            first[identity] = key
    return aliases


def safetensors_names(shards: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-0000i-of-0000n.safetensors``."""
    if shards == 1:
        return [SAFETENSORS_SINGLE]
    return [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]


def safetensors_index(weight_map: dict[str, str], total: int) -> bytes:
    """``model.safetensors.index.json`` as Hugging Face writes it (keys sorted)."""
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2).encode()


def plan_files(
    tensors: list[TensorInfo], max_shard_bytes: int
) -> list[tuple[str, list[TensorInfo]]]:
    """Each output file's name and tensors: consecutive in key order, as ``plan_shards``."""
    kept = sorted(tensors, key=lambda t: t.key)
    shards = plan_shards(kept, max_shard_bytes) if kept else [[]]
    return list(zip(safetensors_names(len(shards)), shards))


def export_safetensors(
    source: Source,
    destination: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    max_shard_bytes: int = 5 * 10**9,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
    on_bytes: Callable[[int], None] | None = None,
    group: Group | None = None,
) -> ExportResult:
    """Write ``source``'s tensors as Hugging Face style safetensors in ``destination``.

    Every rank of ``group`` (one process if None) calls it with the same arguments: each
    writes the files a deterministic split by bytes gives it, each under its temp name
    ``<name>.partial``. Once every rank's files are durable the coordinator publishes: it
    removes an earlier export's index, renames the files into place, writes the new index
    (several files), then removes the earlier export's other files. An earlier export at
    ``destination`` stays whole until then: a failure while writing raises on every rank
    and removes only this export's temp files. A failure while publishing (a rename or the
    index write failing) leaves no index: files renamed by then are removed, and an earlier
    several-file export has lost its index (its shards not yet replaced stay).
    """
    group = group or Group(None, 0, 1, 0)
    location = resolve(destination, storage_options)
    store = storage_for(location)
    aliases = tied_aliases(source)
    held = common_tensors(source)
    files = plan_files(
        [source.tensors[k] for k in source.tensors if k not in aliases]
        + [_info(k, t) for k, t in held.items()],
        max_shard_bytes,
    )
    names = [name for name, _ in files]
    work = [WorkItem(name, sum(t.nbytes for t in shard), 0) for name, shard in files]
    mine = {w.key for w in assign(work, group.size)[group.rank]}

    def plan() -> tuple[list[str], int]:
        if _holds_source(location, source):
            raise InvalidArgumentError(
                f"the destination {location.url} holds the source {source.location.url}: "
                "the export would overwrite the files it reads"
            )
        return new_folders(location), max_shard_bytes  # before any write

    everyone = protocol.agree(group, "plan", plan)
    created = everyone[0][0]
    same_split("export_safetensors", [m for _, m in everyone])  # else other files per rank

    protocol.on_coordinator(group, "prepare", store.makedirs)  # before any rank writes

    started: list[str] = []  # the temp files this rank opened, removed if the export fails
    published: list[str] = []  # the coordinator's: final names this export has replaced

    def write() -> dict[str, str]:
        store.makedirs()  # the coordinator's may not be visible here yet
        weight_map: dict[str, str] = {}
        for name, shard in files:
            if name not in mine:
                continue
            head, ordered = safetensors_header(shard, aliases)
            started.append(name + PARTIAL)
            with (
                storage_faults(f"{location.url}: write {name}"),
                store.open_write(location.path(name + PARTIAL)) as raw,
            ):
                out = CoalescingFile(raw)
                out.write(memoryview(head))
                for t in ordered:
                    parts = (
                        [tensor_bytes(held[t.key])]
                        if t.key in held
                        else _whole(source, t.key, slab_bytes)
                    )
                    for part in counted(parts, on_bytes):
                        out.write(part)
                    weight_map[t.key] = name
                out.flush()
                store.sync(raw)
        return weight_map

    def publish(maps: list[dict[str, str]]) -> None:
        # an earlier export's index would name this one's shards among its own
        published.append(SAFETENSORS_INDEX)
        _remove_present(store, [SAFETENSORS_INDEX])
        for name in names:
            with storage_faults(f"{location.url}: publish {name}"):
                location.fs.mv(location.path(name + PARTIAL), location.path(name))
            published.append(name)
        if location.is_local:
            _sync_dir(location.root)
        if len(names) > 1:
            weight_map = {k: v for m in maps for k, v in m.items()}
            total = sum(t.nbytes for _, shard in files for t in shard)
            raw_index = safetensors_index(weight_map, total)
            store.commit_file(SAFETENSORS_INDEX, raw_index, f"{SAFETENSORS_INDEX}.tmp", sync=True)

    try:
        protocol.commit(group, "write", write, publish)
    except BaseException:  # every rank has stopped writing by now
        # (the index's temp file: commit_file's own, which it removes when the commit fails)
        # each rank removes its files, then the folders the export made while they are empty:
        # the last rank to finish removes them (the coordinator may finish first)
        remove_export(store, [*started, *published], created)
        raise
    written = names + ([SAFETENSORS_INDEX] if len(names) > 1 else [])
    if group.is_coordinator:
        _remove_quietly(store, stale_exports(store, written))  # an earlier export (--force)
    skipped = sorted(source.objects)
    total = sum(t.nbytes for _, shard in files for t in shard)
    count = sum(len(shard) for _, shard in files)
    return ExportResult(location.url, written, count, total, skipped, aliases)


def _holds_source(location: Location, source: Source) -> bool:
    """Whether ``location`` is the folder of ``source``'s files (the source itself, or the
    folder of a single-file source), whose files an export there would overwrite."""
    src = source.location
    if type(src.fs) is not type(location.fs):
        return False
    norm = os.path.realpath if location.is_local else (lambda p: p.rstrip("/"))
    dst, root = norm(location.root), norm(src.root)
    if dst == root:
        return True
    return source.format == Format.SAFETENSORS and dst == norm(root.rsplit("/", 1)[0] or "/")


def same_split(what: str, limits: list[int]) -> None:
    """Raise (on every rank: each sees all ``limits``) unless every rank passed the same
    ``max_shard_bytes``: the files each writes are planned from it."""
    if len(set(limits)) > 1:
        ranks = ", ".join(f"rank {r}: {m}" for r, m in enumerate(limits))
        raise InvalidArgumentError(
            f"{what}: every rank must pass the same max_shard_bytes, got {ranks}"
        )


def remove_export(store: Storage, names: list[str], created: list[str]) -> None:
    """Remove a failed export's files (and the folders the export created, ``new_folders``)."""
    _remove_quietly(store, names)
    remove_new_folders(created)  # only while empty: never another's files


def stale_exports(store: Storage, keep: list[str]) -> list[str]:
    """Safetensors files of an earlier export at the destination that this one did not write,
    and the temp files (``.partial``) a killed export or ``save_hf`` left behind."""
    pattern = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.partial)?\Z")
    names = store.list_names()
    return [n for n in names if n not in keep and (pattern.match(n) or n == SAFETENSORS_INDEX)]


def _remove_present(store: Storage, names: list[str]) -> None:
    """Remove those of ``names`` that exist."""
    present = set(store.list_names())
    store.remove([n for n in names if n in present])


def _sync_dir(root: str) -> None:
    """Make the renames in the local folder ``root`` durable (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_quietly(store: Storage, names: list[str]) -> None:
    """``_remove_present``, a failure only logged."""
    try:
        _remove_present(store, names)
    except Exception as e:  # the export's own outcome is what the caller must see
        log.warning("could not remove %s in %s: %s", names, store.location.url, e)


def _torch_layout(source: Source) -> dict[str, Any]:
    """The dict the torch file holds, tensors as unallocated placeholders."""
    out: dict[str, Any] = {}
    common = source.common_state() if COMMON_KEY in source.objects else {}
    if not isinstance(common, dict):
        common = {COMMON_KEY: common}
    for key in sorted(source.objects):
        if key != COMMON_KEY:
            out[key] = source.object(key)
    for key, value in common.items():
        if key in out:
            raise CheckpointError(f"{key!r} is both an object and a common-state entry")
        out[key] = value
    for key in sorted(source.tensors):
        if key in out:
            raise CheckpointError(f"{key!r} is both a tensor and a common-state entry or object")
        info = source.tensors[key]
        out[key] = torch.empty(info.shape, dtype=info.dtype)  # untouched: no memory committed
    return out


class _StorageOrder(pickle.Pickler):
    """Pickles nothing: numbers each storage in the order ``torch.save`` names them
    (``data/0``, ``data/1``, ...), as its pickler meets them."""

    def __init__(self) -> None:
        super().__init__(_Discard(), protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.order: dict[int, tuple[str, Any]] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
            key = self.order.setdefault(storage._cdata, (str(len(self.order)), storage))[0]
            return ("storage", key)
        return None


class _Discard:
    def write(self, data: Any) -> int:
        return len(data)


def _held_storages(layout: dict[str, Any], placeholders: set[int]) -> dict[str, Any]:
    """The storages of the tensors held in objects and the common state, by their record
    name in the torch file (``torch.save`` under ``skip_data`` writes no tensor's bytes;
    the checkpoint's own tensors are streamed in later, these must be written too)."""
    skipped = {layout[k].untyped_storage()._cdata for k in layout if id(layout[k]) in placeholders}
    order = _StorageOrder()
    order.dump(layout)
    return {
        f"data/{key}": storage
        for cdata, (key, storage) in order.order.items()
        if cdata not in skipped
    }


def _write_held(
    fd: int,
    path: str,
    held: dict[str, Any],
    records: dict[int, tuple[zipfile.ZipInfo, int]],
) -> int:
    """Write the bytes of the ``held`` storages (objects' and common tensors') into their
    records of the torch file at ``path``, and their CRCs; returns the bytes written."""
    total = 0
    by_name = {
        info.filename.partition("/")[2]: (start, info, cd) for start, (info, cd) in records.items()
    }
    for name, storage in held.items():
        found = by_name.get(name)
        data = storage.cpu() if storage.device.type != "cpu" else storage
        raw = torch.empty(0, dtype=torch.uint8).set_(data, 0, (data.nbytes(),)).numpy().tobytes()
        if found is None or found[1].file_size != len(raw):
            raise CheckpointError(
                f"cannot locate the bytes of a tensor held in an object in {path}"
            )
        start, info, cd_entry = found
        view = memoryview(raw)
        pos = start
        while len(view):
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n
        _set_crc(fd, info, start, cd_entry, zlib.crc32(raw))
        total += len(raw)
    return total


def _data_records(path: str) -> dict[int, tuple[zipfile.ZipInfo, int]]:
    """Data start offset -> (zip entry, offset of its central directory entry)."""
    out = {}
    with open(path, "rb") as f, zipfile.ZipFile(f) as z:
        cd = z.start_dir  # type: ignore[attr-defined]
        for info in z.infolist():
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            out[info.header_offset + 30 + name_len + extra_len] = (info, cd)
            f.seek(cd + 28)
            n, m, k = struct.unpack("<HHH", f.read(6))
            cd += 46 + n + m + k
    return out


def _set_crc(fd: int, info: zipfile.ZipInfo, data_start: int, cd_entry: int, crc: int) -> None:
    packed = struct.pack("<I", crc)
    os.pwrite(fd, packed, cd_entry + 16)
    if info.flag_bits & 0x08:  # a data descriptor follows the data
        end = data_start + info.compress_size
        sig = os.pread(fd, 4, end)
        os.pwrite(fd, packed, end + 4 if sig == b"PK\x07\x08" else end)
    else:
        os.pwrite(fd, packed, info.header_offset + 14)


def export_torch(
    source: Source,
    destination: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
    on_bytes: Callable[[int], None] | None = None,
) -> ExportResult:
    """Write ``source`` as one ``torch.save`` file at ``destination`` (any fsspec URL)."""
    location = resolve(destination, storage_options)
    with storage_faults(f"{location.url}: write"):
        return _export_torch(source, location, slab_bytes, on_bytes)


def _export_torch(
    source: Source,
    location: Location,
    slab_bytes: int,
    on_bytes: Callable[[int], None] | None,
) -> ExportResult:
    """``export_torch`` at a resolved ``location`` (file system errors raised as they come)."""
    scratch = None
    path = location.root
    folder = os.path.dirname(path) or "."
    created: list[str] = []
    if not location.is_local:
        scratch = tempfile.mkdtemp(prefix="dcpbridge-export-")
        path = os.path.join(scratch, os.path.basename(location.root) or "model.pt")
    else:
        created = new_folders(location)[1:]  # the file's missing folders
        os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp-export"
    try:
        total = _write_torch_file(source, tmp, slab_bytes, on_bytes)
        os.replace(tmp, path)
        if scratch is not None:
            location.fs.put_file(path, location.root)
    except BaseException:  # a failed export leaves nothing behind
        if scratch is None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            remove_new_folders(created)  # only while empty: never another's files
        raise
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return ExportResult(location.url, [location.url], len(source.tensors), total, [])


def _write_torch_file(
    source: Source, path: str, slab_bytes: int, on_bytes: Callable[[int], None] | None
) -> int:
    layout = _torch_layout(source)
    with torch.serialization.skip_data():
        try:
            torch.save(layout, path)
        except RuntimeError as e:  # torch's zip writer failing to write (a full disk)
            raise storage_error(f"{path}: write", e) from e
    held = _held_storages(layout, {id(layout[k]) for k in source.tensors})
    del layout
    placed = torch.load(path, map_location="meta", mmap=True, weights_only=False)
    records = _data_records(path)
    total = 0
    fd = os.open(path, os.O_RDWR)
    try:
        total += _write_held(fd, path, held, records)
        for key in sorted(source.tensors):
            if source.tensors[key].nbytes == 0:
                continue
            storage = placed[key].untyped_storage()
            start = getattr(storage, "_checkpoint_offset", None)
            if start is None or start not in records:
                raise CheckpointError(f"cannot locate the bytes of {key!r} in {path}")
            pos, crc = start, 0
            for part in counted(_whole(source, key, slab_bytes), on_bytes):
                view = part
                while len(view):
                    n = os.pwrite(fd, view, pos)
                    view, pos = view[n:], pos + n
                crc = zlib.crc32(part, crc)
            info, cd_entry = records[start]
            if pos - start != info.file_size:
                raise CheckpointError(
                    f"{key!r}: wrote {pos - start} bytes, record holds {info.file_size}"
                )
            _set_crc(fd, info, start, cd_entry, crc)
            total += pos - start
        os.fsync(fd)
    finally:
        os.close(fd)
    return total
