"""A save's commit: the metadata document indexed from every rank's write results and
committed last (conditionally on the commit it replaces), and the files that commit makes
stale removed after it."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import WriteResult

from dcpbridge.storage.backends.referenced import sizes_with_references
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.errors import StorageFileNotFoundError
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import (
    DATA_FILE_RE,
    METADATA_FILE,
    TEMP_METADATA_PREFIX,
    ItemKey,
    ItemTable,
    StorageIndex,
    StoredItem,
    encode_metadata,
    temp_metadata_name,
)
from dcpbridge.storage.format.references import is_reference, reference_dir
from dcpbridge.storage.write.written import written_table

log = logging.getLogger(__name__)


def publish(
    store: Storage,
    metadata: Metadata,
    items: Mapping[ItemKey, StoredItem],
    *,
    save_id: str,
    world_size: int,
    checksums: bool,
    checksum_block_size: int,
    sync: bool,
    makedirs: bool = False,
    columns: bool = False,
    synced: Callable[[], None] | None = None,
    check_files: bool = True,
) -> None:
    """Index ``items`` into ``metadata``, commit ``dcpbridge.json`` last, then drop the files of
    the checkpoint it replaced (``columns``: as ``encode_index``; ``synced``: waits until the
    data files are durable, called once the document is encoded, before it is committed;
    ``check_files``: ``check_present`` first)."""
    raw = encode_index(
        metadata,
        items,
        save_id=save_id,
        world_size=world_size,
        checksums=checksums,
        checksum_block_size=checksum_block_size,
        prefixes=store.location.prefixes,
        columns=columns,
    )
    if synced is not None:
        synced()
    if makedirs:
        store.makedirs()
    index = metadata.storage_data
    assert isinstance(index, StorageIndex)
    if check_files:
        check_present(store, index.files, index.prefixes)
    commit_document(store, raw, index.files, save_id=save_id, sync=sync)


def commit_document(
    store: Storage,
    raw: bytes,
    files: Iterable[str],
    *,
    save_id: str,
    sync: bool,
    temp_name: str | None = None,
) -> None:
    """Commit ``raw`` (a document naming data ``files``) at ``store``'s location, conditionally
    on the commit it replaces, then remove that commit's data files ``raw`` does not name
    (``temp_name``: of the temp file, by default ``temp_metadata_name(save_id)``)."""
    current = store.read_committed(METADATA_FILE)
    files = list(files)
    keep = set(files) | _referenced_here(store.location.root, files)
    replaced = [n for n in files_of(json_object(current.data)) if n not in keep]
    # Conditional: if another save committed since ``current`` was read, this one raises
    # (and its caller removes its files) instead of replacing a commit it never saw.
    temp = temp_name or temp_metadata_name(save_id)
    store.commit_file(METADATA_FILE, raw, temp, sync=sync, replaces=current)
    remove_replaced_files(store, replaced, save_id)


def check_present(store: Storage, files: Iterable[str], prefixes: int) -> None:
    """Raise ``StorageFileNotFoundError`` naming the data files among ``files`` (a commit
    document's, references included) that are not there: a commit never names missing data
    (another job's cleanup of the same root may remove a save's files while it writes). One
    listing of the location and of each referenced folder; a file a listing lacks is looked
    up once more (a store whose listings lag behind its writes)."""
    files = list(files)
    store.fs.invalidate_cache(store.location.root.rstrip("/"))
    present = sizes_with_references(store, files)
    missing = [f for f in files if f not in present and not _found(store, f, prefixes)]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise StorageFileNotFoundError(
            f"{store.location.url}: data files of this save are missing at its commit "
            f"({', '.join(missing[:5])}{more}; removed by another job's cleanup of the same "
            "root?): it did not commit"
        )


def _found(store: Storage, name: str, prefixes: int) -> bool:
    """Whether data file (or reference) ``name`` is there, looked up by its own path (not
    answered from a cached listing of its folder)."""
    path = store.location.data_path(name, prefixes)
    store.fs.invalidate_cache(path.rsplit("/", 1)[0])
    try:
        store.info(path)
    except FileNotFoundError:
        return False
    return True


def _referenced_here(root: str, files: Iterable[str]) -> set[str]:
    """Names of the files of checkpoint folder ``root`` that its own document ``files``
    references (``../<this folder>/...``: an incremental save over the checkpoint its
    ``reuse_from`` references): replacing the old commit must keep them."""
    here = root.rstrip("/").rsplit("/", 1)[-1]
    return {f.rsplit("/", 1)[-1] for f in files if is_reference(f) and reference_dir(f) == here}


def json_object(raw: bytes | None) -> dict[str, Any] | None:
    """``raw`` as a JSON object, or None if absent or unreadable."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def encode_index(
    metadata: Metadata,
    items: Mapping[ItemKey, StoredItem],
    *,
    save_id: str,
    world_size: int,
    checksums: bool,
    checksum_block_size: int = checksum.DEFAULT_BLOCK_SIZE,
    prefixes: int = 1,
    columns: bool = False,
) -> bytes:
    """The commit document of ``metadata`` with ``items`` (a mapping or an ``ItemTable``) as
    its storage index (data files spread over ``prefixes`` folders; ``columns``: items packed
    as columns however few)."""
    files = (
        items.files if isinstance(items, ItemTable) else sorted({i.file for i in items.values()})
    )
    metadata.storage_data = StorageIndex(
        items=items,
        save_id=save_id,
        files=tuple(files),
        checksum_algorithm=checksum.ALGORITHM if checksums else None,
        checksum_block_size=checksum_block_size if checksums else 0,
        world_size=world_size,
        prefixes=prefixes,
    )
    return encode_metadata(metadata, columns=columns)


