"""Offline reshard/convert machinery: slabs, work split, workers, failures, bounded memory."""

from __future__ import annotations

import json
import math
import os
import subprocess

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import dcpbridge as db
from dcpbridge.formats.layout import parse_layout, whole_tensors
from dcpbridge.formats.sources import open_source
from dcpbridge.planners import ShardedSavePlanner
from dcpbridge.tools.reshard import WorkItem, assign, plan_work, reshard, slabs
from tests.e2e.test_reshard import save_layout
from tests.support import layouts as L
from tests.support import preloaded
from tests.support.dist_pool import Rank


@pytest.mark.parametrize(
    ("sizes", "budget"),
    [
        ((12, 8), 4 * 8 * 3),
        ((12, 8), 1),
        ((1, 1, 5, 7), 4 * 7 * 2),
        ((3, 4, 5), 4 * 5 + 1),
        ((0, 5), 1),
    ],
)
def test_slabs_tile_the_box_in_c_order_within_budget(sizes, budget):
    full = torch.arange(math.prod(sizes), dtype=torch.float32).reshape(sizes)
    offsets = (0,) * len(sizes)
    pieces = list(slabs(offsets, sizes, 4, budget))
    flat = [full[tuple(slice(o, o + n) for o, n in zip(off, sz))].reshape(-1) for off, sz in pieces]
    assert torch.equal(torch.cat(flat) if flat else torch.empty(0), full.reshape(-1))
    if budget >= 4:  # a single element is the smallest slab
        assert all(math.prod(sz) * 4 <= budget for _, sz in pieces)


def test_assign_balances_bytes_deterministically():
    work = [WorkItem(f"k{i}", n, 0, (0,), (n,)) for i, n in enumerate([50, 10, 40, 30, 20, 20])]
    split = assign(work, 3)
    assert [sum(w.nbytes for w in part) for part in split] == [60, 60, 50]
    assert [[w.key for w in part] for part in split] == [["k0", "k1"], ["k2", "k5"], ["k3", "k4"]]
    assert assign(work, 3) == split and sum(map(len, assign(work, 7))) == len(work)


def reshard_on_workers(r: Rank, src: str, dst: str, layout_doc: dict) -> tuple[int, str | None]:
    """Every worker runs ``reshard``; returns (files written by this worker, error text)."""
    from dcpbridge.engine.collectives import Group

    source = open_source(src)
    try:
        reshard(source, dst, parse_layout(layout_doc), group=Group.resolve(r.group), slab_bytes=64)
    except db.CheckpointError as e:
        return 0, f"{type(e).__name__}: {e}"
    finally:
        source.close()
    return sum(n.startswith(f"__{r.rank}_") for n in os.listdir(dst)), None


LAYOUT4 = {"world_size": 4, "rules": [{"match": "*", "split": {"axis": 0}}]}


def test_workers_share_the_work_and_any_failure_stops_the_commit(pool, tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    pool.run(save_layout, 2, "cols2", src)
    results = pool.run(reshard_on_workers, 3, src, dst, LAYOUT4)
    assert [err for _, err in results] == [None] * 3 and all(n >= 1 for n, _ in results)
    with open(os.path.join(dst, "dcpbridge.json")) as f:
        doc = json.load(f)
    assert [c["rank"] for c in doc["tensors"]["idx"]["chunks"]] == [0, 1, 2, 3]
    pool.run(load_rows4, 4, dst, default_group=True)

    # Corrupt one stored chunk: the worker that reads it fails, every worker reports it,
    # and no commit file is written.
    with open(os.path.join(src, "dcpbridge.json")) as f:
        chunk = json.load(f)["tensors"]["w"]["chunks"][1]
    with open(os.path.join(src, chunk["file"]), "r+b") as f:
        f.seek(chunk["offset"])
        f.write(b"\xff\xff\xff\xff")
    bad = str(tmp_path / "bad")
    results = pool.run(reshard_on_workers, 3, src, bad, LAYOUT4)
    errors = {err for _, err in results}
    assert len(errors) == 1
    (err,) = errors
    assert (
        err.startswith("ChecksumMismatchError: rank") and "checksum mismatch in tensor 'w'" in err
    )
    assert not os.path.exists(os.path.join(bad, "dcpbridge.json"))


def load_rows4(r: Rank, path: str) -> None:
    tmpl = {k: L.template(k, L.boxes("rows4", k, r.rank)[0]) for k in L.TENSORS}
    out = db.load(tmpl, path)
    for k, sh in tmpl.items():
        assert torch.equal(out[k], L.expected(k, (sh.global_offset, sh.local_shape))), k


def test_torchrun_workers(tmp_path):
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    w = torch.randn(64, 32)
    db.save({"w": db.ShardedTensor.from_box("w", w, (64, 32), (0, 0)), "step": 3}, src)
    layout = tmp_path / "l.yaml"
    layout.write_text("world_size: 8\nrules: [{match: '*', split: {axis: 0}}]\n")
    args = ["--standalone", "--nproc-per-node", "2", "-m", "dcpbridge.tools.cli", "reshard"]
    args += [src, dst, "--layout", str(layout), "--no-progress", "-v"]
    try:  # 13 s alone; minutes on a loaded 2-core machine, whose output a timeout shows
        # torchrun's launcher, torch imported already; the workers are fresh interpreters
        proc = preloaded.run_module("torch.distributed.run", args, dict(os.environ), timeout=280)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun reshard hung; stdout:\n{e.stdout}\nstderr:\n{e.stderr}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(2 worker(s))" in proc.stdout and "8 target ranks" in proc.stdout
    names = os.listdir(dst)
    assert any(n.startswith("__0_") for n in names) and any(n.startswith("__1_") for n in names)
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(8, 32), (64, 32), (40, 0))}
    out = db.load(tmpl, dst)
    assert torch.equal(out["w"], w[40:48]) and out["step"] == 3


