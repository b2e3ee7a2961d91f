"""The kernel's end of the helper process: starting it, sending to it, reading from it.

One :class:`Helper` per running helper (``python -m air_magic.rank.zygote``), owned by the
:class:`~air_magic.kernel.launcher.Launcher`::

    Launcher --send(StartLaunch | Stop | Shutdown)--> socketpair --> helper
    Launcher <--on_message(helper, message)-- reader thread <-- (Ready, Started, Exited, ...)
    Launcher <--on_gone(helper)-- reader thread, at EOF (the helper exited or was killed)

The helper also holds the read end of the *alive* pipe; the kernel keeps the only
write end, so the kernel's death (even by SIGKILL) reaches the helper and every rank.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, Callable

from air_magic.accelerators import Hardware, detect_hardware
from air_magic.protocol import Shutdown, ToHelper, ToKernel, decode, encode

#: The folder air_magic is imported from (the helper imports it from there too).
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Helper:
    """The running helper process and the reader thread of its control channel: the
    local backend (:class:`air_magic.backends.base.Backend`)."""

    name = "local"
    local_processes = True

    def __init__(
        self,
        session_dir: str,
        shm_root: str | None,
        on_message: Callable[["Helper", ToKernel], None],
        on_gone: Callable[["Helper"], None],
    ) -> None:
        parent_sock, child_sock = socket.socketpair()
        alive_r, self.alive_w = os.pipe()  # both ends non-inheritable; passed explicitly below
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_PARENT, env.get("PYTHONPATH")]))
        env.pop("MPLBACKEND", None)
        log = open(os.path.join(session_dir, "helper.log"), "ab")
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "air_magic.rank.zygote",
                    str(child_sock.fileno()),
                    str(alive_r),
                    session_dir,
                    shm_root or "",
                ],
                pass_fds=(child_sock.fileno(), alive_r),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                cwd=session_dir,
            )
        finally:
            log.close()
            child_sock.close()
            os.close(alive_r)
        self.conn = Connection(parent_sock.detach())
        self.send_lock = threading.Lock()
        self.ready = threading.Event()  # its preload (torch) is done
        self.alive = True
        self._on_message = on_message
        self._on_gone = on_gone
        self.thread = threading.Thread(target=self._read, name="air_magic-helper-reader", daemon=True)
        self.thread.start()

    def send(self, message: ToHelper) -> None:
        """``OSError`` when the helper is gone."""
        with self.send_lock:
            self.conn.send(encode(message))

    def try_send(self, message: ToHelper) -> None:
        """Send if the helper is alive; a helper that went away just now is not an error."""
        if self.alive:
            try:
                self.send(message)
            except OSError:
                pass

    def returncode(self) -> int | None:
        return self.proc.poll()

    def hardware(self) -> Hardware:
        return detect_hardware()

    def waiting_for(self, world_size: int) -> str:
        if not self.ready.is_set():
            return "waiting for the helper process to import torch"
        return f"forking {world_size} rank{'s' * (world_size != 1)}"

    def stacks(self, launch_id: str, timeout: float) -> dict[int, str]:
        return {}  # local ranks are asked directly (Launch.stacks)

    def collectives(self, launch_id: str, ranks: list[int], how: str, timeout: float) -> dict[int, Any]:
        return {rank: None for rank in ranks}  # local ranks are asked directly (air_magic.kernel.inspect.collectives)

    def signal_ranks(self, launch_id: str, ranks: list[int], signum: int) -> None:
        pass  # local ranks are signalled directly (Launch.signal_ranks)

    def pool_started(self, launch_id: str) -> None:
        pass  # nothing is kept for a local pool

    def release_pool(self, launch_id: str) -> None:
        pass  # a pool's local ranks are the launch's: nothing else is kept

    def kernel_address(self) -> str:
        return "127.0.0.1"

    def _read(self) -> None:
        while True:
            try:
                wire = self.conn.recv()
            except (EOFError, OSError):
                break
            try:
                message = decode(wire)
            except ValueError:
                continue  # not a message of this version: ignored
            try:
                self._on_message(self, message)  # type: ignore[arg-type]
            except Exception as exc:  # pragma: no cover - a bug must not kill the reader
                sys.stderr.write(f"[air_magic] internal error handling {message.KIND!r}: {exc}\n")
        self.alive = False
        # The socket closes as the helper exits, a moment before its exit status can be read.
        try:
            self.proc.wait(2)
        except subprocess.TimeoutExpired:  # closed its end and lives on: said as "exit None"
            pass
        self._on_gone(self)

    def close(self, wait: float = 3.0) -> None:
        # EOF on the alive pipe first: a helper still importing torch leaves at once,
        # and ranks take themselves down even before the helper's own shutdown.
        try:
            os.close(self.alive_w)
        except OSError:
            pass
        self.try_send(Shutdown())
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            self.conn.close()
        except OSError:
            pass
        if threading.current_thread() is not self.thread:
            self.thread.join(2)
