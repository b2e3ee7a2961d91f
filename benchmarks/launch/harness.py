"""Kernel driving, timing brackets, stamp files and process cleanup."""

from __future__ import annotations

import ast
import json
import math
import os
import queue
import statistics
import textwrap
import time
from pathlib import Path

import psutil
from jupyter_client import KernelManager

TAG_VAR = "AIRBENCH_SESSION"  # set in every kernel's env; children inherit it
RUN_VAR = "AIRBENCH_RUN"


class CellTimeout(Exception):
    pass


class KernelDied(Exception):
    pass


class CellError(Exception):
    pass


def write_kernelspec(root: Path, name: str, argv: list[str], interrupt_mode: str = "signal") -> None:
    d = root / "kernels" / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.json").write_text(
        json.dumps(
            {
                "argv": argv,
                "display_name": name,
                "language": "python",
                "interrupt_mode": interrupt_mode,
            }
        )
    )


class KernelSession:
    """One kernel, driven over ZMQ the way a notebook front end does."""

    def __init__(self, kernel_name: str, env: dict, cwd: str, ready_timeout: float = 180, log_path: Path | None = None):
        self.km = KernelManager(kernel_name=kernel_name)
        self.log_path = log_path
        # The kernel's own stdout/stderr (and so any rank process that inherits
        # them) go to a per-session log file instead of the harness terminal.
        self._log = open(log_path, "ab") if log_path else None
        extra = {"stdout": self._log, "stderr": self._log} if self._log else {}
        t0 = time.perf_counter()
        self.km.start_kernel(env=env, cwd=cwd, **extra)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=ready_timeout)
        except RuntimeError as e:
            raise KernelDied(f"kernel not ready: {e}") from e
        self.start_s = time.perf_counter() - t0
        prov = getattr(self.km, "provisioner", None)
        self.pid = getattr(prov, "pid", None)

    # -- execution ---------------------------------------------------------
    def execute(self, code: str, timeout: float, user_expressions: dict | None = None) -> dict:
        """Run one cell. Returns client-side send->reply time, reply, stdout, errors."""
        kc = self.kc
        self._drain_iopub(None, [], [], block=False)
        w_send = time.time()
        t0 = time.perf_counter()
        msg_id = kc.execute(
            code, silent=False, store_history=True, user_expressions=user_expressions or {}, allow_stdin=False
        )
        deadline = t0 + timeout
        out: list[str] = []
        errs: list[str] = []
        reply = None
        t1 = None
        while reply is None:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise CellTimeout(f"no reply within {timeout:.0f} s")
            try:
                msg = kc.get_shell_msg(timeout=min(0.25, remaining))
            except queue.Empty:
                self._drain_iopub(msg_id, out, errs, block=False)
                if not self.km.is_alive():
                    raise KernelDied("kernel process exited") from None
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                t1 = time.perf_counter()
                reply = msg["content"]
        self._drain_iopub(msg_id, out, errs, block=True, limit=10.0)
        return {"client_s": t1 - t0, "w_send": w_send, "reply": reply, "stdout": "".join(out), "errors": errs}

    def _drain_iopub(self, msg_id, out, errs, block: bool, limit: float = 0.0):
        end = time.perf_counter() + limit
        while True:
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05 if block else 0)
            except queue.Empty:
                if not block or time.perf_counter() > end:
                    return
                continue
            parent = msg["parent_header"].get("msg_id")
            mt = msg["header"]["msg_type"]
            if msg_id is not None and parent == msg_id:
                if mt == "stream":
                    out.append(msg["content"]["text"])
                elif mt == "error":
                    c = msg["content"]
                    errs.append(f"{c.get('ename')}: {c.get('evalue')}")
                elif mt == "status" and msg["content"]["execution_state"] == "idle" and block:
                    return
            if block and time.perf_counter() > end:
                return

    def run_plain(self, code: str, timeout: float) -> dict:
        """Run untimed harness code; raise on any error."""
        r = self.execute(code, timeout)
        if r["reply"].get("status") != "ok":
            c = r["reply"]
            raise CellError(f"{c.get('ename')}: {c.get('evalue')} | {r['stdout'][-800:]}")
        return r

    def run_bracketed(self, body: str, timeout: float) -> dict:
        """Run ``body`` inside a kernel-side time.time()/perf_counter() bracket."""
        code = bracket(body)
        r = self.execute(code, timeout, {"rec": "__import__('json').dumps(_bench_rec)"})
        rec = None
        ue = r["reply"].get("user_expressions", {}).get("rec")
        if ue and ue.get("status") == "ok":
            rec = json.loads(ast.literal_eval(ue["data"]["text/plain"]))
        if rec is None:
            c = r["reply"]
            raise CellError(f"bracket failed: {c.get('ename')}: {c.get('evalue')} | {r['stdout'][-800:]}")
        r["rec"] = rec
        return r

    def interrupt(self):
        try:
            self.km.interrupt_kernel()
        except Exception:
            pass

    def descendants(self) -> list[psutil.Process]:
        if not self.pid:
            return []
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def shutdown(self, timeout: float = 15):
        kids = self.descendants()
        try:
            self.kc.stop_channels()
        except Exception:
            pass
        try:
            self.km.shutdown_kernel(now=False, restart=False)
        except Exception:
            try:
                self.km.shutdown_kernel(now=True)
            except Exception:
                pass
        kill_procs(kids)
        if self._log:
            self._log.close()

    def log_tail(self, n: int = 1500) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()[-n:].decode(errors="replace")
        return data


