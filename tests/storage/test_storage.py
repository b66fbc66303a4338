"""Storage classes on their own and inside plain torch.distributed.checkpoint."""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from dcpbridge.planners import ShardedLoadPlanner, ShardedSavePlanner
from dcpbridge.storage import FsspecCheckpointReader, FsspecCheckpointWriter
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.format.document import sign_document
from dcpbridge.storage.format.paths import resolve
from tests.support import layouts as L
from tests.support.dist_pool import Rank

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _dcp_save_with_our_planner(r: Rank, path: str) -> None:
    sd = {"model": {"w": L.shard("w", L.boxes("rows2", "w", r.rank)[0])}, "step": 3}
    dcp.save(
        sd,
        storage_writer=dcp.FileSystemWriter(path),
        planner=ShardedSavePlanner(),
        process_group=r.group,
    )


def _dcp_load_with_our_planner(r: Rank, path: str) -> None:
    box = L.boxes("cols4", "w", r.rank)[0]
    sd = {"model": {"w": L.template("w", box)}, "step": 0}
    dcp.load(
        sd,
        storage_reader=dcp.FileSystemReader(path),
        planner=ShardedLoadPlanner(),
        process_group=r.group,
    )
    assert torch.equal(sd["model"]["w"].data, L.expected("w", box))
    assert sd["step"] == 3


def test_planners_plug_into_plain_dcp(pool, tmp_path):
    path = str(tmp_path / "dcp")
    pool.run(_dcp_save_with_our_planner, 2, path)
    assert os.path.exists(os.path.join(path, ".metadata"))  # DCP's own format
    pool.run(_dcp_load_with_our_planner, 4, path)


def test_storage_plugs_into_plain_dcp_with_default_planners(tmp_path):
    sd = {"a": torch.randn(5, 7), "b": {"x": 1, "y": torch.ones(3, dtype=torch.bfloat16)}}
    dcp.save(sd, storage_writer=FsspecCheckpointWriter(str(tmp_path)))
    out = {"a": torch.zeros(5, 7), "b": {"x": 0, "y": torch.zeros(3, dtype=torch.bfloat16)}}
    dcp.load(out, storage_reader=FsspecCheckpointReader(str(tmp_path)))
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"]["y"], sd["b"]["y"])
    assert out["b"]["x"] == 1


def _save_rows(path: str, rows: int = 64, cols: int = 8192) -> torch.Tensor:
    full = torch.randn(rows, cols)
    sd = {
        f"p{i}": db.ShardedTensor.from_rank_offsets("w", full.chunk(2)[i].clone(), (0, i, 2))
        for i in range(2)
    }
    dcp.save(sd, storage_writer=FsspecCheckpointWriter(path), planner=ShardedSavePlanner())
    return full


@pytest.mark.parametrize(("dim", "verify"), [(0, True), (0, False), (1, False), (1, True)])
def test_reader_fetches_only_the_needed_bytes(tmp_path, dim, verify):
    full = _save_rows(str(tmp_path))
    piece = full.chunk(4, dim=dim)[1]
    offset = (16, 0) if dim == 0 else (0, 2048)
    req = {"w": db.ShardedTensor.from_box("w", torch.zeros_like(piece), tuple(full.shape), offset)}
    reader = FsspecCheckpointReader(str(tmp_path), verify_checksums=verify)
    dcp.load(req, storage_reader=reader, planner=ShardedLoadPlanner())
    assert torch.equal(req["w"].data, piece)
    needed = piece.numel() * 4
    if not verify:
        assert reader.bytes_read == needed
    elif dim == 0:  # rows 16..31 lie in one row of checksum tiles (rows 0..31) of chunk 0
        assert reader.bytes_read == 1 << 20
    else:  # columns 2048..4095 are whole column groups of tiles: verified, nothing more read
        assert reader.bytes_read == needed


def test_flipped_byte_is_caught_and_names_file_and_key(tmp_path):
    _save_rows(str(tmp_path))
    doc = json.loads((tmp_path / "dcpbridge.json").read_text())
    chunk = doc["tensors"]["w"]["chunks"][1]
    with open(tmp_path / chunk["file"], "r+b") as f:
        f.seek(chunk["offset"] + 12345)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(64, 8192), (64, 8192), (0, 0))}
    with pytest.raises(db.ChecksumMismatchError) as info:
        db.load(tmpl, str(tmp_path))
    assert (
        chunk["file"] in str(info.value)
        and "'w'" in str(info.value)
        and "block 3 (elements [0, 3072]+[32, 1024]" in str(info.value)
    )
    db.load(tmpl, str(tmp_path), verify_checksums=False)  # explicitly unchecked: loads


