"""Other tools' readers, run where dcpbridge cannot be imported (see ``import_block``).

Pool tasks (Megatron-Core's ``dist_checkpointing.load`` and plain ``dcp.load`` on N ranks)
run in a ``WorkerPool(blocked=("dcpbridge",))``. Single-process readers run in a subprocess
under ``import_block.blocked_env``: ``python -m tests.support.foreign SPEC OUT`` reads the
JSON list of checks in SPEC (``dcp``, ``megatron``, ``torch_dist_files``, ``torch``,
``safetensors``, ``transformers``) and ``torch.save``s what each read into OUT. Nothing
here imports dcpbridge: values go back as plain tensors and Python values, and the test
compares them with what it saved.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import sys
from datetime import timedelta
from typing import Any

import torch

Shapes = dict[str, tuple[list[int], str]]  # key -> (global shape, dtype name)


def not_importable() -> str:
    """The ImportError of ``import dcpbridge`` here (raises if it imports)."""
    try:
        import dcpbridge  # noqa: F401
    except ImportError as e:
        loaded = [m for m in sys.modules if m == "dcpbridge" or m.startswith("dcpbridge.")]
        assert not loaded, loaded
        return str(e)
    raise AssertionError("dcpbridge is importable in a process that must not have it")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _mcore() -> Any:
    """megatron.core.dist_checkpointing, patched to run on CPU with gloo."""
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing

    return dist_checkpointing


def megatron_template(
    mdc: Any, shapes: Shapes, grids: dict[str, int], rank: int, size: int
) -> dict[str, Any]:
    """Megatron's own layout: rows split over ``size`` ranks where they divide evenly (else
    whole, rank 0 the main replica), cells ``i`` of each object grid on rank ``i % size``."""
    tensors = {}
    for key, (shape, dtype) in shapes.items():
        if shape[0] % size == 0:
            data = torch.zeros(shape[0] // size, *shape[1:], dtype=_dtype(dtype))
            tensors[key] = mdc.ShardedTensor.from_rank_offsets(key, data, (0, rank, size))
        else:
            data = torch.zeros(shape, dtype=_dtype(dtype))
            tensors[key] = mdc.ShardedTensor.from_rank_offsets(key, data, replica_id=rank)
    objects = {
        f"{key}/{i}": mdc.ShardedObject(key, None, (n,), (i,), replica_id=0)
        for key, n in grids.items()
        for i in range(rank, n, size)
    }
    return {"t": tensors, "o": objects}


def _megatron_load(path: str, shapes: Shapes, grids: dict[str, int], rank: int, size: int):
    mdc = _mcore()
    out = mdc.load(megatron_template(mdc, shapes, grids, rank, size), path)
    common = {k: v for k, v in out.items() if k not in ("t", "o")}
    return {"tensors": dict(out["t"]), "objects": dict(out["o"]), "common": common}


def megatron_load(r: Any, path: str, shapes: Shapes, grids: dict[str, int]) -> dict[str, Any]:
    """Pool task (all ranks, default group): Megatron-Core loads in its own layout."""
    return {"blocked": not_importable(), **_megatron_load(path, shapes, grids, r.rank, r.size)}


def _dcp_load(path: str, shapes: Shapes, objects: list[str], **kwargs: Any) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = {k: torch.zeros(s, dtype=_dtype(d)) for k, (s, d) in shapes.items()}
    state.update(dict.fromkeys(objects))
    dcp.load(state, checkpoint_id=path, **kwargs)
    return state


def dcp_load(r: Any, path: str, shapes: Shapes, objects: list[str]) -> dict[str, Any]:
    """Pool task (all ranks, default group): plain ``dcp.load`` of whole tensors and objects."""
    return {"blocked": not_importable(), "state": _dcp_load(path, shapes, objects)}


def _torch_dist_files(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "metadata.json")) as f:
        config = json.load(f)
    common = torch.load(os.path.join(path, "common.pt"), weights_only=True)
    return {"config": config, "common": common}


def _safetensors(path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = (
        sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
    )
    out: dict[str, Any] = {}
    for name in files:
        out.update(load_file(name))
    return out


def _transformers(path: str) -> dict[str, Any]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _one_rank_group() -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=60),
    )


def run_checks(checks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each check's reads, by its ``name``; the import refusal under ``"blocked"``."""
    results: dict[str, Any] = {"blocked": not_importable()}
    if any(c["kind"] == "megatron" for c in checks):
        import torch.distributed.checkpoint

        _one_rank_group()
    for c in checks:
        kind, path = c["kind"], c["path"]
        if kind == "dcp":
            results[c["name"]] = _dcp_load(path, c["shapes"], c.get("objects", []))
        elif kind == "megatron":
            results[c["name"]] = _megatron_load(path, c["shapes"], c.get("grids", {}), 0, 1)
        elif kind == "torch_dist_files":
            results[c["name"]] = _torch_dist_files(path)
        elif kind == "torch":
            results[c["name"]] = torch.load(path, weights_only=True)
        elif kind == "safetensors":
            results[c["name"]] = _safetensors(path)
        elif kind == "transformers":
            results[c["name"]] = _transformers(path)
        else:
            raise ValueError(f"unknown check {kind!r}")
    results["still_blocked"] = not_importable()
    return results


def main(spec: str, out: str) -> None:
    with open(spec) as f:
        checks = json.load(f)
    torch.save(run_checks(checks), out)


if __name__ == "__main__":  # megatron-core's helper processes re-import the main module
    main(sys.argv[1], sys.argv[2])
