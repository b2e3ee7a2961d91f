"""The Ray tests run inside a network namespace that has only the loopback interface.

There a Ray node finds no address but 127.0.0.1 (outside one, Ray 2.60 advertises the
machine's own address whatever ``--node-ip-address`` says), so no test traffic can reach
another address. ``python -m pytest`` needs nothing more:

- **outside such a namespace** (the usual case) one test, ``test_ray_namespace.py``, runs
  the selected tests of this folder in a pytest session of their own under ``unshare -n``
  (``unshare -rn`` for a user who is not root). Each of them stays an item of this session,
  run after it, that reports the outcome it had there (its failure's message and output), so
  the closing counts say what ran and a failed test's id, as printed, runs it again. The
  wrapper skips, saying why, where no namespace can be made or Ray is not installed; with
  ``AIR_MAGIC_RAY_REQUIRED=1`` (CI) it fails instead. Selected alone (its own id, as a
  failure of it prints), it runs every test of this folder;
- **inside one** (that inner session, or a container started without a network) the tests
  run directly and that one test is deselected.

Fixtures: ``ray_cluster`` (session: a head and a worker node, see ``ray_support.RayCluster``),
``spare_worker`` (a worker node of the test's own, killed at its end if the test did not),
``ray_kernel`` (a kernel whose environment joins ``ray_cluster``), ``kernel`` (that kernel,
``air_magic.ray_init()`` done).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
from ray_support import (
    HERE,
    INNER,
    INSTALL_HINT,
    RESULTS,
    SUMMARY,
    WRAPPER,
    Node,
    RayCluster,
    loopback_only,
    ray_version,
)

_WRAPPER_ITEM = pytest.StashKey[pytest.Item]()

IN_NAMESPACE = loopback_only()


def _ours(item: pytest.Item) -> bool:
    return HERE in Path(item.path).resolve().parents


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Before -k / -m deselect anything: remember the wrapper, which a -k that names an
    # inner test would drop.
    for item in items:
        if _ours(item):
            item.add_marker(pytest.mark.ray)
            if item.path.name == WRAPPER:
                config.stash[_WRAPPER_ITEM] = item


def _select(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _ours(item)]
    wrapper = [item for item in ours if item.path.name == WRAPPER]
    inner = [item for item in ours if item.path.name != WRAPPER]
    if IN_NAMESPACE:
        if wrapper:
            items[:] = [item for item in items if item not in wrapper]
            config.hook.pytest_deselected(items=wrapper)
        return
    if not inner and not wrapper:
        return
    if not inner:  # the wrapper alone: every Ray test
        config.stash[INNER] = [str(HERE.relative_to(config.rootpath))]
        return
    config.stash[INNER] = [item.nodeid for item in inner]
    if not wrapper:
        known = config.stash.get(_WRAPPER_ITEM, None)
        wrapper = [known if known is not None else _collect_wrapper(inner[0])]
    # The wrapper first, then an item per Ray test that tells what it did in the namespace.
    rest = [item for item in items if item not in ours]
    items[:] = [*rest, wrapper[0], *(RayOutcome.standing_for(item) for item in inner)]


class RayOutcome(pytest.Item):
    """A Ray test in the outer session: it passes, fails or skips as it did in the namespace
    (where the wrapper ran it), with the same node id, so ``pytest <its id>`` runs it again."""

    @classmethod
    def standing_for(cls, item: pytest.Item) -> "RayOutcome":
        parent = item.parent
        assert parent is not None
        outcome: RayOutcome = cls.from_parent(parent, name=item.name)
        outcome.add_marker(pytest.mark.ray)
        return outcome

    def runtest(self) -> None:
        results = self.config.stash.get(RESULTS, None)
        if results is None:
            pytest.skip("the Ray tests did not run in a namespace: the outcome of test_ray_namespace.py says why")
        outcome, said = results.get(self.nodeid, ("missing", ""))
        if outcome == "passed":
            return
        if outcome == "skipped":
            pytest.skip(said)
        if outcome == "missing":
            pytest.fail("it did not run to its end in the namespace: the output of test_ray_namespace.py says why")
        pytest.fail(f"in the loopback-only network namespace: {said}", pytrace=False)

    def reportinfo(self) -> tuple[Any, int | None, str]:
        return self.path, None, f"{self.name} (run in a loopback-only network namespace)"


def _collect_wrapper(near: pytest.Item) -> pytest.Item:
    """The wrapper test when only some Ray test files were named on the command line."""
    module = near.getparent(pytest.Module)
    assert module is not None and module.parent is not None
    wrapper = pytest.Module.from_parent(module.parent, path=HERE / WRAPPER)
    (item,) = [node for node in wrapper.collect() if isinstance(node, pytest.Item)]
    item.add_marker(pytest.mark.ray)
    return item


class _LastSelection:
    """Runs :func:`_select` after every other ``pytest_collection_modifyitems`` (``-k``, ``-m``)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        _select(config, items)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_LastSelection(), "air-magic-ray-selection")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    lines = config.stash.get(SUMMARY, None)
    if lines:
        terminalreporter.section("Ray tests, run in a loopback-only network namespace")
        for line in lines:
            terminalreporter.write_line(line)


