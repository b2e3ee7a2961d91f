"""Runs the Ray tests this session selected in a pytest session of their own, inside a new
network namespace that has only the loopback interface (see ``conftest.py``).

Each Ray test then reports, as an item of this session, what it did there (a failure with
its message and the inner session's output for it); their counts, and the reason of every
test that did not pass, are also printed in this session's summary.  This test itself fails
for what no Ray test stands for: the inner session ran past its time, ended without a
report, or left processes running (it is marked, as every process it starts is: they are
killed).  Each inner test keeps pytest-timeout's limit, enforced from a thread of its own,
so a test stuck where no signal reaches it (a dead cluster's kernel) still ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
from ray_support import (
    HERE,
    INNER,
    INSTALL_HINT,
    NAMESPACE_RUN,
    RESULTS,
    SUMMARY,
    describe,
    kill_marked,
    marked_processes,
    ray_version,
    unshare_prefix,
)

#: The inner session's whole time (each of its tests keeps pytest-timeout's 300 s).
INNER_TIMEOUT = 1500

pytestmark = [pytest.mark.timeout(INNER_TIMEOUT + 120)]


def _cannot(why: str) -> None:
    if os.environ.get("AIR_MAGIC_RAY_REQUIRED") == "1":
        pytest.fail(f"{why} (AIR_MAGIC_RAY_REQUIRED=1: the Ray tests must run)")
    pytest.skip(why)


def test_ray_tests_in_a_loopback_only_network_namespace(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    selected = request.config.stash.get(INNER, [])
    if not selected:
        pytest.skip("no Ray test was selected")
    if ray_version() is None:
        _cannot(f"Ray is not installed: {INSTALL_HINT}")
    prefix, why = unshare_prefix()
    if prefix is None:
        _cannot(f"the Ray tests run in a network namespace of their own, and none can be made here: {why}")
    assert prefix is not None

    run = uuid.uuid4().hex
    env = dict(os.environ, SPT_NOENV="1", **{NAMESPACE_RUN: run})
    env.pop("PYTEST_CURRENT_TEST", None)
    report = tmp_path / "inner.xml"
    command = [
        *prefix,
        sys.executable,
        str(HERE / "netns_exec.py"),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        f"--basetemp={tmp_path / 'inner'}",
        f"--junitxml={report}",
        "-o",
        "junit_logging=all",
        "-o",
        "timeout_method=thread",
        "-v",
        *selected,
    ]
    began = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=str(request.config.rootpath),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=INNER_TIMEOUT)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    finally:
        # What the inner session left (a cluster whose fixture never ended, a kernel ...).
        deadline = time.monotonic() + 5
        while marked_processes(NAMESPACE_RUN, run) and time.monotonic() < deadline:
            time.sleep(0.2)
        leftovers = marked_processes(NAMESPACE_RUN, run)
        left_report = describe(leftovers)
        kill_marked(NAMESPACE_RUN, run)
    took = time.monotonic() - began

    lines = _summary(report, took, len(selected))
    request.config.stash[SUMMARY] = lines
    results = _results(report)
    request.config.stash[RESULTS] = results
    print("\n".join(lines))
    if timed_out:
        pytest.fail(f"the Ray tests did not finish in {INNER_TIMEOUT} s; their output:\n{output}")
    told = any(outcome in ("failed", "error") for outcome, _ in results.values())
    if proc.returncode != 0 and not told:  # a failure no Ray test's item reports
        pytest.fail(f"the Ray tests failed in their namespace (exit {proc.returncode}); their output:\n{output}")
    if leftovers:
        pytest.fail(f"processes of the Ray tests outlived their session (killed now):\n{left_report}\n\n{output}")


def _results(report: Path) -> dict[str, tuple[str, str]]:
    """Each inner test's outcome and what it said, by node id (the outer session's items
    for them report it)."""
    try:
        root = ElementTree.parse(report).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    results = {}
    for case in root.iter("testcase"):
        nodeid = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome, said = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                said = child.get("message") or ""
                if child.tag != "skipped" and child.text:
                    said += "\n" + child.text[-6000:]
                break
        if outcome in ("failed", "error"):
            output = "".join(c.text or "" for c in case if c.tag in ("system-out", "system-err"))
            if output.strip():
                said += "\n--- its output ---\n" + output[-6000:]
        if outcome != "passed" and results.get(nodeid, ("passed",))[0] in ("failed", "error"):
            continue  # an error at teardown after a failure: the failure is the one to tell
        results[nodeid] = (outcome, said)
    return results


def _summary(report: Path, took: float, selected: int) -> list[str]:
    """``9 passed, 1 skipped in 84.0 s`` and one line per test that did not pass."""
    try:
        root = ElementTree.parse(report).getroot()
    except (OSError, ElementTree.ParseError) as exc:
        return [f"{selected} selected; no report from the inner session ({exc}) after {took:.1f} s"]
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    details = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or "").splitlines()
                details.append(f"  {outcome.upper()} {name}: {message[0] if message else ''}")
                break
        counts[outcome] += 1
    words = [f"{n} {word}" for word, n in counts.items() if n] or ["no tests ran"]
    return [f"{', '.join(words)} in {took:.1f} s (in a loopback-only network namespace)", *details]
