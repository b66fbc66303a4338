"""Damaged or crafted checkpoints are refused; failed saves leave nothing (faults: test_faults.py).

The corruption trials damage a real two-rank checkpoint (tensors in several chunks from both
ranks' files, ShardedObjects, common state) one way at a time; every trial must either load
bit-identical data or raise a ``CheckpointError`` naming the damaged file, and no load may
allocate far more than the checkpoint holds.
"""

from __future__ import annotations

import contextlib
import fractions
import json
import os
import random
import re
import shutil
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import dcpbridge as db
from dcpbridge.storage.format.document import FORMAT_VERSION, sign_document
from tests.support import layouts as L
from tests.support.dist_pool import Rank
from tests.support.limits import file_size_limit
from tests.support.old_formats import rewrite_as

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

META = "dcpbridge.json"
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "w": ((12, 8), torch.float32),
    "v": ((6, 10), torch.bfloat16),
    "i": ((9,), torch.int64),
}
COMMON = {"step": 7, "run": "integrity"}


def _full(key: str) -> torch.Tensor:
    shape, dtype = SHAPES[key]
    return L.full(key, shape, dtype)


def _pieces(rank: int) -> dict[str, db.ShardedTensor | db.ShardedObject]:
    """Rank 0 holds rows 0:6 of w (two chunks), cols 0:4 of v, i[0:4]; rank 1 the rest."""
    w, v, i = _full("w"), _full("v"), _full("i")
    if rank == 0:
        boxes = {"w0": ("w", (0, 0), (4, 8)), "w1": ("w", (4, 0), (2, 8))}
        boxes |= {"v": ("v", (0, 0), (6, 4)), "i": ("i", (0,), (4,))}
    else:
        boxes = {"w0": ("w", (6, 0), (6, 8)), "v": ("v", (0, 4), (6, 6)), "i": ("i", (4,), (5,))}
    full = {"w": w, "v": v, "i": i}
    out: dict[str, Any] = {}
    for name, (key, off, size) in boxes.items():
        region = tuple(slice(o, o + s) for o, s in zip(off, size))
        out[name] = db.ShardedTensor.from_box(key, full[key][region].clone(), full[key].shape, off)
    out["rng"] = db.ShardedObject("rng", {"seed": 100 + rank, "draws": [rank] * 5}, (2,), (rank,))
    return out


def save_two_ranks(r: Rank, path: str) -> None:
    db.save({**_pieces(r.rank), **COMMON}, path, process_group=r.group)


def _template() -> dict[str, Any]:
    tmpl: dict[str, Any] = {
        k: db.ShardedTensor.from_box(k, torch.zeros(s, dtype=d), s, (0,) * len(s))
        for k, (s, d) in SHAPES.items()
    }
    tmpl |= {f"rng{k}": db.ShardedObject("rng", None, (2,), (k,)) for k in range(2)}
    return tmpl


def _expected() -> dict[str, Any]:
    out: dict[str, Any] = {k: _full(k) for k in SHAPES}
    out |= {f"rng{k}": {"seed": 100 + k, "draws": [k] * 5} for k in range(2)}
    return {**out, **COMMON}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _identical(out: dict[str, Any], expected: dict[str, Any]) -> bool:
    if out.keys() != expected.keys():
        return False
    for k, want in expected.items():
        got = out[k]
        if isinstance(want, torch.Tensor):
            if not isinstance(got, torch.Tensor) or got.dtype != want.dtype:
                return False
            if got.shape != want.shape or _bits(got) != _bits(want):
                return False
        elif got != want:
            return False
    return True


@pytest.fixture(scope="module")
def original(pool, tmp_path_factory) -> Path:
    """A committed two-rank checkpoint that no test modifies (trials work on copies)."""
    path = tmp_path_factory.mktemp("integrity") / "ck"
    pool.run(save_two_ranks, 2, str(path))
    assert _identical(db.load(_template(), str(path)), _expected())
    return path


def _as_format_1(ck: Path) -> None:
    """Rewrite the commit file as format 1 wrote it: no digest, flat checksum blocks."""
    rewrite_as(ck, 1)


# -- mutations ----------------------------------------------------------------------------------


