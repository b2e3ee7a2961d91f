#!/usr/bin/env python3
"""The pool's first ``state_dict`` beside its second, quiet and beside busy loops.

    .venv/bin/python benchmarks/model_back/first.py [--kernels 5] [--busy 0,2]

Each try is a fresh IPython kernel (jupyter_client, as a notebook drives it) that loads
air_magic, starts a pool of 2 CPU ranks, builds a 0.3 MiB model there (5 ``Linear(128, 128)``)
and then times ``pool.state_dict('model')`` twice in the kernel (``time.perf_counter()``
around each).  Nothing else runs in the kernel before: its first ``state_dict`` is the first
use of torch there.  ``--busy N``: N busy loops on the same cores.

Writes ``results/first.json`` and ``results/first.md``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness import Kernel  # noqa: E402  (the test suite's notebook-like kernel driver)

TIMED = (
    "import time, air_magic\n_t = time.perf_counter()\nsd = air_magic.Pool.current().state_dict('model')\n"
    "_took = time.perf_counter() - _t"
)


def one_kernel() -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as workdir:
        kernel = Kernel(workdir)
        try:
            kernel.ok("%load_ext air_magic")
            kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=300)
            kernel.ok(
                "%%distributed --pool\nimport torch\nmodel = torch.nn.Sequential(*[torch.nn.Linear(128, 128) "
                "for _ in range(5)])",
                timeout=120,
            )
            times = []
            for _ in range(2):
                kernel.ok(TIMED, timeout=300)
                times.append(float(kernel.value("_took")))
            return times[0], times[1]
        finally:
            kernel.shutdown()


def busy() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--kernels", type=int, default=5, help="fresh kernels per load")
    parser.add_argument("--busy", default="0,2", help="busy loops beside it, one run per number")
    args = parser.parse_args()
    results = {"machine": f"{platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores"}
    rows = []
    for loops_wanted in [int(n) for n in args.busy.split(",")]:
        loops = [multiprocessing.Process(target=busy, daemon=True) for _ in range(loops_wanted)]
        for loop in loops:
            loop.start()
        try:
            found = [one_kernel() for _ in range(args.kernels)]
        finally:
            for loop in loops:
                loop.terminate()
        first = statistics.median(f for f, _ in found)
        second = statistics.median(s for _, s in found)
        extra = statistics.median(f - s for f, s in found)
        rows.append({"busy": loops_wanted, "tries": found, "first": first, "second": second, "extra": extra})
        print(f"busy {loops_wanted}: first {first:.3f} s, second {second:.3f} s, extra {extra:.3f} s", flush=True)
    results["rows"] = rows
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "first.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"Machine: {results['machine']}; {args.kernels} fresh kernels per row, medians.",
        "",
        "| busy loops | first state_dict (s) | second (s) | first − second (s) | worst first − second (s) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        worst = max(f - s for f, s in row["tries"])
        lines.append(f"| {row['busy']} | {row['first']:.3f} | {row['second']:.3f} | {row['extra']:.3f} | {worst:.3f} |")
    (out / "first.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
