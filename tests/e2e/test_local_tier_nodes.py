"""The local tier on 8 gloo ranks in 4 simulated nodes (``{node}`` directories, 2 ranks each):
a wiped node's parts come from the copies, a job one node smaller restores in another split,
with all but one node wiped the persistent step loads, and a peer that dies while receiving
copies leaves the previous local step in charge.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator

import pytest
import torch

from dcpbridge.engine import collectives
from tests.e2e.test_local_tier import (
    STEPS,
    manager,
    node_dir,
    piece,
    restore,
    state,
    train,
    weights,
)
from tests.support.dist_pool import Rank, RankFailure, WorkerPool

pytestmark = pytest.mark.slow  # 8 ranks: 40 s to minutes on a shared 2-core machine


@pytest.fixture(scope="module")
def pool8() -> Iterator[WorkerPool]:
    p = WorkerPool(size=8)
    yield p
    p.close()


def _train8(pool8, tmp_path, **kwargs) -> tuple[str, str]:
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    out = pool8.run(train, 8, root, local, kwargs, timeout=300)
    assert sorted(s for s, t, _ in out[0]["calls"] if t == "local") == list(range(1, STEPS + 1))
    return root, local


def test_a_wiped_node_restores_from_the_copies_then_a_smaller_job_then_the_persistent_step(
    pool8, tmp_path
):
    root, local = _train8(pool8, tmp_path)
    assert [sorted(os.listdir(node_dir(tmp_path, n))) for n in range(4)] == [["step_00000006"]] * 4
    kept = str(tmp_path / "node2.kept")
    shutil.copytree(node_dir(tmp_path, 2), kept)
    shutil.rmtree(node_dir(tmp_path, 2))  # node 2 died; its replacement starts empty
    back = pool8.run(restore, 8, root, local, 0, 2, timeout=300)
    assert [b["step"] for b in back] == [6] * 8 and [b["latest"] for b in back] == [6] * 8
    assert any("from the local tier" in line for line in back[0]["log"])
    assert not os.path.exists(node_dir(tmp_path, 2))  # read from the copies, nothing written

    # Node 1 is gone for good: the job restarts on the other three, renumbered 0..2, with
    # 6 ranks splitting the columns instead of the rows. Ranks 2-3's parts exist only as
    # copies on the old node 2, now node 1.
    shutil.rmtree(node_dir(tmp_path, 1))
    os.rename(kept, node_dir(tmp_path, 1))
    os.rename(node_dir(tmp_path, 3), node_dir(tmp_path, 2))
    back = pool8.run(restore, 6, root, local, 1, 2, timeout=300)
    assert [b["step"] for b in back] == [6] * 6 and [b["latest"] for b in back] == [6] * 6
    assert any("from the local tier" in line for line in back[0]["log"])

    # All but one node wiped: no local step is whole anywhere, the persistent step 4 loads.
    for n in (1, 2):
        shutil.rmtree(node_dir(tmp_path, n))
    back = pool8.run(restore, 6, root, local, 1, 2, timeout=300)
    assert [b["step"] for b in back] == [4] * 6 and [b["latest"] for b in back] == [4] * 6
    line = next(x for x in back[0]["log"] if "loading persistent step 4" in x)
    assert "no complete local step newer than the persistent tier's" in line


VICTIM = 5  # node 2; it keeps the copies of rank 3's files


def receiver_dies(r: Rank, root: str, local: str) -> dict:
    """Steps 1..STEPS with the copies behind; in step STEPS, rank VICTIM is killed after the
    first copy it receives. The others return what ``save`` did."""
    original = collectives.SideGroup.exchange

    def dying(self, sends, recvs):
        if recvs:
            data, src, tag = recvs[0]
            self._gloo.recv([data.reshape(-1).view(torch.uint8)], src, tag).wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, sends, recvs)

    mgr = manager(r, root, local, async_save=True)
    w = piece(weights(0), r.rank, r.size, 0)
    saved = []
    for step in range(1, STEPS + 1):
        w.mul_(0.5).add_(step)
        if step == STEPS:
            mgr.wait()  # step STEPS - 1 committed everywhere before the victim arms
            if r.rank == VICTIM:
                collectives.SideGroup.exchange = dying
        saved.append(mgr.save(step, state(w, r.rank, r.size, step)))
    if r.rank == VICTIM:
        mgr.wait()  # it dies in there, receiving
    return {"saved": saved}  # no wait/close: a job with a dead rank is torn down


def test_a_peer_killed_while_receiving_copies_leaves_the_previous_local_step(pool, pool8, tmp_path):
    root, local = str(tmp_path / "persistent"), str(tmp_path / "node{node}")
    try:
        with pytest.raises(RankFailure) as failed:
            pool8.run(receiver_dies, 8, root, local, timeout=300)
    finally:
        pool8.kill()
    report = str(failed.value)
    assert f"rank {VICTIM} raised" in report and "worker died" in report
    others = [r for r in range(8) if r != VICTIM]
    assert not any(f"rank {r} raised" in report for r in others)  # save returned on each
    assert "did not finish" not in report
    for n in range(4):
        assert not os.path.exists(
            os.path.join(node_dir(tmp_path, n), "step_00000006", "local.json")
        )
        assert os.path.exists(os.path.join(node_dir(tmp_path, n), "step_00000005", "local.json"))
    # the restart: 4 ranks, one per node directory, in another layout
    back = pool.run(restore, 4, root, local, 1, 1, timeout=120)
    assert [b["step"] for b in back] == [STEPS - 1] * 4
    assert any("from the local tier" in line for line in back[0]["log"])
