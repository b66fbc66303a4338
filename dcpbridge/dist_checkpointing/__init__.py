"""Drop-in for ``megatron.core.dist_checkpointing``: switch by changing one import.

``from dcpbridge import dist_checkpointing`` gives Megatron-Core's public functions and classes
with Megatron's parameters, backed by dcpbridge (differences: ``serialization``'s docstring);
submodules ``mapping``, ``serialization``, ``validation``, ``optimizer``, ``core`` and
``strategies`` mirror Megatron's.
"""

from __future__ import annotations

from dcpbridge.dist_checkpointing.core import (
    CheckpointingException,
    check_is_distributed_checkpoint,
)
from dcpbridge.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from dcpbridge.dist_checkpointing.optimizer import (
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from dcpbridge.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
    save,
)
from dcpbridge.dist_checkpointing.validation import StrictHandling, parse_strict_flag

__all__ = [
    "CheckpointingException",
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "StrictHandling",
    "apply_factories",
    "apply_factory_merges",
    "check_is_distributed_checkpoint",
    "get_default_load_sharded_strategy",
    "get_default_save_sharded_strategy",
    "get_optim_param_to_id_map",
    "get_param_id_to_sharded_param_map",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "make_sharded_optimizer_tensor",
    "optim_state_to_sharding_state",
    "parse_strict_flag",
    "remove_sharded_tensors",
    "save",
]
