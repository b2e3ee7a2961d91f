"""Ray backend benchmark: air_magic on a Ray cluster vs. air_magic's local backend vs. Ray
Train's ``TorchTrainer``, on the same work, on a 2-node cluster simulated on this machine.

    python benchmarks/ray/run.py            # 10 to 15 minutes on 2 cores
    python benchmarks/ray/run.py --quick    # fewer repetitions and steps, about 7 minutes

Like the test suite, it runs inside a loopback-only network namespace (``unshare -n`` as
root, ``unshare -rn`` otherwise, with a PID namespace so that nothing of the cluster outlives
the run), where Ray's nodes use 127.0.0.1. The cluster is a head and one more node, 1 CPU
each, started with ``ray start`` (its own ``--temp-dir``, token authentication:
``RAY_AUTH_MODE=token`` with a token generated in a temporary ``HOME``). The only attempt
at another address is Ray's own probe for the machine's address (a UDP ``connect`` to a
public resolver, which fails at once in a namespace without routes: nothing is sent).

Every node, and every driver, has ``RAY_ADDRESS=127.0.0.1:6391`` (Ray's documented variable
for the cluster to use). Without it ``TorchTrainer.fit()`` took 12 s more on every call: Ray
Train's ``PlacementGroupCleaner`` asks the State API whether the controller is alive, the
State API finds the cluster from ``RAY_ADDRESS`` or else from the ``ray_current_cluster``
file of Ray's *default* temp dir, which another Ray cluster of the machine had written; that
cluster's GCS cannot be reached from this namespace, so the cleaner's thread waited 40 s for
it and the controller's shutdown gave up on the cleaner after 12 s. The second node's
dashboard agent gets its own port (both nodes share 127.0.0.1).

``TorchTrainer`` runs with ``FailureConfig(controller_failure_limit=0)``: by default (-1)
Ray Train v2 retries a worker group it could not place within 60 s forever, so a cluster
without 2 free CPUs made ``fit()`` wait without end in ``_initialize_and_run_controller``
(the controller's log says ``[FailurePolicy] RETRY ... (max allowed: inf)`` every minute);
with 0 the call fails with Ray Train's own reason. Nothing else of its defaults changes.

Every call of a tool runs in a driver process of that tool (a *runner*, connected to the
cluster once, untimed) and has a wall-clock limit (``--limit``, 300 s): a call without an
answer in time is reported as failed, with where the runner waited (``py-spy dump``) and
what the cluster had pending (actors and placement groups that are not running); the runner
is killed (its job's actors and placement groups go with it) and the next call gets a new,
warmed-up one. A tool that fails twice in a row is not called again in that measurement.

Measurements, each tool in turn in one run:

* **warm launch**: 2 ranks (one per node) run ``init_process_group`` + ``all_reduce`` +
  ``destroy_process_group`` and return; wall time of the call, after one untimed launch.
  ``TorchTrainer`` makes the process group itself, so its loop only runs the ``all_reduce``.
* **where a Ray launch spends its time**: more launches of the same work that stamp
  ``time.monotonic()`` (one clock for every process of the machine) in the ranks, read with
  the launch's own timings and the times of the backend's calls to Ray (placement group
  ready, agents placed); for ``TorchTrainer`` the same from its controller's log.
* **steady-state throughput**: the same DDP training loop (an MLP on random data, one
  thread per rank) on the same 2 ranks; steps per second measured inside rank 0 after the
  first 50 steps, so start-up is not counted; the tools take turns, round by round. Also
  rank 0's CPU time per step, and the CPU time every other process of the run used while
  the ranks trained (read from ``/proc`` every second: the PID namespace holds only the
  run's processes), by tool (its driver and actors) and for Ray's own daemons: with 2 ranks
  on 2 cores, that is what a launcher can take from the ranks.

Results: ``benchmarks/ray/results/ray.json`` and ``ray.md`` (printed too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
MARK = "AIR_MAGIC_BENCH_NETNS"
ADDRESS = "127.0.0.1:6391"
TOOLS = ("air_magic local", "air_magic ray", "TorchTrainer")
#: Warm-up steps before rank 0 starts its clock in the training loop.
WARMUP_STEPS = 50


def in_loopback_namespace() -> bool:
    # (if_nameindex asks the kernel about this process's namespace; /sys/class/net shows the
    # namespace that mounted /sys)
    return os.environ.get(MARK) == "1" and [name for _, name in socket.if_nameindex()] == ["lo"]


def reexec_in_namespace(argv: list[str], script: str = __file__) -> int:
    """Run ``python script argv...`` again inside a new loopback-only network namespace (and
    PID namespace); its exit code."""
    unshare = shutil.which("unshare")
    if unshare is None:
        sys.exit("unshare (util-linux) is needed: the benchmark runs in a loopback-only network namespace")
    flags = ["-n"] if os.geteuid() == 0 else ["-rn"]
    inner = "ip link set lo up && exec " + shlex.join([sys.executable, os.path.abspath(script), *argv])
    if os.environ.get(MARK) == "1":
        sys.exit("could not make a loopback-only network namespace (this is one already, with other interfaces)")
    env = {**os.environ, MARK: "1"}
    # -p -f --mount-proc: a PID namespace too, so that nothing of the cluster outlives the run
    return subprocess.call([unshare, *flags, "-p", "-f", "--mount-proc", "sh", "-c", inner], env=env)


# -- the work (runs in the ranks) --------------------------------------------------------------


def payload() -> float:
    """What a warm launch runs on each rank."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    dist.destroy_process_group()
    return float(value.item())