def _peak_rss_mib(*args: str) -> float:
    """The peak RSS of ``dcpbridge ARGS`` in a process forked from one that imported torch (its
    count starts there, not at this test process's peak; a fresh interpreter would import
    torch again for each of the three commands)."""
    return preloaded.cli_peak_rss(args) / 1024


def test_reshard_and_export_memory_stay_bounded(tmp_path):
    """A 256 MiB tensor moves through 4 MiB slabs: peak memory grows by a few slabs (measured:
    about 30 MiB), not by the tensor's size."""
    src = str(tmp_path / "big")
    big = torch.ones(64, 1 << 20)  # 256 MiB
    db.save({"big": db.ShardedTensor.from_box("big", big, tuple(big.shape), (0, 0))}, src)
    del big
    layout = tmp_path / "l.yaml"
    layout.write_text("world_size: 2\nrules: [{match: '*', split: {axis: 1}}]\n")
    base = _peak_rss_mib("inspect", src)
    resharded = _peak_rss_mib(
        "reshard",
        src,
        str(tmp_path / "out"),
        "--layout",
        str(layout),
        "--slab-size",
        "4MiB",
        "--no-progress",
    )
    exported = _peak_rss_mib(
        "convert",
        src,
        str(tmp_path / "big.pt"),
        "--to",
        "torch",
        "--slab-size",
        "4MiB",
        "--no-progress",
    )
    assert resharded - base < 100, (base, resharded)
    assert exported - base < 100, (base, exported)
    t = torch.load(str(tmp_path / "big.pt"), mmap=True, weights_only=True)["big"]
    assert t.shape == (64, 1 << 20) and bool((t[::17, ::4099] == 1).all())


def test_sources_read_dcp_safetensors_and_torch_files(pool, tmp_path):
    """Every input format yields the same tensors through ``Source.read``."""
    w = L.full("w")
    dcp_dir = str(tmp_path / "dcp")
    dcp.save(
        {"w": db.ShardedTensor.from_box("w", w, (12, 8), (0, 0)), "step": 4},
        storage_writer=dcp.FileSystemWriter(dcp_dir),
        planner=ShardedSavePlanner(),
    )
    st = str(tmp_path / "m.safetensors")
    save_file({"w": w, "b": torch.arange(3, dtype=torch.int32)}, st)
    pt = str(tmp_path / "m.pt")
    torch.save({"model": {"w": w}, "meta": {"epoch": 1}}, pt)
    # torch's writer pickles the planner's metadata: DCP's classes only, read without pickle
    for url, key in [(dcp_dir, "w"), (st, "w"), (pt, "model.w")]:
        source = open_source(url)
        assert source.tensors[key].shape == (12, 8)
        assert torch.equal(source.read(key, (3, 2), (5, 4)), w[3:8, 2:6]), url
        plan = plan_work(source, whole_tensors())
        assert [(x.offsets, x.sizes) for x in plan if x.key == key] == [((0, 0), (12, 8))]
        source.close()
    dcp_source = open_source(dcp_dir)
    assert dcp_source.reads_whole_chunks and dcp_source.object("step") == 4
    assert open_source(pt).common_state() == {"meta": {"epoch": 1}}


