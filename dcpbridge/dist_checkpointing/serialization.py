"""Megatron-Core's ``dist_checkpointing.serialization`` entry points, with Megatron's parameters.

Each function takes Megatron's arguments and maps them onto dcpbridge; extra keyword arguments
(``process_group``, ``storage_options``, ``allow_pickle``, ``fully_parallel``, ...) go to the
dcpbridge function underneath. What cannot be honoured raises ``CheckpointError``
(= ``CheckpointingException`` here). Differences from Megatron, all deliberate:

* ``save`` writes dcpbridge's format unless the strategy names ``"torch_dist"``;
  ``async_sharded_save=True`` returns a running ``AsyncSaveHandle`` (call ``result()``), not
  an ``AsyncRequest`` for the caller to schedule.
* ``load``'s ``validate_access_integrity`` is accepted and unused: dcpbridge reads any
  requested boxes, overlapping or not. Megatron's torch_dist checkpoints keep pickled
  metadata, which dcpbridge reads without running code (``allow_pickle=True`` only where it
  needs classes beyond DCP's).
* ``load_plain_tensors`` returns tensors only, as Megatron documents (its code also merges
  the common state).
"""

from __future__ import annotations

import os
from typing import Any

from dcpbridge.dist_checkpointing.strategies import LoadStrategy, SaveStrategy
from dcpbridge.engine import load as engine_load
from dcpbridge.engine import save as engine_save
from dcpbridge.engine.async_save import AsyncSaveHandle
from dcpbridge.engine.strict import StrictHandling
from dcpbridge.errors import CheckpointError, InvalidArgumentError
from dcpbridge.formats import metadata
from dcpbridge.formats.checkpoint import detect
from dcpbridge.model.mapping import ShardedObject, ShardedStateDict, ShardedTensor, StateDict
from dcpbridge.storage import resolve

PathLike = str | os.PathLike[str]
CONTENT_METADATA_KEY = "content_metadata"
_BACKENDS = ("dcpbridge", "torch_dist")


def _strategy(
    strategy: Any, what: str, *, loading: bool = False
) -> tuple[str | None, dict[str, Any]]:
    """(backend or None, fully-parallel options) a Megatron-style strategy argument stands for
    (``loading``: Megatron-Core's own load strategies too, as loads detect the format)."""
    options: dict[str, Any] = {}
    if hasattr(strategy, "parallelization_group") and hasattr(strategy, "base_strategy"):
        options = {"fully_parallel": True, "parallelization_group": strategy.parallelization_group}
        strategy = strategy.base_strategy
    if strategy is None:
        return None, options
    if loading and callable(getattr(strategy, "load_tensors_metadata", None)):
        return None, options  # a Megatron-Core LoadShardedStrategy (TorchDistLoadShardedStrategy)
    if isinstance(strategy, tuple) and strategy and isinstance(strategy[0], str):
        backend = strategy[0]
    elif isinstance(getattr(strategy, "backend", None), str):
        backend = strategy.backend
    else:
        raise CheckpointError(
            f"{what}={strategy!r} is not supported: dcpbridge takes None, a (backend, version) "
            "tuple, an object with a 'backend' name, or a fully-parallel wrapper of one"
        )
    if backend not in _BACKENDS:
        raise CheckpointError(
            f"{what} backend {backend!r} is not supported; dcpbridge writes and reads "
            f"{' and '.join(map(repr, _BACKENDS))}"
        )
    return backend, options


