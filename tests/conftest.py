"""Shared fixtures: the gloo worker pool (one per session)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from tests.dist_pool import WorkerPool

warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(size=4)
    yield p
    p.close()
