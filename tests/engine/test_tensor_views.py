"""Tensors whose memory holds other values than they show (conjugate and negative views) are
stored as the values they show, and filled as such on load; nested tensors are refused."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

import dcpbridge as db
from tests.support.dist_pool import Rank

C = torch.tensor([1 + 2j, -3 + 0.5j, 4 - 1j, 0.25 + 8j], dtype=torch.complex64)


def _views() -> dict[str, torch.Tensor]:
    """A conjugate view, a negative view (the imaginary part of one) and a plain tensor."""
    return {"conj": C.conj(), "neg": C.clone().conj().imag, "plain": C.real.clone()}


def _shown(t: torch.Tensor) -> torch.Tensor:
    return t.resolve_conj().resolve_neg().clone()


def _template() -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(_shown(v)) for k, v in _views().items()}


def _assert_shown(out: dict, sd: dict) -> None:
    for k, v in sd.items():
        assert torch.equal(_shown(out[k]), _shown(v)), k


@pytest.mark.parametrize(
    "how",
    [
        "save",
        "async_thread",
        "background_staging",
        "torch_dist",
        "plain_dcp",
        "plain_dcp_default_planner",
        "plain_dcp_async",
        "plain_dcp_async_default_planner",
    ],
)
def test_views_are_stored_as_the_values_they_show(tmp_path, how):
    sd, path = _views(), str(tmp_path / "ck")
    assert sd["conj"].is_conj() and sd["neg"].is_neg()
    if how == "save":
        db.save(sd, path)
    elif how == "async_thread":
        db.async_save(sd, path, writer="thread").result()
    elif how == "background_staging":
        db.async_save(sd, path, writer="thread", background_staging=True).result()
    elif how == "torch_dist":
        db.save(sd, path, format="torch_dist")
    elif how.startswith("plain_dcp") and "async" not in how:
        planner = db.ShardedSavePlanner() if how == "plain_dcp" else None  # DCP's hands views on
        dcp.save(sd, storage_writer=db.FsspecCheckpointWriter(path), planner=planner, no_dist=True)
    else:  # the writer is DCP's stager (torch's default one stored the unconjugated memory)
        planner = db.ShardedSavePlanner() if how == "plain_dcp_async" else None
        writer = db.FsspecCheckpointWriter(path)
        dcp.async_save(sd, storage_writer=writer, planner=planner, no_dist=True).result()
    _assert_shown(db.load(_template(), path), sd)
    assert C.conj().is_conj() and torch.equal(_shown(sd["conj"]), torch.conj_physical(C))


def test_view_templates_are_filled_with_the_stored_values(tmp_path):
    sd, path = {k: _shown(v) for k, v in _views().items()}, str(tmp_path / "ck")
    db.save(sd, path)
    template = {"conj": torch.zeros(4, dtype=torch.complex64).conj(), "neg": torch.zeros(4)}
    template["neg"] = torch.zeros(4, dtype=torch.complex64).conj().imag
    before = dict(template)
    out = db.load(template, path, strict="assume_ok_unexpected")
    for k in template:
        assert out[k] is before[k] and (out[k].is_conj() or out[k].is_neg()), k
        assert torch.equal(_shown(out[k]), sd[k]), k


def test_a_sharded_tensor_over_a_view_and_a_nested_tensor_are_refused(tmp_path):
    st = db.ShardedTensor.from_rank_offsets("w", C.conj())
    with pytest.raises(db.SerializationError, match=r"'w'.*conjugate view.*resolve_conj"):
        db.save({"w": st}, str(tmp_path / "a"))
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    with pytest.raises(db.SerializationError, match=r"'n'.*nested tensor"):
        db.save({"n": nested}, str(tmp_path / "b"))
    assert not list(tmp_path.iterdir())


def test_a_sharded_tensor_over_quantized_data_is_refused(tmp_path):
    """A quantized tensor's memory holds integers whose meaning (scale, zero point) is not
    stored: refused by name, as for a plain tensor (was: saved as its integers; a load into a
    quantized template returned them with the template's scale, silently other values)."""
    q = torch.quantize_per_tensor(torch.tensor([0.5, -0.2, 1.1, 0.0]), 0.1, 3, torch.qint8)
    st = db.ShardedTensor.from_rank_offsets("q", q)
    with pytest.raises(db.ShardingValidationError, match=r"'q': .*quantized.*cannot be saved"):
        db.save({"q": st}, str(tmp_path / "a"))
    assert not list(tmp_path.iterdir())


FREED = """
import sys, torch, dcpbridge as db
t = torch.randn(4, 8)
t.untyped_storage().resize_(int(sys.argv[2]))  # freed (0), as FSDP frees a parameter, or shrunk
try:
    db.save({"w": db.ShardedTensor.from_rank_offsets("w", t)}, sys.argv[1])
except db.CheckpointError as e:
    print(type(e).__name__, e)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("left", [0, 100])
def test_a_sharded_tensor_whose_storage_was_freed_is_refused(tmp_path, left):
    """Data whose storage no longer holds it (resized to 0 bytes, as FSDP frees a parameter,
    or shrunk) is refused by name before anything is written (was: the writer copied from
    the storage's address unchecked: a segfault, or bytes past its end written)."""
    run = subprocess.run(
        [sys.executable, "-c", FREED, str(tmp_path / "a"), str(left)],
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("SerializationError "), run.stdout + run.stderr[-2000:]
    assert f"'w': the tensor's storage holds {left} bytes, fewer than its shape" in run.stdout
    assert not list(tmp_path.iterdir())


def dtensor_conj(r: Rank, path: str) -> list[bool]:
    """A DTensor over a conjugate view saved; loaded plainly and, fully parallel (each rank
    reads half and sends it), into view templates."""
    mesh = DeviceMesh.from_group(r.group or dist.group.WORLD, "cpu")
    dt = distribute_tensor(C, mesh, [Shard(0)]).conj()
    assert dt.to_local().is_conj()
    db.save({"c": dt}, path, process_group=r.group)
    out = db.load({"c": torch.zeros(4, dtype=torch.complex64)}, path, process_group=r.group)
    views = {"c": torch.zeros(4, dtype=torch.complex64).conj()}
    both = db.load(views, path, process_group=r.group, fully_parallel=True)
    shown = torch.conj_physical(C)
    return [torch.equal(out["c"], shown), torch.equal(_shown(both["c"]), shown)]


def test_a_dtensor_conjugate_view_is_stored_as_shown(pool, tmp_path):
    got = pool.run(dtensor_conj, 2, str(tmp_path / "ck"), timeout=60)
    assert got == [[True, True], [True, True]]


def view_refusals(r: Rank, root: str) -> list[tuple[str, str, bool]]:
    """Rank 1's ShardedTensor is a conjugate view (``"conj"``) or a negative view (``"neg"``):
    each save path's (error class, message, whether anything was written) on this rank."""
    from dcpbridge.engine.async_save import AsyncSaver

    data = {"conj": C.conj(), "neg": torch._neg_view(C.real.clone())}
    out = []
    for kind, view in data.items():
        local = view if r.rank == 1 else _shown(view)
        how_saved = {
            "save": lambda sd, p: db.save(sd, p, process_group=r.group),
            "async": lambda sd, p: db.async_save(
                sd, p, process_group=r.group, writer="thread"
            ).result(60),
            "background": lambda sd, p: db.async_save(
                sd, p, process_group=r.group, writer="thread", background_staging=True
            ).result(60),
            "process": lambda sd, p: db.async_save(
                sd, p, process_group=r.group, writer="process"
            ).result(60),
            "fully_parallel": lambda sd, p: db.async_save(
                sd, p, process_group=r.group, fully_parallel=True
            ).result(60),
            "torch_dist": lambda sd, p: db.async_save(
                sd, p, process_group=r.group, format="torch_dist"
            ).result(60),
            "manager": _manager_save(r),
        }
        for how, save in how_saved.items():
            path = os.path.join(root, f"{kind}-{how}")
            sd = {"w": db.ShardedTensor.from_rank_offsets("w", local, (0, r.rank, r.size))}
            try:
                save(sd, path)
                out.append((how, "saved", False))
            except db.CheckpointError as e:
                out.append((f"{kind} {how} {type(e).__name__}", str(e), _files_in(path)))
    AsyncSaver.close_orphans()
    return out


def _files_in(path: str) -> bool:
    """Whether a save wrote data or commit files under ``path`` (a manager's step record,
    written before the save and removed with the failed step, aside)."""
    return any(f != "manager.json" for _, _, files in os.walk(path) for f in files)


def _manager_save(r: Rank) -> Any:
    def save(sd: dict, path: str) -> None:
        mgr = db.CheckpointManager(path, every=1, process_group=r.group)
        try:
            mgr.save(1, sd)
            mgr.wait()
        finally:
            with contextlib.suppress(db.CheckpointError):
                mgr.close()

    return save


def test_every_save_path_refuses_a_sharded_tensor_over_a_view_as_save_does(pool, tmp_path):
    """A ShardedTensor over a conjugate or negative view on one rank is refused by name on
    every rank by every save path, sync or staged, with the same error and nothing written
    (was: async saves, whose staging copy resolves the view, stored it where save refuses)."""
    got = pool.run(view_refusals, 2, str(tmp_path), timeout=240)
    assert got[0] == got[1]
    for what, message, wrote in got[0]:
        kind = what.split()[0]
        assert what.endswith(" SerializationError"), (what, message)
        view = "conjugate" if kind == "conj" else "negative"
        assert message.endswith(
            f"ShardedTensor 'w': data is a {view} view; pass data.resolve_conj().resolve_neg()"
        ), (what, message)
        assert not wrote, what
    assert len(got[0]) == 14
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_plain_dcp_async_save_refuses_a_sharded_tensor_over_a_view_as_save_does(tmp_path):
    """The writer's staging keeps a view's flags (torch's own copy dropped them and the
    memory was stored): the planner refuses the ShardedTensor as a sync save does, and
    nothing is left."""
    path = tmp_path / "ck"
    state = {"w": db.ShardedTensor.from_rank_offsets("w", C.conj())}
    with pytest.raises(BaseException, match="conjugate view"):  # DCP's CheckpointException
        dcp.async_save(
            state,
            storage_writer=db.FsspecCheckpointWriter(str(path)),
            planner=db.ShardedSavePlanner(),
            no_dist=True,
        ).result()
    assert not path.exists()
