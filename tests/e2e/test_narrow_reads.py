"""Narrow reads stay narrow with checksums on: a 2 -> 4 rank reshard split on dim 1 reads
(counted by the reader, not timed) no more than the bytes it needs; format 2 still loads."""

from __future__ import annotations

import json
import os

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from dcpbridge.storage.backends import store
from dcpbridge.storage.format.document import METADATA_FILE
from tests.support.dist_pool import Rank
from tests.support.old_formats import rewrite_as

ROWS, COLS, TENSORS = 512, 4096, 3  # float32: each rank of 2 saves 1024 KiB rows x 2 MiB


def full(i: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i))


def save_rows(r: Rank, path: str) -> None:
    sd = {
        f"w{i}": db.ShardedTensor.from_rank_offsets(
            f"w{i}", full(i).chunk(r.size)[r.rank].clone(), (0, r.rank, r.size)
        )
        for i in range(TENSORS)
    }
    db.save(sd, path, process_group=r.group)


def load_split(r: Rank, path: str, dim: int, verify: bool) -> int:
    """Load this rank's part of every tensor split on ``dim``; returns the bytes it read."""
    parts = {f"w{i}": full(i).chunk(r.size, dim=dim)[r.rank] for i in range(TENSORS)}
    sd = {
        k: db.ShardedTensor.from_rank_offsets(k, torch.zeros_like(v), (dim, r.rank, r.size))
        for k, v in parts.items()
    }
    reader = db.FsspecCheckpointReader(path, verify_checksums=verify)
    dcp.load(sd, storage_reader=reader, planner=db.ShardedLoadPlanner(), process_group=r.group)
    assert all(torch.equal(sd[k].data, v) for k, v in parts.items())
    return reader.bytes_read


@pytest.mark.parametrize("dim", [1, 0])
def test_reshard_two_to_four_reads_only_what_it_needs_with_checksums(pool, tmp_path, dim):
    path = str(tmp_path / "ck")
    pool.run(save_rows, 2, path)
    read = sum(pool.run(load_split, 4, path, dim, True))
    needed = TENSORS * ROWS * COLS * 4  # every element is needed by exactly one rank
    assert read / needed <= 1.1, read / needed
    assert read == needed  # here the column groups of the checksum tiles fit the split exactly


def test_format_2_checkpoints_still_load_and_verify(pool, tmp_path):
    path = str(tmp_path / "ck")
    pool.run(save_rows, 2, path)
    rewrite_as(path, 2)
    assert db.load_tensors_metadata(path)  # the document is valid format 2
    read = sum(pool.run(load_split, 4, path, 1, True))
    assert read == 4 * TENSORS * ROWS * COLS * 4  # 1 MiB blocks of 64 whole rows: 4x the need
    with open(os.path.join(path, METADATA_FILE)) as f:
        chunk = json.load(f)["tensors"]["w1"]["chunks"][1]
    with open(os.path.join(path, chunk["file"]), "r+b") as f:  # flip one byte of w1's 2nd chunk
        f.seek(chunk["offset"] + 5000)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    tmpl = {"w1": db.ShardedTensor.from_box("w1", torch.zeros(ROWS, 8), (ROWS, COLS), (0, 0))}
    with pytest.raises(db.ChecksumMismatchError, match=r"'w1' chunk \[256, 0\].*block 0"):
        db.load(tmpl, path)


def _flip(path: str, key: str, at: int) -> None:
    """Flip one bit of byte ``at`` of ``key``'s first stored chunk (any fsspec URL)."""
    with fsspec.open(f"{path}/{METADATA_FILE}", "rb") as f:
        chunk = json.load(f)["tensors"][key]["chunks"][0]
    fs, root = fsspec.core.url_to_fs(path)
    name = f"{root}/{chunk['file']}"
    data = bytearray(fs.cat_file(name))
    data[chunk["offset"] + at] ^= 1
    fs.pipe_file(name, bytes(data))


def _left_half(path: str) -> tuple[torch.Tensor, int]:
    """Columns [0, COLS/2) of ``w0`` stored whole, loaded with checksums; and bytes read."""
    out = torch.zeros(ROWS, COLS // 2)
    sd = {"w0": db.ShardedTensor.from_box("w0", out, (ROWS, COLS), (0, 0))}
    reader = db.FsspecCheckpointReader(path, verify_checksums=True)
    dcp.load(sd, storage_reader=reader, planner=db.ShardedLoadPlanner(), no_dist=True)
    return out, reader.bytes_read


@pytest.mark.parametrize("where", ["local", "local-prefetched", "local-unmapped", "memory"])
def test_column_split_reads_only_needed_rows_and_verifies_only_what_it_delivers(
    tmp_path, request, monkeypatch, where
):
    """Half of each 16 KiB row is needed: local disk copies the halves out of the mapped file
    (reading nothing else); memory:// and a kernel that cannot populate mappings join the rows
    into one span by the cost model (the skipped halves read but never delivered). Either way
    a flipped byte in an unneeded half is not this load's concern and a flipped byte in a
    needed half fails the load (also with the coming boxes populated by a thread ahead)."""
    if where == "local-prefetched":  # any size: the thread populates while boxes are copied
        monkeypatch.setattr(store, "PREFETCH_MIN", 0)
        monkeypatch.setattr(store, "PREFETCH_AHEAD", 0)
    if where == "local-unmapped":  # an advice the kernel refuses (EINVAL), as before 5.14
        monkeypatch.setattr(store, "_MADV_POPULATE_READ", 12345)
    if where == "memory":
        request.getfixturevalue("memory_store")
        path = "memory://narrow/ck"
    else:
        path = str(tmp_path / "ck")
    full0 = full(0)
    db.save({"w0": db.ShardedTensor.from_box("w0", full0, (ROWS, COLS), (0, 0))}, path)
    out, read = _left_half(path)
    assert torch.equal(out, full0[:, : COLS // 2])
    row = COLS * 4
    joined = (ROWS - 1) * row + row // 2  # one span: the needed halves and the gaps
    mapped = where in ("local", "local-prefetched")
    assert read == (ROWS * row // 2 if mapped else joined)
    _flip(path, "w0", 100 * row + row // 2 + 8)  # row 100, in the unneeded right half
    out, _ = _left_half(path)
    assert torch.equal(out, full0[:, : COLS // 2])
    _flip(path, "w0", 300 * row + 8)  # row 300, in the needed left half
    tmpl = {
        "w0": db.ShardedTensor.from_box("w0", torch.zeros(ROWS, COLS // 2), (ROWS, COLS), (0, 0))
    }
    with pytest.raises(db.ChecksumMismatchError, match=r"'w0' chunk \[0, 0\]"):
        db.load(tmpl, path)
