"""Seeded fuzzing of hostile storage: every reader returns the saved bytes or a CheckpointError.

Small real checkpoints (float32, bfloat16, bool, int8, float64 0-dim, an empty tensor, tensors
in several chunks and files, ShardedObjects, common state) are saved in each layout a load
meets: one object per item, packed columns, format 1 (no digest), format 3 (flat blocks) and
without checksums. Copies are then damaged: random bytes of the commit file, re-signed edits
anywhere in it (``planner_data`` included), crafted hostile documents, and damaged data files.
Each copy is read by ``dcpbridge.load``, ``load_common_state_dict``, the metadata readers, the
CLI's ``inspect`` and ``validate --checksums`` and plain ``dcp.load`` with dcpbridge's reader.

Every read must return bit-identical data or raise a ``CheckpointError`` (plain ``dcp.load``:
DCP's ``CheckpointException``), under an address-space limit that turns any large allocation
into a failure. Damaged data bytes of a checkpoint without checksums, or loaded without
verifying them, may load: there only the exception type is judged. (Random damage of one
two-rank checkpoint: ``tests/e2e/test_integrity.py``; hostile packed columns:
``test_encoding.py``.)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
import random
import resource
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.api import CheckpointException

import dcpbridge as db
from dcpbridge import dist_checkpointing as mdc
from dcpbridge.formats.config import load_config
from dcpbridge.storage.format import document as fmt
from dcpbridge.storage.format.document import sign_document
from dcpbridge.tools import cli
from tests.support.old_formats import rewrite_as

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.timeout(240),
]

META = "dcpbridge.json"
VARIANTS = ("rows", "columns", "v1", "v3", "nosum")
COMMON_KEYS = ("e", "i", "step", "cfg")
HEADROOM = 3 << 30  # address space a trial may add: far above what these checkpoints need


# -- the checkpoint -----------------------------------------------------------------------------


@functools.cache
def _saved_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(12, 8, generator=g),
        "b": torch.randn(6, 10, generator=g).to(torch.bfloat16),
        "m": torch.arange(17) % 3 == 0,
        "q": torch.arange(-17, 18, dtype=torch.int8).reshape(5, 7),
        "z": torch.tensor(3.25, dtype=torch.float64),
        "big": torch.arange(300_000, dtype=torch.float32).reshape(500, 600),  # several tiles
    }


def _tensors() -> dict[str, torch.Tensor]:
    """The saved tensors (made once; callers that write copy them)."""
    return dict(_saved_tensors())


OBJECTS = {0: {"seed": 1, "draws": [1, 2]}, 1: {"seed": 2, "draws": [3]}}


def _common() -> dict[str, Any]:
    return {
        "e": torch.zeros(0, 4),
        "i": torch.arange(9),
        "step": 7,
        "cfg": {"lr": 0.5, "names": ["a", "b"], "betas": (0.9, 0.99)},
    }


def _state() -> dict[str, Any]:
    t = _tensors()
    w, b = t["w"], t["b"]
    out: dict[str, Any] = {
        "w0": db.ShardedTensor.from_box("w", w[:5].clone(), (12, 8), (0, 0)),
        "w1": db.ShardedTensor.from_box("w", w[5:].clone(), (12, 8), (5, 0)),
        "w2": db.ShardedTensor.from_box("w", w[12:].clone(), (12, 8), (12, 0)),  # empty shard
        "b0": db.ShardedTensor.from_box("b", b[:, :4].clone(), (6, 10), (0, 0)),
        "b1": db.ShardedTensor.from_box("b", b[:, 4:].clone(), (6, 10), (0, 4)),
    }
    for key in ("m", "q", "z", "big"):
        v = t[key].clone()
        out[key] = db.ShardedTensor.from_box(key, v, tuple(v.shape), (0,) * v.ndim)
    for k, obj in OBJECTS.items():
        out[f"rng{k}"] = db.ShardedObject("rng", obj, (2,), (k,))
    return out | _common()


def _template() -> dict[str, Any]:
    """Whole tensors, a column slice of w and a row slice of b (narrow reads), both objects."""
    out: dict[str, Any] = {
        k: db.ShardedTensor.from_box(k, torch.zeros_like(v), tuple(v.shape), (0,) * v.ndim)
        for k, v in _tensors().items()
    }
    out["w_cols"] = db.ShardedTensor.from_box("w", torch.zeros(12, 3), (12, 8), (0, 5))
    out["b_rows"] = db.ShardedTensor.from_box(
        "b", torch.zeros(2, 10, dtype=torch.bfloat16), (6, 10), (3, 0)
    )
    for k in OBJECTS:
        out[f"rng{k}"] = db.ShardedObject("rng", None, (2,), (k,))
    return out


def _expected() -> dict[str, Any]:
    t = _tensors()
    out: dict[str, Any] = dict(t, w_cols=t["w"][:, 5:], b_rows=t["b"][3:5])
    out |= {f"rng{k}": obj for k, obj in OBJECTS.items()}
    return out | _common()


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and (got.dtype, got.shape) == (want.dtype, want.shape)
            and _bits(got) == _bits(want)
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same(got[k], want[k]) for k in want)
        )
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(map(_same, got, want))
    return type(got) is type(want) and got == want


def _differing(got: dict[str, Any], want: dict[str, Any]) -> set[str]:
    return {k for k in want.keys() | got.keys() if k not in got or not _same(got[k], want.get(k))}


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> dict[str, Path]:
    """One committed checkpoint per variant (trials damage copies)."""
    root = tmp_path_factory.mktemp("hostile")
    out = {}
    for variant in VARIANTS:
        path = root / variant
        with pytest.MonkeyPatch.context() as mp:
            if variant == "columns":
                mp.setattr(fmt, "ROWS_AS_OBJECTS", 0)
            db.save(_state(), str(path), checksums=variant != "nosum")
        if variant in ("v1", "v3"):
            rewrite_as(path, int(variant[1]))
        out[variant] = path
    for variant, path in out.items():  # every reader agrees on the undamaged checkpoints
        assert Reads(path, variant).run("baseline") == {"ok"}, variant
    return out


# -- the readers --------------------------------------------------------------------------------


class Wrong(AssertionError):
    """A reader returned data that differs from what was saved."""


@functools.cache
def _parser() -> Any:
    return cli.build_parser()


def _cli(*argv: str) -> int:
    """A CLI command run without ``main``'s catch-all, so any exception type shows."""
    args = _parser().parse_args(list(argv))
    with contextlib.redirect_stdout(io.StringIO()):
        return cli.COMMANDS[args.command](args, load_config(None))


