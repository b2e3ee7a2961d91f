#!/usr/bin/env python3
"""Why is it stuck: how soon the hang report comes, whether it ever comes when nothing hangs,
and what torch's Flight Recorder costs.

    .venv/bin/python benchmarks/hang/run.py [--samples 10] [--runs 100] [--pause 60] [--only PART] [--quick]

* ``detection``: a real kernel (jupyter_client, as a notebook drives it) with a pool of 2 and
  of 4 CPU ranks and the default ``AIR_MAGIC_HANG_SECONDS`` (5); each cell makes two
  all_reduces on every rank, then rank 1 writes ``time.time()`` and skips the third, which
  the others make.  Seconds from that line (the last collective completed) to the front end's
  display of the report (``--samples`` cells each), then Ctrl-C (the pool stays); ranks that
  disagree (all_reduce against broadcast), the same way; and rank 1 ending the call where the
  others make a third all_reduce (``--samples`` cells); a training step that rank 1 skips
  while its peers wait in the collective the framework issued from a hook (DDP's gradient
  all-reduce, FSDP2's all-gather, DeepSpeed ZeRO-2's all-reduce); and the same DDP skip in a
  launch (a ``%%distributed`` cell) and under ``air-magic run`` (its stderr as it comes).
* ``false reports``: ``--runs`` pool cells of ``--pause`` seconds (60) at the default
  ``AIR_MAGIC_HANG_SECONDS`` (5), a third each: every rank computing (matmuls) between two
  all_reduces; a rank paused in the debugger while its peer waits in an all_reduce (answered
  ``c`` after the pause); all_reduces of 65,536 floats that complete, one after another, for the
  pause.  A report in any of them is a false one.
* ``recording``: 1,000 all_reduces of 1,024 floats on 2 ranks (the median of 10 blocks, rank 0),
  recorder on (``TORCH_FR_BUFFER_SIZE=2000``, air_magic's default) and off, alternated, 10 runs
  each: under ``air-magic run``, and as two bare torch processes pinned to a core each; and
  ``benchmarks/training/train.py``'s DDP training (2,000 steps), on and off alternated, 5 each.

* ``side-by-side``: the same two costs with the machine's drift taken out: two pools of 2 ranks
  alive at once, recorder on in one and off in the other, blocks alternated (``--pairs``, 60):
  1,000 all_reduces of 1,024 floats, and 200 steps of the quickstart's model (DDP); the median of
  the pairs' on/off ratios, with a 95 % bootstrap interval; as the scheduler places the ranks,
  pinned to a core each, and (pinned) as two bare torch worlds without air_magic: torch's
  recorder alone.

* ``side-by-side-control``: the pinned pools again with the recorder off in both: what the method
  says of two equal pools (the first one started takes the "on" place).

* ``crossover``: the pinned side by side twice, with fresh pools each time: the recorder-on pool
  started first, then second, so that whatever the order costs falls on each side once; the
  cost is the median of both halves' pairs.

* ``components``: the recording's two parts, each where it is large enough to see: what the
  recorder adds to one collective (two 1-rank pools side by side, blocks of 5,000 all_reduces),
  what a rank spends on the hang watch's look (once a second), and the collectives and seconds of
  one training step: the training's cost from them.  ``--steps N --work steps`` gives the
  crossover longer training blocks.

``--only PART`` runs one part (detection, false-reports, recording, training, side-by-side,
side-by-side-control, crossover, components) and keeps the others' last results.  Writes ``results/hang.json`` and ``results/hang.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(ROOT / "tests"))

from harness import CellResult, Kernel  # noqa: E402  (the test suite's notebook-like kernel driver)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


def reported(res: CellResult) -> bool:
    return any(str(d.get("text/plain", "")).startswith("[air_magic] hang report:") for _, d, _ in res.displays)


def verdict(res: CellResult) -> str:
    for _, data, _ in reversed(res.displays):
        text = str(data.get("text/plain", ""))
        if text.startswith("[air_magic] hang report:"):
            return text.splitlines()[0]
    return ""


SKIP = """%%distributed --pool
t = torch.ones(1024)
dist.all_reduce(t)
dist.all_reduce(t)
if dist.get_rank() == 1:
    open({mark!r}, "w").write(repr(time.time()))
    time.sleep(120)
else:
    dist.all_reduce(t)"""

DISAGREE = """%%distributed --pool
t = torch.ones(1024)
dist.all_reduce(t)
if dist.get_rank() == 1:
    open({mark!r}, "w").write(repr(time.time()))
    dist.broadcast(torch.ones(16), src=1)
else:
    dist.all_reduce(t)"""


ENDED = """%%distributed --pool
t = torch.ones(1024)
dist.all_reduce(t)
dist.all_reduce(t)
if dist.get_rank() == 1:
    open({mark!r}, "w").write(repr(time.time()))
