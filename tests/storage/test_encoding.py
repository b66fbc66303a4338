"""The packed metadata encoding (versions 3 and 4): item columns, their validation, older versions.

Real saves and loads in one process; hostile documents are re-signed so that only the field
validation stands between them and the loader.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dcpbridge as db
from dcpbridge.planners.boxes import Placed, chunk_arrays, coverage_problems, untiled_keys
from dcpbridge.storage.format import document as fmt
from dcpbridge.storage.format.table import pack_column, unpack_column
from dcpbridge.storage.format.tiling import DISJOINT, OVERLAP, disjointness
from dcpbridge.tools import cli
from tests.support.old_formats import rewrite_as

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
META = "dcpbridge.json"


def _state() -> dict[str, Any]:
    """Tensors in several chunks (one empty), a 0-dim tensor, objects and common values."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(12, 8, generator=g)
    return {
        "w0": db.ShardedTensor.from_box("w", w[:5], (12, 8), (0, 0)),
        "w1": db.ShardedTensor.from_box("w", w[5:], (12, 8), (5, 0)),
        "e": db.ShardedTensor.from_box("w", w[12:], (12, 8), (12, 0)),
        "i": torch.arange(9, dtype=torch.int16).reshape(3, 3),
        "s": torch.tensor(2.5, dtype=torch.float64),
        "rng": db.ShardedObject("rng", {"seed": 7}, (1,), (0,)),
        "step": 11,
        "cfg": {"lr": 0.5, "names": ["a", "b"]},
    }


def _template() -> dict[str, Any]:
    return {
        "w0": db.ShardedTensor.from_box("w", torch.zeros(5, 8), (12, 8), (0, 0)),
        "w1": db.ShardedTensor.from_box("w", torch.zeros(7, 8), (12, 8), (5, 0)),
        "i": torch.zeros(3, 3, dtype=torch.int16),
        "s": torch.tensor(0.0, dtype=torch.float64),
        "rng": db.ShardedObject("rng", None, (1,), (0,)),
    }


def _check_loaded(out: dict[str, Any]) -> None:
    want = _state()
    assert torch.equal(
        torch.cat([out["w0"], out["w1"]]), torch.cat([want["w0"].data, want["w1"].data])
    )
    assert torch.equal(out["i"], want["i"]) and torch.equal(out["s"], want["s"])
    assert out["rng"] == {"seed": 7} and out["step"] == 11 and out["cfg"] == want["cfg"]


@pytest.fixture
def columnar(monkeypatch):
    """Every save packs its items as columns, however few it has."""
    monkeypatch.setattr(fmt, "ROWS_AS_OBJECTS", 0)


@pytest.fixture
def saved(columnar, tmp_path) -> Path:
    path = tmp_path / "ck"
    db.save(_state(), str(path))
    return path


