"""Running the scripts in examples/ as users run them: ``torchrun --nproc-per-node 2`` on CPU
(shared by the example test modules, which ``make test`` runs in parallel)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.support import preloaded

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def torchrun(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``examples/script`` on 2 CPU ranks; returns its stdout. The launcher is torchrun's
    own (``python -m torch.distributed.run``) in a process that has torch imported already; the
    ranks it starts are fresh interpreters running the script, as under a user's torchrun."""
    command = ["--standalone", "--nproc-per-node", "2", str(EXAMPLES / script), *args]
    proc = preloaded.run_module(
        "torch.distributed.run",
        command,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=240,
    )
    if proc.returncode != 0 and _gloo_exit_race(proc.stderr) and "checkpoints [" in proc.stdout:
        return proc.stdout  # the job finished; only torch's interpreter exit aborted (below)
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _gloo_exit_race(stderr: str) -> bool:
    """torch 2.13's gloo race at interpreter exit: a finished collective's work, freed by the
    process group's worker thread while Python finalizes, aborts the process after the job
    completed (also seen with plain DCP loads of FSDP2 models, about 1 run in 10 here)."""
    return "terminate called without an active exception" in stderr and "exitcode: -6" in stderr


def final_step(out: str) -> str:
    return re.findall(r"^step \d+ .*$", out, flags=re.M)[-1]