else:
    dist.all_reduce(t)"""


# Hooks' collectives: rank 1 skips a training step (its peers wait in the collective the
# framework issued from backward() or forward(): DDP's gradient all-reduce, FSDP2's all-gather,
# DeepSpeed's all-reduce).
FRAMEWORKS = """%%distributed --pool
import torch.nn as nn, torch.nn.functional as F, deepspeed
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
ddp = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
fsdp = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
for layer in fsdp:
    fully_shard(layer)
fully_shard(fsdp)
fsdp_opt = torch.optim.SGD(fsdp.parameters(), lr=0.01)
net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2}}
engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
def train(name):
    if name == "ddp":
        ddp_opt.zero_grad(); ddp(torch.randn(8, 64)).sum().backward(); ddp_opt.step()
    elif name == "fsdp2":
        fsdp_opt.zero_grad(); fsdp(torch.randn(8, 64)).sum().backward(); fsdp_opt.step()
    else:
        engine.backward(F.mse_loss(engine(torch.randn(4, 64)), torch.randn(4, 4))); engine.step()
"""

HOOKED = """%%distributed --pool
for i in range(3):
    if dist.get_rank() == 1 and i == 2:
        open({mark!r}, "w").write(repr(time.time()))
        continue
    train({name!r})"""


def detection(n: int, samples: int, workdir: str) -> dict[str, Any]:
    kernel = Kernel(tempfile.mkdtemp(dir=workdir), {"DS_ACCELERATOR": "cpu"})
    mark = os.path.join(kernel.workdir, "mark")
    out: dict[str, Any] = {}
    try:
        kernel.ok("%load_ext air_magic\n%config DistributedMagics.tracking = False")
        kernel.ok(f"%distributed_pool -n {n} --no-tracking", timeout=300)
        kernel.ok("%%distributed --pool\nimport time, torch, torch.distributed as dist", timeout=120)
        kernel.ok(FRAMEWORKS, timeout=600)
        hangs = 0
        for name, cell, count in (
            ("skip", SKIP, samples),
            ("disagree", DISAGREE, max(3, samples // 2)),
            ("ended", ENDED, samples),
            ("DDP step skipped", HOOKED.replace("{name!r}", repr("ddp")), samples),
            ("FSDP2 step skipped", HOOKED.replace("{name!r}", repr("fsdp2")), samples),
            ("DeepSpeed step skipped", HOOKED.replace("{name!r}", repr("deepspeed")), samples),
        ):
            seconds, verdicts, outcomes = [], [], []
            for _ in range(count):
                if os.path.exists(mark):
                    os.unlink(mark)
                msg_id = kernel.execute(cell.format(mark=mark))
                res = kernel.collect(msg_id, timeout=120, until=reported)
                seen = time.time()
                seconds.append(seen - float(Path(mark).read_text()))
                verdicts.append(verdict(res))
                kernel.km.interrupt_kernel()
                end = kernel.collect(msg_id, timeout=120)
                outcomes.append(end.error["evalue"] if end.error else "no error")
                if "broken" in outcomes[-1]:
                    print("   BROKEN:", end.error_text[-3000:], flush=True)
                hangs += 1
                if hangs % 4 == 0 or "broken" in outcomes[-1]:
                    # A pool's groups can be rebuilt 5 times (torch's backend types): fresh ranks.
                    kernel.ok("%distributed_pool --restart", timeout=300)
                    kernel.ok("%%distributed --pool\nimport time, torch, torch.distributed as dist", timeout=120)
                    kernel.ok(FRAMEWORKS, timeout=600)
                kernel.ok("%%distributed --pool\nt = torch.ones(2); dist.all_reduce(t); t.tolist()", timeout=60)
            out[name] = {
                "seconds": seconds,
                "median": statistics.median(seconds),
                "p95": p95(seconds),
                "verdicts": sorted(set(verdicts)),
                "after_ctrl_c": sorted(set(outcomes)),
            }
            print(f"  {n} ranks, {name}: median {out[name]['median']:.2f} s, p95 {out[name]['p95']:.2f} s", flush=True)
    finally:
        kernel.km.shutdown_kernel(now=True)
    return out


# DDP training from outside code's shape: rank 1 skips a step, then both reach the final
# barrier: rank 0 waits in DDP's gradient all-reduce, rank 1 in the barrier.
DDP_SCRIPT = """import os, sys, time, torch, torch.nn as nn, torch.distributed as dist
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)))
opt = torch.optim.SGD(model.parameters(), lr=0.001)
for i in range(6):
    if dist.get_rank() == 1 and i == 3:
        open(sys.argv[1], "w").write(repr(time.time()))
        continue
    opt.zero_grad()
    nn.MSELoss()(model(torch.randn(20, 10)), torch.randn(20, 5)).backward()
    opt.step()
