"""Checkpoints written by earlier dcpbridge versions (tests/fixtures/golden) load bit-exact.

Each fixture folder was written by ``tests/fixtures/golden/make_golden.py`` running an older
commit's code (its README.md says which); the expected values are regenerated here from the
same script, so a user who upgrades keeps every checkpoint an older dcpbridge wrote.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dcpbridge as db
from dcpbridge.storage.errors import CorruptCheckpointError
from dcpbridge.storage.format.document import FORMAT_VERSION, sign_document
from dcpbridge.tools import cli
from tests.support.dist_pool import Rank

GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden"
LABELS = sorted(p.parent.name for p in GOLDEN.glob("*/golden.json"))


def _spec() -> Any:
    """The generating script, imported by path (it is not a package module)."""
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mg = _spec()


def _manifest(label: str) -> dict[str, Any]:
    return json.loads((GOLDEN / label / "golden.json").read_text())


def _copy(label: str, tmp_path: Path) -> Path:
    """The fixture copied to ``tmp_path`` (a load never touches the repository's files)."""
    dst = tmp_path / label
    shutil.copytree(GOLDEN / label, dst)
    return dst


def _checkpoints(man: dict[str, Any]) -> list[tuple[str, bool, bool]]:
    """(folder, whether it holds the --many tensors, whether w.f32 was bumped) of a fixture."""
    out = [("ckpt", man["many"], False)]
    if man["incremental"]:  # format 5: ckpt2 references ckpt's unchanged chunks
        out.append(("ckpt2", man["many"], True))
    if man.get("torch_dist"):  # Megatron-Core torch_dist, and dcpbridge without checksums
        out += [("tdist", False, False), ("nosum", False, False)]
    return out


def _template(many: bool) -> dict[str, Any]:
    """A one-process template asking for every stored tensor whole and both object cells."""
    sd: dict[str, Any] = {}
    for key, (shape, dtype, _) in mg.tensor_specs(many).items():
        fill = torch.full(shape, 7).to(dtype)  # not the stored values: the load must fill them
        sd[key] = db.ShardedTensor.from_box(key, fill, shape, (0,) * len(shape))
    for r in range(mg.WORLD):
        sd[f"rng{r}"] = db.ShardedObject("rng", None, (mg.WORLD,), (r,))
    sd |= {k: torch.full_like(v, 3) for k, v in mg.common_tensors().items()}
    return sd


def assert_same(actual: Any, expected: Any, where: str) -> None:
    """Equal values of the same types; tensors bit for bit (dtype, shape and bytes)."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        a = actual.contiguous().view(-1).view(torch.uint8)
        e = expected.contiguous().view(-1).view(torch.uint8)
        assert torch.equal(a, e), f"{where}: bytes differ"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: keys {sorted(actual)}"
        for k in expected:
            assert_same(actual[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _check_loaded(out: dict[str, Any], many: bool, bump: bool = False) -> None:
    expected = mg.expected_tensors(many)
    if bump:
        expected["w.f32"] = expected["w.f32"] + 1
    for key, value in expected.items():
        assert_same(out[key], value, key)
    for r in range(mg.WORLD):
        assert_same(out[f"rng{r}"], mg.rank_object(r), f"rng{r}")
    for key, value in {**mg.COMMON, **mg.common_tensors()}.items():
        assert_same(out[key], value, key)


@pytest.mark.parametrize("label", LABELS)
def test_golden_checkpoint_loads_bit_exact(label: str, tmp_path: Path) -> None:
    """db.load of the older 2-rank save in one process returns exactly what was written."""
    root = _copy(label, tmp_path)
    for name, many, bump in _checkpoints(_manifest(label)):
        out = db.load(_template(many), root / name)
        _check_loaded(out, many, bump)


@pytest.mark.parametrize("label", LABELS)
def test_golden_checkpoint_opens_and_validates(label: str, tmp_path: Path, capsys) -> None:
    """open_source reads every tensor and object of it; 'dcpbridge validate --checksums' and
    'dcpbridge fsck' pass; load_common_state_dict returns the whole common state."""
    root = _copy(label, tmp_path)
    for name, many, bump in _checkpoints(_manifest(label)):
        source = db.open_source(root / name)
        try:
            expected = mg.expected_tensors(many)
            if bump:
                expected["w.f32"] = expected["w.f32"] + 1
            if set(source.tensors) != set(expected):  # plain common tensors, since 13a68b3
                expected |= mg.common_tensors()
            else:  # in the older common blob
                for key, value in mg.common_tensors().items():
                    assert_same(source.common_state()[key], value, f"{name}: blob {key}")
            assert set(source.tensors) == set(expected)
            for key, value in expected.items():
                got = source.read(key, (0,) * value.dim(), tuple(value.shape))
                assert_same(got, value, f"{name}:{key}")
            for key, value in mg.expected_objects().items():
                assert_same(source.object(key), value, f"{name}:{key}")
        finally:
            source.close()
        code = cli.main(["validate", str(root / name), "--checksums"])
        assert code == 0, capsys.readouterr()
        assert cli.main(["fsck", str(root)]) == 0, capsys.readouterr()  # nothing orphaned
        common = db.load_common_state_dict(root / name)
        for key, value in {**mg.COMMON, **mg.common_tensors()}.items():
            assert_same(common[key], value, f"{name}: common {key}")


def _axis(shape: tuple[int, ...], stored_axis: int) -> int:
    """A split axis unlike the save's: dim 0 for tensors one rank wrote whole, the next dim
    for split ones, -1 (whole) for split 1-D ones."""
    if stored_axis < 0:
        return 0 if shape else -1
    return (stored_axis + 1) % len(shape) if len(shape) > 1 else -1


def load_on_two_ranks(r: Rank, path: str, many: bool, fully_parallel: bool, bump: bool) -> str:
    """Each rank asks for another layout than the save's (other split axes, replicated
    tensors split, split ones whole on rank 1) and the other rank's object cell; checked
    against the written values here."""
    expected = mg.expected_tensors(many)
    if bump:
        expected["w.f32"] = expected["w.f32"] + 1
    sd: dict[str, Any] = {}
    boxes: dict[str, torch.Tensor] = {}
    for key, (shape, _, stored) in mg.tensor_specs(many).items():
        axis = _axis(shape, stored)
        offset = [0] * len(shape)
        want = expected[key]
        if axis >= 0 and not (r.rank == 1 and stored >= 0):
            start, stop = mg._split(shape[axis], r.rank)
            want, offset[axis] = want.narrow(axis, start, stop - start), start
        boxes[key] = want
        sd[key] = db.ShardedTensor.from_box(key, torch.zeros_like(want), shape, tuple(offset))
    other = 1 - r.rank
    sd["rng"] = db.ShardedObject("rng", None, (mg.WORLD,), (other,))
    sd |= {k: torch.zeros_like(v) for k, v in mg.common_tensors().items()}
    out = db.load(sd, path, process_group=r.group, fully_parallel=fully_parallel)
    for key, value in boxes.items():
        assert_same(out[key], value, f"rank {r.rank} {key}")
    assert_same(out["rng"], mg.rank_object(other), f"rank {r.rank} rng")
    for key, value in {**mg.COMMON, **mg.common_tensors()}.items():
        assert_same(out[key], value, f"rank {r.rank} {key}")
    return "ok"


@pytest.mark.parametrize("fully_parallel", [False, True])
@pytest.mark.parametrize("label", LABELS)
def test_golden_checkpoint_loads_on_two_ranks_in_another_layout(
    label: str, fully_parallel: bool, tmp_path: Path, pool
) -> None:
    """2 ranks (gloo) load the older checkpoint resharded, fully parallel or not, bit-exact."""
    man = _manifest(label)
    root = _copy(label, tmp_path)
    for name, many, bump in _checkpoints(man):
        args = (str(root / name), many, fully_parallel, bump)
        assert pool.run(load_on_two_ranks, 2, *args, timeout=120) == ["ok", "ok"]


MANAGED = [label for label in LABELS if _manifest(label).get("manager")]


def _manager_template() -> dict[str, Any]:
    return {"w": db.ShardedTensor.from_box("w", torch.zeros(4, 6), (4, 6), (0, 0)), "step": -1}


@pytest.mark.parametrize("label", MANAGED)
def test_golden_manager_root_resumes_and_keeps_the_best_step(label: str, tmp_path: Path) -> None:
    """An older CheckpointManager's root: the current manager loads its newest and any step,
    and its retention reads the old steps' metrics (keep the best and the newest only)."""
    root = _copy(label, tmp_path) / "mgr"
    mgr = db.CheckpointManager(root, every=10, keep_last=1, keep_best=1, best_metric="loss")
    try:
        assert mgr.all_steps() == sorted(mg.MANAGER_STEPS)
        assert mgr.latest_step() == max(mg.MANAGER_STEPS)
        for step in [None, *mg.MANAGER_STEPS]:
            out = mgr.load(_manager_template(), step)
            want = max(mg.MANAGER_STEPS) if step is None else step
            assert out["step"] == want
            assert_same(out["w"], mg.values(want, (4, 6), torch.float32), f"step {step}")
        assert mgr.save(40, {"w": _whole(40), "step": 40}, metrics={"loss": 5.0})
        mgr.wait()
    finally:
        mgr.close()
    best = min(mg.MANAGER_STEPS, key=mg.MANAGER_STEPS.__getitem__)
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:08d}" for s in (best, 40)]
    out = db.load(_manager_template(), root / f"step_{best:08d}")
    assert_same(out["w"], mg.values(best, (4, 6), torch.float32), "kept best step")


