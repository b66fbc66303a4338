"""Hugging Face safetensors at scale: ``save_hf`` on every rank, ``load`` from safetensors on
every rank (each reading its own ranges), hostile headers, and a rank failing mid-save."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import safetensors.torch
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dcpbridge as db
from dcpbridge.formats.sources import Source
from dcpbridge.tools.hf import Held, plan_hf
from tests.support import preloaded
from tests.support.dist_pool import Rank
from tests.support.limits import file_size_limit

INDEX = "model.safetensors.index.json"
SHARD_BYTES = 400  # several files, so an index


def full() -> dict[str, torch.Tensor]:
    """The reference tensors: float8 weights with float32 scales among them."""
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 6, generator=g),
        "layers.0.attn.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "layers.0.mlp.weight": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "layers.0.mlp.weight_scale_inv": torch.rand(2, 4, generator=g),
        "norm.bias": torch.arange(5, dtype=torch.int64),
    }


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _mesh(r: Rank) -> DeviceMesh:
    return DeviceMesh.from_group(r.group, "cpu")


def sharded_state(r: Rank) -> dict[str, Any]:
    """DTensors split by columns and rows, a Megatron-style ShardedTensor, plain tensors."""
    f, mesh = full(), _mesh(r)
    mlp = f["layers.0.mlp.weight"].chunk(r.size)[r.rank].clone()
    return {
        "embed.weight": distribute_tensor(f["embed.weight"], mesh, [Shard(1)]),
        "layers.0.attn.weight": distribute_tensor(f["layers.0.attn.weight"], mesh, [Shard(0)]),
        "layers.0.mlp.weight": db.ShardedTensor.from_rank_offsets(
            "layers.0.mlp.weight", mlp, (0, r.rank, r.size)
        ),
        "layers.0.mlp.weight_scale_inv": f["layers.0.mlp.weight_scale_inv"],
        "norm.bias": f["norm.bias"],
    }


def save_sharded(r: Rank, path: str, limit: int | None) -> str:
    """``save_hf`` on every rank; ``limit``: rank 1's files cannot grow past it (EFBIG)."""
    try:
        with file_size_limit(limit if r.rank == 1 else None):
            db.save_hf(sharded_state(r), path, process_group=r.group, max_shard_bytes=SHARD_BYTES)
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def load_columns(r: Rank, path: str) -> list[str]:
    """Every tensor of ``path`` loaded as column shards (Shard(1)), compared byte for byte."""
    mesh, bad = _mesh(r), []
    for key, want in full().items():
        if want.dim() == 1:
            got = db.load({key: torch.zeros_like(want)}, path, process_group=r.group,
                          strict="assume_ok_unexpected")[key]  # fmt: skip
            mine = want
        else:
            mine = want.chunk(r.size, dim=1)[r.rank]
            template = DTensor.from_local(torch.zeros_like(mine), mesh, [Shard(1)], run_check=False)
            got = db.load({key: template}, path, process_group=r.group,
                          strict="assume_ok_unexpected")[key].to_local()  # fmt: skip
        if not torch.equal(_bytes(got), _bytes(mine)):
            bad.append(key)
    return bad


def _same_files(a: str, b: str, names: list[str]) -> None:
    for name in names:
        with open(os.path.join(a, name), "rb") as x, open(os.path.join(b, name), "rb") as y:
            assert x.read() == y.read(), name


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> str:
    """The reference: a one-process ``export_safetensors`` of the same tensors."""
    root = tmp_path_factory.mktemp("hf")
    torch.save(full(), str(root / "full.pt"))
    source = db.open_source(str(root / "full.pt"))
    db.export_safetensors(source, str(root / "one"), max_shard_bytes=SHARD_BYTES)
    source.close()
    return str(root / "one")


@pytest.mark.timeout(300)  # may start the shared pool
def test_save_hf_on_two_ranks_writes_the_one_process_export(pool, tmp_path, exported):
    """Every file (headers, data, index) is byte-identical to the one-process export."""
    path = str(tmp_path / "two")
    assert pool.run(save_sharded, 2, path, None, timeout=100) == ["saved"] * 2
    names = sorted(os.listdir(exported))
    assert INDEX in names and len(names) > 2, names
    assert sorted(os.listdir(path)) == names
    _same_files(path, exported, names)


