"""The coordinator's data files synced on a thread while the commit is encoded: every file is
durable before ``dcpbridge.json`` is committed, and a failed sync leaves nothing behind."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import dcpbridge as db
from dcpbridge.storage.backends.store import LocalStorage
from dcpbridge.storage.write import commit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict[str, db.ShardedTensor]:
    """Enough small tensors for two data files (the writer's default two threads)."""
    g = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(5, 3, generator=g) for i in range(40)}
    tensors["b"] = torch.arange(7, dtype=torch.int16)
    return {
        k: db.ShardedTensor.from_box(k, t, tuple(t.shape), (0,) * t.dim())
        for k, t in tensors.items()
    }


def test_data_files_synced_before_commit_and_load_bit_exact(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    threads: set[str] = set()
    sync, commit = LocalStorage.sync, LocalStorage.commit_file

    def record_sync(self, f):
        sync(self, f)
        events.append(("sync", os.path.basename(f.name)))
        threads.add(threading.current_thread().name.split("_")[0])

    def record_commit(self, name, *args, **kwargs):
        events.append(("commit", name))
        return commit(self, name, *args, **kwargs)

    monkeypatch.setattr(LocalStorage, "sync", record_sync)
    monkeypatch.setattr(LocalStorage, "commit_file", record_commit)
    state = _state()
    db.save(state, tmp_path)
    data = sorted(n for n in os.listdir(tmp_path) if n != "dcpbridge.json")
    assert len(data) == 2
    assert events == [*(("sync", n) for n in data), ("commit", "dcpbridge.json")]
    assert threads == {"dcpb-sync"}  # synced while the commit was encoded
    out = {k: torch.zeros_like(s.data) for k, s in state.items()}
    db.load(
        {
            k: db.ShardedTensor.from_box(k, t, tuple(t.shape), (0,) * t.dim())
            for k, t in out.items()
        },
        tmp_path,
    )
    for k, s in state.items():
        assert out[k].dtype == s.data.dtype and torch.equal(out[k], s.data), k


def test_failed_sync_raises_and_leaves_nothing(tmp_path, monkeypatch):
    def failing_sync(self, f):
        raise OSError(5, "injected fsync failure")

    monkeypatch.setattr(LocalStorage, "sync", failing_sync)
    with pytest.raises(db.CheckpointError, match=r"write __\d") as err:
        db.save(_state(), tmp_path)
    assert isinstance(err.value.__cause__, OSError)
    assert "injected fsync failure" in str(err.value.__cause__)
    assert os.listdir(tmp_path) == []


def test_failed_encoding_joins_the_syncs_and_leaves_nothing(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise db.InvalidArgumentError("injected encoding refusal")

    monkeypatch.setattr(commit, "encode_index", refuse)
    with pytest.raises(db.CheckpointError, match="injected encoding refusal"):
        db.save(_state(), tmp_path)
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("dcpb-sync")]