@contextlib.contextmanager
def _address_space_limit() -> Iterator[None]:
    """Allocations beyond ``HEADROOM`` more address space fail (MemoryError, RuntimeError)
    instead of succeeding: a hostile size must be refused before anything is allocated."""
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    old = resource.getrlimit(resource.RLIMIT_AS)
    limit = used + HEADROOM
    if old[1] != resource.RLIM_INFINITY:
        limit = min(limit, old[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)


def _out_of_memory(e: BaseException | None) -> bool:
    seen = 0
    while e is not None and seen < 20:
        if isinstance(e, MemoryError) or any(m in str(e) for m in ("allocate", "out of memory")):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


@dataclass
class Reads:
    """Every reader over one (damaged) checkpoint; ``run`` returns the outcomes seen."""

    path: Path
    variant: str
    exempt: set[str] = field(default_factory=set)  # keys a consistent edit may change
    data_damaged: bool = False  # data file bytes changed

    def _judge(self, got: dict[str, Any], want: dict[str, Any], *, verified: bool) -> None:
        if not verified:
            return
        wrong = _differing(got, want) - self.exempt
        if wrong:
            raise Wrong(f"wrong data for {sorted(wrong)}")

    @property
    def _verified(self) -> bool:
        """Whether damaged data bytes must be caught (the checkpoint has checksums)."""
        return not (self.data_damaged and self.variant == "nosum")

    def load(self) -> None:
        self._judge(db.load(_template(), str(self.path)), _expected(), verified=self._verified)

    def load_unverified(self) -> None:
        out = db.load(_template(), str(self.path), verify_checksums=False)
        self._judge(out, _expected(), verified=not self.data_damaged)

    def common(self) -> None:
        out = db.load_common_state_dict(str(self.path))
        self._judge(out, _common(), verified=self._verified)

    def metadata(self) -> None:
        db.load_tensors_metadata(str(self.path))
        mdc.load_sharded_metadata(str(self.path))

    def inspect(self) -> None:
        _cli("inspect", str(self.path))  # the report as text (its JSON: test_cli.py)

    def validate(self) -> None:
        code = _cli("validate", str(self.path), "--checksums", "--no-progress")
        if code == 0 and self.data_damaged and self.variant != "nosum":
            try:  # validate passed: the damage must be harmless to a load as well
                self.load()
            except db.CheckpointError as e:
                raise Wrong(f"validate --checksums passed, load refused: {e}") from e

    def plain_dcp(self) -> None:
        want = _tensors()
        sd = {k: torch.zeros_like(v) for k, v in want.items()}
        try:
            dcp.load(
                sd,
                storage_reader=db.FsspecCheckpointReader(str(self.path)),
                planner=db.ShardedLoadPlanner(),
            )
        except CheckpointException as e:  # DCP wraps every failure (even as AssertionError)
            raise db.CheckpointError(str(e)) from None
        self._judge(sd, want, verified=self._verified)

    def run(self, label: str) -> set[str]:
        outcomes = set()
        readers: list[Callable[[], None]] = [
            self.load,
            self.common,
            self.metadata,
            self.inspect,
            self.validate,
            self.plain_dcp,
        ]
        if self.data_damaged:  # the metadata is read as by ``load``
            readers.append(self.load_unverified)
        with _address_space_limit():
            for read in readers:
                try:
                    read()
                    outcomes.add("ok")
                except db.CheckpointError as e:
                    if _out_of_memory(e):  # a failed allocation, even when wrapped
                        raise AssertionError(f"{label}: {read.__name__} ran out of memory") from e
                    outcomes.add("refused")
                except Exception as e:  # any other type, wrong data, a failed allocation
                    raise AssertionError(
                        f"{label}: {read.__name__} raised {type(e).__name__}: {e}"
                    ) from e
        return outcomes


@dataclass
class Tally:
    ok: int = 0
    refused: int = 0

    def add(self, outcomes: set[str]) -> None:
        self.ok += "ok" in outcomes
        self.refused += "refused" in outcomes


def _copy(original: Path, scratch: Path, n: int) -> Path:
    ck = scratch / f"t{n}"
    shutil.copytree(original, ck)
    return ck


# -- random damage of the commit file -------------------------------------------------------------


def _damage_bytes(rng: random.Random, data: bytearray) -> tuple[bytearray, str]:
    kind = rng.choice(["flip", "flip", "truncate", "extend", "splice"])
    if kind == "flip":
        for _ in range(rng.choice([1, 1, 3])):
            pos = rng.randrange(len(data))
            data[pos] ^= rng.randrange(1, 256)
        return data, "flip"
    if kind == "truncate":
        return data[: rng.randrange(len(data))], "truncate"
    if kind == "extend":
        return data + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))), "extend"
    a, b = sorted(rng.randrange(len(data)) for _ in range(2))
    return data[:a] + data[b:], "splice"  # a piece cut out


