"""Megatron-Core compatibility: the seed APIs (optimizer, param groups, rank-0 sharding, tensor-aware state dict)."""
