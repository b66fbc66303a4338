"""dcpbridge: Megatron-style sharded checkpoints saved and loaded through torch.distributed.checkpoint."""

from __future__ import annotations

from dcpbridge.engine.async_save import AsyncSaveHandle
from dcpbridge.engine.common_digest import CommonStateMismatchWarning
from dcpbridge.engine.load import load, load_common_state_dict, load_plain_tensors
from dcpbridge.engine.manager import CheckpointManager
from dcpbridge.engine.save import SaveOptions, async_save, save
from dcpbridge.engine.strict import StrictHandling
from dcpbridge.errors import (
    CheckpointError,
    ChecksumMismatchError,
    CollectiveError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    DataLayoutError,
    DataStateError,
    DistributedCheckpointError,
    DTypeMismatchError,
    HollowStateError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    InvalidRequestError,
    InvalidShardError,
    KeyMismatchError,
    MissingEntryError,
    MissingKeysError,
    NotACheckpointError,
    OptimizerStateError,
    PickleRefusedError,
    SerializationError,
    ShapeMismatchError,
    ShardingValidationError,
    StagingError,
    StagingMutationError,
    StorageError,
    StorageFileNotFoundError,
    TiedTensorsError,
    UnexpectedKeysError,
    UnsafePathError,
    UnsupportedExtensionError,
    WriterProcessError,
)
from dcpbridge.formats.config import ConfigError, load_config
from dcpbridge.formats.layout import Layout, LayoutError, load_layout, parse_layout
from dcpbridge.formats.metadata import (
    load_sharded_metadata,
    load_tensors_metadata,
    remove_sharded_tensors,
)
from dcpbridge.formats.sources import open_source
from dcpbridge.mcore.optim_layout import from_model_space, to_model_space
from dcpbridge.mcore.optimizer import (
    get_optim_param_to_id_map,
    get_param_id_to_sharded_param_map,
    init_optimizer_state,
    load_optimizer_state,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
    optimizer_sharded_state_dict,
    restore_optim_state,
)
from dcpbridge.mcore.param_groups import OptimizerConfig, ParamKey, get_optimizer, get_param_groups
from dcpbridge.mcore.sharding import (
    DistModule,
    DistributedKeys,
    broadcast_and_shard_state_dict,
    load_state_dict,
    shard_broadcasted_state_dict,
)
from dcpbridge.mcore.tensor_aware_state_dict import ShardDistribution, TensorAwareStateDict
from dcpbridge.model.data_position import GlobalBatchSampler
from dcpbridge.model.key_map import KeyMap
from dcpbridge.model.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    apply_factories,
    apply_factory_merges,
)
from dcpbridge.model.per_rank import DataStateDroppedWarning, PerRankState
from dcpbridge.model.rng_state import RNGState
from dcpbridge.planners import ShardedLoadPlanner, ShardedSavePlanner, StrictMode
from dcpbridge.storage import FsspecCheckpointReader, FsspecCheckpointWriter
from dcpbridge.tools.export import export_safetensors, export_torch
from dcpbridge.tools.hf import save_hf
from dcpbridge.tools.reshard import reshard

__version__ = "0.1.0"

__all__ = [
    "AsyncSaveHandle",
    "CheckpointError",
    "CheckpointManager",
    "ChecksumMismatchError",
    "CollectiveError",
    "CommonStateMismatchWarning",
    "ConcurrentSaveError",
    "ConfigError",
    "CorruptCheckpointError",
    "DTypeMismatchError",
    "DataLayoutError",
    "DataStateDroppedWarning",
    "DataStateError",
    "DistModule",
    "DistributedCheckpointError",
    "DistributedKeys",
    "FsspecCheckpointReader",
    "FsspecCheckpointWriter",
    "GlobalBatchSampler",
    "HollowStateError",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "InvalidRequestError",
    "InvalidShardError",
    "KeyMap",
    "KeyMismatchError",
    "Layout",
    "LayoutError",
    "LocalNonpersistentObject",
    "MissingEntryError",
    "MissingKeysError",
    "NotACheckpointError",
    "OptimizerConfig",
    "OptimizerStateError",
    "ParamKey",
    "PerRankState",
    "PickleRefusedError",
    "RNGState",
    "SaveOptions",
    "SerializationError",
    "ShapeMismatchError",
    "ShardDistribution",
    "ShardedLoadPlanner",
    "ShardedObject",
    "ShardedSavePlanner",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "ShardingValidationError",
    "StagingError",
    "StagingMutationError",
    "StateDict",
    "StorageError",
    "StorageFileNotFoundError",
    "StrictHandling",
    "StrictMode",
    "TensorAwareStateDict",
    "TiedTensorsError",
    "UnexpectedKeysError",
    "UnsafePathError",
    "UnsupportedExtensionError",
    "WriterProcessError",
    "apply_factories",
    "apply_factory_merges",
    "async_save",
    "broadcast_and_shard_state_dict",
    "export_safetensors",
    "export_torch",
    "from_model_space",
    "get_optim_param_to_id_map",
    "get_optimizer",
    "get_param_groups",
    "get_param_id_to_sharded_param_map",
    "init_optimizer_state",
    "load",
    "load_common_state_dict",
    "load_config",
    "load_layout",
    "load_optimizer_state",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_state_dict",
    "load_tensors_metadata",
    "make_sharded_optimizer_tensor",
    "open_source",
    "optim_state_to_sharding_state",
    "optimizer_sharded_state_dict",
    "parse_layout",
    "remove_sharded_tensors",
    "reshard",
    "restore_optim_state",
    "save",
    "save_hf",
    "shard_broadcasted_state_dict",
    "to_model_space",
]
