"""Round trips with real megatron-core (0.16.1) dist_checkpointing, torch_dist backend."""

from __future__ import annotations

import json
import os

import pytest
import torch

import dcpbridge as db
from tests.support import megatron_cpu as M
from tests.support.dist_pool import Rank

pytestmark = [pytest.mark.interop, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _bridge_template(r: Rank) -> dict:
    """A 2-rank dcpbridge layout unlike Megatron's: fc1 by columns, qkv by its column axis
    (every layer on each rank), the bias split in halves, object grid cells 2r and 2r+1."""
    fc1 = db.ShardedTensor.from_box(
        "decoder.fc1.weight", torch.zeros(16, 3), (16, 6), (0, 3 * r.rank)
    )
    qkv = db.ShardedTensor.from_box(
        "decoder.layers.qkv", torch.zeros(4, 8, 3), (4, 8, 6), (0, 0, 3 * r.rank)
    )
    bias = db.ShardedTensor.from_box(
        "embedding.bias", torch.zeros(5, dtype=torch.bfloat16), (10,), (5 * r.rank,)
    )
    objs = [db.ShardedObject("rng_state", None, (4,), (2 * r.rank + i,)) for i in range(2)]
    return {"model": {"fc1": fc1, "qkv": qkv, "bias": bias}, "rng": objs}


def bridge_load(r: Rank, path: str) -> dict:
    return bridge_load_checked(r, path, allow_pickle=True)


def bridge_load_checked(r: Rank, path: str, *, allow_pickle: bool) -> dict:
    out = db.load(_bridge_template(r), path, process_group=r.group, allow_pickle=allow_pickle)
    cols = slice(3 * r.rank, 3 * r.rank + 3)
    assert torch.equal(out["model"]["fc1"], M.full("decoder.fc1.weight")[:, cols])
    assert torch.equal(out["model"]["qkv"], M.full("decoder.layers.qkv")[..., cols])
    assert torch.equal(out["model"]["bias"], M.full("embedding.bias")[5 * r.rank : 5 * r.rank + 5])
    assert out["rng"] == [{"seed": 1000 + 2 * r.rank + i} for i in range(2)]
    return {"iteration": out["iteration"], "args": vars(out["args"]), "note": out["note"]}


def bridge_load_without_pickle(r: Rank, path: str) -> dict:
    """Megatron's ``.metadata`` is read without pickle; its ``common.pt`` holds an
    ``argparse.Namespace``, which megatron.core (imported in this worker by the save) has
    registered as a safe global for ``weights_only`` loading."""
    return bridge_load_checked(r, path, allow_pickle=False)


@pytest.fixture(scope="module")
def megatron_ckpt(pool, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("mcore") / "iter_0000042")
    os.makedirs(path)
    pool.run(M.megatron_save, 4, path, default_group=True, timeout=120)
    return path


def test_megatron_checkpoint_loads_into_another_layout(pool, megatron_ckpt):
    names = set(os.listdir(megatron_ckpt))
    assert {"metadata.json", ".metadata", "common.pt"} <= names
    assert any(n.endswith(".distcp") for n in names)

    commons = pool.run(bridge_load, 2, megatron_ckpt)
    assert commons[0] == {"iteration": 42, "args": {"lr": 0.5, "tp": 4}, "note": "megatron"}

    assert pool.run(bridge_load_without_pickle, 2, megatron_ckpt)[0] == commons[0]

    # One plain process (no process group) reads whole tensors.
    whole = {
        k: db.ShardedTensor.from_box(k, torch.zeros(s, dtype=d), s, (0,) * len(s))
        for k, (s, d) in M.SHAPES.items()
    }
    out = db.load(whole, megatron_ckpt, allow_pickle=True)
    for k in M.SHAPES:
        assert torch.equal(out[k], M.full(k)), k
    # Megatron-Core's .metadata holds DCP's classes only: read without pickle by default
    assert set(db.load_tensors_metadata(megatron_ckpt)) == set(M.SHAPES)


def bridge_save_torch_dist(r: Rank, path: str, background: bool) -> None:
    """2 ranks save in their own layout, in Megatron's format (``background``: async_save,
    with every tensor, the common state's too, changed as soon as it returns)."""
    state = _bridge_template(r)
    cols = slice(3 * r.rank, 3 * r.rank + 3)
    state["model"]["fc1"].data.copy_(M.full("decoder.fc1.weight")[:, cols])
    state["model"]["qkv"].data.copy_(M.full("decoder.layers.qkv")[..., cols])
    state["model"]["bias"].data.copy_(M.full("embedding.bias")[5 * r.rank : 5 * r.rank + 5])
    for i, obj in enumerate(state["rng"]):
        obj.data = {"seed": 1000 + 2 * r.rank + i}
    state.update(iteration=42, note="bridge", scale=torch.full((3,), 0.5))
    if not background:
        db.save(state, path, process_group=r.group, format="torch_dist")
        return
    handle = db.async_save(state, path, process_group=r.group, format="torch_dist")
    for t in (state["scale"], *(sh.data for sh in state["model"].values())):
        t.fill_(-1)  # training goes on: the staged copies are unaffected
    state["rng"][0].data["seed"] = -1
    handle.result(timeout=60)


@pytest.mark.parametrize("background", [False, True], ids=["save", "async_save"])
def test_megatron_loads_a_torch_dist_checkpoint_written_by_dcpbridge(pool, tmp_path, background):
    path = str(tmp_path / "bridge_torch_dist")
    os.makedirs(path)
    db.save({"old": db.ShardedTensor.from_box("old", torch.ones(2), (2,), (0,))}, path)
    pool.run(bridge_save_torch_dist, 2, path, background)
    names = set(os.listdir(path))
    assert "dcpbridge.json" not in names and not any(n.endswith(".bin") for n in names)
    with open(os.path.join(path, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "torch_dist"

    got = pool.run(M.megatron_load, 4, path, default_group=True, timeout=120)
    for rank, out in enumerate(got):
        assert torch.equal(out["fc1"], M.full("decoder.fc1.weight")[rank * 4 : rank * 4 + 4])
        assert torch.equal(out["qkv"], M.full("decoder.layers.qkv")[rank])
        assert torch.equal(out["bias"], M.full("embedding.bias"))
        assert out["rng"] == {"seed": 1000 + rank}
        assert out["iteration"] == 42
    # ... and dcpbridge reads its own torch_dist output back (common state from common.pt).
    assert pool.run(bridge_load_common, 2, path)[0] == 42


def bridge_load_common(r: Rank, path: str) -> int:
    out = db.load(_bridge_template(r), path, process_group=r.group, allow_pickle=True)
    assert out["note"] == "bridge" and torch.equal(out["scale"], torch.full((3,), 0.5))
    assert out["rng"] == [{"seed": 1000 + 2 * r.rank + i} for i in range(2)]
    return out["iteration"]


def test_cli_on_a_megatron_checkpoint(megatron_ckpt, tmp_path, capsys):
    from tests.tools.test_cli import in_process, run_cli

    doc = json.loads(run_cli("inspect", megatron_ckpt, "--json", "--allow-pickle").stdout)
    assert doc["format"] == "torch_dist" and doc["complete"]
    assert doc["megatron_config"]["sharded_backend"] == "torch_dist"
    fc1 = doc["tensors"]["decoder.fc1.weight"]
    assert [(c["offsets"], c["rank"]) for c in fc1["chunks"]] == [([4 * r, 0], r) for r in range(4)]
    assert [c["sizes"] for c in doc["tensors"]["decoder.layers.qkv"]["chunks"]] == [[1, 8, 6]] * 4
    assert {f"rng_state/shard_{r}_4" for r in range(4)} | {"__common__"} == set(doc["objects"])

    code, out, err = in_process(capsys, "inspect", megatron_ckpt)  # no pickle runs
    assert code == 0 and "torch_dist" in out and "decoder.fc1.weight" in out, out + err
    code, out, err = in_process(capsys, "validate", megatron_ckpt, "--checksums", "--allow-pickle")
    assert code == 0, out + err
    assert "records no checksums; every item was read" in out

    # Megatron -> dcpbridge (whole tensors) -> loads without touching Megatron's pickles,
    # except the common state, which holds an argparse.Namespace.
    dst = str(tmp_path / "converted")
    code, out, err = in_process(
        capsys,
        "convert",
        megatron_ckpt,
        dst,
        "--to",
        "dcpbridge",
        "--allow-pickle",
        "--no-progress",
    )
    assert code == 0, err
    whole = {
        k: db.ShardedTensor.from_box(k, torch.zeros(s, dtype=d), s, (0,) * len(s))
        for k, (s, d) in M.SHAPES.items()
    }
    whole["rng"] = [db.ShardedObject("rng_state", None, (4,), (i,)) for i in range(4)]
    out = db.load(whole, dst, allow_pickle=True)
    for k in M.SHAPES:
        assert torch.equal(out[k], M.full(k)), k
    assert out["rng"] == [{"seed": 1000 + i} for i in range(4)]
    assert out["iteration"] == 42 and vars(out["args"]) == {"lr": 0.5, "tp": 4}
    # megatron.core registers argparse.Namespace as a safe global once imported (process-wide):
    # without that registration, weights_only loading refuses it
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(
            db.PickleRefusedError, match=r"object '__common__' .*argparse\.Namespace"
        ):
            db.load(whole, dst)
    finally:
        torch.serialization.add_safe_globals(registered)

    hf = str(tmp_path / "hf")
    code, out, err = in_process(
        capsys, "convert", megatron_ckpt, hf, "--to", "safetensors", "--allow-pickle"
    )
    assert code == 0, err
    from safetensors.torch import load_file

    loaded = load_file(os.path.join(hf, "model.safetensors"))
    assert all(torch.equal(loaded[k], M.full(k)) for k in M.SHAPES)