def export_on_ranks(r: Rank, source: str, path: str) -> list[str]:
    """What ``dcpbridge convert --to safetensors`` runs on each torchrun worker."""
    from dcpbridge.engine.collectives import Group

    src = db.open_source(source)
    try:
        return db.export_safetensors(
            src, path, max_shard_bytes=SHARD_BYTES, group=Group.resolve(r.group)
        ).files
    finally:
        src.close()


@pytest.mark.timeout(120)
def test_export_on_two_ranks_writes_the_one_process_export(pool, tmp_path, exported):
    """Each rank writes its share of the files; the result is byte-identical."""
    path = str(tmp_path / "two")
    source = os.path.join(os.path.dirname(exported), "full.pt")
    files = pool.run(export_on_ranks, 2, source, path, timeout=100)
    assert files[0] == files[1] == sorted(os.listdir(exported))
    _same_files(path, exported, files[0])


def test_save_hf_in_one_process_writes_one_file(tmp_path, exported):
    """Everything fits one file: ``model.safetensors`` (published by a rename), no index,
    the bytes of the one-process export, readable by safetensors."""
    from safetensors.torch import load_file

    one, path = str(tmp_path / "export"), str(tmp_path / "saved")
    source = db.open_source(os.path.join(os.path.dirname(exported), "full.pt"))
    db.export_safetensors(source, one)
    source.close()
    assert db.save_hf(full(), path).files == ["model.safetensors"]
    assert os.listdir(path) == os.listdir(one) == ["model.safetensors"]
    _same_files(path, one, ["model.safetensors"])
    got = load_file(os.path.join(path, "model.safetensors"))
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in full().items())


@pytest.mark.timeout(120)
def test_load_hf_into_column_shards_on_two_ranks(pool, exported):
    assert pool.run(load_columns, 2, exported, timeout=100) == [[], []]


@pytest.mark.timeout(120)
def test_a_rank_failing_mid_save_leaves_no_index(pool, tmp_path):
    """Rank 1 cannot write past byte 200 of any file: every rank raises its StorageError,
    and nothing is left (no index, no file)."""
    path = str(tmp_path / "fail")
    outcomes = pool.run(save_sharded, 2, path, 200, timeout=100)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"StorageError: rank 1: {path}: write model-"), outcomes[0]
    assert "File too large" in outcomes[0], outcomes[0]
    assert not os.path.exists(path) or os.listdir(path) == []


def export_failing_on_rank_1(r: Rank, source: str, path: str) -> str:
    """``export_safetensors`` on every rank; rank 1's disk fills at its first file, and it
    removes what it wrote only after the coordinator has removed its own files."""
    import time

    from dcpbridge.engine.collectives import Group
    from dcpbridge.tools import export

    whole, remove = export._whole, export._remove_quietly

    def full_disk(*args: Any) -> Any:
        yield next(whole(*args))
        raise OSError(28, "No space left on device")

    def late_remove(*args: Any) -> None:
        time.sleep(1.0)
        remove(*args)

    if r.rank == 1:
        export._whole, export._remove_quietly = full_disk, late_remove  # type: ignore[assignment]
    src = db.open_source(source)
    try:
        db.export_safetensors(src, path, max_shard_bytes=SHARD_BYTES, group=Group.resolve(r.group))
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        export._whole, export._remove_quietly = whole, remove  # type: ignore[assignment]
        src.close()
    return "saved"


@pytest.mark.timeout(120)
def test_an_export_failing_on_one_rank_leaves_no_folder_behind(pool, tmp_path):
    """Each rank removes the files it wrote; the folder the export made was removed by the
    coordinator only, while it was empty: where another rank's files were still there, an empty
    folder stayed behind (a one-process export leaves none). The last rank done removes it."""
    source, path = str(tmp_path / "full.pt"), str(tmp_path / "out" / "hf")
    torch.save(full(), source)
    outcomes = pool.run(export_failing_on_rank_1, 2, source, path, timeout=100)
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"StorageError: rank 1: {path}: write model-"), outcomes[0]
    assert "No space left on device" in outcomes[0]
    assert sorted(os.listdir(tmp_path)) == ["full.pt"]  # neither "out" nor "out/hf"