dist.barrier()
"""


def detection_outside(n: int, samples: int, workdir: str) -> dict[str, Any]:
    """A DDP step skipped in a launch (a kernel's ``%%distributed`` cell) and under
    ``air-magic run`` (its stderr read as it comes): seconds from the skip to the report."""
    out: dict[str, Any] = {}
    folder = tempfile.mkdtemp(dir=workdir)
    script = os.path.join(folder, "train.py")
    Path(script).write_text(DDP_SCRIPT)
    mark = os.path.join(folder, "mark")
    kernel = Kernel(tempfile.mkdtemp(dir=workdir))
    try:
        kernel.ok("%load_ext air_magic\n%config DistributedMagics.tracking = False")
        cell = f"%%distributed -n {n} -- {mark}\n" + DDP_SCRIPT
        seconds = []
        for _ in range(samples):
            if os.path.exists(mark):
                os.unlink(mark)
            msg_id = kernel.execute(cell)
            kernel.collect(msg_id, timeout=120, until=reported)
            seconds.append(time.time() - float(Path(mark).read_text()))
            kernel.km.interrupt_kernel()
            kernel.collect(msg_id, timeout=120)
        out["launch, DDP step skipped"] = {
            "seconds": seconds,
            "median": statistics.median(seconds),
            "p95": p95(seconds),
        }
    finally:
        kernel.km.shutdown_kernel(now=True)
    seconds = []
    for _ in range(samples):
        if os.path.exists(mark):
            os.unlink(mark)
        command = [sys.executable, "-m", "air_magic.cli", "run", "-n", str(n), "--no-tracking", script, "--", mark]
        proc = subprocess.Popen(command, cwd=folder, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                if line.startswith("[air_magic] hang report:"):
                    seconds.append(time.time() - float(Path(mark).read_text()))
                    break
        finally:
            proc.send_signal(2)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    out["air-magic run, DDP step skipped"] = {
        "seconds": seconds,
        "median": statistics.median(seconds),
        "p95": p95(seconds),
    }
    for name, data in out.items():
        data["verdicts"], data["after_ctrl_c"] = [], []
        print(f"  {n} ranks, {name}: median {data['median']:.2f} s, p95 {data['p95']:.2f} s", flush=True)
    return out


PAUSE = """%%distributed --pool
t = torch.ones(64)
dist.all_reduce(t)
torch.set_num_threads(1)
began, a = time.time(), torch.rand(256, 256)
while time.time() - began < {pause}:
    a = torch.tanh(a @ a)
dist.all_reduce(t)"""

DEBUG = """%%distributed --pool
t = torch.ones(64)
if dist.get_rank() == 1:
    breakpoint()
dist.all_reduce(t)"""

# Rank 0 says when to stop inside the collective itself, so every rank makes the same number.
PROGRESS = """%%distributed --pool
t, began, go = torch.ones(1 << 16), time.time(), 1.0
while go:
    t[0] = float(time.time() - began < {pause}) if dist.get_rank() == 0 else 1.0
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    go = t[0].item()"""


def false_reports(runs: int, pause: float, hang_seconds: str, workdir: str) -> dict[str, Any]:
    kernel = Kernel(tempfile.mkdtemp(dir=workdir), {"AIR_MAGIC_HANG_SECONDS": hang_seconds})
    counts = {"compute pause": [0, 0], "debugger pause": [0, 0], "collectives that progress": [0, 0]}
    began = time.time()
    try:
        kernel.ok("%load_ext air_magic\n%config DistributedMagics.tracking = False")
        kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=300)
        kernel.ok("%%distributed --pool\nimport time, torch, torch.distributed as dist", timeout=120)
        for i in range(runs):
            kind = list(counts)[i % 3]
            if kind == "debugger pause":

                def answer(prompt: str, res: Any) -> str:
                    time.sleep(pause)
                    return "c"

                res = kernel.run_with_stdin(DEBUG, answer, timeout=pause + 120)
            else:
                cell = PAUSE if kind == "compute pause" else PROGRESS
                res = kernel.run(cell.format(pause=pause), timeout=pause + 120)
            assert res.error is None, res.error_text
            counts[kind][0] += 1
            counts[kind][1] += reported(res)
            if reported(res):
                print(f"  FALSE REPORT in run {i} ({kind}): {verdict(res)}", flush=True)
    finally:
        kernel.km.shutdown_kernel(now=True)
    for kind, (made, false) in counts.items():
        print(f"  {kind}: {false} false reports in {made} runs", flush=True)
    out: dict[str, Any] = {kind: {"runs": made, "false_reports": false} for kind, (made, false) in counts.items()}
    out["settings"] = {"pause_s": pause, "AIR_MAGIC_HANG_SECONDS": hang_seconds, "took_s": time.time() - began}
    return out


RECORD = """import os, sys, time, torch, torch.distributed as dist
if os.environ.get("PIN_RANKS"):
    os.sched_setaffinity(0, {int(os.environ["RANK"]) % os.cpu_count()})
dist.init_process_group("gloo")
t = torch.ones(1024)
for _ in range(200):
    dist.all_reduce(t)
blocks = []
for _ in range(10):
    began = time.perf_counter()
    for _ in range(1000):
        dist.all_reduce(t)
    blocks.append(time.perf_counter() - began)
if dist.get_rank() == 0:
    print("TOOK", sorted(blocks)[len(blocks) // 2], flush=True)
"""


def _bare(script: Path, env: dict[str, str], port: int) -> str:
    """Two ranks started here, without air_magic: torch's recorder alone."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=dict(env, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return outs[0]


def recording(runs: int, workdir: str) -> dict[str, Any]:
    """1,000 all_reduces of 1,024 floats on 2 ranks, the median of 10 blocks on rank 0, recorder on and
    off alternated: under ``air-magic run`` (what a user gets: the recorder and the hang watch's
    looks), and as two bare torch processes pinned to a core each (the recorder alone; pinning keeps
    the scheduler's noise out of a few-percent difference)."""
    script = Path(workdir) / "record.py"
    script.write_text(RECORD)
    out: dict[str, Any] = {}
    for way in ("air-magic run", "torch alone, pinned"):
        took: dict[str, list[float]] = {"on": [], "off": []}
        for i in range(2 * runs):
            mode = "on" if i % 2 == 0 else "off"
            env = dict(os.environ)
            env.pop("TORCH_FR_BUFFER_SIZE", None)
            if way == "air-magic run":
                env["AIR_MAGIC_FLIGHT_RECORDER"] = "2000" if mode == "on" else "0"
                stdout = subprocess.run(
                    [sys.executable, "-m", "air_magic.cli", "run", str(script), "-n", "2", "--no-tracking"],
                    cwd=workdir,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                ).stdout
            else:
                env["PIN_RANKS"] = "1"
                if mode == "on":
                    env["TORCH_FR_BUFFER_SIZE"] = "2000"
                stdout = _bare(script, env, 29400 + i)
            line = next(line for line in stdout.splitlines() if line.startswith("TOOK"))
            took[mode].append(float(line.split()[1]))
        ratios = [on / off for on, off in zip(took["on"], took["off"])]
        on, off = statistics.median(took["on"]), statistics.median(took["off"])
        out[way] = {
            "on_s": took["on"],
            "off_s": took["off"],
            "median_on": on,
            "median_off": off,
            "ratio": on / off,
            "pair_ratios": ratios,
            "median_pair_ratio": statistics.median(ratios),
        }
        print(
            f"  {way}: on {on * 1000:.0f} ms, off {off * 1000:.0f} ms per 1,000, ratio {on / off:.3f} "
            f"(median of pairs {statistics.median(ratios):.3f})",
            flush=True,
        )
    return out


SIDE_SETUP = """
global t, model, opt, batches, loss_fn
import os, torch, torch.nn as nn
if os.environ.get("PIN_RANKS"):  # every thread of rank r on core r: the scheduler's noise out
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), {int(os.environ["RANK"]) % os.cpu_count()})
from torch.nn.parallel import DistributedDataParallel as DDP
t = torch.ones(1024)
torch.manual_seed(0)
# The quickstart's model (notebooks/quickstart.ipynb: SimpleMLP, DDP, Adam, MSE), batches of 32.
model = DDP(nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.ReLU(),
                          nn.Dropout(0.2), nn.Linear(64, 1)))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
batches = [(torch.randn(32, 10), torch.randn(32, 1)) for _ in range(16)]
loss_fn = nn.MSELoss()
"""


def _all_reduces(n: int) -> float:
    import time

    import torch.distributed as dist

    began = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t)  # noqa: F821 - the pool's namespace (SIDE_SETUP)
    return time.perf_counter() - began


def _steps(n: int) -> float:
    import time

    began = time.perf_counter()
    for step in range(n):
        x, y = batches[step % len(batches)]  # noqa: F821 - the pool's namespace (SIDE_SETUP)
        opt.zero_grad()  # noqa: F821
        loss = loss_fn(model(x), y)  # noqa: F821
        loss.backward()
        opt.step()  # noqa: F821
    return time.perf_counter() - began


def _median_ci(ratios: list[float], rounds: int = 2000) -> tuple[float, float, float]:
    """The median of ``ratios`` and a 95 % bootstrap interval of it (a fixed seed: the same
    ratios give the same interval)."""
    import random

    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(rounds))
    return statistics.median(ratios), medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


def side_worker(mode: str) -> None:
    """One of the two pools of :func:`side_by_side` (a process of its own: a kernel keeps one
    pool): reads ``WORK N`` lines, runs that work on the pool, answers ``TOOK seconds``."""
    import air_magic

    os.environ["AIR_MAGIC_FLIGHT_RECORDER"] = "2000" if mode == "on" else "0"
    pool = air_magic.Pool(int(os.environ.get("SIDE_RANKS", "2")), tracking=False)
    try:
        pool.run(lambda: exec(SIDE_SETUP, globals()))
        recorded = pool.run(lambda: os.environ.get("TORCH_FR_BUFFER_SIZE"))[0]
        print(f"READY {recorded}", flush=True)
        works = {"all_reduces": _all_reduces, "steps": _steps}
        for line in sys.stdin:
            what, n = line.split()
            print(f"TOOK {pool.run(works[what], int(n))[0]}", flush=True)
    finally:
        pool.close()


def bare_rank(mode: str, rank: int, port: int) -> None:
    """A rank of a bare torch world (no air_magic) for :func:`side_by_side`'s torch-alone rows:
    the recorder alone on or off; reads ``WORK N`` lines, answers ``TOOK seconds``."""
    # One thread each, as air_magic gives 2 CPU ranks on 2 cores.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1"
    )
    os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    if mode == "on":
        os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    exec(SIDE_SETUP, globals())
    print(f"READY {os.environ.get('TORCH_FR_BUFFER_SIZE')}", flush=True)
    works = {"all_reduces": _all_reduces, "steps": _steps}
    for line in sys.stdin:
        what, n = line.split()
        print(f"TOOK {works[what](int(n))}", flush=True)
    dist.destroy_process_group()


