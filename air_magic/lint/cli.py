"""``air-magic``: the command line.  ``air-magic lint [--fix] [--diff] [--format json] PATH...``

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

from .._version import __version__
from .diagnostics import ConvergenceError, Diagnostic
from .rules import Applicability

__all__ = ["main"]

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
        "--unsafe-fixes", action="store_true",
        help="also apply fixes that may change behaviour (with --fix or --diff)",
    )
    lint.add_argument("--diff", action="store_true", help="show what --fix would change; write nothing")
    lint.add_argument("--format", choices=["text", "json"], default="text", help="output format (default text)")
    lint.add_argument("-q", "--quiet", action="store_true", help="print the findings only, no summary")
    return parser


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


def _process(path: str, fix: bool, diff: bool, unsafe: bool) -> _Outcome:
    if path.endswith(".ipynb"):
        return _process_notebook(path, fix, diff, unsafe)
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            source = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise _UsageError(f"{path}: cannot read it ({exc})") from None
    from .engine import check
    from .fixes import fix_until_stable

    if not (fix or diff):
        return _Outcome(path, check(source, path=path))
    result = fix_until_stable(source, lambda s: check(s, path=path), unsafe=unsafe, path=path)
    outcome = _Outcome(path, list(result.remaining), fixed=len(result.fixed))
    if result.source != source:
        if diff:
            outcome.diff = list(
                difflib.unified_diff(
                    source.splitlines(keepends=True), result.source.splitlines(keepends=True),
                    fromfile=path, tofile=path,
                )
            )
        if fix:
            with open(path, "w", encoding="utf-8", newline="") as fh:
                fh.write(result.source)
    if diff and not fix:
        outcome.diagnostics = check(source, path=path)
    return outcome


def _process_notebook(path: str, fix: bool, diff: bool, unsafe: bool) -> _Outcome:
    from .notebook import fix_notebook_file, lint_notebook_file

    try:
        if not (fix or diff):
            return _Outcome(path, lint_notebook_file(path))
        result = fix_notebook_file(path, unsafe=unsafe, write=fix)
    except ConvergenceError:
        raise
    except Exception as exc:  # not JSON, not a notebook, unreadable
        raise _UsageError(f"{path}: cannot read it as a notebook ({type(exc).__name__}: {exc})") from None
    outcome = _Outcome(path, result.remaining_diagnostics, fixed=len(result.result.fixed))
    if diff:
        for index, (old, new) in enumerate(zip(result.before, result.result.sources)):
            if old is not None and new is not None and old != new:
                name = f"{path}:cell {index + 1}"
                outcome.diff.extend(
                    difflib.unified_diff(
                        _lines(old), _lines(new), fromfile=name, tofile=name,
                    )
                )
        if not fix:
            outcome.diagnostics = lint_notebook_file(path)
    return outcome


def _lines(text: str) -> list[str]:
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


def _print_text(outcomes: list[_Outcome], args: argparse.Namespace, out: TextIO) -> None:
    for outcome in outcomes:
        for line in outcome.diff:
            out.write(line)
    diagnostics = [d for o in outcomes for d in o.diagnostics]
    if args.diff:
        if not args.quiet:
            changed = sum(1 for o in outcomes if o.diff)
            sys.stderr.write(f"{changed} file{'s' if changed != 1 else ''} would be changed by --fix.\n")
        return
    for d in diagnostics:
        out.write(f"{d}\n")
        if d.fix_title:
            out.write(f"    fix: {d.fix_title}\n")
    if args.quiet:
        return
    fixed = sum(o.fixed for o in outcomes)
    if args.fix and fixed:
        out.write(f"Fixed {fixed} finding{'s' if fixed != 1 else ''}.\n")
    if not diagnostics:
        if not (args.fix and fixed):
            out.write("No findings.\n")
        return
    safe = sum(1 for d in diagnostics if d.fixable and d.applicability is Applicability.SAFE)
    unsafe = sum(1 for d in diagnostics if d.fixable and d.applicability is Applicability.UNSAFE)
    summary = f"Found {len(diagnostics)} finding{'s' if len(diagnostics) != 1 else ''}"
    if args.fix:
        summary = f"{len(diagnostics)} finding{'s' if len(diagnostics) != 1 else ''} left to fix by hand"
    notes = []
    if safe and not args.fix:
        notes.append(f"{safe} fixable with --fix")
    if unsafe and not args.unsafe_fixes:
        notes.append(f"{unsafe} more with --fix --unsafe-fixes")
    out.write(summary + (f" ({'; '.join(notes)})" if notes else "") + ".\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help / --version exit 0, a usage error 2
        return int(exc.code or 0)
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