def test_random_commit_file_damage(originals, tmp_path):
    rng = random.Random(101)
    tally = Tally()
    for n in range(40):
        variant = VARIANTS[n % len(VARIANTS)]
        ck = _copy(originals[variant], tmp_path, n)
        data, kind = _damage_bytes(rng, bytearray((ck / META).read_bytes()))
        (ck / META).write_bytes(bytes(data))
        # format 1 has no digest: a changed byte may make a consistent other document
        exempt = set(_expected()) if variant == "v1" else set()
        tally.add(Reads(ck, variant, exempt).run(f"{variant} {kind}"))
        shutil.rmtree(ck)
    assert tally.refused >= 32, tally


# -- re-signed edits ------------------------------------------------------------------------------

HOSTILE_VALUES: list[Any] = [
    -1, -64, 0, 1, 63, 64, 2**31, 2**40, 2**62, 2**62 + 1, 2**64, 1.5, 64.0, 1e300, True, False,
    None, "", "7", "float32", "bfloat16", "bool", "int8", "qint8", "float8_e4m3fn", "Tensor",
    "../x", "/etc/passwd", "../../etc/passwd", [], {}, [0], [-1], [2**64], [0, -1], [1, 2, 3],
    {"a": 1}, ["a"], [[0]], "\x00", "rng/shard_0_2", "x" * 300,
]  # fmt: skip


