#!/usr/bin/env python3
"""Ctrl-C at random points of a pool's training: how often the pool stays intact.

    .venv/bin/python benchmarks/pool/interrupts.py [--tries 100] [--kinds ddp,fsdp2] [--seed 0]

For each kind (a DDP-wrapped MLP, an MLP sharded with FSDP2's ``fully_shard``), one real
IPython kernel (jupyter_client, as a notebook drives it) starts a pool of 2 CPU ranks (gloo),
builds the model on them, and then ``--tries`` times: runs a pool cell that trains without end,
waits a random 0.05–1.5 s, interrupts the kernel as Jupyter's stop button does, and reads what
the cell said.  A try is

* ``intact`` when the cell ended with the pool's KeyboardInterrupt ("... the pool and its state
  are intact") and the next pool cell trains two more steps on the same model;
* ``finished`` (a kind of intact) when, besides, a rank had been left inside a collective its
  peer had abandoned and the peer made it too (the cell's note says so);
* ``broken`` otherwise: the pool was broken or the next cell failed (its text is kept, and the
  pool is made again for the next try).

It also counts the tries that changed how many more optimizer steps one rank had taken than
the other (a rank stopped just after ``opt.step()``, its peer just before): an interrupt stops
each rank where it finds it.

Writes ``results/interrupts.json`` and ``results/interrupts.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(ROOT / "tests"))

from harness import Kernel  # noqa: E402  (the test suite's notebook-like kernel driver)
from pool_training import CHECK, INTACT, SETUP, TRAIN  # noqa: E402  (the cells its test runs too)


def start(kind: str, workdir: str) -> Kernel:
    kernel = Kernel(workdir)
    kernel.ok("%load_ext air_magic")
    kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
    kernel.ok(SETUP[kind], timeout=120)
    return kernel


def one_try(kernel: Kernel, rng: random.Random) -> dict[str, Any]:
    msg_id = kernel.execute(TRAIN)
    wait = rng.uniform(0.05, 1.5)
    time.sleep(wait)
    began = time.monotonic()
    kernel.km.interrupt_kernel()
    res = kernel.collect(msg_id, timeout=120)
    seconds = time.monotonic() - began
    error = res.error or {}
    said = f"{error.get('ename')}: {error.get('evalue')}"
    text = res.error_text if res.error else "(no error)"
    outcome: dict[str, Any] = {"wait": round(wait, 3), "seconds": round(seconds, 3)}
    if error.get("ename") != "KeyboardInterrupt" or error.get("evalue") != INTACT:
        return {**outcome, "result": "broken", "said": said, "text": text[-3000:]}
    check_id = kernel.execute(CHECK)
    try:
        check = kernel.collect(check_id, timeout=60)
    except TimeoutError:
        kernel.km.interrupt_kernel()
        late = kernel.collect(check_id, timeout=120)
        return {**outcome, "result": "broken", "said": "the next cell hung: " + late.error_text[-3000:], "text": text}
    if check.error is not None:
        return {**outcome, "result": "broken", "said": "the next cell: " + check.error_text[-3000:], "text": text}
    steps = json.loads(check.result.replace("'", '"')) if check.result else []
    finished = "made it too, on zeros" in text or "made them too, on zeros" in text
    gap = max(steps) - min(steps) if steps else 0
    return {
        **outcome,
        "result": "finished" if finished else "intact",
        "gap": gap,
        **({"said_before": text[-3000:]} if finished or seconds > 0.5 else {}),
    }


def run_kind(kind: str, tries: int, rng: random.Random) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="am-interrupts-") as workdir:
        kernel = start(kind, workdir)
        try:
            gap = 0  # how many more optimizer steps one rank has taken than the other, before this try
            for n in range(tries):
                outcome = one_try(kernel, rng)
                outcome["steps_differ"] = outcome.get("gap", gap) != gap
                gap = outcome.get("gap", 0)
                found.append(outcome)
                print(f"{kind} {n + 1:3d}/{tries}: {outcome['result']:8s} after {outcome['seconds']:.2f} s", flush=True)
                if outcome["result"] == "broken":
                    print("   ", outcome["said"][:400], flush=True)
                    kernel.ok("%distributed_pool --stop")
                    kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
                    kernel.ok(SETUP[kind], timeout=120)
                    gap = 0
        finally:
            kernel.run("%distributed_pool --stop")
            kernel.shutdown()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=100)
    parser.add_argument("--kinds", default="ddp,fsdp2")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    results: dict[str, Any] = {
        "machine": f"{platform.platform()}, {platform.processor() or platform.machine()}",
        "tries": args.tries,
        "kinds": {},
    }
    for kind in args.kinds.split(","):
        found = run_kind(kind, args.tries, rng)
        counts = {r: sum(1 for f in found if f["result"] == r) for r in ("intact", "finished", "broken")}
        seconds = sorted(f["seconds"] for f in found)
        results["kinds"][kind] = {
            **counts,
            "steps_differ": sum(1 for f in found if f.get("steps_differ")),
            "median_seconds": seconds[len(seconds) // 2],
            "max_seconds": seconds[-1],
            "broken_said": [f["said"] for f in found if f["result"] == "broken"],
            # what the interrupted cell itself said, for each broken try and each slow or finished one
            "cells_said": [
                {"try": n + 1, "result": f["result"], "text": f.get("text") or f.get("said_before")}
                for n, f in enumerate(found)
                if f["result"] != "intact" or f.get("said_before")
            ],
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "interrupts.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"Ctrl-C at a random point (0.05–1.5 s) of a pool's training, 2 CPU ranks (gloo), {args.tries} tries each.",
        "",
        "| training | intact | of which a collective was finished | broken | tries that left the ranks a step apart | median / max answer |",
        "|---|---|---|---|---|---|",
    ]
    for kind, info in results["kinds"].items():
        lines.append(
            f"| {kind} | {info['intact'] + info['finished']} | {info['finished']} | {info['broken']} "
            f"| {info['steps_differ']} | {info['median_seconds']:.2f} s / {info['max_seconds']:.2f} s |"
        )
    (RESULTS / "interrupts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