def test_torch_dist_save_and_load_through_an_fsspec_url():
    """format="torch_dist" on a URL: written through torch's FsspecWriter, read through ours."""
    fs = fsspec.filesystem("memory")
    url = "memory://torch-dist-url/ck"
    try:
        w = L.full("w")
        state = {
            "w": db.ShardedTensor.from_box("w", w, (12, 8), (0, 0)),
            "rng": db.ShardedObject("rng", {"seed": 5}, (1,), (0,)),
            "iteration": 3,
        }
        db.save(state, url, format="torch_dist")
        names = {n.rsplit("/", 1)[-1] for n in fs.ls("/torch-dist-url/ck", detail=False)}
        assert {"metadata.json", ".metadata", "common.pt"} <= names
        tmpl = {
            "w": db.ShardedTensor.from_box("w", torch.zeros(4, 8), (12, 8), (8, 0)),
            "rng": db.ShardedObject("rng", None, (1,), (0,)),
        }
        out = db.load(tmpl, url, allow_pickle=True)
        assert torch.equal(out["w"], w[8:]) and out["rng"] == {"seed": 5}
        assert out["iteration"] == 3
        with pytest.raises(ValueError, match="format must be 'dcpbridge' or 'torch_dist'"):
            db.save(state, url, format="zarr")
    finally:
        fs.rm("/torch-dist-url", recursive=True)


def test_an_export_never_counts_a_name_with_a_trailing_newline_as_its_own(tmp_path):
    """``model.safetensors\\n`` at an export's destination is not an earlier export's file,
    so ``--force`` leaves it (the pattern ended in ``$``, which matches before a trailing
    newline: it was removed as stale)."""
    from dcpbridge.storage.backends import storage_for
    from dcpbridge.storage.format.paths import resolve
    from dcpbridge.tools.export import stale_exports

    for name in ("model.safetensors", "model.safetensors\n"):
        (tmp_path / name).write_bytes(b"x")
    assert stale_exports(storage_for(resolve(str(tmp_path))), []) == ["model.safetensors"]


_WHOLE_BYTE_DTYPES = [
    torch.complex64,
    torch.float8_e8m0fnu,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]


def _every_byte(dtype: torch.dtype) -> torch.Tensor:
    """A (6, 4) tensor of ``dtype`` whose bytes run through many values (NaNs included)."""
    n = 6 * 4 * dtype.itemsize
    raw = torch.arange(n, dtype=torch.int64).mul(37).remainder(256).to(torch.uint8)
    return raw.view(dtype).reshape(6, 4)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", _WHOLE_BYTE_DTYPES, ids=str)
def test_safetensors_c64_and_other_float8_dtypes_load_and_export_bit_exact(tmp_path, dtype):
    """Files the ``safetensors`` package writes with C64, F8_E8M0 and the FNUZ float8 dtypes
    load bit-exact, and an export of such tensors is a file that package loads bit-exact
    (loads raised ``unsupported dtype``, exports ``safetensors cannot store dtype``)."""
    from safetensors.torch import load_file

    t = _every_byte(dtype)
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"x": t}, str(hf / "model.safetensors"))
    source = open_source(str(hf))
    assert source.tensors["x"].dtype == dtype
    assert torch.equal(_bytes(source.read("x", (1, 0), (3, 4))), _bytes(t[1:4]))
    source.close()
    out = db.load({"x": torch.zeros(6, 4, dtype=dtype)}, str(hf))
    assert torch.equal(_bytes(out["x"]), _bytes(t))
    db.save({"x": t}, str(tmp_path / "ck"))
    db.export_safetensors(open_source(str(tmp_path / "ck")), str(tmp_path / "out"))
    back = load_file(str(tmp_path / "out" / "model.safetensors"))["x"]
    assert back.dtype == dtype and torch.equal(_bytes(back), _bytes(t))


