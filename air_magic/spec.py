"""The launch description shared by ``@distributed`` and ``%%distributed``.

Both fronts build a :class:`LaunchSpec` with :func:`make_spec` (static checks, run
at decoration / magic parsing, so a notebook written on a laptop decorates fine)
and the launcher calls :meth:`LaunchSpec.resolve` against the attached hardware
at launch time.  The options themselves are declared in :mod:`air_magic.options`;
kernel-wide settings (``AIR_MAGIC_*``) are in :mod:`air_magic.settings`.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import operator
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Union

from air_magic.accelerators import AcceleratorType, GPUType, Hardware
from air_magic.errors import (
    AcceleratorMismatchError,
    ConfigurationError,
    CPUOversubscriptionWarning,
    TooManyCPURanksError,
)
from air_magic.options import DEFAULT_TIMEOUT
from air_magic.settings import CPU_RANKS_PER_CORE, MAX_CPU_RANKS_ENV, settings

__all__ = [
    "LaunchSpec",
    "Placement",
    "make_spec",
    "max_cpu_ranks",
    "timeout_from_text",
    "DEFAULT_TIMEOUT",
    "UNSET",
    "BACKENDS",
    "CPU_RANKS_PER_CORE",
    "MAX_CPU_RANKS_ENV",
]

BACKENDS = ("local", "ray")


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


#: "argument not passed" (``None`` is a meaningful timeout: no limit).
UNSET: Any = _Unset()

AcceleratorArg = Union[AcceleratorType, GPUType, str, None]


@dataclass(frozen=True)
class Placement:
    """Where a launch runs, resolved against the hardware at launch time."""

    world_size: int
    device: str  # "cuda" or "cpu"
    accelerator_type: AcceleratorType
    hardware: Hardware


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a launch needs besides the code: one field per ``%%distributed`` option."""

    num_accelerators: int | None = None
    accelerator_type: AcceleratorType | GPUType | None = None
    timeout: float | None = DEFAULT_TIMEOUT
    tracking: bool = True
    experiment: str | None = None
    run_name: str | None = None
    backend: str = "local"
    #: Wait for GPUs another launch holds (False: refuse at once, naming who holds them).
    wait: bool = True
    #: The launch's live panel: ``None`` follows the kernel's setting (``settings.panel``).
    #: TODO(panel.py): its panel decision is to read this first, then ``settings.panel``.
    panel: bool | None = None

    def resolve(self, hardware: Hardware) -> Placement:
        """Check the spec against ``hardware``; raise ``AcceleratorMismatchError`` naming both."""
        wanted = self.accelerator_type
        if isinstance(wanted, AcceleratorType) and wanted.is_cpu:
            return self._cpu_placement(hardware)
        if hardware.gpu_count == 0:
            if wanted is not None:
                raise AcceleratorMismatchError(
                    f"accelerator_type={_shown(wanted)} was asked for, but this machine has "
                    f"{hardware.describe()}. Omit accelerator_type (or pass 'CPU') to run "
                    "CPU ranks here."
                )
            return self._cpu_placement(hardware)
        attached = hardware.accelerator_type
        if isinstance(wanted, GPUType):
            chip = wanted.to_accelerator_type(1)
            assert chip is not None
            if chip.model != attached.model:
                raise AcceleratorMismatchError(
                    f"accelerator_type={_shown(wanted)} ({chip.model}) was asked for, but this "
                    f"machine has {hardware.describe()}. Use accelerator_type="
                    f"{attached.value!r} or omit it."
                )
            wanted = None
        if isinstance(wanted, AcceleratorType):
            if wanted.model != attached.model or wanted.count > attached.count:
                raise AcceleratorMismatchError(
                    f"accelerator_type={wanted.value!r} was asked for, but this machine has "
                    f"{hardware.describe()}. Use accelerator_type={attached.value!r} or omit it."
                )
        count = self.num_accelerators
        if count is None:
            count = wanted.count if isinstance(wanted, AcceleratorType) else attached.count
        if count > attached.count:
            raise AcceleratorMismatchError(
                f"num_accelerators={count} was asked for, but only {attached.count} GPU"
                f"{'s are' if attached.count != 1 else ' is'} visible ({hardware.describe()}). "
                f"Pass num_accelerators={attached.count} or fewer, or accelerator_type='CPU' "
                "for CPU ranks."
            )
        return Placement(count, "cuda", attached, hardware)

    def _cpu_placement(self, hardware: Hardware) -> Placement:
        # GPU counts are bounded by the GPUs; CPU ranks only by this check (each one is a
        # process with its own copy of torch: a typo such as -n 1000000 must not fork
        # until the machine's process table is full).
        count = self.num_accelerators or 1
        cores = max(1, hardware.cpu_count)
        bound, from_env = max_cpu_ranks(cores)
        if count > bound:
            if from_env:
                allowed = f"{MAX_CPU_RANKS_ENV}={bound} allows at most {bound}"
                advice = f"or raise {MAX_CPU_RANKS_ENV}"
            else:
                allowed = f"air_magic starts at most {bound} CPU ranks on it ({CPU_RANKS_PER_CORE} per core)"
                advice = f"or set the environment variable {MAX_CPU_RANKS_ENV} to allow more"
            raise TooManyCPURanksError(
                f"num_accelerators={count} was asked for (CPU ranks), but this machine has "
                f"{_cores(cores)} and {allowed}. Pass num_accelerators={bound} or fewer, {advice}."
            )
        if count > cores:
            warnings.warn(
                f"num_accelerators={count} starts {count} CPU ranks on {_cores(cores)}: the ranks "
                f"share the cores and run slower than {cores} rank{'s' if cores != 1 else ''} "
                f"would. Fine for trying out distributed code; pass num_accelerators={cores} or "
                "fewer for speed.",
                CPUOversubscriptionWarning,
                stacklevel=_user_stacklevel(),
            )
        return Placement(count, "cpu", AcceleratorType.CPU, hardware)

    def describe(self) -> str:
        parts = [f"num_accelerators={self.num_accelerators!r}"]
        parts.append(f"accelerator_type={_shown(self.accelerator_type)}")
        parts.append(f"timeout={self.timeout!r}")
        if not self.tracking:
            parts.append("tracking=False")
        if self.experiment:
            parts.append(f"experiment={self.experiment!r}")
        if self.run_name:
            parts.append(f"run_name={self.run_name!r}")
        if self.backend != "local":
            parts.append(f"backend={self.backend!r}")
        if not self.wait:
            parts.append("wait=False")
        if self.panel is not None:
            parts.append(f"panel={self.panel!r}")
        return ", ".join(parts)