def test_metadata_is_json_and_cannot_point_outside_the_checkpoint(tmp_path):
    db.save({"w": db.ShardedTensor.from_box("w", torch.ones(4), (4,), (0,))}, str(tmp_path))
    meta = tmp_path / "dcpbridge.json"
    doc = json.loads(meta.read_text())
    assert doc["format"] == "dcpbridge" and doc["version"] == 4
    doc["tensors"]["w"]["chunks"][0]["file"] = "../../etc/passwd"
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(4), (4,), (0,))}
    meta.write_text(json.dumps(doc))  # edited without a matching digest
    with pytest.raises(db.CorruptCheckpointError, match="metadata digest"):
        db.load(tmpl, str(tmp_path))
    meta.write_bytes(sign_document(doc))  # a digest that matches: the path is still refused
    with pytest.raises(db.UnsafePathError, match=r"\.\./\.\./etc/passwd"):
        db.load(tmpl, str(tmp_path))


def test_plain_dcp_checkpoint_metadata_reads_without_allow_pickle(tmp_path):
    dcp.save({"a": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)))
    assert db.load_tensors_metadata(str(tmp_path))["a"].global_shape == (2,)
    with pytest.raises(db.NotACheckpointError, match=r"plain torch\.distributed\.checkpoint"):
        db.FsspecCheckpointReader(str(tmp_path)).read_metadata()  # dcpbridge's own format only


class _Exploit:
    """Unpickling this runs code: a checkpoint load must never do that unasked."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loading_never_executes_pickles_unless_allowed(tmp_path):
    marker = tmp_path / "pwned"
    path = str(tmp_path / "ck")
    db.save({"evil": db.ShardedObject("evil", _Exploit(str(marker)), (1,), (0,))}, path)
    with pytest.raises(db.PickleRefusedError, match="allow_pickle=True"):
        db.load({"evil": db.ShardedObject("evil", None, (1,), (0,))}, path)
    assert not marker.exists()


def test_damaged_object_bytes_without_checksums_are_a_corrupt_checkpoint(tmp_path):
    """Saved without checksums, an object's damaged torch.save bytes are refused by name (they
    raised torch.load's RuntimeError or UnicodeDecodeError)."""
    path = tmp_path / "ck"
    db.save({"rng": db.ShardedObject("rng", {"seed": 1}, (1,), (0,))}, str(path), checksums=False)
    item = json.loads((path / "dcpbridge.json").read_bytes())["objects"]["rng/shard_0_1"]
    data = path / item["file"]
    raw = bytearray(data.read_bytes())
    end = item["offset"] + item["nbytes"]
    raw[end - 22 : end - 18] = b"\xff\xff\xff\xff"  # the zip's end-of-directory record
    data.write_bytes(bytes(raw))
    tmpl = {"rng": db.ShardedObject("rng", None, (1,), (0,))}
    for allow_pickle in (False, True):
        with pytest.raises(db.CorruptCheckpointError, match="object 'rng/shard_0_1' is not rea"):
            db.load(tmpl, str(path), allow_pickle=allow_pickle)


