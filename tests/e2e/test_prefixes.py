"""Data files spread over hashed prefixes (storage option / profile option ``prefixes``), on
the real S3 server: where objects land, round trips, the CLI, re-saves and failed saves."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

import dcpbridge as db
from dcpbridge.storage.backends import storage_for
from dcpbridge.storage.format.paths import resolve, spread_dir
from dcpbridge.storage.write.writer import FsspecCheckpointWriter
from tests.storage.test_backends import COMMON, check_loaded, layout_state
from tests.support import layouts as L
from tests.support.dist_pool import Rank
from tests.tools.test_cli import LAYOUT, run_cli

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def save_spread(r: Rank, url: str, options: dict[str, Any]) -> None:
    db.save(
        {"common": COMMON, **layout_state("rows2", [r.rank])},
        url,
        process_group=r.group,
        storage_options=options,
        thread_count=2,
    )


def _data_keys(s3_server: Any, bucket: str, name: str) -> list[str]:
    return [k for k in s3_server.keys(bucket) if k.startswith(f"{name}/") and k.endswith(".bin")]


@pytest.mark.s3
def test_prefixes_spread_data_objects_and_everything_finds_them(
    pool, s3_server, tmp_path, monkeypatch
):
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/ck"
    spread = s3_server.storage_options(prefixes=8)
    pool.run(save_spread, 2, url, spread)

    keys = _data_keys(s3_server, bucket, "ck")
    assert len(keys) == 4  # 2 ranks x 2 files, each under the folder its name hashes to
    for key in keys:
        _, folder, name = key.split("/")
        assert re.fullmatch(r"p[0-7]", folder) and folder == spread_dir(name, 8), key
    assert "ck/dcpbridge.json" in s3_server.keys(bucket)
    doc = json.loads(resolve(url, spread).fs.cat_file(f"{bucket}/ck/dcpbridge.json"))
    assert doc["prefixes"] == 8

    plain = s3_server.storage_options()  # a load needs no option: the metadata says where
    tmpl = layout_state("cols4", [0, 1, 2, 3], fill=False)
    out = db.load(tmpl, url, storage_options=plain)
    assert check_loaded(out, tmpl) == len(L.TENSORS) * 4 and out["common"] == COMMON

    # the CLI: inspect, validate (every checksum), reshard out of the spread checkpoint
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "profiles:\n  seaweed:\n    type: s3\n"
        f"    endpoint_url: {s3_server.endpoint_url}\n    region: us-east-1\n"
        "    access_key_env: TEST_S3_ACCESS\n    secret_key_env: TEST_S3_SECRET\n"
        "    options: {prefixes: 4}\n"
    )
    monkeypatch.setenv("TEST_S3_ACCESS", s3_server.access_key)
    monkeypatch.setenv("TEST_S3_SECRET", s3_server.secret_key)
    conf = ("--profile", "seaweed", "--config", str(cfg))
    doc = json.loads(run_cli("inspect", url, "--json", *conf).stdout)
    assert doc["complete"] and doc["problems"] == []
    assert sorted(f["name"] for f in doc["files"] if f["name"].endswith(".bin")) == sorted(
        k.rsplit("/", 1)[1] for k in keys
    )
    run_cli("validate", "--checksums", url, *conf)
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    back = str(tmp_path / "back")
    run_cli(
        "reshard",
        url,
        back,
        "--layout",
        str(layout),
        "--src-profile",
        "seaweed",
        "--config",
        str(cfg),
    )
    whole = layout_state("whole1", [0], fill=False)
    assert check_loaded(db.load(whole, back), whole) == len(L.TENSORS)
    # ... and into another spread checkpoint (the profile's prefixes: 4)
    dst = f"s3://{bucket}/resharded"
    run_cli(
        "reshard",
        back,
        dst,
        "--layout",
        str(layout),
        "--dst-profile",
        "seaweed",
        "--config",
        str(cfg),
    )
    assert all(
        re.fullmatch(r"resharded/p[0-3]/.*", k) for k in _data_keys(s3_server, bucket, "resharded")
    )
    whole = layout_state("whole1", [0], fill=False)
    assert check_loaded(db.load(whole, dst, storage_options=plain), whole) == len(L.TENSORS)

    # a re-save replaces the old spread files; a failed save leaves none of its own behind
    pool.run(save_spread, 2, url, spread)
    assert (
        len(_data_keys(s3_server, bucket, "ck")) == 4
        and _data_keys(s3_server, bucket, "ck") != keys
    )
    current = _data_keys(s3_server, bucket, "ck")

    def fail(self: Any, metadata: Any, results: Any) -> None:
        raise OSError("commit refused")

    monkeypatch.setattr(FsspecCheckpointWriter, "finish", fail)
    with pytest.raises(OSError, match="commit refused"):
        db.save({"x": torch.ones(3)}, url, storage_options=spread)
    assert _data_keys(s3_server, bucket, "ck") == current


def test_prefixes_option_is_checked():
    for bad in (0, 5000, "8", True):
        with pytest.raises(db.InvalidArgumentError, match="prefixes"):
            resolve("memory://x", {"prefixes": bad})


@pytest.mark.parametrize("backend_name", ["local", "memory"])
def test_prefixes_work_on_any_filesystem(backend_name, tmp_path, memory_store):
    url = str(tmp_path / "ck") if backend_name == "local" else "memory://spread/ck"
    state = {"common": COMMON, **layout_state("rows2", [0, 1])}
    db.save(state, url, storage_options={"prefixes": 3}, thread_count=2)
    loc = resolve(url)
    names = storage_for(loc).list_names()
    first = {n for n in names if n.endswith(".bin")}
    assert "dcpbridge.json" in names and len(first) == 2
    assert not [n for n in loc.fs.ls(loc.root, detail=False) if n.endswith(".bin")]
    tmpl = layout_state("cols4", [0, 1, 2, 3], fill=False)
    assert check_loaded(db.load(tmpl, url), tmpl) == len(L.TENSORS) * 4
    db.save(state, url, storage_options={"prefixes": 3}, thread_count=2)
    second = {n for n in storage_for(loc).list_names() if n.endswith(".bin")}
    assert len(second) == 2 and not first & second  # the re-save removed the old files
