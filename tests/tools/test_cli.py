"""The ``dcpbridge`` command, each call in a process of its own (forked from one that has imported
torch; the installed entry point once as a fresh interpreter), in-process where URLs are memory://."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile

import fsspec
import pytest
import torch
from safetensors.torch import load_file

import dcpbridge as db
from dcpbridge.storage.backends.store import LocalStorage, parts_of
from dcpbridge.tools import cli
from tests.e2e.test_reshard import COMMON, save_layout
from tests.support import layouts as L
from tests.support import preloaded
from tests.support.dist_pool import Rank
from tests.support.s3_server import DEAD_ENDPOINT

_SCRIPT = shutil.which("dcpbridge", path=os.path.dirname(sys.executable))
COMMAND = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "dcpbridge.tools.cli"]

# rank = pp * 2 + tp
LAYOUT = """\
mesh: {pp: 2, tp: 2}
rules:
  - match: w
    split: [{axis: 0, over: pp}, {axis: 1, over: tp}]
  - match: w_bf16
    split: {axis: 1, over: tp}
  - match: vec
    split: {axis: 0, parts: 4}
  - match: "*"
    replicate: true
    rank: 3
"""
# key -> {target rank: (offsets, sizes)} of the layout above, for the tensors of tests.support.layouts
OWNED = {
    "w": {0: ((0, 0), (6, 4)), 1: ((0, 4), (6, 4)), 2: ((6, 0), (6, 4)), 3: ((6, 4), (6, 4))},
    "w_bf16": {0: ((0, 0), (12, 4)), 1: ((0, 4), (12, 4))},
    "vec": {0: ((0,), (3,)), 1: ((3,), (3,)), 2: ((6,), (2,)), 3: ((8,), (2,))},
    "idx": {3: ((0, 0), (12, 6))},
}


def run_cli(*args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    """``dcpbridge ARGS`` in a process of its own, forked from one that imported torch."""
    proc = preloaded.run_cli(args)
    assert proc.returncode == code, (args, proc.returncode, proc.stdout, proc.stderr)
    return proc


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``dcpbridge ARGS`` in this process (needed for memory:// URLs)."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def rows2(pool, tmp_path_factory) -> str:
    """A checkpoint saved by 2 ranks, each tensor split by rows (rank 0 top, rank 1 bottom)."""
    path = str(tmp_path_factory.mktemp("cli") / "rows2")
    pool.run(save_layout, 2, "rows2", path, 1)  # one data file per rank
    return path


def test_inspect_json_lists_chunks_ranks_files(rows2):
    doc = json.loads(run_cli("inspect", rows2, "--json").stdout)
    assert doc["format"] == "dcpbridge" and doc["format_version"] == 4
    assert doc["complete"] and doc["problems"] == [] and doc["world_size"] == 2
    assert doc["checksum"] == {"algorithm": "xxh3_64", "block_size": 1 << 20}
    w = doc["tensors"]["w"]
    assert (w["shape"], w["dtype"], w["bytes"]) == ([12, 8], "float32", 384)
    assert [(c["offsets"], c["sizes"], c["rank"]) for c in w["chunks"]] == [
        ([0, 0], [6, 8], 0),
        ([6, 0], [6, 8], 1),
    ]
    assert w["chunks"][1]["file"].startswith("__1_0.")
    assert doc["tensors"]["w_bf16"]["dtype"] == "bfloat16"
    common = {"common.iteration", "common.args.lr", "common.args.betas", "common.args.name"}
    assert set(doc["objects"]) == common  # the common state, one entry per key (as DCP)
    names = {f["name"]: f["bytes"] for f in doc["files"]}
    assert set(names) == {"dcpbridge.json", w["chunks"][0]["file"], w["chunks"][1]["file"]}
    assert all(n > 0 for n in names.values())


def test_reshard_to_a_mesh_layout_one_chunk_per_target_box(pool, rows2, tmp_path, monkeypatch):
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    dst = str(tmp_path / "mesh4")
    proc = run_cli(
        "reshard", rows2, dst, "--layout", str(layout), "--slab-size", "100", "--progress"
    )
    assert "5 tensors as 12 chunks for 4 target ranks, 4 objects" in proc.stdout
    assert "reshard" in proc.stderr and "B/s" in proc.stderr  # the progress bar

    with open(os.path.join(dst, "dcpbridge.json")) as f:
        doc = json.load(f)
    assert doc["world_size"] == 4
    for key, owned in OWNED.items():
        chunks = doc["tensors"][key]["chunks"]
        got = {c["rank"]: (tuple(c["offsets"]), tuple(c["sizes"])) for c in chunks}
        assert got == owned, key
    pool.run(load_mesh_layout, 4, dst, default_group=True)

    # Loading a target rank's shard is one contiguous read of exactly its bytes.
    reads: list[int] = []
    real_fetch = LocalStorage.fetch

    def recording(self, batch, threads):
        reads.extend(len(p) for r in batch for p in parts_of(r) if not isinstance(p, int))
        return real_fetch(self, batch, threads)

    monkeypatch.setattr(LocalStorage, "fetch", recording)
    offsets, sizes = OWNED["w"][2]
    tmpl = {"w": db.ShardedTensor.from_box("w", torch.zeros(sizes), (12, 8), offsets)}
    out = db.load(tmpl, dst)
    assert torch.equal(out["w"], L.expected("w", (offsets, sizes)))
    common = [o["nbytes"] for o in doc["objects"].values()]
    common += [c["nbytes"] for c in doc["tensors"]["common.t"]["chunks"]]
    assert sorted(reads) == sorted([6 * 4 * 4, *common])  # the shard, and the common state


def load_mesh_layout(r: Rank, path: str) -> None:
    """Rank r loads the boxes it owns plus the replicas it holds (w_bf16 on pp=1)."""
    tmpl: dict = {}
    for key, owned in OWNED.items():
        box = owned.get(r.rank) or (owned.get(r.rank % 2) if key == "w_bf16" else None)
        if box is not None:
            tmpl[key] = L.template(key, box)
    out = db.load(tmpl, path)
    for key, sh in tmpl.items():
        assert torch.equal(out[key], L.expected(key, (sh.global_offset, sh.local_shape))), key
    assert out["common"]["iteration"] == COMMON["iteration"]


def test_validate_reports_corruption_and_missing_files(rows2, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(rows2, ck)
    with open(os.path.join(ck, "dcpbridge.json")) as f:
        doc = json.load(f)
    chunk = doc["tensors"]["idx"]["chunks"][1]
    with open(os.path.join(ck, chunk["file"]), "r+b") as f:  # flip one byte of idx rows 6..12
        f.seek(chunk["offset"] + 5)
        byte = f.read(1)
        f.seek(chunk["offset"] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, out, _ = in_process(capsys, "validate", ck)
    assert code == 0 and out.startswith("OK: ")  # structure only: still fine
    proc = run_cli("validate", ck, "--checksums", code=1)
    assert proc.stdout.startswith(f"INVALID: {ck}")
    assert "checksum mismatch in 'idx'[6, 0] in __1_0." in proc.stdout and "block 0" in proc.stdout

    os.remove(os.path.join(ck, doc["tensors"]["w"]["chunks"][0]["file"]))
    code, out, _ = in_process(capsys, "validate", ck)
    assert code == 1 and f"data file {doc['tensors']['w']['chunks'][0]['file']} is missing" in out
    assert (
        "it holds tensor 'common.t' chunk [0:3], tensor 'vec' chunk [0:5], tensor 'w' chunk" in out
    )


def test_convert_to_safetensors_torch_and_back(rows2, tmp_path, capsys):
    hf, pt, back = str(tmp_path / "hf"), str(tmp_path / "model.pt"), str(tmp_path / "back")
    proc = run_cli("convert", rows2, hf, "--to", "safetensors", "--max-shard-size", "500")
    assert "skipped 4 object(s): common.args.betas, common.args.lr" in proc.stdout
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    t = COMMON["t"]  # a plain tensor of the common state is stored, and exported, as a tensor
    assert index["metadata"]["total_size"] == t.numel() * t.element_size() + sum(
        L.full(k).numel() * L.full(k).element_size() for k in L.TENSORS
    )
    loaded = {k: v for f in files for k, v in load_file(os.path.join(hf, f)).items()}
    assert set(loaded) == {*L.TENSORS, "common.t"} and torch.equal(loaded["common.t"], t)
    for key in L.TENSORS:
        assert torch.equal(loaded[key], L.full(key)), key

    run_cli("convert", hf, pt, "--to", "torch", "--no-progress")
    sd = torch.load(pt, weights_only=True)
    del sd["common.t"]
    assert set(sd) == set(L.TENSORS)
    assert all(torch.equal(sd[k], L.full(k)) for k in L.TENSORS)
    assert zipfile.ZipFile(pt).testzip() is None  # CRCs of the in-place written records

    torch.save({"model": sd, "iteration": 9}, pt)
    code, _, err = in_process(capsys, "convert", pt, back, "--to", "dcpbridge", "--no-progress")
    assert code == 0, err
    tmpl = {k: L.template(k, ((0,) * len(s), s)) for k, (s, _) in L.TENSORS.items()}
    tmpl = {
        k: db.ShardedTensor.from_box(f"model.{k}", v.data, v.global_shape, v.global_offset)
        for k, v in tmpl.items()
    }
    out = db.load(tmpl, back)
    assert all(torch.equal(out[k], L.full(k)) for k in L.TENSORS) and out["iteration"] == 9


def test_usage_errors_exit_2_and_bad_checkpoints_exit_1(rows2, tmp_path, capsys):
    bad_layout = tmp_path / "bad.yaml"
    bad_layout.write_text("world_size: 4\nrules:\n  - match: w\n    split: {axis: 0, part: 2}\n")
    proc = run_cli("reshard", rows2, str(tmp_path / "x"), "--layout", str(bad_layout), code=2)
    assert f"{bad_layout}: rules[0].split[0]: unknown key(s) ['part']" in proc.stderr
    assert not os.path.exists(tmp_path / "x")

    code, _, err = in_process(capsys, "inspect", str(tmp_path / "nowhere"))
    assert code == 1 and "no such checkpoint directory" in err
    code, _, err = in_process(capsys)
    assert code == 2 and "required: COMMAND" in err
    code, _, err = in_process(capsys, "reshard", rows2, str(tmp_path / "y"))
    assert code == 2  # the message alone, without the class name of the usage error
    assert err == "dcpbridge reshard: error: reshard SRC DST needs --layout LAYOUT.yaml\n"
    code, _, err = in_process(capsys, "convert", rows2, rows2 + "/", "--to", "dcpbridge")
    assert code == 2 and err.startswith("dcpbridge convert: error: the destination ")
    assert "is the source itself" in err
    code, _, err = in_process(capsys, "convert", rows2, str(tmp_path / "y"), "--to", "zip")
    assert code == 2 and "invalid choice: 'zip'" in err
    bad_config = tmp_path / "c.yaml"
    bad_config.write_text("checkpoint: {threads: many}\n")
    for args in (
        ["inspect", rows2, "--config", str(bad_config)],
        ["--config", str(bad_config), "inspect", rows2],
    ):
        code, _, err = in_process(capsys, *args)
        assert code == 2 and f"{bad_config}: checkpoint.threads: expected int, got str" in err

    os.makedirs(tmp_path / "half")
    shutil.copy(os.path.join(rows2, sorted(os.listdir(rows2))[0]), tmp_path / "half")
    code, _, err = in_process(capsys, "validate", str(tmp_path / "half"))
    assert code == 1 and "incomplete checkpoint" in err


def test_help_documents_layout_and_config(capsys):
    proc = run_cli("--help")
    assert "profiles:" in proc.stdout and "access_key_env" in proc.stdout
    code, out, _ = in_process(capsys, "reshard", "--help")
    assert code == 0
    for needle in (
        "layout file:",
        "world_size",
        "mesh:",
        "over: tp",
        "replicate: true",
        "torchrun",
    ):
        assert needle in out, needle


def test_memory_urls_and_a_config_job(rows2, tmp_path, capsys):
    """local -> memory:// by a job of a config file, then memory:// -> local safetensors."""
    mem = fsspec.filesystem("memory")
    cfg = tmp_path / "job.yaml"
    cfg.write_text(
        textwrap.dedent(
            f"""
            profiles:
              mem: {{type: fsspec, options: {{skip_instance_cache: true}}}}
            jobs:
              to-mem:
                source: {rows2}
                destination: memory://cli-job/ck
                destination_profile: mem
                layout: {{world_size: 2, rules: [{{match: "*", split: {{axis: 0}}}}]}}
            """
        )
    )
    try:
        code, out, err = in_process(capsys, "reshard", "--config", str(cfg), "--no-progress")
        assert code == 0, err
        assert "wrote memory://cli-job/ck" in out
        code, out, _ = in_process(capsys, "inspect", "memory://cli-job/ck", "--json")
        doc = json.loads(out)
        assert code == 0 and doc["world_size"] == 2
        assert [c["rank"] for c in doc["tensors"]["idx"]["chunks"]] == [0, 1]
        hf = str(tmp_path / "hf")
        code, _, err = in_process(
            capsys, "convert", "memory://cli-job/ck", hf, "--to", "safetensors"
        )
        assert code == 0, err
        assert sorted(os.listdir(hf)) == ["model.safetensors"]  # one shard: no index
        assert torch.equal(load_file(os.path.join(hf, "model.safetensors"))["w"], L.full("w"))
        code, _, err = in_process(capsys, "reshard", "--config", str(cfg), "--job", "nope")
        assert code == 2 and "no job 'nope' (jobs: to-mem)" in err
    finally:
        mem.rm("/cli-job", recursive=True)


