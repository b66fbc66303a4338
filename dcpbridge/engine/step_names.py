"""Step folder names: the one spelling of a step that the persistent and the local tier share.

``step_00000100`` sorts like its step; any other spelling of a step (``step_100``, non-ASCII
digits) is another folder, never read, removed or renamed as that step.
"""

from __future__ import annotations

import re

STEP_DIR = re.compile(r"^step_([0-9]{1,18})\Z")
ASIDE = ".previous"  # the local tier's committed step set aside while it is saved again
ASIDE_DIR = re.compile(r"^step_([0-9]{1,18})\.previous\Z")


def step_dir_name(step: int) -> str:
    """``step_00000100``: zero-padded so that names sort like steps."""
    return f"step_{step:08d}"


def step_of(name: str, *, aside: bool = False) -> int | None:
    """The step whose folder (with ``aside``: set-aside folder) is ``name``, or None: only
    ``step_dir_name``'s spelling is a step (``step_2`` beside ``step_00000002`` is another
    folder, not a second step 2)."""
    m = (ASIDE_DIR if aside else STEP_DIR).match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if name == step_dir_name(step) + (ASIDE if aside else "") else None
