"""The checkpoint location a storage writer or reader works on (options survive ``reset``)."""

from __future__ import annotations

import os
from typing import Any

from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.backends.store import Storage
from dcpbridge.storage.errors import InvalidArgumentError
from dcpbridge.storage.format.paths import Location, resolve


class LocationMixin:
    """What the DCP writer and reader share: their checkpoint location and its ``Storage``,
    resolved from checkpoint ids with the ``storage_options`` given once at construction.

    torch's FsspecWriter rebuilds its filesystem on ``reset(checkpoint_id)`` without them;
    here every path resolution uses them, so credentials and endpoints are never dropped.
    """

    def __init__(self, storage_options: dict[str, Any] | None) -> None:
        self.storage_options = dict(storage_options or {})
        self.location: Location | None = None
        self._io: Storage | None = None
        self._pid = os.getpid()  # the process this writer or reader was made in

    def _relocate(self, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Point at ``checkpoint_id``; True if that is a different location than before."""
        location = resolve(checkpoint_id, self.storage_options)
        if location == self.location:
            return False
        self.location = location
        self._io = storage_for(location)
        return True

    def __getstate__(self) -> dict[str, Any]:
        """Picklable for DCP's checkpoint process: the location travels, its open byte I/O
        (file descriptors, S3 wrappers, locks) does not."""
        state = self.__dict__.copy()
        state["_io"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.location is not None:
            self._io = storage_for(self.location)

    def _check_process(self) -> None:
        """Refuse a process-local location (``memory://``) from another process than the one
        this object was made in: it would write to, or read from, that process's own memory."""
        if self.location is None or not self.location.process_local or os.getpid() == self._pid:
            return
        raise InvalidArgumentError(
            f"{self.location.url} lives in the memory of process {self._pid}, but this "
            f"{type(self).__name__} runs in process {os.getpid()} (for example the checkpoint "
            "process of dcp.async_save(async_checkpointer_type=AsyncCheckpointerType.PROCESS)), "
            "which has a memory:// of its own: whatever it wrote there would be lost. Use the "
            "THREAD executor, or a location every process sees (a path, s3://...)"
        )

    @property
    def checkpoint_id(self) -> str:
        return self._loc.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return bool(os.fspath(checkpoint_id))

    @property
    def _loc(self) -> Location:
        if self.location is None:
            raise InvalidArgumentError(
                f"{type(self).__name__} has no checkpoint path: pass one to it"
            )
        return self.location

    @property
    def _store(self) -> Storage:
        self._loc  # noqa: B018 (raises the clear error when unset)
        assert self._io is not None
        return self._io
