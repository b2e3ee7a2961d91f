"""One rank's agent on a Ray node: a Ray actor that starts the rank and reports on it.

The kernel's Ray backend (:mod:`air_magic.backends.ray.backend`) places one :class:`RankAgent` per
rank in a placement group; each agent, on the node Ray chose::

    node()        where it runs: node id, address, pid, the GPUs Ray gave it
    free_port()   a free port on its node (rank 0's: MASTER_PORT)
    start(...)    a private folder (and one in the node's ``/dev/shm``), the payload, the
                  request with this node's paths; the rank as a fresh
                  ``python -m air_magic.backends.ray.rank_entry`` (what torchrun starts)
    poll(run)     new bytes of the rank's log and of its MLflow spool file, and its exit code
                  once it has ended (the kernel copies them into its own files: the kernel
                  stays the only MLflow writer, the panel reads them as for local ranks)
    finish()      the result record, its large tensors' bytes and the rank's MLflow
                  artifacts; the folders are removed
    signal(sig)   to the rank's process group (stop: SIGINT, SIGTERM, SIGKILL)
    stacks()      the rank's Python stacks (faulthandler, as for local ranks)

A rank writes the large tensors of its return value as a local rank does
(:mod:`air_magic.rank.results`): each to a file of its own, in the agent's folder in the node's
``/dev/shm`` (in its private folder where that has no room), the record holding their names.
``finish()`` returns each file as a NumPy array of bytes mapped from it (the file is
unlinked at once), so Ray stores it as a raw buffer beside the small record (pickle
protocol 5, out of band) instead of inside a pickle, and the kernel's ``ray.get`` maps it
from its own node's object store without a copy; the kernel writes it once, under its name,
into the launch's folders, where the record finds it.

The rank holds the read end of a pipe whose only write end is in the agent: when Ray kills
the agent (its owner, the kernel's driver, is gone; ``ray.kill``), the rank's process group
gets SIGIO and ends.  An agent killed so cannot remove its folders: each agent holds a lock
on its own (``flock``, released by the kernel of the node when the process dies, however it
dies), and the next agent that starts on the node removes those whose lock is free.  This
module imports nothing of the kernel side; it imports ``ray`` and NumPy only inside the
methods, which run in Ray's worker processes.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import mmap
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

from air_magic.protocol import (
    THREAD_ANSWER_SECONDS,
    LaunchRequest,
    ask_for_collectives,
    ask_for_stacks,
    collectives_path,
    log_path,
    payload_path,
    result_path,
    signal_rank,
    spool_file,
    stack_path,
)
from air_magic.protocol.spool import SPOOL_DIR_ENV, artifact_dir, publish_run
from air_magic.rank import results as _results
from air_magic.settings import settings

#: The most bytes of a log one poll returns (the rest comes with the next).
CHUNK = 1 << 20

#: How an agent's folders are named (in the node's temp folder and in its ``/dev/shm``).
FOLDER_PREFIX = "air_magic-ray-"
#: A folder younger than this is never removed as a dead agent's (its agent may not hold
#: its lock yet).
_SWEEP_AGE = 60.0

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


class _Rank:
    """One rank an agent started: its process, folders, log and spool offsets."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.proc: subprocess.Popen[bytes] | None = None
        self.folder: str | None = None
        self.shm_folder: str | None = None  # where the rank's large result tensors go
        self.spare_folder: str | None = None  # the spare process's, when the rank is one
        self.locks: list[int] = []  # one descriptor a folder, holding its lock
        self.alive_w: int | None = None
        self.log_path = ""
        self.spool_path: str | None = None
        self.spool_folder: str | None = None
        self.offsets = {"log": 0, "spool": 0}
        self.returncode: int | None = None
        self.run_published = False


