"""The Megatron-style example (examples/megatron_tp_loop.py) under ``torchrun`` on 2 CPU ranks;
the other examples are in test_examples_more.py (the two modules run in parallel)."""

from __future__ import annotations

import shutil

from tests.support.examples import final_step, torchrun


def test_megatron_tp_loop_resumes_bit_exact(tmp_path):
    root = tmp_path / "tp"
    uninterrupted = torchrun("megatron_tp_loop.py", "--root", str(root), "--steps", "12")
    assert "checkpoints [5, 10]" in uninterrupted
    shutil.rmtree(root / "step_00000010")  # as if the job had died after step 7
    resumed = torchrun("megatron_tp_loop.py", "--root", str(root), "--steps", "12")
    assert "resumed from step 5" in resumed and "checkpoints [5, 10]" in resumed
    assert final_step(resumed) == final_step(uninterrupted)  # same weights, bit for bit