def _shown(value: object) -> str:
    if isinstance(value, AcceleratorType):
        return repr(value.value)
    if isinstance(value, GPUType):
        return f"GPUType.{value.name}"
    return repr(value)


def _cores(count: int) -> str:
    return f"{count} usable CPU core{'s' if count != 1 else ''}"


def max_cpu_ranks(cores: int) -> tuple[int, bool]:
    """The most CPU ranks a launch may start, and whether ``AIR_MAGIC_MAX_CPU_RANKS`` set it."""
    return settings.max_cpu_ranks(cores)


def check_num_accelerators(value: object, name: str = "num_accelerators") -> int | None:
    """A positive number of ranks: any integer type (numpy's too), never a bool."""
    if value is None:
        return None
    try:
        # operator.index accepts exactly the integer types (int, numpy integers, ...):
        # not floats, not strings, and not numpy's bool.
        count = None if isinstance(value, bool) else operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        count = None
    if count is None:
        raise ConfigurationError(
            f"{name} must be a positive integer (the number of ranks), got {type(value).__name__} {value!r}."
        )
    if count <= 0:
        raise ConfigurationError(
            f"{name} must be a positive integer (the number of ranks), got {count}. "
            "Pass 1 or more, or omit it to use every GPU of this machine."
        )
    return int(count)


def check_timeout(value: object, no_limit: str = "timeout=None") -> float | None:
    """Seconds > 0 as a float, or ``None`` (no limit; also for infinity).

    ``no_limit`` is how the user spells "no limit" where the value came from
    (``timeout=None``, ``--timeout none``).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigurationError(
            f"timeout must be a number of seconds or None (no limit), got {type(value).__name__} {value!r}."
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond a float's range
        if value < 0:
            raise ConfigurationError(
                f"timeout must be more than 0 seconds, got a negative integer of "
                f"{int(value).bit_length()} bits. Pass {no_limit} for no limit."  # type: ignore[call-overload]
            ) from None
        raise ConfigurationError(
            f"timeout is an integer beyond {sys.float_info.max:.1e}: more seconds than any clock "
            f"holds. Pass {no_limit} for no limit."
        ) from None
    if math.isnan(seconds) or seconds <= 0:
        shown = repr(int(value)) if isinstance(value, numbers.Integral) else repr(seconds)
        raise ConfigurationError(f"timeout must be more than 0 seconds, got {shown}. Pass {no_limit} for no limit.")
    # Huge finite values are kept as they are: the helper caps its own waits.
    return None if math.isinf(seconds) else seconds


def timeout_from_text(text: str, no_limit: str = "--timeout none") -> float | None:
    """``--timeout``'s value as written on a command line or a magic line: seconds > 0, or
    ``none`` (also ``off``) for no limit.  ``ConfigurationError`` says what was wrong."""
    if text.strip().lower() in ("none", "off"):
        return None
    value: int | float
    try:
        value = int(text)  # shown as written in a message: "got 0", not "got 0.0"
    except ValueError:
        try:
            value = float(text)
        except ValueError:
            raise ConfigurationError(f"--timeout takes a number of seconds or 'none', got {text!r}") from None
    return check_timeout(value, no_limit=no_limit)


def _check_text(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigurationError(f"{name} must be a non-empty string or None, got {value!r}.")
    return value


def _user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the user's own line.

    That is the first frame outside air_magic and outside IPython's machinery: for
    ``%%distributed`` the cell that called the magic, not IPython's ``run_cell_magic``.
    """
    internal = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    ipython_file = getattr(sys.modules.get("IPython"), "__file__", None)
    if ipython_file:
        internal.append(os.path.dirname(os.path.abspath(ipython_file)) + os.sep)
    frame = sys._getframe(1)
    level = 1
    while frame is not None:
        filename = frame.f_code.co_filename
        machinery = filename.startswith("<decorator-gen-") or os.path.abspath(filename).startswith(tuple(internal))
        if not machinery:
            return level
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def _warn(message: str) -> None:
    warnings.warn(message, FutureWarning, stacklevel=_user_stacklevel())