def test_a_safetensors_dtype_without_a_whole_byte_torch_dtype_is_refused_by_name(tmp_path):
    """F4 (two elements a byte) has no torch dtype element by element: loading it raises a
    ``CheckpointError`` naming the tensor and the dtype; exporting or ``save_hf`` of a dtype
    safetensors has no name for raises ``SerializationError`` (it raised the base class)."""
    packed = torch.zeros(2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"x": packed}, str(hf / "model.safetensors"))
    with pytest.raises(db.CorruptCheckpointError, match="tensor 'x' has unsupported dtype 'F4'"):
        open_source(str(hf))
    db.save({"x": packed}, str(tmp_path / "ck"))
    with pytest.raises(db.SerializationError, match="tensor 'x': safetensors cannot store dtype"):
        db.export_safetensors(open_source(str(tmp_path / "ck")), str(tmp_path / "out"))
    bits = torch.zeros(2, dtype=torch.int16).view(torch.bits16)
    with pytest.raises(db.SerializationError, match="'x': safetensors cannot store dtype") as e:
        db.save_hf({"x": bits}, str(tmp_path / "hf_out"))
    assert str(e.value).endswith("torch.bits16")
    assert not (tmp_path / "hf_out").exists()


def test_a_torch_dist_save_of_common_state_only_validates_and_converts(tmp_path, capsys):
    """A torch_dist save without sharded tensors stored its empty shard list as an object
    "shards" (DCP's rule for a list without tensors): ``validate --checksums``, ``convert`` and
    ``reshard`` then refused the checkpoint that loads fine. It stores no such object."""
    from dcpbridge.tools import cli

    state = {"w": L.full("w"), "b": torch.ones(7), "step": 3, "cfg": {"lr": 0.1}}
    src, dst = str(tmp_path / "td"), str(tmp_path / "out")
    db.save(state, src, format="torch_dist")
    assert set(open_source(src).objects) == {"__common__"}
    assert cli.main(["validate", "--checksums", src]) == 0
    assert f"OK: {src} (torch_dist" in capsys.readouterr().out
    assert cli.main(["convert", src, dst, "--to", "dcpbridge"]) == 0
    for path in (src, dst):
        out = db.load({"w": torch.zeros(12, 8), "b": torch.zeros(7)}, path)
        assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
        assert out["step"] == 3 and out["cfg"] == {"lr": 0.1}


def test_an_older_torch_dist_save_of_common_state_only_validates_and_converts(
    tmp_path, capsys, monkeypatch
):
    """Such saves by dcpbridge before 1925df2 hold an empty list as object "shards" (written
    here as they did): the offline tools skip it, as a load does (they refused it)."""
    import dcpbridge.engine.save as save_engine
    from dcpbridge.tools import cli

    made = save_engine._planner_and_writer

    def as_before(*args, **kwargs):
        state, planner, writer = made(*args, **kwargs)
        return state or {"shards": []}, planner, writer

    monkeypatch.setattr(save_engine, "_planner_and_writer", as_before)
    state = {"w": L.full("w"), "step": 3}
    src, dst = str(tmp_path / "td"), str(tmp_path / "out")
    db.save(state, src, format="torch_dist")
    monkeypatch.undo()
    assert "shards" in dcp.FileSystemReader(src).read_metadata().state_dict_metadata
    assert set(open_source(src).objects) == {"__common__"}
    assert cli.main(["validate", "--checksums", src]) == 0
    assert cli.main(["convert", src, dst, "--to", "dcpbridge"]) == 0
    for path in (src, dst):
        out = db.load({"w": torch.zeros(12, 8)}, path)
        assert torch.equal(out["w"], state["w"]) and out["step"] == 3


@pytest.mark.parametrize("to", ["reshard", "dcpbridge", "safetensors", "torch"])
def test_a_failed_reshard_or_export_removes_the_folders_it_created(tmp_path, capsys, to):
    """A failed reshard/convert into ``a/b/c`` removed ``c`` at most and left ``a/b``
    behind: every folder it created goes, an existing one stays."""
    from dcpbridge.tools import cli

    src = str(tmp_path / "src")
    db.save({"w": L.full("w"), "step": 1}, src)
    data = next(n for n in os.listdir(src) if n.endswith(".bin") and n.startswith("__0_0"))
    with open(os.path.join(src, data), "r+b") as f:  # a flipped byte: the read fails
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 0xFF]))
    layout = tmp_path / "layout.yaml"
    layout.write_text('world_size: 1\nrules:\n  - {match: "*", replicate: true}\n')
    (tmp_path / "kept").mkdir()
    dst = str(tmp_path / "kept" / "a" / "b" / ("m.pt" if to == "torch" else "c"))
    args = ["reshard", src, dst, "--layout", str(layout)] if to == "reshard" else []
    args = args or ["convert", src, dst, "--to", to]
    assert cli.main(args) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    assert os.listdir(tmp_path / "kept") == []


