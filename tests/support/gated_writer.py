"""A writer process that holds each job until the gate file named by ``DCPB_TEST_GATE``
exists, after creating ``<gate>.taken`` (so a test can act while a job is being written):
``python -m tests.support.gated_writer FD``."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from dcpbridge.storage.write import process_main

_write = process_main.run


def _gated(job: Any, segments: Any) -> Any:
    gate = os.environ["DCPB_TEST_GATE"]
    open(f"{gate}.taken", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _write(job, segments)


if __name__ == "__main__":
    process_main.run = _gated
    sys.exit(process_main.main(sys.argv))