def split_payload() -> list[float]:
    """:func:`payload`, stamped: first line, torch imported, initialised, reduced, destroyed."""
    import time

    stamps = [time.monotonic()]
    import torch
    import torch.distributed as dist

    stamps.append(time.monotonic())
    dist.init_process_group("gloo")
    stamps.append(time.monotonic())
    value = torch.ones(1)
    dist.all_reduce(value)
    stamps.append(time.monotonic())
    dist.destroy_process_group()
    stamps.append(time.monotonic())
    return stamps


def trainer_payload(config: dict) -> None:
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)


def training(steps: int, init: bool = True) -> dict:
    """A DDP training loop. Rank 0's steps per second after the warm-up steps, its CPU time
    per step (every thread of the process), the timed window (wall clock) and each rank's pid."""
    import os
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if init:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data = torch.randn(64, 256)
    target = torch.randint(0, 10, (64,))
    began = cpu = wall = 0.0
    for step in range(steps):
        if step == WARMUP_STEPS:
            began, cpu, wall = time.perf_counter(), time.process_time(), time.time()
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(data), target)
        loss.backward()
        optimizer.step()
    timed = steps - WARMUP_STEPS
    numbers = {
        "rate": timed / (time.perf_counter() - began),
        "cpu_per_step": (time.process_time() - cpu) / timed,
        "window": [wall, time.time()],
        "threads": torch.get_num_threads(),
    }
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    numbers["pids"] = pids
    if init:
        dist.destroy_process_group()
    return numbers


def trainer_training(config: dict) -> None:
    """:func:`training` under ``TorchTrainer``: rank 0 writes its numbers to ``config["out"]``
    (Ray Train v2 keeps reported metrics only with a checkpoint)."""
    import json

    import torch.distributed as dist

    numbers = training(config["steps"], init=False)
    if dist.get_rank() == 0:
        with open(config["out"], "w") as handle:
            json.dump(numbers, handle)


# -- the cluster -------------------------------------------------------------------------------


def start_cluster(folder: str, root: str = ROOT) -> dict[str, str]:
    """A head and one more node, 1 CPU each; the environment of every Ray process and driver
    (``root``, the air_magic checkout they import, first on ``PYTHONPATH``)."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    home = os.path.join(folder, "home")
    os.makedirs(home)
    env = {
        **os.environ,
        "HOME": home,
        "RAY_AUTH_MODE": "token",
        "RAY_ADDRESS": ADDRESS,
        "RAY_USAGE_STATS_ENABLED": "0",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    subprocess.run([ray_bin, "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    temp = os.path.join(folder, "ray")
    port = ADDRESS.rsplit(":", 1)[1]
    common = ["--num-cpus=1", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}", "--disable-usage-stats"]
    head = [ray_bin, "start", "--head", f"--port={port}", "--dashboard-host=127.0.0.1", *common]
    subprocess.run(head, env=env, check=True, capture_output=True)
    other = [ray_bin, "start", f"--address={ADDRESS}", "--dashboard-agent-listen-port=52366", *common]
    subprocess.run(other, env=env, check=True, capture_output=True)
    return env


# -- the runners: one driver process per tool ----------------------------------------------


class CallFailed(Exception):
    """A call failed or got no answer within the limit (the message says which and why)."""


def runner_main(tool: str, reply_fd: int) -> int:
    """A tool's driver: reads one JSON command a line from stdin, answers on ``reply_fd``."""
    replies = os.fdopen(reply_fd, "w", buffering=1)

    def reply(message: dict) -> None:
        replies.write(json.dumps(message) + "\n")

    try:
        ops = tool_ops(tool)
    except BaseException:
        reply({"ok": False, "error": traceback.format_exc()})
        return 1
    reply({"ok": True, "ready": True})
    for line in sys.stdin:
        command = json.loads(line)
        began_wall, began = time.time(), time.perf_counter()
        try:
            value = ops[command["op"]](**command.get("args", {}))
        except BaseException as exc:
            traceback.print_exc()  # into the runner's log
            where = " < ".join(
                f"{f.name} ({os.path.basename(f.filename)}:{f.lineno})"
                for f in reversed(traceback.extract_tb(exc.__traceback__)[-3:])
            )
            reply({"ok": False, "error": f"{type(exc).__name__}: {exc} [in {where}]"[:2000]})
            continue
        reply({"ok": True, "seconds": time.perf_counter() - began, "began": began_wall, "value": value})
    return 0