@dataclass
class Trial:
    """One way of damaging one file of a copy of the checkpoint."""

    file: str
    kind: str
    detail: str = ""


def _flip(rng: random.Random, data: bytearray) -> str:
    pos = rng.randrange(len(data))
    data[pos] ^= rng.randrange(1, 256)
    return f"byte {pos}"


def _digit(rng: random.Random, data: bytearray, within: tuple[int, int] | None = None) -> str:
    lo, hi = within or (0, len(data))
    digits = [m.start() + lo for m in re.finditer(rb"\d", bytes(data[lo:hi]))]
    if within is not None:  # values only: format 1 cannot tell an edited key from a real one
        in_key = bytearray(len(data))
        for m in re.finditer(rb'"([^"]+)":', bytes(data)):
            in_key[m.start(1) : m.end(1)] = b"\1" * (m.end(1) - m.start(1))
        digits = [d for d in digits if not in_key[d]]
    pos = rng.choice(digits)
    data[pos] = rng.choice([d for d in b"0123456789" if d != data[pos]])
    return f"digit at {pos}"


def _key_char(rng: random.Random, data: bytearray) -> str:
    keys = [m.span(1) for m in re.finditer(rb'"([^"]+)":', bytes(data))]
    start, stop = rng.choice(keys)
    pos = rng.randrange(start, stop)
    data[pos] = rng.choice([c for c in b"abcdefghijklmnopqrstuvwxyz_0" if c != data[pos]])
    return f"key char at {pos}"


def _sections(data: bytes) -> tuple[int, int]:
    """Byte span of the tensors, objects and files entries (what load interprets)."""
    start = data.index(b'"files":')
    stop = data.index(b'"planner_data":')
    return start, stop


def mutate_bytes(rng: random.Random, ck: Path, name: str, *, format_1: bool) -> Trial:
    """Damage file ``name`` at random: bit flips, truncation, extension, deletion or, for the
    commit file, edits of digits, key characters or structure."""
    path = ck / name
    data = bytearray(path.read_bytes())
    kinds = ["flip", "truncate", "extend", "delete"]
    if name == META and format_1:  # no digest: a flipped key renames an entry unnoticed
        kinds = ["truncate", "extend", "delete"] + ["digit"] * 6
    elif name == META:
        kinds += ["digit", "key", "structure"]
    kind = rng.choice(kinds)
    detail = ""
    if kind == "flip":
        detail = _flip(rng, data)
    elif kind == "truncate":
        data = data[: rng.randrange(len(data))]
        detail = f"to {len(data)}"
    elif kind == "extend":
        data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    elif kind == "delete":
        path.unlink()
        return Trial(name, kind)
    elif kind == "digit":  # format 1 has no digest: only edit what its validation covers
        detail = _digit(rng, data, _sections(bytes(data)) if format_1 else None)
    elif kind == "key":
        detail = _key_char(rng, data)
    else:
        doc = json.loads(data)
        detail = edit_structure(rng, doc)
        data = bytearray(json.dumps(doc, separators=(",", ":")).encode())
    path.write_bytes(bytes(data))
    return Trial(name, kind, detail)


def _containers(doc: Any, path: str = "") -> list[tuple[str, Any]]:
    found = [(path, doc)] if isinstance(doc, (dict, list)) else []
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    )
    for k, v in items:
        found += _containers(v, f"{path}/{k}")
    return found


HOSTILE_VALUES: list[Any] = [
    -1, -64, 2**29, 2**62, 2**64, 2**63 - 1, 1.5, 64.0, True, None, "7", [], {}, [2**64],
    [0, -1], "../../etc/passwd", "float32", "Tensor", 0,
]  # fmt: skip