# -- fixtures of the inner session ---------------------------------------------------------


def require_ray() -> None:
    """Skip (fail with ``AIR_MAGIC_RAY_REQUIRED=1``) where Ray is not installed."""
    if ray_version() is None:
        message = f"Ray is not installed: {INSTALL_HINT}"
        if os.environ.get("AIR_MAGIC_RAY_REQUIRED") == "1":
            pytest.fail(f"{message} (AIR_MAGIC_RAY_REQUIRED=1)")
        pytest.skip(message)


@pytest.fixture(autouse=True)
def _ray_installed() -> None:
    """Every test here needs Ray (``tests/`` on ``sys.path`` makes this folder a ``ray`` of its own otherwise)."""
    require_ray()


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    """A head node (resource ``head_node``) and a worker node (``worker_node``), one CPU each,
    on 127.0.0.1; every process of it is gone after the session (checked)."""
    require_ray()
    if not loopback_only():
        pytest.fail("a Ray cluster is started only inside a loopback-only network namespace")
    cluster = RayCluster()
    try:
        cluster.start(workers=1)
    except BaseException:
        cluster.stop()
        raise
    print(
        f"\nRay test cluster at {cluster.address}: up in {cluster.started_s:.1f} s "
        f"(head {cluster.head.started_s if cluster.head else 0:.1f} s, "
        f"worker {cluster.workers[0].started_s:.1f} s)"
    )
    yield cluster
    cluster.stop()


@pytest.fixture
def spare_worker(ray_cluster: RayCluster) -> Iterator[Node]:
    """One more worker node, for this test alone (to kill it: ``ray_cluster.kill_worker(node)``)."""
    node = ray_cluster.start_worker()
    yield node
    if node in ray_cluster.workers:
        ray_cluster.kill_worker(node)


@pytest.fixture(scope="module")
def ray_kernel(kernel_factory: Any, ray_cluster: RayCluster) -> Iterator[Any]:
    """A kernel (``%load_ext air_magic`` done) whose environment joins ``ray_cluster``:
    ``air_magic.ray_init()`` with no address connects to it."""
    kernel = kernel_factory(extra_env=ray_cluster.env)
    yield kernel
    kernel.shutdown()


@pytest.fixture(scope="module")
def kernel(ray_kernel: Any) -> Any:
    """``ray_kernel`` joined to the cluster (``air_magic.ray_init()``), gloo told to use lo."""
    ray_kernel.ok("%env GLOO_SOCKET_IFNAME=lo")
    result = ray_kernel.ok("import air_magic\nair_magic.ray_init()", timeout=120)
    assert "2 nodes" in result.stdout
    return ray_kernel
