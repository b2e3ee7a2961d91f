"""The migration linter's findings for a launch's code, as the panel lists them.

Run once per launch on a thread of its own (``LaunchState.start_lint``)::

    launch.sources: {key: (display name, cell source)}
        --> air_magic.lint.lint_cell(source)   (each distinct cell once per kernel: cached)
        --> Diagnostic(code, line, message)    AM0xx (about the linter itself) left out
        --> _Lint.findings: ["Cell In[4]: AM101 line 2: use air_magic ...", ...]

``air_magic.lint`` is imported only here, when a launch is linted.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..launcher import Launch
    from ..lint.diagnostics import Diagnostic


@dataclass
class _Lint:
    findings: list[str] = field(default_factory=list)
    available: bool = False


_LINT_CACHE: "collections.OrderedDict[str, list[str]]" = collections.OrderedDict()
_LINT_CACHE_SIZE = 128
_LINT_LOCK = threading.Lock()


def _lint_texts(launch: "Launch") -> _Lint:
    """The migration linter's findings for the launched code (none when it cannot be imported).

    The code's notebook cells are linted (a ``%%distributed`` cell, or the cells that
    define the launched function), each once per kernel: a relaunch costs a lookup.
    """
    try:
        from .. import lint
    except ImportError:
        return _Lint()
    sources = getattr(launch, "sources", {}) or {}
    result = _Lint(available=True)
    for display, source in sources.values():
        with _LINT_LOCK:
            cached = _LINT_CACHE.get(source)
        if cached is None:
            cached = []
            try:
                diagnostics = lint.lint_cell(source)  # IPython syntax included
            except Exception as exc:  # a linter bug is shown as a finding, never breaks the panel
                diagnostics = []
                cached.append(f"the linter failed ({type(exc).__name__}: {exc})")
            for diagnostic in diagnostics:
                if diagnostic.code.startswith("AM0"):  # about the linter itself (syntax it cannot parse)
                    continue
                cached.append(_diagnostic_text(diagnostic))
            with _LINT_LOCK:
                _LINT_CACHE[source] = cached
                while len(_LINT_CACHE) > _LINT_CACHE_SIZE:
                    _LINT_CACHE.popitem(last=False)
        result.findings.extend(f"{display}: {text}" for text in cached)
    return result


def _diagnostic_text(diagnostic: "Diagnostic") -> str:
    """``AM101 line 2: use air_magic instead of serverless_gpu``."""
    if not diagnostic.message:
        return str(diagnostic)
    return " ".join(p for p in (diagnostic.code, f"line {diagnostic.line}:", diagnostic.message) if p)