def edit_structure(rng: random.Random, doc: dict[str, Any], *, scope: str = "") -> str:
    """One structural edit somewhere under ``scope``: drop, duplicate, swap or replace a value.

    With a ``scope``, whole entries are not dropped or swapped: that makes a valid document of
    another checkpoint (an object renamed, the common state left out), which only the digest
    can tell from the real one.
    """
    places = [
        (p, c)
        for p, c in _containers(doc)
        if p.startswith(scope) and c and not (scope and p in ("/tensors", "/objects"))
    ]
    where, box = rng.choice(places)
    key = rng.choice(list(box.keys()) if isinstance(box, dict) else range(len(box)))
    action = rng.choice(["drop", "duplicate", "swap", "replace", "replace"])
    if action == "drop":
        del box[key]
    elif action == "duplicate" and isinstance(box, list):
        box.append(json.loads(json.dumps(box[key])))
    elif action == "swap" and len(box) > 1:
        other = rng.choice([k for k in (box.keys() if isinstance(box, dict) else range(len(box)))])
        box[key], box[other] = box[other], box[key]
    else:
        box[key] = rng.choice(HOSTILE_VALUES)
    return f"{action} {where}/{key}"


# -- running trials -----------------------------------------------------------------------------


@dataclass
class Tally:
    trials: int = 0
    identical: int = 0
    refused: int = 0
    worst_peak: int = 0
    worst: str = ""
    traced: int = 0  # trials whose allocations were traced
    kinds: dict[str, int] = field(default_factory=dict)


def _checkpoint_bytes(ck: Path) -> int:
    return sum(p.stat().st_size for p in ck.iterdir())


def run_trial(
    ck: Path,
    trial: Trial,
    tally: Tally,
    *,
    names_file: bool = True,
    expected: dict[str, Any],
    traced: bool = True,
) -> None:
    """Load the damaged copy ``ck``: identical data, or a CheckpointError naming the file;
    ``traced``: with its peak allocation recorded (tracing makes a load 2.5x as costly)."""
    if traced:
        tracemalloc.start()
    peak = 0
    try:
        out = db.load(_template(), str(ck))
        outcome: BaseException | dict[str, Any] = out
    except db.CheckpointError as e:
        outcome = e
    except Exception as e:  # any other exception is a defect: report the trial
        raise AssertionError(f"{trial}: crashed with {type(e).__name__}: {e}") from e
    finally:
        if traced:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
    tally.trials += 1
    tally.traced += traced
    tally.kinds[trial.kind] = tally.kinds.get(trial.kind, 0) + 1
    if peak > tally.worst_peak:
        tally.worst_peak, tally.worst = peak, f"{trial}"
    if isinstance(outcome, BaseException):
        tally.refused += 1
        if names_file:
            assert trial.file in str(outcome), f"{trial}: error does not name the file: {outcome}"
    else:
        assert _identical(outcome, expected), f"{trial}: loaded different data without an error"
        tally.identical += 1


def corruption_trials(
    original: Path, scratch: Path, seed: int, count: int, *, trace_every: int = 1
) -> Tally:
    """``count`` seeded trials on format-2 copies and on format-1 (no digest) copies, every
    ``trace_every``-th one with its allocations traced."""
    rng = random.Random(seed)
    expected = _expected()
    names = sorted(p.name for p in original.iterdir())
    tally = Tally()
    with _fast_scratch(scratch) as fast:
        format_1 = fast / "format-1"  # rewritten once, copied for each format-1 trial
        shutil.copytree(original, format_1)
        _as_format_1(format_1)
        for n in range(count):
            traced = n % trace_every == 0
            _one_trial(rng, (original, format_1), fast / f"t{n}", n, names, tally, expected, traced)
    limit = max(64 * _checkpoint_bytes(original), 8 << 20)
    assert tally.traced and tally.worst_peak < limit, f"peak {tally.worst_peak} in {tally.worst}"
    return tally


