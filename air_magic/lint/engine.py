"""The checks behind the rule table, run over one parsed module.

::

    source ──libcst parse + metadata (_source.Source)──> checks by kind ──> Diagnostics with byte-edit fixes
                                                         _imports     AM1xx
                                                         _arguments   AM2xx
                                                         _patterns    AM3xx
                                                         _portability AM4xx

Fixes are byte edits of the source (never a re-printed tree), so every line a fix does
not touch keeps its exact text; :mod:`air_magic.lint.fixes` applies them.  A finding on a
line with a ``# noqa`` comment that names its code (or no code) is dropped, fix and all.
"""

from __future__ import annotations

from typing import Callable, Sequence

import libcst as cst

from air_magic.lint import _arguments, _imports, _patterns, _portability
from air_magic.lint._noqa import noqa_lines, unsuppressed
from air_magic.lint._source import Region, Source, accelerator_replacement
from air_magic.lint.diagnostics import Diagnostic

__all__ = ["Region", "check", "accelerator_replacement", "syntax_error"]

_CHECKS: tuple[Callable[[Source], None], ...] = (
    _imports.check_imports,
    _imports.check_env_vars,
    _arguments.check_arguments,
    _patterns.check_torch_distributor,
    _patterns.check_rendezvous,
    _patterns.check_direct_calls,
    _portability.check_portability,
)


def check(
    source: str,
    *,
    path: str = "<string>",
    regions: Sequence[Region] = (),
    describe_line: Callable[[int], str] | None = None,
    launched: Sequence[str] = (),
) -> list[Diagnostic]:
    """Lint ``source``; a syntax error is one ``AM001`` finding.

    ``regions`` are lines that run on the ranks as they are (``%%distributed`` bodies);
    ``launched`` names top-level functions that run on the ranks however they are
    launched.  Fix edits are byte offsets into ``source.encode("utf-8")``.
    """
    try:
        src = Source(source, describe_line or (lambda line: f"line {line}"), launched)
    except cst.ParserSyntaxError as exc:
        return [syntax_error(source, exc, path)]
    for checker in _CHECKS:
        checker(src)
    _patterns.check_launched_code(src, regions)
    return unsuppressed(src.diagnostics(path), noqa_lines(source))


def syntax_error(source: str, exc: Exception, path: str, what: str = "this code") -> Diagnostic:
    """``AM001`` at the place Python's own parser names (libcst's position is often a token later)."""
    import ast

    line = getattr(exc, "raw_line", 1)
    col = getattr(exc, "raw_column", 0) + 1
    message = (getattr(exc, "message", "") or str(exc)).splitlines()[0]
    try:
        ast.parse(source)
    except SyntaxError as err:
        line, col, message = err.lineno or line, err.offset or col, err.msg
    except (ValueError, RecursionError):
        pass
    return Diagnostic.from_rule(
        "AM001",
        {"what": what, "error": f"syntax error: {message}"},
        path=path,
        line=line,
        col=col,
        end_line=line,
        end_col=col,
    )
