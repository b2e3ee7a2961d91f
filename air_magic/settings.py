"""The kernel-wide settings of air_magic: one object, :data:`settings`.

Each setting is read from its ``AIR_MAGIC_*`` environment variable *when it is used*
(so ``%env`` after ``import air_magic`` counts, and a bad value never breaks the
import); :meth:`Settings.check` reads them all before a launch starts anything, so a bad
value is that launch's ``ConfigurationError``, never an error inside a running one; unless a value was set on the object: ``%config DistributedMagics.<trait>``
writes ``capture_warn_mb`` and ``panel`` here, and then wins over the environment.

===============================  ===========================================================
Environment variable             Setting (default)
===============================  ===========================================================
``AIR_MAGIC_CAPTURE_WARN_MB``    ``capture_warn_mb``: warn when a captured object pickles
                                 to more MB than this (100); a bad value is a
                                 ``ConfigurationError`` at the launch that reads it
``AIR_MAGIC_PANEL``              ``panel_mode``: ``auto`` (default), ``0``/``off``/``false``/
                                 ``no``/``none`` (no panel), ``text``/``plain``,
                                 ``widget``/``widgets``; ``panel``: the
                                 ``%config DistributedMagics.panel`` switch (True)
``AIR_MAGIC_WARM``               ``warm``: start the helper and MLflow's store early, and
                                 load the panel and the linter (``1``; ``0`` leaves it
                                 to the first launch)
``AIR_MAGIC_OUTPUT_LIMIT``       ``output_limit``: bytes of rank 0's output copied into the
                                 cell per launch (1 MiB; a whole number of bytes)
``AIR_MAGIC_STALL_SECONDS``      ``stall_seconds``: seconds without output before the ranks'
                                 stacks are looked at (300; 0: never)
``AIR_MAGIC_HANG_SECONDS``       ``hang_seconds``: seconds without a completed collective, while
                                 a rank waits in one, before the cell shows a hang report (5;
                                 0: never)
``AIR_MAGIC_GPU_BUSY_MIB``       ``gpu_busy_mib``: MiB of a GPU's memory processes outside
                                 air_magic may use before a launch's claim counts the GPU as
                                 busy (1024)
``AIR_MAGIC_GPU_CLAIMS``         ``gpu_claims``: ``on`` (default): a GPU launch claims its GPUs
                                 (a lock on each device node) and is refused where they cannot
                                 be claimed safely; ``off``: it runs unclaimed, other notebooks
                                 may land on the same GPUs
``AIR_MAGIC_REGISTRY``           the machine's list of launches and pools (``air-magic ps``,
                                 the sidebar): ``/tmp/air-magic-launches``, one for the machine
                                 whatever TMPDIR says; read by :mod:`air_magic.protocol.registry`
``AIR_MAGIC_DEVICE_NODES``       where the GPUs' device nodes are (``/dev``; tests put files
                                 standing in for them elsewhere); read by
                                 :mod:`air_magic.protocol.gpu_locks`
``AIR_MAGIC_LOG_LIMIT``          ``log_limit``: bytes of each rank's log kept after a launch
                                 (16 MiB; a whole number of bytes)
``AIR_MAGIC_SHM_DIR``            ``shm_dir``: where large result tensors travel (``/dev/shm``;
                                 on a Ray node, as the node's environment sets it)
``AIR_MAGIC_MAX_CPU_RANKS``      ``max_cpu_ranks(cores)``: the most CPU ranks a launch may
                                 start (4 per usable core)
``AIR_MAGIC_PRELOAD``            ``preload``: modules the helper imports at start, comma
                                 separated (torch and its distributed, nn, optim, data);
                                 read by the helper process
``AIR_MAGIC_LOG_DIR``            ``log_dir``: where each launch's logs are kept after the kernel
                                 exits (``$XDG_CACHE_HOME/air_magic/logs``, else
                                 ``~/.cache/air_magic/logs``)
``AIR_MAGIC_LOG_KEEP_DAYS``      ``log_keep_days``: launch logs older than this are pruned (14)
``AIR_MAGIC_LOG_KEEP_MB``        ``log_keep_mb``: the oldest launch logs are pruned past this
                                 total (1024)
``AIR_MAGIC_STATE_DIR``          ``state_dir``: state that outlives a kernel (``None``:
                                 ``$XDG_STATE_HOME/air_magic``, else
                                 ``~/.local/state/air_magic``)
``AIR_MAGIC_RAY_STRATEGY``       ``ray_strategy``: how a Ray launch's ranks are placed on the
                                 cluster's nodes: ``PACK`` (default: as few nodes as
                                 possible), ``SPREAD``, ``STRICT_PACK``, ``STRICT_SPREAD``
``AIR_MAGIC_RAY_PLACE_TIMEOUT``  ``ray_place_timeout``: seconds a Ray launch waits for the
                                 cluster to have room for its ranks (60)
``AIR_MAGIC_FLIGHT_RECORDER``    ``flight_recorder``: collectives torch's Flight Recorder keeps
                                 per rank (2000; 0: off), for the hang report and a pool's
                                 Ctrl-C; a ``TORCH_FR_BUFFER_SIZE`` of the user's wins
``AIR_MAGIC_ON_BREAKPOINT``      ``on_breakpoint``: what a breakpoint in a rank does: ``prompt``
                                 (default: a pdb prompt in the waiting cell; skipped with
                                 one line where there is no stdin), ``skip``, or ``error``
                                 (the rank fails where there is no stdin, or always)
``AIR_MAGIC_BREAKPOINT_WAIT``    seconds a rank of a background launch (``.submit()``,
                                 ``--async``) waits at a breakpoint for ``launch.debug()``
                                 (300); read by the rank
===============================  ===========================================================

Set by air_magic for its own child processes, not settings: ``AIR_MAGIC_TRACKING_DIR``
(a launch's spool folder), ``AIR_MAGIC_RUN_WAIT`` (how long a rank waits for the
launch's MLflow run), ``AIR_MAGIC_LAUNCH_ID``, ``AIR_MAGIC_MLFLOW_RUN_ID``,
``AIR_MAGIC_POSTMORTEM`` (the kernel has ``%pdb on``: a rank that raises opens pdb first) and
``AIR_MAGIC_POOL`` (set in a pool's ranks, so code can tell it runs in one).  Two switches
for comparisons and for a store or package that misbehaves, read where they act:
``AIR_MAGIC_STORE_TEMPLATE=0`` (MLflow makes every new sqlite store itself, no copy of the
empty store in the user's cache) and ``AIR_MAGIC_LAZY_MLFLOW=0`` (a rank's ``import mlflow``
imports the real package at once, no stand-in).

Standard library only (and :mod:`air_magic.errors`).
"""

from __future__ import annotations

import math
import os
from typing import Callable, Mapping

from air_magic.errors import ConfigurationError
from air_magic.protocol.spool import STATE_DIR_ENV

__all__ = [
    "Settings",
    "settings",
    "WARN_MB_ENV",
    "DEFAULT_WARN_MB",
    "PANEL_ENV",
    "WARM_ENV",
    "MAX_CPU_RANKS_ENV",
    "CPU_RANKS_PER_CORE",
    "DEFAULT_PRELOAD",
]

WARN_MB_ENV = "AIR_MAGIC_CAPTURE_WARN_MB"
DEFAULT_WARN_MB = 100.0
PANEL_ENV = "AIR_MAGIC_PANEL"
WARM_ENV = "AIR_MAGIC_WARM"
OUTPUT_LIMIT_ENV = "AIR_MAGIC_OUTPUT_LIMIT"
STALL_SECONDS_ENV = "AIR_MAGIC_STALL_SECONDS"
HANG_SECONDS_ENV = "AIR_MAGIC_HANG_SECONDS"
GPU_BUSY_MIB_ENV = "AIR_MAGIC_GPU_BUSY_MIB"
GPU_CLAIMS_ENV = "AIR_MAGIC_GPU_CLAIMS"
LOG_LIMIT_ENV = "AIR_MAGIC_LOG_LIMIT"
SHM_DIR_ENV = "AIR_MAGIC_SHM_DIR"
#: Environment variable that replaces the default bound on CPU ranks.
MAX_CPU_RANKS_ENV = "AIR_MAGIC_MAX_CPU_RANKS"
#: CPU ranks allowed per usable core by default. A few ranks per core are useful to try
#: out distributed code on a laptop; thousands only exhaust the process table.
CPU_RANKS_PER_CORE = 4
PRELOAD_ENV = "AIR_MAGIC_PRELOAD"
DEFAULT_PRELOAD = "torch,torch.distributed,torch.nn,torch.optim,torch.utils.data"
LOG_DIR_ENV = "AIR_MAGIC_LOG_DIR"
LOG_KEEP_DAYS_ENV = "AIR_MAGIC_LOG_KEEP_DAYS"
LOG_KEEP_MB_ENV = "AIR_MAGIC_LOG_KEEP_MB"
RAY_STRATEGY_ENV = "AIR_MAGIC_RAY_STRATEGY"
RAY_PLACE_TIMEOUT_ENV = "AIR_MAGIC_RAY_PLACE_TIMEOUT"
RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
FLIGHT_RECORDER_ENV = "AIR_MAGIC_FLIGHT_RECORDER"
ON_BREAKPOINT_ENV = "AIR_MAGIC_ON_BREAKPOINT"
ON_BREAKPOINT = ("prompt", "skip", "error")

_PANEL_OFF = ("0", "off", "false", "no", "none")


class Settings:
    """air_magic's settings in this process (see the module docstring for each one)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        #: Where the variables are read (``os.environ`` as it is at each read by default).
        self._environ = environ
        self._warn_mb: float | None = None
        self._panel: bool | None = None

    def _env(self, name: str, default: str = "") -> str:
        environ = os.environ if self._environ is None else self._environ
        return environ.get(name, default)

    # -- written by %config DistributedMagics.<trait> -----------------------------------------

    @property
    def capture_warn_mb(self) -> float:
        """Captured objects whose pickle is larger than this (MB) get a warning.

        Until it is set, ``AIR_MAGIC_CAPTURE_WARN_MB`` as it is at each launch, else 100.
        """
        if self._warn_mb is not None:
            return self._warn_mb
        return self._number(
            WARN_MB_ENV,
            DEFAULT_WARN_MB,
            lambda text: (
                f"{WARN_MB_ENV} must be a number of megabytes (0 or more), got {text!r}. Set it to "
                f"a number such as 500, or unset it for the default of {DEFAULT_WARN_MB:g}."
            ),
        )

    @capture_warn_mb.setter
    def capture_warn_mb(self, value: float) -> None:
        self._warn_mb = float(value)

    #: The name :mod:`air_magic.capture` has used for ``capture_warn_mb``.
    warn_mb = capture_warn_mb

    @property
    def panel(self) -> bool:
        """Whether launches show a live panel (``%config DistributedMagics.panel``; True).

        A launch's own ``LaunchSpec.panel`` (``@distributed(panel=False)``) is to win over
        it, and ``AIR_MAGIC_PANEL=0`` turns the panel off whatever this says (see
        :attr:`panel_mode`).
        """
        return True if self._panel is None else self._panel

    @panel.setter
    def panel(self, value: bool) -> None:
        self._panel = bool(value)

    # -- read from the environment at each use ------------------------------------------------

    @property
    def panel_mode(self) -> str:
        """``AIR_MAGIC_PANEL`` normalised: ``"auto"``, ``"off"``, ``"text"`` or ``"widget"``."""
        value = self._env(PANEL_ENV, "auto").strip().lower()
        if value in _PANEL_OFF:
            return "off"
        if value in ("text", "plain"):
            return "text"
        if value in ("widget", "widgets"):
            return "widget"
        if value in ("", "auto"):
            return "auto"
        raise ConfigurationError(
            f"{PANEL_ENV} must be auto, text, widget or off (also 0, false, no, none), got "
            f"{self._env(PANEL_ENV)!r}; unset it for auto."
        )

    @property
    def warm(self) -> bool:
        """Start the helper (and MLflow's store, the panel, the linter) before the first
        launch (``AIR_MAGIC_WARM``)."""
        value = self._env(WARM_ENV, "1").strip().lower()
        if value in ("", "1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ConfigurationError(
            f"{WARM_ENV} must be 1 (start the helper early) or 0 (at the first launch), got "
            f"{self._env(WARM_ENV)!r}; unset it for 1."
        )

    @property
    def output_limit(self) -> int:
        """Bytes of rank 0's output copied into the cell per launch (``AIR_MAGIC_OUTPUT_LIMIT``)."""
        return self._bytes(OUTPUT_LIMIT_ENV, 1 << 20)

    @property
    def stall_seconds(self) -> float:
        """Seconds without a line from any rank before their stacks are looked at (0: never)."""
        return self._number(STALL_SECONDS_ENV, 300.0, unit="seconds", zero="0 never looks")

    @property
    def hang_seconds(self) -> float:
        """Seconds no collective completes, while a rank waits in one, before the cell shows
        a hang report (``AIR_MAGIC_HANG_SECONDS``; 0: never)."""
        return self._number(HANG_SECONDS_ENV, 5.0, unit="seconds", zero="0 never reports")

    @property
    def gpu_busy_mib(self) -> float:
        """MiB of a GPU's memory that processes outside air_magic's launches may use before the
        GPU counts as busy for a launch's claim (``AIR_MAGIC_GPU_BUSY_MIB``; 1024)."""
        return self._number(GPU_BUSY_MIB_ENV, 1024.0, unit="MiB", zero="0 counts any use as busy")

    @property
    def log_limit(self) -> int:
        """Bytes of each rank's log kept once a launch has ended (``AIR_MAGIC_LOG_LIMIT``)."""
        return self._bytes(LOG_LIMIT_ENV, 16 << 20)

    def _bytes(self, name: str, default: int) -> int:
        """``name``'s value, a whole number of bytes, 0 or more (``default`` when unset)."""
        text = self._env(name).strip()
        if not text:
            return default
        if not text.isdigit():  # no sign, no unit, no point
            raise ConfigurationError(
                f"{name} must be a whole number of bytes (0 or more), got {text!r}: for example "
                f"{name}={16 << 20} for 16 MiB, or unset it for the default ({_size(default)})."
            )
        return int(text)

    @property
    def shm_dir(self) -> str:
        """Where large result tensors travel (``AIR_MAGIC_SHM_DIR``)."""
        return self._env(SHM_DIR_ENV, "/dev/shm")

    @property
    def preload(self) -> str:
        """Modules the helper imports at start, comma separated (``AIR_MAGIC_PRELOAD``)."""
        return self._env(PRELOAD_ENV, DEFAULT_PRELOAD)

    @property
    def log_dir(self) -> str:
        """Where each launch's logs are kept (``AIR_MAGIC_LOG_DIR``, else the user's cache)."""
        chosen = self._env(LOG_DIR_ENV)
        if chosen:
            return os.path.abspath(os.path.expanduser(chosen))
        xdg = self._env("XDG_CACHE_HOME")
        base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "air_magic", "logs")

    @property
    def log_keep_days(self) -> float:
        """Launch logs older than this many days are pruned (``AIR_MAGIC_LOG_KEEP_DAYS``, 14)."""
        return self._number(LOG_KEEP_DAYS_ENV, 14.0)

    @property
    def log_keep_mb(self) -> float:
        """The oldest launch logs are pruned past this many MB in all (``AIR_MAGIC_LOG_KEEP_MB``)."""
        return self._number(LOG_KEEP_MB_ENV, 1024.0)

    def _number(
        self,
        name: str,
        default: float,
        bad: Callable[[str], str] | None = None,
        *,
        unit: str = "",
        zero: str = "",
    ) -> float:
        """``name``'s value, a finite number, 0 or more (``default`` when unset); ``bad(text)``
        says what is wrong (else a message with ``unit`` and what ``zero`` means)."""
        text = self._env(name).strip()
        if not text:
            return default
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:
            what = f"a number of {unit}" if unit else "a number"
            means = f"; {zero}" if zero else ""
            message = (
                bad(text)
                if bad
                else f"{name} must be {what} (0 or more{means}), got {text!r}; unset it for {default:g}."
            )
            raise ConfigurationError(message)
        return value

    @property
    def ray_strategy(self) -> str:
        """Ray's placement-group strategy for a launch's ranks (``AIR_MAGIC_RAY_STRATEGY``)."""
        text = self._env(RAY_STRATEGY_ENV, "PACK").strip().upper() or "PACK"
        if text not in RAY_STRATEGIES:
            raise ConfigurationError(
                f"{RAY_STRATEGY_ENV} must be one of {', '.join(RAY_STRATEGIES)}, got {text!r}; unset it for PACK."
            )
        return text

    @property
    def on_breakpoint(self) -> str:
        """What a breakpoint in a rank does (``AIR_MAGIC_ON_BREAKPOINT``): prompt, skip or error."""
        text = self._env(ON_BREAKPOINT_ENV, "prompt").strip().lower() or "prompt"
        if text not in ON_BREAKPOINT:
            raise ConfigurationError(
                f"{ON_BREAKPOINT_ENV} must be one of {', '.join(ON_BREAKPOINT)}, got {text!r}; unset it for prompt."
            )
        return text

    @property
    def gpu_claims(self) -> bool:
        """Whether GPU launches claim their GPUs (``AIR_MAGIC_GPU_CLAIMS``: on, or off)."""
        text = self._env(GPU_CLAIMS_ENV, "on").strip().lower() or "on"
        if text in ("on", "1", "true", "yes"):
            return True
        if text in ("off", "0", "false", "no"):
            return False
        raise ConfigurationError(f"{GPU_CLAIMS_ENV} must be on or off, got {text!r}; unset it for on.")

    @property
    def ray_place_timeout(self) -> float:
        """Seconds a Ray launch waits for room on the cluster (``AIR_MAGIC_RAY_PLACE_TIMEOUT``, 60)."""
        return self._number(RAY_PLACE_TIMEOUT_ENV, 60.0)

    @property
    def flight_recorder(self) -> int:
        """Collectives torch's Flight Recorder keeps per rank (``AIR_MAGIC_FLIGHT_RECORDER``;
        0 turns it off)."""
        text = self._env(FLIGHT_RECORDER_ENV).strip()
        if not text:
            return 2000
        if not text.isdigit():
            raise ConfigurationError(
                f"{FLIGHT_RECORDER_ENV} must be a whole number of collectives kept per rank (0 turns torch's "
                f"Flight Recorder off), got {text!r}; unset it for 2000."
            )
        return int(text)

    @property
    def state_dir(self) -> str | None:
        """``AIR_MAGIC_STATE_DIR``, or ``None`` for the XDG default."""
        return self._env(STATE_DIR_ENV) or None

    def max_cpu_ranks(self, cores: int) -> tuple[int, bool]:
        """The most CPU ranks a launch may start, and whether ``AIR_MAGIC_MAX_CPU_RANKS`` set it."""
        default = CPU_RANKS_PER_CORE * max(1, cores)
        text = self._env(MAX_CPU_RANKS_ENV).strip()
        if not text:
            return default, False
        try:
            bound = int(text)
        except ValueError:
            bound = 0
        if bound <= 0:
            raise ConfigurationError(
                f"{MAX_CPU_RANKS_ENV} must be a whole number of CPU ranks above 0, got {text!r}. "
                f"Set it to a number such as {2 * default}, or unset it for the default "
                f"({CPU_RANKS_PER_CORE} per CPU core: {default} here)."
            )
        return bound, True

    def check(self) -> None:
        """Read every setting once: a bad ``AIR_MAGIC_*`` value is a ``ConfigurationError``
        naming the variable, its value and what it accepts -- before a launch starts
        anything, never from inside a launch that runs."""
        for name in _CHECKED:
            getattr(self, name)


#: What :meth:`Settings.check` reads (``max_cpu_ranks`` needs the machine's cores: the
#: launch reads it as it places its ranks, also before anything starts).
_CHECKED = (
    "capture_warn_mb",
    "panel_mode",
    "warm",
    "output_limit",
    "stall_seconds",
    "hang_seconds",
    "gpu_busy_mib",
    "gpu_claims",
    "log_limit",
    "log_keep_days",
    "log_keep_mb",
    "ray_strategy",
    "ray_place_timeout",
    "flight_recorder",
    "on_breakpoint",
)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


#: The settings of this process.
settings = Settings()