def _containers(doc: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(doc, (dict, list)) and doc:
        yield path, doc
        items = doc.items() if isinstance(doc, dict) else enumerate(doc)
        for k, v in items:
            yield from _containers(v, (*path, k))


def _edit(rng: random.Random, doc: dict[str, Any]) -> tuple[Any, ...]:
    """One edit anywhere in ``doc``: replace, nudge, drop, duplicate, swap or rename; returns
    the path it touched."""
    where, box = rng.choice(list(_containers(doc)))
    keys = list(box) if isinstance(box, dict) else list(range(len(box)))
    key = rng.choice(keys)
    action = rng.choice(["replace", "replace", "nudge", "drop", "duplicate", "swap", "rename"])
    if action == "nudge" and type(box[key]) is int:
        box[key] += rng.choice([-64, -1, 1, 64, 1 << 20])
    elif action == "drop":
        del box[key]
    elif action == "duplicate" and isinstance(box, list):
        box.append(copy.deepcopy(box[key]))
    elif action == "swap" and len(keys) > 1:
        other = rng.choice(keys)
        box[key], box[other] = box[other], box[key]
        return where  # both entries changed
    elif action == "rename" and isinstance(box, dict):
        new = rng.choice([*keys, "zz", "rng/shard_1_2", "__common__"])
        box[new] = box.pop(key)
        return where
    else:
        box[key] = copy.deepcopy(rng.choice(HOSTILE_VALUES))
    return (*where, key)


def _touched(doc: dict[str, Any], where: tuple[Any, ...]) -> set[str]:
    """The saved keys whose values an edit at ``where`` may legitimately change: the edited
    document can describe another valid checkpoint only there."""
    everything = set(_expected())
    if len(where) < 2:
        return everything
    section, name = where[0], where[1]
    if section == "tensors" and isinstance(doc.get("tensors"), dict):
        if name in ("names", "dtypes", "shapes", "chunks"):  # packed: by tensor index
            names = doc["tensors"].get("names")
            if len(where) > 2 and isinstance(names, list) and where[2] < len(names):
                name = names[where[2]]
            else:
                return everything
        return {k for k in everything if k == name or k.startswith(f"{name}_")}
    if section == "planner_data":
        if len(where) > 3 and where[1:3] == ("common", "keys"):
            return {str(where[3]).split(".")[0]}
        return set(COMMON_KEYS)
    if section == "objects" and isinstance(name, str):
        return {"rng0", "rng1"} if name.startswith("rng") else {name.split(".")[0]}
    return set() if section in ("items", "checksum", "files", "save_id") else everything


def test_resigned_edits_anywhere(originals, tmp_path):
    """Edits with a matching digest (format 1: none needed) reach the field validation: each
    copy loads the saved data (apart from keys the edit may legitimately redefine) or is
    refused; no reader crashes or allocates what the document claims."""
    rng = random.Random(202)
    tally = Tally()
    raws = {v: (originals[v] / META).read_bytes() for v in VARIANTS}
    for n in range(100):
        variant = VARIANTS[n % len(VARIANTS)]
        doc = json.loads(raws[variant])
        doc.pop("digest", None)
        exempt: set[str] = set()
        wheres = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            where = _edit(rng, doc)
            exempt |= _touched(doc, where)
            wheres.append("/".join(map(str, where)))
        try:
            raw = json.dumps(doc).encode() if variant == "v1" else sign_document(doc)
        except (TypeError, ValueError):  # a value JSON cannot hold here: not a document
            continue
        ck = _copy(originals[variant], tmp_path, n)
        (ck / META).write_bytes(raw)
        tally.add(Reads(ck, variant, exempt).run(f"{variant} resigned edit of {wheres}"))
        shutil.rmtree(ck)
    assert tally.refused >= 60 and tally.ok >= 5, tally


def test_resigned_planner_data_edits(originals, tmp_path):
    """The common-state table is hostile too: edits of ``planner_data`` alone."""
    rng = random.Random(303)
    tally = Tally()
    for n in range(40):
        variant = ("rows", "columns")[n % 2]
        doc = json.loads((originals[variant] / META).read_bytes())
        doc.pop("digest")
        pd = doc["planner_data"]
        # the tables dcpbridge reads (DCP's key-to-path map beside them is torch's alone)
        tables = {k: pd.pop(k) for k in ("common", "objects") if k in pd}
        for _ in range(rng.choice([1, 2])):
            _edit(rng, tables)
        pd.update(tables)
        ck = _copy(originals[variant], tmp_path, n)
        try:
            (ck / META).write_bytes(sign_document(doc))
        except (TypeError, ValueError):
            continue
        tally.add(Reads(ck, variant, set(COMMON_KEYS)).run(f"{variant} planner_data {pd}"))
        shutil.rmtree(ck)
    assert tally.refused >= 15, tally


# -- crafted documents ---------------------------------------------------------------------------


def _sign_raw(body: bytes) -> bytes:
    """Sign raw document text (``sign_document`` of text ``json.dumps`` would not write)."""
    digest = xxhash.xxh3_128_hexdigest(body)
    return body[:-1] + f',"digest":"xxh3_128:{digest}"}}'.encode()


def _body(raw: bytes) -> bytes:
    return raw[: raw.rindex(b',"digest":')] + b"}"


def _with(doc: dict[str, Any], edit: Callable[[dict[str, Any]], Any]) -> bytes:
    doc = copy.deepcopy(doc)
    doc.pop("digest", None)
    edit(doc)
    return sign_document(doc)


def _put(where: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit setting the value at path ``where`` of a document."""

    def edit(doc: dict[str, Any]) -> None:
        box = doc
        for key in where[:-1]:
            box = box[key]
        box[where[-1]] = copy.deepcopy(value)

    return edit


COMMON_TABLE = ("planner_data", "common")
HOSTILE_PATHS: list[Any] = [
    [], ["i", 2**40], ["i", 2**31], ["i", 10**6], ["cfg", "lr", "x"], [["i"]], ["i", True],
    ["i", -1], ["cfg"], ["i", 1.0], [None], "i", ["i", 0],
]  # fmt: skip
FIELDS: list[tuple[tuple[Any, ...], Any]] = [
    *[(("prefixes",), v) for v in (0, 2, 4097, True)],
    *[(("world_size",), v) for v in (0, 2**31 + 1, -1, 3)],
    *[(("save_id",), v) for v in ("", "ABC", "../x", "0" * 65)],
    *[(("version",), v) for v in (0, 2, 3, 6, 4.0)],
    (("format",), "dcp"),
    *[(("checksum",), {"algorithm": "xxh3_64", "block_size": v}) for v in (1, 2**62)],
    (("checksum",), {"algorithm": "md5", "block_size": 64}),
    (("checksum",), []),
    (("files",), []),
    (("tensors",), None),
    (("objects",), []),
    # the common table: indices a load would extend a list to, misplaced and clashing paths
    *[((*COMMON_TABLE, "keys", "i"), path) for path in HOSTILE_PATHS],
    *[
        ((*COMMON_TABLE, "empty"), v)
        for v in (5, [[]], [["cfg"]], [["cfg", "lr"]], [["zz", 2**31]], [["cfg", 0]])
    ],
    ((*COMMON_TABLE, "keys", "zz"), ["zz"]),  # not stored
    ((*COMMON_TABLE, "keys", "step.x"), ["step", "x"]),
    ((*COMMON_TABLE, "keys", "cfg.names.0"), ["cfg", "names", 0]),
    *[(COMMON_TABLE, v) for v in ({}, {"keys": []}, {"keys": {}, "empty": {}}, {"keys": None})],
    *[
        (("planner_data", "objects"), v)
        for v in (None, 5, [], {"rng/shard_0_2": {"key": 5, "global_shape": [2**62]}})
    ],
]


def _crafted(doc: dict[str, Any], raw: bytes) -> Iterator[tuple[str, bytes, set[str]]]:
    """(label, commit file bytes, keys the document may legitimately redefine)."""
    body = _body(raw)
    text = [
        ("duplicate key in tensors", b'"tensors":{', b'"tensors":{"w":{"dtype":"int8"},'),
        ("duplicate top-level key", b'"files":', b'"files":[],"files":'),
        ("nesting 900 deep", b'"planner_data":', b'"x":' + b"[" * 900 + b"]" * 900 + b',"pd":'),
        ("nesting 5000 deep", b'"planner_data":', b'"x":' + b"[" * 5000 + b"]" * 5000 + b',"pd":'),
        ("4000-digit integer", b'"world_size":1', b'"world_size":' + b"9" * 4000),
        ("5000-digit integer", b'"world_size":1', b'"world_size":' + b"9" * 5000),
        ("NaN", b'"created_unix":', b'"created_unix":NaN,"was":'),
        # an integer too large for a float: float() of it raised a bare OverflowError
        ("created_unix 10**400", b'"created_unix":', b'"created_unix":1' + b"0" * 400 + b',"x":'),
        ("Infinity", b'"world_size":1', b'"world_size":Infinity'),
        ("1e400", b'"world_size":1', b'"world_size":1e400'),
    ]
    for label, old, new in text:
        exempt = set(COMMON_KEYS) if label.startswith("nesting") else set()
        yield label, _sign_raw(body.replace(old, new, 1)), exempt
    yield "byte order mark", b"\xef\xbb\xbf" + raw, set()
    yield "UTF-16", raw.decode().encode("utf-16"), set()
    f0 = doc["files"][0]
    names = ["../" + f0, "/tmp/" + f0, "a/" + f0, f0 + "/", "./" + f0, "..", "", "C:\\" + f0]
    names += ["~/" + f0, "s3://b/" + f0, f0.upper(), f0 + "\x00", "%2e%2e/" + f0]
    for where, value in [*((("files", 0), name) for name in names), *FIELDS]:
        label = f"{'/'.join(map(str, where))} = {value!r}"[:120]
        exempt = set(COMMON_KEYS) if where[0] == "planner_data" else set()  # no table: none
        yield label, _with(doc, _put(where, value)), exempt


def _rows_edits(doc: dict[str, Any]) -> Iterator[tuple[str, bytes, set[str]]]:
    """Crafted item fields of a document with one object per item."""

    def chunk(d: dict[str, Any], key: str, i: int = 0) -> dict[str, Any]:
        return d["tensors"][key]["chunks"][i]

    edits: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("chunk past the file end", lambda d: chunk(d, "big").update(offset=1 << 30)),
        ("huge chunk in a tiny file", lambda d: d["tensors"]["m"].update(shape=[2**40]) or chunk(d, "m").update(sizes=[2**40], nbytes=2**40)),
        ("chunks overlapping", lambda d: chunk(d, "w", 1).update(offsets=[4, 0])),
        ("chunk listed twice", lambda d: d["tensors"]["w"]["chunks"].append(chunk(d, "w", 1))),
        ("two items share bytes", lambda d: chunk(d, "q").update(offset=chunk(d, "m")["offset"])),
        ("bool dtype, int8 bytes", lambda d: d["tensors"]["q"].update(dtype="bool")),
        ("bfloat16 as float16", lambda d: d["tensors"]["b"].update(dtype="float16")),
        ("quantized dtype", lambda d: d["tensors"]["q"].update(dtype="qint8")),
        ("complex dtype", lambda d: d["tensors"]["z"].update(dtype="complex64")),
        ("0-dim given a dimension", lambda d: d["tensors"]["z"].update(shape=[1])),
        ("0-dim chunk with offsets", lambda d: chunk(d, "z").update(offsets=[0], sizes=[1])),
        ("empty tensor given chunks", lambda d: d["tensors"]["e"]["chunks"].append(chunk(d, "i"))),
        ("negative size", lambda d: chunk(d, "w").update(sizes=[-5, 8])),
        ("checksums one short", lambda d: chunk(d, "big")["checksums"].pop()),
        ("checksums one long", lambda d: chunk(d, "big")["checksums"].append("0" * 16)),
        ("checksum not hex", lambda d: chunk(d, "m")["checksums"].__setitem__(0, "g" * 16)),
        ("object past the file end", lambda d: d["objects"]["step"].update(nbytes=2**40)),
        ("object file traversal", lambda d: d["objects"]["step"].update(file="../" + d["files"][0])),
        ("object file absolute", lambda d: d["objects"]["step"].update(file="/etc/passwd")),
        ("object renamed onto the legacy blob", lambda d: d["objects"].__setitem__("__common__", d["objects"].pop("step"))),
    ]  # fmt: skip
    for label, edit in edits:
        exempt = {"step"} if "legacy blob" in label else set()
        yield label, _with(doc, edit), exempt


def test_crafted_hostile_documents(originals, tmp_path):
    """Each crafted document (re-signed) is refused, or loads exactly what was saved."""
    tally = Tally()
    n = 0
    for variant in ("rows", "columns"):
        raw = (originals[variant] / META).read_bytes()
        doc = json.loads(raw)
        cases = list(_crafted(doc, raw))
        if variant == "rows":
            cases += list(_rows_edits(doc))
        for label, data, exempt in cases:
            ck = _copy(originals[variant], tmp_path, n := n + 1)
            (ck / META).write_bytes(data)
            tally.add(Reads(ck, variant, exempt).run(f"{variant}: {label}"))
            shutil.rmtree(ck)
    assert tally.refused >= 150, tally


def test_commit_file_and_data_files_that_are_not_files(originals, tmp_path):
    tally = Tally()
    name = json.loads((originals["rows"] / META).read_bytes())["files"][0]
    changes: list[Callable[[Path], Any]] = [
        lambda ck: ((ck / META).unlink(), (ck / META).mkdir()),
        lambda ck: (ck / META).write_bytes(b""),
        lambda ck: ((ck / META).unlink(), (ck / META).symlink_to(ck / META)),
        lambda ck: ((ck / name).unlink(), (ck / name).mkdir()),
        lambda ck: ((ck / name).unlink(), (ck / name).symlink_to("/dev/zero")),
        lambda ck: ((ck / name).unlink(), (ck / name).symlink_to(ck / "missing")),
    ]
    for n, change in enumerate(changes):
        ck = _copy(originals["rows"], tmp_path, n)
        change(ck)
        tally.add(Reads(ck, "rows").run(f"change {n}"))
    assert tally.refused == len(changes), tally


# -- damaged data files ---------------------------------------------------------------------------


def test_random_data_file_damage(originals, tmp_path):
    """Flipped, cut, extended, emptied or deleted data files: a checkpoint with checksums never
    loads changed bytes; one without may, but its readers still raise only CheckpointErrors
    (damaged object bytes included)."""
    rng = random.Random(404)
    tally = Tally()
    for n in range(45):
        variant = VARIANTS[n % len(VARIANTS)]
        ck = _copy(originals[variant], tmp_path, n)
        data_files = sorted(p for p in ck.iterdir() if p.name != META)
        target = rng.choice(data_files)
        data = bytearray(target.read_bytes())
        kind = rng.choice(["flip", "flip", "flip", "truncate", "extend", "empty", "delete"])
        if kind == "delete":
            target.unlink()
        else:
            if kind == "flip":
                for _ in range(rng.choice([1, 1, 4])):
                    data[rng.randrange(len(data))] ^= rng.randrange(1, 256)
            elif kind == "truncate":
                data = data[: rng.randrange(len(data))]
            elif kind == "extend":
                data += bytes(rng.randrange(1, 256))
            else:
                data = bytearray()
            target.write_bytes(bytes(data))
        reads = Reads(ck, variant, data_damaged=kind != "extend")
        tally.add(reads.run(f"{variant} {kind} {target.name}"))
        shutil.rmtree(ck)
    assert tally.refused >= 20 and tally.ok >= 5, tally


def test_every_byte_of_an_object_without_checksums(originals, tmp_path):
    """A checkpoint saved without checksums, an object's bytes damaged one at a time: its
    torch.save data is unreadable (a CorruptCheckpointError naming the object) or loads."""
    doc = json.loads((originals["nosum"] / META).read_bytes())
    item = doc["objects"]["rng/shard_1_2"]
    ck = _copy(originals["nosum"], tmp_path, 0)
    path = ck / item["file"]
    clean = path.read_bytes()
    rng = random.Random(505)
    errors = []
    for pos in sorted(rng.sample(range(item["offset"], item["offset"] + item["nbytes"]), 120)):
        data = bytearray(clean)
        data[pos] ^= 0xFF
        path.write_bytes(bytes(data))
        try:
            db.load({"r": db.ShardedObject("rng", None, (2,), (1,))}, str(ck))
        except db.CheckpointError as e:
            errors.append(str(e))
    assert len(errors) > 20
    assert all("object 'rng/shard_1_2'" in e for e in errors), errors
