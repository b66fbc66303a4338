"""A checkpoint opened once: one handle per format, whose byte I/O serves loads and tools alike."""

from __future__ import annotations

import os

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

import dcpbridge as db
from dcpbridge.formats.checkpoint import Format, open_checkpoint
from dcpbridge.formats.dcp_files import DcpFileReader
from dcpbridge.formats.sources import open_source
from dcpbridge.storage import FsspecCheckpointReader
from tests.support import layouts as L


@pytest.fixture
def dcp_on_memory(memory_store):
    """A plain DCP checkpoint written by torch's own writer to memory://."""
    url = "memory://plain-dcp/ck"
    state = {"w": L.full("w"), "step": 7}
    dcp.save(state, storage_writer=FsspecWriter(url), no_dist=True)
    return url


def test_plain_dcp_on_a_url_loads_through_the_handles_byte_io(dcp_on_memory):
    checkpoint = open_checkpoint(dcp_on_memory)
    assert checkpoint.format == Format.DCP
    reader = checkpoint.reader()
    assert isinstance(reader, DcpFileReader) and reader.files is checkpoint.files
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(6, 8), (12, 8), (3, 0)), "step": 0}
    out = db.load(tmpl, dcp_on_memory)
    assert torch.equal(out["w"], L.full("w")[3:9]) and out["step"] == 7
    source = open_source(dcp_on_memory)
    assert source.checkpoint.files is not None and source.object("step") == 7
    assert torch.equal(source.read("w", (0, 2), (12, 3)), L.full("w")[:, 2:5])


def test_a_truncated_dcp_file_is_refused_at_open_naming_it(dcp_on_memory):
    fs = fsspec.filesystem("memory")
    (data,) = [p for p in fs.ls("/plain-dcp/ck", detail=False) if p.endswith(".distcp")]
    fs.pipe_file(data, fs.cat_file(data)[:100])
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(12, 8), (12, 8), (0, 0))}
    with pytest.raises(db.CorruptCheckpointError) as info:
        db.load(tmpl, dcp_on_memory)
    assert os.path.basename(data) in str(info.value) and "truncated" in str(info.value)


def test_each_format_gives_its_own_reader_or_a_clear_refusal(tmp_path, dcp_on_memory):
    reader = open_checkpoint(dcp_on_memory).reader()  # DCP metadata, read without pickle
    assert isinstance(reader, DcpFileReader)
    assert set(reader.read_metadata().state_dict_metadata) == {"w", "step"}
    bridge = str(tmp_path / "bridge")
    db.save({"w": db.ShardedTensor.from_box("w", L.full("w"), (12, 8), (0, 0))}, bridge)
    checkpoint = open_checkpoint(bridge)
    reader = checkpoint.reader()
    assert isinstance(reader, FsspecCheckpointReader)
    assert reader.checkpoint_id == checkpoint.location.url
    single = str(tmp_path / "model.pt")
    torch.save({"w": L.full("w")}, single)
    with pytest.raises(db.NotACheckpointError, match="convert"):
        open_checkpoint(single).reader()


@pytest.mark.parametrize("allow_pickle", [False, True])
@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_torch_file_is_refused_naming_it(tmp_path, damage, allow_pickle):
    """A torch.save file cut short, or bytes that are no torch.save file at all, raise
    CorruptCheckpointError naming the file (torch's error as the cause), not torch's bare
    RuntimeError, nor a pickle refusal that asks for the allow_pickle already given."""
    path = tmp_path / "model.pt"
    torch.save({"w": L.full("w")}, str(path))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if damage == "truncated" else b"not a checkpoint")
    with pytest.raises(
        db.CorruptCheckpointError, match=rf"{path}: not a readable torch\.save"
    ) as e:
        open_source(str(path), allow_pickle=allow_pickle)
    assert e.value.__cause__ is not None


def test_file_name_patterns_refuse_a_trailing_newline():
    """DCP data file and Hugging Face shard names ending in a newline are not theirs (the
    patterns ended in ``$``, which matches before a trailing newline)."""
    from dcpbridge.formats import safetensors_files, sources

    for pattern, name in (
        (sources._DISTCP, "__1_0.distcp"),
        (safetensors_files._HF_SHARD, "model-00001-of-00002.safetensors"),
    ):
        assert pattern.match(name) and pattern.match(name + "\n") is None


@pytest.mark.parametrize("fmt", ["dcpbridge", "dcp", "torch", "safetensors"])
def test_a_box_read_of_an_absent_key_or_outside_its_tensor_raises_by_name(tmp_path, fmt):
    """``open_source(...).read`` of a key the checkpoint lacks raises MissingEntryError naming
    it (a CheckpointError, not a bare KeyError), and a box outside the tensor, or of another
    rank, InvalidShardError in every format: a torch.save file returned what slicing left of it
    (4 rows for 10 asked, none for a negative offset, a 2-D box for a 1-D request)."""
    w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    url = str(tmp_path / "ck")
    if fmt == "dcpbridge":
        db.save({"w": w}, url)
    elif fmt == "dcp":
        dcp.save({"w": w}, checkpoint_id=url, no_dist=True)
    elif fmt == "torch":
        url += ".pt"
        torch.save({"w": w}, url)
    else:
        url += ".safetensors"
        from safetensors.torch import save_file

        save_file({"w": w}, url)
    source = open_source(url)
    assert torch.equal(source.read("w", (60, 4), (4, 8)), w[60:, 4:12])
    with pytest.raises(db.MissingEntryError, match="has no tensor 'nope'"):
        source.read("nope", (0,), (1,))
    boxes = (((60, 0), (10, 32)), ((-2, 0), (4, 32)), ((0,), (4,)), ((0, 0), (-1, 32)))
    for offsets, sizes in boxes:
        with pytest.raises(db.InvalidShardError, match="'w'"):
            source.read("w", offsets, sizes)
