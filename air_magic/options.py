"""The launch options of ``@distributed(...)`` and ``%%distributed``, each declared once.

:data:`OPTIONS` holds one :class:`Option` per option: its ``@distributed`` keyword, the
flags of ``%%distributed`` (none for options only the decorator has), how argparse
reads its value, its default, its help text and whether the linter strips quotes
around its value.  Built from it:

* the magic's IPython ``@argument`` decorators (:func:`apply_arguments`), so that
  ``%%distributed?`` and the magic's error messages come from the same table;
* :data:`FLAG_TO_OPTION` (each flag and the option it sets);
* :func:`line_parser`, a plain ``argparse`` parser of a ``%%distributed`` line that
  raises :class:`OptionError` with the message the magic's parser gives (the linter
  uses it: no IPython needed);
* :func:`add_launch_arguments`, the same flags on another parser (``air-magic run``'s),
  without those only a notebook has (``--async``).

``tests/unit/test_options.py`` checks the table against ``distributed(...)``'s
signature and against the magic's parser.  Standard library only.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Iterable

__all__ = [
    "DEFAULT_TIMEOUT",
    "POOL_KEYWORDS",
    "Option",
    "OPTIONS",
    "OPTIONS_BY_KEYWORD",
    "FLAG_TO_OPTION",
    "OptionError",
    "apply_arguments",
    "add_launch_arguments",
    "line_parser",
    "unquoted",
]

#: Seconds a launch may run by default (3 hours).
DEFAULT_TIMEOUT = 10800.0


@dataclass(frozen=True)
class Option:
    """One launch option: its ``@distributed`` keyword and its ``%%distributed`` flags."""

    #: The keyword of ``@distributed(...)`` (``None``: the magic alone has it, e.g. ``--async``).
    keyword: str | None
    #: ``@distributed``'s default for it.
    default: Any = None
    #: Keyword-only in ``@distributed(...)`` (after the ``*``).
    keyword_only: bool = True
    #: ``%%distributed`` flags, long one last (``()``: the decorator alone has it).
    flags: tuple[str, ...] = ()
    #: How the flag's text becomes a value (argparse's ``type``; ``None``: the text).
    parse: Callable[[str], Any] | None = None
    #: ``store_true`` for a flag without a value.
    action: str | None = None
    #: Where argparse stores it (default: from the long flag).
    dest: str | None = None
    metavar: str | None = None
    help: str = ""
    #: Whether the linter reads the flag's value with surrounding quotes stripped.
    unquoted: bool = False

    @property
    def flag(self) -> str | None:
        """The long flag (``--num-accelerators``), or ``None``."""
        return self.flags[-1] if self.flags else None

    def argparse_keywords(
        self, parse: Callable[[Callable[[str], Any]], Callable[[str], Any]] | None = None
    ) -> dict[str, Any]:
        """The keywords of ``add_argument`` for the flags; ``parse`` wraps a typed option's parser."""
        keywords: dict[str, Any] = {}
        if self.action is not None:
            keywords["action"] = self.action
        else:
            keywords["default"] = None  # not given: the magic's %config default applies
            if self.parse is not None:
                keywords["type"] = parse(self.parse) if parse is not None else self.parse
            if self.metavar is not None:
                keywords["metavar"] = self.metavar
        if self.dest is not None:
            keywords["dest"] = self.dest
        keywords["help"] = self.help
        return keywords


