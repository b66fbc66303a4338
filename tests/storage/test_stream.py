"""The streaming writer produces exactly the on-disk format of a regular save."""

from __future__ import annotations

import io
import json
import os

import fsspec
import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

import dcpbridge as db
from dcpbridge.storage import resolve
from dcpbridge.storage.format import checksum
from dcpbridge.storage.format.document import METADATA_FILE
from dcpbridge.storage.write.items import tensor_bytes
from dcpbridge.storage.write.stream import StreamWriter, commit, new_save_id


def _parts(t: torch.Tensor, sizes: list[int]) -> list[memoryview]:
    """``t``'s bytes cut into pieces of the given sizes (the rest as the last piece)."""
    raw, out, pos = tensor_bytes(t), [], 0
    for n in sizes:
        out.append(raw[pos : pos + n])
        pos += n
    out.append(raw[pos:])
    return out


def _stream_checkpoint(url: str, w: torch.Tensor, common: dict, **writer_kw) -> None:
    """``w`` as two row chunks written by two workers, plus the common state object."""
    loc = resolve(url)
    save_id = new_save_id()
    items = {}
    halves = [(0, w[:5]), (5, w[5:])]
    for worker, (row, part) in enumerate(halves):
        with StreamWriter(loc, save_id=save_id, worker=worker, **writer_kw) as sw:
            nbytes = part.numel() * part.element_size()
            sw.write_item(
                MetadataIndex("w", (row, 0)),
                _parts(part, [7, 1500, 3]),
                nbytes=nbytes,
                rank=worker,
                sizes=tuple(part.shape),
                dtype=part.dtype,
            )
            if worker == 0:
                buf = io.BytesIO()
                torch.save(common, buf)
                blob = memoryview(buf.getvalue())
                sw.write_item(MetadataIndex("__common__"), [blob], nbytes=len(blob), rank=0)
            items.update(sw.items)
    chunks = [
        ChunkStorageMetadata(torch.Size([row, 0]), torch.Size(part.shape)) for row, part in halves
    ]
    state = {
        "w": TensorStorageMetadata(TensorProperties(dtype=w.dtype), w.shape, chunks),
        "__common__": BytesStorageMetadata(),
    }
    block = writer_kw.get("checksum_block_size", checksum.DEFAULT_BLOCK_SIZE)
    commit(loc, state, items, save_id=save_id, world_size=2, checksum_block_size=block)


def _doc(path: str) -> dict:
    with open(os.path.join(path, METADATA_FILE)) as f:
        return json.load(f)


def test_stream_checkpoint_matches_a_regular_save_and_loads(tmp_path):
    w = torch.randn(12, 100)
    common = {"iteration": 7, "args": {"lr": 0.1}}
    streamed, saved = str(tmp_path / "streamed"), str(tmp_path / "saved")
    _stream_checkpoint(streamed, w, common)
    db.save(
        {
            "a": db.ShardedTensor.from_box("w", w[:5].clone(), (12, 100), (0, 0)),
            "b": db.ShardedTensor.from_box("w", w[5:].clone(), (12, 100), (5, 0)),
            **common,
        },
        saved,
    )
    s, r = _doc(streamed), _doc(saved)
    assert s["tensors"]["w"]["shape"] == r["tensors"]["w"]["shape"]
    for sc, rc in zip(s["tensors"]["w"]["chunks"], r["tensors"]["w"]["chunks"]):
        assert (sc["offsets"], sc["sizes"], sc["nbytes"], sc["checksums"]) == (
            rc["offsets"],
            rc["sizes"],
            rc["nbytes"],
            rc["checksums"],
        )
        assert sc["offset"] % 64 == 0
    assert s["objects"]["__common__"]["offset"] % 64 == 0  # items are aligned like a save's
    assert s["checksum"] == r["checksum"] and s["version"] == r["version"]
    assert sorted(s["files"]) == sorted(f for f in os.listdir(streamed) if f.endswith(".bin"))

    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(4, 100), (12, 100), (3, 0))}
    out = db.load(tmpl, streamed)
    assert torch.equal(out["w"], w[3:7])
    assert out["iteration"] == 7 and out["args"] == {"lr": 0.1}


def test_rollover_small_blocks_and_memory_url_round_trip():
    fs = fsspec.filesystem("memory")
    url = "memory://stream-test/ck"
    try:
        w = torch.arange(1200, dtype=torch.float64).reshape(12, 100)
        _stream_checkpoint(url, w, {"step": 1}, checksum_block_size=1000, max_file_bytes=1)
        doc = json.loads(fs.cat_file("/stream-test/ck/" + METADATA_FILE))
        assert len(doc["files"]) == 3  # worker 0 rolled over after its first item
        assert doc["checksum"]["block_size"] == 1000
        assert len(doc["tensors"]["w"]["chunks"][0]["checksums"]) == 5  # a row (800 B) each
        whole = {"w": db.ShardedTensor.from_box("w", torch.zeros_like(w), (12, 100), (0, 0))}
        out = db.load(whole, url)
        assert torch.equal(out["w"], w) and out["step"] == 1
        # The block checksums are really checked: corrupt one byte of the second chunk.
        f = "/stream-test/ck/" + doc["tensors"]["w"]["chunks"][1]["file"]
        raw = bytearray(fs.cat_file(f))
        raw[doc["tensors"]["w"]["chunks"][1]["offset"] + 10] ^= 1
        fs.pipe_file(f, bytes(raw))
        with pytest.raises(db.ChecksumMismatchError, match="block 0"):
            db.load(whole, url)
    finally:
        fs.rm("/stream-test", recursive=True)


def test_wrong_sizes_and_duplicates_are_refused(tmp_path):
    loc = resolve(str(tmp_path))
    with StreamWriter(loc, save_id=new_save_id()) as sw:
        with pytest.raises(ValueError, match="3 bytes written, 4 expected"):
            sw.write_item(MetadataIndex("x"), [memoryview(b"abc")], nbytes=4, rank=0)
        sw.write_item(MetadataIndex("y"), [memoryview(b"abcd")], nbytes=4, rank=0)
        with pytest.raises(ValueError, match="written twice"):
            sw.write_item(MetadataIndex("y"), [memoryview(b"abcd")], nbytes=4, rank=0)