#: (function name, thread, start, end) of the Ray calls made by air_magic's launch threads.
RAY_CALLS: list[tuple[str, str, float, float]] = []


def record_ray_calls(ray: Any) -> None:
    """Note when the Ray backend's launch threads call ``ray.wait`` and ``ray.get``."""
    for name in ("wait", "get"):
        original = getattr(ray, name)

        def wrapper(*args: Any, _original: Callable = original, _name: str = name, **kwargs: Any) -> Any:
            thread = threading.current_thread().name
            if not thread.startswith("air_magic-ray-"):
                return _original(*args, **kwargs)
            began = time.monotonic()
            try:
                return _original(*args, **kwargs)
            finally:
                RAY_CALLS.append((_name, thread, began, time.monotonic()))

        wrapper.recording = True  # type: ignore[attr-defined]
        setattr(ray, name, wrapper)


def tool_ops(tool: str) -> dict[str, Callable[..., Any]]:
    if tool == "air_magic local":
        import air_magic

        local = air_magic.distributed(num_accelerators=2, tracking=False, panel=False)(payload)
        return {"warm": lambda: check_values(local.distributed())}

    import ray

    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    if tool == "air_magic ray":
        import air_magic

        on_ray = air_magic.distributed(num_accelerators=2, tracking=False, panel=False, backend="ray")
        warm, stamped, train = on_ray(payload), on_ray(split_payload), on_ray(training)

        def split() -> dict:
            if not getattr(ray.get, "recording", False):
                record_ray_calls(ray)  # not before: the warm launches run without it
            RAY_CALLS.clear()
            stamps = stamped.distributed()
            launch = stamped.last_launch
            return {
                "timings": dict(launch.timings),
                "stamps": stamps,
                "exited": [rank.ended_at for rank in launch.ranks],
                "calls": list(RAY_CALLS),
            }

        return {
            "warm": lambda: check_values(warm.distributed()),
            "split": split,
            "train": lambda steps: train.distributed(steps)[0],
        }

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage = os.path.join(os.getcwd(), "train")

    def fit(loop: Callable, config: dict | None = None) -> None:
        TorchTrainer(
            loop,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
            # a worker group that cannot be placed within 60 s is an error, not retried forever
            run_config=RunConfig(storage_path=storage, failure_config=FailureConfig(controller_failure_limit=0)),
        ).fit()  # raises the run's error

    def train(steps: int) -> dict:
        out = os.path.join(os.getcwd(), f"rate-{uuid.uuid4().hex}.json")
        fit(trainer_training, {"steps": steps, "out": out})
        with open(out) as handle:
            return json.load(handle)

    return {"warm": lambda: fit(trainer_payload), "train": train}


def check_values(values: list) -> None:
    if values != [2.0, 2.0]:
        raise RuntimeError(f"the ranks returned {values!r}, not the sum of their ones")


