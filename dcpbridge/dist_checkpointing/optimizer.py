"""Megatron-Core's ``dist_checkpointing.optimizer`` helpers, as dcpbridge implements them."""

from __future__ import annotations

from dcpbridge.mcore.optimizer import (
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)

__all__ = [
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
]
