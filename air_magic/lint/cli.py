"""``air-magic lint [--fix] [--diff] [--format json] PATH...``: the linter's verb of the
``air-magic`` command (:mod:`air_magic.cli` adds it with :func:`add_parser` and runs it with
:func:`run`; :func:`main` is the verb alone, with ``air-magic``'s name).

Exit codes follow ruff: 0 nothing found (or everything fixed), 1 findings left,
2 usage error (bad option, missing path, unreadable file, fixes that do not settle).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Iterator, Sequence, TextIO

from air_magic._version import __version__
from air_magic.lint._files import UnreadableFile, finding_text, lines, lint_file, plural, summary
from air_magic.lint.diagnostics import ConvergenceError, Diagnostic

__all__ = ["main", "add_parser", "run"]

_SKIP_DIRS = {"__pycache__", "node_modules", "site-packages", ".ipynb_checkpoints", "build", "dist"}


class _UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="air-magic",
        description="Tools for air_magic, the notebook launcher for multi-GPU training.",
    )
    parser.add_argument("--version", action="version", version=f"air-magic {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    add_parser(verbs)
    return parser


def add_parser(verbs: "argparse._SubParsersAction[argparse.ArgumentParser]") -> argparse.ArgumentParser:
    """Add the ``lint`` verb to a command line's verbs (``air-magic``'s, :mod:`air_magic.cli`)."""
    lint = verbs.add_parser(
        "lint",
        help="find (and fix) serverless_gpu / databricks.air / TorchDistributor code",
        description="Find code written for serverless_gpu, databricks.air or Spark's TorchDistributor "
        "and move it to air_magic. Folders are searched for .py and .ipynb files. "
        "Exit status: 0 clean, 1 findings left, 2 usage error.",
    )
    lint.add_argument("paths", nargs="+", metavar="PATH", help=".py files, .ipynb notebooks or folders")
    lint.add_argument("--fix", action="store_true", help="rewrite the files with every safe fix applied")
    lint.add_argument(
        "--unsafe-fixes",
        action="store_true",
        help="also apply fixes that may change behaviour (with --fix or --diff)",
    )
    lint.add_argument("--diff", action="store_true", help="show what --fix would change; write nothing")
    lint.add_argument("--format", choices=["text", "json"], default="text", help="output format (default text)")
    lint.add_argument("-q", "--quiet", action="store_true", help="print the findings only, no summary")
    return lint


def _files(paths: Sequence[str]) -> Iterator[str]:
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
                for name in sorted(names):
                    if name.endswith((".py", ".ipynb")):
                        yield os.path.join(root, name)
        elif os.path.isfile(path):
            yield path
        else:
            raise _UsageError(f"{path}: no such file or folder")


@dataclass
class _Outcome:
    path: str
    diagnostics: list[Diagnostic]  # left after fixing, or all of them when not fixing
    fixed: int = 0
    diff: list[str] = field(default_factory=list)
    sources: list[str | None] = field(default_factory=list)  # its code as it is now


def _process(path: str, fix: bool, diff: bool, unsafe: bool) -> _Outcome:
    try:
        result = lint_file(path, fix=fix or diff, unsafe=unsafe, write=fix)
    except UnreadableFile as exc:
        raise _UsageError(str(exc)) from None
    outcome = _Outcome(
        path, result.found if diff and not fix else result.remaining, fixed=result.fixed, sources=result.sources
    )
    if diff:
        for cell, old, new in result.changes:
            if cell is None:
                outcome.diff.extend(
                    difflib.unified_diff(
                        old.splitlines(keepends=True),
                        new.splitlines(keepends=True),
                        fromfile=path,
                        tofile=path,
                    )
                )
            else:
                name = f"{path}:cell {cell}"
                outcome.diff.extend(difflib.unified_diff(lines(old), lines(new), fromfile=name, tofile=name))
    return outcome


def _print_text(outcomes: list[_Outcome], args: argparse.Namespace, out: TextIO) -> None:
    for outcome in outcomes:
        for line in outcome.diff:
            out.write(line)
    diagnostics = [d for o in outcomes for d in o.diagnostics]
    if args.diff:
        if not args.quiet:
            changed = sum(1 for o in outcomes if o.diff)
            sys.stderr.write(f"{plural(changed, 'file')} would be changed by --fix.\n")
        return
    for d in diagnostics:
        out.write(finding_text(d))
    if args.quiet:
        return
    for outcome in outcomes if args.fix or args.diff else ():  # what the Lab's migrate dialog says, here too
        for note in _hardware_notes(outcome):
            out.write(f"Note: {note}\n")
    fixed = sum(o.fixed for o in outcomes)
    if args.fix and fixed:
        out.write(f"Fixed {plural(fixed, 'finding')}.\n")
    if not diagnostics:
        if not (args.fix and fixed):
            out.write("No findings.\n")
        return
    out.write(summary(diagnostics, fixing=args.fix, unsafe_hint=not args.unsafe_fixes) + "\n")


def _hardware_notes(outcome: _Outcome) -> list[str]:
    """The GPU shapes the file's code asks for that this machine lacks (see
    :func:`air_magic.lint.migrate.hardware_notes`)."""
    from air_magic.lint.migrate import hardware_notes

    return hardware_notes(outcome.sources, subject=outcome.path)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help / --version exit 0, a usage error 2
        return int(exc.code or 0)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """``air-magic lint`` with its parsed arguments; returns the exit status."""
    out = sys.stdout
    try:
        outcomes = [_process(path, args.fix, args.diff, args.unsafe_fixes) for path in _files(args.paths)]
    except _UsageError as exc:
        sys.stderr.write(f"air-magic lint: error: {exc}\n")
        return 2
    except ConvergenceError as exc:
        sys.stderr.write(f"air-magic lint: error: {exc}\n")
        return 2
    if args.format == "json":
        json.dump([d.to_json() for o in outcomes for d in o.diagnostics], out, indent=2)
        out.write("\n")
    else:
        _print_text(outcomes, args, out)
    return 1 if any(o.diagnostics for o in outcomes) else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
