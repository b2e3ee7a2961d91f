#!/usr/bin/env python3
"""Per-cell latency of ranks that stay: air_magic's pool beside ipyparallel, nbdistributed and jupyter-distributed.

    python benchmarks/pool/run.py [--ranks 2,8] [--cells 50] [--tools air_magic,ipyparallel,nbdistributed]

Each (tool, N) gets its own fresh IPython kernel, driven over ZMQ with jupyter_client as a
notebook front end drives it (the launch benchmark's harness and virtual environment:
``bash benchmarks/launch/setup_env.sh`` once).  In the kernel, the tool's ranks are started
once, a warm-up cell runs, and then one kernel cell runs each measured cell ``--cells`` times
through IPython's own ``run_cell_magic`` with ``time.perf_counter()`` around each: the time a
user waits for a cell, measured where the notebook's code runs.  Two cells:

* ``noop``: the cell ``0``;
* ``all_reduce``: ``t = torch.ones(1); dist.all_reduce(t)`` on the group the tool keeps.

Then the same two cells again, one notebook cell each, timed by the front end (jupyter_client:
execute_request sent → execute_reply received).  jupyter-distributed is only in that table: its
kernel is a proxy whose every cell runs on N rank kernels, so no cell of it runs in a kernel
where ``perf_counter`` could bracket it.

Writes ``results/pool.json`` and ``results/pool.md`` (medians, p99, ratios to air_magic).
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import textwrap
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAUNCH = HERE.parent / "launch"
VENV = LAUNCH / ".venv"  # the launch benchmark's: every peer, one pinned torch


def _reexec_in_venv() -> None:
    import os

    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    if not (VENV / "bin" / "python").exists():
        sys.exit(f"{VENV} not found: run `bash {LAUNCH / 'setup_env.sh'}` first")
    os.execv(str(VENV / "bin" / "python"), [str(VENV / "bin" / "python"), str(Path(__file__).resolve()), *sys.argv[1:]])


_reexec_in_venv()
sys.path.insert(0, str(LAUNCH))
import run as L  # noqa: E402  (the launch benchmark's environment, kernels and machine description)

H = L.H

RESULTS = HERE / "results"

NOOP = "0"
ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\n"


class Tool:
    name = ""
    #: cell magic and its line: how one cell of the tool runs
    magic = ("", "")
    setup_cell = ""

    def init(self, n: int) -> str:
        raise NotImplementedError

    def teardown(self) -> str:
        return ""


class AirMagicPool(Tool):
    name = "air_magic"
    magic = ("distributed", "--pool")
    model = "%%distributed --pool: N ranks forked once by the helper, gloo group joined once, cells over a Unix socket"

    def init(self, n: int) -> str:
        return (
            'get_ipython().run_line_magic("load_ext", "air_magic")\n'
            f'get_ipython().run_line_magic("distributed_pool", "-n {n} --accelerator-type CPU --no-tracking")\n'
            # %load_ext imports MLflow on a thread of the kernel (for tracked launches): a warm pool
            # is measured once that import is over, as the other tools' steady state is.
            "import threading as _th\n"
            "for _t in _th.enumerate():\n"
            "    if _t.name == 'air_magic-mlflow-warm':\n"
            "        _t.join(120)\n"
        )

    setup_cell = "import torch, torch.distributed as dist"

    def teardown(self) -> str:
        return 'get_ipython().run_line_magic("distributed_pool", "--stop")'


class IpyParallelPx(Tool):
    name = "ipyparallel"
    magic = ("px", "")
    model = "%%px on N engines (controller + engines started once); a gloo group initialised once on the engines"

    def init(self, n: int) -> str:
        return textwrap.dedent(f"""\
            import ipyparallel as ipp, socket
            _ipp_cluster = ipp.Cluster(n={n})
            _ipp_rc = _ipp_cluster.start_and_connect_sync()
            _ipp_rc.wait_for_engines({n}, timeout=120)
            _ipp_view = _ipp_rc[:]
            _ipp_view.block = True
            _ipp_view.activate()
            with socket.socket() as _s:
                _s.bind(("127.0.0.1", 0)); _port = _s.getsockname()[1]
            def _join(rank, n, port):
                import os, torch.distributed as dist
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
                dist.init_process_group("gloo")
                return rank
            _ipp_view.map_sync(_join, list(range({n})), [{n}] * {n}, [_port] * {n})
            """)

    setup_cell = "import torch, torch.distributed as dist"

    def teardown(self) -> str:
        return "try:\n    _ipp_rc.close()\nfinally:\n    _ipp_cluster.stop_cluster_sync()"


class NbDistributed(Tool):
    name = "nbdistributed"
    magic = ("distributed", "")
    model = "%%distributed of nbdistributed: N workers started by %dist_init, group joined at start, ZMQ messages"

    def init(self, n: int) -> str:
        return (
            L.T.NbDistributed().init_body(type("C", (), {"n": n})())
            + '\nget_ipython().run_line_magic("dist_mode", "--disable")\n'
        )

    setup_cell = "import torch, torch.distributed as dist"

    def teardown(self) -> str:
        return L.T.NbDistributed().teardown(None)


class JupyterDistributedKernels(Tool):
    """The kernel is the tool: a proxy kernel whose every cell runs on N rank kernels; no
    cell runs in a kernel of the notebook's own, so only the front end's clock can time it."""

    name = "jupyter-distributed"
    proxy = True
    model = (
        "a proxy kernel that runs every cell on N persistent rank ipykernels; a gloo group "
        "initialised once in the rank kernels"
    )

    def init(self, n: int) -> str:
        port = H.free_port()
        return (
            f"import os, torch, torch.distributed as dist\nos.environ['MASTER_PORT'] = '{port}'\n"
            "dist.init_process_group('gloo')\n"
        )


class _FreshLaunch(Tool):
    """A fresh %%distributed launch of the same cell (the helper warm): what a pool cell replaces."""

    def __init__(self, n: int) -> None:
        self.magic = ("distributed", f"-n {n} --accelerator-type CPU --no-tracking")


TOOLS = {t.name: t for t in (AirMagicPool(), IpyParallelPx(), NbDistributed(), JupyterDistributedKernels())}


def client_cell(tool: Tool, body: str) -> str:
    """The cell a user types for ``body`` with this tool."""
    if getattr(tool, "proxy", False):
        return body
    magic, line = tool.magic
    return f"%%{magic} {line}\n{body}".replace(f"%%{magic} \n", f"%%{magic}\n")


def client_times(ks: object, tool: Tool, body: str, cells: int) -> dict:
    """execute_request -> execute_reply, timed by the front end (jupyter_client), per cell."""
    times = []
    for i in range(cells + 3):
        r = ks.execute(client_cell(tool, body), 120)
        if r["reply"].get("status") != "ok" or r["errors"]:
            raise H.CellError(f"{r['errors'] or r['reply'].get('evalue')}")
        if i >= 3:  # three warm-up cells
            times.append(r["client_s"])
    times.sort()
    return {
        "median_ms": statistics.median(times) * 1000,
        "p99_ms": times[min(len(times) - 1, int(round(0.99 * (len(times) - 1))))] * 1000,
        "cells": len(times),
    }


def timing_cell(tool: Tool, body: str, cells: int) -> str:
    magic, line = tool.magic
    return textwrap.dedent(f"""\
        import time as _t, json as _j, contextlib as _c, io as _io
        _times = []
        for _i in range({cells}):
            _buf = _io.StringIO()
            _b = _t.perf_counter()
            with _c.redirect_stdout(_buf):
                get_ipython().run_cell_magic({magic!r}, {line!r}, {body!r})
            _times.append(_t.perf_counter() - _b)
        _bench_times = _j.dumps(_times)
        """)


def measure(env: L.Env, tool: Tool, n: int, cells: int) -> dict:
    session = f"pool-{tool.name}-{n}-{uuid.uuid4().hex[:6]}"
    kenv = env.kernel_env(session)
    row: dict = {"tool": tool.name, "n": n, "model": tool.model}
    ks = None
    try:
        if getattr(tool, "proxy", False):
            began = time.perf_counter()
            ks, _ = L._start_proxy(env, L.T.TOOLS_BY_NAME["jupyter-distributed"], n, kenv)
            r = ks.execute(tool.init(n), 300)  # the rank kernels start with this first cell
            if r["reply"].get("status") != "ok" or r["errors"]:
                raise H.CellError(f"{r['errors'] or r['reply'].get('evalue')} {r['stdout'][-400:]}")
            row["start_s"] = time.perf_counter() - began
            for name, body in (("noop", NOOP), ("all_reduce", ALL_REDUCE)):
                row[f"client_{name}"] = client_times(ks, tool, body, cells)
            row["status"] = "ok"
            return row
        ks = H.KernelSession(env.kernel_name, kenv, cwd=str(env.root), log_path=env.logs / f"pool-{tool.name}-{n}.log")
        began = time.perf_counter()
        ks.run_plain(tool.init(n), timeout=300)
        ks.run_plain(f"get_ipython().run_cell_magic({tool.magic[0]!r}, {tool.magic[1]!r}, {tool.setup_cell!r})", 120)
        row["start_s"] = time.perf_counter() - began
        for name, body in (("noop", NOOP), ("all_reduce", ALL_REDUCE)):
            ks.run_plain(timing_cell(tool, body, 3), timeout=120)  # warm-up
            r = ks.execute(timing_cell(tool, body, cells), 600, {"t": "_bench_times"})
            if r["reply"].get("status") != "ok":
                raise H.CellError(f"{r['reply'].get('ename')}: {r['reply'].get('evalue')}")
            text = r["reply"]["user_expressions"]["t"]["data"]["text/plain"]
            times = sorted(json.loads(ast.literal_eval(text)))  # the repr of a JSON string
            row[name] = {
                "median_ms": statistics.median(times) * 1000,
                "p99_ms": times[min(len(times) - 1, int(round(0.99 * (len(times) - 1))))] * 1000,
                "cells": len(times),
            }
        for name, body in (("noop", NOOP), ("all_reduce", ALL_REDUCE)):
            row[f"client_{name}"] = client_times(ks, tool, body, cells)
        if tool.teardown():
            ks.run_plain(tool.teardown(), timeout=60)
        if isinstance(tool, AirMagicPool):  # what the pool saves: a fresh launch of the same cell
            body = timing_cell(_FreshLaunch(n), NOOP, min(cells, 20))
            r = ks.execute(body, 600, {"t": "_bench_times"})
            text = r["reply"]["user_expressions"]["t"]["data"]["text/plain"]
            times = sorted(json.loads(ast.literal_eval(text)))
            row["fresh_launch_ms"] = statistics.median(times) * 1000
            began = time.perf_counter()
            second = f'get_ipython().run_line_magic("distributed_pool", "-n {n} --accelerator-type CPU --no-tracking")'
            ks.run_plain(second, timeout=300)  # a second pool, the helper warm
            row["pool_start_warm_s"] = time.perf_counter() - began
            ks.run_plain(tool.teardown(), timeout=60)
        row["status"] = "ok"
    except Exception as exc:  # a peer that fails is reported, not fatal
        row["status"] = "failed"
        row["reason"] = f"{type(exc).__name__}: {exc}"[:400]
    finally:
        if ks is not None:
            ks.shutdown()
        H.kill_procs(H.tagged_processes(H.TAG_VAR, session))
    return row


def markdown(rows: list[dict], machine: dict) -> str:
    ours = {
        (r["n"], cell): r[cell]["median_ms"]
        for r in rows
        if r["tool"] == "air_magic" and r["status"] == "ok"
        for cell in ("noop", "all_reduce")
    }
    lines = [
        "# Pool: per-cell latency of ranks that stay",
        "",
        f"Machine: {machine.get('cpu_model', '?')}, {machine.get('logical_cpus')} logical CPUs, {machine.get('os')}, "
        f"Python {machine.get('python')}, torch {machine.get('versions', {}).get('torch', '?')}.",
        "",
        "| tool | N | start (s) | `0` median (ms) | `0` p99 (ms) | all_reduce median (ms) | all_reduce p99 (ms) | × air_magic (`0`, all_reduce) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['tool']} | {r['n']} | failed: {r.get('reason', '')} | | | | | |")
            continue
        if "noop" not in r:
            lines.append(f"| {r['tool']} | {r['n']} | {r['start_s']:.1f} | (no kernel of its own: below) | | | | |")
            continue
        ratio = []
        for cell in ("noop", "all_reduce"):
            base = ours.get((r["n"], cell))
            ratio.append(f"{r[cell]['median_ms'] / base:.1f}×" if base else "?")
        lines.append(
            f"| {r['tool']} | {r['n']} | {r['start_s']:.1f} | {r['noop']['median_ms']:.2f} | {r['noop']['p99_ms']:.2f} | "
            f"{r['all_reduce']['median_ms']:.2f} | {r['all_reduce']['p99_ms']:.2f} | {', '.join(ratio)} |"
        )
    for r in rows:
        if r["tool"] == "air_magic" and r["status"] == "ok" and "fresh_launch_ms" in r:
            lines.append(
                f"\nair_magic, N = {r['n']}: a fresh `%%distributed` launch of the same `0` cell (helper warm) takes "
                f"{r['fresh_launch_ms']:.1f} ms median, {r['fresh_launch_ms'] / r['noop']['median_ms']:.0f}× the pool's "
                f"cell; starting a pool with the helper warm takes {r['pool_start_warm_s']:.2f} s."
            )
    client = {
        (r["n"], cell): r[f"client_{cell}"]["median_ms"]
        for r in rows
        if r["tool"] == "air_magic" and r["status"] == "ok"
        for cell in ("noop", "all_reduce")
        if f"client_{cell}" in r
    }
    lines += [
        "",
        "The same cells, timed by the front end (jupyter_client: execute_request sent → execute_reply "
        "received; the kernel's messaging included), one notebook cell each:",
        "",
        "| tool | N | `0` median (ms) | `0` p99 (ms) | all_reduce median (ms) | all_reduce p99 (ms) | × air_magic (`0`, all_reduce) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok" or "client_noop" not in r:
            continue
        ratio = []
        for cell in ("noop", "all_reduce"):
            base = client.get((r["n"], cell))
            ratio.append(f"{r[f'client_{cell}']['median_ms'] / base:.1f}×" if base else "?")
        lines.append(
            f"| {r['tool']} | {r['n']} | {r['client_noop']['median_ms']:.2f} | {r['client_noop']['p99_ms']:.2f} | "
            f"{r['client_all_reduce']['median_ms']:.2f} | {r['client_all_reduce']['p99_ms']:.2f} | {', '.join(ratio)} |"
        )
    lines += ["", "How each tool keeps its ranks:", ""]
    for name, tool in TOOLS.items():
        lines.append(f"- **{name}**: {tool.model}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,8")
    parser.add_argument("--cells", type=int, default=50)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--out", default=str(RESULTS / "pool.json"))
    args = parser.parse_args()
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="airbench-pool-"))
    env = L.Env(uuid.uuid4().hex[:8], root, root / "logs")
    machine = L.machine_info()
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        for name in args.tools.split(","):
            L.log(f"{name} N={n}")
            rows.append(measure(env, TOOLS[name], n, args.cells))
            L.log(json.dumps(rows[-1]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    text = markdown(rows, machine)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
