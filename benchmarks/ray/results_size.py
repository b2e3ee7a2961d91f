"""How a large tensor comes back from a Ray rank: time and the driver's peak memory.

    python benchmarks/ray/results_size.py                      # this checkout
    python benchmarks/ray/results_size.py --tree OLD --tree .  # two checkouts, side by side

For each checkout of air_magic (``--tree``, this one by default), in a loopback-only network
namespace and PID namespace of its own with a 2-node cluster as ``run.py`` makes one (a
head and one more node, 1 CPU each, ``ray start``, token authentication), a driver process
(what a notebook's kernel is to a launch) imports that checkout and calls a function
decorated with ``@distributed(num_accelerators=2, backend="ray")`` one of whose ranks returns
a float32 tensor of ``--mib`` MiB (256), the other ``None`` (rank 0 and rank 1 take turns).
The two ranks are on different nodes, and which rank lands on which node is Ray's choice at
each launch: each call is reported by where the tensor came from, the driver's node (Ray's
object store there maps it) or the other one (Ray copies it across first). One untimed
call, then ``2 * --reps`` (6) timed ones. For each:

* **result time**: from the rank's ``time.monotonic()`` taken just before its ``return`` (the
  tensor is made) until the call returns in the driver (one clock for the whole machine):
  the record written, the rank's exit seen, the bytes through Ray to the driver's node, the
  values read;
* **call time**: the whole call;
* **peak RSS**: the driver's peak resident memory (``VmHWM``, reset before the call through
  ``/proc/self/clear_refs``) above its resident memory before the call, with the tensor's
  every page read once after the call (its sum), as code that uses it does;
* **RSS after**: what stays resident once the call returned and the tensor was read.

Results: ``benchmarks/ray/results/results_size.json`` and ``results_size.md`` (printed too).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run import ROOT, in_loopback_namespace, machine, reexec_in_namespace, start_cluster, write_results  # noqa: E402


def returns(rank: int, mib: int) -> Any:
    """Rank ``rank``'s return value: its Ray node's id, when it returns, and a tensor of
    ``mib`` MiB; the other rank's: None."""
    import os
    import time

    import torch

    if os.environ["RANK"] != str(rank):
        return None
    node = ""
    with open(f"/proc/{os.environ['RAY_RAYLET_PID']}/cmdline", "rb") as handle:  # its node's raylet
        for arg in handle.read().split(b"\0"):
            if arg.startswith(b"--node_id="):
                node = arg.split(b"=", 1)[1].decode()
    tensor = torch.full((mib << 18,), 1.5)  # float32
    return node, time.monotonic(), tensor


def _status(key: str) -> int:
    """A line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure_tree(tree: str, mib: int, reps: int) -> dict[str, Any]:
    """Inside the namespace: a cluster whose nodes import ``tree``, then the calls, here."""
    folder = tempfile.mkdtemp(prefix="air_magic-bench-results-")
    os.chdir(folder)
    env = start_cluster(folder, root=tree)
    os.environ.update(env)
    os.environ["AIR_MAGIC_LOG_DIR"] = os.path.join(folder, "logs")
    sys.path.insert(0, tree)
    import ray
    import torch

    import air_magic

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    driver_node = ray.get_runtime_context().get_node_id()
    on_ray = air_magic.distributed(num_accelerators=2, tracking=False, panel=False, backend="ray")(returns)
    runs = []
    for index in range(2 * reps + 1):
        rank = index % 2
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # VmHWM := VmRSS
        base = _status("VmRSS")
        began = time.monotonic()
        values = on_ray.distributed(rank, mib)
        returned = time.monotonic()
        node, stamp, tensor = values[rank]
        total = float(tensor.sum())  # every page read once
        run = {
            "from": "the driver's node" if node == driver_node else "the other node",
            "result_s": returned - stamp,
            "call_s": returned - began,
            "peak_rss_mib": (_status("VmHWM") - base) / 2**20,
            "rss_after_mib": (_status("VmRSS") - base) / 2**20,
            "checked": total == 1.5 * tensor.numel() and tensor.dtype == torch.float32,
        }
        del values, tensor
        if index:  # the first call warms up (imports, worker processes)
            runs.append(run)
        print(f"[bench] {tree}: {'timed' if index else 'warm-up'} call {run}", file=sys.stderr, flush=True)
    branch, commit = (
        subprocess.run(["git", "-C", tree, "rev-parse", *args, "HEAD"], capture_output=True, text=True).stdout.strip()
        for args in (["--abbrev-ref"], ["--short"])
    )
    return {
        "commit": f"{branch} {commit}".strip(),  # (no path of this machine in the results)
        "driver_node": driver_node,
        "ray_version": ray.__version__,
        "torch_version": torch.__version__,
        "runs": runs,
    }


#: The table's measured columns: (key, unit, digits).
_COLUMNS = [("result_s", "s", 2), ("call_s", "s", 2), ("peak_rss_mib", "MiB", 0), ("rss_after_mib", "MiB", 0)]


def _cell(values: list[float], unit: str, digits: int) -> str:
    low, high = min(values), max(values)
    return f"{statistics.median(values):.{digits}f} {unit} ({low:.{digits}f}–{high:.{digits}f})"


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"Machine: {m['cores']} cores ({m.get('cpu', '?')}), {m.get('memory_gib', '?')} GiB, Linux {m['kernel']}, "
        f"Python {m['python']}; a 2-node Ray cluster on it (1 CPU each, loopback only). Run of {results['date']}: "
        f"a {results['mib']} MiB float32 tensor from one of 2 ranks (one per node), {2 * results['reps']} timed calls "
        "after one untimed, counted by where the tensor came from.",
        "",
        "| checkout | tensor from | calls | result time (median, min–max) | call time | driver's peak RSS above "
        "its start | RSS after |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for tree in results["trees"]:
        name = tree["commit"]
        if not tree["runs"]:
            lines.append(f"| {name} | failed | | | | | |")
            continue
        for where in sorted({run["from"] for run in tree["runs"]}):
            runs = [run for run in tree["runs"] if run["from"] == where]

            cells = [_cell([run[key] for run in runs], unit, digits) for key, unit, digits in _COLUMNS]
            lines.append(f"| {name} | {where} | {len(runs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", help="an air_magic checkout to measure (repeatable)")
    parser.add_argument("--mib", type=int, default=256, help="the tensor's size in MiB")
    parser.add_argument("--reps", type=int, default=3, help="timed calls per checkout")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for the results")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # inside a namespace: the checkout to measure
    parser.add_argument("--answer", help=argparse.SUPPRESS)  # ... and where to write its numbers
    args = parser.parse_args()
    if args.one:
        if not in_loopback_namespace():
            sys.exit("--one runs inside the benchmark's namespace only")
        with open(args.answer, "w") as handle:
            json.dump(measure_tree(args.one, args.mib, args.reps), handle)
        return 0
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "mib": args.mib,
        "reps": args.reps,
        "trees": [],
    }
    for index, tree in enumerate(os.path.abspath(t) for t in args.tree or [ROOT]):
        # Each checkout in a namespace of its own: its cluster ends with it.
        with tempfile.NamedTemporaryFile(suffix=".json") as answer:
            code = reexec_in_namespace(
                ["--one", tree, "--answer", answer.name, "--mib", str(args.mib), "--reps", str(args.reps)], __file__
            )
            try:
                with open(answer.name) as handle:
                    results["trees"].append(json.load(handle))
            except (OSError, ValueError):
                results["trees"].append({"commit": f"checkout {index + 1}", "runs": [], "exit": code})
    write_results(args.out, "results_size", results, report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
