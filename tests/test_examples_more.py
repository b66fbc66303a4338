"""The FSDP2, reshard and S3 examples of examples/ under ``torchrun`` on 2 CPU ranks."""

from __future__ import annotations

import pytest

from tests.support.examples import torchrun


def test_fsdp2_loop_resumes(tmp_path):
    root = str(tmp_path / "fsdp")
    assert "checkpoints [5]" in torchrun("fsdp2_loop.py", "--root", root, "--steps", "6")
    resumed = torchrun("fsdp2_loop.py", "--root", root, "--steps", "10")
    assert "resumed from step 5" in resumed and "checkpoints [5, 10]" in resumed


def test_reshard_job(tmp_path):
    out = torchrun("reshard_job.py", "--root", str(tmp_path))
    assert "for 4 ranks" in out and "4 target ranks" in out


@pytest.mark.s3
def test_s3_save(s3_server):
    bucket = s3_server.new_bucket()
    env = {"AWS_ACCESS_KEY_ID": s3_server.access_key, "AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    url = f"s3://{bucket}/run"
    out = torchrun("s3_save.py", url, "--endpoint-url", s3_server.endpoint_url, env=env)
    assert f"saved and loaded {url}/step_00000100; steps [100]" in out
    assert f"{bucket}/run/step_00000100/dcpbridge.json" in {
        f"{bucket}/{k}" for k in s3_server.keys(bucket)
    }