def _corrupt_first_data_file(src: str) -> None:
    """Flip one byte of the source's first data file: a read of it fails its checksum."""
    data = next(n for n in sorted(os.listdir(src)) if n.endswith(".bin"))
    with open(os.path.join(src, data), "r+b") as f:
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("shard_size", [None, "100"])
def test_a_failed_forced_safetensors_export_keeps_the_earlier_export_whole(
    tmp_path, capsys, shard_size
):
    """``convert --to safetensors --force`` into a folder holding an older export, failing
    halfway, left that export whole (it wrote ``model.safetensors`` and the shards in place,
    then removed them, and had removed the index first) and no temp file behind."""
    from dcpbridge.tools import cli

    dst = str(tmp_path / "hf")
    sizes = ["--max-shard-size", shard_size] if shard_size else []
    old = str(tmp_path / "old")
    db.save({"a": torch.arange(24.0).reshape(4, 6), "b": torch.ones(5, 6)}, old)
    assert cli.main(["convert", old, dst, "--to", "safetensors", *sizes, "--no-progress"]) == 0
    before = {n: (tmp_path / "hf" / n).read_bytes() for n in os.listdir(dst)}
    assert len(before) == (3 if shard_size else 1)
    new = str(tmp_path / "new")
    db.save({"a": torch.zeros(4, 6), "b": torch.zeros(5, 6)}, new)
    _corrupt_first_data_file(new)
    args = ["convert", new, dst, "--to", "safetensors", "--force", *sizes, "--no-progress"]
    assert cli.main(args) == 1
    assert "checksum mismatch" in capsys.readouterr().err
    assert {n: (tmp_path / "hf" / n).read_bytes() for n in os.listdir(dst)} == before
    out = db.load({"a": torch.empty(4, 6), "b": torch.empty(5, 6)}, dst)
    assert torch.equal(out["a"], torch.arange(24.0).reshape(4, 6))
    assert torch.equal(out["b"], torch.ones(5, 6))


def test_a_safetensors_export_removes_the_temp_files_of_a_killed_earlier_one(tmp_path):
    """The ``.partial`` files a killed export left (any shard count) are removed by the next
    export into that folder, which publishes its own in their place."""
    from dcpbridge.tools.export import export_safetensors

    src = str(tmp_path / "src")
    db.save({"a": torch.arange(24.0).reshape(4, 6), "b": torch.ones(5, 6)}, src)
    dst = tmp_path / "hf"
    dst.mkdir()
    killed = ["model.safetensors.partial", "model-00002-of-00007.safetensors.partial"]
    for name in [*killed, "notes.partial"]:
        (dst / name).write_bytes(b"x" * 64)
    for limit, files in [(100, 3), (10**9, 1)]:
        result = export_safetensors(open_source(src), str(dst), max_shard_bytes=limit)
        assert sorted(os.listdir(dst)) == sorted([*result.files, "notes.partial"])
        assert len(result.files) == files
        out = db.load({"a": torch.empty(4, 6), "b": torch.empty(5, 6)}, str(dst))
        assert torch.equal(out["a"], torch.arange(24.0).reshape(4, 6))
        assert torch.equal(out["b"], torch.ones(5, 6))


def test_a_safetensors_export_over_an_earlier_one_publishes_on_every_backend(backend, tmp_path):
    """Each file written as ``<name>.partial`` and renamed into place (on S3: copied) once
    all are durable: an export over an earlier one of another shard count leaves exactly its
    own files, loading bit-exact, local, memory:// and S3 alike."""
    from dcpbridge.tools.export import export_safetensors

    src = str(tmp_path / "src")
    db.save({"a": torch.arange(24.0).reshape(4, 6), "b": torch.ones(5, 6)}, src)
    url = backend.url("hf")
    opts = backend.storage_options
    for limit in (100, 10**9, 100):
        result = export_safetensors(
            open_source(src), url, storage_options=opts, max_shard_bytes=limit
        )
        assert backend.names("hf") == sorted(result.files)
        tmpl = {"a": torch.empty(4, 6), "b": torch.empty(5, 6)}
        out = db.load(tmpl, url, storage_options=opts)
        assert torch.equal(out["a"], torch.arange(24.0).reshape(4, 6))
        assert torch.equal(out["b"], torch.ones(5, 6))


