"""The fixtures every room shares (short temporary directories for Unix sockets, the session's Slurm, the
Kubernetes API fake, an etcd server; each room's own are in its conftest.py) and the fast lane: ``pytest
--fast`` (``scripts/test --fast``) leaves out the tests marked ``slow``, ``service`` or ``torch_mp`` and does
not even import a module whose ``pytestmark`` carries one of those markers."""

from __future__ import annotations

import ast
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.lazy import HAS_TORCH, Lazy
from tests.support import short_tmp

if TYPE_CHECKING:
    from tests.k8s_fake import FakeKube
    from tests.slurm_cluster import SlurmCluster

# What the fast lane leaves out (pyproject.toml declares them): tests of 2 s or more, tests that need an
# external service (Slurm, Ray, the Kubernetes API fake or kubectl, systemd, docker), multi-process torch.
NOT_FAST = frozenset({"slow", "service", "torch_mp"})
# Fixtures that start an external service: a test that takes one is marked ``service`` here, in one place.
SERVICE_FIXTURES = frozenset({"slurm", "ray_cluster", "kube", "kube_jobs", "pair"})
# Fixtures that are slow to build (the session's Slurm, a Ray cluster, two ranks' checkpoints, an evacuation
# and a full-state peer save on three hosts): the tests that share one run on the same parallel worker
# (``--dist loadgroup``), which builds it once.
SHARED_FIXTURES = frozenset({"slurm", "ray_cluster", "two_steps", "evacuated", "saved_full"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="the fast lane: leave out tests marked " + ", ".join(sorted(NOT_FAST)),
    )


def module_marks(path: Path) -> set[str]:
    """The marker names in a test module's top-level ``pytestmark`` (``pytest.mark.NAME``), read from its
    source without importing it: the fast lane skips modules whose imports alone take seconds (torch)."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (OSError, SyntaxError):
        return set()  # pytest's own collection reports it
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            for sub in ast.walk(node.value):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Attribute)
                    and sub.value.attr == "mark"
                ):
                    names.add(sub.attr)
    return names


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not config.getoption("fast") or collection_path.suffix != ".py":
        return None
    return bool(collection_path.name.startswith("test_") and module_marks(collection_path) & NOT_FAST) or None


def uses_lazy_torch(module: object) -> bool:
    return module is not None and any(isinstance(value, Lazy) for value in vars(module).values())


def weight(item: pytest.Item) -> int:
    """Where a test goes in the whole suite's order: first several simulated hosts (tests/e2e/) and the groups
    that run on one worker, one after another (a shared Slurm, Ray cluster, image or checkpoint run); then the
    other multi-process torch tests, the other services, the other slow tests, the rest."""
    marks = {m for m in NOT_FAST if item.get_closest_marker(m)}
    if "e2e" in item.path.parts or item.get_closest_marker("xdist_group"):
        return 0
    if "torch_mp" in marks:
        return 1
    return 2 if marks else 3


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouped = config.pluginmanager.hasplugin("xdist")
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SERVICE_FIXTURES:
            item.add_marker(pytest.mark.service)
        if grouped:
            for name in sorted(fixtures & SHARED_FIXTURES):
                item.add_marker(pytest.mark.xdist_group(name))
        if not HAS_TORCH and item.get_closest_marker("torch_mp"):
            # Its torch runs in child processes (torchrun, ranks): nothing in this one would skip it.
            item.add_marker(pytest.mark.skip(reason="torch is not installed (pip install -e '.[torch]')"))
    if not config.getoption("fast"):
        # The long tests first, the longest kinds first (stable: each kind keeps its order): on parallel
        # workers they start together and the short ones fill in around them, rather than a long one drawn
        # last running on alone.
        items.sort(key=weight)
        return
    if grouped:
        # The fast lane's tests of modules that resolve torch on first use (tests/lazy.py) run on one worker,
        # the only one that imports torch. Not in the whole suite: there its multi-process torch tests would
        # queue on that worker, and every worker imports torch anyway.
        for item in items:
            if uses_lazy_torch(getattr(item, "module", None)):
                item.add_marker(pytest.mark.xdist_group("torch"))
    kept: list[pytest.Item] = []
    left_out: list[pytest.Item] = []
    for item in items:
        (left_out if any(item.get_closest_marker(m) for m in NOT_FAST) else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture
def base() -> Iterator[Path]:
    """A short /tmp directory for an agent's socket and state (Unix socket paths are limited to 108 bytes)."""
    path = short_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """One real single-node Slurm (tests/slurm_cluster.py) for the session's Slurm tests, which run on one
    parallel worker (``SHARED_FIXTURES``); each test leaves the node in service and no job behind."""
    from tests.slurm_cluster import SlurmCluster, Unavailable

    cluster = SlurmCluster()
    try:
        cluster.start()
    except Unavailable as exc:
        cluster.stop()
        pytest.skip(f"no Slurm on this machine: {exc}")
    yield cluster
    cluster.stop()


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    """The fake Kubernetes API server (tests/k8s_fake.py) with one node, NODE."""
    from tests.k8s_fake import NODE, FakeKube

    async with FakeKube() as fake:
        fake.add_node(NODE)
        yield fake


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A real etcd server (Debian's etcd-server) with its v2 API, on loopback, for this module; its client port."""
    import subprocess
    import time
    import urllib.request

    from tests.hosts import free_port

    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    pytest.importorskip("etcd", reason="python-etcd (torch's etcd-v2 rendezvous client) is not installed")
    client, peer = free_port(), free_port()
    data = tmp_path_factory.mktemp("etcd")
    command = [
        binary,
        "--name",
        "shrink",
        "--data-dir",
        str(data / "data"),
        "--enable-v2",
        "--listen-client-urls",
        f"http://127.0.0.1:{client}",
        "--advertise-client-urls",
        f"http://127.0.0.1:{client}",
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"shrink=http://127.0.0.1:{peer}",
    ]
    with (data / "etcd.log").open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{client}/v2/keys", timeout=1):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((data / "etcd.log").read_text()[-3000:]) from None
                time.sleep(0.1)
        yield client
    finally:
        server.terminate()
        server.wait(timeout=30)