def _fold_accelerator(
    accelerator_type: AcceleratorArg, gpu_type: AcceleratorArg, count: int | None
) -> AcceleratorType | GPUType | None:
    if accelerator_type is not None and gpu_type is not None:
        raise ConfigurationError(
            "gpu_type and accelerator_type cannot be combined: gpu_type is the deprecated name "
            "of accelerator_type. Pass only accelerator_type."
        )
    via_legacy_name = gpu_type is not None
    value = gpu_type if via_legacy_name else accelerator_type
    if value is None:
        return None
    if isinstance(value, AcceleratorType):
        if via_legacy_name:
            _warn(f"gpu_type is deprecated; use accelerator_type={value.value!r} instead.")
        return value
    legacy = GPUType.parse(value)  # type: ignore[arg-type]
    if legacy is None:
        parsed = AcceleratorType.parse(value)  # type: ignore[arg-type]  # raises ConfigurationError with the valid forms
        if via_legacy_name:
            _warn(f"gpu_type is deprecated; use accelerator_type={parsed.value!r} instead.")
        return parsed
    replacement = legacy.to_accelerator_type(count)
    if replacement is not None:
        advice = f"accelerator_type={replacement.value!r}"
    else:
        advice = "accelerator_type='GPU_1xH100' (one GPU) or 'GPU_8xH100' (eight)"
    shown = value.name if isinstance(value, GPUType) else value
    if via_legacy_name:
        _warn(f"gpu_type={shown!r} is deprecated; use {advice} instead (or omit it: the type is detected).")
    else:
        _warn(f"accelerator_type={shown!r} is a deprecated GPU type name; use {advice} instead.")
    return replacement if replacement is not None else legacy


def make_spec(
    num_accelerators: object = None,
    accelerator_type: AcceleratorArg = None,
    timeout: object = DEFAULT_TIMEOUT,
    *,
    gpus: object = None,
    gpu_type: AcceleratorArg = None,
    tracking: object = True,
    experiment: object = None,
    run_name: object = None,
    backend: object = "local",
    remote: object = False,
    panel: object = None,
    wait: object = True,
) -> LaunchSpec:
    """Validate the decorator's arguments (no hardware is looked at) and build a spec."""
    checked_timeout = check_timeout(timeout)
    if remote is not False:
        raise ConfigurationError(
            "remote=True has no meaning in air_magic: ranks always run on this machine. Remove remote=...."
        )
    if gpus is not None and num_accelerators is not None:
        raise ConfigurationError(
            "gpus and num_accelerators cannot be combined: gpus is the deprecated name of "
            "num_accelerators. Pass only num_accelerators."
        )
    if gpus is not None:
        count = check_num_accelerators(gpus, "gpus")
        _warn(f"gpus is deprecated; use num_accelerators={count} instead.")
    else:
        count = check_num_accelerators(num_accelerators)
    accel = _fold_accelerator(accelerator_type, gpu_type, count)
    if not isinstance(tracking, bool):
        raise ConfigurationError(f"tracking must be True or False, got {tracking!r}.")
    if backend not in BACKENDS:
        raise ConfigurationError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}.")
    if backend == "ray" and importlib.util.find_spec("ray") is None:  # said at decoration
        raise ConfigurationError(
            "backend='ray' needs Ray, which is not installed in the environment this kernel runs in: "
            "pip install 'ray[default]>=2.40' (and the same on every node of the cluster)."
        )
    if not isinstance(wait, bool):
        raise ConfigurationError(f"wait must be True or False, got {wait!r}.")
    if panel is not None and not isinstance(panel, bool):
        raise ConfigurationError(f"panel must be True, False or None (the kernel's setting), got {panel!r}.")
    return LaunchSpec(
        num_accelerators=count,
        accelerator_type=accel,
        timeout=checked_timeout,
        tracking=tracking,
        experiment=_check_text(experiment, "experiment"),
        run_name=_check_text(run_name, "run_name"),
        backend=str(backend),
        wait=wait,
        panel=panel,
    )
