"""Test harness: real IPython kernels driven like a notebook, and process accounting.

Every process air_magic starts (the helper ``python -m air_magic.rank.zygote`` and the
ranks forked from it, with their DataLoader workers) carries ``AIR_MAGIC_TEST_MARK``
in the environment it was started with, so the checks below only ever look at the
processes of this test session, not at those of another session on the machine.
"""

from __future__ import annotations

import os
import queue
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import psutil

#: Written into the environment of this pytest process (inherited by the process
#: tests' helper) and of every kernel started here (inherited by their helpers).
TEST_MARK = uuid.uuid4().hex
os.environ["AIR_MAGIC_TEST_MARK"] = TEST_MARK

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

#: Put first on the kernels' PYTHONPATH: its sitecustomize makes a kernel dump its stacks.
_KERNEL_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_site")

#: pids of kernels started by this session that are alive (their helpers may live on).
LIVE_KERNEL_PIDS: set[int] = set()


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def user_lines(text: str) -> list[str]:
    """The lines of a cell's output that the launched code printed (air_magic's own
    status lines, which start with ``[air_magic]``, left out)."""
    return [line for line in text.splitlines() if not line.startswith("[air_magic]")]


# -- process accounting ------------------------------------------------------------------


def _is_ours(proc: psutil.Process) -> bool:
    """A helper of this session (``python -m air_magic.rank.zygote``), a rank or a process a
    rank started.  Recognised by what they are, never by path text: a clone of the
    project in a folder named ``air_magic`` puts that name in every command line (an
    MLflow server started from its virtual environment included)."""
    try:
        if proc.environ().get("AIR_MAGIC_TEST_MARK") != TEST_MARK:
            return False
        if _is_helper_command(proc.cmdline()):
            return True  # the helper, and the ranks and DataLoader workers forked from it
        # what a rank executed (a shell, a spawned worker) carries the rank's environment
        return "AIR_MAGIC_LAUNCH_ID" in proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


#: Ranks of a pool (``%%distributed --pool``) of a live kernel: they stay from one test to the next.
POOL_RANK_PIDS: set[int] = set()


def alive(process: psutil.Process) -> bool:
    """Whether a process still runs: a zombie, or one that ends while it is being asked, does not."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone(pid: int) -> bool:
    """Whether the process ``pid`` has ended (a zombie has)."""
    try:
        return not alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return True


def values(res: "CellResult") -> Any:
    """A cell's ``Out`` (a launch's or pool cell's list of the ranks' values), read back."""
    import ast

    assert res.error is None, res.error_text
    assert res.result is not None, f"no Out; stdout={res.stdout!r} stderr={res.stderr!r}"
    return ast.literal_eval(res.result)


def pool_pids(k: "Kernel") -> list[int]:
    """The pids of the ranks of the kernel's pool."""
    return k.value("__import__('air_magic').Pool.current().status()['pids']")


def kernel_with_a_pool(kernel_factory: Any, first: str) -> Iterator["Kernel"]:
    """A module's kernel (its first cell ``first``) with a pool of 2 ranks that stays from one
    test to the next; for a module-scoped fixture.  With :func:`the_pool_stays`."""
    kernel = kernel_factory()
    kernel.ok(first)
    kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
    yield kernel
    POOL_RANK_PIDS.clear()
    kernel.shutdown()


def the_pool_stays(k: "Kernel") -> Iterator[None]:
    """After each test: the kernel's pool's ranks (if it has a pool) are not leftovers;
    nothing else may stay.  For an autouse fixture."""
    yield
    POOL_RANK_PIDS.clear()
    if k.value("__import__('air_magic').Pool.current() is not None"):
        POOL_RANK_PIDS.update(pool_pids(k))


def _is_helper_command(cmdline: list[str]) -> bool:
    return any(a == "-m" and b == "air_magic.rank.zygote" for a, b in zip(cmdline, cmdline[1:]))


