#!/usr/bin/env python3
"""One model, whatever stops it: interrupts at random times in a pool's training, counted.

    .venv/bin/python benchmarks/consistency/run.py [--tries 100] [--kinds ddp,fsdp2]
        [--modes ctrl-c,q-before-backward,q-before-step] [--busy 0] [--seed 0]

For each kind of training (``tests/pool_training.py``: PyTorch's DDP example's ToyModel, a
Transformer sharded with FSDP2 as PyTorch's FSDP2 example shards its own), one real IPython
kernel (jupyter_client, driven as JupyterLab drives it) starts a pool of 2 CPU ranks (gloo) and
builds the model.  Each try then stops the training one way, chosen in turn:

* ``ctrl-c``: the training cell runs for a random 0.1-1.5 s, then the kernel is interrupted
  as Jupyter's stop button does;
* ``q-before-backward`` / ``q-before-step``: a ``breakpoint()`` on a random rank, a random
  0-5 steps on, placed before ``loss.backward()`` or after it and before ``opt.step()``;
  the prompt is answered ``q``.

After each try a cell reads every rank's state, trains 10 more steps and reads it again.  A try
is **consistent** when both reads show equal step counts (the loop's and Adam's), equal
replicated weights, every FSDP2 parameter a DTensor, and the 10 steps ran on every rank with a
finite loss.  The cell's own word is counted beside it: "intact" (the pool's check found the
ranks equal), "differs" (it named what differs), or "broken".  The seconds from the interrupt
(or the ``q``) to the cell's end are measured.  ``--busy N`` runs N busy loops beside it.

Writes ``results/consistency.json`` and ``results/consistency.md``.
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing
import platform
import random
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

from harness import Kernel  # noqa: E402  (the test suite's notebook-like kernel driver)
from pool_training import CHECK, INTACT, SETUP, TRAIN, consistent  # noqa: E402

MODES = ("ctrl-c", "q-before-backward", "q-before-step")


def start(kind: str, workdir: str) -> Kernel:
    kernel = Kernel(workdir)
    kernel.ok("%load_ext air_magic")
    kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
    kernel.ok(SETUP[kind], timeout=120)
    return kernel


def stop_training(kernel: Kernel, mode: str, rng: random.Random) -> tuple[Any, float]:
    """Run the training cell and stop it as ``mode`` says; its result and the seconds from the
    interrupt (or the q) to its end."""
    if mode == "ctrl-c":
        msg_id = kernel.execute(TRAIN)
        time.sleep(rng.uniform(0.1, 1.5))
        began = time.monotonic()
        kernel.km.interrupt_kernel()
        res = kernel.collect(msg_id, timeout=120)
        return res, time.monotonic() - began
    where = mode.removeprefix("q-").replace("-", "_")
    rank, ahead = rng.randrange(2), rng.randrange(6)
    kernel.ok(f"%%distributed --pool\nstop = ({rank}, steps + {ahead}, {where!r})")
    quit_at: list[float] = []

    def answer(prompt: str, res: Any) -> str:
        quit_at.append(time.monotonic())
        return "q"

    res = kernel.run_with_stdin(TRAIN, answer, timeout=120)
    return res, time.monotonic() - (quit_at[0] if quit_at else time.monotonic())


def one_try(kernel: Kernel, mode: str, rng: random.Random) -> dict[str, Any]:
    res, seconds = stop_training(kernel, mode, rng)
    error = res.error or {}
    evalue = str(error.get("evalue", ""))
    if error.get("ename") != "KeyboardInterrupt":
        said = "no error" if not error else "other"
    elif evalue == INTACT:
        said = "intact"
    elif "their state differs" in evalue:
        said = "differs"
    elif "broken" in evalue:
        said = "broken"
    else:
        said = "intact" if "your names are kept" in evalue else "other"
    outcome: dict[str, Any] = {"mode": mode, "said": said, "seconds": round(seconds, 3)}
    if said in ("broken", "other", "no error"):
        outcome["text"] = res.error_text[-3000:] if res.error else res.stdout[-2000:]
    check_id = kernel.execute(CHECK)
    try:
        check = kernel.collect(check_id, timeout=120)
    except TimeoutError:
        kernel.km.interrupt_kernel()
        late = kernel.collect(check_id, timeout=120)
        return {**outcome, "consistent": False, "why": "the next cell hung: " + late.error_text[-2000:]}
    if check.error is not None:
        return {**outcome, "consistent": False, "why": "the next cell failed: " + check.error_text[-2000:]}
    values = ast.literal_eval(check.result or "[]")
    why = consistent(values)
    return {**outcome, "consistent": not why, "why": why, "regrouped": "rebuilt" in res.error_text}


def busy() -> None:
    while True:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--tries", type=int, default=100, help="tries per kind and mode")
    parser.add_argument("--kinds", default="ddp,fsdp2")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--busy", type=int, default=0, help="busy loops beside it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="consistency")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    loops = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.busy)]
    for loop in loops:
        loop.start()
    results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {multiprocessing.cpu_count()} cores",
        "busy": args.busy,
        "tries": {},
    }
    try:
        for kind in args.kinds.split(","):
            rng = random.Random(f"{args.seed}-{kind}")
            with tempfile.TemporaryDirectory() as workdir:
                kernel = start(kind, workdir)
                try:
                    found: list[dict[str, Any]] = []
                    modes = args.modes.split(",")
                    for n in range(args.tries * len(modes)):
                        mode = modes[n % len(modes)]
                        outcome = one_try(kernel, mode, rng)
                        found.append(outcome)
                        print(kind, n, json.dumps(outcome)[:300], flush=True)
                        if outcome["said"] in ("broken", "other") or not outcome["consistent"]:
                            kernel.run("%distributed_pool --restart", timeout=180)
                            kernel.ok(SETUP[kind], timeout=120)
                    results["tries"][kind] = found
                finally:
                    kernel.shutdown()
    finally:
        for loop in loops:
            loop.terminate()
    (RESULTS / f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"Machine: {results['machine']}; {args.busy} busy loop(s) beside it.",
        "",
        "| training | stopped by | tries | consistent | said intact | said differs | broken | "
        "cell's end: median / p95 / max (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, found in results["tries"].items():
        for mode in args.modes.split(","):
            rows = [f for f in found if f["mode"] == mode]
            if not rows:
                continue
            secs = sorted(f["seconds"] for f in rows)
            p95 = secs[min(len(secs) - 1, int(0.95 * len(secs)))]
            lines.append(
                f"| {kind} | {mode} | {len(rows)} | {sum(f['consistent'] for f in rows)} | "
                f"{sum(f['said'] == 'intact' for f in rows)} | {sum(f['said'] == 'differs' for f in rows)} | "
                f"{sum(f['said'] in ('broken', 'other') for f in rows)} | "
                f"{statistics.median(secs):.2f} / {p95:.2f} / {secs[-1]:.2f} |"
            )
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
