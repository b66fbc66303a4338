"""Strategy descriptions mirroring Megatron-Core's fully-parallel wrappers (no behaviour of their own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SaveStrategy:
    """Which format a save writes: ``"dcpbridge"`` or Megatron's ``"torch_dist"``."""

    backend: str = "dcpbridge"
    version: int = 1


@dataclass(frozen=True)
class LoadStrategy:
    """A load strategy; loads detect the format, so ``backend`` is informative only."""

    backend: str = "dcpbridge"
    version: int = 1


@dataclass
class FullyParallelSaveStrategyWrapper:
    """Save with ``fully_parallel=True`` over ``parallelization_group`` (default: the save's group)."""

    strategy: Any = None
    parallelization_group: Any = None
    do_cache_distribution: bool = False  # dcpbridge always caches while the structure holds

    @property
    def base_strategy(self) -> Any:
        return self.strategy


@dataclass
class FullyParallelLoadStrategyWrapper:
    """Load with ``fully_parallel=True`` over ``parallelization_group`` (default: the load's group)."""

    strategy: Any = None
    parallelization_group: Any = None
    do_cache_distribution: bool = False
    exchange_algo: str = "broadcast"  # dcpbridge picks its own exchange

    @property
    def base_strategy(self) -> Any:
        return self.strategy
