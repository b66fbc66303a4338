"""Megatron-Core's ``dist_checkpointing.core`` names, answered by dcpbridge."""

from __future__ import annotations

import os
from typing import Any

from dcpbridge.errors import CheckpointError
from dcpbridge.formats.metadata import is_sharded_checkpoint

# Megatron's base exception; dcpbridge's errors all derive from CheckpointError.
CheckpointingException = CheckpointError


def check_is_distributed_checkpoint(
    checkpoint_dir: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None
) -> bool:
    """Whether ``checkpoint_dir`` holds a complete checkpoint that ``load`` reads (dcpbridge,
    Megatron torch_dist or plain DCP); never raises for a missing or foreign directory."""
    return is_sharded_checkpoint(checkpoint_dir, storage_options=storage_options)
