"""Make packages unimportable in a process: a ``sys.meta_path`` finder that raises ImportError.

Used to run other tools' readers where ``import dcpbridge`` fails, as on a machine without
it: installed first thing in a pool worker (``WorkerPool(blocked=...)``), or at interpreter
start-up by a ``sitecustomize.py`` on ``PYTHONPATH`` (``blocked_env``) for a subprocess.
This module imports nothing of ours, so installing it imports nothing it blocks.
"""

from __future__ import annotations

import os
import sys
from typing import Any

_SITECUSTOMIZE = """\
import sys


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if any(name == p or name.startswith(p + ".") for p in {prefixes!r}):
            raise ImportError(f"{{name}} is blocked in this process")
        return None


sys.meta_path.insert(0, _Blocker())
"""


class ImportBlocker:
    """Refuses to import ``prefixes`` (and their submodules) in this process."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if any(name == p or name.startswith(p + ".") for p in self.prefixes):
            raise ImportError(f"{name} is blocked in this process")


def install(prefixes: tuple[str, ...]) -> None:
    """Block ``prefixes`` from now on; raises if one of them is imported already."""
    loaded = sorted(m for m in sys.modules for p in prefixes if m == p or m.startswith(p + "."))
    if loaded:
        raise RuntimeError(f"cannot block what is imported already: {loaded}")
    sys.meta_path.insert(0, ImportBlocker(prefixes))


def blocked_env(folder: str, prefixes: tuple[str, ...]) -> dict[str, str]:
    """The environment of a subprocess in which ``prefixes`` cannot be imported (a
    ``sitecustomize.py`` written into ``folder`` runs before anything else)."""
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE.format(prefixes=tuple(prefixes)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([folder, *filter(None, [env.get("PYTHONPATH")])])
    return env