@contextlib.contextmanager
def _fast_scratch(scratch: Path) -> Iterator[Path]:
    """A directory on tmpfs where there is one (a trial's copy is made and removed in
    microseconds there, milliseconds on disk), else ``scratch``."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield scratch
        return
    fast = Path(tempfile.mkdtemp(prefix="dcpb-trials-", dir=shm))
    try:
        yield fast
    finally:
        shutil.rmtree(fast, ignore_errors=True)


def _one_trial(
    rng: random.Random,
    originals: tuple[Path, Path],
    ck: Path,
    n: int,
    names: list[str],
    tally: Tally,
    expected: dict[str, Any],
    traced: bool,
) -> None:
    """Damage a fresh copy ``ck`` of the checkpoint, as written or as format 1 wrote it (every
    trial under a new path), and load it."""
    format_1 = n % 3 == 2
    shutil.copytree(originals[format_1], ck)
    name = META if rng.random() < 0.5 else rng.choice(names)
    trial = mutate_bytes(rng, ck, name, format_1=format_1)
    trial.kind = f"v{1 if format_1 else 2}-{trial.kind}"
    run_trial(ck, trial, tally, expected=expected, traced=traced)
    shutil.rmtree(ck)


def _report(label: str, tally: Tally) -> None:
    print(
        f"\n{label}: {tally.trials} trials, {tally.refused} refused, {tally.identical} loaded "
        f"identical data, worst peak allocation of {tally.traced} traced {tally.worst_peak} "
        f"bytes ({tally.worst}); "
        f"kinds {dict(sorted(tally.kinds.items()))}"
    )


def test_random_damage_is_refused_or_harmless(original, tmp_path):
    tally = corruption_trials(original, tmp_path, seed=11, count=500)
    _report("damage", tally)
    assert tally.refused > tally.trials // 2 and tally.identical > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_random_damage_is_refused_or_harmless_thousands(original, tmp_path):
    """More seeds of the same damage; the allocation bound on every 4th trial (an unbiased
    sample of the same kinds: the 500 trials above trace every one)."""
    for seed in range(4):
        tally = corruption_trials(original, tmp_path, seed, 1000, trace_every=4)
        _report(f"damage seed {seed}", tally)


def test_resigned_edits_are_refused_by_validation(original, tmp_path):
    """Edits with a matching digest (a buggy writer, a hand edit) meet the field validation:
    the loader refuses them or, where the edit changes nothing it reads, loads the same data."""
    rng = random.Random(5)
    expected = _expected()
    tally = Tally()
    doc0 = json.loads((original / META).read_bytes())
    scopes = ["/tensors", "/objects", "/files", "/checksum", "/world_size", "/save_id"]
    for n in range(300):
        ck = tmp_path / f"t{n}"
        shutil.copytree(original, ck)
        doc = json.loads(json.dumps(doc0))
        if n % 2:
            detail = edit_structure(rng, doc, scope=rng.choice(scopes[:3]))
        else:
            field_ = rng.choice(scopes)
            detail = f"replace {field_}"
            doc[field_[1:]] = rng.choice(HOSTILE_VALUES)
        (ck / META).write_bytes(sign_document(doc))
        # a resigned document may be valid yet describe other keys: the planner names those
        run_trial(ck, Trial(META, "resigned", detail), tally, names_file=False, expected=expected)
        shutil.rmtree(ck)
    _report("resigned", tally)
    assert tally.refused > 200


# -- crafted documents --------------------------------------------------------------------------


def _first_chunk(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["tensors"]["w"]["chunks"][0]


def _object(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["objects"]["rng/shard_0_2"]


def _last_object(doc: dict[str, Any]) -> dict[str, Any]:
    """The object stored last in its data file."""
    items = [c for t in doc["tensors"].values() for c in t["chunks"]] + list(
        doc["objects"].values()
    )
    objects = [o for o in doc["objects"].values()]
    return max(
        objects,
        key=lambda o: (
            o["offset"] == max(i["offset"] for i in items if i["file"] == o["file"]),
            o["offset"],
        ),
    )


def _unchecked(doc: dict[str, Any]) -> None:
    doc["checksum"] = None
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            c.pop("checksums", None)
    for o in doc["objects"].values():
        o.pop("checksums", None)


def _set(fn: Callable[[dict[str, Any]], dict[str, Any]], field_: str, value: Any):
    return lambda doc: fn(doc).__setitem__(field_, value)


def _huge_object(nbytes: int, *, checksums: bool) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        if not checksums:
            _unchecked(doc)
        obj = _last_object(doc)  # the last item of its file: only the file's end bounds it
        obj["nbytes"] = nbytes
        if checksums:
            obj["checksums"] = ["0123456789abcdef"] * (nbytes >> 20)

    return edit


CRAFTED: list[tuple[str, Callable[[dict[str, Any]], None], type[Exception], str]] = [
    (
        "object of 2**29 bytes",
        _huge_object(2**29, checksums=True),
        db.CorruptCheckpointError,
        r"dcpbridge.json places object '[^']+' at bytes \d+\.\.\d+ of __0_0\.\w+\.bin, "
        "which has only",
    ),
    (
        "object of 2**62 bytes",
        _huge_object(2**62, checksums=False),
        db.CorruptCheckpointError,
        r"places object '[^']+' at bytes .* which has only \d+ bytes",
    ),
    (
        "offset 2**64",
        _set(_first_chunk, "offset", 2**64),
        db.CorruptCheckpointError,
        r"tensor 'w' chunk \[0, 0\] offset must be an integer in \[0, 4611686018427387904\]",
    ),
    (
        "negative byte offset",
        _set(_object, "offset", -64),
        db.CorruptCheckpointError,
        r"object 'rng/shard_0_2' offset must be an integer .* got -64",
    ),
    (
        "unaligned byte offset",
        _set(_object, "offset", 65),
        db.CorruptCheckpointError,
        "offset 65 is not 64-byte aligned",
    ),
    (
        "chunk offsets 2**64",
        _set(_first_chunk, "offsets", [2**64, 0]),
        db.CorruptCheckpointError,
        "tensor 'w' chunk offsets must be an integer",
    ),
    (
        "overlapping chunks",
        _set(_first_chunk, "offsets", [2, 0]),
        db.CorruptCheckpointError,
        r"tensor 'w': chunks \[2, 0\]\+\[4, 8\] and \[4, 0\]\+\[2, 8\] overlap",
    ),
    (
        "chunk outside the tensor",
        _set(_first_chunk, "offsets", [10, 0]),
        db.CorruptCheckpointError,
        r"tensor 'w' chunk \[10, 0\]: sizes \[4, 8\] exceed shape \[12, 8\]",
    ),
    (
        "float where an integer belongs",
        _set(_first_chunk, "nbytes", 128.0),
        db.CorruptCheckpointError,
        "tensor 'w' chunk \\[0, 0\\] nbytes must be an integer .* got 128.0",
    ),
    (
        "bool rank",
        _set(_object, "rank", True),
        db.CorruptCheckpointError,
        "rank must be an integer",
    ),
    (
        "string offsets",
        _set(_first_chunk, "offsets", ["0", "0"]),
        db.CorruptCheckpointError,
        "tensor 'w' chunk offsets must be an integer",
    ),
    (
        "byte size not matching the chunk",
        _set(_first_chunk, "nbytes", 64),
        db.CorruptCheckpointError,
        r"tensor 'w' chunk \[0, 0\]: 64 bytes recorded, 128 expected",
    ),
    (
        "missing field",
        lambda doc: _first_chunk(doc).pop("file"),
        db.CorruptCheckpointError,
        r"tensor 'w' chunk \[0, 0\]: field 'file' is missing",
    ),
    (
        "no chunks for a non-empty tensor",
        lambda doc: doc["tensors"]["i"].__setitem__("chunks", []),
        db.CorruptCheckpointError,
        "tensor 'i': chunks cover 0 of 9 elements",
    ),
    (
        "a chunk missing",
        lambda doc: doc["tensors"]["w"]["chunks"].pop(),
        db.CorruptCheckpointError,
        "tensor 'w': chunks cover 48 of 96 elements",
    ),
    (
        "shape whose product overflows",
        lambda doc: doc["tensors"]["w"].__setitem__("shape", [2**40, 2**40]),
        db.CorruptCheckpointError,
        "tensor 'w' shape: .* elements are too many",
    ),
    (
        "unknown dtype",
        lambda doc: doc["tensors"]["w"].__setitem__("dtype", "Tensor"),
        db.CorruptCheckpointError,
        "unknown dtype 'Tensor'",
    ),
    (
        "file outside the list",
        _set(_object, "file", "__0_9.0123456789abcdef.bin"),
        db.CorruptCheckpointError,
        "file '__0_9.0123456789abcdef.bin' is not among the checkpoint's files",
    ),
    (
        "path escape",
        _set(_object, "file", "../../etc/passwd"),
        db.UnsafePathError,
        r"\.\./\.\./etc/passwd",
    ),
    (
        "tensors not a mapping",
        lambda doc: doc.__setitem__("tensors", []),
        db.CorruptCheckpointError,
        "tensors must be a JSON object",
    ),
    (
        "newer format",
        lambda doc: doc.__setitem__("version", FORMAT_VERSION + 1),
        db.CorruptCheckpointError,
        f"format version {FORMAT_VERSION + 1} is newer than this dcpbridge reads",
    ),
    (
        "version as a string",
        lambda doc: doc.__setitem__("version", "2"),
        db.CorruptCheckpointError,
        "format version '2' is not valid",
    ),
    (
        "checksum count",
        lambda doc: _object(doc).__setitem__("checksums", []),
        db.CorruptCheckpointError,
        "1 block checksums expected",
    ),
    (
        "unknown checksum algorithm",
        lambda doc: doc["checksum"].__setitem__("algorithm", "md5"),
        db.CorruptCheckpointError,
        "unknown checksum algorithm 'md5'",
    ),
    (
        "two items share bytes",
        lambda doc: _object(doc).update(
            offset=_first_chunk(doc)["offset"], file=_first_chunk(doc)["file"]
        ),
        db.CorruptCheckpointError,
        "the bytes of .* overlap",
    ),
]


@pytest.mark.parametrize(
    ("edit", "exc", "needle"), [c[1:] for c in CRAFTED], ids=[c[0] for c in CRAFTED]
)
def test_crafted_metadata_is_refused_before_allocation(original, tmp_path, edit, exc, needle):
    ck = tmp_path / "ck"
    shutil.copytree(original, ck)
    doc = json.loads((ck / META).read_bytes())
    edit(doc)
    (ck / META).write_bytes(sign_document(doc))
    tracemalloc.start()
    try:
        with pytest.raises(exc, match=needle) as info:
            db.load(_template(), str(ck))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated before refusing"
    if exc is db.CorruptCheckpointError and "places object" not in needle:
        assert str(ck / META) in str(info.value)
    # the offline tools decode the same way
    with pytest.raises(exc, match=needle):
        _read_offline(ck)


def _read_offline(ck: Path) -> None:
    source = db.open_source(str(ck))
    source.read("w", (0, 0), (12, 8))
    for key in sorted(source.objects):
        source.object(key)


def test_format_1_checkpoints_still_load(original, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(original, ck)
    _as_format_1(ck)
    assert _identical(db.load(_template(), str(ck)), _expected())
    assert db.load_common_state_dict(str(ck)) == COMMON


def test_one_changed_byte_of_a_key_is_detected(original, tmp_path):
    """Any key, the common state's included: without the digest such an edit silently drops
    or renames an entry."""
    raw = (original / META).read_bytes()
    keys = [m.start(1) for m in re.finditer(rb'"([^"]+)":', raw)]
    for n, pos in enumerate(keys):
        ck = tmp_path / f"k{n}"
        shutil.copytree(original, ck)
        data = bytearray(raw)
        data[pos] = ord("X") if data[pos] != ord("X") else ord("Y")
        (ck / META).write_bytes(bytes(data))
        with pytest.raises(db.CorruptCheckpointError, match=f"{re.escape(str(ck / META))}: "):
            db.load(_template(), str(ck))
        shutil.rmtree(ck)


# -- failed saves (concurrent saves and killed ranks: test_faults.py) ---------------------


def save_with_full_disk_on_rank_1(r: Rank, path: str) -> str:
    """Rank 1's writes fail with EFBIG past 64 KiB (a real storage fault on one rank only)."""
    sd = {
        "big": db.ShardedTensor.from_box(
            "big", torch.full((1 << 16,), float(r.rank)), (2 << 16,), (r.rank << 16,)
        ),
        **COMMON,
    }
    try:
        with file_size_limit(64 << 10 if r.rank == 1 else None):
            db.save(sd, path, process_group=r.group)
    except db.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "saved"


