"""References to an earlier checkpoint's stored bytes (incremental saves), checked as hostile input.

An incremental checkpoint's ``files`` list may name, beside its own data files, data files of
a sibling checkpoint under the same parent (the same storage root): ``../<dir>/<file>`` or,
where that checkpoint spreads its files over hashed folders, ``../<dir>/<pXXX>/<file>``.
Nothing else is accepted: no absolute paths, no URLs, no ``..`` beyond the one level up, no
other folders; so a document can never make a reader open anything outside the root.
"""

from __future__ import annotations

import re

from dcpbridge.storage.errors import UnsafePathError

PARENT = "../"
# ../<dir>/[<spread folder>/]<data file>; <dir> is a plain name (see paths._SAFE_NAME)
_REFERENCE = re.compile(
    r"^\.\./(?P<dir>[A-Za-z0-9_][A-Za-z0-9_.\-]*)/(?:(?P<spread>p[0-9a-f]{1,3})/)?"
    r"(?P<file>__\d+_\d+\.[0-9a-f]+\.bin)\Z"
)


def is_reference(name: str) -> bool:
    """Whether a ``files`` entry points into another checkpoint (it starts with ``../``)."""
    return name.startswith(PARENT)


def check_reference(name: str) -> re.Match[str]:
    """The parts of reference ``name``; raises ``UnsafePathError`` unless it is exactly
    ``../<dir>/[<pXXX>/]<data file>`` with plain names."""
    m = _REFERENCE.match(name)
    if m is None or ".." in m.group("dir"):
        raise UnsafePathError(
            f"refusing referenced file {name!r}: a reference must be '../<checkpoint>/<data "
            "file>' inside the same storage root (no absolute paths, URLs or deeper '..')"
        )
    return m


def reference_dir(name: str) -> str:
    """The sibling checkpoint folder (its plain name) that reference ``name`` points into."""
    return check_reference(name).group("dir")


def parent_of(root: str) -> str:
    """The storage root that holds checkpoint ``root`` (refused where there is none)."""
    trimmed = root.rstrip("/")
    if "/" not in trimmed or not trimmed.rsplit("/", 1)[0]:
        raise UnsafePathError(f"{root!r} has no parent folder for referenced checkpoints")
    return trimmed.rsplit("/", 1)[0]


def reference_path(root: str, name: str) -> str:
    """Full path of reference ``name`` made from the checkpoint at ``root``."""
    check_reference(name)
    return f"{parent_of(root)}/{name[len(PARENT) :]}"


def folder_of(root: str, name: str) -> str:
    """Full path of the folder that holds the file reference ``name`` points to."""
    return reference_path(root, name).rsplit("/", 1)[0]


def reference_to(dir_name: str, file: str, spread: str | None) -> str:
    """The reference to data file ``file`` of sibling checkpoint ``dir_name`` (in hashed
    folder ``spread``, or None); a file that already is a reference stays as it is."""
    if is_reference(file):
        check_reference(file)
        return file
    name = f"{PARENT}{dir_name}/{spread}/{file}" if spread else f"{PARENT}{dir_name}/{file}"
    check_reference(name)
    return name