@pytest.mark.s3
def test_commands_on_s3_urls_through_a_config_profile(
    pool, rows2, tmp_path, s3_server, monkeypatch
):
    """inspect/validate an S3 checkpoint and reshard local -> S3 -> local, credentials by profile."""
    bucket = s3_server.new_bucket()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "profiles:\n"
        "  seaweed:\n"
        "    type: s3\n"
        f"    endpoint_url: {s3_server.endpoint_url}\n"
        "    region: us-east-1\n"
        "    access_key_env: TEST_S3_ACCESS\n"
        "    secret_key_env: TEST_S3_SECRET\n"
    )
    monkeypatch.setenv("TEST_S3_ACCESS", s3_server.access_key)
    monkeypatch.setenv("TEST_S3_SECRET", s3_server.secret_key)
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    remote = f"s3://{bucket}/mesh4"
    conf = ("--config", str(cfg))
    run_cli("reshard", rows2, remote, "--layout", str(layout), "--dst-profile", "seaweed", *conf)
    doc = json.loads(run_cli("inspect", remote, "--json", "--profile", "seaweed", *conf).stdout)
    assert doc["complete"] and doc["problems"] == []
    owners = {k: {c["rank"] for c in v["chunks"]} for k, v in doc["tensors"].items()}
    assert owners == {k: set(v) for k, v in OWNED.items()} | {"common.t": {3}}
    run_cli("validate", "--checksums", remote, "--profile", "seaweed", *conf)
    back = str(tmp_path / "back")
    run_cli("reshard", remote, back, "--layout", str(layout), "--src-profile", "seaweed", *conf)
    monkeypatch.setenv("DCPBRIDGE_CONFIG", str(cfg))
    for key in L.TENSORS:
        shape, dtype = L.TENSORS[key]
        full = db.load(
            {
                key: db.ShardedTensor.from_box(
                    key, torch.zeros(shape, dtype=dtype), shape, (0,) * len(shape)
                )
            },
            remote,
            profile="seaweed",
        )
        assert torch.equal(full[key], L.full(key))
        local = db.load(
            {
                key: db.ShardedTensor.from_box(
                    key, torch.zeros(shape, dtype=dtype), shape, (0,) * len(shape)
                )
            },
            back,
        )
        assert torch.equal(local[key], L.full(key))