def save_or_export_split_differently(r: Rank, path: str, source: str | None) -> str:
    """``save_hf`` (``export_safetensors`` from ``source`` if given) with a ``max_shard_bytes``
    that differs between the ranks: the files each rank plans would differ."""
    from dcpbridge.engine.collectives import Group

    limit = 10**9 if r.rank == 0 else SHARD_BYTES
    try:
        if source is None:
            db.save_hf(full(), path, process_group=r.group, max_shard_bytes=limit)
        else:
            src = db.open_source(source)
            try:
                db.export_safetensors(
                    src, path, max_shard_bytes=limit, group=Group.resolve(r.group)
                )
            finally:
                src.close()
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["save_hf", "export"])
def test_ranks_passing_different_shard_sizes_are_refused(pool, tmp_path, how):
    """Each rank plans the files from its own ``max_shard_bytes``: with different values,
    one rank's boxes went to files the others did not publish (the tensor read as zeros).
    Refused on every rank before anything is written."""
    path = str(tmp_path / "out")
    source = None
    if how == "export":
        source = str(tmp_path / "full.pt")
        torch.save(full(), source)
    outcomes = pool.run(save_or_export_split_differently, 2, path, source, timeout=100)
    what = "save_hf" if how == "save_hf" else "export_safetensors"
    want = (
        f"InvalidArgumentError: {what}: every rank must pass the same max_shard_bytes, "
        f"got rank 0: 1000000000, rank 1: {SHARD_BYTES}"
    )
    assert outcomes == [want, want]
    assert not os.path.exists(path)


def _exit_code(target: Any, *args: str) -> int | None:
    """``target(*args)`` in a process of its own (forked from one that imported torch): its
    exit code, or None (the process killed) if it ran past 100 s."""
    p = preloaded.context().Process(target=target, args=args)
    p.start()
    p.join(100)
    if p.is_alive():
        p.kill()
        p.join()
        return None
    return p.exitcode


def _killed_after_headers(path: str) -> None:
    """``save_hf`` in a process killed at its first tensor byte (every header in place)."""
    from dcpbridge.tools import hf

    def die(*_: object) -> None:
        os._exit(9)

    hf._box_parts = die  # type: ignore[assignment]
    db.save_hf(full(), path, max_shard_bytes=SHARD_BYTES)


@pytest.mark.timeout(120)
def test_a_save_killed_before_its_index_is_refused_not_read_as_zeros(tmp_path):
    """A killed ``save_hf`` leaves only its temp files (``.partial``: headers written, data
    zeros), which no load reads. Full-size shards without the index (as a writer that renames
    them before its index leaves them) must raise too, not return zeros (Hugging Face writes
    the index last)."""
    path = str(tmp_path / "killed")
    assert _exit_code(_killed_after_headers, path) == 9
    names = sorted(os.listdir(path))
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert names == [f"{n}.partial" for n in shards], names
    with pytest.raises(db.NotACheckpointError):
        db.load({k: torch.zeros_like(v) for k, v in full().items()}, path)
    for n in shards:
        os.rename(os.path.join(path, f"{n}.partial"), os.path.join(path, n))
    template = {k: torch.zeros_like(v) for k, v in full().items()}
    error = rf"{path}: model-00001-of-00002\.safetensors .* but no {INDEX}"
    with pytest.raises(db.IncompleteCheckpointError, match=error):
        db.load(template, path)
    with pytest.raises(db.IncompleteCheckpointError, match=error):
        db.open_source(path)


def _killed_one_file_save(path: str) -> None:
    """A one-file ``save_hf`` in a process killed at its first tensor byte."""
    from dcpbridge.tools import hf

    def die(*_: object) -> None:
        os._exit(9)

    hf._box_parts = die  # type: ignore[assignment]
    db.save_hf(full(), path)


