"""Deleting checkpoints that incremental saves may reference: only files no kept checkpoint needs.

What a checkpoint needs is read from its commit document on storage (its own data files and
the files it references in sibling checkpoints), never from memory, so it holds after restarts
and across jobs. Deletion runs in an order that a crash at any point cannot break a kept
checkpoint: every doomed commit file first (nothing half-deleted looks complete), then the
files no kept checkpoint names, then the folders left empty. ``fsck`` finds what a crash left.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dcpbridge.errors import CorruptCheckpointError, InvalidArgumentError
from dcpbridge.storage import METADATA_FILE, Location, resolve
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.errors import storage_faults
from dcpbridge.storage.format.document import DATA_FILE_RE, TEMP_METADATA_PREFIX
from dcpbridge.storage.format.paths import SPREAD_DIR, check_file_name, spread_dir
from dcpbridge.storage.format.references import check_reference, is_reference

log = logging.getLogger(__name__)

Needed = set[tuple[str, str]]  # (checkpoint folder name, file path inside it)


def child(root: Location, name: str) -> Location:
    """The checkpoint folder ``name`` under storage root ``root`` (same filesystem options)."""
    check_file_name(name)
    return Location(
        url=f"{root.url.rstrip('/')}/{name}",
        fs=root.fs,
        root=f"{root.root.rstrip('/')}/{name}",
        settings=root.settings,
    )


def needed_by(name: str, raw: bytes) -> Needed:
    """The files checkpoint folder ``name`` needs, from its commit document ``raw`` (hostile:
    anything malformed raises ``CorruptCheckpointError``, so nothing is deleted on a guess)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{name}/{METADATA_FILE} is not valid JSON: {e}") from None
    files = doc.get("files") if isinstance(doc, dict) else None
    prefixes = doc.get("prefixes", 1) if isinstance(doc, dict) else 1
    if type(files) is not list or type(prefixes) is not int or prefixes < 1:
        raise CorruptCheckpointError(f"{name}/{METADATA_FILE} has no valid files list")
    out: Needed = set()
    for f in files:
        if not isinstance(f, str):
            raise CorruptCheckpointError(f"{name}/{METADATA_FILE}: {f!r} is not a file name")
        if is_reference(f):
            m = check_reference(f)
            inner = f"{m.group('spread')}/{m.group('file')}" if m.group("spread") else m["file"]
            out.add((m.group("dir"), inner))
        else:
            folder = spread_dir(check_file_name(f), prefixes)
            out.add((name, f"{folder}/{f}" if folder else f))
    return out


def needed_files(root: Location, names: Iterable[str]) -> Needed:
    """Every file the committed checkpoints ``names`` (folders under ``root``) need; a
    document that cannot be read raises (the caller then deletes nothing)."""
    out: Needed = set()
    for name in names:
        location = child(root, name)
        raw = storage_for(location).read_file(location.path(METADATA_FILE))
        out |= needed_by(name, raw)
    return out


def refuse_if_referenced(root: Location, name: str, others: Iterable[str]) -> None:
    """Refuse to replace checkpoint folder ``name`` while the committed checkpoints ``others``
    reference its files (replacing it deletes them)."""
    users = [o for o in others if o != name and any(d == name for d, _ in needed_files(root, [o]))]
    if users:
        raise InvalidArgumentError(
            f"{root.url}/{name} cannot be saved again: {', '.join(users)} reference its files "
            "(incremental saves); delete those steps first or save under another step"
        )


def _listing(location: Location, list_fn: Callable[[Any, str], Any]) -> tuple[str, Any]:
    """``list_fn(fs, folder)`` of ``location``'s folder, afresh (an absent folder lists
    nothing); ``fs`` is the storage's own (on S3, every request bounded by its timeouts)."""
    base = location.root.rstrip("/")
    with storage_faults(f"{location.url}: list", location.fs):
        fs = storage_for(location).fs
        fs.invalidate_cache(base)
        try:
            return base, list_fn(fs, base)
        except FileNotFoundError:
            return base, []


def files_in(location: Location) -> list[str]:
    """Paths (relative to the folder) of every file under checkpoint folder ``location``."""
    base, found = _listing(location, lambda fs, b: fs.find(b, detail=False))
    return sorted(p.rstrip("/")[len(base) + 1 :] for p in found if p.startswith(base + "/"))


def _remove(location: Location, paths: list[str]) -> None:
    if not paths:
        return
    with storage_faults(f"{location.url}: remove"):
        storage_for(location).remove(paths)  # paths taken literally, never as patterns
        location.fs.invalidate_cache(location.root.rstrip("/"))


def _remove_folder(location: Location) -> None:
    with storage_faults(f"{location.url}: remove"):
        storage_for(location).remove_folder()


