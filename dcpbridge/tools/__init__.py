"""Formats and offline tools: detect and open checkpoints, torch_dist, export, inspect/validate/reshard, CLI, config."""
