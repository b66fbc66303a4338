"""What dcpbridge writes in other tools' formats loads with those tools alone.

Checkpoints are written here, single-process and on 2 ranks: Megatron-Core ``torch_dist``
(``db.save(format="torch_dist")``), plain DCP (``dcp.save`` with torch's writer and
dcpbridge's planner), and ``dcpbridge convert --to torch`` / ``--to safetensors`` of
dcpbridge checkpoints. They are read by Megatron-Core (on 4 ranks in its own layout, and in
one process), ``dcp.load`` (4 ranks and one process), ``torch.load(weights_only=True)``,
safetensors and transformers, in processes where ``import dcpbridge`` fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from dcpbridge.planners import ShardedSavePlanner
from dcpbridge.tools import cli
from tests.e2e.test_interop import bridge_save_torch_dist
from tests.support import foreign
from tests.support import megatron_cpu as M
from tests.support.dist_pool import Rank, WorkerPool
from tests.support.import_block import blocked_env

pytestmark = [pytest.mark.interop, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHAPES = {k: (list(s), str(d)) for k, (s, d) in M.SHAPES.items()}
GRIDS = {"rng_state": 4}
CELLS = [f"rng_state/shard_{i}_4" for i in range(4)]  # the grid's storage keys
SEEDS = [{"seed": 1000 + i} for i in range(4)]  # what bridge_save_torch_dist stores


def _gpt2() -> tuple[Any, dict[str, torch.Tensor]]:
    """A tiny GPT-2 (config, state dict without the tied ``lm_head.weight``)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=8, bos_token_id=0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    return config, state


def save_single_torch_dist(path: str) -> None:
    """One process, whole tensors, in Megatron's format."""
    state: dict[str, Any] = {
        k: db.ShardedTensor.from_box(k, M.full(k), s, (0,) * len(s))
        for k, (s, _) in M.SHAPES.items()
    }
    state["rng"] = [db.ShardedObject("rng_state", SEEDS[i], (4,), (i,)) for i in range(4)]
    state.update(iteration=42, note="bridge", scale=torch.full((3,), 0.5))
    db.save(state, path, format="torch_dist")


def _planner_state(rank: int, size: int) -> dict[str, Any]:
    """fc1 split by columns over ``size`` ranks, objects by cell, a plain step on every rank."""
    cols = 6 // size
    fc1 = M.full("decoder.fc1.weight")[:, rank * cols : (rank + 1) * cols].clone()
    state: dict[str, Any] = {
        "fc1": db.ShardedTensor.from_box("decoder.fc1.weight", fc1, (16, 6), (0, rank * cols)),
        "step": 9,
    }
    for i in range(rank, 4, size):
        state[f"rng{i}"] = db.ShardedObject("rng_state", SEEDS[i], (4,), (i,))
    return state


def dcp_save_with_our_planner(r: Rank, path: str) -> None:
    """torch's own ``dcp.save`` and writer, dcpbridge's planner, 2 ranks."""
    dcp.save(
        _planner_state(r.rank, r.size),
        storage_writer=dcp.FileSystemWriter(path),
        planner=ShardedSavePlanner(),
        process_group=r.group,
    )


def save_gpt2_shards(r: Rank, source: str, path: str) -> None:
    """The GPT-2 state of ``source`` saved by dcpbridge on 2 ranks: rows split where even."""
    full = torch.load(source, weights_only=True)
    state: dict[str, Any] = {"iteration": 7}
    for k, v in full.items():
        if v.dim() and v.shape[0] % r.size == 0:
            part = v.chunk(r.size)[r.rank].clone()
            state[k] = db.ShardedTensor.from_rank_offsets(k, part, (0, r.rank, r.size))
        else:
            state[k] = v
    db.save(state, path, process_group=r.group)


