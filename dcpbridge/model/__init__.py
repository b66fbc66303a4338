"""The data model: Megatron-style sharded types, state surgery, intake of every kind of state, key maps."""
