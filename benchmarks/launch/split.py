"""Where the time of a warm air_magic launch goes (the "floor, explained").

Run by ``run.py`` (tool name ``split``): one fresh kernel per (tracking on/off, N), a few
untimed launches, then measured ones of a payload that stamps ``time.monotonic()``
around ``init_process_group``, ``all_reduce`` and ``destroy_process_group`` on every
rank.  The kernel's side comes from ``Launch.timings`` (the same clock: CLOCK_MONOTONIC
is one clock for every process of the machine).  Medians, milliseconds.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import harness as H

SETUP = """
import json
from air_magic import distributed

@distributed(num_accelerators={n}, tracking={tracking})
def _split_payload():
    import time, torch, torch.distributed as dist
    t0 = time.monotonic()
    dist.init_process_group("gloo")
    t1 = time.monotonic()
    x = torch.ones(1)
    dist.all_reduce(x)
    t2 = time.monotonic()
    dist.destroy_process_group()
    t3 = time.monotonic()
    return (t0, t1, t2, t3)

_split_rows = []
"""

LAUNCH = """
_v = _split_payload.distributed()
_split_rows.append((dict(_split_payload.last_launch.timings), _v))
"""

#: (label, how it is computed from one launch) in the order of a launch.
PARTS = [
    ("kernel: spec, payload file, observers' before_start", "prepare"),
    ("  of which MLflow (spool folder, writer thread)", "mlflow_start"),
    ("  of which panel (first display)", "panel_start"),
    ("helper: fork the ranks (request sent → forked)", "fork"),
    ("rank start-up until the user's first line", "rank_start"),
    ("user code: init_process_group (rendezvous)", "rendezvous"),
    ("user code: all_reduce", "collective"),
    ("user code: destroy_process_group (gloo's event loop)", "destroy"),
    ("result: pickle, rank exit, helper → kernel", "result"),
    ("kernel: read the values", "read"),
    ("MLflow: last points, rank logs, run status", "mlflow_end"),
    ("panel: last update and summary", "panel_end"),
    ("the rest (files, wake-ups)", "other"),
    ("total (call → values)", "total"),
]


def parts_of(timings: dict[str, float], stamps: list[list[float]]) -> dict[str, float]:
    t = timings
    first_line = max(s[0] for s in stamps)
    user_end = max(s[3] for s in stamps)
    out = {
        "prepare": t["sent"] - t["call"],
        "mlflow_start": t.get("mlflow.before_start", 0.0),
        "panel_start": t.get("panel.before_start", 0.0),
        "fork": t["started"] - t["sent"],
        "rank_start": first_line - t["started"],
        "rendezvous": max(s[1] - s[0] for s in stamps),
        "collective": max(s[2] - s[1] for s in stamps),
        "destroy": max(s[3] - s[2] for s in stamps),
        "result": t["done"] - user_end,
        "read": t["outcome"] - t["done"],
        "mlflow_end": t.get("mlflow.after_end", 0.0) + t.get("mlflow.before_end", 0.0),
        "panel_end": t.get("panel.before_end", 0.0) + t.get("panel.after_end", 0.0),
        "total": t["returned"] - t["call"],
    }
    # user_end - first_line = the three user parts, with their overlap across ranks
    accounted = (
        out["prepare"]
        + out["fork"]
        + out["rank_start"]
        + (user_end - first_line)
        + out["result"]
        + out["read"]
        + out["mlflow_end"]
        + out["panel_end"]
    )
    out["other"] = out["total"] - accounted
    return out


def run_split(
    env: Any, kernel_name: str, n: int, tracking: bool, launches: int, warmup: int, logs: Path, session: str
) -> dict[str, Any]:
    """One kernel: ``warmup`` untimed launches, then ``launches`` measured; medians in ms."""
    folder = env.root / "folders" / session
    folder.mkdir(parents=True)
    ks = H.KernelSession(kernel_name, env.kernel_env(session), cwd=str(folder), log_path=logs / f"{session}.log")
    try:
        ks.run_plain(SETUP.format(n=n, tracking=tracking), timeout=120)
        time.sleep(3.0)  # the helper imports torch; MLflow opens its store
        for _ in range(warmup):
            ks.run_plain(LAUNCH, timeout=180)
        ks.run_plain("_split_rows.clear()", timeout=30)
        for _ in range(launches):
            ks.run_plain(LAUNCH, timeout=180)
        out = ks.run_plain("print('SPLIT' + json.dumps(_split_rows))", timeout=60)["stdout"]
    finally:
        ks.shutdown()
        H.reap(H.TAG_VAR, session)
    rows = json.loads(out[out.index("SPLIT") + 5 :].strip().splitlines()[0])
    parts = [parts_of(timings, stamps) for timings, stamps in rows]
    medians = {key: 1000 * statistics.median(p[key] for p in parts) for _, key in PARTS}
    return {"n": n, "tracking": tracking, "launches": len(parts), "median_ms": medians}


def render(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    heads = [f"{r['n']} ranks, tracking {'on' if r['tracking'] else 'off'}" for r in rows]
    lines = [
        "",
        "## Where a warm air_magic launch spends its time (medians, ms)",
        "",
        "From `Launch.timings` (kernel, helper) and `time.monotonic()` stamps in the ranks (one clock "
        "for every process).  Parts overlap a little across ranks, so they do not add up exactly; "
        "'the rest' is the total minus the parts.",
        "",
        "| part | " + " | ".join(heads) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for label, key in PARTS:
        lines.append(f"| {label} | " + " | ".join(f"{r['median_ms'][key]:.1f}" for r in rows) + " |")
    lines.append("| launches measured | " + " | ".join(str(r["launches"]) for r in rows) + " |")
    return lines