def bracket(body: str) -> str:
    return (
        "import time as _bench_time\n"
        "_bench_rec = {'w0': _bench_time.time(), 'p0': _bench_time.perf_counter()}\n"
        "_bench_out = None\n"
        "try:\n" + textwrap.indent(body.rstrip() + "\n", "    ") + "    _bench_rec['ok'] = True\n"
        "except BaseException as _bench_e:\n"
        "    import traceback as _bench_tb\n"
        "    _bench_rec['ok'] = False\n"
        "    _bench_rec['err'] = _bench_tb.format_exc()[-2500:]\n"
        "_bench_rec['p1'] = _bench_time.perf_counter()\n"
        "_bench_rec['w1'] = _bench_time.time()\n"
        "try:\n"
        "    _bench_rec['out'] = repr(_bench_out)[:400]\n"
        "    _bench_rec['out_list'] = ([list(v) if isinstance(v, tuple) else repr(v)[:80] for v in _bench_out]\n"
        "                              if isinstance(_bench_out, list) and len(_bench_out) <= 64 else None)\n"
        "except BaseException:\n"
        "    _bench_rec['out'] = '<unreprable>'\n"
    )


# -- stamp files -------------------------------------------------------------
def clear_stamps(sd: Path) -> None:
    for p in sd.iterdir():
        try:
            p.unlink()
        except OSError:
            pass


def read_stamps(sd: Path) -> tuple[list[float], list[float]]:
    starts, dones = [], []
    for p in sd.iterdir():
        try:
            v = float(p.read_text())
        except (OSError, ValueError):
            continue
        if p.name.startswith("start-"):
            starts.append(v)
        elif p.name.startswith("done-"):
            dones.append(v)
    return starts, dones


# -- processes ----------------------------------------------------------------
def kill_procs(procs: list[psutil.Process], grace: float = 3.0) -> list[int]:
    me = os.getpid()
    procs = [p for p in procs if p.pid != me]
    alive = []
    for p in procs:
        try:
            p.terminate()
            alive.append(p)
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive, timeout=grace)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still, timeout=grace)
    return [p.pid for p in alive]


def tagged_processes(var: str, value: str) -> list[psutil.Process]:
    """Processes whose environment carries var=value (set by this harness)."""
    found = []
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.environ().get(var) == value:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def reap(var: str, value: str, settle: float = 5.0) -> list[int]:
    """Kill what is left of a session.  Processes still shutting down on their
    own (engines, agents) get ``settle`` seconds first; returns the pids that
    had to be terminated."""
    procs = tagged_processes(var, value)
    if procs and settle > 0:
        _, procs = psutil.wait_procs(procs, timeout=settle)
    return kill_procs(procs)


# -- stats ----------------------------------------------------------------------
def summarize(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return None
    s = sorted(xs)
    p90 = s[max(0, math.ceil(0.9 * len(s)) - 1)]  # nearest-rank
    return {"n": len(s), "median": statistics.median(s), "p90": p90, "min": s[0], "max": s[-1], "all": xs}


def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