def _common_strategy(common_strategy: Any) -> None:
    backend = common_strategy[0] if isinstance(common_strategy, tuple) else None
    if common_strategy is not None and backend != "torch":
        raise CheckpointError(
            f"common_strategy={common_strategy!r} is not supported: dcpbridge stores the common "
            "state itself (pass None)"
        )


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Any = None,
    content_metadata: dict | None = None,
    **options: Any,
) -> AsyncSaveHandle | None:
    """Megatron's ``save``: every rank calls it; returns a handle only for an async save.

    ``preprocess_common_before_consistancy_check`` is accepted and unused (Megatron only
    logs common-state differences between ranks; dcpbridge stores rank 0's). The
    ``content_metadata`` dict is stored in the common state, as Megatron does.
    """
    if common_strategy is not None:  # Megatron too refuses any common strategy on save
        raise CheckpointError("common_strategy is not supported on save (pass None)")
    if preprocess_common_before_consistancy_check is not None and not callable(
        preprocess_common_before_consistancy_check
    ):
        raise CheckpointError("preprocess_common_before_consistancy_check must be callable")
    backend, parallel = _strategy(sharded_strategy, "sharded_strategy")
    if content_metadata is not None:
        sharded_state_dict = {**sharded_state_dict, CONTENT_METADATA_KEY: content_metadata}
    kwargs = {
        **parallel,
        "validate_access_integrity": validate_access_integrity,
        "format": backend or "dcpbridge",
        **options,
    }
    if async_sharded_save:
        return engine_save.async_save(sharded_state_dict, checkpoint_dir, **kwargs)
    engine_save.save(sharded_state_dict, checkpoint_dir, **kwargs)
    return None


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: PathLike,
    sharded_strategy: Any = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: Any = StrictHandling.ASSUME_OK_UNEXPECTED,
    **options: Any,
) -> StateDict | tuple[StateDict, set[str], set[str]]:
    """Megatron's ``load``: every rank calls it; ``strict`` has Megatron's meaning and
    return shape (``dcpbridge.planners.strict``). Any sharded format dcpbridge reads loads."""
    _, parallel = _strategy(sharded_strategy, "sharded_strategy", loading=True)
    _common_strategy(common_strategy)
    return engine_load.load(
        sharded_state_dict, checkpoint_dir, strict=strict, **{**parallel, **options}
    )


def load_common_state_dict(checkpoint_dir: PathLike, **options: Any) -> StateDict:
    """The common (non-sharded) state, read in this process alone."""
    return engine_load.load_common(checkpoint_dir, **options)


def load_tensors_metadata(
    checkpoint_dir: PathLike, sharded_strategy: Any = None, **options: Any
) -> dict[str, ShardedTensor]:
    """Stored tensors by key, as whole-tensor ShardedTensors without real data; ``load``-ing
    them gives plain tensors."""
    _strategy(sharded_strategy, "sharded_strategy", loading=True)
    return metadata.load_tensors_metadata(checkpoint_dir, **options)


def load_sharded_metadata(
    checkpoint_dir: PathLike, sharded_strategy: Any = None, common_strategy: Any = None, **options
) -> dict[str, ShardedTensor | ShardedObject]:
    """``load_tensors_metadata`` plus one data-less ShardedObject per stored object cell."""
    _strategy(sharded_strategy, "sharded_strategy", loading=True)
    _common_strategy(common_strategy)
    return metadata.load_sharded_metadata(checkpoint_dir, **options)


def load_plain_tensors(checkpoint_dir: PathLike, **options: Any) -> StateDict:
    """Every stored tensor whole, by key (a collective load; see ``metadata``)."""
    return engine_load.load_plain_tensors(checkpoint_dir, **options)


def load_content_metadata(
    checkpoint_dir: PathLike | None = None,
    *,
    preloaded_state_dict: StateDict | None = None,
    **options: Any,
) -> dict | None:
    """The ``content_metadata`` given to ``save``, or None; reads the common state unless
    ``preloaded_state_dict`` (a loaded state dict) is given."""
    if preloaded_state_dict is None:
        if checkpoint_dir is None:
            raise InvalidArgumentError("pass checkpoint_dir or preloaded_state_dict")
        preloaded_state_dict = load_common_state_dict(checkpoint_dir, **options)
    return preloaded_state_dict.get(CONTENT_METADATA_KEY)


def remove_sharded_tensors(checkpoint_dir: PathLike, key_prefix: str, **options: Any) -> None:
    """Drop the stored tensors and objects whose keys start with ``key_prefix`` (one process)."""
    metadata.remove_sharded_tensors(checkpoint_dir, key_prefix, **options)


def get_default_save_sharded_strategy(backend: str = "dcpbridge", version: int = 1) -> SaveStrategy:
    """The strategy ``save`` uses for ``backend`` (``"dcpbridge"`` or ``"torch_dist"``)."""
    if backend not in _BACKENDS:
        raise CheckpointError(f"backend {backend!r} is not supported; use one of {_BACKENDS}")
    return SaveStrategy(backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: PathLike, **options: Any) -> LoadStrategy:
    """A description of how ``checkpoint_dir`` loads (its detected format)."""
    return LoadStrategy(detect(resolve(checkpoint_dir, options.get("storage_options"))).value)
