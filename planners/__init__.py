"""dcpbridge planners: DCP SavePlanner/LoadPlanner for Megatron-style sharded state."""

from __future__ import annotations

from dcpbridge.planners.boxes import Placed, coverage_problems, find_gap, find_overlaps, intersect
from dcpbridge.planners.distribution import is_main_replica
from dcpbridge.planners.errors import (
    DTypeMismatchError,
    InvalidRequestError,
    KeyMismatchError,
    MissingKeysError,
    PickleRefusedError,
    SerializationError,
    ShapeMismatchError,
    ShardingValidationError,
    UnexpectedKeysError,
)
from dcpbridge.planners.load_planner import (
    ShardedLoadPlanner,
    StrictMode,
    load_object,
    plan_local_reads,
    plan_tensor_reads,
)
from dcpbridge.planners.protocol import ObjectShard, TensorShard
from dcpbridge.planners.save_planner import ShardedSavePlanner, build_metadata, plan_local_writes

__all__ = [
    "DTypeMismatchError",
    "InvalidRequestError",
    "KeyMismatchError",
    "MissingKeysError",
    "ObjectShard",
    "PickleRefusedError",
    "Placed",
    "SerializationError",
    "ShapeMismatchError",
    "ShardedLoadPlanner",
    "ShardedSavePlanner",
    "ShardingValidationError",
    "StrictMode",
    "TensorShard",
    "UnexpectedKeysError",
    "build_metadata",
    "coverage_problems",
    "find_gap",
    "find_overlaps",
    "intersect",
    "is_main_replica",
    "load_object",
    "plan_local_reads",
    "plan_local_writes",
    "plan_tensor_reads",
]
