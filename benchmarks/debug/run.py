#!/usr/bin/env python3
"""A rank's debugger, timed from the front end: how soon the prompt comes, how fast a command is
answered, what waiting ranks cost, how soon ``q`` frees every rank, a post-mortem, a long pause.

    .venv/bin/python benchmarks/debug/run.py [--samples 20] [--idle 30] [--pause 600] [--quick]

One real IPython kernel (jupyter_client, as JupyterLab drives it: cells sent with
``allow_stdin=True``, each ``input_request`` answered on the stdin channel), 2 CPU ranks:

* ``prompt``: a pool cell whose rank 0 writes ``time.time()`` and calls ``breakpoint()``; the
  seconds from that line to the front end's ``input_request`` (``--samples`` cells), and the
  same for fresh launches (5);
* ``command``: ``p 1 + 1`` at the prompt: seconds from the answer sent to the next prompt;
* ``idle CPU``: rank 0 paused, rank 1 waiting for it in ``all_reduce``: each rank's CPU time
  over ``--idle`` seconds (their processes' own counts), as % of one core;
* ``quit``: ``q`` at the prompt (rank 1 waits in ``all_reduce``): seconds until the cell has
  ended with every rank back and the pool intact;
* ``post-mortem``: ``%distributed_debug`` after a failed pool cell: seconds to its prompt;
* ``pause``: a prompt left for ``--pause`` seconds, then ``c``: the cell's values.

Writes ``results/debug.json`` and ``results/debug.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(ROOT / "tests"))

from harness import Kernel, rank_processes  # noqa: E402  (the test suite's notebook-like kernel driver)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def prompt_latency(kernel: Kernel, mark: Path, cell: str) -> tuple[float, float]:
    """(seconds from the breakpoint's line to the prompt, seconds for `p 1 + 1`'s answer)."""
    times: dict[str, float] = {}

    def answer(prompt: str, res: Any) -> str:
        now = time.time()
        if "prompt" not in times:
            times["prompt"] = now - float(mark.read_text())
            times["sent"] = time.monotonic()
            return "p 1 + 1"
        times["command"] = time.monotonic() - times["sent"]
        return "c"

    res = kernel.run_with_stdin(cell, answer)
    assert res.error is None, res.error_text
    return times["prompt"], times["command"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--idle", type=float, default=30.0)
    parser.add_argument("--pause", type=float, default=600.0)
    parser.add_argument("--quick", action="store_true", help="5 samples, 5 s idle, a 10 s pause")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.idle, args.pause = 5, 5.0, 10.0
    workdir = tempfile.mkdtemp(prefix="airbench-debug-")
    mark = Path(workdir) / "mark"
    kernel = Kernel(workdir)
    results: dict[str, Any] = {}
    try:
        kernel.ok("%load_ext air_magic\n%config DistributedMagics.tracking = False")
        here = f"open({str(mark)!r}, 'w').write(repr(time.time()))"
        launch_cell = (
            f"%%distributed -n 2\nimport os, time\nif os.environ['RANK'] == '0':\n    {here}\n    breakpoint()\n1"
        )
        launches = [prompt_latency(kernel, mark, launch_cell) for _ in range(5)]
        kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
        pool_cell = (
            "%%distributed --pool\nimport time, torch, torch.distributed as dist\n"
            f"if dist.get_rank() == 0:\n    {here}\n    breakpoint()\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
        )
        pools = [prompt_latency(kernel, mark, pool_cell) for _ in range(args.samples)]
        results["prompt_launch_s"] = [p for p, _ in launches]
        results["prompt_pool_s"] = [p for p, _ in pools]
        results["command_s"] = [c for _, c in launches + pools]

        # Waiting ranks' CPU: rank 0 at its prompt, rank 1 in all_reduce, for --idle seconds.
        def idle(prompt: str, res: Any) -> str:
            procs = sorted(rank_processes(), key=lambda p: p.pid)
            before = [p.cpu_times() for p in procs]
            time.sleep(args.idle)
            after = [p.cpu_times() for p in procs]
            results["idle_cpu_pct"] = [
                100 * ((a.user + a.system) - (b.user + b.system)) / args.idle for a, b in zip(after, before)
            ]
            return "c"

        kernel.run_with_stdin(pool_cell, idle)

        # q: every rank back, the pool intact.
        pids = sorted(p.pid for p in rank_processes())
        quits = []
        for _ in range(5):
            sent: dict[str, float] = {}

            def quit_(prompt: str, res: Any, sent: dict[str, float] = sent) -> str:
                sent["at"] = time.monotonic()
                return "q"

            res = kernel.run_with_stdin(pool_cell, quit_)
            assert "at" in sent, (res, res.reply)
            quits.append(time.monotonic() - sent["at"])
            assert res.error is not None and "intact" in res.error["evalue"], res.error_text
        assert sorted(p.pid for p in rank_processes()) == pids
        results["quit_s"] = quits

        # %distributed_debug after a failed cell.
        post = []
        for _ in range(5):
            kernel.run("%%distributed --pool\nimport os\nif os.environ['RANK'] == '1':\n    raise ValueError('x')")
            began = time.monotonic()
            found: dict[str, float] = {}

            def post_(prompt: str, res: Any, found: dict[str, float] = found, began: float = began) -> str:
                found.setdefault("at", time.monotonic() - began)
                return "q"

            kernel.run_with_stdin("%distributed_debug", post_)
            post.append(found["at"])
        results["post_mortem_s"] = post

        # A long pause, then c.
        def pause(prompt: str, res: Any) -> str:
            time.sleep(args.pause)
            return "c"

        res = kernel.run_with_stdin(pool_cell, pause, timeout=args.pause + 120)
        results["pause_s"] = args.pause
        results["pause_values"] = res.result
        results["pause_error"] = res.error_text or None
    finally:
        kernel.shutdown()
    results["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "debug.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# A rank's debugger ({results['machine']}; 2 CPU ranks)",
        "",
        "| what | median | p95 | max | goal |",
        "|---|---|---|---|---|",
    ]
    for key, what, goal in (
        ("prompt_pool_s", f"breakpoint line → prompt, pool cell ({len(results['prompt_pool_s'])})", "≤ 1 s p95"),
        ("prompt_launch_s", "breakpoint line → prompt, fresh launch (5)", "≤ 1 s p95"),
        ("command_s", "`p 1 + 1` answered (from the front end)", "≤ 0.1 s"),
        ("quit_s", "`q` → every rank back, pool intact (5)", "≤ 3 s"),
        ("post_mortem_s", "`%distributed_debug` → prompt (5)", "≤ 1 s"),
    ):
        values = results[key]
        lines.append(
            f"| {what} | {statistics.median(values):.3f} s | {p95(values):.3f} s | {max(values):.3f} s | {goal} |"
        )
    cpu = ", ".join(f"{c:.2f} %" for c in results["idle_cpu_pct"])
    lines += [
        "",
        f"Waiting over {args.idle:g} s (rank 0 at its prompt, rank 1 in all_reduce): {cpu} of a core (goal ≤ 2 %).",
        f"A prompt left {args.pause:g} s, then `c`: {results['pause_values'] or results['pause_error']}.",
    ]
    (RESULTS / "debug.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