#: Every option, in the order ``%%distributed?`` lists the flags.
OPTIONS: tuple[Option, ...] = (
    Option(
        "num_accelerators",
        keyword_only=False,
        flags=("-n", "--num-accelerators"),
        parse=int,
        metavar="N",
        help="Number of ranks (default: every GPU of this machine, or 1 CPU rank).",
    ),
    Option(
        "accelerator_type",
        keyword_only=False,
        flags=("--accelerator-type",),
        metavar="TYPE",
        help="GPU_<n>x<MODEL> (e.g. GPU_8xH100) or CPU; detected when omitted.",
        unquoted=True,
    ),
    Option(
        "timeout",
        default=DEFAULT_TIMEOUT,
        keyword_only=False,
        flags=("--timeout",),
        # Read by the magic (seconds or 'none'), after argparse, against its %config default.
        metavar="SECONDS|none",
        help="Stop every rank after this many seconds (default 3 h); 'none' for no limit.",
    ),
    Option("gpus"),  # deprecated name of num_accelerators
    Option("gpu_type"),  # deprecated name of accelerator_type
    Option(
        "tracking",
        default=True,
        flags=("--no-tracking",),
        action="store_true",
        help="Do not record the launch in MLflow.",
    ),
    Option("experiment", flags=("--experiment",), help="MLflow experiment of the launch's run."),
    Option("run_name", flags=("--run-name",), help="MLflow run name of the launch."),
    Option(
        None,  # .submit(...) instead of .distributed(...)
        flags=("--async",),
        action="store_true",
        dest="run_async",
        help="Return a Launch handle at once instead of waiting for the ranks.",
    ),
    Option(
        None,  # a cell of the kernel's pool (air_magic.Pool) instead of a launch
        flags=("--pool",),
        action="store_true",
        dest="pool",
        help=(
            "Run the cell on the kernel's pool of ranks, which stay across cells with their names "
            "and process group (the first such cell starts it; see %%distributed_pool)."
        ),
    ),
    Option(
        "backend",
        default="local",
        flags=("--backend",),
        help=(
            "Where the ranks run: local (the default: this machine's accelerators) or ray "
            "(the nodes of the Ray cluster air_magic.ray_init() or RAY_ADDRESS names)."
        ),
    ),
    Option(
        "wait",
        default=True,
        flags=("--no-wait",),
        action="store_true",
        help=(
            "When the GPUs asked for are held by another launch or notebook, refuse at once "
            "(naming who holds them) instead of waiting for them."
        ),
    ),
    Option("remote", default=False),  # refused: kept so that old code gets a clear error
    # None: the kernel's setting (%config DistributedMagics.panel, AIR_MAGIC_PANEL).
    Option("panel"),
)

OPTIONS_BY_KEYWORD: dict[str, Option] = {o.keyword: o for o in OPTIONS if o.keyword is not None}

#: Every flag of ``%%distributed`` and its option.
FLAG_TO_OPTION: dict[str, Option] = {flag: o for o in OPTIONS for flag in o.flags}


def _flagged() -> Iterable[Option]:
    return (o for o in OPTIONS if o.flags)


#: The options of a pool (``%distributed_pool``, ``air_magic.Pool``): what its ranks are.
POOL_KEYWORDS = ("num_accelerators", "accelerator_type", "timeout", "tracking", "backend", "wait")


def apply_arguments(
    argument: Callable[..., Callable[[Any], Any]], only: Iterable[str] | None = None
) -> Callable[[Any], Any]:
    """A decorator applying ``argument(*flags, **keywords)`` for each flag, as a stack of
    ``@argument(...)`` lines in table order would (IPython's ``magic_arguments.argument``).
    ``only``: the keywords of the options to apply (default: every flagged option)."""
    chosen = None if only is None else set(only)

    def decorate(func: Any) -> Any:
        for option in reversed(tuple(_flagged())):
            if chosen is not None and option.keyword not in chosen:
                continue
            func = argument(*option.flags, **option.argparse_keywords())(func)
        return func

    return decorate


class OptionError(ValueError):
    """A ``%%distributed`` line the magic's parser refuses; the message is argparse's."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print the usage and exit
        raise OptionError(message)


def line_parser(parse: Callable[[Callable[[str], Any]], Callable[[str], Any]] | None = None) -> argparse.ArgumentParser:
    """A parser of ``%%distributed``'s options, without IPython: the same flags, values and
    error messages as the magic's.  ``parse`` wraps each typed option's parser."""
    parser = _Parser(prog="%%distributed", add_help=False)
    for option in _flagged():
        parser.add_argument(*option.flags, **option.argparse_keywords(parse))
    return parser


def add_launch_arguments(parser: Any) -> None:
    """Add the flags of every option ``@distributed`` has a keyword for to ``parser`` (an
    ``argparse`` parser or argument group): the magic's flags but ``--async``, with the
    same values, defaults (``None``: not given) and help."""
    for option in _flagged():
        if option.keyword is not None:
            parser.add_argument(*option.flags, **option.argparse_keywords())


def unquoted(option: Option, value: Any) -> Any:
    """``value`` with the quotes around it stripped where ``option`` is read that way."""
    if option.unquoted and isinstance(value, str):
        return value.strip("\"'")
    return value
