"""Planning errors: each names the key, ranks and ranges at fault."""

from __future__ import annotations

from collections.abc import Iterable

from dcpbridge.storage.errors import CheckpointError

KEY_LIST_LIMIT = 100
"""A key-mismatch message names every key up to this many, then says how many more there are."""


def key_list(items: Iterable[str], sep: str = ", ", limit: int = KEY_LIST_LIMIT) -> str:
    """``items`` (already formatted) for an error message: the first ``limit``, then
    "and N more"."""
    items = list(items)
    shown = sep.join(items[:limit])
    return shown + (f"{sep}and {len(items) - limit} more" if len(items) > limit else "")


class ShardingValidationError(CheckpointError):
    """The shards of a save do not tile their global tensors (gap, overlap, disagreement)."""


class MissingKeysError(CheckpointError, KeyError):
    """Requested keys are not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnexpectedKeysError(CheckpointError):
    """The checkpoint holds keys no rank requested (strict load)."""


class KeyMismatchError(MissingKeysError, UnexpectedKeysError):
    """Keys requested but not in the checkpoint and keys in it but not requested, together."""


class ShapeMismatchError(CheckpointError):
    """A requested tensor's global shape differs from the stored one."""


class DTypeMismatchError(CheckpointError, TypeError):
    """A requested tensor's dtype differs from the stored one."""


class SerializationError(CheckpointError, TypeError):
    """A state-dict object could not be serialized for saving."""


class PickleRefusedError(CheckpointError):
    """A stored object needs full unpickling, which was not allowed."""


class InvalidRequestError(CheckpointError, ValueError):
    """A load template entry cannot receive data (no data, meta tensor, unknown kind)."""