@pytest.mark.timeout(120)
def test_a_killed_one_file_save_leaves_no_temp_file_after_the_next_save(tmp_path):
    """A one-file save killed before its rename leaves ``model.safetensors.partial``, as large
    as the model; the next save replaced it only if it was one file too: a save in several
    files kept it for ever. It is removed with the earlier export's other leftovers."""
    path = str(tmp_path / "hf")
    assert _exit_code(_killed_one_file_save, path) == 9
    assert os.listdir(path) == ["model.safetensors.partial"]
    db.save_hf(full(), path, max_shard_bytes=SHARD_BYTES)
    names = sorted(os.listdir(path))
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    got = db.load({k: torch.zeros_like(v) for k, v in full().items()}, path)
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in full().items())


def _export_killed_after_one_shard(source: str, path: str) -> None:
    """``export_safetensors`` (``convert --force``) killed once its first shard is durable."""
    from dcpbridge.tools import export

    header = export.safetensors_header
    calls = []

    def second_shard_dies(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            os._exit(9)
        return header(*args)

    export.safetensors_header = second_shard_dies  # type: ignore[assignment]
    src = db.open_source(source)
    export.export_safetensors(src, path, max_shard_bytes=SHARD_BYTES)


@pytest.mark.timeout(120)
def test_an_export_killed_over_an_older_one_leaves_the_older_one_whole(tmp_path):
    """Exporting over an earlier export (same file names) writes temp files and renames them
    only once all are durable: a kill mid-way leaves the old export whole (its index naming
    only old shards), and the next export removes the temp files the killed one left."""
    old, new = full(), {k: (_bytes(v) + 1).view(v.dtype).view(v.shape) for k, v in full().items()}
    path, source = str(tmp_path / "hf"), str(tmp_path / "new.pt")
    db.save_hf(old, path, max_shard_bytes=SHARD_BYTES)
    torch.save(new, source)
    assert _exit_code(_export_killed_after_one_shard, source, path) == 9
    template = {k: torch.zeros_like(v) for k, v in old.items()}
    got = db.load(template, path)
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in old.items())
    assert any(n.endswith(".partial") for n in os.listdir(path))
    db.export_safetensors(db.open_source(source), path, max_shard_bytes=SHARD_BYTES)
    assert not any(n.endswith(".partial") for n in os.listdir(path))
    got = db.load(template, path)
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in new.items())


@pytest.mark.parametrize("single_file", [False, True])
def test_an_export_onto_its_own_source_is_refused_and_the_source_kept(tmp_path, single_file):
    """Exporting safetensors into the folder they are read from would truncate the source
    files while reading them, then remove them as a failed export's: refused up front."""
    path = str(tmp_path / "hf")
    db.save_hf(full(), path)
    opened = os.path.join(path, "model.safetensors") if single_file else path
    source = db.open_source(opened)
    try:
        with pytest.raises(db.InvalidArgumentError, match=rf"{path} holds the source"):
            db.export_safetensors(source, path)
    finally:
        source.close()
    got = db.load({k: torch.zeros_like(v) for k, v in full().items()}, path)
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in full().items())


def test_a_folder_named_like_a_safetensors_file_loads(tmp_path):
    """``save_hf`` into ``llama.safetensors/`` (a folder): loaded as the folder it is, not
    refused as a missing file."""
    path = str(tmp_path / "llama.safetensors")
    db.save_hf(full(), path, max_shard_bytes=SHARD_BYTES)
    got = db.load({k: torch.zeros_like(v) for k, v in full().items()}, path)
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in full().items())
    os.remove(os.path.join(path, INDEX))
    os.rename(os.path.join(path, "model-00001-of-00002.safetensors"), f"{path}/a.safetensors")
    os.rename(os.path.join(path, "model-00002-of-00002.safetensors"), f"{path}/b.safetensors")
    got = db.load({k: torch.zeros_like(v) for k, v in full().items()}, path)  # no index
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in full().items())
    os.mkdir(os.path.join(path, "old.safetensors"))  # a folder among the files: not one of them
    got = db.load({k: torch.zeros_like(v) for k, v in full().items()}, path)
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in full().items())


def test_a_tensor_named_like_the_header_metadata_is_refused(tmp_path):
    """A tensor named ``__metadata__`` would replace the header's metadata entry: safetensors
    refuses such a file and dcpbridge reads it without that tensor. Refused before writing."""
    state = {"__metadata__": torch.ones(3), "a": torch.zeros(2)}
    torch.save(state, str(tmp_path / "m.pt"))
    source = db.open_source(str(tmp_path / "m.pt"))
    error = r"tensor '__metadata__': safetensors reserves that name"
    try:
        with pytest.raises(db.SerializationError, match=error):
            db.export_safetensors(source, str(tmp_path / "out"))
    finally:
        source.close()
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(db.SerializationError, match=error):
        db.save_hf(state, str(tmp_path / "saved"))
    assert not os.path.exists(tmp_path / "saved")