def test_failed_save_leaves_no_files_and_the_old_checkpoint(original, pool, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(original, ck)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    errors = pool.run(save_with_full_disk_on_rank_1, 2, str(ck))
    assert errors[0] == errors[1], errors
    assert errors[0].startswith("StorageError: rank 1: "), errors[0]
    assert "File too large" in errors[0] and re.search(r"write __1_0\.\w+\.bin", errors[0])
    after = {p.name: p.read_bytes() for p in ck.iterdir()}
    assert after == before  # rank 0's complete file and rank 1's partial one are gone
    assert _identical(db.load(_template(), str(ck)), _expected())


def test_common_tensor_sized_by_the_document_is_checked_before_allocation(tmp_path):
    """A load allocates the common state's tensors by their recorded shape: only after every
    item was found inside its data file."""
    db.save({"t": torch.arange(4.0), "n": 1}, tmp_path)
    path = tmp_path / "dcpbridge.json"
    doc = json.loads(path.read_bytes())
    _unchecked(doc)
    n = 1 << 40  # 4 TiB of float32, consistent everywhere but in the (tiny) data file
    doc["tensors"]["t"]["shape"] = [n]
    chunk = doc["tensors"]["t"]["chunks"][0]
    chunk["sizes"], chunk["nbytes"] = [n], 4 * n
    path.write_bytes(sign_document(doc))
    tracemalloc.start()
    try:
        with pytest.raises(db.CorruptCheckpointError, match=r"places tensor 't'.*which has only"):
            db.load({}, str(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated before refusing"


# -- one exception family: what users can get wrong outside a save or load ----------------------


def test_full_state_dict_files_that_cannot_be_read_raise_checkpoint_errors(tmp_path):
    """``load_state_dict`` (rank 0 reads a full state dict file): each failure names the file."""
    missing = tmp_path / "missing.pt"
    with pytest.raises(db.StorageFileNotFoundError, match=re.escape(str(missing))) as e:
        db.load_state_dict(missing)
    assert isinstance(e.value.__cause__, FileNotFoundError)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"metadata": {}}')  # no weight_map
    with pytest.raises(db.CorruptCheckpointError, match=r"index\.json: not a shard index \(it has"):
        db.load_state_dict(index)
    listed = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], listed)
    with pytest.raises(db.InvalidArgumentError, match=r"list\.pt holds a list, not a state dict"):
        db.load_state_dict(listed)
    pickled = tmp_path / "pickled.pt"
    # a global weights_only refuses (not Path: megatron.core allows PosixPath process-wide)
    torch.save({"x": fractions.Fraction(1, 3)}, pickled)
    with pytest.raises(db.PickleRefusedError, match=r"pickled\.pt: holds objects"):
        db.load_state_dict(pickled)
    shards = tmp_path / "shards.index.json"  # a failing shard file is the one named
    shards.write_text('{"weight_map": {"x": "pickled.pt"}}')
    with pytest.raises(db.PickleRefusedError, match=r"pickled\.pt: holds objects"):
        db.load_state_dict(shards)
    truncated = tmp_path / "truncated.pt"
    torch.save({"x": torch.zeros(100)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(db.CorruptCheckpointError, match=r"truncated\.pt: not a readable"):
        db.load_state_dict(truncated)


def test_bad_arguments_raise_invalid_argument_errors(tmp_path):
    """Arguments users pass wrong are ``InvalidArgumentError`` (still ``ValueError``)."""
    from dcpbridge.engine.collectives import Group
    from dcpbridge.mcore.sharding import _device_for

    cases = [
        (lambda: db.OptimizerConfig(lr=-1.0), "lr must be a finite number"),
        (lambda: db.ParamKey(), "needs a name pattern"),
        (lambda: db.async_save({}, tmp_path, max_in_flight=0), "max_in_flight must be >= 1"),
        (lambda: db.TensorAwareStateDict.from_state_dict({}, algo="x"), "algo must be one of"),
        (lambda: Group.resolve(object()), "torch.distributed is not initialized"),
        (lambda: _device_for("x", {"": "no-such-device"}), "is not a device"),
        (lambda: db.shard_broadcasted_state_dict({}, {}), "ranks other than 0"),
    ]
    for fn, needle in cases:
        with pytest.raises(db.InvalidArgumentError, match=needle):
            fn()


def test_a_failed_param_group_dump_is_a_storage_error(tmp_path):
    model = torch.nn.Linear(2, 2)
    target = tmp_path / "no-such-dir" / "groups.json"
    with pytest.raises(db.StorageError, match=r"dump of param groups to .*groups\.json"):
        db.get_optimizer(model, db.OptimizerConfig(), dump_param_groups_to=target)
    assert not (tmp_path / "no-such-dir").exists()