def test_the_installed_command_runs():
    """The ``dcpbridge`` entry point itself, started as a fresh interpreter (once: importing
    torch takes seconds), its exit status that of ``main``; ``--version`` as it prints."""
    bad = subprocess.run([*COMMAND, "inspect"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "usage: dcpbridge inspect" in bad.stderr
    assert run_cli("--version").stdout.strip() == f"dcpbridge {db.__version__}"


# The retry settings the README suggests for failing fast (S3 and other object stores).
FAIL_FAST = "{connect_timeout: 2, read_timeout: 60, retries: {max_attempts: 3, mode: standard}}"


def test_a_dead_endpoint_fails_in_one_line(tmp_path, monkeypatch):
    cfg = tmp_path / "config.yaml"
    profile = (
        f"    endpoint_url: {DEAD_ENDPOINT}\n"
        "    access_key_env: TEST_DEAD_KEY\n    secret_key_env: TEST_DEAD_SECRET\n"
    )
    cfg.write_text(  # "once": the same error without botocore's backoff sleeps (seconds each)
        f"profiles:\n  dead:\n{profile}    options: {{config_kwargs: {FAIL_FAST}}}\n"
        f"  once:\n{profile}    options: {{config_kwargs: {{retries: {{max_attempts: 1}}}}}}\n"
    )
    monkeypatch.setenv("TEST_DEAD_KEY", "AKIDEXAMPLE")
    monkeypatch.setenv("TEST_DEAD_SECRET", "not-a-secret")
    args = ("inspect", "s3://bucket/ck", "--config", str(cfg), "--profile", "dead")
    err = run_cli(*args, code=1).stderr
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("dcpbridge inspect: error: s3://bucket/ck: ")
    assert "Could not connect" in err and "is the endpoint up?" in err
    args = (*args[:-1], "once")
    assert "Traceback" in run_cli(*args, "--debug", code=1).stderr
    doc = json.loads(run_cli(*args, "--json", code=1).stdout)
    assert doc["type"] == "StorageError" and doc["exit_status"] == 1
    assert doc["error"].startswith("s3://bucket/ck: ")


@pytest.mark.s3
def test_s3_refusals_are_one_line(s3_server, tmp_path, monkeypatch):
    bucket = s3_server.new_bucket()
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        "profiles:\n  wrong:\n"
        f"    endpoint_url: {s3_server.endpoint_url}\n    region: us-east-1\n"
        "    access_key_env: TEST_S3_ACCESS\n    secret_key_env: TEST_S3_WRONG\n"
        f"    options: {{config_kwargs: {FAIL_FAST}}}\n"
        "  right:\n"
        f"    endpoint_url: {s3_server.endpoint_url}\n    region: us-east-1\n"
        "    access_key_env: TEST_S3_ACCESS\n    secret_key_env: TEST_S3_SECRET\n"
    )
    monkeypatch.setenv("TEST_S3_ACCESS", s3_server.access_key)
    monkeypatch.setenv("TEST_S3_SECRET", s3_server.secret_key)
    monkeypatch.setenv("TEST_S3_WRONG", "wrong-secret")
    conf = ("--config", str(cfg))
    err = run_cli("inspect", f"s3://{bucket}/ck", "--profile", "wrong", *conf, code=1).stderr
    assert err.count("\n") == 1 and f"s3://{bucket}/ck" in err, err
    assert "check the credentials" in err and "not-a-secret" not in err
    err = run_cli(
        "inspect", "s3://no-such-bucket-x1/ck", "--profile", "right", *conf, code=1
    ).stderr
    assert err.count("\n") == 1 and "s3://no-such-bucket-x1/ck" in err, err


def test_existing_destinations_need_force(rows2, tmp_path):
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    for args in (
        ("convert", rows2, str(dst), "--to", "dcpbridge"),
        ("convert", rows2, str(dst), "--to", "safetensors"),
        ("reshard", rows2, str(dst), "--layout", str(layout)),
    ):
        err = run_cli(*args, code=2).stderr
        assert f"the destination {dst} exists; pass --force to overwrite it" in err
    assert os.listdir(dst) == ["keep.txt"]
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"old")
    run_cli("convert", rows2, str(pt), "--to", "torch", code=2)
    run_cli("convert", rows2, str(pt), "--to", "torch", "--force", "--no-progress")
    assert set(torch.load(pt, weights_only=True)) >= set(L.TENSORS)
    run_cli("convert", rows2, str(dst), "--to", "dcpbridge", "--force")
    assert db.load_tensors_metadata(str(dst))["w"].global_shape == (12, 8)
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is no data to lose
    run_cli("convert", rows2, str(empty), "--to", "safetensors", "--no-progress")