def _export(source: Source, out: str, to: str) -> None:
    if to == "safetensors":
        db.export_safetensors(source, out, max_shard_bytes=SHARD_BYTES)
    else:
        db.export_torch(source, os.path.join(out, "model.pt"))


@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_an_export_on_a_full_disk_raises_a_storage_error_and_leaves_nothing(tmp_path, to):
    """EFBIG mid-export (a full disk) is a StorageError naming the destination's file, the
    failed write (the OS's, or torch's zip writer's) as the cause; nothing is left."""
    torch.save(full(), str(tmp_path / "m.pt"))
    source = db.open_source(str(tmp_path / "m.pt"))
    out = str(tmp_path / "out")
    try:
        with (
            file_size_limit(200),
            pytest.raises(db.StorageError, match=rf"^{out}.*: write") as info,
        ):
            _export(source, out, to)
    finally:
        source.close()
    assert isinstance(info.value.__cause__, OSError if to == "safetensors" else RuntimeError)
    assert not os.path.exists(out)


def _header_file(folder, header: dict[str, Any], data: bytes) -> None:
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize(
    ("header", "error"),
    [
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
             "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
            r"model\.safetensors: tensors 'a' and 'b' share bytes \d+\.\.\d+",
        ),
        (
            {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            r"tensor 'a': byte range does not match its shape",
        ),
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
            r"tensor 'a': bytes \d+\.\.\d+ lie past the end of the file",
        ),
    ],
)  # fmt: skip
def test_load_refuses_a_hostile_header(tmp_path, header, error):
    """``db.load`` checks the header before it sizes anything by it (the file holds 12 bytes)."""
    _header_file(tmp_path, header, bytes(12))
    with pytest.raises(db.CorruptCheckpointError, match=error):
        db.load({"a": torch.zeros(2)}, str(tmp_path))


_A8 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("raw", "data", "error"),
    [
        (  # 4 bytes between a and b that no tensor accounts for
            {"a": _A8, "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]}},
            bytes(16),
            r"model\.safetensors: bytes \d+\.\.\d+ before tensor 'b' belong to no tensor",
        ),
        (  # 4 bytes after the last tensor
            {"a": _A8},
            bytes(12),
            r"model\.safetensors: bytes \d+\.\.\d+ at the end of the file belong to no tensor",
        ),
        (  # the header in UTF-16 (Python's json reads it; the format is UTF-8)
            json.dumps({"a": _A8}).encode("utf-16"),
            bytes(8),
            r"safetensors header does not start with '\{'",
        ),
        (  # UTF-32 without a byte order mark: starts with '{', read as UTF-8 it is not JSON
            json.dumps({"a": _A8}).encode("utf-32-le"),
            bytes(8),
            r"safetensors header is not JSON",
        ),
        (  # a header that is not UTF-8 at all
            b'{"a": "\xff"}',
            bytes(8),
            r"safetensors header is not JSON: 'utf-8' codec can't decode",
        ),
    ],
    ids=["gap", "trailing-bytes", "utf-16", "utf-32", "latin-1"],
)  # fmt: skip
def test_load_refuses_files_the_safetensors_package_refuses(tmp_path, raw, data, error):
    """Bytes no tensor accounts for, or a header that is not UTF-8 JSON: a damaged file, or
    one made to be read as something else too. Refused as the ``safetensors`` package does
    (checked here), naming the file and where."""
    raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    with pytest.raises(Exception, match=r"(?i)header|offset|incomplete|invalid"):
        safetensors.torch.load_file(str(path))  # the reference reader refuses it too
    with pytest.raises(db.CorruptCheckpointError, match=error):
        db.load({"a": torch.zeros(2)}, str(tmp_path))


