"""One rank's agent on a Ray node: a Ray actor that starts the rank and reports on it.

The kernel's Ray backend (:mod:`air_magic._ray_backend`) places one :class:`RankAgent` per
rank in a placement group; each agent, on the node Ray chose::

    node()        where it runs: node id, address, pid, the GPUs Ray gave it
    free_port()   a free port on its node (rank 0's: MASTER_PORT)
    start(...)    a private folder, the payload, the request with this node's paths; the rank
                  as a fresh ``python -m air_magic._ray_rank`` (what torchrun starts)
    poll(run)     new bytes of the rank's log and of its MLflow spool file, and its exit code
                  once it has ended (the kernel copies them into its own files: the kernel
                  stays the only MLflow writer, the panel reads them as for local ranks)
    finish()      the result record and the rank's MLflow artifacts; the folder is removed
    signal(sig)   to the rank's process group (stop: SIGINT, SIGTERM, SIGKILL)
    stacks()      the rank's Python stacks (faulthandler, as for local ranks)

The rank holds the read end of a pipe whose only write end is in the agent: when Ray kills
the agent (its owner, the kernel's driver, is gone; ``ray.kill``), the rank's process group
gets SIGIO and ends.  This module imports nothing of the kernel side; it imports ``ray``
only inside the methods, which run in Ray's worker processes.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from ._protocol import STACK_SIGNAL, LaunchRequest, log_path, payload_path, result_path, spool_file, stack_path
from ._spool import SPOOL_DIR_ENV, artifact_dir, publish_run

#: The most bytes of a log one poll returns (the rest comes with the next).
CHUNK = 1 << 20

#: Variables that describe the machine a process runs on, not the user's launch: a rank on
#: another node keeps its node's values (or has none) instead of the kernel's.
MACHINE_VARIABLES = frozenset(
    {
        "PATH",
        "LD_LIBRARY_PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "HOSTNAME",
        "SHELL",
        "PWD",
        "OLDPWD",
        "TMPDIR",
        "PYTHONHOME",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "CONDA_DEFAULT_ENV",
        "CUDA_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "SSH_AUTH_SOCK",
        "SSH_CONNECTION",
        "SSH_CLIENT",
        "XDG_RUNTIME_DIR",
        "DISPLAY",
    }
)


def node_environment(kernel_env: dict[str, str], node_env: dict[str, str]) -> dict[str, str]:
    """The kernel's environment for a rank on a node: the user's variables as in the
    kernel, the machine's (``PATH``, ``HOME``, visible devices...) and Ray's as on the node."""
    env = {k: v for k, v in kernel_env.items() if k not in MACHINE_VARIABLES and not k.startswith("RAY_")}
    env.update({k: v for k, v in node_env.items() if k in MACHINE_VARIABLES or k.startswith("RAY_")})
    return env


class RankAgent:
    """The agent of one rank (a Ray actor: see the module's docstring)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.folder: str | None = None
        self.alive_w: int | None = None
        self.log_path = ""
        self.spool_path: str | None = None
        self.spool_folder: str | None = None
        self.rank = 0
        self.offsets = {"log": 0, "spool": 0}
        self.returncode: int | None = None
        self.run_published = False

    # -- where -------------------------------------------------------------------------

    def node(self) -> dict[str, Any]:
        import ray  # type: ignore[import-not-found]

        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        }

    def free_port(self) -> int:
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((ray.util.get_node_ip_address(), 0))
            return int(sock.getsockname()[1])

    # -- the rank ----------------------------------------------------------------------

    def start(self, request: LaunchRequest, payload: bytes, rank: int, port: int) -> int:
        """Start ``rank`` of ``request`` on this node; its pid."""
        self.rank = rank
        self.folder = folder = tempfile.mkdtemp(prefix=f"air_magic-{request.launch_id}-r{rank}-")
        os.mkdir(os.path.join(folder, "logs"), mode=0o700)
        with open(os.open(payload_path(folder), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
            handle.write(payload)
        self.log_path = log_path(os.path.join(folder, "logs"), rank)
        env = node_environment(request.env, dict(os.environ))
        if SPOOL_DIR_ENV in env:  # tracking is on: the rank's calls go to a spool of this node
            self.spool_folder = os.path.join(folder, "spool")
            os.mkdir(self.spool_folder, mode=0o700)
            env[SPOOL_DIR_ENV] = self.spool_folder
            self.spool_path = spool_file(self.spool_folder, rank)
        cwd = request.cwd if os.path.isdir(request.cwd) else folder
        # The kernel's sys.path where it exists here, then this interpreter's own.
        sys_path = [p for p in request.sys_path if os.path.exists(p)]
        sys_path += [p for p in sys.path if p and p not in sys_path]
        local = dataclasses.replace(
            request,
            env=env,
            cwd=cwd,
            sys_path=sys_path,
            payload_path=payload_path(folder),
            work_dir=folder,
            shm_dir=None,  # the result travels back through Ray, pickled whole
            log_paths=[self.log_path if r == rank else os.devnull for r in range(request.world_size)],
            private_rendezvous=False,
        )
        request_file = os.path.join(folder, "request.pkl")
        with open(os.open(request_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
            pickle.dump(local, handle)
        alive_r, self.alive_w = os.pipe()
        early = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            command = [sys.executable, "-m", "air_magic._ray_rank", request_file, str(rank), str(port), str(alive_r)]
            self.proc = subprocess.Popen(
                command,
                pass_fds=(alive_r,),
                stdin=subprocess.DEVNULL,
                stdout=early,  # until the rank sends its output to the log itself
                stderr=early,
                cwd=cwd,
                env={**env, "PYTHONPATH": os.pathsep.join(sys_path)},
            )
        finally:
            os.close(alive_r)
            os.close(early)
        return self.proc.pid

    def poll(self, run: str | None = None) -> tuple[bytes, bytes, int | None]:
        """New log bytes, new spool bytes, and the exit code once the rank has ended (then
        every byte has been returned).  ``run``: the launch's MLflow run id, once made."""
        if run and not self.run_published and self.spool_folder:
            publish_run(self.spool_folder, run)
            self.run_published = True
        ended = self._ended()
        log = self._read("log", self.log_path)
        spool = self._read("spool", self.spool_path) if self.spool_path else b""
        if ended and (len(log) >= CHUNK or len(spool) >= CHUNK):
            ended = False  # more to send first
        return log, spool, self.returncode if ended else None

    def _ended(self) -> bool:
        if self.returncode is not None or self.proc is None:
            return self.returncode is not None
        pid = self.proc.pid
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            return False
        # Still a zombie, so its group id cannot be reused yet: end what it left behind.
        _killpg(pid, signal.SIGKILL)
        self.returncode = self.proc.wait()
        return True

    def _read(self, which: str, path: str | None) -> bytes:
        if path is None:
            return b""
        try:
            with open(path, "rb") as handle:
                handle.seek(self.offsets[which])
                data = handle.read(CHUNK)
        except FileNotFoundError:
            return b""
        self.offsets[which] += len(data)
        return data

    def finish(self) -> tuple[bytes | None, dict[str, bytes]]:
        """The rank's result record (None if it wrote none) and its MLflow artifacts
        (``{relative path: bytes}``); the rank's folder is removed."""
        result = None
        artifacts: dict[str, bytes] = {}
        if self.folder is not None:
            try:
                with open(result_path(self.folder, self.rank), "rb") as handle:
                    result = handle.read()
            except FileNotFoundError:
                pass
            if self.spool_folder:
                root = artifact_dir(self.spool_folder, self.rank)
                for dirpath, _, files in os.walk(root):
                    for name in files:
                        path = os.path.join(dirpath, name)
                        with open(path, "rb") as handle:
                            artifacts[os.path.relpath(path, root)] = handle.read()
        self.close()
        return result, artifacts

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.returncode is None:
            _killpg(self.proc.pid, signum)

    def stacks(self, grace: float = 0.5) -> str:
        """Every thread's Python stack of the running rank ('' if it has ended)."""
        if self.proc is None or self.returncode is not None or self.folder is None:
            return ""
        path = stack_path(self.folder, self.rank)
        try:
            os.truncate(path, 0)
            os.kill(self.proc.pid, STACK_SIGNAL)
        except OSError:
            return ""
        time.sleep(grace)
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    def close(self) -> None:
        """Kill the rank if it still runs; remove its folder."""
        if self.proc is not None and self.returncode is None:
            _killpg(self.proc.pid, signal.SIGKILL)
            self.returncode = self.proc.wait()
        if self.alive_w is not None:
            os.close(self.alive_w)
            self.alive_w = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


def _killpg(pid: int, signum: int) -> None:
    """To the rank's group (its own, once it has called setsid) and to the rank itself
    (in case it has not yet)."""
    for send in (os.killpg, os.kill):
        try:
            send(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
