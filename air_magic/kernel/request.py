"""What a launch's ranks inherit from the kernel, taken at the moment of the launch.

The kernel's environment, working directory, ``sys.path``, umask and soft resource
limits as they are now (not as they were when the helper started) go into the
:class:`~air_magic.protocol.LaunchRequest` the helper forks the ranks with::

    Launch + Payload + the kernel's state now --request()--> LaunchRequest --> helper --> ranks
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from air_magic.errors import LaunchError
from air_magic.kernel.inspect.debugger import post_mortem_on
from air_magic.protocol import LAUNCH_ID_ENV, LaunchRequest
from air_magic.protocol.debugging import BACKGROUND_WAIT, BREAKPOINT_WAIT_ENV, POSTMORTEM_ENV
from air_magic.settings import settings

if TYPE_CHECKING:
    from air_magic.capture import Payload
    from air_magic.kernel.launch import Launch


def request(launch: "Launch", payload: "Payload", env: dict[str, str], cwd: str, payload_file: str) -> LaunchRequest:
    """The helper's request for ``launch`` (its folders and payload file are made)."""
    return LaunchRequest(
        launch_id=launch.id,
        world_size=launch.world_size,
        env=env,
        cwd=cwd,
        sys_path=[p if p else cwd for p in sys.path],
        payload_path=payload_file,
        work_dir=launch.work_dir,
        shm_dir=launch.shm_dir,
        log_paths=launch.log_paths,
        timeout=launch.spec.timeout,
        sources=payload.sources,
        argv=payload.argv,
        umask=current_umask(),
        rlimits=soft_limits(),
        device=launch.placement.device,
        pool=payload.kind == "pool",
        rank_env=dict(launch.rank_env) or None,
    )


def rank_environment(launch: "Launch") -> dict[str, str]:
    """The environment of the launch's ranks: the kernel's now, with what a rank needs."""
    env = dict(os.environ)
    # The kernel's inline plotting backend means nothing in a rank.
    if env.get("MPLBACKEND", "").startswith("module://"):
        env["MPLBACKEND"] = "Agg"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if launch.world_size > 1:  # torchrun's rule: one thread per rank unless set
        env.setdefault("OMP_NUM_THREADS", "1")
    env[LAUNCH_ID_ENV] = launch.id
    # torch's Flight Recorder: what the hang report and a pool's Ctrl-C read of a rank's
    # collectives (the user's own setting of it wins).
    recorded = settings.flight_recorder
    if recorded and not (env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE")):
        env["TORCH_FR_BUFFER_SIZE"] = str(recorded)
    if post_mortem_on():  # %pdb on: a rank that raises opens pdb in its frames first
        env[POSTMORTEM_ENV] = "1"
    if launch.background:  # a breakpoint waits for launch.debug() a while
        env.setdefault(BREAKPOINT_WAIT_ENV, str(BACKGROUND_WAIT))
    if launch.placement.device == "cpu":
        # DeepSpeed reads DS_ACCELERATOR (else it looks for a GPU); ACCELERATE_USE_CPU
        # is what `accelerate launch --cpu` sets: without it the Hugging Face Trainer
        # runs every CPU rank on its own instead of joining them with gloo.
        env.setdefault("DS_ACCELERATOR", "cpu")
        env.setdefault("ACCELERATE_USE_CPU", "true")
        if launch.placement.hardware.gpu_count:
            env["CUDA_VISIBLE_DEVICES"] = ""  # CPU ranks asked for on a GPU machine
    return env


def working_directory() -> str:
    """The kernel's working directory (the ranks start in it); it must still exist."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        raise LaunchError(
            "the notebook's working directory no longer exists (it was deleted or moved), and the "
            "ranks start in it. Change to a folder that exists first, e.g. %cd ~ (or os.chdir(...))."
        ) from None


def current_umask() -> int | None:
    """The kernel's umask, read without changing it (another thread may be creating files)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def soft_limits() -> dict[str, int]:
    """The kernel's soft resource limits now, by name (a rank takes them as its own)."""
    import resource

    limits = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                limits[name] = resource.getrlimit(getattr(resource, name))[0]
            except (OSError, ValueError):
                pass
    return limits
