"""``CheckpointManager``: a training loop's checkpoints (interval, retention, resume, preemption).

Checkpoints live in ``root/step_00000100`` style directories (local disk, S3 or any fsspec URL).
A step is complete only once its commit file (``dcpbridge.json``, written last by the storage
layer) exists: ``latest_step`` / ``all_steps`` see complete steps only, and the directories of
saves that never committed (holding only what a save writes) are removed once a newer step
commits (a newer one may be another job's save in flight) or their step is saved again.
Retention runs only
after a commit and never removes the newest complete checkpoint. Deleting a checkpoint removes
its commit file first, so a half-deleted directory never looks complete.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dcpbridge.engine import load as load_mod
from dcpbridge.engine import protocol
from dcpbridge.engine import save as save_mod
from dcpbridge.engine.async_save import AsyncSaveHandle
from dcpbridge.engine.collectives import Group
from dcpbridge.engine.gc_pause import gc_paused
from dcpbridge.engine.incremental import (
    child,
    is_link,
    refuse_if_referenced,
    remove_checkpoints,
)
from dcpbridge.engine.local_persist import PersistJob
from dcpbridge.engine.local_plan import Recoverable, newest_recoverable
from dcpbridge.engine.local_restore import open_local_step, planning_ahead
from dcpbridge.engine.local_tier import LocalTier, check_local_args, run_of
from dcpbridge.engine.retention import (
    SIDECAR,
    Retention,
    committed_anyway,
    plain_metrics,
    read_sidecar,
    replaced,
    stored_metric,
)
from dcpbridge.engine.step_agreement import agreed_newest, choose_step
from dcpbridge.engine.step_guard import StepGuard
from dcpbridge.engine.step_names import step_dir_name, step_of
from dcpbridge.engine.strict import Policy, parse_strict
from dcpbridge.engine.writer_process import check_writer
from dcpbridge.errors import (
    CheckpointError,
    CorruptCheckpointError,
    InvalidArgumentError,
    NotACheckpointError,
    UnsafePathError,
)
from dcpbridge.formats.config import Config, load_config, resolve_storage_options
from dcpbridge.planners import StrictMode
from dcpbridge.storage import METADATA_FILE, Location, resolve
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.format.document import DATA_FILE_RE
from dcpbridge.storage.write.reuse import Previous

log = logging.getLogger("dcpbridge")
F = TypeVar("F", bound=Callable[..., Any])

MAX_STEP = 10**18 - 1
"""The largest step a manager saves: its folder name must read back (at most 18 digits)."""
_NEEDS_OPTIMIZERS = (
    "background_staging needs the optimizers that change the saved state: "
    "CheckpointManager(..., optimizers=[opt]) or mgr.watch(opt)"
)


class _OneThread:
    """Which thread is inside a manager's call: a second thread's call meanwhile is refused
    (the manager's state, its pending save above all, is one thread's); the same thread may
    enter again (an ``on_commit`` that saves)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: threading.Thread | None = None
        self._depth = 0

    @contextlib.contextmanager
    def enter(self, call: str) -> Iterator[None]:
        me = threading.current_thread()
        with self._lock:
            owner = self._owner
            if owner is not None and owner is not me:
                raise InvalidArgumentError(
                    f"CheckpointManager.{call}() called from thread {me.name!r} while thread "
                    f"{owner.name!r} is inside a call of the same manager: a manager is not "
                    "thread-safe; make its calls from one thread at a time"
                )
            self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None


def _one_thread(method: F) -> F:
    """Refuse a call while another thread is inside a call of the same manager."""

    @functools.wraps(method)
    def guarded(self: CheckpointManager, *args: Any, **kwargs: Any) -> Any:
        with self._calls.enter(method.__name__):
            return method(self, *args, **kwargs)

    return guarded  # type: ignore[return-value]