def _whole(step: int) -> Any:
    """The manager state's tensor whole (one process saves it all)."""
    return db.ShardedTensor.from_box("w", mg.values(step, (4, 6), torch.float32), (4, 6), (0, 0))


@pytest.mark.parametrize("label", [lb for lb in LABELS if _manifest(lb).get("optimizer")])
def test_golden_optimizer_state_resumes(label: str, tmp_path: Path) -> None:
    """Model and AdamW state of an older save go back into a fresh model and optimizer (the
    optimizer key scheme and param groups by identity), equal to what the old run held."""
    root = _copy(label, tmp_path)
    model, opt = mg.optimizer_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    db.init_optimizer_state(opt)
    msd = mg.optimizer_template(model)
    template = {"model": msd, "optimizer": db.optimizer_sharded_state_dict(opt, msd)}
    out = db.load(template, root / "optim")
    db.load_optimizer_state(opt, out["optimizer"])
    expected = torch.load(root / "optim-expected.pt", weights_only=True)
    assert_same(dict(model.state_dict()), dict(expected["model"]), "model")
    assert_same(opt.state_dict(), expected["optimizer"], "optimizer")
    assert out["iteration"] == 2


@pytest.mark.parametrize("label", LABELS)
def test_golden_plain_dcp_save_loads(label: str, tmp_path: Path) -> None:
    """The older plain dcp.save through dcpbridge's planner and writer: tuples and lists come
    back whole (also where stored item by item), tensors bit-exact through many checksum blocks."""
    root = _copy(label, tmp_path)
    sd: dict[str, Any] = {"cfg": {"betas": (0.0, 0.0), "groups": [[0, 0], [0]]}, "blob": ""}
    sd |= {k: torch.zeros_like(v) for k, v in mg.dcp_tensors().items()}
    dcp.load(
        sd,
        storage_reader=db.FsspecCheckpointReader(root / "dcp"),
        planner=db.ShardedLoadPlanner(),
        no_dist=True,
    )
    assert_same(sd, mg.DCP_STATE | mg.dcp_tensors(), "dcp")