@pytest.mark.parametrize(
    ("header", "index", "error"),
    [
        (
            b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',
            None,
            r"model\.safetensors: safetensors header names 'a' twice",
        ),
        (
            b'{"a":{"dtype":"F32","shape":[1],"dtype":"I32","data_offsets":[0,4]}}',
            None,
            r"model\.safetensors: safetensors header names 'dtype' twice",
        ),
        (
            b'{"__metadata__":{"DCP_SHARDING_INFO":"{\\"a\\":{\\"saved_offsets\\":[0]},'
            b'\\"a\\":{\\"saved_offsets\\":[1]}}"},'
            b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
            None,
            r"model\.safetensors: DCP_SHARDING_INFO names 'a' twice",
        ),
        (
            b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
            b'{"weight_map":{"a":"other.safetensors","a":"model.safetensors"}}',
            rf"{INDEX} names 'a' twice",
        ),
    ],
)
def test_a_name_given_twice_is_refused_not_resolved_to_the_last(tmp_path, header, index, error):
    """JSON with a duplicate name is ambiguous (json keeps the last, other readers the first):
    the file or index is refused instead of loading one of the two silently."""
    data = torch.tensor([1.0, 2.0]).view(torch.uint8).numpy().tobytes()
    (tmp_path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    if index is not None:
        (tmp_path / INDEX).write_bytes(index)
    with pytest.raises(db.CorruptCheckpointError, match=error):
        db.load({"a": torch.zeros(1)}, str(tmp_path))


def test_an_index_larger_than_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """The index is hostile input like a header: its size is checked before it is read
    whole (every rank reads it), so a huge file cannot exhaust the memory of the job."""
    from dcpbridge.formats import safetensors_files

    db.save_hf(full(), str(tmp_path), max_shard_bytes=SHARD_BYTES)
    size = os.path.getsize(tmp_path / INDEX)
    monkeypatch.setattr(safetensors_files, "MAX_INDEX_BYTES", size - 1)
    error = rf"{INDEX} holds {size} bytes, more than an index may \({size - 1}\)"
    with pytest.raises(db.CorruptCheckpointError, match=error):
        db.load({k: torch.zeros_like(v) for k, v in full().items()}, str(tmp_path))
    monkeypatch.setattr(safetensors_files, "MAX_INDEX_BYTES", size)
    db.load({k: torch.zeros_like(v) for k, v in full().items()}, str(tmp_path))


def test_plan_spreads_plain_tensors_and_refuses_disagreeing_ranks():
    """Pure planning: replicated plain tensors go to the least-loaded holder; shapes that
    differ between ranks, or boxes that do not tile, raise before anything is written."""
    f32 = torch.float32
    big = Held("a", (64,), f32, (0,), (64,), True, True)
    small = Held("b", (8,), f32, (0,), (8,), True, True)
    plan = plan_hf([[big, small], [big, small]], 10**9)
    assert [(w.key, w.sizes) for w in plan.writes[0]] == [("a", (64,))]
    assert [(w.key, w.sizes) for w in plan.writes[1]] == [("b", (8,))]
    other = Held("a", (32,), f32, (0,), (32,), True, True)
    with pytest.raises(db.ShardingValidationError, match=r"'a': rank 1 holds it as"):
        plan_hf([[big], [other]], 10**9)
    half = Held("c", (8, 4), f32, (0, 0), (8, 2), True, False)
    with pytest.raises(db.ShardingValidationError, match=r"elements \[0:8, 2:4\] are not written"):
        plan_hf([[half], []], 10**9)


@pytest.mark.timeout(120)
def test_plan_of_many_plain_tensors_takes_linear_time():
    """Each plain tensor's writer was planned by searching that rank's whole holdings for the
    tensor's shape: 30,000 plain tensors on 2 ranks took minutes (about 9 * 10^8 steps).
    Planned from one table now; the plan is the same as before."""
    import time

    f32 = torch.float32
    held = [Held(f"layers.{i}.w", (4,), f32, (0,), (4,), True, True) for i in range(30_000)]
    started = time.perf_counter()
    plan = plan_hf([held, held], 10**9)
    assert time.perf_counter() - started < 20
    writes = sorted((w.key, r, w.sizes) for r, ws in plan.writes.items() for w in ws)
    assert len(writes) == 30_000 and {r for _, r, _ in writes} == {0, 1}
    assert all(sizes == (4,) for _, _, sizes in writes)


def test_save_hf_publish_and_cleanup_failures_raise_storage_errors_or_are_logged(tmp_path, caplog):
    """The one file's rename raised the OS error itself (no StorageError, nothing naming the
    export), and a stale file of an earlier export that could not be removed after the commit
    raised on the coordinator alone, though the export was complete and published (the other
    ranks returned it). The rename's failure is a StorageError leaving nothing; the leftover
    is logged, as ``export_safetensors`` does."""
    from safetensors.torch import load_file

    blocked = tmp_path / "blocked"
    (blocked / "model.safetensors" / "x").mkdir(parents=True)  # a folder where the file goes
    error = rf"{blocked}: publish model\.safetensors: IsADirectoryError"
    with pytest.raises(db.StorageError, match=error) as raised:
        db.save_hf(full(), str(blocked))
    assert isinstance(raised.value.__cause__, IsADirectoryError)
    assert sorted(os.listdir(blocked)) == ["model.safetensors"]  # the folder only
    stale = tmp_path / "stale"
    (stale / "model-00001-of-00005.safetensors" / "x").mkdir(parents=True)
    with caplog.at_level("WARNING"):
        assert db.save_hf(full(), str(stale)).files == ["model.safetensors"]
    assert "could not remove ['model-00001-of-00005.safetensors']" in caplog.text
    got = load_file(str(stale / "model.safetensors"))
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in full().items())


