"""Fresh processes forked from a server that has already imported torch and dcpbridge.

Each call still gets a process of its own (its own memory, file descriptors, environment and
exit code), without paying the ~3 s of importing torch again: the CLI, README snippets and
killed-rank tests start hundreds of processes in a run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import runpy
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.context import BaseContext
from typing import Any

PRELOAD = ["torch", "torch.distributed.checkpoint", "dcpbridge", "dcpbridge.tools.cli"]
_context: BaseContext | None = None


def context() -> BaseContext:
    """The forkserver context whose server imported ``PRELOAD`` once (the first start)."""
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _child(target: Callable[[], Any], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    mp.set_start_method("fork", force=True)  # a fresh interpreter's default on Linux
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115  (the process's own stdout)
    sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
    try:
        result = target()
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _cli(argv: list[str]) -> int:
    from dcpbridge.tools import cli

    return cli.main(argv)


def _cli_peak_rss(argv: list[str], out: str) -> int:
    code = _cli(argv)
    with open(out, "w") as f:  # KiB; counted from the fork, which starts at the server's RSS
        f.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
    return code


def _script(path: str) -> None:
    sys.argv = [path]
    runpy.run_path(path, run_name="__main__")


def _module(name: str, argv: list[str]) -> None:
    sys.argv = [name, *argv]
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def _run(
    target: Callable[[], Any],
    label: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="dcpb-proc-") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        env = dict(os.environ) if env is None else env
        p = context().Process(target=_child, args=(target, env, os.getcwd(), out, err))
        p.start()
        p.join(timeout)
        hung = p.is_alive()
        if hung:
            p.kill()
            p.join()
        with open(out) as fo, open(err) as fe:
            stdout, stderr = fo.read(), fe.read()
        if hung:  # what it wrote so far comes with the error
            raise subprocess.TimeoutExpired(label, timeout, stdout, stderr)
        return subprocess.CompletedProcess(label, p.exitcode, stdout, stderr)


def run_cli(argv: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``dcpbridge ARGV`` in a process of its own: exit code, stdout and stderr."""

    return _run(partial(_cli, list(argv)), ["dcpbridge", *argv], timeout)


def cli_peak_rss(argv: Sequence[str], timeout: float = 120) -> int:
    """``dcpbridge ARGV`` (which must succeed) in a process of its own: its peak RSS in KiB,
    counted from the fork on (a server that imported torch, whatever the caller holds)."""
    with tempfile.TemporaryDirectory(prefix="dcpb-rss-") as d:
        out = os.path.join(d, "rss")
        proc = _run(partial(_cli_peak_rss, list(argv), out), ["dcpbridge", *argv], timeout)
        assert proc.returncode == 0, (argv, proc.returncode, proc.stderr[-2000:])
        with open(out) as f:
            return int(f.read())


def run_script(path: str, cwd: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python PATH`` run in ``cwd`` in a process of its own."""

    here = os.getcwd()
    os.chdir(cwd)
    try:
        return _run(partial(_script, path), ["python", path], timeout)
    finally:
        os.chdir(here)


def run_module(
    name: str, argv: Sequence[str], env: dict[str, str], timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``python -m NAME ARGV`` with environment ``env`` in a process of its own (``torchrun``:
    its agent then skips importing torch; the workers it starts are fresh interpreters)."""

    return _run(partial(_module, name, list(argv)), ["python", "-m", name, *argv], timeout, env)
