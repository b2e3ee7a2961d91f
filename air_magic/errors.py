"""Exceptions raised by air_magic.

Every error shares :class:`AirMagicError` and its message says three things: what
went wrong, which rank / variable / argument, and what to do next.

Failures that happen *inside* a rank keep their own type where it can be rebuilt
in the kernel (a ``ValueError`` raised on rank 1 is re-raised as a ``ValueError``);
the rank's traceback travels as text in a :class:`RankTraceback` chained as the
cause, and the exception renders in IPython as the rank's traceback rather than the
launcher's internals.  When the exception cannot be rebuilt (its class only exists
on the rank), :class:`RankFailedError` carries the same information.
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "AirMagicError",
    "ConfigurationError",
    "AcceleratorMismatchError",
    "TooManyCPURanksError",
    "CPUOversubscriptionWarning",
    "DirectCallError",
    "CaptureError",
    "LaunchError",
    "RankFailedError",
    "RankCrashedError",
    "LaunchTimeoutError",
    "LaunchCancelledError",
    "ResultError",
    "RayClusterError",
    "RayNotInstalledError",
    "RankTraceback",
]


class AirMagicError(Exception):
    """Base class of every error raised by air_magic."""

    def _render_traceback_(self) -> list[str]:
        # A user mistake caught before launch: the message says what to do, and the
        # frames of air_magic's own machinery would only hide it (IPython's UsageError
        # makes the same choice).
        return render_lines(self)


class ConfigurationError(AirMagicError, ValueError):
    """A bad argument to ``@distributed`` / ``%%distributed`` (checked before any process starts)."""


class AcceleratorMismatchError(ConfigurationError):
    """What was asked for does not match the hardware this kernel runs on (checked at launch),
    or the accelerators of the Ray cluster ``ray_init(min_gpus=...)`` joined."""


class TooManyCPURanksError(ConfigurationError):
    """More CPU ranks than this machine can run were asked for (checked at launch)."""


class CPUOversubscriptionWarning(UserWarning):
    """More CPU ranks than usable CPU cores: the launch works, but the ranks share the cores."""


class DirectCallError(AirMagicError, TypeError):
    """A ``@distributed`` function was called directly instead of through ``.distributed(...)``."""


class CaptureError(AirMagicError):
    """Something the launched code uses cannot be sent to the ranks (checked before launch)."""

    def __init__(self, message: str, problems: Sequence[tuple[str, str, str]] = ()) -> None:
        super().__init__(message)
        #: ``(name, type name, reason)`` for every object that could not be serialised.
        self.problems = list(problems)


class LaunchError(AirMagicError):
    """A launch did not produce a result on every rank."""

    rank: int | None = None
    world_size: int | None = None
    log_path: str | None = None


class RankFailedError(LaunchError):
    """A rank raised an exception whose class could not be rebuilt in the kernel."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        world_size: int,
        exc_type: str,
        exc_message: str,
        traceback_text: str,
        log_path: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.traceback_text = traceback_text
        self.log_path = log_path


class RankCrashedError(LaunchError):
    """A rank died without reporting an exception: a signal (SIGKILL, SIGSEGV, ...) or ``os._exit``."""

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        world_size: int,
        returncode: int,
        log_path: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.world_size = world_size
        self.returncode = returncode
        self.log_path = log_path


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The launch ran past its ``timeout``; every rank was stopped."""


class LaunchCancelledError(LaunchError):
    """The launch was cancelled (``Launch.cancel()`` or the panel's Stop button)."""


class ResultError(LaunchError):
    """A rank finished but its return value could not be sent back to the kernel."""


class RayClusterError(AirMagicError):
    """``ray_init()`` could not start or join a Ray cluster: the address does not answer,
    Ray's versions differ, or this kernel is already connected to another cluster."""


class RayNotInstalledError(RayClusterError, ImportError):
    """``ray_init()`` was called where Ray is not installed (``pip install 'ray[default]>=2.40'``)."""


class RankTraceback(Exception):
    """The traceback of an exception raised on a rank, as text.

    Chained as ``__cause__`` of the re-raised exception so that plain Python (a
    script, a terminal) prints the rank's frames too.
    """

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text.rstrip()


def render_lines(exc: BaseException) -> list[str]:
    """The lines IPython shows for a launch failure: the rank's traceback, then the summary.

    A rank's own exception rebuilt in the kernel is the last line of its traceback
    already; only air_magic's errors (a summary naming the rank) add a line of their own.
    """
    lines: list[str] = []
    text = getattr(exc, "traceback_text", None)
    cause = exc.__cause__
    rebuilt = text is None and isinstance(cause, RankTraceback)
    if rebuilt:
        text = cause.text  # type: ignore[union-attr]
    if text:
        lines.extend(text.rstrip("\n").splitlines())
    if not rebuilt:
        if text:
            lines.append("")
        lines.append(f"{type(exc).__name__}: {exc}")
    for note in getattr(exc, "__notes__", ()):
        lines.append(str(note))
    return lines


def interrupted(message: str) -> KeyboardInterrupt:
    """The error of a blocking launch the user interrupted: a plain ``KeyboardInterrupt``
    (``except KeyboardInterrupt`` around a call keeps working in a script) that IPython
    shows as its one line, without the launcher's frames."""
    exc = KeyboardInterrupt(message)
    line = f"KeyboardInterrupt: {message}"
    exc._render_traceback_ = lambda: [line, *getattr(exc, "__notes__", [])]  # type: ignore[attr-defined]
    return exc


def attach_rank_rendering(exc: BaseException) -> BaseException:
    """Make a rebuilt user exception render as its rank traceback in IPython.

    Exception instances have a ``__dict__``, so the hook can live on the instance:
    the class stays the user's own (``except ValueError`` keeps working).
    """
    try:
        exc._render_traceback_ = lambda: render_lines(exc)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):  # pragma: no cover - exotic exception types
        pass
    return exc