class _Spare:
    """A rank process started ahead (``rank_entry --spare``): it has imported torch and
    waits for the launch it is to run, so a launch on warm agents does not pay that."""

    def __init__(self) -> None:
        self.alive_r, self.alive_w = os.pipe()
        self.folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}spare-")
        self.lock = claim(self.folder)
        early = os.open(os.path.join(self.folder, "early.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "air_magic.backends.ray.rank_entry", "--spare", str(self.alive_r)],
                pass_fds=(self.alive_r,),
                stdin=subprocess.PIPE,
                stdout=early,
                stderr=early,
                cwd=self.folder,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            )
        finally:
            os.close(self.alive_r)
            os.close(early)

    def take(self, request_file: str, rank: int, port: int) -> subprocess.Popen[bytes] | None:
        """The spare, told to run ``rank`` of the request; None if it is gone."""
        assert self.proc.stdin is not None
        if self.proc.poll() is not None:
            return None
        try:
            self.proc.stdin.write(f"{request_file}\t{rank}\t{port}\n".encode())
            self.proc.stdin.close()
        except OSError:
            return None
        return self.proc

    def close(self) -> None:
        if self.proc.poll() is None:
            signal_rank(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for fd in (self.alive_w, self.lock):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.folder, ignore_errors=True)


class RankAgent:
    """The agent of one bundle (a Ray actor: see the module's docstring).  It runs one rank
    of a launch at a time, or, for agents a pool keeps, the pool's rank and one rank of a
    launch that borrows them between the pool's calls: each is named by its launch's id."""

    def __init__(self) -> None:
        self.ranks: dict[str, _Rank] = {}
        self.spare: _Spare | None = None

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

    def prepare_spare(self) -> None:
        """Start a spare rank process, if none waits (a kept agent's next launch takes it)."""
        if self.spare is not None and self.spare.proc.poll() is None:
            return
        if self.spare is not None:
            self.spare.close()
        self.spare = _Spare()

    def start(self, request: LaunchRequest, payload: bytes, rank: int, port: int) -> int:
        """Start ``rank`` of ``request`` on this node; its pid."""
        state = self.ranks[request.launch_id] = _Rank(rank)
        prefix = f"{FOLDER_PREFIX}{request.launch_id}-r{rank}-"
        shm: str | None = settings.shm_dir
        if not (shm and os.path.isdir(shm) and os.access(shm, os.W_OK)):
            shm = None
        for parent in (tempfile.gettempdir(), shm):
            if parent is not None:
                sweep(parent)
        state.folder = folder = tempfile.mkdtemp(prefix=prefix)
        state.locks.append(claim(folder))
        if shm is not None:
            state.shm_folder = tempfile.mkdtemp(prefix=prefix, dir=shm)
            state.locks.append(claim(state.shm_folder))
        os.mkdir(os.path.join(folder, "logs"), mode=0o700)
        with open(os.open(payload_path(folder), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
            handle.write(payload)
        state.log_path = log_path(os.path.join(folder, "logs"), rank)
        env = node_environment(request.env, dict(os.environ))
        if SPOOL_DIR_ENV in env:  # tracking is on: the rank's calls go to a spool of this node
            state.spool_folder = os.path.join(folder, "spool")
            os.mkdir(state.spool_folder, mode=0o700)
            env[SPOOL_DIR_ENV] = state.spool_folder
            state.spool_path = spool_file(state.spool_folder, rank)
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
            # Large tensors: a file each, in shared memory if it has room, else in the folder.
            shm_dir=state.shm_folder or folder,
            log_paths=[state.log_path if r == rank else os.devnull for r in range(request.world_size)],
            private_rendezvous=False,
        )
        request_file = os.path.join(folder, "request.pkl")
        with open(os.open(request_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as handle:
            pickle.dump(local, handle)
        spare, self.spare = self.spare, None
        if spare is not None:  # started ahead: it has imported torch already
            state.proc = spare.take(request_file, rank, port)
            if state.proc is not None:
                state.alive_w = spare.alive_w
                state.locks.append(spare.lock)
                state.spare_folder = spare.folder  # its output until the rank's own log: removed at the end
                return state.proc.pid
            spare.close()
        alive_r, state.alive_w = os.pipe()
        early = os.open(state.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            command = [
                sys.executable,
                "-m",
                "air_magic.backends.ray.rank_entry",
                request_file,
                str(rank),
                str(port),
                str(alive_r),
            ]
            state.proc = subprocess.Popen(
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
        return state.proc.pid

    def poll(self, launch_id: str, run: str | None = None) -> tuple[bytes, bytes, int | None]:
        """New log bytes, new spool bytes, and the exit code once the rank has ended (then
        every byte has been returned).  ``run``: the launch's MLflow run (``spool.run_text``), once made."""
        state = self.ranks[launch_id]
        if run and not state.run_published and state.spool_folder:
            publish_run(state.spool_folder, run)
            state.run_published = True
        ended = _ended(state)
        log = _read(state, "log", state.log_path)
        spool = _read(state, "spool", state.spool_path) if state.spool_path else b""
        if ended and (len(log) >= CHUNK or len(spool) >= CHUNK):
            ended = False  # more to send first
        return log, spool, state.returncode if ended else None

    def finish(self, launch_id: str) -> tuple[bytes | None, dict[str, Any], dict[str, bytes]]:
        """The rank's result record (None if it wrote none), the files of its large tensors
        (``{name: NumPy array of their bytes}``: raw buffers for Ray) and its MLflow artifacts
        (``{relative path: bytes}``); the rank's folders are removed."""
        state = self.ranks.get(launch_id)
        result = None
        tensors: dict[str, Any] = {}
        artifacts: dict[str, bytes] = {}
        if state is not None and state.folder is not None:
            try:
                with open(result_path(state.folder, state.rank), "rb") as handle:
                    result = handle.read()
            except FileNotFoundError:
                pass
            if result is not None:
                tensors = take_tensor_files((state.shm_folder, state.folder), _results.rank_prefix(state.rank))
            if state.spool_folder:
                root = artifact_dir(state.spool_folder, state.rank)
                for dirpath, _, files in os.walk(root):
                    for name in files:
                        path = os.path.join(dirpath, name)
                        with open(path, "rb") as handle:
                            artifacts[os.path.relpath(path, root)] = handle.read()
        self.end(launch_id)
        return result, tensors, artifacts

    def signal(self, launch_id: str, signum: int) -> None:
        state = self.ranks.get(launch_id)
        if state is not None and state.proc is not None and state.returncode is None:
            signal_rank(state.proc.pid, signum)

    def stacks(self, launch_id: str, grace: float = 0.5) -> str:
        """Every thread's Python stack of the running rank ('' if it has ended)."""
        state = self.ranks.get(launch_id)
        if state is None or state.proc is None or state.returncode is not None or state.folder is None:
            return ""
        path = stack_path(state.folder, state.rank)
        if not ask_for_stacks(state.folder, state.rank, state.proc.pid):
            return ""
        time.sleep(min(grace, THREAD_ANSWER_SECONDS))
        if not os.path.exists(path) or not os.path.getsize(
            path
        ):  # the rank's thread did not answer (a C call holds the GIL)
            ask_for_stacks(state.folder, state.rank, state.proc.pid, by_signal=True)
            time.sleep(max(0.0, grace - THREAD_ANSWER_SECONDS))
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    def collectives(self, launch_id: str, how: str, grace: float) -> dict[str, Any] | None:
        """What torch's Flight Recorder holds in the running rank (its stack thread answers
        ``how``: :func:`air_magic.protocol.ask_for_collectives`); None when it cannot say."""
        state = self.ranks.get(launch_id)
        if state is None or state.proc is None or state.returncode is not None or state.folder is None:
            return None
        token = ask_for_collectives(state.folder, state.rank, how)
        if token is None:
            return None
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                with open(collectives_path(state.folder, state.rank), encoding="utf-8") as handle:
                    data = json.load(handle)
            except (OSError, ValueError):
                data = None
            if isinstance(data, dict) and data.get("token") == token:
                return data if data.get("recorded") else None
            time.sleep(0.01)
        return None

    def end(self, launch_id: str) -> None:
        """Kill the launch's rank if it still runs; remove its folders."""
        state = self.ranks.pop(launch_id, None)
        if state is None:
            return
        if state.proc is not None and state.returncode is None:
            signal_rank(state.proc.pid, signal.SIGKILL)
            state.returncode = state.proc.wait()
        if state.alive_w is not None:
            os.close(state.alive_w)
            state.alive_w = None
        for folder in (state.folder, state.shm_folder, state.spare_folder):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        state.folder = state.shm_folder = state.spare_folder = None
        for fd in state.locks:
            os.close(fd)
        state.locks = []

    def close(self) -> None:
        """End every rank of this agent, and its spare."""
        for launch_id in list(self.ranks):
            self.end(launch_id)
        if self.spare is not None:
            self.spare.close()
            self.spare = None


def _ended(state: _Rank) -> bool:
    if state.returncode is not None or state.proc is None:
        return state.returncode is not None
    pid = state.proc.pid
    if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        return False
    # Still a zombie, so its group id cannot be reused yet: end what it left behind.
    signal_rank(pid, signal.SIGKILL)
    state.returncode = state.proc.wait()
    if state.returncode != 0 and state.spare_folder is not None:
        # A spare that failed: what it wrote before the rank's log was its own is said there.
        try:
            with open(os.path.join(state.spare_folder, "early.log"), "rb") as early:
                text = early.read()[-CHUNK:]
            with open(state.log_path, "ab") as log:
                log.write(text)
        except OSError:
            pass
    return True


def _read(state: _Rank, which: str, path: str | None) -> bytes:
    if path is None:
        return b""
    try:
        with open(path, "rb") as handle:
            handle.seek(state.offsets[which])
            data = handle.read(CHUNK)
    except FileNotFoundError:
        return b""
    state.offsets[which] += len(data)
    return data


def take_tensor_files(folders: tuple[str | None, ...], prefix: str) -> dict[str, Any]:
    """The tensor files a rank wrote (:func:`air_magic.rank.results.tensor_files`), each as a
    read-only NumPy array of bytes mapped from it; the files are unlinked (the mappings
    stay valid until the arrays are gone).  Pickled with protocol 5, such an array is a
    buffer of its own, out of the pickle's bytes: what Ray keeps as a raw buffer."""
    import numpy

    taken: dict[str, Any] = {}
    for name, path in _results.tensor_files(folders, prefix).items():
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            size = os.fstat(fd).st_size
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else b""
        finally:
            os.close(fd)
            os.unlink(path)
        taken[name] = numpy.frombuffer(mapped, dtype=numpy.uint8)
    return taken


def claim(folder: str) -> int:
    """Lock ``folder`` for as long as this process lives (the descriptor that holds the lock)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def sweep(parent: str, min_age: float = _SWEEP_AGE) -> list[str]:
    """Remove the folders in ``parent`` of agents that died without removing them (killed
    with their driver, or their node restarted): an agent's folder whose lock is free and
    that is older than ``min_age`` seconds.  The paths removed."""
    removed: list[str] = []
    try:
        names = [name for name in os.listdir(parent) if name.startswith(FOLDER_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(parent, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # not a folder, gone, or another user's
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < min_age or os.fstat(fd).st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # its agent is alive
                continue
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed
