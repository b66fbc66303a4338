"""A folder (or one file) of safetensors opened as a sharded checkpoint: checked headers into
DCP metadata, read by dcpbridge's reader (each rank reads just its ranges, no broadcast).

Every header is validated before anything is sized by it: its length, UTF-8 JSON (no name
given twice), dtypes, shapes, byte ranges equal to shape x dtype that tile the file's data
exactly, and (with an index, itself of bounded size) every key where the index says it is
(``dcpbridge.formats.safetensors_chunks``). Shards of a Hugging Face export without their
index (which the writer publishes last) are an export that did not finish, refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from dcpbridge.errors import CorruptCheckpointError, IncompleteCheckpointError
from dcpbridge.formats.safetensors_chunks import (
    DuplicateName,
    FileChunk,
    GlobalTensor,
    file_chunks,
    global_tensors,
    load_json,
)
from dcpbridge.storage import FsspecCheckpointReader, Location, StorageIndex, StoredItem, resolve
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.errors import storage_faults

SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
MAX_INDEX_BYTES = 100 << 20  # Hugging Face's indexes hold a few MB for the largest models
# The shards of a Hugging Face export (transformers', dcpbridge's): valid only under an index,
# which the writer publishes last (without it, the export did not finish).
_HF_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors\Z")


@dataclass(frozen=True, slots=True)
class SafetensorsFiles:
    """What a folder of safetensors holds: the folder, its files, its tensors as DCP metadata."""

    folder: Location
    names: list[str]
    tensors: dict[str, GlobalTensor]
    metadata: Metadata


def _parent_url(location: Location) -> str:
    url = location.url.rstrip("/")
    return os.path.dirname(os.path.abspath(url)) if location.is_local else url.rsplit("/", 1)[0]


def read_safetensors_header(location: Location, name: str) -> tuple[dict[str, Any], int]:
    """The JSON header of safetensors file ``name`` and the offset where its data starts."""
    path = location.path(name)
    fs = storage_for(location).fs  # on S3, requests bounded by the storage's timeouts
    with storage_faults(f"{location.url}: read {name}", location.fs):
        head = fs.cat_file(path, start=0, end=8)
    size = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 2 <= size <= MAX_HEADER_BYTES:
        raise CorruptCheckpointError(f"{path}: not a safetensors file (bad header length)")
    with storage_faults(f"{location.url}: read {name}", location.fs):
        raw = fs.cat_file(path, start=8, end=8 + size)
    if raw[:1] != b"{":  # the format's header is a UTF-8 JSON object, nothing before it
        raise CorruptCheckpointError(f"{path}: safetensors header does not start with '{{'")
    try:
        header = load_json(raw.decode("utf-8"))
    except DuplicateName as e:
        raise CorruptCheckpointError(f"{path}: safetensors header {e}") from None
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + size


def _weight_map(raw: bytes, where: str) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index (key -> file name), checked."""
    try:
        weight_map = load_json(raw).get("weight_map")
    except DuplicateName as e:
        raise CorruptCheckpointError(f"{where}: {SAFETENSORS_INDEX} {e}") from None
    except (ValueError, AttributeError, RecursionError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and "/" not in v and v not in ("", ".", "..")
        for k, v in weight_map.items()
    ):
        raise CorruptCheckpointError(f"{where}: {SAFETENSORS_INDEX} has no weight_map of names")
    return weight_map


def _is_file(store: Storage, location: Location) -> bool:
    """Whether ``location`` is a file (a request bounded like the storage's others)."""
    with storage_faults(f"{location.url}: look up", location.fs):
        return bool(store.fs.isfile(location.root))


def _files(
    location: Location, store: Storage, storage_options: dict[str, Any] | None
) -> tuple[Location, list[str], dict[str, str] | None]:
    """The folder, the file names and the index's weight map (None without an index)."""
    if store.exists(SAFETENSORS_INDEX):
        size = store.file_size(location.path(SAFETENSORS_INDEX))
        if size > MAX_INDEX_BYTES:  # checked before it is read whole
            raise CorruptCheckpointError(
                f"{location.url}: {SAFETENSORS_INDEX} holds {size} bytes, more than an index "
                f"may ({MAX_INDEX_BYTES})"
            )
        weight_map = _weight_map(store.read_file(location.path(SAFETENSORS_INDEX)), location.url)
        return location, sorted(set(weight_map.values())), weight_map
    if location.root.endswith(".safetensors") and _is_file(store, location):
        folder = resolve(_parent_url(location), storage_options)
        return folder, [location.root.rstrip("/").rsplit("/", 1)[-1]], None
    names = sorted(n for n in store.file_sizes() if n.endswith(".safetensors"))  # files only
    shards = [n for n in names if _HF_SHARD.match(n)]
    if shards:
        raise IncompleteCheckpointError(
            f"{location.url}: {shards[0]} is a shard of a Hugging Face export but no "
            f"{SAFETENSORS_INDEX} (written last) exists: the export did not finish"
        )
    return location, names, None


def open_safetensors(
    location: Location, store: Storage, storage_options: dict[str, Any] | None = None
) -> SafetensorsFiles:
    """Read and check every header of the safetensors at ``location`` (metadata only)."""
    folder, names, weight_map = _files(location, store, storage_options)
    files = storage_for(folder)
    sizes = files.file_sizes()
    chunks: list[FileChunk] = []
    for name in names:
        if name not in sizes:
            raise CorruptCheckpointError(f"{folder.url}: {name} is missing")
        header, data_start = read_safetensors_header(folder, name)
        chunks += file_chunks(header, name, data_start, sizes[name])
    held = {(c.key, c.file) for c in chunks}
    for key, name in (weight_map or {}).items():
        if (key, name) not in held:
            raise CorruptCheckpointError(
                f"{folder.url}: {SAFETENSORS_INDEX} places {key!r} in {name}, which lacks it"
            )
    tensors = global_tensors(chunks, folder.url)
    state: dict[str, Any] = {}
    items = {}
    for key, t in tensors.items():
        state[key] = TensorStorageMetadata(
            TensorProperties(dtype=t.dtype),
            torch.Size(t.shape),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks],
        )
        for c in t.chunks:
            items[(key, c.offsets)] = StoredItem(
                c.file, c.start, c.nbytes, 0, None, c.sizes, c.dtype
            )
    metadata = Metadata(
        state_dict_metadata=state,
        storage_data=StorageIndex(items=items, save_id="safetensors", files=tuple(names)),
    )
    return SafetensorsFiles(folder, names, tensors, metadata)


class SafetensorsReader(FsspecCheckpointReader):
    """dcpbridge's reader over safetensors files whose headers were read and checked already:
    each rank reads the byte ranges of its own boxes (no checksums: the format has none)."""

    def __init__(
        self,
        files: SafetensorsFiles,
        *,
        storage_options: dict[str, Any] | None = None,
        thread_count: int = 4,
    ) -> None:
        super().__init__(
            files.folder,  # type: ignore[arg-type]  (resolved already)
            storage_options=storage_options,
            thread_count=thread_count,
            verify_checksums=False,
        )
        self._metadata = files.metadata
