"""Persist behind: a persistent checkpoint uploaded from a committed local step's files.

A local step is an ordinary dcpbridge checkpoint, so its persistent twin is the same bytes:
each rank uploads the data files it wrote from its node's directory, then the coordinator
publishes the step's document, last, as the persistent commit. Nothing is staged a second
time, and the upload runs on the local tier's background thread after the local commit.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from dcpbridge.engine import protocol
from dcpbridge.engine.async_save import AsyncSaveHandle
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.incremental import files_in
from dcpbridge.engine.local_plan import writer_rank
from dcpbridge.errors import CheckpointError
from dcpbridge.storage import METADATA_FILE, Location, StorageIndex
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.errors import storage_faults
from dcpbridge.storage.format.document import DATA_FILE_RE
from dcpbridge.storage.format.paths import spread_dir
from dcpbridge.storage.write.commit import check_present, commit_document, committed_save_id

log = logging.getLogger("dcpbridge")
_PIECE = 8 << 20  # bytes per read while uploading a data file

__all__ = ["PersistJob", "upload"]


@dataclass
class PersistJob:
    """Where a local step goes in the persistent tier: its URL, location, the manager's
    preparation (run on the coordinator first) and the handle its outcome finishes."""

    url: str
    location: Location
    prepare: Callable[[], None] | None
    handle: AsyncSaveHandle

    @staticmethod
    def new(url: str, location: Location, prepare: Callable[[], None] | None) -> PersistJob:
        """A job whose handle never holds the caller's tensors (the local step stages)."""
        handle = AsyncSaveHandle(url)
        handle._staged.set()
        return PersistJob(url, location, prepare, handle)


def upload(group: Group, job: PersistJob, local: Location, raw: bytes, index: StorageIndex) -> None:
    """Upload this rank's data files of the local step at ``local`` (document ``raw``) to
    ``job.location`` and commit there (collective); the outcome finishes ``job.handle``."""
    error: BaseException | None = None
    try:
        if job.prepare is not None:
            protocol.on_coordinator(group, "persist behind: prepare", job.prepare)
        protocol.agree(
            group, "persist behind: upload", lambda: _upload_mine(group, job, local, index)
        )
        protocol.on_coordinator(group, "persist behind: commit", lambda: _commit(job, raw, index))
    except BaseException as e:  # raised alike on every rank: reported at the next save/wait
        error = e  # (a base exception too, a client's CancelledError: else never finished)
        if group.is_coordinator:  # every rank is done with it: nothing half-written stays
            _remove(job.location, index)
    job.handle._finish(error)


def _commit(job: PersistJob, raw: bytes, index: StorageIndex) -> None:
    """Publish the document ``raw`` at ``job.location`` once every file it names is there,
    then remove the data files of the commit it replaced (a step saved again), as a save does."""
    store = storage_for(job.location)
    check_present(store, index.files, index.prefixes)
    commit_document(
        store, raw, index.files, save_id=index.save_id, sync=True, temp_name=f"{METADATA_FILE}.tmp"
    )


def _remove(location: Location, index: StorageIndex) -> None:
    """Delete what a failed upload of the local step ``index`` left at ``location`` (best
    effort): its data files, and the folder where no checkpoint is left in it. A checkpoint
    committed there before (a re-save) and files other checkpoints reference stay."""
    try:
        with storage_faults(f"{location.url}: remove"):
            store = storage_for(location)
            if committed_save_id(store) == index.save_id:
                return  # it committed: nothing of it is half-written
            mine = {_relative(name, index.prefixes) for name in index.files}
            left = files_in(location)
            base = location.root.rstrip("/")
            if any(_needs_folder(p) and p not in mine for p in left):
                doomed = [p for p in left if p in mine]
                if doomed:
                    store.remove(doomed)  # paths taken literally, never as patterns
            else:
                store.remove_folder()
            location.fs.invalidate_cache(base)
    except CheckpointError as e:
        log.warning("dcpbridge: removing the failed upload at %s failed: %s", location.url, e)


def _relative(name: str, prefixes: int) -> str:
    """Path of a local step's data file ``name`` inside a checkpoint folder."""
    folder = spread_dir(name, prefixes)
    return f"{folder}/{name}" if folder else name


def _needs_folder(path: str) -> bool:
    """Whether file ``path`` of a checkpoint folder may belong to a checkpoint (its commit
    file or a data file, which later incremental steps may reference)."""
    last = path.rsplit("/", 1)[-1]
    return last == METADATA_FILE or bool(DATA_FILE_RE.match(last))


def _upload_mine(group: Group, job: PersistJob, local: Location, index: StorageIndex) -> None:
    """Copy the data files this rank wrote, byte for byte, and make them durable."""
    store = storage_for(job.location)
    store.makedirs()
    for name in index.files:
        if writer_rank(name) == group.rank:
            with storage_faults(f"{job.url}: upload {name} from {local.url}"):
                _upload_file(
                    local,
                    local.data_path(name, index.prefixes),
                    store,
                    job.location.data_path(name, index.prefixes),
                )


def _upload_file(local: Location, source: str, store: Storage, target: str) -> None:
    """Copy ``source`` to ``target``; a failure part-way leaves no object (an S3 upload is
    aborted on leaving its ``with`` block with an exception, where ``close`` would finish it)."""
    with local.fs.open(source, "rb") as src, store.open_write(target) as out:
        shutil.copyfileobj(src, out, _PIECE)
        store.sync(out)