class CheckpointManager:
    """Save every ``every`` steps under ``root``, keep some, resume from the newest complete one.

    Every rank of ``process_group`` makes the same calls (``save``, ``load``, ``latest_step``,
    ``wait``, ``close``, ``should_stop``). Arguments left as None take the configuration file's
    ``checkpoint:`` defaults (``dcpbridge.formats.config.CheckpointDefaults``); storage options
    come from ``storage_options`` over ``profile`` (or the file's default profile).

    With ``async_save``, ``save`` returns once the state is staged in host memory; the next
    saving ``save``, ``wait``, ``load`` or ``close`` first waits for that commit and raises its
    failure, on every rank (and then starts nothing). With ``background_staging`` too, ``save``
    returns at once and stages on a thread: the next ``step()`` of each optimizer given in
    ``optimizers`` (or to ``watch``) first waits until staging is done; ``verify_staging``
    fails the save (``StagingMutationError``) if a saved tensor changed before that.
    ``writer`` chooses who writes async saves' data files (see ``async_save``): "auto" (the
    default) a writer process where it can, "process" always, "thread" this process; sync
    saves and the local tier always write in this process. With a local tier (``local_dir``)
    and ``persist_behind``, a persistent step that is also a local step is uploaded from the
    local step's files behind the loop instead of being staged and written again. Retention
    and the removal of uncommitted directories run on the group's rank 0 after a commit; a
    failure to delete is logged, never raised (the new checkpoint is safe).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        every: int | None = None,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        fully_parallel: bool | None = None,
        *,
        profile: str | None = None,
        config: Config | str | os.PathLike[str] | None = None,
        local_dir: str | os.PathLike[str] | None = None,
        local_every: int = 1,
        replicas: int = 1,
        ranks_per_node: int | None = None,
        on_commit: Callable[[int, str, str], Any] | None = None,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        background_staging: bool = False,
        verify_staging: bool = False,
        writer: str = "auto",
        incremental: bool = False,
        persist_behind: bool = False,
    ) -> None:
        self._calls = _OneThread()  # the thread inside a call (see ``_one_thread``)
        cfg = config if isinstance(config, Config) else load_config(config)
        defaults = cfg.checkpoint
        self.every = _positive("every", defaults.every if every is None else every)
        if keep_last is None and keep_best is None:
            keep_last = defaults.keep_last
        keep_every = defaults.keep_every if keep_every is None else keep_every
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None:
                _positive(name, value)
        if keep_best is not None:
            _positive("keep_best", keep_best)
            if not best_metric:
                raise InvalidArgumentError("keep_best needs best_metric (the name of a metric)")
        if best_mode not in ("min", "max"):
            raise InvalidArgumentError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        self.retention = Retention(keep_last, keep_every, keep_best, best_mode)
        self.best_metric = best_metric
        self.async_save = defaults.async_save if async_save is None else async_save
        self.fully_parallel = defaults.fully_parallel if fully_parallel is None else fully_parallel
        self.threads, self.checksums = defaults.threads, defaults.checksums
        self.root = os.fspath(root)
        if not self.root:
            raise InvalidArgumentError("CheckpointManager needs a root directory or URL")
        self.storage_options = resolve_storage_options(storage_options, profile, cfg, url=self.root)
        self.process_group = process_group
        self._group = Group.resolve(process_group)
        self._pending: tuple[int, AsyncSaveHandle] | None = None
        self._metrics: dict[int, float | None] = {}
        # rank 0: the sidecar (None: none) of each step being saved, put back if that save
        # fails, so a committed step keeps its own metrics and a new one leaves nothing
        self._resaved: dict[int, bytes | None] = {}
        self._signals: dict[int, Any] = {}  # signal -> the handler it replaced
        self._state_fn: Callable[[], tuple[int, Any]] | None = None
        self._received: int | None = None
        self._stop = False
        self._final_saved = False
        self.on_commit = on_commit
        self._local: LocalTier | None = None
        self.local_every = local_every
        if local_dir is not None:
            self.local_every, replicas, ranks_per_node = check_local_args(
                local_every, replicas, ranks_per_node
            )
            if not os.fspath(local_dir):
                raise InvalidArgumentError("local_dir must name a directory")
            self._local = LocalTier(
                os.fspath(local_dir),
                self._group,
                replicas=replicas,
                ranks_per_node=ranks_per_node,
                run=run_of(self.root),
            )
        if persist_behind and self._local is None:
            raise InvalidArgumentError("persist_behind uploads local steps: it needs local_dir")
        self.persist_behind = persist_behind
        self.background_staging, self.verify_staging = background_staging, verify_staging
        check_writer(writer, "dcpbridge")
        self.writer = writer
        if incremental and not self.checksums:  # else only the second save would fail
            raise InvalidArgumentError(
                "incremental=True needs checksums (they decide what is reused): the "
                "configuration file's checkpoint section sets checksums: false"
            )
        self.incremental = incremental  # reference chunks equal to the previous step's
        self._previous: int | None = None  # the newest committed step (incremental saves)
        self._guard = StepGuard(self._in_flight)
        for optimizer in optimizers:
            self.watch(optimizer)

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer.step()`` wait until a background-staged save has its copy."""
        self._guard.watch(optimizer)

    # -- locations ----------------------------------------------------------------------------

    def step_url(self, step: int) -> str:
        """Where checkpoint ``step`` lives."""
        return f"{self.root.rstrip('/')}/{step_dir_name(step)}"

    def _location(self, step: int | None = None) -> Location:
        return resolve(self.root if step is None else self.step_url(step), self.storage_options)

    def _scan(self) -> tuple[list[int], list[int]]:
        """(complete steps, steps without a commit), ascending; a storage fault raises."""
        names = storage_for(self._location()).list_names()
        steps = sorted(s for n in names if (s := step_of(n)) is not None)
        complete, partial = [], []
        for step in steps:
            store = storage_for(self._location(step))
            if store.exists(METADATA_FILE):
                complete.append(step)
            elif not _foreign(store.list_names()):  # a killed save's leftovers
                partial.append(step)
            # else another format's checkpoint or others' files: never the manager's to remove
        return complete, partial

    def _complete(self) -> list[int]:
        """The complete steps, ascending (``_scan``'s first list)."""
        return self._scan()[0]

    def _committed_here(self, step: int) -> bool:
        """Whether this rank sees step ``step``'s commit file."""
        return storage_for(self._location(step)).exists(METADATA_FILE)

    def _wait_pending(self) -> None:
        """Wait for this manager's save in flight, if any (its failure is raised later, by the
        next ``save``/``wait``/``close``)."""
        if self._pending is not None:
            self._pending[1].wait_done()

    @_one_thread
    def all_steps(self) -> list[int]:
        """The complete checkpoints, ascending (a save of this manager in flight is waited for
        first; its failure is raised by the next ``save``/``wait``/``close``)."""
        self._wait_pending()
        return self._complete()

    @_one_thread
    def latest_step(self) -> int | None:
        """The newest complete checkpoint that every rank sees committed, or None (collective
        in a group); with a local tier, the newer of the persistent one and the newest local
        step the ranks can recover."""
        if self._local is None:
            self._wait_pending()
            return agreed_newest(
                self._group,
                self._agree(self._complete),
                self._complete,
                self._committed_here,
                self.root,
            )
        complete, local = self._survey(None)
        persistent = complete[-1] if complete else None
        return local.step if local is not None else persistent

    # -- saving -------------------------------------------------------------------------------

    @_one_thread
    def save(
        self,
        step: int,
        state: Any,
        *,
        force: bool = False,
        metrics: Mapping[str, Any] | None = None,
    ) -> bool:
        """Save ``state`` as ``step`` when ``step % every == 0`` (or ``force``, or a signal of
        ``save_on_signal`` arrived on any rank); True if it saved."""
        _check_step(step)
        preempted = self._agree_on_signal() if self._signals else False
        if preempted and self._final_saved:
            return False
        persist = force or preempted or step % self.every == 0
        local = self._local is not None and not preempted and step % self.local_every == 0
        if not (persist or local):
            return False
        behind = persist and local and self.persist_behind  # uploaded from the local step
        if persist and not (behind and self._save_local(step, state, metrics, persist=True)):
            self._persist(step, state, metrics, preempted)
        if local and not behind:
            self._save_local(step, state)
        return True

    @property
    def saving(self) -> bool:
        """Whether a save of this manager (either tier) is still in flight."""
        return any(not handle.done() for handle in self._in_flight())

    def _in_flight(self) -> list[AsyncSaveHandle]:
        """The saves whose staging a watched optimizer's step waits for."""
        local = self._local.staging if self._local is not None else None
        pending = self._pending[1] if self._pending else None
        return [h for h in (local, pending) if h is not None]

    def _save_local(
        self, step: int, state: Any, metrics: Mapping[str, Any] | None = None, persist: bool = False
    ) -> bool:
        """The local step ``step`` (with ``persist``, uploaded as the persistent one behind
        it); False if it was skipped."""
        assert self._local is not None
        stage_behind = self.async_save and self.background_staging
        if stage_behind and not self._guard.watching:
            raise InvalidArgumentError(_NEEDS_OPTIMIZERS)
        job = None
        if persist:
            self._finish_pending()
            job = PersistJob.new(
                self.step_url(step), self._location(step), self._prepare(step, metrics, behind=True)
            )
        options = dict(
            thread_count=self.threads, checksums=True, fully_parallel=self.fully_parallel
        )
        url = self._local.step_url(step, node=0)
        try:
            saved = self._local.save(
                step,
                state,
                options,
                behind=self.async_save,
                stage_behind=stage_behind,
                verify=self.verify_staging,
                committed=lambda: self._notify(step, "local", url),
                persist=job,
                hold_caller=not stage_behind,
            )
        except BaseException as e:  # interrupted while staging: the upload fails behind, and
            left = save_mod.interrupted_save(e)  # the next call raises it, as on the peers
            if job is not None and left is job.handle:
                self._pending = (step, left)
            raise
        if saved and job is not None:
            self._pending = (step, job.handle)
            if not self.async_save:
                self.wait()
        return saved

    def _notify(self, step: int, tier: str, url: str) -> None:
        """Call ``on_commit(step, tier, url)`` on rank 0; its exceptions are logged only, base
        exceptions too (an ``asyncio.CancelledError``: raised here it would leave the other
        ranks waiting, or skip the upload behind a local commit), except an interrupt or
        exit in the main thread."""
        if self.on_commit is None or not self._group.is_coordinator:
            return
        try:
            self.on_commit(step, tier, url)
        except BaseException as e:
            stop = isinstance(e, (KeyboardInterrupt, SystemExit))
            if stop and threading.current_thread() is threading.main_thread():
                raise
            log.warning("dcpbridge: on_commit(%d, %r, %r) failed: %r", step, tier, url, e)

    def _persist(
        self, step: int, state: Any, metrics: Mapping[str, Any] | None, preempted: bool
    ) -> None:
        """The persistent save of ``step`` (async unless preempted)."""
        background = self.async_save and self.background_staging and not preempted
        if background and not self._guard.watching:
            raise InvalidArgumentError(_NEEDS_OPTIMIZERS)
        self._finish_pending()
        url = self.step_url(step)
        options = dict(
            process_group=self.process_group,
            storage_options=self.storage_options,
            fully_parallel=self.fully_parallel,
            thread_count=self.threads,
            checksums=self.checksums,
        )
        if self.incremental:  # before the sidecar is written: its failure leaves nothing
            options["reuse_from"] = self._reuse_from(step)
        prepare = self._prepare(step, metrics, behind=background)
        if self.async_save and not preempted:
            try:
                with self._unprepared_on_failure(step):
                    handle = save_mod.async_save(
                        state,
                        url,
                        background_staging=background,
                        verify_staging=self.verify_staging,
                        before_write=prepare,
                        writer=self.writer,
                        defer_stream_wait=background,
                        **options,
                    )
            except BaseException as e:  # interrupted while staging: the save still runs to its
                left = save_mod.interrupted_save(e)  # failure, which the next call raises here
                if left is not None:  # as on the peers (else their calls no longer pair)
                    self._pending = (step, left)
                raise
            self._pending = (step, handle)
            return
        with self._unprepared_on_failure(step):
            save_mod.save(state, url, **options)
        self._resaved.pop(step, None)
        self._committed(step)
        log.info("dcpbridge: checkpoint of step %d committed at %s", step, url)
        self._after_commit()
        self._notify(step, "persistent", url)
        self._settle()
        if preempted:
            self._final_saved = True

    def _prepare(
        self, step: int, metrics: Mapping[str, Any] | None, *, behind: bool = False
    ) -> Callable[[], None] | None:
        """Rank 0 clears leftovers of a killed save of ``step`` and records its metrics; the
        outcome reaches every rank before anyone writes. With ``behind``, only the metrics are
        checked here; the rest is returned, for the background save to run first."""

        def check() -> tuple[float | None, dict[str, float]]:
            plain = plain_metrics(metrics)  # raises for a value that is no number
            return self._metric(plain), plain

        def run(value: float | None, plain: dict[str, float]) -> None:
            location = self._location(step)
            store = storage_for(location)
            doc: dict[str, Any] = {"step": step, "metrics": plain}
            if is_link(location):  # another place's folder: a save must not write into it
                raise InvalidArgumentError(
                    f"{location.url}: {step_dir_name(step)} is a symbolic link to a folder "
                    "elsewhere; remove the link or save under another step"
                )
            if store.exists(METADATA_FILE):  # a re-save: never under steps that reference it
                names = [step_dir_name(s) for s in self._complete()] + self._others()
                refuse_if_referenced(self._location(), step_dir_name(step), names)
                kept = read_sidecar(store, location)
                self._resaved[step] = kept
                doc["over"] = replaced(store, kept)
            else:  # a new step: its sidecar goes if the save fails (rule 3)
                if names := store.list_names():
                    self._clear_leftovers(step, names)
                self._resaved[step] = None
            store.makedirs()
            raw = json.dumps(doc, sort_keys=True).encode()
            store.commit_file(SIDECAR, raw, f"{SIDECAR}.tmp", sync=True)
            self._metrics[step] = value

        if not behind:
            protocol.on_coordinator(self._group, "prepare", lambda: run(*check()))
            return None
        if metrics is None and self.retention.keep_best is None:  # nothing to check: no exchange
            return lambda: run(None, {})
        checked = protocol.on_coordinator(self._group, "prepare", check)
        return (lambda: run(*checked)) if checked is not None else (lambda: None)

    def _clear_leftovers(self, step: int, names: list[str]) -> None:
        """Rank 0: remove what a killed save left in new step ``step``'s folder (``names``),
        keeping what the complete steps reference; where their documents cannot tell, nothing
        is removed (the leftovers' own save id keeps them apart from this save's files)."""
        foreign = _foreign(names)
        if foreign:
            raise InvalidArgumentError(
                f"{self.step_url(step)} holds files no save of a manager writes "
                f"({', '.join(repr(n) for n in foreign[:5])}: another format's checkpoint?); "
                "move them away or save under another step"
            )
        try:
            self._remove_steps([step], self._complete(), [step])
        except CorruptCheckpointError as e:
            log.warning(
                "dcpbridge: leaving what a killed save left in %s: %s", self.step_url(step), e
            )

    def _metric(self, metrics: Mapping[str, Any] | None) -> float | None:
        if self.retention.keep_best is None:
            return None
        if not metrics or self.best_metric not in metrics:
            raise InvalidArgumentError(
                f"keep_best ranks checkpoints by {self.best_metric!r}: pass "
                f"save(..., metrics={{{self.best_metric!r}: value}})"
            )
        return float(metrics[self.best_metric])

    def _finish_pending(self) -> bool:
        """Wait for the background save; raise its failure (every rank) or run retention.
        True if a save was waited for. A save that ``on_commit`` started meanwhile is the
        pending one then: it is finished too, before anything else starts or ``close`` ends."""
        waited = False
        while self._pending is not None:
            step, handle = self._pending
            handle.wait_done()  # interrupted (Ctrl-C): the save is still pending, not failed
            self._pending = None
            with self._unprepared_on_failure(step):
                handle.result()
            self._resaved.pop(step, None)
            self._committed(step)
            log.info(
                "dcpbridge: checkpoint of step %d committed at %s", step, handle.checkpoint_dir
            )
            self._after_commit()
            self._notify(step, "persistent", handle.checkpoint_dir)
            waited = True
        return waited

    @contextlib.contextmanager
    def _unprepared_on_failure(self, step: int) -> Iterator[None]:
        """Run a save of ``step``; if it raises, ``_unprepare`` it first."""
        try:
            yield
        except BaseException:
            self._unprepare(step)
            raise

    def _unprepare(self, step: int) -> None:
        """Rank 0, after a failed save of ``step``: put its sidecar back (the failed save
        wrote its own metrics there; a committed step holds the old save, whose metrics
        retention must rank), or remove it (a new step). A failure to do so is logged."""
        if step not in self._resaved:
            return
        kept = self._resaved.pop(step)
        self._metrics.pop(step, None)  # read again from the sidecar when retention needs it
        try:
            store = storage_for(self._location(step))
            if committed_anyway(store, self._location(step), kept):
                log.warning(
                    "dcpbridge: the save of step %d committed before it failed (its answer "
                    "was lost): the step is complete, its metrics stay with it",
                    step,
                )
                return
            if kept is None:
                store.remove([SIDECAR])
                if not store.list_names():  # a new step's folder, nothing else written there
                    store.remove_folder()
            else:
                store.commit_file(SIDECAR, kept, f"{SIDECAR}.tmp", sync=True)
        except FileNotFoundError:  # the folder is gone (another manager's cleanup): nothing left
            pass
        except Exception as e:
            log.warning("dcpbridge: restoring %s of step %d failed: %s", SIDECAR, step, e)

    def _settle(self) -> None:
        """Every rank waits until rank 0's retention is done, so all see the same steps."""
        self._group.broadcast(None)

    def _after_commit(self) -> None:
        """Rank 0: apply retention and remove the uncommitted step directories older than the
        newest complete step (a newer one may be another job's save in flight: an old job
        still running beside its restart is ahead of it)."""
        if not self._group.is_coordinator:
            return
        try:
            complete, partial = self._scan()
            metric = {s: self._stored_metric(s) for s in complete} if self.best_metric else {}
            keep = self.retention.keep(complete, metric)
            dead = [s for s in partial if complete and s < complete[-1]]
            doomed = [s for s in complete if s not in keep] + dead
            self._remove_steps(doomed, [s for s in complete if s in keep], dead)
            for step in doomed:
                self._metrics.pop(step, None)
        except Exception as e:  # the new checkpoint is committed: leftovers only waste space
            log.warning("dcpbridge: retention in %s failed: %s", self.root, e)

    def _remove_steps(self, doomed: list[int], kept: list[int], uncommitted: list[int]) -> None:
        """Delete steps ``doomed``, keeping the files the committed steps ``kept`` and the
        other checkpoints under the root reference (read from their commit files: incremental
        saves share files between steps); one of ``uncommitted`` committed since is kept."""
        names = [step_dir_name(s) for s in kept] + self._others()
        remove_checkpoints(
            self._location(),
            [step_dir_name(s) for s in doomed],
            names,
            uncommitted=[step_dir_name(s) for s in uncommitted],
        )

    def _others(self) -> list[str]:
        """Committed checkpoints under the root that are not steps (a ``db.save`` beside them
        may reference a step's files with ``reuse_from``)."""
        out = []
        root = self._location()
        for name in storage_for(root).list_names():
            if step_of(name) is not None:
                continue
            try:
                location = child(root, name)
            except UnsafePathError:  # no reference can name it
                continue
            if storage_for(location).exists(METADATA_FILE):
                out.append(name)
        return out

    def _committed(self, step: int) -> None:
        """Record the commit of ``step`` for incremental saves: the newest complete step stays
        the one referenced (retention may remove a step saved below it, after a rollback)."""
        if self._previous is not None:
            self._previous = max(self._previous, step)

    def _reuse_from(self, step: int) -> str | None:
        """The step an incremental save of ``step`` references: the newest committed one whose
        document reads (rank 0's view of storage, agreed once; then the newest commit of this
        manager, while rank 0 still sees it committed: a step removed meanwhile, by hand or by
        another manager's retention, would fail every later save)."""
        if self._previous is None:
            self._previous = self._agree(self._newest_readable)
        elif self._previous >= 0:
            self._previous = self._agree(functools.partial(self._still_complete, self._previous))
        previous = self._previous
        return None if previous < 0 or previous == step else self.step_url(previous)

    def _still_complete(self, step: int) -> int:
        """``step`` if its commit document still reads, else the newest readable step (-1): a
        step damaged or removed meanwhile is skipped with a warning (it failed every later
        save; with no other step, the save writes everything)."""
        try:
            Previous.open(self._location(step))
        except CheckpointError as e:
            log.warning("dcpbridge: incremental saves skip step %d: %s", step, e)
            return self._newest_readable(skipped=step)
        return step

    def _newest_readable(self, skipped: int | None = None) -> int:
        """The newest complete step whose commit document an incremental save can read (-1:
        none); a damaged one is skipped with a warning, so it never fails every later save
        (``skipped``: one found unreadable already, warned about)."""
        for step in reversed(self._complete()):
            if step == skipped:
                continue
            try:
                Previous.open(self._location(step))
            except CheckpointError as e:
                log.warning("dcpbridge: incremental saves skip step %d: %s", step, e)
                continue
            return step
        return -1

    def _stored_metric(self, step: int) -> float | None:
        """``best_metric`` of ``step`` from its sidecar (untrusted: anything odd is None); the
        metrics of the commit a re-save was written over while that commit is still there. A
        storage fault raises: retention then deletes nothing rather than rank ``step`` as
        having no metric."""
        if step not in self._metrics:
            self._metrics[step] = stored_metric(self._location(step), self.best_metric)
        return self._metrics[step]

    @_one_thread
    def wait(self) -> None:
        """Block until the pending background save is committed (raises its failure) and
        the local step's copies and commit are done."""
        if self._local is not None:
            self._local.wait()
        if self._finish_pending():
            self._settle()

    # -- loading ------------------------------------------------------------------------------

    @_one_thread
    def load(self, template: Any, step: int | None = None, **kwargs: Any) -> Any:
        """Load ``step`` (default: the newest complete one every rank sees committed) into
        ``template``, in any layout or world size; ``kwargs`` go to ``dcpbridge.load``."""
        _check_load_options(kwargs)
        if step is not None:
            _check_step(step)
        self._finish_pending()
        if self._local is not None:
            return self._load_either(template, step, kwargs)
        chosen = choose_step(
            self._group, step, self.root, self._complete, self._committed_here, self.step_url
        )
        return self._load_persistent(template, chosen, kwargs)

    def _load_persistent(self, template: Any, step: int, kwargs: dict[str, Any]) -> Any:
        kwargs.setdefault("storage_options", self.storage_options)
        return load_mod.load(
            template, self.step_url(step), process_group=self.process_group, **kwargs
        )

    def _agree(self, work: Callable[[], Any]) -> Any:
        """``work()`` run on rank 0, its result on every rank (its failure raised on all)."""
        size = self._group.size
        return protocol.decide(self._group, "agree", lambda: None, lambda _: [work()] * size)

    def _load_either(self, template: Any, step: int | None, kwargs: dict[str, Any]) -> Any:
        """Load ``step`` (default: the newest of both tiers) from the local tier where the
        ranks can recover it, else from the persistent tier, logging which and why."""
        assert self._local is not None
        strict, options = _local_load_options(kwargs)
        ahead = planning_ahead(
            self._local,
            template,
            strict=strict,
            allow_pickle=options.get("allow_pickle", False),
            allow_dtype_cast=options.get("allow_dtype_cast", False),
        )
        complete, local = self._survey(step, ahead)
        if step is not None and step in complete:
            local = None
            why = f"step {step} is in the persistent tier"
        else:
            why = (
                "no complete local step newer than the persistent tier's"
                if step is None
                else f"the local tier cannot recover step {step}"
            )
        if local is not None:
            try:
                return self._load_local_or_copies(template, local, kwargs)
            except CheckpointError as e:
                if step is not None or not complete:
                    raise
                why = f"local step {local.step} could not be restored: {e}"
        if step is None:
            if not complete:
                raise NotACheckpointError(
                    f"{self.root}: no complete checkpoint (step_*) and no recoverable local step"
                )
            step = complete[-1]
        elif step not in complete:
            raise NotACheckpointError(f"step {step} is in neither tier ({why})")
        asked = local is None and why == f"step {step} is in the persistent tier"  # no fallback
        log.log(
            logging.INFO if asked else logging.WARNING,
            "dcpbridge: loading persistent step %d from %s (%s)",
            step,
            self.root,
            why,
        )
        return self._load_persistent(template, step, kwargs)

    def _survey(self, step: int | None, ahead: Any = None) -> tuple[list[int], Recoverable | None]:
        """The complete persistent steps (rank 0's listing, made while it looks at its node's
        local directory) and the newest local step the ranks can recover that is newer
        (exactly ``step`` if given and not persistent): one all-gather in all (``ahead``: a
        load's planning, run before it, as ``LocalTier.survey`` runs it)."""
        assert self._local is not None
        self._wait_pending()
        reports, complete = self._local.survey(self._complete, ahead)
        if step is not None and step in complete:
            return complete, None
        after = (complete[-1] if complete else None) if step is None else step
        return complete, newest_recoverable(reports, METADATA_FILE, after, step)

    def _load_local_or_copies(
        self, template: Any, chosen: Recoverable, kwargs: dict[str, Any]
    ) -> Any:
        """Load local step ``chosen``; where a part fails verification, once more, the ranks
        that failed reading every file from another node's copy where one exists."""
        assert self._local is not None
        try:
            out = self._load_local(template, chosen, kwargs)
        except CorruptCheckpointError as e:
            log.warning(
                "dcpbridge: local step %d failed verification (%s); reading it from the copies "
                "on other nodes",
                chosen.step,
                e,
            )
            failed = protocol.failed_ranks(e)
            mine = failed is None or self._local.group.rank in failed
            out = self._load_local(template, chosen, kwargs, retry=True, failed=mine)
            log.info("dcpbridge: loaded step %d from the local tier's copies", chosen.step)
            return out
        log.info("dcpbridge: loaded step %d from the local tier", chosen.step)
        return out

    @gc_paused
    def _load_local(
        self,
        template: Any,
        chosen: Recoverable,
        kwargs: dict[str, Any],
        *,
        retry: bool = False,
        failed: bool = True,
    ) -> Any:
        assert self._local is not None
        strict, options = _local_load_options(kwargs)
        opened = open_local_step(
            self._local,
            chosen,
            template,
            strict=strict,
            allow_pickle=options.get("allow_pickle", False),
            allow_dtype_cast=options.get("allow_dtype_cast", False),
            retry=retry,
            failed=failed,
            thread_count=options.get("thread_count", self._local.reader_threads),
            reshard_data_state=options.get("reshard_data_state", "raise"),
        )
        if opened.planner is not None:  # planned and checked on every rank while opening
            assert opened.plan is not None and opened.reader is not None
            return load_mod.load_planned(
                template,
                opened.checkpoint,
                self._local.group,
                opened.planner,
                opened.plan,
                opened.reader,
            )
        return load_mod.load_opened(
            template, opened.checkpoint, self._local.training, strict=strict, **options
        )

    # -- preemption ---------------------------------------------------------------------------

    def save_on_signal(
        self, signum: int = signal.SIGTERM, state_fn: Callable[[], tuple[int, Any]] | None = None
    ) -> None:
        """Write one final checkpoint when ``signum`` arrives (e.g. a scheduler's SIGTERM).

        The handler only records the signal. The next ``save`` or ``should_stop`` call agrees
        on it across ranks (one tiny all_gather per call, so every rank must make the same
        calls): if any rank received it, every rank saves together, ``save`` with its own
        state, ``should_stop`` with ``state_fn() -> (step, state)``, and ``should_stop`` then
        returns True on every rank. Call it from the main thread.
        """
        if signum not in self._signals:
            try:
                self._signals[signum] = signal.signal(signum, self._on_signal)
            except (ValueError, OSError, TypeError) as e:  # a bad number, not the main thread
                raise InvalidArgumentError(
                    f"save_on_signal cannot handle signal {signum!r} here: {e}"
                ) from e
        if state_fn is not None:
            self._state_fn = state_fn

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._received = signum

    def _agree_on_signal(self) -> bool:
        if not self._stop:
            self._stop = any(self._group.all_gather(self._received is not None))
            if self._stop:
                log.warning("dcpbridge: stop signal received; writing a final checkpoint")
        return self._stop

    @_one_thread
    def should_stop(self) -> bool:
        """Whether a ``save_on_signal`` signal arrived on any rank (collective); the first
        time it is True, the final checkpoint of ``state_fn()`` is written first (unless a
        ``save`` already wrote it). Without ``save_on_signal`` it is False, with no collective."""
        if not self._signals or not self._agree_on_signal():
            return False
        if not self._final_saved:
            if self._state_fn is None:
                raise InvalidArgumentError("should_stop needs save_on_signal(..., state_fn)")
            step, state = self._state_fn()
            self.save(step, state, force=True)
        return True

    # -- lifetime -----------------------------------------------------------------------------

    @_one_thread
    def close(self) -> None:
        """Wait for the pending save (raising its failure), restore signal handlers and stop
        watching optimizers. With ``save_on_signal``'s handlers, call it from the main thread
        (only it can restore them): elsewhere it raises ``InvalidArgumentError`` at once."""
        if self._signals and threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError(
                "close() restores the handlers save_on_signal installed, which only the main "
                "thread can do: call it from the main thread"
            )
        try:
            if self._local is not None:
                self._local.close()
            if self._finish_pending():
                self._settle()
        finally:
            self._guard.close()
            for signum, previous in self._signals.items():
                signal.signal(signum, previous)
            self._signals.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # do not hide the original error behind a save failure
            try:
                self.close()
            except Exception as e:
                log.warning("dcpbridge: pending checkpoint failed too: %s", e)