class Runner:
    """The parent's end of a runner process."""

    def __init__(self, tool: str, folder: str, limit: float, index: int) -> None:
        self.tool = tool
        self.limit = limit
        read_end, write_end = os.pipe()
        self.log_path = os.path.join(folder, f"runner-{tool.replace(' ', '_')}-{index}.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--runner", tool, "--reply-fd", str(write_end)],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_end,),
                start_new_session=True,
                text=True,
            )
        os.close(write_end)
        self.replies = read_end
        self.pending = b""
        self._wait("starting the runner (imports, connecting to the cluster)")

    def call(self, op: str, **args: Any) -> dict:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.kill()
            raise CallFailed(f"the runner had ended before the {op} call: {tail(self.log_path)}") from None
        return self._wait(f"{op} call")

    def _wait(self, what: str) -> dict:
        deadline = time.monotonic() + self.limit
        while b"\n" not in self.pending:
            ready, _, _ = select.select([self.replies], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                reason = f"no answer to the {what} within {self.limit:g} s; {diagnose(self.proc.pid)}"
                self.kill()
                raise CallFailed(reason)
            data = os.read(self.replies, 1 << 16)
            if not data:
                self.kill()
                raise CallFailed(f"the runner ended during the {what}: {tail(self.log_path)}")
            self.pending += data
        line, self.pending = self.pending.split(b"\n", 1)
        message = json.loads(line)
        if not message["ok"]:
            raise CallFailed(f"the {what} failed: {message['error']}")
        return message

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            time.sleep(2)  # Ray notices the driver is gone and frees what its job held
        if self.replies >= 0:
            os.close(self.replies)
            self.replies = -1


def tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as handle:
            return " | ".join(line.strip() for line in handle.readlines()[-lines:])
    except OSError:
        return "(no log)"


def diagnose(pid: int) -> str:
    """Where a runner waits, and what the cluster has that is not running."""
    parts = []
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if py_spy:
        try:
            dump = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
            frames = [line.strip() for line in dump.stdout.split("Thread ")[1].splitlines()[1:8]]
            parts.append("the runner's main thread was in " + " < ".join(frames))
        except (subprocess.SubprocessError, IndexError, OSError) as exc:
            parts.append(f"(py-spy: {exc})")
    try:
        from ray.util.state import list_actors, list_placement_groups

        actors = list_actors(filters=[("state", "!=", "DEAD")], limit=200, timeout=15)
        waiting = sorted({f"{a.class_name} {a.state}" for a in actors if a.state != "ALIVE"})
        groups = list_placement_groups(filters=[("state", "!=", "REMOVED")], limit=200, timeout=15)
        pending = [f"{g.placement_group_id[:8]} {g.state}" for g in groups if g.state != "CREATED"]
        parts.append(f"actors not running: {', '.join(waiting) or 'none'}")
        parts.append(f"placement groups not placed: {', '.join(pending) or 'none'}")
    except Exception as exc:  # the State API itself may be what is stuck
        parts.append(f"(cluster state: {type(exc).__name__}: {exc})")
    return "; ".join(parts)


class Bench:
    """The runners and what they measured, failures included."""

    def __init__(self, folder: str, limit: float) -> None:
        self.folder = folder
        self.limit = limit
        self.runners: dict[str, Runner] = {}
        self.started = 0
        self.failures: list[dict] = []
        self.failed_in_a_row: dict[tuple[str, str], int] = {}

    def runner(self, tool: str) -> Runner:
        if tool not in self.runners:
            self.started += 1
            runner = Runner(tool, self.folder, self.limit, self.started)
            try:
                runner.call("warm")  # untimed: the first imports and connections, the cluster's first workers
            except CallFailed:
                runner.kill()
                raise
            self.runners[tool] = runner
        return self.runners[tool]

    def call(self, tool: str, phase: str, op: str, **args: Any) -> dict | None:
        """One call (a fresh runner if the last one was lost); None if it failed."""
        key = (tool, phase)
        if self.failed_in_a_row.get(key, 0) >= 2:
            return None
        try:
            answer = self.runner(tool).call(op, **args)
        except CallFailed as exc:
            reason = " ".join(str(exc).split())
            self.failures.append({"tool": tool, "phase": phase, "op": op, "reason": reason, "at": time.time()})
            print(f"[bench] {tool} {phase}: {reason}", file=sys.stderr, flush=True)
            self.failed_in_a_row[key] = self.failed_in_a_row.get(key, 0) + 1
            runner = self.runners.pop(tool, None)
            if runner is not None:
                runner.kill()
            return None
        self.failed_in_a_row[key] = 0
        return answer

    def close(self, tool: str) -> None:
        runner = self.runners.pop(tool, None)
        if runner is not None:
            runner.close()


# -- measurements ------------------------------------------------------------------------------


class Sampler(threading.Thread):
    """Every second: the machine's 1-minute load average and, while ``cpu`` is set, the CPU
    time of every process of this namespace (its PID namespace holds only the run's)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.load: list[tuple[float, float]] = []
        self.cpu = threading.Event()
        self.processes: list[tuple[float, dict[int, tuple[float, str]]]] = []
        self.stop = threading.Event()
        self.tick = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.load or time.time() - self.load[-1][0] >= 5:  # the kernel updates it every 5 s
                with open("/proc/loadavg") as handle:
                    self.load.append((time.time(), float(handle.read().split()[0])))
            if self.cpu.is_set():
                self.processes.append((time.time(), self.snapshot()))
            self.stop.wait(1)

    def snapshot(self) -> dict[int, tuple[float, str]]:
        found = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as handle:
                    fields = handle.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{name}/cmdline", "rb") as handle:
                    command = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:  # ended meanwhile
                continue
            found[int(name)] = ((int(fields[11]) + int(fields[12])) / self.tick, command)
        return found

    def cpu_outside(self, window: list[float], ranks: list[int]) -> dict[str, dict[str, float]]:
        """CPU used by every process but the ranks during ``window``, in cores: by owner (a
        tool, or ``cluster``) and by process name."""
        inside = [(at, snap) for at, snap in self.processes if window[0] <= at <= window[1]]
        if len(inside) < 2:
            return {}
        (first_at, first), (last_at, last) = inside[0], inside[-1]
        owners: dict[str, float] = {}
        names: dict[str, float] = {}
        for pid, (seconds, command) in last.items():
            if pid in ranks or pid == os.getpid():
                continue
            used = (seconds - first.get(pid, (0.0, ""))[0]) / (last_at - first_at)
            owner, name = owner_of(command), name_of(command)
            owners[owner] = owners.get(owner, 0.0) + used
            names[f"{owner}: {name}"] = names.get(f"{owner}: {name}", 0.0) + used
        return {"owners": owners, "processes": {k: v for k, v in names.items() if v >= 0.001}}


#: Ray's process titles (``ray::Class.method``) of each tool's actors; the rest of the cluster
#: (GCS, raylets, dashboard, agents, idle workers) is ``cluster``.
ACTORS = {
    "RankAgent": "air_magic ray",
    "TrainController": "TorchTrainer",
    "RayTrainWorker": "TorchTrainer",
    "PlacementGroupCleaner": "TorchTrainer",
    "SynchronizationActor": "TorchTrainer",
    "DatasetManager": "TorchTrainer",
    "PreemptionWatcher": "TorchTrainer",
    "_AutoscalingCoordinatorActor": "TorchTrainer",
}


def name_of(command: str) -> str:
    """A process's short name: ``driver``, ``ray::Class``, or its program (and script)."""
    if "--runner " in command:
        return "driver"
    if command.startswith("ray::"):
        return command.split(".", 1)[0].split()[0]
    words = command.split()
    options = words[1 : next((i for i, w in enumerate(words) if w.startswith("--")), len(words))]
    script = next((os.path.basename(w) for w in options if w.endswith(".py") or w.startswith("ray.")), "")
    return " ".join(filter(None, [os.path.basename(words[0]) if words else "?", script]))[:60]


def owner_of(command: str) -> str:
    if "--runner " in command:  # a tool's driver
        return command.split("--runner ", 1)[1].split(" --reply-fd", 1)[0]
    if command.startswith("ray::"):
        return ACTORS.get(command[5:].split(".", 1)[0].split()[0], "cluster")
    return "cluster"


def machine() -> dict:
    info: dict[str, Any] = {"cores": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as handle:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
        with open("/proc/meminfo") as handle:
            kib = next(int(line.split()[1]) for line in handle if line.startswith("MemTotal"))
        info["memory_gib"] = round(kib / 2**20, 1)
    except (OSError, StopIteration):
        pass
    return info


def measure(args: argparse.Namespace) -> dict:
    folder = tempfile.mkdtemp(prefix="air_magic-bench-ray-")
    os.chdir(folder)
    env = start_cluster(folder)
    os.environ.update(env)  # the runners', and the State API's here (it reads the token from $HOME/.ray)
    os.environ["AIR_MAGIC_LOG_DIR"] = os.path.join(folder, "logs")
    reps = dict.fromkeys(TOOLS, 3) if args.quick else {"air_magic local": 10, "air_magic ray": 7, "TorchTrainer": 7}
    splits = 3 if args.quick else 7
    rounds = 2 if args.quick else 5
    steps = 600 if args.quick else 2000
    sampler = Sampler()
    sampler.start()
    bench = Bench(folder, args.limit)
    results: dict[str, Any] = {
        "quick": args.quick,
        "steps": steps,
        "warmup_steps": WARMUP_STEPS,
        "warm_launch": {},
        "warm_launch_began": {},
        "throughput": {tool: [] for tool in TOOLS[1:]},
        "training": {tool: [] for tool in TOOLS[1:]},
    }
    phases: list[tuple[str, float, float]] = []

    began = time.time()
    for tool in TOOLS:
        times, starts = [], []
        for _ in range(reps[tool]):
            answer = bench.call(tool, "warm launch", "warm")
            if answer is not None:
                times.append(answer["seconds"])
                starts.append((answer["began"], answer["began"] + answer["seconds"]))
        results["warm_launch"][tool] = times
        results["warm_launch_began"][tool] = starts
        if tool == "air_magic local":
            bench.close(tool)
    phases.append(("warm launch", began, time.time()))

    began = time.time()
    results["ray_split"], results["ray_split_stamps"] = [], []
    for _ in range(splits):
        answer = bench.call("air_magic ray", "split", "split")
        if answer is not None:
            results["ray_split"].append(split_parts(answer["value"]))
            results["ray_split_stamps"].append(answer["value"])
    phases.append(("split", began, time.time()))

    began = time.time()
    sampler.cpu.set()
    for _ in range(rounds):  # the tools take turns, so that a slower minute of the machine hits both
        for tool in TOOLS[1:]:
            answer = bench.call(tool, "throughput", "train", steps=steps)
            numbers = answer["value"] if answer is not None else {}
            if numbers:
                numbers["cpu_outside"] = sampler.cpu_outside(numbers["window"], numbers["pids"])
            results["training"][tool].append(numbers)
            results["throughput"][tool].append(numbers.get("rate"))
    sampler.cpu.clear()
    phases.append(("throughput", began, time.time()))

    for tool in list(bench.runners):
        bench.close(tool)
    sampler.stop.set()
    results["trainer_split"] = trainer_split(folder, results["warm_launch_began"]["TorchTrainer"])
    if args.keep:
        print(f"[bench] the run's folder: {folder}", file=sys.stderr)
    else:  # the cluster's processes end with this namespace, right after
        shutil.rmtree(folder, ignore_errors=True)
    results["failures"] = bench.failures
    results["load"] = {name: [value for at, value in sampler.load if start <= at <= end] for name, start, end in phases}
    return results


#: The parts of a warm Ray launch, in order: (key, label).
RAY_PARTS = [
    ("kernel", "kernel: spec, payload file, the cluster's resources"),
    ("placement", "placement group made and ready"),
    ("agents", "2 agent actors placed, each in a Ray worker process, asked where they run"),
    ("start", "free port, payload to the object store, agents write the request and start the ranks"),
    ("rank_start", "rank start-up: `python -m air_magic.backends.ray.rank_entry` until the user's first line"),
    ("import_torch", "user code: `import torch`"),
    ("rendezvous", "user code: `init_process_group` (torch's TCP store on rank 0's node)"),
    ("collective", "user code: `all_reduce`"),
    ("destroy", "user code: `destroy_process_group`"),
    ("result", "result: rank exits, its agent's poll sees it, the record comes back"),
    ("end", "end: actors killed, placement group removed"),
    ("values", "kernel: values read"),
    ("total", "total (call → values)"),
]
FIXED = ("kernel", "placement", "agents", "start", "rank_start", "result", "end", "values")


def split_parts(value: dict) -> dict[str, float]:
    """One stamped launch's parts, in seconds (see :data:`RAY_PARTS`), along the rank that
    finished last: consecutive stamps, so the parts add up to the total."""
    t, exited = value["timings"], value["exited"]
    last = max(value["stamps"], key=lambda stamps: stamps[4])
    waits = [call for call in value["calls"] if call[0] == "wait"]
    ready = waits[0][3] if waits else t["sent"]
    gets = [call for call in value["calls"] if call[0] == "get" and call[2] >= ready]
    placed = gets[0][3] if gets else ready
    returned = t.get("returned", t["outcome"])
    marks = [t["call"], t["sent"], ready, placed, t["started"], *last, max(exited), t["done"], returned]
    keys = [key for key, _ in RAY_PARTS if key != "total"]
    parts = {key: end - start for key, start, end in zip(keys, marks, marks[1:])}
    parts["total"] = returned - t["call"]
    return parts


#: TorchTrainer.fit()'s parts, from its controller's log: (key, label, the log line that ends it).
TRAINER_PARTS = [
    ("controller", "controller actor started (`fit()` → it asks for resources)", "Requesting resources"),
    ("placement", "placement group for the workers", "Attempting to start training worker group"),
    ("workers", "2 worker actors, torch imported, process group made", "Started training worker group"),
    ("rest", "the loop, the run's end, the controller's shutdown, the result", None),
]


def trainer_split(folder: str, fits: list[tuple[float, float]]) -> list[dict[str, float]]:
    """Each timed ``fit()``'s parts, from the controller's log lines (wall clock, ms)."""
    logs = os.path.join(folder, "ray", "session_latest", "logs", "train")
    runs = []
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        if not name.startswith("ray-train-app-controller-"):
            continue
        marks = {}
        with open(os.path.join(logs, name), errors="replace") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                    when = datetime.datetime.strptime(record["asctime"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                except (ValueError, KeyError):
                    continue
                for key, _, message in TRAINER_PARTS:
                    if message and key not in marks and record.get("message", "").startswith(message):
                        marks[key] = when
        if len(marks) == 3:
            runs.append(marks)
    parts = []
    for start, end in fits:
        found = [m for m in runs if start <= m["controller"] <= end]
        if found:
            m = found[0]
            parts.append(
                {
                    "controller": m["controller"] - start,
                    "placement": m["placement"] - m["controller"],
                    "workers": m["workers"] - m["placement"],
                    "rest": end - m["workers"],
                    "total": end - start,
                }
            )
    return parts


# -- the report --------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 2) -> str:
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}" if values else "—"


def report(results: dict) -> str:
    m = results["machine"]
    warm = {k: statistics.median(v) for k, v in results["warm_launch"].items() if v}
    samples = [value for values in results["load"].values() for value in values]
    lines = [
        f"Machine: {m['cores']} cores ({m.get('cpu', platform.machine())}), {m.get('memory_gib', '?')} GiB, "
        f"Linux {m['kernel']}, Python {m['python']}, Ray {results['ray_version']}, torch {results['torch_version']}; "
        "a 2-node Ray cluster on it (head and one more node, 1 CPU each, loopback only, token authentication); "
        "2 CPU ranks, one per node, gloo.",
        f"Load average (1 min) while measuring: {spread(samples, 1)}, median {statistics.median(samples):.1f}."
        if samples
        else "Load average: not sampled.",
        f"Run of {results['date']}: `python benchmarks/ray/run.py{' --quick' if results['quick'] else ''}`, "
        f"{results['wall_s'] / 60:.1f} min.",
        "",
        "| warm launch (init_process_group, all_reduce, destroy, return) | median | min–max | runs |",
        "|---|---:|---:|---:|",
    ]
    for name, values in results["warm_launch"].items():
        median = f"{warm[name]:.3f} s" if values else "failed"
        lines.append(f"| {name} | {median} | {spread(values, 3)} | {len(values)} |")
    if "air_magic ray" in warm:
        ratios = []
        if "TorchTrainer" in warm:
            ratios.append(f"÷ TorchTrainer **{warm['air_magic ray'] / warm['TorchTrainer']:.2f}**")
        if "air_magic local" in warm:
            ratios.append(f"÷ air_magic local **{warm['air_magic ray'] / warm['air_magic local']:.1f}**")
        lines += ["", "air_magic ray (medians): " + ", ".join(ratios) + "."]

    rates = results["throughput"]
    done = {k: [r for r in v if r is not None] for k, v in rates.items()}
    lines += [
        "",
        f"| steady-state DDP throughput ({results['steps']} steps, rank 0, after {results['warmup_steps']}) "
        "| median steps/s | min–max | runs | rank 0 CPU per step | the tool's other processes | Ray's daemons "
        "| threads per rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, values in done.items():
        runs = [n for n in results["training"][name] if n]
        median = f"{statistics.median(values):.1f}" if values else "failed"
        cpu = f"{statistics.median(n['cpu_per_step'] for n in runs) * 1000:.2f} ms" if runs else "—"
        outside = [n["cpu_outside"]["owners"] for n in runs if n.get("cpu_outside")]
        own = f"{statistics.median(o.get(name, 0.0) for o in outside) * 100:.1f} % of a core" if outside else "—"
        daemons = (
            f"{statistics.median(o.get('cluster', 0.0) for o in outside) * 100:.1f} % of a core" if outside else "—"
        )
        threads = ", ".join(map(str, sorted({n["threads"] for n in runs}))) or "—"
        lines.append(
            f"| {name} | {median} | {spread(values, 1)} | {len(values)} | {cpu} | {own} | {daemons} | {threads} |"
        )
    for name in done:
        runs = [n["cpu_outside"]["processes"] for n in results["training"][name] if n and n.get("cpu_outside")]
        keys = sorted({key for run in runs for key in run if not key.startswith("cluster:")})
        used = {key: statistics.median(run.get(key, 0.0) for run in runs) for key in keys}
        shown = [
            f"{key} {value * 100:.1f} %" for key, value in sorted(used.items(), key=lambda kv: -kv[1]) if value >= 0.002
        ]
        if shown:
            lines += ["", f"While {name}'s ranks trained (% of a core, medians): " + "; ".join(shown) + "."]
    pairs = [a / b for a, b in zip(rates["air_magic ray"], rates["TorchTrainer"]) if a and b]
    if pairs and all(done.values()):
        ratio = statistics.median(done["air_magic ray"]) / statistics.median(done["TorchTrainer"])
        noise = max((max(v) - min(v)) / statistics.median(v) / 2 for v in done.values()) * 100
        met = "met" if ratio >= 0.98 else "not met"
        lines += [
            "",
            f"air_magic ray ÷ TorchTrainer: **{ratio:.3f}** (medians); paired by round: median "
            f"{statistics.median(pairs):.3f} [{min(pairs):.3f}, {max(pairs):.3f}]. "
            f"Goal (no more than 2 % slower, by the medians): {met}; a tool's own runs spread by up to "
            f"±{noise:.0f} %.",
        ]

    if results["ray_split"]:
        lines += [
            "",
            f"Where a warm air_magic Ray launch spends its time (medians of {len(results['ray_split'])} launches, ms; "
            "* = fixed cost, the same for any work):",
            "",
            "| part | ms |",
            "|---|---:|",
        ]
        for key, label in RAY_PARTS:
            value = statistics.median(p[key] for p in results["ray_split"]) * 1000
            mark = " *" if key in FIXED else ""
            lines.append(f"| {label}{mark} | {value:.0f} |")
        fixed = statistics.median(sum(p[k] for k in FIXED) for p in results["ray_split"]) * 1000
        lines += ["", f"Fixed cost (* rows, median of their sums): {fixed:.0f} ms."]
    if results["trainer_split"]:
        lines += [
            "",
            f"`TorchTrainer.fit()` by its controller's log (medians of {len(results['trainer_split'])} warm fits, s):",
            "",
            "| part | s |",
            "|---|---:|",
        ]
        for key, label, _ in TRAINER_PARTS:
            lines.append(f"| {label} | {statistics.median(p[key] for p in results['trainer_split']):.2f} |")
        total = statistics.median(p["total"] for p in results["trainer_split"])
        lines.append(f"| total | {total:.2f} |")
    lines += ["", "Failed calls: " + ("none." if not results["failures"] else "")]
    for failure in results["failures"]:
        lines.append(f"- {failure['tool']}, {failure['phase']}: {failure['reason']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    parser.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for ray.json and ray.md")
    parser.add_argument("--limit", type=float, default=300.0, help="wall-clock limit of each call, in seconds")
    parser.add_argument("--keep", action="store_true", help="keep the run's folder (Ray's logs, the runners' logs)")
    parser.add_argument("--runner", help=argparse.SUPPRESS)
    parser.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runner:
        return runner_main(args.runner, args.reply_fd)
    args.out = os.path.abspath(args.out)  # the measurements run in a temporary folder
    if not in_loopback_namespace():
        return reexec_in_namespace(sys.argv[1:])
    began = time.time()
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine()}
    results.update(measure(args))
    results["wall_s"] = time.time() - began
    import ray
    import torch

    results["ray_version"] = ray.__version__
    results["torch_version"] = torch.__version__
    write_results(args.out, "ray", results, report(results))
    return 0


def write_results(out: str, name: str, results: dict, text: str) -> None:
    """``out/name.json`` (every measurement) and ``out/name.md`` (the report, also printed)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