def side_by_side(
    pairs: int,
    pinned: bool = False,
    bare: bool = False,
    control: bool = False,
    first: str = "on",
    steps: int = 200,
    works: tuple[str, ...] = (),
    ranks: int = 2,
    reduces: int = 1000,
) -> dict[str, Any]:
    """Two pools of 2 CPU ranks alive at once (each driven by a process of its own), recorder on
    in one and off in the other; blocks of work alternate between them (on, off, off, on, ...:
    neither always first), so the machine's drift falls on both alike.  Each block's time is
    rank 0's; the cost is the median of the pairs' on/off ratios, with a 95 % bootstrap interval.
    ``control``: the recorder off in both (what the method says of two equal pools: the first
    one started is "on").  ``first``: which pool is started first (and answers first when both
    are asked at once).  ``steps``: training steps a block; ``works``: only these
    (``all_reduces``, ``steps``); ``ranks``: each pool's (1: the recorder's own cost per
    collective, no peer to wait for); ``reduces``: all_reduces a block."""
    env = dict(os.environ, SIDE_RANKS=str(ranks))
    if pinned:
        env["PIN_RANKS"] = "1"
    real = {"on": "off" if control else "on", "off": "off"}
    order = ("on", "off") if first == "on" else ("off", "on")

    def start(*args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, __file__, *args],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

    if bare:  # each world two processes; rank 0's answer is the block's time
        workers = {
            mode: [start("--bare-rank", real[mode], str(rank), str(29700 + 10 * index)) for rank in (0, 1)]
            for index, mode in enumerate(order)
        }
    else:
        workers = {mode: [start("--side-worker", real[mode])] for mode in order}

    def ask(mode: str, what: str, n: int) -> float:
        for worker in workers[mode]:
            assert worker.stdin is not None
            worker.stdin.write(f"{what} {n}\n")
            worker.stdin.flush()
        answers = []
        for worker in workers[mode]:
            assert worker.stdout is not None
            answers.append(float(worker.stdout.readline().split()[1]))
        return answers[0]

    out: dict[str, Any] = {}
    try:
        for mode, started in workers.items():
            for worker in started:
                assert worker.stdout is not None
                line = worker.stdout.readline()
                if not line.startswith("READY"):
                    raise SystemExit(f"the {mode} world did not start")
                out.setdefault("TORCH_FR_BUFFER_SIZE", {})[mode] = line.split()[1]
        for what, work, n in (
            (f"{reduces:,} all_reduces of 1,024 floats", "all_reduces", reduces),
            (f"{steps:,} training steps", "steps", steps),
        ):
            if works and work not in works:
                continue
            for mode in workers:  # warm
                ask(mode, work, n // 4)
            took: dict[str, list[float]] = {"on": [], "off": []}
            for i in range(pairs):
                for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    took[mode].append(ask(mode, work, n))
            ratios = [on / off for on, off in zip(took["on"], took["off"])]
            median, low, high = _median_ci(ratios)
            out[what] = {
                "on_s": took["on"],
                "off_s": took["off"],
                "median_on": statistics.median(took["on"]),
                "median_off": statistics.median(took["off"]),
                "median_pair_ratio": median,
                "ci95": [low, high],
            }
            print(
                f"  {what}: on {statistics.median(took['on']) * 1000:.0f} ms, off "
                f"{statistics.median(took['off']) * 1000:.0f} ms (medians of {pairs}); pairs' on/off median "
                f"{median:.4f}, 95 % interval {low:.4f}-{high:.4f}",
                flush=True,
            )
    finally:
        for started in workers.values():
            for worker in started:
                assert worker.stdin is not None
                worker.stdin.close()
        for started in workers.values():
            for worker in started:
                try:
                    worker.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    worker.kill()
    return out


def crossover(pairs: int, steps: int = 200, works: tuple[str, ...] = ()) -> dict[str, Any]:
    """:func:`side_by_side` (pinned) twice, with fresh pools: the recorder-on pool started first,
    then second.  A cost that follows the order the pools started in (the method's own) falls on
    "on" in one half and on "off" in the other; the pairs of both halves together give the cost."""
    halves = {first: side_by_side(pairs, pinned=True, first=first, steps=steps, works=works) for first in ("on", "off")}
    out: dict[str, Any] = {"halves": halves}
    for what in halves["on"]:
        if not isinstance(halves["on"][what], dict) or "on_s" not in halves["on"][what]:
            continue
        on = halves["on"][what]["on_s"] + halves["off"][what]["on_s"]
        off = halves["on"][what]["off_s"] + halves["off"][what]["off_s"]
        ratios = [a / b for a, b in zip(on, off)]
        median, low, high = _median_ci(ratios)
        out[what] = {
            "on_s": on,
            "off_s": off,
            "median_on": statistics.median(on),
            "median_off": statistics.median(off),
            "median_pair_ratio": median,
            "ci95": [low, high],
            "halves": {first: halves[first][what]["median_pair_ratio"] for first in halves},
        }
        print(
            f"  {what}, both halves: pairs' on/off median {median:.4f}, 95 % interval {low:.4f}-{high:.4f} "
            f"(on started first {halves['on'][what]['median_pair_ratio']:.4f}, second "
            f"{halves['off'][what]['median_pair_ratio']:.4f})",
            flush=True,
        )
    return out


def _look(looks: int) -> float:
    """On a rank: the seconds of one answer to the hang watch's look (what the rank's thread
    does)."""
    import tempfile
    import time

    from air_magic.rank.inspect import collectives

    folder = tempfile.mkdtemp()
    began = time.perf_counter()
    for _ in range(looks):
        collectives.answer(folder, 0, "t", "q")
    shutil.rmtree(folder, ignore_errors=True)
    return (time.perf_counter() - began) / looks


def _enqueued() -> int:
    """On a rank: the collectives its recorder has seen enqueued, every group together."""
    from air_magic.rank.inspect import collectives

    found = collectives.dump("q") or {"groups": {}}
    return sum(group["enqueued"] for group in found["groups"].values())


def components(pairs: int) -> dict[str, Any]:
    """The recording's cost in its two parts, each measured where it is large enough to see:
    (1) what torch's recorder adds to one collective: two 1-rank pools (no peer to wait for:
    an all_reduce is the recorder's and gloo's own work, 29 µs), recorder on in one, off in the
    other, blocks of 5,000 alternated; (2) what a rank spends on the hang watch's look (once a
    second), and how many collectives a training step of the quickstart's model makes, in a
    2-rank pool, recorder on.  The cost for training is then
    extra per collective x collectives per step / step time + a look's seconds / 1 s."""
    out: dict[str, Any] = {
        "per_collective": side_by_side(pairs, pinned=True, ranks=1, reduces=5000, works=("all_reduces",))
    }
    import air_magic

    os.environ["AIR_MAGIC_FLIGHT_RECORDER"] = "2000"
    os.environ["PIN_RANKS"] = "1"
    pool = air_magic.Pool(2, tracking=False)
    try:
        pool.run(lambda: exec(SIDE_SETUP, globals()))
        look_s = pool.run(_look, 1000)[0]
        marks = [pool.run(_enqueued)[0], pool.run(_enqueued)[0]]  # (what a call itself makes, if any)
        pool.run(_steps, 200)
        marks.append(pool.run(_enqueued)[0])
        per_step = (marks[2] - marks[1] - 2 * (marks[1] - marks[0])) / 200
        step_s = statistics.median(pool.run(_steps, 200)[0] / 200 for _ in range(5))
    finally:
        pool.close()
        del os.environ["PIN_RANKS"]
    rec = next(v for v in out["per_collective"].values() if isinstance(v, dict) and "on_s" in v)
    extra = (rec["median_on"] - rec["median_off"]) / 5000
    high = (rec["ci95"][1] - 1) * rec["median_off"] / 5000
    out.update(
        look_s=look_s,
        collectives_per_step=per_step,
        step_s=step_s,
        extra_per_collective_s=extra,
        extra_per_collective_high_s=high,
        # a look each second (hangs.HangWatch's ``every``): look_s of each second is the rank's
        training_cost=max(extra, 0) * per_step / step_s + look_s / 1.0,
        training_cost_high=max(high, 0) * per_step / step_s + look_s / 1.0,
    )
    print(
        f"  per collective: {extra * 1e6:+.2f} µs (95 % interval's top {high * 1e6:+.2f} µs); a look "
        f"{look_s * 1e3:.3f} ms; {per_step:g} collectives a step of {step_s * 1e3:.2f} ms: training "
        f"{out['training_cost']:+.3%} (at most {out['training_cost_high']:+.3%})",
        flush=True,
    )
    return out


def training(runs: int, steps: int, workdir: str) -> dict[str, Any]:
    """``benchmarks/training/train.py`` (DDP on a small MLP, 2 CPU ranks) under ``air-magic run``,
    recorder on and off alternated: steps/s after the warm-up, the mean of the ranks."""
    script = ROOT / "benchmarks" / "training" / "train.py"
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * runs):
        mode = "on" if i % 2 == 0 else "off"
        out = Path(tempfile.mkdtemp(dir=workdir))
        env = dict(os.environ, AIR_MAGIC_FLIGHT_RECORDER="2000" if mode == "on" else "0")
        env.pop("TORCH_FR_BUFFER_SIZE", None)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "air_magic.cli",
                "run",
                str(script),
                "-n",
                "2",
                "--no-tracking",
                "--",
                "--kind",
                "ddp",
                "--steps",
                str(steps),
                "--out",
                str(out),
            ],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        ranks = [json.loads((out / f"rank-{r}.json").read_text())["steps_per_s"] for r in range(2)]
        rates[mode].append(statistics.mean(ranks))
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    print(f"  DDP training: on {on:.1f} steps/s, off {off:.1f} steps/s, cost {1 - on / off:+.1%}", flush=True)
    return {"on": rates["on"], "off": rates["off"], "median_on": on, "median_off": off, "cost": 1 - on / off}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"