def air_magic_processes() -> list[psutil.Process]:
    """Every live (non-zombie) helper, rank or rank child of this session."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if proc.pid != os.getpid() and _is_ours(proc):
            found.append(proc)
    return found


def _parent_pid(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def helper_processes() -> list[psutil.Process]:
    """Helpers: started by a live kernel of this session or by this pytest process."""
    owners = LIVE_KERNEL_PIDS | {os.getpid()}
    return [p for p in air_magic_processes() if _parent_pid(p) in owners]


def stray_processes() -> list[psutil.Process]:
    """air_magic processes that should not exist between tests: ranks, their children,
    and helpers whose kernel is gone (the ranks of a live kernel's pool stay: they are
    in ``POOL_RANK_PIDS``)."""
    owners = LIVE_KERNEL_PIDS | {os.getpid()}
    return [p for p in air_magic_processes() if _parent_pid(p) not in owners and p.pid not in POOL_RANK_PIDS]


def rank_processes() -> list[psutil.Process]:
    """Processes forked (directly or not) from a helper of this session."""
    procs = air_magic_processes()
    pids = {p.pid for p in procs}
    return [p for p in procs if _parent_pid(p) in pids]


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def describe(procs: list[psutil.Process]) -> str:
    rows = []
    for proc in procs:
        try:
            rows.append(f"pid {proc.pid} ppid {proc.ppid()} {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            rows.append(f"pid {proc.pid} (gone)")
    return "\n".join(rows)


# -- kernels -------------------------------------------------------------------------------


@dataclass
class CellResult:
    """What a notebook shows for one executed cell."""

    stdout: str = ""
    stderr: str = ""
    result: str | None = None  # text/plain of execute_result
    error: dict[str, Any] | None = None  # ename, evalue, traceback (ANSI stripped), text
    streams: list[tuple[str, str]] = field(default_factory=list)  # (name, text) in order
    reply: dict[str, Any] | None = None
    execution_count: int | None = None
    #: (msg_type, data, display_id) of each display_data / update_display_data, in order.
    displays: list[tuple[str, dict[str, Any], str | None]] = field(default_factory=list)
    #: Where the outputs come in the cell, in order: "stdout", "stderr", "display_data"
    #: (an update changes a display in place: it is not a place).
    order: list[str] = field(default_factory=list)
    #: The input requests it made (a rank's pdb prompt) and the seconds since it was sent;
    #: what was answered (``Kernel.run_with_stdin``).
    prompts: list[tuple[str, float]] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.stdout, self.result, self.error))

    @property
    def shown_text(self) -> str:
        """What the cell shows as text: its stdout, then each display's text form (a
        magic's status, such as ``%distributed_pool``'s, is a display)."""
        return self.stdout + "".join(
            str(data.get("text/plain", "")) + "\n" for kind, data, _ in self.displays if kind == "display_data"
        )

    @property
    def error_text(self) -> str:
        return self.error["text"] if self.error else ""

    def record(self, msg: dict[str, Any]) -> bool:
        """Add one iopub message of the cell; True at the cell's end (the kernel is idle)."""
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            self.streams.append((content["name"], content["text"]))
            self.order.append(content["name"])
            if content["name"] == "stdout":
                self.stdout += content["text"]
            else:
                self.stderr += content["text"]
        elif kind in ("execute_result", "execute_input"):
            if kind == "execute_result":
                self.result = content["data"].get("text/plain")
            self.execution_count = content.get("execution_count")
        elif kind in ("display_data", "update_display_data"):
            display_id = (content.get("transient") or {}).get("display_id")
            self.displays.append((kind, content.get("data") or {}, display_id))
            if kind == "display_data":
                self.order.append(kind)
        elif kind == "error":
            tb = [strip_ansi(line) for line in content["traceback"]]
            self.error = {
                "ename": content["ename"],
                "evalue": strip_ansi(content["evalue"]),
                "traceback": tb,
                "text": "\n".join(tb),
            }
        return kind == "status" and content["execution_state"] == "idle"


def reports(res: CellResult) -> list[str]:
    """The hang reports the cell showed (each state of its display)."""
    return [
        str(data.get("text/plain", ""))
        for _, data, _ in res.displays
        if str(data.get("text/plain", "")).startswith("[air_magic] hang report:")
    ]


