"""The storage backends every storage test runs on: local disk, memory:// and S3 (SeaweedFS)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

from tests.support.s3_server import S3Server


def clear_memory_store() -> None:
    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs[:] = [""]


@dataclass
class Backend:
    """Where one test keeps its checkpoints: ``url(name)`` plus the options to reach it."""

    name: str
    base: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    # memory:// lives inside one process; other backends are seen by every pool rank.
    shared_between_processes: bool = True
    _everything: Callable[[], list[str]] = field(default=lambda: [], repr=False)
    s3: S3Server | None = None
    bucket: str = ""

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def fs(self) -> Any:
        return fsspec.core.url_to_fs(self.base, **self.storage_options)[0]

    def path(self, name: str, file: str = "") -> str:
        """The filesystem path of checkpoint ``name`` (or of ``file`` inside it)."""
        root = fsspec.core.url_to_fs(self.url(name), **self.storage_options)[1]
        return f"{root}/{file}" if file else root

    def names(self, name: str) -> list[str]:
        """File names in checkpoint ``name``, read fresh from the storage."""
        fs = self.fs()
        try:
            entries = fs.ls(self.path(name), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def data_names(self, name: str) -> list[str]:
        return [n for n in self.names(name) if n.endswith(".bin")]

    def read(self, name: str, file: str) -> bytes:
        return self.fs().cat_file(self.path(name, file))

    def write(self, name: str, file: str, data: bytes) -> None:
        fs = self.fs()
        fs.makedirs(self.path(name), exist_ok=True)
        fs.pipe_file(self.path(name, file), data)
        fs.invalidate_cache()

    def delete(self, name: str, file: str) -> None:
        fs = self.fs()
        fs.rm_file(self.path(name, file))
        fs.invalidate_cache()

    def everything(self) -> list[str]:
        """Paths (comparable with ``path()``) of every file this test's storage holds: the
        whole temp dir, memory store or bucket, not only the checkpoint area."""
        return self._everything()


def local_backend(tmp_path: Path) -> Backend:
    area = tmp_path / "area"
    area.mkdir()

    def everything() -> list[str]:
        return sorted(os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files)

    return Backend("local", str(area), _everything=everything)


def memory_backend(test_id: str) -> Backend:
    def everything() -> list[str]:
        return sorted(MemoryFileSystem.store)

    return Backend(
        "memory", f"memory://{test_id}", shared_between_processes=False, _everything=everything
    )


def s3_backend(server: S3Server, **options: Any) -> Backend:
    bucket = server.new_bucket()
    return Backend(
        "s3",
        f"s3://{bucket}/area",
        server.storage_options(**options),
        _everything=lambda: [f"{bucket}/{k}" for k in server.keys(bucket)],
        s3=server,
        bucket=bucket,
    )