PARTS = (
    "detection",
    "false-reports",
    "recording",
    "training",
    "side-by-side",
    "side-by-side-control",
    "crossover",
    "components",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--pause", type=float, default=60.0, help="seconds of each no-hang run (default 60)")
    parser.add_argument("--hang-seconds", default="5", help="AIR_MAGIC_HANG_SECONDS for the no-hang runs")
    parser.add_argument("--side-worker", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--bare-rank", nargs=3, metavar=("MODE", "RANK", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=60, help="alternated blocks of the side-by-side part")
    parser.add_argument("--steps", type=int, default=200, help="training steps a block of the crossover part")
    parser.add_argument(
        "--work", choices=("all_reduces", "steps"), action="append", help="the crossover part's work (repeatable)"
    )
    parser.add_argument("--only", choices=PARTS, action="append", help="run this part only (repeatable)")
    parser.add_argument("--quick", action="store_true", help="3 samples, 9 runs of 3 s at a 1-s setting")
    args = parser.parse_args()
    if args.side_worker:
        side_worker(args.side_worker)
        return
    if args.bare_rank:
        bare_rank(args.bare_rank[0], int(args.bare_rank[1]), int(args.bare_rank[2]))
        return
    if args.quick:
        args.samples, args.runs, args.pause, args.hang_seconds = 3, 9, 3.0, "1"
    workdir = tempfile.mkdtemp(prefix="air-magic-hang-")
    try:
        run_all(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run_all(args: argparse.Namespace, workdir: str) -> None:
    """Runs the parts asked for; a part not run keeps its last results (``results/hang.json``)."""
    parts = args.only or PARTS
    saved = RESULTS / "hang.json"
    results: dict[str, Any] = json.loads(saved.read_text()) if saved.exists() else {}
    results["machine"] = machine()
    if "detection" in parts:
        print("detection", flush=True)
        results["detection"] = {str(n): detection(n, args.samples, workdir) for n in (2, 4)}
        for n in (2, 4):
            results["detection"][str(n)].update(detection_outside(n, args.samples, workdir))
    if "false-reports" in parts:
        print("false reports", flush=True)
        results["false_reports"] = false_reports(args.runs, args.pause, args.hang_seconds, workdir)
    if "recording" in parts:
        print("recording", flush=True)
        results["recording"] = recording(3 if args.quick else 10, workdir)
    if "training" in parts:
        print("training", flush=True)
        results["training"] = training(2 if args.quick else 5, 600 if args.quick else 2000, workdir)
    if "side-by-side" in parts:
        print("side by side", flush=True)
        results["side_by_side"] = side_by_side(10 if args.quick else args.pairs)
        print("side by side, each rank pinned to a core", flush=True)
        results["side_by_side_pinned"] = side_by_side(10 if args.quick else args.pairs, pinned=True)
        print("side by side, torch alone (no air_magic), each rank pinned to a core", flush=True)
        results["side_by_side_torch_pinned"] = side_by_side(10 if args.quick else args.pairs, pinned=True, bare=True)
    if "side-by-side-control" in parts:
        print("side by side, the recorder off in both pools (a control), each rank pinned to a core", flush=True)
        results["side_by_side_control_pinned"] = side_by_side(
            10 if args.quick else args.pairs, pinned=True, control=True
        )
    if "crossover" in parts:
        print("side by side in two halves, the recorder-on pool started first then second, pinned", flush=True)
        key = "crossover_pinned" if args.steps == 200 and not args.work else f"crossover_pinned_{args.steps}_steps"
        results[key] = crossover(10 if args.quick else args.pairs, args.steps, tuple(args.work or ()))
    if "components" in parts:
        print("the recording's parts: per collective (1-rank pools side by side), a look, a step", flush=True)
        results["components"] = components(10 if args.quick else args.pairs)
    RESULTS.mkdir(exist_ok=True)
    saved.write_text(json.dumps(results, indent=1))
    lines = [f"Machine: {results['machine']}"]
    if "detection" in results:
        lines += ["", "| ranks | case | median s | p95 s | verdict | after Ctrl-C |", "|---|---|---|---|---|---|"]
        for n, cases in results["detection"].items():
            for case, data in cases.items():
                lines.append(
                    f"| {n} | {case} | {data['median']:.2f} | {data['p95']:.2f} | {'; '.join(data['verdicts'])} | "
                    f"{'; '.join(data['after_ctrl_c'])} |"
                )
    if "false_reports" in results:
        fr = dict(results["false_reports"])
        settings = fr.pop("settings", {})
        lines += [
            "",
            f"No hang: {settings.get('pause_s', '?')}-s runs, AIR_MAGIC_HANG_SECONDS="
            f"{settings.get('AIR_MAGIC_HANG_SECONDS', '?')}",
            "",
            "| no hang | runs | false reports |",
            "|---|---|---|",
        ]
        lines += [f"| {kind} | {d['runs']} | {d['false_reports']} |" for kind, d in fr.items()]
    if "recording" in results:
        lines += [
            "",
            "| 1,000 all_reduces of 1,024 floats, 2 ranks | recorder on ms | off ms | ratio | median of pairs |",
        ]
        lines += ["|---|---|---|---|---|"]
        for way, rec in results["recording"].items():
            lines.append(
                f"| {way} | {rec['median_on'] * 1000:.0f} | {rec['median_off'] * 1000:.0f} | {rec['ratio']:.3f} | "
                f"{rec['median_pair_ratio']:.3f} |"
            )
    if "training" in results:
        tr = results["training"]
        lines.append(
            f"\nDDP training (benchmarks/training/train.py, 2 ranks): recorder on {tr['median_on']:.1f} steps/s, "
            f"off {tr['median_off']:.1f} steps/s (medians): cost {tr['cost']:+.1%}"
        )
    for key, how in (
        ("side_by_side", ""),
        ("side_by_side_pinned", ", each rank pinned to a core"),
        ("side_by_side_torch_pinned", ": torch alone (no air_magic), each rank pinned to a core"),
        ("side_by_side_control_pinned", ": the recorder off in both (a control), each rank pinned to a core"),
        ("crossover_pinned", ", in two halves (the recorder-on pool started first, then second), pinned"),
        *(
            (key, f", in two halves, pinned, {key.split('_')[2]}-step blocks")
            for key in results
            if key.startswith("crossover_pinned_")
        ),
    ):
        if key not in results:
            continue
        lines += [
            "",
            f"| two pools at once, blocks alternated{how} | recorder on ms | off ms | median of pairs' on/off | 95 % interval |",
            "|---|---|---|---|---|",
        ]
        for what, rec in results[key].items():
            if isinstance(rec, dict) and "ci95" in rec:
                lines.append(
                    f"| {what} | {rec['median_on'] * 1000:.1f} | {rec['median_off'] * 1000:.1f} | "
                    f"{rec['median_pair_ratio']:.4f} | {rec['ci95'][0]:.4f}-{rec['ci95'][1]:.4f} |"
                )
    if "components" in results:
        c = results["components"]
        lines.append(
            f"\nThe recording's parts: {c['extra_per_collective_s'] * 1e6:+.2f} µs a collective (1-rank pools side by "
            f"side; the 95 % interval's top {c['extra_per_collective_high_s'] * 1e6:+.2f} µs), a look "
            f"{c['look_s'] * 1e3:.3f} ms of the rank's time each second, {c['collectives_per_step']:g} collectives a "
            f"training step of {c['step_s'] * 1e3:.2f} ms: training {c['training_cost']:+.3%} "
            f"(at most {c['training_cost_high']:+.3%})"
        )
    (RESULTS / "hang.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