def test_save_hf_writes_the_main_replica_and_refuses_a_plain_tensor_under_a_shard_key(tmp_path):
    """A rank holding a box twice (its main replica and a replica, as ``db.save`` accepts)
    wrote the data of whichever came last: the replica's bytes where they differ. A plain
    tensor whose path is also a ShardedTensor's key was taken for the shard's replica and one
    of the two values dropped. Now the main replica's bytes are written, in either order, and
    two values under one key raise before anything is written, as ``db.save`` raises."""
    from safetensors.torch import load_file

    main = db.ShardedTensor.from_box("a.b", torch.arange(4.0), (4,), (0,))
    copy = db.ShardedTensor.from_box("a.b", torch.zeros(4), (4,), (0,), replica_id=1)
    for i, state in enumerate(({"m": main, "c": copy}, {"c": copy, "m": main})):
        out = tmp_path / f"order{i}"
        db.save_hf(state, str(out))
        assert torch.equal(load_file(str(out / "model.safetensors"))["a.b"], torch.arange(4.0))
    shard = db.ShardedTensor.from_box("a.b", torch.zeros(2), (4,), (2,))
    for i, other in enumerate((main, shard)):
        out = tmp_path / f"both{i}"
        with pytest.raises(db.ShardingValidationError, match=r"'a\.b' is both a plain tensor"):
            db.save_hf({"a": {"b": torch.ones(4)}, "x": other}, str(out))
        assert not out.exists()


@pytest.mark.parametrize(
    ("data", "error", "what"),
    [
        (lambda: torch.arange(4.0).to(torch.complex64).conj(), db.SerializationError, "conjugate"),
        (lambda: torch.arange(4.0)._neg_view(), db.SerializationError, "negative view"),
        (lambda: torch.arange(4.0).to_sparse(), db.ShardingValidationError, "sparse_coo"),
    ],
    ids=["conjugate", "negative", "sparse"],
)
def test_save_hf_refuses_sharded_tensor_data_db_save_refuses(tmp_path, data, error, what):
    """A ShardedTensor over a conjugate or negative view (whose memory holds other values than
    it shows) or over sparse data made ``save_hf`` fail in its write with torch's
    ``RuntimeError``; ``db.save`` refuses them by key. ``save_hf`` now runs the same checks
    before anything is written."""
    out = tmp_path / "hf"
    with pytest.raises(error, match=f"ShardedTensor 'w': .*{what}"):
        db.save_hf({"w": db.ShardedTensor.from_rank_offsets("w", data())}, str(out))
    assert not out.exists()