def test_keys_cannot_place_files_outside_the_checkpoint(tmp_path):
    path = tmp_path / "ck"
    sd = {
        "a": db.ShardedTensor.from_box("../../escape", torch.ones(4), (4,), (0,)),
        "b": db.ShardedObject("/etc/passwd", 1, (1,), (0,)),
    }
    db.save(sd, str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert all(p.parent == path for p in path.rglob("*"))
    out = db.load(
        {"a": db.ShardedTensor.from_box("../../escape", torch.zeros(4), (4,), (0,))}, str(path)
    )
    assert torch.equal(out["a"], torch.ones(4))


def test_an_object_whose_header_is_damaged_is_corrupt_not_a_refused_pickle(tmp_path):
    """Bytes that do not start as torch.save output are damage: weights-only loading's refusal
    would otherwise advise allow_pickle=True for them."""
    path = tmp_path / "ck"
    db.save({"rng": db.ShardedObject("rng", {"seed": 1}, (1,), (0,))}, str(path), checksums=False)
    item = json.loads((path / "dcpbridge.json").read_bytes())["objects"]["rng/shard_0_1"]
    data = path / item["file"]
    raw = bytearray(data.read_bytes())
    raw[item["offset"]] ^= 0xFF  # 'PK' of the zip archive
    data.write_bytes(bytes(raw))
    tmpl = {"rng": db.ShardedObject("rng", None, (1,), (0,))}
    with pytest.raises(db.CorruptCheckpointError, match="object 'rng/shard_0_1' is not rea"):
        db.load(tmpl, str(path))


def test_automatic_data_files_follow_the_bytes_and_the_cores_per_rank(monkeypatch):
    from dcpbridge.storage.write import writer as W

    monkeypatch.setattr(W.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    mib = 1 << 20
    assert W.data_files(2048 * mib, 3) == 3  # the caller's choice stands
    assert W.data_files(10 * mib, None) == 2  # small saves: two files, as always
    assert W.data_files(512 * mib, None) == 4  # one per 128 MiB
    assert W.data_files(2048 * mib, None) == W.MOST_FILES == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 16 cores shared by 8 ranks: 2 each
    assert W.data_files(2048 * mib, None) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert W.data_files(2048 * mib, None) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert W.data_files(2048 * mib, None) == 8


def test_an_automatic_save_on_many_cores_writes_more_files_and_loads_bit_exact(
    tmp_path, monkeypatch
):
    from dcpbridge.storage.write import writer as W

    monkeypatch.setattr(W, "cores_per_rank", lambda: 16)
    monkeypatch.setattr(W, "_FILE_BYTES", 32 << 10)
    sd = {
        f"w{i}": torch.randn(64, 64, generator=torch.Generator().manual_seed(i)) for i in range(12)
    }
    db.save({k: db.ShardedTensor.from_box(k, v, (64, 64), (0, 0)) for k, v in sd.items()}, tmp_path)
    data = [n for n in os.listdir(tmp_path) if n.endswith(".bin")]
    assert len(data) == 6, data  # 12 x 16 KiB: one file per 32 KiB (at most 8)
    out = {k: torch.zeros(64, 64) for k in sd}
    db.load(
        {k: db.ShardedTensor.from_box(k, v, (64, 64), (0, 0)) for k, v in out.items()}, tmp_path
    )
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def _commit_repeatedly(root: str, fill: int, times: int) -> None:
    """A writer process: commit ``f`` ``times`` times, every byte ``fill``; exit 1 on error."""
    store = storage_for(resolve(root))
    try:
        for _ in range(times):
            store.commit_file("f", bytes([fill]) * _COMMIT_SIZE, "f.tmp", sync=False)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


_COMMIT_SIZE = 1 << 21


def test_concurrent_commits_of_one_name_never_mix_and_leave_no_temp_file(tmp_path):
    """Two writers committing the same name (with the same ``temp_name``) each publish a
    whole file of their own: they shared one temp file, so one truncated or renamed the
    other's half-written bytes (a mixed or short ``f``, or a failed rename)."""
    root = str(tmp_path / "c")
    storage_for(resolve(root)).makedirs()
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_commit_repeatedly, args=(root, b, 40)) for b in (1, 2)]
    for w in writers:
        w.start()
    seen = set()
    while any(w.is_alive() for w in writers):
        try:
            with open(os.path.join(root, "f"), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        assert len(data) == _COMMIT_SIZE and data.count(data[:1]) == _COMMIT_SIZE
        seen.add(data[0])
    for w in writers:
        w.join()
    assert [w.exitcode for w in writers] == [0, 0]
    assert seen <= {1, 2}
    assert os.listdir(root) == ["f"]


def test_a_folder_name_with_a_trailing_newline_is_not_a_spread_folder(tmp_path):
    """A folder ``p1a\\n`` is listed as itself, not opened as a spread folder whose files
    join the checkpoint's listing (the pattern ended in ``$``, which matches before a
    trailing newline)."""
    root = tmp_path / "c"
    (root / "p1a\n").mkdir(parents=True)
    (root / "p1a\n" / "__0_0.ab.bin").write_bytes(b"x")
    assert storage_for(resolve(str(root))).list_names() == ["p1a\n"]
