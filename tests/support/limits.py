"""A full disk without a small file system: a per-process file size limit (EFBIG past it)."""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator


@contextlib.contextmanager
def file_size_limit(nbytes: int | None) -> Iterator[None]:
    """Writes growing a file past ``nbytes`` fail with EFBIG (SIGXFSZ ignored) inside the
    block; ``None`` leaves the limit alone (for ranks that write normally)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if nbytes is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)
