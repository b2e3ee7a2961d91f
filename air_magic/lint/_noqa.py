"""Suppression comments, read as ruff and flake8 read them.

``# noqa`` at the end of a line hides every finding that starts on that line;
``# noqa: AM303`` (or ``# noqa: AM303, AM401``) hides only the codes it names.  A hidden
finding is not fixed either.  Text may follow the codes, to say why::

    probe = model(PROBE)  # noqa: AM303 -- 512 bytes, sent on purpose
"""

from __future__ import annotations

import io
import re
import tokenize
from typing import Iterable, Mapping

from air_magic.lint.diagnostics import Diagnostic

__all__ = ["noqa_lines", "unsuppressed"]

_NOQA = re.compile(r"#\s*noqa(?::\s?(?P<codes>[A-Z]+[0-9]+(?:[,\s]+[A-Z]+[0-9]+)*))?", re.IGNORECASE)
_SEPARATOR = re.compile(r"[,\s]+")

#: Per line: the codes its noqa comment names, or ``None`` for a bare one (every code).
NoqaLines = Mapping[int, "frozenset[str] | None"]


def noqa_lines(source: str) -> dict[int, frozenset[str] | None]:
    """The ``# noqa`` comments of ``source``, by 1-based line.

    >>> table = noqa_lines("x = 1  # noqa\\ny = data  # noqa: AM303, AM401 -- small\\n")
    >>> table[1], sorted(table[2])
    (None, ['AM303', 'AM401'])
    """
    if "noqa" not in source.lower():
        return {}
    try:
        comments = [
            (token.start[0], token.string)
            for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT
        ]
    except (tokenize.TokenError, SyntaxError):
        # Grammar this Python cannot tokenize: a '#' outside strings is all we need here.
        comments = [(n, line[line.index("#") :]) for n, line in enumerate(source.splitlines(), 1) if "#" in line]
    table: dict[int, frozenset[str] | None] = {}
    for line, comment in comments:
        match = _NOQA.search(comment)
        if match is None:
            continue
        codes = match.group("codes")
        table[line] = None if codes is None else frozenset(_SEPARATOR.split(codes.upper()))
    return table


def unsuppressed(diagnostics: Iterable[Diagnostic], table: NoqaLines, offset: int = 0) -> list[Diagnostic]:
    """The findings no ``# noqa`` hides; ``offset`` is added to the table's lines."""
    out = []
    for d in diagnostics:
        line = d.line - offset
        if line in table:
            codes = table[line]
            if codes is None or d.code in codes:
                continue
        out.append(d)
    return out
