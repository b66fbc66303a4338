"""A writer process that writes a job's files, then hangs instead of replying (so a test can
kill it in the middle of a save, deterministically): ``python -m tests.support.held_writer FD``."""

from __future__ import annotations

import sys
import time
from typing import Any

from dcpbridge.storage.write import process_main

_write = process_main.run


def _write_then_hang(job: Any, segments: Any) -> Any:
    _write(job, segments)
    time.sleep(3600)


if __name__ == "__main__":
    process_main.run = _write_then_hang
    sys.exit(process_main.main(sys.argv))
