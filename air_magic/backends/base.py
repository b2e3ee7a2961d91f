"""What runs a launch's ranks: the interface every backend implements.

The :class:`~air_magic.kernel.launcher.Launcher` and the :class:`~air_magic.kernel.launch.Launch` handle
talk to a backend in the messages of :mod:`air_magic.protocol` only::

    launcher --send(StartLaunch(request) | Stop(launch_id, reason) | Shutdown())--> backend
    launcher <--on_message(backend, Started | Exited | Stopping | Done | StartFailed)-- backend
    launcher <--on_gone(backend)-- backend, when it can no longer run anything

and a backend leaves in the launch's folder what a local rank leaves there: each rank's log
(``LaunchRequest.log_paths``), its result record (``result_path``) before its ``Exited``, and
its MLflow spool lines in the spool folder the request's environment names.  Fronts,
tracking and the panel read those files and see every backend alike.

Two backends exist: the local helper process (:class:`air_magic.backends.local.Helper`, ranks
forked on this machine) and Ray (:class:`air_magic.backends.ray.backend.RayBackend`, ranks as
actors on a cluster's nodes).  Another engine (Slurm, Kubernetes) is a third class with
these members, chosen by ``LaunchSpec.backend`` in :meth:`Launcher.backend_for`.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from air_magic.accelerators import Hardware
from air_magic.protocol import ToHelper


class Backend(Protocol):
    """The members a backend has (see the module's docstring)."""

    #: ``LaunchSpec.backend``'s value for it.
    name: str
    #: Whether its ranks are processes of this machine: the kernel then signals them
    #: directly (stacks, a second interrupt) and the panel samples their CPU and memory.
    local_processes: bool
    #: Set once it can start ranks (the helper has imported torch; Ray is connected).
    ready: threading.Event
    #: False once it is gone (its launches are ended by ``on_gone``).
    alive: bool

    def send(self, message: ToHelper) -> None:
        """Deliver a message; ``OSError`` if the backend is gone."""

    def try_send(self, message: ToHelper) -> None:
        """Deliver a message if the backend is still there."""

    def returncode(self) -> int | None:
        """The exit code of a backend process that has ended, else None."""

    def close(self) -> None:
        """Stop every rank it runs and let go of everything it holds."""

    def hardware(self) -> Hardware:
        """What a launch may ask of it (GPUs, CPU cores), for ``LaunchSpec.resolve``."""

    def waiting_for(self, world_size: int) -> str:
        """What a launch of ``world_size`` ranks that has not started yet waits for."""

    def stacks(self, launch_id: str, timeout: float) -> dict[int, str]:
        """The running ranks' Python stacks by rank, also written to each rank's stack file
        in the launch's folder (only asked of backends whose ranks are not local processes)."""

    def collectives(self, launch_id: str, ranks: list[int], how: str, timeout: float) -> dict[int, Any]:
        """Each of these ranks' Flight Recorder, as :func:`air_magic.protocol.ask_for_collectives`
        asks it (None for a rank that did not answer; only asked of backends whose ranks are not
        local processes: the kernel asks local ranks itself)."""

    def signal_ranks(self, launch_id: str, ranks: list[int], signum: int) -> None:
        """Send ``signum`` to these running ranks of a launch (only asked of backends whose
        ranks are not local processes: the kernel signals local ranks itself)."""

    def pool_started(self, launch_id: str) -> None:
        """Every rank of the pool's launch ``launch_id`` is up (Ray: its agents start the
        spare rank processes a launch between the pool's calls will take)."""

    def release_pool(self, launch_id: str) -> None:
        """The pool whose latest launch is ``launch_id`` closed: let go of what the backend
        kept for it (Ray: its agents and their placement group)."""

    def kernel_address(self) -> str:
        """The address of this machine that the backend's ranks reach it at (a pool's ranks
        connect to the kernel there)."""