def test_validate_checksums_shows_progress(rows2):
    err = run_cli("validate", rows2, "--checksums", "--progress").stderr
    assert "verify" in err and "100%" in err
    assert "verify" not in run_cli("validate", rows2, "--checksums", "--no-progress").stderr


def _tied_model_file(path: str) -> dict[str, torch.Tensor]:
    """A torch.save of a state dict whose head shares the embedding's storage."""
    emb = torch.randn(10, 4)
    sd = {"embed.weight": emb, "norm.weight": torch.ones(4), "head.weight": emb}
    torch.save(sd, path)
    return sd


def test_safetensors_tied_weights_single_file_and_shards(tmp_path):
    src = str(tmp_path / "tied.pt")
    sd = _tied_model_file(src)
    one = tmp_path / "one"
    out = run_cli("convert", src, str(one), "--to", "safetensors", "--no-progress").stdout
    assert "tied weights written once: head.weight -> embed.weight" in out
    assert sorted(os.listdir(one)) == ["model.safetensors"]
    from safetensors import safe_open

    with safe_open(str(one / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "norm.weight"]
        assert f.metadata() == {"format": "pt", "head.weight": "embed.weight"}
    loaded = load_file(str(one / "model.safetensors"))
    assert torch.equal(loaded["embed.weight"], sd["head.weight"])

    many = tmp_path / "many"
    run_cli("convert", src, str(many), "--to", "safetensors", "--max-shard-size", "40")
    names = sorted(os.listdir(many))
    assert names == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    with open(many / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert index["weight_map"] == {
        "embed.weight": "model-00001-of-00002.safetensors",
        "norm.weight": "model-00002-of-00002.safetensors",
    }
    assert index["metadata"]["total_size"] == 40 * 4 + 4 * 4
    got = {k: v for n in names[:2] for k, v in load_file(str(many / n)).items()}
    assert torch.equal(got["embed.weight"], sd["embed.weight"]) and "head.weight" not in got


def test_a_failed_export_removes_what_it_wrote(tmp_path):
    src = str(tmp_path / "odd.pt")
    torch.save({"a": torch.ones(16), "z": torch.ones(2, dtype=torch.complex128)}, src)
    dst = tmp_path / "out"
    err = run_cli("convert", src, str(dst), "--to", "safetensors", "--max-shard-size", "8", code=1)
    assert "safetensors cannot store dtype torch.complex128" in err.stderr
    assert not dst.exists()  # shard 1 was written, then removed, and the folder it made
    dst.mkdir()
    err = run_cli("convert", src, str(dst), "--to", "safetensors", "--max-shard-size", "8", code=1)
    assert os.listdir(dst) == []  # a folder that was there stays


def test_a_failed_torch_export_removes_what_it_wrote(tmp_path):
    """A read failing mid-way (a corrupted data file) leaves no partial torch file behind."""
    src = str(tmp_path / "ck")
    db.save({"a": torch.ones(1000), "b": torch.ones(1000)}, src)
    (name,) = [n for n in os.listdir(src) if n.startswith("__0_1")]  # holds 'b', read last
    raw = bytearray((tmp_path / "ck" / name).read_bytes())
    raw[-100] ^= 0xFF
    (tmp_path / "ck" / name).write_bytes(bytes(raw))
    out = tmp_path / "out"
    err = run_cli("convert", src, str(out / "model.pt"), "--to", "torch", code=1)
    assert "checksum mismatch in tensor 'b'" in err.stderr, err.stderr
    assert not out.exists()  # the folder it made, with nothing in it
    out.mkdir()
    run_cli("convert", src, str(out / "model.pt"), "--to", "torch", code=1)
    assert os.listdir(out) == []  # a folder that was there stays


def test_transformers_from_pretrained_loads_the_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=16,
        n_head=2,
        vocab_size=64,
        n_positions=8,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config)  # lm_head.weight is tied to transformer.wte
    src = str(tmp_path / "gpt2.pt")
    torch.save(model.state_dict(), src)
    hf = tmp_path / "hf"
    run_cli("convert", src, str(hf), "--to", "safetensors", "--no-progress")
    config.save_pretrained(str(hf))
    back = transformers.GPT2LMHeadModel.from_pretrained(str(hf))
    want, got = model.state_dict(), back.state_dict()
    assert set(want) == set(got)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()


def test_a_torch_export_that_cannot_write_raises_a_storage_error(tmp_path):
    """File system failures of ``export_torch`` (the destination a directory, a parent that
    cannot be made) raise StorageError naming the destination, the OSError as the cause."""
    src = str(tmp_path / "m.pt")
    torch.save({"a": torch.ones(3)}, src)
    (tmp_path / "dir" / "x").mkdir(parents=True)
    (tmp_path / "file").write_bytes(b"")
    source = db.open_source(src)
    try:
        for dst in (str(tmp_path / "dir"), str(tmp_path / "file" / "m.pt")):
            with pytest.raises(db.StorageError, match=rf"^{dst}: write") as info:
                db.export_torch(source, dst)
            assert isinstance(info.value.__cause__, OSError)
    finally:
        source.close()
    assert sorted(os.listdir(tmp_path)) == ["dir", "file", "m.pt"]  # no partial file left


def test_names_out_of_a_checkpoint_cannot_drive_the_terminal(tmp_path, capsys):
    """Keys are untrusted text: a plain DCP checkpoint may name a tensor or an object with
    escape sequences, a newline or a right-to-left override. ``inspect``, ``validate`` and
    the error line print them escaped, never raw (no recolouring, no faked lines)."""
    import torch.distributed.checkpoint as dcp

    evil = "w\x1b[31mRED\x1b[0m\nOK: fake\u202e"
    ck = str(tmp_path / "ck")
    dcp.save({evil: torch.zeros(2), f"obj{evil}": {"a": 1}}, checkpoint_id=ck, no_dist=True)
    code, out, _ = in_process(capsys, "inspect", ck)
    assert code == 0
    os.remove(os.path.join(ck, "__0_0.distcp"))  # validate's problems name the keys
    code, out2, err2 = in_process(capsys, "validate", ck)
    assert code == 1
    code, _, err = in_process(capsys, "inspect", str(tmp_path / "no\x1b[2Jne"))
    assert code == 1
    for text in (out, out2, err2, err):
        assert not any(c in text for c in "\x1b\u202e"), text
    assert "w\\x1b[31mRED\\x1b[0m\\nOK: fake\\u202e" in out
    assert "\nOK: fake" not in out
    assert "no\\x1b[2Jne" in err


def test_fsck_of_no_directory_or_of_one_checkpoint_is_not_an_all_clear(tmp_path, capsys):
    """``fsck`` of a mistyped root, or of a file, printed "0 checkpoint(s)" and exited 0, a
    pass for a script; one checkpoint's own folder (not the root above it) the same. They now
    fail: exit 1 naming the path, and exit 2 pointing at ``validate`` for a checkpoint."""
    ck = tmp_path / "ck"
    db.save({"w": torch.ones(4)}, str(ck))
    (tmp_path / "model.pt").write_bytes(b"x")
    for path in (tmp_path / "nowhere", tmp_path / "model.pt"):
        code, out, err = in_process(capsys, "fsck", str(path))
        assert code == 1 and out == ""
        assert err == f"dcpbridge fsck: error: {path}: no such directory\n"
    code, out, err = in_process(capsys, "fsck", str(ck))
    assert code == 2 and out == "" and f"{ck} is a checkpoint itself" in err and "validate" in err
    code, out, _ = in_process(capsys, "fsck", str(tmp_path))
    assert code == 0 and out == "1 checkpoint(s), 0 orphaned file(s), 0 missing file(s)\n"


def test_a_hint_comes_from_the_error_never_from_a_path_that_looks_like_a_status(tmp_path):
    """The hint for an HTTP 403 was added to a local "no such directory" error when the path held
    ``403`` (pytest's ``pytest-1403`` on CI); a path or URL never chooses the hint now."""
    for name in ("pytest-1403/none", "403/none", "run-Forbidden/x"):
        e = db.NotACheckpointError(f"{tmp_path / name}: no such checkpoint directory")
        assert cli.describe_error(e) == str(e)
    e = db.StorageError("s3://b-403/ck: reading failed")
    e.__cause__ = PermissionError("An error occurred (403) when calling the HeadObject operation")
    assert cli.describe_error(e).endswith("; check the credentials and the bucket policy")
    for text in ("took 14031 ms", "'layer403.w' at offset (403, 0), sizes (2, 403)", "v1.403"):
        e.__cause__ = OSError(text)
        assert "credentials" not in cli.describe_error(e), text
    timeout = TimeoutError("ConnectTimeoutError: Connect timeout on endpoint URL")
    assert cli.describe_error(timeout).endswith("; the endpoint did not answer in time")


def test_a_checkpoint_manager_root_given_as_a_checkpoint_names_its_steps(tmp_path, capsys):
    """``inspect``/``validate`` of a CheckpointManager's root (the first thing a new user tries)
    said only that dcpbridge.json is missing; the error now names the steps under it and the
    folder to pass instead (exit status 1 as before)."""
    root = tmp_path / "run"
    mgr = db.CheckpointManager(str(root), every=1, async_save=False)
    for step in (1, 2):
        mgr.save(step, {"w": torch.ones(4) * step})
    mgr.close()
    (root / "step_3").mkdir()  # not a step's spelling: never named
    for command in ("inspect", "validate"):
        code, out, err = in_process(capsys, command, str(root))
        assert code == 1 and out == ""
        assert f"{root} is not a dcpbridge checkpoint: dcpbridge.json is missing" in err
        assert f"it holds 2 step(s) of a CheckpointManager, name one: {root}/step_00000002" in err
    code, out, err = in_process(capsys, "inspect", str(tmp_path / "none"))
    assert code == 1 and err.endswith("no such checkpoint directory\n")
