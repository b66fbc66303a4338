"""Shared fixtures: the gloo worker pool, the S3 test server and the storage backends."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.backends import (
    Backend,
    clear_memory_store,
    local_backend,
    memory_backend,
    s3_backend,
)
from tests.support.dist_pool import WorkerPool
from tests.support.s3_proxy import FaultProxy
from tests.support.s3_server import S3Server, run_seaweedfs, scrub_aws_environment

warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")


def pytest_configure(config: pytest.Config) -> None:
    scrub_aws_environment()  # before any pool worker starts: no test may reach real AWS
    # xdist's --dist loadfile hands out modules by test count, not in the order below
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# The longest modules (minutes on 2 cores), started first: ``make test`` hands whole modules to
# its processes in this order, so one of these started last would run alone at the end. The
# modules that mostly wait (stalled S3 stores, killed ranks' timeouts: wall time about twice
# their CPU time) sit between CPU-bound ones, so that the other process keeps the CPUs busy
# while they wait (side by side they left the machine half idle for half a minute).
LONGEST_FIRST = (
    "tests/test_examples_more.py",
    "tests/e2e/test_s3_stall.py",  # waits (beside the torchrun examples, which use both cores)
    "tests/test_examples.py",
    "tests/e2e/test_integrity.py",
    "tests/e2e/test_faults.py",
    "tests/e2e/test_dcp_scenarios.py",
    "tests/engine/test_manager.py",  # waits
    "tests/tools/test_offline.py",
    "tests/storage/test_backends.py",
    "tests/mcore/test_megatron_api.py",
    "tests/storage/test_s3.py",  # waits
    "tests/e2e/test_portable.py",
    "tests/tools/test_cli.py",
    "tests/engine/test_writer_process.py",
    "tests/e2e/test_local_tier.py",
    "tests/engine/test_writer_choice.py",
    "tests/e2e/test_dcp_extensions.py",
    "tests/storage/test_hostile_fuzz.py",
    "tests/e2e/test_interop.py",
)


# Modules whose tests import megatron-core in the pool's ranks (~2.3 CPU s a rank) and save with
# it (its writer starts helper processes): ``make test`` runs them in one test process, so its
# pool pays that import once, not once per process they land in.
MEGATRON_IN_POOL = (
    "tests/mcore/test_megatron_api.py",
    "tests/mcore/test_strict_entry_points.py",
    "tests/e2e/test_interop.py",
)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: without xdist, never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, the ``MEGATRON_IN_POOL`` modules counted as one file."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return MEGATRON_IN_POOL[0] if scope in MEGATRON_IN_POOL else scope

    return Scheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on the gloo worker pool are marked ``dist`` (``make test-fast`` leaves them out);
    the longest modules go first (the same order in every test process)."""
    for item in items:
        if "pool" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.dist)
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(first)))


@pytest.fixture(scope="session")
def pool() -> Iterator[WorkerPool]:
    p = WorkerPool(size=4)
    yield p
    p.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """SeaweedFS ``weed mini`` on free 127.0.0.1 ports, for the whole session."""
    with run_seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def memory_store() -> Iterator[None]:
    """An empty memory:// filesystem, emptied again after the test."""
    clear_memory_store()
    yield
    clear_memory_store()


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.s3)])
def backend(request: pytest.FixtureRequest, tmp_path) -> Backend:
    """The same test on local disk, memory:// and S3 (a fresh bucket per test)."""
    if request.param == "local":
        return local_backend(tmp_path)
    if request.param == "memory":
        request.getfixturevalue("memory_store")
        return memory_backend(re.sub(r"\W", "_", request.node.name))
    return s3_backend(request.getfixturevalue("s3_server"))


@pytest.fixture
def s3_proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    """A proxy in front of the S3 server that counts bytes and injects transient faults."""
    proxy = FaultProxy(s3_server.endpoint_url)
    yield proxy
    proxy.close()