def test_round_trip_and_readers(saved, tmp_path, capsys):
    doc = json.loads((saved / META).read_bytes())
    assert doc["version"] == 4 and set(doc["items"]) >= {"offsets", "sizes", "checksums"}
    assert doc["tensors"]["names"] == ["w", "i", "s"]
    _check_loaded(db.load(_template(), str(saved)))
    meta = db.load_tensors_metadata(str(saved))
    assert meta["w"].global_shape == (12, 8) and meta["i"].dtype == torch.int16
    chunks = fmt.decode_metadata((saved / META).read_bytes(), where="x").state_dict_metadata
    assert [(list(c.offsets), list(c.sizes)) for c in chunks["w"].chunks] == [
        ([0, 0], [5, 8]),
        ([5, 0], [7, 8]),
    ]  # empty shards are not stored
    assert cli.main(["inspect", str(saved), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "w" in json.dumps(report)
    assert cli.main(["validate", str(saved), "--checksums"]) == 0


def test_older_versions_still_load(saved, tmp_path):
    rows = fmt.rows_document((saved / META).read_bytes())
    assert rows["version"] == 4 and len(rows["tensors"]["w"]["chunks"]) == 2
    ck = tmp_path / "v4-rows"
    shutil.copytree(saved, ck)
    (ck / META).write_bytes(fmt.sign_document(rows))
    _check_loaded(db.load(_template(), str(ck)))
    for version in (3, 2, 1):
        ck = tmp_path / f"v{version}"
        shutil.copytree(saved, ck)
        rewrite_as(ck, version)
        assert json.loads((ck / META).read_bytes())["version"] == version
        _check_loaded(db.load(_template(), str(ck)))
        assert cli.main(["validate", str(ck), "--checksums"]) == 0


def test_large_saves_are_columnar_and_small(tmp_path):
    state = {f"t{i}": torch.full((4,), float(i)) for i in range(fmt.ROWS_AS_OBJECTS + 1)}
    db.save(state, str(tmp_path))
    raw = (tmp_path / META).read_bytes()
    assert json.loads(raw)["version"] == 4
    rows = json.dumps(fmt.rows_document(raw)).encode()
    assert len(raw) < len(rows) / 2
    out = db.load({k: torch.zeros(4) for k in state}, str(tmp_path))
    assert all(torch.equal(out[k], v) for k, v in state.items())


# -- hostile packed documents --------------------------------------------------------------------


def _edit_column(name: str, fn) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        col = doc["items"][name]
        values = unpack_column(col, name, checksums=name == "checksums")
        doc["items"][name] = pack_column(fn(values.copy()), compress=name != "checksums")

    return edit


def _set_item(name: str, index: int, value: int):
    def fn(v: np.ndarray) -> np.ndarray:
        v[index] = value
        return v

    return _edit_column(name, fn)


def _raw_column(name: str, **fields: Any):
    return lambda doc: doc["items"][name].update(fields)


def _huge(doc: dict[str, Any], name: str) -> None:
    values = unpack_column(doc["items"][name], name).astype(np.uint64)
    values[0] = np.uint64(2**63)
    doc["items"][name] = pack_column(values)


def _bomb(doc: dict[str, Any]) -> None:
    col = doc["items"]["offset"]
    col["data"] = base64.b64encode(zlib.compress(bytes(1 << 24))).decode()


HOSTILE = [
    ("no items", lambda d: d.pop("items"), "objects must be a JSON object"),
    ("extra column", lambda d: d["items"].update(x=d["items"]["rank"]), "are not the expected"),
    ("unknown type", _raw_column("rank", type="<f8"), "unknown column type"),
    ("count too large", _raw_column("rank", count=2**40), "column count"),
    ("count a bool", _raw_column("rank", count=True), "column count"),
    ("bad base64", _raw_column("rank", data="@@@"), "column data is not valid"),
    ("not zlib", _raw_column("rank", data=base64.b64encode(b"xyz").decode()), "not valid"),
    ("zlib bomb", _bomb, "does not hold"),
    ("short column", _edit_column("nbytes", lambda v: v[:-1]), "values for"),
    ("value beyond 2**62", lambda d: _huge(d, "offset"), "exceeds"),
    ("file index", _set_item("file", 0, 7), "is not among the checkpoint's files"),
    ("unaligned", _set_item("offset", 1, 65), "offset 65 is not 64-byte aligned"),
    ("rank", _set_item("rank", 0, 5), r"rank must be an integer in \[0, 0\], got 5"),
    ("nbytes", _set_item("nbytes", 0, 64), r"tensor 'w' chunk \[0, 0\]: 64 bytes recorded"),
    ("outside", _set_item("offsets", 2, 9), r"tensor 'w' chunk \[9, 0\]: sizes \[7, 8\] exceed"),
    ("overlap", _set_item("sizes", 0, 6), "overlap|bytes recorded"),
    ("gap", _set_item("offsets", 0, 1), r"tensor 'w': chunks cover 152 of 96|overlap"),
    (
        "checksum count",
        _edit_column("checksums", lambda v: v[:-1]),
        "block checksums expected",
    ),
    ("names twice", lambda d: d["tensors"]["names"].__setitem__(1, "w"), "listed twice"),
    ("tensor and object", lambda d: d["objects"].append("w"), "both a tensor and an object"),
    (
        "counts",
        lambda d: d["tensors"]["chunks"].__setitem__(0, 3),
        "values, .* expected|values for",
    ),
    ("dtype", lambda d: d["tensors"]["dtypes"].__setitem__(0, "Tensor"), "unknown dtype"),
    ("shape", lambda d: d["tensors"]["shapes"].__setitem__(0, [2**40, 2**40]), "too many"),
    ("shape float", lambda d: d["tensors"]["shapes"].__setitem__(0, [12.0, 8]), "integer"),
    ("lengths differ", lambda d: d["tensors"]["dtypes"].pop(), "differ in length"),
    (
        "shared bytes",
        lambda d: _set_item("offset", -1, 0)(d) or _set_item("file", -1, 0)(d),
        "overlap",
    ),
]


@pytest.mark.parametrize(("edit", "needle"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_columns_are_refused(saved, tmp_path, edit, needle):
    ck = tmp_path / "bad"
    shutil.copytree(saved, ck)
    doc = json.loads((ck / META).read_bytes())
    edit(doc)
    (ck / META).write_bytes(fmt.sign_document(doc))
    with pytest.raises(db.CorruptCheckpointError, match=needle) as info:
        db.load(_template(), str(ck))
    assert str(ck / META) in str(info.value)


def test_random_column_damage_is_refused_or_harmless(saved, tmp_path):
    rng = random.Random(1)
    doc0 = json.loads((saved / META).read_bytes())
    names = sorted(doc0["items"])
    refused = 0
    for n in range(60):
        doc = json.loads(json.dumps(doc0))
        name = rng.choice(names)
        values = unpack_column(doc["items"][name], name, checksums=name == "checksums")
        values = values.copy()
        i = rng.randrange(len(values))
        values[i] = rng.choice([0, 1, 63, 64, 2**20, 2**62, int(values[i]) + 1])
        doc["items"][name] = pack_column(values, compress=name != "checksums")
        ck = tmp_path / f"t{n}"
        shutil.copytree(saved, ck)
        (ck / META).write_bytes(fmt.sign_document(doc))
        try:
            _check_loaded(db.load(_template(), str(ck)))
        except db.CorruptCheckpointError:
            refused += 1
        shutil.rmtree(ck)
    assert refused > 40


# -- array geometry against the exact checks -------------------------------------------------


def _random_tiling(rng: random.Random, shape: tuple[int, int]) -> list[Placed]:
    rows = sorted(rng.sample(range(1, shape[0]), rng.randint(0, min(3, shape[0] - 1))))
    out = []
    for r0, r1 in zip([0, *rows], [*rows, shape[0]]):
        cols = sorted(rng.sample(range(1, shape[1]), rng.randint(0, min(3, shape[1] - 1))))
        for c0, c1 in zip([0, *cols], [*cols, shape[1]]):
            out.append(Placed((r0, c0), (r1 - r0, c1 - c0), len(out)))
    return out


def _damage(rng: random.Random, chunks: list[Placed]) -> list[Placed]:
    chunks = list(chunks)
    kind = rng.choice(["drop", "dup", "grow", "shift", "none", "none"])
    i = rng.randrange(len(chunks))
    c = chunks[i]
    if kind == "drop" and len(chunks) > 1:
        chunks.pop(i)
    elif kind == "dup":
        chunks.append(c)
    elif kind == "grow":
        chunks[i] = Placed(c.offsets, (c.sizes[0] + 1, c.sizes[1]), c.rank)
    elif kind == "shift":
        chunks[i] = Placed((c.offsets[0], max(0, c.offsets[1] - 1)), c.sizes, c.rank)
    return chunks


def test_array_coverage_check_agrees_with_the_exact_one():
    rng = random.Random(0)
    shapes, per_key = [], []
    for _ in range(300):
        shape = (rng.randint(2, 9), rng.randint(2, 9))
        shapes.append(shape)
        per_key.append(_damage(rng, _random_tiling(rng, shape)))
    flat = [c for chunks in per_key for c in chunks]
    kid = np.repeat(np.arange(len(shapes)), [len(c) for c in per_key])
    offsets, sizes, dims = chunk_arrays([c.offsets for c in flat], [c.sizes for c in flat], 2)
    flagged = set(untiled_keys(shapes, kid, offsets, sizes, dims))
    exact = {k for k, chunks in enumerate(per_key) if coverage_problems("k", shapes[k], chunks)}
    assert exact <= flagged  # never misses a problem; flagged keys get the exact check
    assert exact == {k for k in flagged if coverage_problems("k", shapes[k], per_key[k])}
    assert len(exact) > 50


def test_disjointness_is_exact_or_unknown():
    rng = random.Random(2)
    for _ in range(200):
        boxes = [
            ((rng.randrange(6), rng.randrange(6)), (rng.randint(1, 3), rng.randint(1, 3)))
            for _ in range(rng.randint(1, 6))
        ]
        o = np.array([b[0] for b in boxes], dtype=np.int64)
        s = np.array([b[1] for b in boxes], dtype=np.int64)
        (status,) = disjointness(np.zeros(len(boxes), dtype=np.int64), o, s, 1)
        truth = any(
            all(a < b + m and b < a + n for a, n, b, m in zip(*boxes[i], *boxes[j]))
            for i in range(len(boxes))
            for j in range(i)
        )
        if status == DISJOINT:
            assert not truth
        elif status == OVERLAP:
            assert truth


def test_planning_a_million_chunk_layout_shape_is_checked_as_arrays():
    """Many ranks, many chunks per key: the array check passes a clean layout without the
    worded per-chunk check, and names a missing rank's chunk."""
    from benchmarks import bench_planning as bp
    from dcpbridge.planners import build_metadata

    plans = bp._plans(64, bp._fsdp(64, 16, 2, 8))
    md = build_metadata(plans)
    assert len(md.state_dict_metadata["layers.3.weight"].chunks) == 64
    plans[5].items.pop()
    with pytest.raises(db.ShardingValidationError, match=r"layers.15.weight.*\[10:12, 0:8\]"):
        build_metadata(plans)


def test_reshard_over_many_decoded_chunks(columnar, tmp_path):
    """A tensor of 100 chunks, decoded as columns, read back in other boxes (the array
    search of the load planner)."""
    full = torch.arange(1000.0).reshape(100, 10)
    state = {
        f"r{i}": db.ShardedTensor.from_box("x", full[i : i + 1], (100, 10), (i, 0))
        for i in range(100)
    }
    db.save(state, str(tmp_path))
    assert json.loads((tmp_path / META).read_bytes())["version"] == 4
    parts = [(0, 33), (33, 34), (67, 33)]
    tmpl = {
        f"p{a}": db.ShardedTensor.from_box("x", torch.zeros(n, 10), (100, 10), (a, 0))
        for a, n in parts
    }
    tmpl["cols"] = db.ShardedTensor.from_box("x", torch.zeros(100, 3), (100, 10), (0, 7))
    out = db.load(tmpl, str(tmp_path))
    for a, n in parts:
        assert torch.equal(out[f"p{a}"], full[a : a + n])
    assert torch.equal(out["cols"], full[:, 7:])


def test_planner_data_is_written_as_plain_json_or_refused():
    """Tuples become lists, keys strings, nesting is kept; a value JSON cannot hold raises."""
    data = {"a.b": ("a", "b"), "x": ["x", 0], 3: {"k": (1, 2.5, None, True)}, "n": [("p", 1)]}
    assert fmt._jsonable(data) == {
        "a.b": ["a", "b"],
        "x": ["x", 0],
        "3": {"k": [1, 2.5, None, True]},
        "n": [["p", 1]],
    }
    for bad in ({"k": {1, 2}}, {"k": ["a", object()]}, {"k": torch.zeros(1)}):
        with pytest.raises(TypeError, match="planner_data must be JSON-serializable"):
            fmt._jsonable(bad)


@pytest.mark.parametrize(
    "digest",
    ["ABCDEF0123456789", "\uff10" * 16, "0x0123456789abcd", " 123456789abcdef", 12345678],
)
def test_a_rows_document_refuses_checksums_that_are_not_lowercase_hex(tmp_path, digest):
    """One object per item (a small save): a checksum in capitals, other digits, a prefix, a
    space or a number is refused; the untouched document decodes, each item's checksums as
    written (looked up one row at a time)."""
    path = tmp_path / "ck"
    db.save(_state(), str(path))
    doc = json.loads((path / META).read_bytes())
    assert "items" not in doc  # rows, not columns
    decoded = fmt.decode_metadata((path / META).read_bytes(), where="ck").storage_data
    for fqn, entry in doc["tensors"].items():
        for c in entry["chunks"]:
            assert decoded.items.get((fqn, tuple(c["offsets"]))).checksums == tuple(c["checksums"])
    doc.pop("digest")
    doc["tensors"]["w"]["chunks"][1]["checksums"][0] = digest
    with pytest.raises(db.CorruptCheckpointError, match="checksums must be 16 hex digits each"):
        fmt.decode_metadata(fmt.sign_document(doc), where="ck")


@pytest.mark.parametrize(
    ("names", "dtypes", "shapes", "needle"),
    [
        (["a", "b", "c"], ["float32", "Tensor", "nope"], [[1], [2], [3]], "'Tensor'"),
        (["a", "b"], ["float32", "float32"], [[1], [True]], "tensor 'b' shape"),
        (["a", "b"], ["float32", "int8"], [[2], [-1]], "tensor 'b' shape"),
        (["a", 3], ["float32", "float32"], [[1], [1]], "tensor name 3"),
        (["a", "b"], ["float32", "float64"], [[1], [2**61]], "tensor 'b' shape"),
        (["a", "b"], ["float32", "float32"], [[1], [2] * 65], "tensor 'b' shape"),
    ],
)
def test_tensor_headers_checked_as_columns_refuse_the_first_bad_tensor(
    names, dtypes, shapes, needle
):
    """The column-at-a-time check of well-formed headers hands anything else to the
    tensor-by-tensor one, which names the first bad tensor as before."""
    from dcpbridge.storage.format.fields import tensor_headers

    with pytest.raises(db.CorruptCheckpointError, match=needle):
        tensor_headers(names, dtypes, shapes)
    good = tensor_headers(["a", "b"], ["float32", "bfloat16"], [[2, 3], []])
    assert [(h.name, h.dtype, h.shape) for h in good] == [
        ("a", torch.float32, (2, 3)),
        ("b", torch.bfloat16, ()),
    ]
