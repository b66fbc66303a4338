"""Megatron-Core's metadata readers and checkpoint surgery, for every sharded format dcpbridge reads.

``load_tensors_metadata`` / ``load_sharded_metadata`` describe what a checkpoint stores as
data-less Megatron-style objects (keys by tensor key, objects by storage name, as Megatron
returns them) and ``remove_sharded_tensors`` drops keys from a committed dcpbridge checkpoint.
All run in one process, with no process group (the readers that load data, ``load_common`` and
``load_plain_tensors``, are the engine's: ``dcpbridge.engine.load``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)

from dcpbridge.errors import CheckpointError, InvalidArgumentError
from dcpbridge.formats.checkpoint import Format, detect, open_checkpoint
from dcpbridge.formats.config import resolve_storage_options
from dcpbridge.model.mapping import (
    COMMON_KEY,
    ShardedObject,
    ShardedTensor,
    parse_object_name,
)
from dcpbridge.storage import (
    METADATA_FILE,
    Location,
    StorageIndex,
    read_checkpoint_metadata,
    resolve,
)
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.errors import storage_faults
from dcpbridge.storage.format.document import encode_metadata, temp_metadata_name
from dcpbridge.storage.format.references import check_reference, is_reference

PathLike = str | os.PathLike[str]


def read_metadata(
    checkpoint_dir: PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    profile: str | None = None,
    allow_pickle: bool = False,
) -> Metadata:
    """The DCP metadata of a dcpbridge, torch_dist or plain DCP checkpoint (the latter two's
    pickle read without running code; ``allow_pickle`` where it needs classes beyond DCP's)."""
    options = resolve_storage_options(storage_options, profile, url=checkpoint_dir)
    checkpoint = open_checkpoint(checkpoint_dir, storage_options=options, allow_pickle=allow_pickle)
    return checkpoint.reader().read_metadata()


def tensors_metadata(metadata: Metadata) -> dict[str, ShardedTensor]:
    """Each stored tensor as one whole-tensor ShardedTensor on the meta device.

    ``axis_fragmentations`` is all ones (the box is the whole tensor); a ``load`` of these
    templates allocates real CPU tensors for them.
    """
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            size = tuple(md.size)
            data = torch.empty(size, dtype=md.properties.dtype, device="meta")
            zeros, ones = (0,) * len(size), (1,) * len(size)
            out[key] = ShardedTensor(key, data, data.dtype, size, size, zeros, ones)
    return out


def objects_metadata(metadata: Metadata) -> dict[str, ShardedObject]:
    """Each stored ShardedObject grid cell, data-less, by its storage name (Megatron's keys)."""
    out = {}
    for name, md in metadata.state_dict_metadata.items():
        parsed = parse_object_name(name) if isinstance(md, BytesStorageMetadata) else None
        if name != COMMON_KEY and parsed is not None:
            key, offset, shape = parsed
            out[name] = ShardedObject(key, None, shape, offset)
    return out


def load_tensors_metadata(
    checkpoint_dir: PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    profile: str | None = None,
    allow_pickle: bool = False,
) -> dict[str, ShardedTensor]:
    """Stored tensors by key as whole-tensor ShardedTensors (meta device), any sharded format."""
    return tensors_metadata(
        read_metadata(
            checkpoint_dir,
            storage_options=storage_options,
            profile=profile,
            allow_pickle=allow_pickle,
        )
    )


def load_sharded_metadata(
    checkpoint_dir: PathLike,
    *,
    storage_options: dict[str, Any] | None = None,
    profile: str | None = None,
    allow_pickle: bool = False,
) -> dict[str, ShardedTensor | ShardedObject]:
    """``load_tensors_metadata`` plus one data-less ShardedObject per stored object grid cell,
    keyed by its storage name ``key/shard_<offset>_<shape>`` (Megatron's result)."""
    metadata = read_metadata(
        checkpoint_dir, storage_options=storage_options, profile=profile, allow_pickle=allow_pickle
    )
    return {**objects_metadata(metadata), **tensors_metadata(metadata)}


def is_sharded_checkpoint(
    checkpoint_dir: PathLike, *, storage_options: dict[str, Any] | None = None
) -> bool:
    """Whether ``checkpoint_dir`` holds a complete checkpoint that ``load`` reads."""
    try:
        fmt = detect(resolve(checkpoint_dir, storage_options))
    except (CheckpointError, OSError):
        return False
    return fmt in (Format.DCPBRIDGE, Format.TORCH_DIST, Format.DCP)


def remove_sharded_tensors(
    checkpoint_dir: PathLike,
    key_prefix: str,
    *,
    storage_options: dict[str, Any] | None = None,
    profile: str | None = None,
) -> list[str]:
    """Drop every stored tensor and object whose key starts with ``key_prefix`` from a committed
    dcpbridge checkpoint; returns the dropped storage names.

    The new ``dcpbridge.json`` is published atomically, then data files that hold nothing else
    and that no checkpoint beside it references (incremental saves) are deleted (others keep
    the dropped bytes). Run it in one process, with no save or load of
    the same checkpoint in flight. Warns and changes nothing when no key matches (as Megatron).
    """
    if not key_prefix:
        raise InvalidArgumentError(
            "key_prefix must be a non-empty string (it would remove everything)"
        )
    location = resolve(
        checkpoint_dir, resolve_storage_options(storage_options, profile, url=checkpoint_dir)
    )
    fmt = detect(location)
    if fmt != Format.DCPBRIDGE:
        raise CheckpointError(
            f"{location.url} is a {fmt.description}; remove_sharded_tensors rewrites dcpbridge "
            "checkpoints only (convert it first: `dcpbridge convert SRC DST --to dcpbridge`)"
        )
    metadata = read_checkpoint_metadata(location)
    index = metadata.storage_data
    assert isinstance(index, StorageIndex)
    drop = sorted(
        n for n in metadata.state_dict_metadata if n.startswith(key_prefix) and n != COMMON_KEY
    )
    if not drop:
        warnings.warn(
            f"{location.url}: no stored key starts with {key_prefix!r}; nothing removed",
            stacklevel=2,
        )
        return []
    gone = set(drop)
    items = {k: it for k, it in index.items.items() if k[0] not in gone}
    files = tuple(sorted({it.file for it in items.values()}))
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict):  # DCP's key-to-path map: removed keys leave it too
        planner_data = {k: v for k, v in planner_data.items() if k not in gone}
    if isinstance(planner_data, dict) and isinstance(planner_data.get("objects"), dict):
        objects = {k: v for k, v in planner_data["objects"].items() if k not in gone}
        planner_data = {**planner_data, "objects": objects}
    common = planner_data.get("common") if isinstance(planner_data, dict) else None
    if isinstance(common, dict) and isinstance(common.get("keys"), dict):  # common state's keys
        keys = {k: path for k, path in common["keys"].items() if k not in gone}
        planner_data = {**planner_data, "common": {**common, "keys": keys}}
    kept = Metadata(
        state_dict_metadata={
            n: md for n, md in metadata.state_dict_metadata.items() if n not in gone
        },
        planner_data=planner_data,
        storage_data=dataclasses.replace(index, items=items, files=files),
    )
    unused = [f for f in index.files if f not in files and not is_reference(f)]
    if unused:  # asked before the commit: a failure leaves the checkpoint as it was
        referenced = _referenced_by_siblings(location)
        unused = [] if referenced is None else [f for f in unused if f not in referenced]
    store = storage_for(location)
    store.commit_file(
        METADATA_FILE, encode_metadata(kept), temp_metadata_name(index.save_id), sync=True
    )
    store.remove(unused)
    return drop