def save_gpt2_hf(r: Rank, source: str, path: str) -> None:
    """The GPT-2 state of ``source`` written by ``db.save_hf`` on 2 ranks: columns split
    where even (DTensors), the rest plain; small files, so an index."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(r.group, "cpu")
    state: dict[str, Any] = {}
    for k, v in torch.load(source, weights_only=True).items():
        if v.dim() == 2 and v.shape[1] % r.size == 0:
            part = v.chunk(r.size, dim=1)[r.rank].clone()
            state[k] = DTensor.from_local(part, mesh, [Shard(1)], run_check=False)
        else:
            state[k] = v
    db.save_hf(state, path, process_group=r.group, max_shard_bytes=GPT2_SHARD_BYTES)


GPT2_SHARD_BYTES = 8000


def _convert(capsys, src: str, dst: str, to: str) -> None:
    code = cli.main(["convert", src, dst, "--to", to, "--no-progress"])
    assert code == 0, capsys.readouterr().err


@pytest.fixture(scope="module")
def made(pool, tmp_path_factory) -> dict[str, Any]:
    """Every checkpoint of the module, by name, with the GPT-2 reference state."""
    root = tmp_path_factory.mktemp("portable")
    paths = {
        n: str(root / n)
        for n in (
            "td_single", "td_ranks", "dcp_single", "dcp_ranks", "gpt2_single", "gpt2_ranks",
            "gpt2_hf",
        )
    }  # fmt: skip
    os.makedirs(paths["td_ranks"])
    pool.run(bridge_save_torch_dist, 2, paths["td_ranks"], False, timeout=120)
    save_single_torch_dist(paths["td_single"])
    dcp.save(
        _planner_state(0, 1),
        storage_writer=dcp.FileSystemWriter(paths["dcp_single"]),
        planner=ShardedSavePlanner(),
        no_dist=True,
    )
    pool.run(dcp_save_with_our_planner, 2, paths["dcp_ranks"])
    config, gpt2 = _gpt2()
    source = str(root / "gpt2.pt")
    torch.save(gpt2, source)
    db.save({**gpt2, "iteration": 7}, paths["gpt2_single"])
    pool.run(save_gpt2_shards, 2, source, paths["gpt2_ranks"])
    pool.run(save_gpt2_hf, 2, source, paths["gpt2_hf"])
    return {"paths": paths, "root": root, "config": config, "gpt2": gpt2}


@pytest.fixture(scope="module")
def foreign_pool() -> Iterator[WorkerPool]:
    """4 gloo ranks in which ``import dcpbridge`` fails, megatron-core imported (once, before
    they were forked: every rank runs Megatron's load first)."""
    p = WorkerPool(size=4, blocked=("dcpbridge",), preload=("megatron.core.dist_checkpointing",))
    yield p
    p.close()


def _check_torch_dist_common(common: dict[str, Any]) -> None:
    assert common["iteration"] == 42 and common["note"] == "bridge"
    assert torch.equal(common["scale"], torch.full((3,), 0.5))


def test_native_checkpoints_hold_no_pickle(made):
    """dcpbridge's own format writes no DCP ``.metadata``: its commit document is JSON."""
    for name in ("gpt2_single", "gpt2_ranks"):
        path = made["paths"][name]
        names = os.listdir(path)
        assert ".metadata" not in names and "dcpbridge.json" in names, names
        with open(os.path.join(path, "dcpbridge.json")) as f:
            assert json.load(f)["planner_data"]["common"]


@pytest.mark.timeout(600)
def test_single_process_readers_without_dcpbridge(made, tmp_path, capsys):
    paths = made["paths"]
    exports = {}
    for name in ("gpt2_single", "gpt2_ranks"):
        for to in ("torch", "safetensors"):
            dst = str(tmp_path / f"{name}.pt") if to == "torch" else str(tmp_path / name)
            _convert(capsys, paths[name], dst, to)
            exports[f"{name}_{to}"] = dst
        made["config"].save_pretrained(exports[f"{name}_safetensors"])
    exports["gpt2_hf_safetensors"] = paths["gpt2_hf"]  # db.save_hf on 2 ranks
    made["config"].save_pretrained(paths["gpt2_hf"])
    checks = [
        {"kind": "megatron", "name": "mc_single", "path": paths["td_single"], "shapes": SHAPES,
         "grids": GRIDS},
        {"kind": "megatron", "name": "mc_ranks", "path": paths["td_ranks"], "shapes": SHAPES,
         "grids": GRIDS},
        {"kind": "dcp", "name": "dcp_td_single", "path": paths["td_single"], "shapes": SHAPES,
         "objects": CELLS},
        {"kind": "dcp", "name": "dcp_td_ranks", "path": paths["td_ranks"], "shapes": SHAPES,
         "objects": CELLS},
        {"kind": "torch_dist_files", "name": "files_single", "path": paths["td_single"]},
        {"kind": "torch_dist_files", "name": "files_ranks", "path": paths["td_ranks"]},
    ]  # fmt: skip
    fc1 = {"decoder.fc1.weight": SHAPES["decoder.fc1.weight"]}
    for name in ("dcp_single", "dcp_ranks"):
        checks.append(
            {"kind": "dcp", "name": name, "path": paths[name], "shapes": fc1, "objects": CELLS}
        )
    for name in ("gpt2_single", "gpt2_ranks", "gpt2_hf"):
        if name != "gpt2_hf":
            checks.append(
                {"kind": "torch", "name": f"{name}_torch", "path": exports[f"{name}_torch"]}
            )
        for kind in ("safetensors", "transformers"):
            path = exports[f"{name}_safetensors"]
            checks.append({"kind": kind, "name": f"{name}_{kind}", "path": path})
    spec, out = tmp_path / "spec.json", tmp_path / "out.pt"
    spec.write_text(json.dumps(checks))
    env = blocked_env(str(tmp_path), ("dcpbridge",))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.foreign", str(spec), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    assert "dcpbridge is blocked" in got["blocked"] and "blocked" in got["still_blocked"]

    for name in ("mc_single", "mc_ranks"):  # Megatron-Core, whole tensors in one process
        res = got[name]
        assert all(torch.equal(res["tensors"][k], M.full(k)) for k in M.SHAPES), name
        assert [res["objects"][f"rng_state/{i}"] for i in range(4)] == SEEDS, name
        _check_torch_dist_common(res["common"])
    for name in ("dcp_td_single", "dcp_td_ranks"):  # plain dcp.load of the torch_dist files
        state = got[name]
        assert all(torch.equal(state[k], M.full(k)) for k in M.SHAPES), name
        assert [state[c] for c in CELLS] == [[s] for s in SEEDS], name  # Megatron's [value]
    for name in ("files_single", "files_ranks"):
        files = got[name]
        assert files["config"]["sharded_backend"] == "torch_dist"
        _check_torch_dist_common(files["common"])
    for name in ("dcp_single", "dcp_ranks"):  # torch's writer, dcpbridge's planner
        state = got[name]
        assert torch.equal(state["decoder.fc1.weight"], M.full("decoder.fc1.weight")), name
        assert [state[c] for c in CELLS] == SEEDS, name
    gpt2 = made["gpt2"]
    for name in ("gpt2_single", "gpt2_ranks", "gpt2_hf"):
        if name != "gpt2_hf":
            pt = got[f"{name}_torch"]
            assert pt["iteration"] == 7 and set(pt) - {"iteration"} == set(gpt2), name
            assert all(torch.equal(pt[k], v) for k, v in gpt2.items()), name
        st = got[f"{name}_safetensors"]
        assert set(st) == set(gpt2) and all(torch.equal(st[k], v) for k, v in gpt2.items())
        hf = got[f"{name}_transformers"]
        assert all(torch.equal(hf[k], v) for k, v in gpt2.items()), name
        assert torch.equal(hf["lm_head.weight"], gpt2["transformer.wte.weight"])  # tied
    one = str(tmp_path / "gpt2_one_process")  # save_hf's index is the one-process export's
    source = db.open_source(str(made["root"] / "gpt2.pt"))
    db.export_safetensors(source, one, max_shard_bytes=GPT2_SHARD_BYTES)
    source.close()
    index = "model.safetensors.index.json"
    with open(os.path.join(one, index)) as a, open(os.path.join(paths["gpt2_hf"], index)) as b:
        assert json.load(a) == json.load(b)


@pytest.mark.timeout(600)
def test_megatron_and_dcp_load_on_4_ranks_without_dcpbridge(made, foreign_pool):
    paths = made["paths"]
    for name in ("td_single", "td_ranks"):
        got = foreign_pool.run(
            foreign.megatron_load, 4, paths[name], SHAPES, GRIDS, default_group=True, timeout=180
        )
        for rank, res in enumerate(got):
            assert "dcpbridge is blocked" in res["blocked"]
            for k, (shape, _) in M.SHAPES.items():
                want = M.full(k)
                if shape[0] % 4 == 0:  # Megatron's layout: rows split 4 ways
                    want = want.chunk(4)[rank]
                assert torch.equal(res["tensors"][k], want), (name, rank, k)
            assert res["objects"] == {f"rng_state/{rank}": SEEDS[rank]}, (name, rank)
            _check_torch_dist_common(res["common"])
    fc1 = {"decoder.fc1.weight": SHAPES["decoder.fc1.weight"]}
    for name, shapes, wrapped in [
        ("td_single", SHAPES, True),
        ("td_ranks", SHAPES, True),
        ("dcp_single", fc1, False),
        ("dcp_ranks", fc1, False),
    ]:
        got = foreign_pool.run(
            foreign.dcp_load, 4, paths[name], shapes, CELLS, default_group=True, timeout=120
        )
        for rank, res in enumerate(got):
            assert "dcpbridge is blocked" in res["blocked"]
            state = res["state"]
            assert all(torch.equal(state[k], M.full(k)) for k in shapes), (name, rank)
            assert [state[c] for c in CELLS] == [[s] if wrapped else s for s in SEEDS]