def test_export_keeps_conjugate_and_negative_views_of_one_storage_apart(tmp_path):
    """A torch.save file keeps a conjugate (or negative) view on its base's storage, with the
    same offset, shape and stride: export took it for a tied weight, wrote the base's values
    once and recorded the view as an alias of it (re-tied on load: the base's values, not the
    view's); and reading the view to write it (convert --to safetensors or dcpbridge) raised
    torch's RuntimeError. Each is written with the values it shows."""
    from safetensors.torch import load_file

    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    f = torch.tensor([1.0, -2.5])
    state = {"c": c, "c_conj": c.conj(), "f": f, "f_neg": f._neg_view(), "f_tied": f}
    src = str(tmp_path / "views.pt")
    torch.save(state, src)
    source = db.open_source(src)
    try:
        result = db.export_safetensors(source, str(tmp_path / "out"))
        db.reshard(source, str(tmp_path / "ck"), db.parse_layout({"world_size": 1}))
    finally:
        source.close()
    template = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in state.items()}
    resharded = db.load(template, str(tmp_path / "ck"))
    assert all(torch.equal(resharded[k], v.resolve_conj().resolve_neg()) for k, v in state.items())
    assert result.aliases == {"f_tied": "f"}
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == ["c", "c_conj", "f", "f_neg"]
    for key in got:
        assert torch.equal(_bytes(got[key]), _bytes(state[key].resolve_conj().resolve_neg()))


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        ("sparse", "a torch.sparse_coo tensor"),
        ("csr", "a torch.sparse_csr tensor"),
        ("quantized", "a quantized tensor"),
        ("nested", "a nested tensor"),
        ("meta", "a torch.strided meta tensor"),
    ],
)
def test_a_torch_file_holding_a_tensor_without_dense_data_is_refused_naming_it(
    tmp_path, kind, what
):
    """Export and reshard of such a torch.save file raised torch's own NotImplementedError or
    RuntimeError mid-way (sparse, nested, meta), or, for a quantized tensor, resharded its
    integer bytes without their scale and zero point (values silently lost; db.save refuses
    the tensor). Opening the file now refuses it, naming the file and the tensor."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's notes on sparse and nested tensors
        odd = {
            "sparse": lambda: torch.eye(3).to_sparse(),
            "csr": lambda: torch.eye(3).to_sparse_csr(),
            "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.5, 3, torch.qint8),
            "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "meta": lambda: torch.empty(3, device="meta"),
        }[kind]()
        src = str(tmp_path / "odd.pt")
        torch.save({"w": torch.ones(2), "layer": {"x": odd}}, src)
    error = rf"{src}: tensor 'layer\.x' is {what}, which has no dense data to read"
    with pytest.raises(db.SerializationError, match=error):
        db.open_source(src)


@pytest.mark.parametrize("shard_bytes", [SHARD_BYTES, 10**9])
def test_save_hf_failing_over_an_earlier_export_leaves_it_whole(tmp_path, monkeypatch, shard_bytes):
    """``save_hf`` into a folder holding an earlier export of the same file names, failing
    halfway: it wrote the shards in place (and had removed the old index first), then removed
    them, so the earlier export was gone. Each file is now written as ``<name>.partial`` and
    renamed into place once all are durable: the earlier export stays byte for byte."""
    from dcpbridge.tools import hf

    old = full()
    new = {k: (_bytes(v) + 1).view(v.dtype).view(v.shape) for k, v in old.items()}
    path = tmp_path / "hf"
    db.save_hf(old, str(path), max_shard_bytes=shard_bytes)
    before = {n: (path / n).read_bytes() for n in os.listdir(path)}
    parts = hf._box_parts

    def full_disk(*args: Any) -> Any:
        yield next(iter(parts(*args)))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf, "_box_parts", full_disk)
    with pytest.raises(db.StorageError, match="No space left on device"):
        db.save_hf(new, str(path), max_shard_bytes=shard_bytes)
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == before
    monkeypatch.undo()
    got = db.load({k: torch.zeros_like(v) for k, v in old.items()}, str(path))
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in old.items())
    db.save_hf(new, str(path), max_shard_bytes=shard_bytes)
    assert sorted(os.listdir(path)) == sorted(before)
    got = db.load({k: torch.zeros_like(v) for k, v in old.items()}, str(path))
    assert all(torch.equal(_bytes(got[k]), _bytes(v)) for k, v in new.items())