class Kernel:
    """A real IPython kernel in its own temp folder, driven like a notebook front end."""

    def __init__(
        self, workdir: str, extra_env: dict[str, str] | None = None, kernel_name: str = "python3", ipc: str = ""
    ) -> None:
        """``ipc``: a path prefix for the kernel's sockets (ZeroMQ over Unix sockets, not TCP: a
        kernel in a network namespace of its own is reached through the file system)."""
        from jupyter_client.manager import KernelManager

        self.workdir = workdir
        env = dict(os.environ)
        env.update(
            AIR_MAGIC_TEST_MARK=TEST_MARK,
            MLFLOW_TRACKING_URI=f"sqlite:///{os.path.join(workdir, 'mlflow.db')}",
            PYTHONDONTWRITEBYTECODE="1",
        )
        env.pop("PYTEST_CURRENT_TEST", None)
        env.pop("AIR_MAGIC_WARM", None)  # set for the unit and lint tests; a kernel warms as a user's does
        env.update(extra_env or {})
        # Where the kernel's stacks go on SIGUSR2 (see kernel_site/sitecustomize.py).
        self.stacks_path = os.path.join(workdir, "kernel-stacks.txt")
        env["AIR_MAGIC_TEST_KERNEL_STACKS"] = self.stacks_path
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_KERNEL_SITE, env.get("PYTHONPATH")) if p)
        self.km = KernelManager(kernel_name=kernel_name, **({"transport": "ipc", "ip": ipc} if ipc else {}))
        self.km.start_kernel(cwd=workdir, env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.pid = self.km.provisioner.process.pid  # type: ignore[union-attr]
        LIVE_KERNEL_PIDS.add(self.pid)

    # -- running cells ---------------------------------------------------------------------

    def execute(self, code: str) -> str:
        """Send a cell without waiting; returns its msg_id."""
        return self.kc.execute(code, store_history=True, allow_stdin=False)

    def collect(
        self, msg_id: str, timeout: float = 60.0, until: Any = None, earlier: dict[str, CellResult] | None = None
    ) -> CellResult:
        """Read the cell's output until the kernel is idle again (or ``until(result)`` is true);
        what comes meanwhile for the cells in ``earlier`` (by msg_id: an update of a display
        made by a thread after its cell ended) is added to their results."""
        res = CellResult()
        deadline = time.monotonic() + timeout
        idle = False
        while not idle:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"cell did not finish in {timeout} s; output so far: {res.stdout[-2000:]!r}"
                    f"\nthe kernel's threads:\n{self.thread_stacks()}"
                )
            try:
                msg = self.kc.get_iopub_msg(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            parent = msg["parent_header"].get("msg_id")
            if earlier is not None and parent in earlier:
                earlier[parent].record(msg)
                continue
            if parent != msg_id:
                continue
            idle = res.record(msg)
            if until is not None and until(res):
                return res
        res.reply = self._shell_reply(msg_id, max(1.0, deadline - time.monotonic()))
        return res

    def run_with_stdin(
        self, code: str, answers: list[str] | Callable[[str, "CellResult"], str | None], timeout: float = 120.0
    ) -> "CellResult":
        """A cell run as a front end that allows stdin runs it: each input request (a rank's
        pdb prompt) is answered with the next of ``answers`` (or ``answers(prompt, result)``;
        None there interrupts the kernel instead, as the notebook's Interrupt does).  The
        result's ``prompts`` lists each prompt with the seconds since the cell was sent."""
        msg_id = self.kc.execute(code, store_history=True, allow_stdin=True)
        res = CellResult()
        queue_of = list(answers) if isinstance(answers, list) else None
        began = time.monotonic()
        deadline = began + timeout
        idle = False
        while not idle:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell did not finish in {timeout} s; output so far: {res.stdout[-2000:]!r}")
            try:
                request = self.kc.get_stdin_msg(timeout=0.02)
            except queue.Empty:
                request = None
            if request is not None:
                prompt = request["content"]["prompt"]
                res.prompts.append((prompt, time.monotonic() - began))
                if queue_of is not None:
                    answer: str | None = queue_of.pop(0) if queue_of else "c"
                else:
                    answer = answers(prompt, res)  # type: ignore[operator]
                if answer is None:
                    self.km.interrupt_kernel()
                else:
                    res.answers.append(answer)
                    self.kc.input(answer)
            while True:
                try:
                    msg = self.kc.get_iopub_msg(timeout=0.01)
                except queue.Empty:
                    break
                if msg["parent_header"].get("msg_id") == msg_id and res.record(msg):
                    idle = True
                    break
        res.reply = self._shell_reply(msg_id, max(1.0, deadline - time.monotonic()))
        return res

    def thread_stacks(self) -> str:
        """Every thread's Python stack in the kernel process, as faulthandler writes them."""
        import signal

        try:
            size = os.path.getsize(self.stacks_path)
            os.kill(self.pid, signal.SIGUSR2)
        except OSError as exc:
            return f"(none: {exc})"
        wait_until(lambda: os.path.getsize(self.stacks_path) > size, timeout=2.0)
        time.sleep(0.2)
        with open(self.stacks_path, encoding="utf-8", errors="replace") as handle:
            handle.seek(size)
            return handle.read() or "(none written)"

    def _shell_reply(self, msg_id: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg["content"]
        raise TimeoutError("no execute_reply")

    def run(self, code: str, timeout: float = 60.0) -> CellResult:
        return self.collect(self.execute(code), timeout=timeout)

    def ok(self, code: str, timeout: float = 60.0) -> CellResult:
        """Run a cell that must not fail."""
        res = self.run(code, timeout=timeout)
        assert res.error is None, res.error_text
        return res

    def value(self, expr: str, timeout: float = 60.0) -> Any:
        """Evaluate an expression in the kernel and return it (through its repr)."""
        import ast

        res = self.ok(expr, timeout=timeout)
        assert res.result is not None, f"{expr!r} gave no result"
        return ast.literal_eval(res.result)

    # -- life ----------------------------------------------------------------------------------

    def forget(self) -> None:
        LIVE_KERNEL_PIDS.discard(self.pid)

    def refresh_pid(self) -> None:
        """After a restart: the new kernel process."""
        self.forget()
        self.pid = self.km.provisioner.process.pid  # type: ignore[union-attr]
        LIVE_KERNEL_PIDS.add(self.pid)

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        except Exception:
            pass
        try:
            if self.km.is_alive():
                self.km.shutdown_kernel(now=False)
        except Exception:
            try:
                self.km.shutdown_kernel(now=True)
            except Exception:
                pass
        self.km.cleanup_resources()
        self.forget()
