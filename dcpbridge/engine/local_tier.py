"""The local tier: frequent checkpoints in node-local directories, copied to other nodes.

A local step is an ordinary dcpbridge checkpoint (checksummed) whose data files stay in the
writing ranks' node directories (``local_dir/step_00000100/`` on each node) and whose
document is then written to every node directory. Everything runs on the tier's side group
(``collectives.SideGroup``: never the training group): planning, the write, the copies of each
rank's data files to ``replicas`` ranks on other nodes and, once every part and copy is
durable (agreed by one collective), each node's lead rank publishing the step's marker
(``local.json``, atomically). Behind the loop, the call only plans and stages (or not even
that) and the rest runs on the tier's thread. A node's directory keeps the newest committed
step and the one being written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import StorageWriter

from dcpbridge.engine import protocol
from dcpbridge.engine import save as save_mod
from dcpbridge.engine.async_save import AsyncSaveHandle, drain_at_exit
from dcpbridge.engine.cache import save_cache
from dcpbridge.engine.collectives import Group, SideGroup
from dcpbridge.engine.local_persist import PersistJob, upload
from dcpbridge.engine.local_plan import (
    LocalStep,
    Nodes,
    Recoverable,
    copy_targets,
    lacking_space,
    newest_recoverable,
    writer_rank,
)
from dcpbridge.engine.save import _Staging
from dcpbridge.engine.staging import BufferSet, StagingArea
from dcpbridge.engine.step_names import ASIDE, step_dir_name, step_of
from dcpbridge.errors import (
    CheckpointError,
    CorruptCheckpointError,
    DistributedCheckpointError,
    InvalidArgumentError,
)
from dcpbridge.model.intake import SaveParts
from dcpbridge.model.mapping import ShardedTensor
from dcpbridge.storage import (
    METADATA_FILE,
    FsspecCheckpointWriter,
    Location,
    StorageIndex,
    resolve,
)
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.store import RangeRead, Storage
from dcpbridge.storage.errors import storage_faults
from dcpbridge.storage.format.document import decode_metadata

log = logging.getLogger("dcpbridge")
T = TypeVar("T")

MARKER = "local.json"
"""A local step's commit marker, published atomically in a node's step directory last."""
StepKey = tuple[int, str, str]  # (step, save id, document digest)
_SLACK = 1 << 20  # bytes per rank beyond its tensors: objects, common state, alignment


def free_bytes(path: str) -> int | None:
    """Free bytes of the file system holding ``path`` (None for remote URLs); tests replace it."""
    if "://" in path:
        return None
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent
    return shutil.disk_usage(probe).free


def parts_share(parts: SaveParts) -> int:
    """An upper bound of the bytes this rank writes for a sorted state: its tensors plus
    slack."""
    held = sum(s.data.nbytes for s in parts.shards if isinstance(s, ShardedTensor))
    return held + _SLACK


def run_of(root: str) -> str:
    """The run a local step belongs to: its manager's persistent root, as an absolute path or
    the URL (a new job that reuses ``local_dir`` with another root must not resume from it)."""
    if "://" in root:
        return root.rstrip("/")
    return os.path.abspath(os.path.expanduser(root)).rstrip("/") or "/"


def document_digest(raw: bytes) -> str:
    """What tells two documents of one step apart."""
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class LocalTier:
    """The local tier of one ``CheckpointManager``: its directories, gloo group and steps."""

    _behind: weakref.WeakSet[LocalTier] = weakref.WeakSet()  # with a thread: drained at exit

    def __init__(
        self,
        local_dir: str,
        group: Group,
        *,
        replicas: int,
        ranks_per_node: int,
        run: str,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.local_dir = local_dir.rstrip("/") or "/"
        self.run = run  # ``run_of`` the manager's root: recorded in and required of markers
        self.replicas = replicas
        self.nodes = Nodes(group.size, ranks_per_node)
        self.storage_options = storage_options
        self._worker: threading.Thread | None = None  # started by the first local step behind
        self._pid = os.getpid()  # its thread is this process's only (not a forked child's)
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._handle: AsyncSaveHandle | None = None
        self.area = StagingArea(1)  # one staging buffer, reused by every local step
        self.documents: dict[tuple[int, str], Metadata] = {}
        """The decoded documents of the steps the last ``survey`` found, by (step, digest)."""
        self._ahead: tuple[StepKey, Any] | None = None
        self.read_locally: StepKey | None = None
        """The step every rank reads from its own node's directory (last ``survey``)."""
        self.training = group
        self.node = self.nodes.node_of(group.rank)
        self.is_lead = group.rank == self.nodes.lead(self.node)
        self._held: int | None = None  # this node's directory, locked while the tier lives
        self._created: str | None = None
        claim = self._claim() if self.is_lead else None
        if self.is_lead and (claim is None or claim.locked):  # before the side group's
            self._recover_set_aside()  # rendezvous: no rank of the node surveys yet
        self.group = SideGroup.for_group(group, "local-tier")
        try:  # a directory another live job holds is refused on every rank, untouched
            _check_claims(self.group.all_gather(claim))
        except BaseException:
            self.close()
            raise
        if replicas > self.nodes.count - 1 and self.group.is_coordinator:
            log.warning(
                "dcpbridge: local tier: replicas=%d but only %d other node(s): %d copies of each "
                "part will be kept",
                replicas,
                self.nodes.count - 1,
                min(replicas, self.nodes.count - 1),
            )

    def _claim(self) -> Claim | None:
        """Lead: lock this node's directory (``flock``, released when this process ends,
        however it ends) for the tier's life, so that another job's manager on the same node
        cannot clear, retain or recover its steps while they are written; what it found (None
        where no lock can be taken: a URL, a file system without ``flock``)."""
        location = self._location()
        if not location.is_local:
            return None
        try:
            created = not os.path.isdir(location.root)
            os.makedirs(location.root, exist_ok=True)
            fd = os.open(location.root, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None  # the first save names what is wrong with it
        self._created = location.root if created else None  # removed by ``close`` if empty
        claim = Claim(location.root, self.node, os.fstat(fd).st_ino, True)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            return dataclasses.replace(claim, locked=False) if _held(e) else None
        self._held = fd
        self._release = weakref.finalize(self, _unlock, fd, os.getpid())  # dropped unclosed
        return claim

    @property
    def reader_threads(self) -> int:
        """A restore's reader threads per rank unless the load names them: 4, at most the
        machine's cores per rank of a node (reading node-local files is copying: threads
        beyond the cores only take turns)."""
        return max(1, min(4, (os.cpu_count() or 1) // self.nodes.ranks_per_node))

    # -- locations ----------------------------------------------------------------------------

    def node_dir(self, node: int) -> str:
        """The local directory of ``node`` (``{node}`` in ``local_dir`` replaced)."""
        return self.local_dir.replace("{node}", str(node))

    def step_url(self, step: int, node: int | None = None) -> str:
        """Where ``node``'s (default: this rank's) part of local step ``step`` lives."""
        base = self.node_dir(self.node if node is None else node).rstrip("/")
        return f"{base}/{step_dir_name(step)}"

    def _location(self, step: int | None = None) -> Location:
        url = self.node_dir(self.node) if step is None else self.step_url(step)
        return resolve(url, self.storage_options)

    # -- saving -------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        options: dict[str, Any],
        *,
        behind: bool = False,
        stage_behind: bool = False,
        verify: bool = False,
        committed: Callable[[], None] | None = None,
        persist: PersistJob | None = None,
        hold_caller: bool = True,
    ) -> bool:
        """Write local step ``step``, copy it to other nodes and commit it, then call
        ``committed()`` and upload it as ``persist`` if given. With ``behind`` only the
        planning and the staging (a copy into a reused host buffer) run in the call, and with
        ``stage_behind`` the staging too runs behind (``staging`` says when the caller's
        tensors may change; without ``hold_caller``, once its ``hold_streams`` ran). False
        (with a warning) where a node lacks space or planning failed; later failures are
        logged (and fail ``persist``). The previous local step and the persistent tier always
        stay."""
        self.wait()
        g = self.group
        url = self.step_url(step)
        opts = save_mod.SaveOptions(**options)
        cache = save_cache(g, opts.validate_access_integrity, opts.format)

        def space(parts: SaveParts) -> tuple[int, int | None]:
            return parts_share(parts), free_bytes(self.node_dir(self.node))

        try:  # the space reports travel with the plan's vote: one exchange in the call
            planned = save_mod.plan_save(g, cache, state, opts, report=space)
        except Exception as e:  # raised alike on every rank: all skip this local step
            if protocol.interrupted_ranks(e):  # an interrupted rank raised at once: so do its
                raise  # peers, or their next calls would no longer pair with its
            self._failed(step, e)
            return False
        if self._lacking(step, planned.reports):
            return False
        handle = AsyncSaveHandle(url)
        staging = _Staging(planned, self.area, url, verify, hold_caller) if behind else None
        buffers: list[BufferSet | None] = [None]
        try:
            if staging is not None and planned.error is None:
                staging.begin()
                if not stage_behind:
                    buffers[0] = staging.finish()
                    handle._set_buffers(buffers[0])
        except Exception as e:  # this rank's alone: carried into the write's first step
            planned.error = staging.failed(e) if staging is not None else e
        except BaseException as e:  # interrupted: the peers' writes fail instead of waiting
            planned.error = DistributedCheckpointError(
                f"local step {step} was interrupted while staging ({type(e).__name__})"
            )
            handle._staged.set()
            self._start(  # its upload fails with it, as on the peers
                handle, lambda: self._finish(step, planned, cache, opts, [None], None, persist)
            )
            if persist is not None:  # the caller keeps it pending (see ``interrupted_save``)
                e.dcpbridge_pending = persist.handle  # type: ignore[attr-defined]
            raise
        if not (stage_behind and staging is not None and planned.error is None):
            handle._staged.set()

        def run() -> None:
            try:
                if not handle.staged:
                    assert staging is not None
                    buffers[0] = staging.behind()
                    handle._set_buffers(buffers[0])
            finally:
                handle._staged.set()
            self._finish(step, planned, cache, opts, buffers, committed, persist)

        if behind:
            self._start(handle, run)
        else:
            run()
            handle._finish(None)
        return True

    @property
    def staging(self) -> AsyncSaveHandle | None:
        """The local step in flight (its ``staged`` says whether the caller's tensors it
        saves may change), or None."""
        return self._handle

    def _start(self, handle: AsyncSaveHandle, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            finally:
                handle._finish(None)

        self._handle = handle
        if self._worker is None:  # one thread for every step: no thread start in the call
            self._worker = threading.Thread(target=self._loop, name="dcpb-local-tier", daemon=True)
            self._worker.start()
            LocalTier._behind.add(self)
        self._jobs.put(run)

    def _drain(self) -> None:
        """At exit: wait for the local step in flight (its copies, commit and upload), which
        the daemon thread's end would kill mid-way; its failure is logged where it happens,
        and a dead peer fails it (liveness) rather than hanging the exit."""
        handle = self._handle
        if handle is not None and self._worker is not None and self._pid == os.getpid():
            handle.wait_done()

    def _loop(self) -> None:
        """The tier's thread: run queued local steps in order until ``close`` sends None."""
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except BaseException as e:  # a step logs its own failures; this is a last resort
                log.error("dcpbridge: local tier: a local step crashed: %r", e)

    def _lacking(self, step: int, reports: list[Any]) -> bool:
        """Whether some node lacks space for this step (warned once, by the coordinator)."""
        lacking = lacking_space(
            [r[0] for r in reports], [r[1] for r in reports], self.nodes, self.replicas
        )
        if lacking and self.group.is_coordinator:
            what = ", ".join(
                f"node {n}: {f} bytes free, {need} needed"
                for n, (f, need) in sorted(lacking.items())
            )
            log.warning(
                "dcpbridge: local step %d skipped: not enough space in %s (%s); training "
                "continues, the persistent tier is unaffected",
                step,
                self.local_dir,
                what,
            )
        return bool(lacking)

    def _finish(
        self,
        step: int,
        planned: save_mod.PlannedSave,
        cache: Any,
        opts: save_mod.SaveOptions,
        buffers: list[BufferSet | None],
        committed: Callable[[], None] | None,
        persist: PersistJob | None = None,
    ) -> None:
        """Write the planned step, copy and commit it, then upload it as ``persist``
        (collective on the side group; every failure is logged alike on every rank)."""
        g, url = self.group, self.step_url(step)
        started = time.perf_counter()
        prepared = False  # this node's directory of ``step`` holds nothing older from here on
        try:
            try:
                if buffers[0] is not None:
                    buffers[0].wait_ready()
                protocol.agree(g, "local prepare", lambda: self._on_lead(lambda: self._clear(step)))
                prepared = True
                save_mod.write_planned(g, cache, planned, url, opts, wrap=_columns)
            finally:
                if buffers[0] is not None:
                    self.area.release(buffers[0])
            raw, index = self._replicate(step, time.perf_counter() - started)
        except BaseException as e:  # every rank fails this step alike (protocol steps); a
            # base exception too (a client's CancelledError): its upload must still be finished
            if prepared:  # nothing of it stays, a marker some nodes published least of all
                self._on_lead(lambda: self._discard(step))
            self._on_lead(lambda: self._put_back(step))  # a committed step ``step`` set aside
            self._failed(step, e)
            if persist is not None:
                persist.handle._finish(e)
            if not isinstance(e, Exception) and threading.current_thread() is not self._worker:
                raise  # an interrupt of the caller's own save (no thread behind): its own
            return
        if committed is not None:
            committed()
        if persist is not None:
            upload(g, persist, self._location(step), raw, index)

    def wait(self) -> None:
        """Until the background write, copies, commit (and upload) of the last local step
        are done."""
        if self._handle is not None:
            self._handle.wait_done()
        self._handle = None

    @staticmethod
    def _failed(step: int, error: BaseException) -> None:
        log.warning(
            "dcpbridge: local step %d not committed (the previous local step and the "
            "persistent tier remain): %s",
            step,
            error,
        )

    def _replicate(self, step: int, written: float) -> tuple[bytes, StorageIndex]:
        """Copy this rank's files of written step ``step`` to its targets, receive the copies
        it keeps, and commit the step once all are durable (collective on the side group);
        the step's document and its index."""
        g = self.group
        started = time.perf_counter()
        raw = g.broadcast(protocol.on_coordinator(g, "local document", self._read_document(step)))
        decoded: list[StorageIndex] = []

        def decode() -> None:
            index = decode_metadata(raw, where=self.step_url(step)).storage_data
            if not isinstance(index, StorageIndex):
                raise CorruptCheckpointError(f"{self.step_url(step)}: no dcpbridge storage index")
            decoded.append(index)

        protocol.agree(g, "local document", decode)
        index = decoded[0]
        mine: dict[str, torch.Tensor] = {}

        def read_mine() -> dict[str, int]:
            location = self._location(step)
            store = storage_for(location)
            present = store.file_sizes()
            reads = []
            for name in index.files:
                if writer_rank(name) == g.rank:
                    mine[name] = torch.empty(present.get(name, 0), dtype=torch.uint8)
                    view = memoryview(mine[name].numpy())
                    reads.append(RangeRead(location.data_path(name, index.prefixes), 0, view))
            store.fetch(reads, threads=2)
            return {name: t.numel() for name, t in mine.items()}

        sizes = protocol.agree(g, "local copies: read", read_mine)
        received: dict[str, torch.Tensor] = {}
        # agreed: a rank whose transfer failed must not leave the others waiting for it in
        # the next step (nor meet them in another step of this protocol)
        protocol.agree(
            g, "local copies: send", lambda: received.update(self._send_copies(sizes, mine))
        )
        sent = time.perf_counter()

        def write_received() -> None:
            # nodes whose directories are one folder (no ``{node}`` on a shared file system)
            # write the same files there at once: each commit's temp file is its own
            store = storage_for(self._location(step))
            for name, data in received.items():
                store.commit_file(name, memoryview(data.numpy()), f"{name}.tmp", sync=True)
            if self.is_lead and not store.exists(METADATA_FILE):
                store.commit_file(METADATA_FILE, raw, f"{METADATA_FILE}.tmp", sync=True)

        protocol.agree(g, "local copies: write", write_received)
        marker = json.dumps(
            {
                "step": step,
                "save_id": index.save_id,
                "digest": document_digest(raw),
                "run": self.run,
            },
            sort_keys=True,
        ).encode()
        protocol.agree(
            g,
            "local commit",
            lambda: self._on_lead(
                lambda: storage_for(self._location(step)).commit_file(
                    MARKER, marker, f"{MARKER}.tmp", sync=True
                )
            ),
        )
        done = time.perf_counter()
        log.info(
            "dcpbridge: local step %d committed in %s (write %.3fs, copies %.3fs, commit %.3fs)",
            step,
            self.local_dir,
            written,
            sent - started,
            done - sent,
        )
        self._on_lead(lambda: self._retain(step))
        return raw, index

    def _read_document(self, step: int) -> Callable[[], bytes]:
        def read() -> bytes:
            location = self._location(step)
            return storage_for(location).read_file(location.path(METADATA_FILE))

        return read

    def _send_copies(
        self, sizes: list[dict[str, int]], mine: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """Send this rank's files to its copy targets and receive the files it keeps for
        others (one message per file, tagged by the file's place in the exchange)."""
        g = self.group
        sends, recvs, received = [], [], {}
        tag = 0
        for src, files in enumerate(sizes):
            targets = copy_targets(src, self.nodes, self.replicas)
            for name in sorted(files):
                tag += 1
                for dst in targets:
                    if src == g.rank:
                        sends.append((mine[name], dst, tag))
                    elif dst == g.rank:
                        received[name] = torch.empty(files[name], dtype=torch.uint8)
                        recvs.append((received[name], src, tag))
        g.exchange([s for s in sends if s[0].numel()], [r for r in recvs if r[0].numel()])
        return received

    def _on_lead(self, work: Callable[[], Any]) -> None:
        if self.is_lead:
            work()

    def _discard(self, step: int) -> None:
        """Lead: remove this node's directory of ``step``, whose save failed after the
        directory was cleared for it: its marker first, where some nodes published theirs
        (best effort: the next save's clearing removes what is left)."""
        try:
            remove_step(self._location(step))
        except (CheckpointError, OSError) as e:
            log.warning(
                "dcpbridge: removing failed local step %s failed: %s", self.step_url(step), e
            )

    def _clear(self, step: int) -> None:
        """Lead: remove this node's uncommitted step directories (and steps set aside by
        saves that were killed); set a committed step ``step`` aside, so that it stays until
        the new one commits (``_put_back`` if it fails)."""
        names = storage_for(self._location()).list_names()
        for name in names:  # first: a step is never set aside onto an older copy's folder
            if step_of(name, aside=True) is not None:
                remove_step(resolve(self._entry_url(name), self.storage_options))
        for name in names:
            s = step_of(name)
            if s is None:
                continue
            location = resolve(self.step_url(s), self.storage_options)
            if not storage_for(location).exists(MARKER):
                remove_step(location)
            elif s == step:
                self._rename(name, name + ASIDE)

    def _recover_set_aside(self) -> None:
        """Lead, at start: return each committed step that a killed save of the same step had
        set aside (its new one never committed) to its place (best effort: logged)."""
        try:
            names = storage_for(self._location()).list_names()
            for name in names:
                aside = step_of(name, aside=True)
                if aside is None:
                    continue
                location = resolve(self.step_url(aside), self.storage_options)
                step_dir = step_dir_name(aside)
                if step_dir in names:
                    if storage_for(location).exists(MARKER):
                        continue  # the new one committed: the next retention removes the old
                    remove_step(location)  # what the killed save wrote
                self._rename(name, step_dir)
        except (CheckpointError, OSError) as e:
            log.warning(
                "dcpbridge: local tier: restoring set-aside steps in %s failed: %s",
                self.node_dir(self.node),
                e,
            )

    def _put_back(self, step: int) -> None:
        """Lead: after a failed save of ``step``, return the committed step ``step`` that
        ``_clear`` set aside to its place (best effort: logged)."""
        name = os.path.basename(self.step_url(step))
        try:
            names = storage_for(self._location()).list_names()
            if name + ASIDE in names and name not in names:
                self._rename(name + ASIDE, name)
        except (CheckpointError, OSError) as e:
            log.warning(
                "dcpbridge: restoring committed local step %s failed: %s", self.step_url(step), e
            )

    def _entry_url(self, name: str) -> str:
        return f"{self.node_dir(self.node).rstrip('/')}/{name}"

    def _rename(self, src: str, dst: str) -> None:
        """Lead: rename entry ``src`` of this node's directory to ``dst``."""
        location = self._location()
        store = storage_for(location)
        with storage_faults(f"{location.url}: rename {src} to {dst}", location.fs):
            store.fs.mv(location.path(src), location.path(dst), recursive=True)

    def _retain(self, step: int) -> None:
        """Lead: keep only committed step ``step`` in this node's directory (best effort)."""
        try:
            for name in storage_for(self._location()).list_names():
                s = step_of(name)
                if (s is not None and s != step) or step_of(name, aside=True) is not None:
                    remove_step(resolve(self._entry_url(name), self.storage_options))
        except (CheckpointError, OSError) as e:
            log.warning(
                "dcpbridge: removing older local steps in %s failed: %s",
                self.node_dir(self.node),
                e,
            )

    # -- what the nodes hold ------------------------------------------------------------------

    def holdings(self) -> list[LocalStep]:
        """The committed local steps this rank's node directory holds (checked documents)."""
        try:
            names = storage_for(self._location()).list_names()
        except (CheckpointError, OSError) as e:
            log.warning("dcpbridge: local tier: cannot list %s: %s", self.node_dir(self.node), e)
            return []
        out = []
        for name in names:
            step = step_of(name)
            if step is None:
                continue
            try:
                location = resolve(self.step_url(step), self.storage_options)
                found = held_step(location, self.run, step)
            except (CheckpointError, OSError, ValueError) as e:
                log.warning("dcpbridge: local tier: ignoring %s: %s", self.step_url(step), e)
                continue
            if found is not None:
                held, metadata = found
                self.documents[(held.step, held.digest)] = metadata
                out.append(held)
        return out

    def survey(
        self,
        coordinator: Callable[[], T],
        ahead: Callable[[LocalStep, Metadata], tuple[Any, bool]] | None = None,
    ) -> tuple[list[list[LocalStep]], T]:
        """What every rank's node holds, and ``coordinator()`` (run on the coordinator while
        it looks at its node's directory): one all-gather on the tier's group. With
        ``ahead``, each rank first runs ``ahead(step, document)`` on the newest step its node
        holds (a load's planning: (its result, whether it reads that node's files only), kept
        for ``take_ahead``) and reports whether it reads locally; ``read_locally`` then names
        the step that every rank reads from its own node's directory (else None), alike on
        every rank."""
        self.wait()
        self.documents = {}
        self._ahead = None

        def report() -> tuple[list[LocalStep], StepKey | None, T | None]:
            if not self.group.is_coordinator:
                held = self.holdings()
                return held, self._plan_ahead(held, ahead), None
            with ThreadPoolExecutor(1, thread_name_prefix="dcpb-survey") as pool:
                other = pool.submit(coordinator)
                held = self.holdings()
                mark = self._plan_ahead(held, ahead)
                return held, mark, other.result()

        everyone = protocol.agree(self.group, "local holdings", report)
        marks = {mark for _, mark, _ in everyone}
        self.read_locally = marks.pop() if len(marks) == 1 else None
        return [held for held, _, _ in everyone], everyone[0][2]  # type: ignore[return-value]

    def _plan_ahead(
        self, held: list[LocalStep], ahead: Callable[[LocalStep, Metadata], tuple[Any, bool]] | None
    ) -> StepKey | None:
        """Run ``ahead`` on the newest held step, keep its result; the step's key where this
        rank reads it locally. A failure is only logged: the load plans again in a collective
        step, which raises it on every rank."""
        if ahead is None or not held:
            return None
        newest = max(held, key=lambda s: (s.step, s.save_id, s.digest))
        key = (newest.step, newest.save_id, newest.digest)
        try:
            result, local = ahead(newest, self.documents[(newest.step, newest.digest)])
        except Exception as e:  # planned again (and raised on every rank) by the load
            log.debug("dcpbridge: local step %d: planning ahead failed: %r", newest.step, e)
            return None
        self._ahead = (key, result)
        return key if local else None

    def take_ahead(self, key: StepKey) -> Any | None:
        """The last survey's ``ahead`` result if it planned step ``key``, once."""
        kept, self._ahead = self._ahead, None
        return kept[1] if kept is not None and kept[0] == key else None

    def newest(self, after: int | None, step: int | None = None) -> Recoverable | None:
        """The newest local step at least ``after`` (exactly ``step`` if given) that the ranks
        can recover together (collective: one all-gather of what each node holds)."""
        reports, _ = self.survey(lambda: None)
        return newest_recoverable(reports, METADATA_FILE, after, step)

    def close(self) -> None:
        """Wait for the background copies and commit of the last local step; end the
        tier's thread and release the side group's gloo backend (idempotent)."""
        try:
            self.wait()
        finally:
            worker, self._worker = self._worker, None
            if worker is not None:
                self._jobs.put(None)
                worker.join()
            if isinstance(self.group, SideGroup):
                self.group.close()
            if self._held is not None:
                self._held = None
                if self._created is not None:  # a manager that wrote nothing leaves nothing
                    with contextlib.suppress(OSError):
                        os.rmdir(self._created)
                self._release()  # another job may use the directory from here on


def _drain_tiers_at_exit() -> None:
    """Wait for every local tier's step in flight before the interpreter exits."""
    for tier in list(LocalTier._behind):
        tier._drain()


drain_at_exit(_drain_tiers_at_exit)


def _unlock(fd: int, pid: int) -> None:
    """Release a directory lock and its descriptor: unlocked first, since a forked child (a
    DataLoader worker) shares the locked descriptor and would keep holding it. In such a
    child (not process ``pid``, which locked it) only its copy is closed: an unlock there,
    at its exit, released the lock of the parent, which still uses the directory."""
    try:
        if os.getpid() == pid:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class Claim:
    """A lead's attempt to lock its node's directory: which directory, and whether it got it."""

    root: str
    node: int
    inode: int
    locked: bool


def _held(error: OSError) -> bool:
    """Whether ``flock`` failed because another open description holds the lock."""
    return isinstance(error, BlockingIOError)


def _check_claims(claims: list[Claim | None]) -> None:
    """Raise, on every rank alike, where a lead could not lock its node's directory and no
    lead of this job holds that directory (nodes sharing one folder, on one machine or a
    shared mount: the first lead got it)."""
    ours = {(c.root, c.inode) for c in claims if c is not None and c.locked}
    for c in claims:
        if c is not None and not c.locked and (c.root, c.inode) not in ours:
            raise InvalidArgumentError(
                f"local_dir {c.root} (node {c.node}) is in use by another live "
                "CheckpointManager (another job on this node, or a manager not closed): jobs "
                "that share a node at the same time need their own local_dir"
            )


def _columns(writer: StorageWriter) -> StorageWriter:
    """A local step's document lists its items as packed columns however few: every rank of
    a restore decodes its node's copy (measured, 64 items: 1.8 ms instead of 5.2). Its data
    files stay in the writing ranks' node directories: the commit cannot list them all."""
    if isinstance(writer, FsspecCheckpointWriter):
        writer.columns = True
        writer.check_files = False
    return writer


def held_step(location: Location, run: str, step: int) -> tuple[LocalStep, Metadata] | None:
    """Committed local step ``step`` of ``run`` at ``location`` (its directory) as this node
    holds it, and its decoded document (None: no marker, or a step of another run, left for
    retention to remove); raises if its marker or document is not what a commit writes."""
    store = storage_for(location)
    try:
        marker = json.loads(store.read_file(location.path(MARKER)))
    except FileNotFoundError:
        return None
    except RecursionError as e:  # nested too deep: damaged like any other bad marker
        raise CorruptCheckpointError(f"{location.path(MARKER)} is not a local step marker") from e
    if not isinstance(marker, dict) or not all(
        isinstance(marker.get(k), t) and not isinstance(marker.get(k), bool)
        for k, t in (("step", int), ("save_id", str), ("digest", str))
    ):
        raise CorruptCheckpointError(f"{location.path(MARKER)} is not a local step marker")
    if marker["step"] != step:  # a renamed or copied directory: its files are not where named
        raise CorruptCheckpointError(
            f"{location.path(MARKER)} names step {marker['step']}, not its directory's {step}"
        )
    if marker.get("run") != run:  # another job's (or an older dcpbridge's, which named none)
        log.info(
            "dcpbridge: local tier: ignoring %s: a step of the run at %s, not of %s",
            location.url,
            marker.get("run"),
            run,
        )
        return None
    raw = store.read_file(location.path(METADATA_FILE))
    digest = document_digest(raw)
    if digest != marker["digest"]:
        raise CorruptCheckpointError(f"{location.url}: {METADATA_FILE} does not match {MARKER}")
    metadata = decode_metadata(raw, where=location.path(METADATA_FILE))
    index = metadata.storage_data
    if not isinstance(index, StorageIndex) or index.save_id != marker["save_id"]:
        raise CorruptCheckpointError(f"{location.url}: {MARKER} names another save")
    present = store.file_sizes()
    held = {n: present[n] for n in index.files if n in present}
    held[METADATA_FILE] = len(raw)
    step = LocalStep(marker["step"], index.save_id, digest, len(set(index.files)), held)
    return step, metadata


def remove_step(location: Location) -> None:
    """Delete a local step directory, its marker first, so it never looks committed half-gone."""
    store: Storage = storage_for(location)
    with contextlib.suppress(FileNotFoundError):
        if store.exists(MARKER):
            store.remove([MARKER])
    with storage_faults(f"{location.url}: remove"):
        store.remove_folder()


def check_local_args(local_every: Any, replicas: Any, ranks_per_node: Any) -> tuple[int, int, int]:
    """Validated (local_every, replicas, ranks_per_node); ranks_per_node None reads torchrun's
    ``LOCAL_WORLD_SIZE`` (1 without it)."""
    if ranks_per_node is None:
        raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
        try:
            ranks_per_node = int(raw)
        except ValueError:
            raise InvalidArgumentError(f"LOCAL_WORLD_SIZE must be an int, got {raw!r}") from None
    for name, value, low in (
        ("local_every", local_every, 1),
        ("replicas", replicas, 0),
        ("ranks_per_node", ranks_per_node, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidArgumentError(f"{name} must be an int >= {low}, got {value!r}")
    return local_every, replicas, ranks_per_node