def _referenced_by_siblings(location: Location) -> set[str] | None:
    """This checkpoint's data files that the checkpoints beside it reference (incremental
    saves name them ``../<this folder>/<file>``), or None when a sibling's commit document
    cannot be read: files are then kept, never deleted on a guess."""
    root = location.root.rstrip("/")
    if "/" not in root or not root.rsplit("/", 1)[0]:
        return set()  # no parent folder: no siblings
    parent, name = root.rsplit("/", 1)
    out: set[str] = set()
    fs = storage_for(location).fs  # the storage's own: on S3, requests bounded by its timeouts
    with storage_faults(f"{location.url}: list the checkpoints beside it", location.fs):
        fs.invalidate_cache(parent)
        siblings = [e.rstrip("/") for e in fs.ls(parent, detail=False)]
    for sibling in siblings:
        document = f"{sibling}/{METADATA_FILE}"
        if sibling.rsplit("/", 1)[-1] == name:
            continue
        try:
            fs.invalidate_cache(document)  # a listing cached before it committed
            if not fs.exists(document):
                continue
            files = json.loads(fs.cat_file(document)).get("files", [])
            for f in files:
                if isinstance(f, str) and is_reference(f):
                    match = check_reference(f)
                    if match.group("dir") == name:
                        out.add(match.group("file"))
        except Exception as e:  # unreadable or malformed: keep every file
            warnings.warn(
                f"{location.url}: cannot tell whether {sibling} references this checkpoint's "
                f"files ({type(e).__name__}: {e}); no data file is deleted",
                stacklevel=3,
            )
            return None
    return out