@pytest.mark.parametrize("name", ["ckpt", "ckpt2"])
def test_future_format_version_is_refused_naming_the_file(
    name: str, tmp_path: Path, capsys
) -> None:
    """A document of a newer dcpbridge (FORMAT_VERSION + 1, digest intact) is refused by load,
    open_source and validate with CorruptCheckpointError naming dcpbridge.json and the versions."""
    root = _copy("v5", tmp_path)
    doc_file = root / name / "dcpbridge.json"
    doc = json.loads(doc_file.read_bytes())
    doc["version"] = FORMAT_VERSION + 1
    doc_file.write_bytes(sign_document(doc))
    newer = (
        rf"{name}/dcpbridge.json: format version {FORMAT_VERSION + 1} is newer than this "
        rf"dcpbridge reads \({FORMAT_VERSION}\); upgrade dcpbridge"
    )
    with pytest.raises(CorruptCheckpointError, match=newer):
        db.load(_template(False), root / name)
    with pytest.raises(CorruptCheckpointError, match=newer):
        db.open_source(root / name)
    with pytest.raises(CorruptCheckpointError, match=newer):
        db.load_common_state_dict(root / name)
    assert cli.main(["validate", str(root / name)]) == 1
    err = capsys.readouterr().err
    assert f"{name}/dcpbridge.json: format version {FORMAT_VERSION + 1} is newer" in err