def remove_checkpoints(
    root: Location, doomed: Iterable[str], kept: Iterable[str], *, uncommitted: Iterable[str] = ()
) -> None:
    """Delete checkpoint folders ``doomed`` under ``root`` except the files the committed
    checkpoints ``kept`` need: all doomed commit files first, then the rest. A folder of
    ``uncommitted`` (doomed as a killed save's) that holds a commit file now is another
    save's that committed since: it stays whole."""
    doomed, uncommitted = list(doomed), set(uncommitted)
    if not doomed:
        return
    needed = needed_files(root, kept)  # raises before anything is deleted
    spared: set[str] = set()  # uncommitted when doomed, committed now
    for name in doomed:
        location = child(root, name)
        store = storage_for(location)
        if not is_link(location) and store.exists(METADATA_FILE):
            if name in uncommitted:
                spared.add(name)
            else:
                store.remove([METADATA_FILE])
    for name in (n for n in doomed if n not in spared):
        location = child(root, name)
        keep = {p for d, p in needed if d == name}
        if is_link(location):  # another place's checkpoint, linked in: never changed here
            if keep:
                log.info("dcpbridge: keeping %s: kept checkpoints read through it", location.url)
            else:  # the link alone, its path taken literally (one step: never half-deleted)
                with storage_faults(f"{location.url}: remove"):
                    os.unlink(location.root.rstrip("/"))
            continue
        if not keep:
            _remove_folder(location)
            continue
        doomed_files = [p for p in files_in(location) if p not in keep]
        _remove(location, [p for p in doomed_files if _checkpoint_path(p)])
        tops = {p.split("/", 1)[0] for p in doomed_files if "/" in p}
        for folder in sorted(t for t in tops if not SPREAD_DIR.match(t)):
            _remove_folder(child(location, folder))  # a folder of its own: no kept file is in one


def _checkpoint_path(path: str) -> bool:
    """Whether ``path`` (in a checkpoint folder) is a file of it or of a spread folder."""
    folder, sep, rest = path.partition("/")
    return not sep or (bool(SPREAD_DIR.match(folder)) and "/" not in rest)


def is_link(location: Location) -> bool:
    """Whether checkpoint folder ``location`` is a symbolic link (local storage)."""
    return location.is_local and os.path.islink(location.root.rstrip("/"))


@dataclass
class FsckReport:
    """What ``fsck`` found under a storage root: files nothing needs, files needed but gone."""

    checkpoints: list[str] = field(default_factory=list)  # committed folders
    orphans: list[str] = field(default_factory=list)  # "<folder>/<path>"
    missing: list[str] = field(default_factory=list)  # "<folder>/<path> (needed by ...)"
    unreadable: list[str] = field(default_factory=list)  # committed folders whose document failed


def _folders(root: Location) -> list[str]:
    _, entries = _listing(root, lambda fs, b: fs.ls(b, detail=True))
    names = [str(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries]
    types = [e.get("type") for e in entries]
    return sorted(n for n, t in zip(names, types) if t == "directory")


def _replaced(root: Location, docs: dict[str, bytes | None], names: set[str]) -> set[str]:
    """Those of folders ``names`` whose commit document is no longer the one read in ``docs``
    (None: none): deleted (retention), saved again or committed while fsck looked, so what
    the old one named is not missing, and what the new one names is no orphan."""
    out = set()
    for name in names:
        location = child(root, name)
        try:
            now = storage_for(location).read_file(location.path(METADATA_FILE))
        except FileNotFoundError:
            now = None
        if now != docs[name]:
            out.add(name)
    return out


def _is_orphan(path: str) -> bool:
    """Files a checkpoint folder holds only while a save runs or after a crash: in the folder
    itself or one of its spread folders, never deeper (a checkpoint nested in it)."""
    folder, _, last = path.rpartition("/")
    if folder and not SPREAD_DIR.match(folder):
        return False
    return bool(DATA_FILE_RE.match(last)) or last.startswith(TEMP_METADATA_PREFIX)


def fsck(url: str, storage_options: dict | None = None, *, fix: bool = False) -> FsckReport:
    """Check every checkpoint folder under storage root ``url``: orphaned data files (no
    committed checkpoint needs them) and missing ones; ``fix`` removes orphans only (run it
    while no save writes under the root)."""
    root = resolve(url, storage_options)
    report = FsckReport()
    users: dict[tuple[str, str], list[str]] = {}
    docs: dict[str, bytes | None] = {}  # each folder's commit document as read (None: none)
    folders = _folders(root)
    for name in folders:
        location = child(root, name)
        try:  # one read per folder (no check first): absent, or deleted by retention beside
            raw = storage_for(location).read_file(location.path(METADATA_FILE))
        except FileNotFoundError:
            docs[name] = None
            continue
        except Exception as e:
            report.checkpoints.append(name)
            report.unreadable.append(f"{name}: {e}")
            continue
        report.checkpoints.append(name)
        docs[name] = raw
        try:
            for key in needed_by(name, raw):
                users.setdefault(key, []).append(name)
        except Exception as e:
            report.unreadable.append(f"{name}: {e}")
    present: set[tuple[str, str]] = set()
    orphans: dict[str, list[str]] = {}
    for name in folders:
        for path in files_in(child(root, name)):
            present.add((name, path))
            if (name, path) not in users and _is_orphan(path):
                orphans.setdefault(name, []).append(path)
    lacking = {key: u for key, u in users.items() if key not in present}
    # folders whose commit changed while fsck looked (one read each): a save's files, committed
    # or removed meanwhile, are no orphans; what a deleted step needed is not missing
    changed = _replaced(root, docs, {n for n in orphans if n in docs}.union(*lacking.values()))
    for name in changed & orphans.keys():
        del orphans[name]
    report.orphans = [f"{d}/{p}" for d, ps in sorted(orphans.items()) for p in ps]
    report.missing = [
        f"{d}/{p} (needed by {', '.join(sorted(kept))})"
        for (d, p), u in sorted(lacking.items())
        if (kept := [n for n in u if n not in changed])
    ]
    if fix and not report.unreadable:
        for name, paths in orphans.items():
            location = child(root, name)
            _remove(location, paths)
            left = files_in(location)
            if name not in report.checkpoints and all(p == "manager.json" for p in left):
                _remove_folder(location)
    return report