_LOAD_OPTIONS = frozenset(inspect.signature(load_mod.load).parameters) - {
    "sharded_state_dict",
    "checkpoint_dir",
    "process_group",
}


def _check_load_options(kwargs: Mapping[str, Any]) -> None:
    """Raise for options ``dcpbridge.load`` does not take: a misspelt one must fail alike
    whichever tier answers (the local tier's load took only those it uses, ignoring the
    rest)."""
    unknown = sorted(set(kwargs) - _LOAD_OPTIONS)
    if unknown:
        raise InvalidArgumentError(
            f"CheckpointManager.load() got unknown options {unknown} "
            f"(it takes {sorted(_LOAD_OPTIONS)})"
        )


def _local_load_options(kwargs: dict[str, Any]) -> tuple[Policy, dict[str, Any]]:
    """The strict policy and the other options of ``load`` that a local-tier load takes."""
    known = {"strict", "allow_pickle", "allow_dtype_cast", "thread_count", "reshard_data_state"}
    options = {k: v for k, v in kwargs.items() if k in known}
    return parse_strict(options.pop("strict", StrictMode.RAISE_MISSING)), options


def _check_step(step: Any) -> None:
    """Raise unless ``step`` is a step number a manager saves (its folder name reads back)."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidArgumentError(
            f"step must be an int from 0 to {MAX_STEP} (its folder name must be found "
            f"again), got {step!r}"
        )


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    return value


def _foreign(names: Iterable[str]) -> list[str]:
    """The names in an uncommitted step folder that no save of a manager writes there (its
    data files, its commits' temp files, its sidecar), sorted."""
    temp = (f"{METADATA_FILE}.tmp", f"{SIDECAR}.tmp")
    return sorted(
        n for n in names if not (DATA_FILE_RE.match(n) or n == SIDECAR or n.startswith(temp))
    )
