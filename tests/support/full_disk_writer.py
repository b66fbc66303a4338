"""A writer process whose disk is full: each data file write fails with ``ENOSPC`` (so a test
sees a storage fault raised in the writer process): ``python -m tests.support.full_disk_writer FD``."""

from __future__ import annotations

import errno
import sys
from typing import Any

from dcpbridge.storage.write import coalesce, process_main


def _no_space(f: Any, data: memoryview) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


if __name__ == "__main__":
    coalesce._write_all = _no_space
    sys.exit(process_main.main(sys.argv))