@pytest.mark.parametrize("fmt", ["dcpbridge", "torch_dist"])
def test_convert_to_torch_keeps_the_tensors_inside_objects_and_common_state(tmp_path, fmt):
    """``convert --to torch`` wrote every tensor's data region blank but the checkpoint's
    own tensors: a tensor in an object or in torch_dist's common.pt (an optimizer step, a
    scale) came out as zeros."""
    from dcpbridge.tools import cli

    w, plain, step = L.full("w"), torch.arange(5, dtype=torch.int32) + 7, torch.tensor(9.5)
    state = {
        "w": db.ShardedTensor.from_box("w", w, tuple(w.shape), (0, 0)),
        "o": db.ShardedObject("o", {"t": torch.arange(3.0) + 1, "n": 2}, (1,), (0,)),
        "opt": {"state": {0: {"step": step}}, "pair": (plain, "x")},
    }
    src, dst = str(tmp_path / fmt), str(tmp_path / f"{fmt}.pt")
    db.save(state, src, format=fmt)
    assert cli.main(["convert", src, dst, "--to", "torch"]) == 0
    out = torch.load(dst, weights_only=True)
    assert torch.equal(out["w"], w)
    assert torch.equal(out["o/shard_0_1"]["t"], torch.arange(3.0) + 1)
    if fmt == "dcpbridge":  # the common state by its DCP keys (the tuple is an object)
        out["opt"] = {"state": {0: {"step": out.pop("opt.state.0.step")}}, "pair": out["opt.pair"]}
    assert torch.equal(out["opt"]["state"][0]["step"], step)
    assert torch.equal(out["opt"]["pair"][0], plain) and out["opt"]["pair"][1] == "x"


def test_safetensors_export_of_torch_dist_keeps_the_tensors_of_its_common_state(tmp_path):
    """A torch_dist save keeps plain tensors in ``common.pt``: ``convert --to safetensors``
    skipped them as an object (no error, the file lacked them) while ``--to torch`` and a
    dcpbridge-format save of the same state export them. They are exported, bit-exact."""
    from safetensors.torch import load_file

    bits = torch.tensor([-0.0, float("nan"), 1.5], dtype=torch.bfloat16)
    state = {
        "w": db.ShardedTensor.from_box("w", L.full("w"), (12, 8), (0, 0)),
        "plain": {"b": bits, "e": torch.zeros(4, 0, 3, dtype=torch.int32)},
        "step": 3,
    }
    src = str(tmp_path / "td")
    db.save(state, src, format="torch_dist")
    result = db.export_safetensors(open_source(src), str(tmp_path / "st"))
    out = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert sorted(out) == ["plain.b", "plain.e", "w"]
    assert torch.equal(out["plain.b"].view(torch.int16), bits.view(torch.int16))
    assert out["plain.e"].shape == (4, 0, 3) and out["plain.e"].dtype == torch.int32
    assert torch.equal(out["w"], L.full("w"))
    assert result.tensors == 3


def test_reshard_of_only_empty_tensors_split_over_ranks_commits(tmp_path):
    """A layout that splits an empty tensor gives it no boxes: with nothing else stored, the
    reshard wrote no item at all and its commit refused its own document ("refusing to
    commit invalid metadata: no block checksums recorded"). It commits the empty tensor."""
    src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
    db.save({"e": db.ShardedTensor.from_box("e", torch.empty(0, 3), (0, 3), (0, 0))}, src)
    layout = parse_layout({"world_size": 2, "rules": [{"match": "e", "split": {"axis": 1}}]})
    reshard(open_source(src), dst, layout)
    out = db.load({"e": torch.ones(0, 3)}, dst)
    assert out["e"].shape == (0, 3) and out["e"].dtype == torch.float32
    assert db.load_tensors_metadata(dst)["e"].global_shape == (0, 3)


def test_validate_checksums_of_plain_dcp_counts_the_objects_it_read(tmp_path, capsys):
    """``validate --checksums`` of a plain DCP checkpoint reads every item, objects included,
    but reported only the tensors' bytes as read (8 KiB of a checkpoint whose objects it read
    too): the count now holds every byte it read."""
    from dcpbridge.tools import cli
    from dcpbridge.tools.report import human_bytes

    src = str(tmp_path / "dcp")
    state = {"w": torch.ones(64, 32), "step": 7, "cfg": {"lr": 0.1, "name": "x" * 5000}}
    dcp.save(state, checkpoint_id=src, no_dist=True)
    source = open_source(src)
    read = sum(t.nbytes for t in source.tensors.values())
    read += sum(len(source.object_bytes(k)) for k in source.objects)
    assert read > 64 * 32 * 4 + 5000
    assert cli.main(["validate", "--checksums", "--no-progress", src]) == 0
    assert f"; {human_bytes(read)} read and verified)" in capsys.readouterr().out