def index_results(
    metadata: Metadata, results: list[list[WriteResult]], *, save_id: str, checksums: bool
) -> bytes:
    """The commit document of ``metadata`` for every rank's write ``results``."""
    return encode_index(
        metadata,
        written_table(metadata, results, checksums=checksums),
        save_id=save_id,
        world_size=len(results),
        checksums=checksums,
    )


def _committed_document(store: Storage) -> dict[str, Any] | None:
    """The JSON of the commit file at ``store``'s location, or None if absent or not a JSON
    object; a failure to read it raises (the caller cannot tell whether a save committed)."""
    try:
        return json_object(store.read_file(store.location.path(METADATA_FILE)))
    except FileNotFoundError:
        return None


def committed_save_id(store: Storage) -> str | None:
    """The save id the location's commit file names (None if there is none). Raises where
    the commit file cannot be read: a failed save's cleanup then removes nothing (its
    commit may have landed with its answer lost, and its data files are then needed)."""
    doc = _committed_document(store)
    save_id = doc.get("save_id") if doc is not None else None
    return save_id if isinstance(save_id, str) else None


def files_of(doc: dict[str, Any] | None) -> list[str]:
    """Data files a commit document names ([] if none or malformed)."""
    files = doc.get("files") if doc is not None else None
    if not isinstance(files, list):
        return []
    return [f for f in files if isinstance(f, str) and DATA_FILE_RE.match(f)]


def save_id_of(name: str) -> str | None:
    m = DATA_FILE_RE.match(name)
    return m.group(3) if m else None


def remove_replaced_files(store: Storage, replaced: list[str], save_id: str) -> None:
    """After ``save_id`` committed: delete the files of the commit it replaced (local temp
    files of killed commits go in the commit itself, under its lock).

    Data files of other save ids are left alone: they may belong to a save to this location
    that is still running (deleting them would break its commit). A failed save removes its
    own files; only a killed process leaves some behind.
    """
    try:
        names = set(store.list_names())
        stale = [n for n in replaced if n in names and save_id_of(n) != save_id]
        if not store.location.is_local:  # no commit writes temp files there: all are stale
            stale += [n for n in names if n.startswith(TEMP_METADATA_PREFIX)]
        store.remove(sorted(set(stale)))
    except OSError as e:  # the checkpoint is committed; leftovers are only wasted space
        log.warning("could not remove replaced files in %s: %s", store.location.url, e)


def remove_stale_files(store: Storage, save_id: str) -> None:
    """Delete every data file not of ``save_id`` (and temp files) at ``store``'s location."""
    try:
        stale = [
            n
            for n in store.list_names()
            if ((m := DATA_FILE_RE.match(n)) and m.group(3) != save_id)
            or n.startswith(TEMP_METADATA_PREFIX)
        ]
        store.remove(stale)
    except OSError as e:  # the checkpoint is committed; leftovers are only wasted space
        log.warning("could not remove stale files in %s: %s", store.location.url, e)
