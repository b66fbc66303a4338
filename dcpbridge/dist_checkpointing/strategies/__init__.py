"""Megatron-Core strategy names, as plain descriptions that ``save``/``load`` translate.

dcpbridge has one engine; a strategy only chooses the save format (``backend``:
``"dcpbridge"``, the default, or ``"torch_dist"``, Megatron's) and, wrapped in a
``FullyParallel*StrategyWrapper``, spreads writes or reads over ``parallelization_group``.
"""

from __future__ import annotations

from dcpbridge.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    LoadStrategy,
    SaveStrategy,
)

__all__ = [
    "FullyParallelLoadStrategyWrapper",
    "FullyParallelSaveStrategyWrapper",
    "LoadStrategy",
    "SaveStrategy",
]
