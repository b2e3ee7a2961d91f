"""The migration linter's findings for a launch's code, as the panel lists them.

Run once per launch on a thread of its own (``LaunchState.start_lint``)::

    launch.sources: {key: (display name, cell source)}
        --> air_magic.lint.lint_cell(source)   (each distinct cell once per kernel: cached)
        --> Diagnostic(code, line, message,    AM0xx (about the linter itself) left out
                       fix_title, fixable, applicability)
        --> _Lint.findings: ["Cell In[4]: AM101 line 2: use air_magic ...", ...]
            _Lint.items:    the same with each finding's own hint (its fix_title) and
                            whether ``--fix`` ("safe") or ``--fix --unsafe-fixes`` ("unsafe")
                            rewrites it ("" : by hand)

``air_magic.lint`` is imported only here, when a launch is linted.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch
    from air_magic.lint.diagnostics import Diagnostic


@dataclass(frozen=True)
class _Finding:
    text: str  # "Cell In[4]: AM101 line 2: use air_magic instead of serverless_gpu"
    hint: str = ""  # what to do (the diagnostic's fix title)
    fix: str = ""  # "safe": `air-magic lint --fix` fixes it; "unsafe": with --unsafe-fixes; "": by hand


@dataclass
class _Lint:
    findings: list[str] = field(default_factory=list)
    available: bool = False
    items: list[_Finding] = field(default_factory=list)

    def add(self, finding: _Finding) -> None:
        self.items.append(finding)
        self.findings.append(finding.text)


#: Left out of a launch's findings: ``AM303`` (data built outside the launched code is pickled
#: and sent) guesses from the code alone, and at a launch the kernel knows better: capture
#: pickled each name and warns with its real size when it passes ``AIR_MAGIC_CAPTURE_WARN_MB``
#: (a 4x1 tensor is no "large data").
_LAUNCH_SKIPS = ("AM303",)

_LINT_CACHE: "collections.OrderedDict[str, list[_Finding]]" = collections.OrderedDict()
_LINT_CACHE_SIZE = 128
_LINT_LOCK = threading.Lock()


def _lint_texts(launch: "Launch") -> _Lint:
    """The migration linter's findings for the launched code (none when it cannot be imported).

    The code's notebook cells are linted (a ``%%distributed`` cell, or the cells that
    define the launched function), each once per kernel: a relaunch costs a lookup.
    """
    try:
        from air_magic import lint
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
                cached.append(_Finding(f"the linter failed ({type(exc).__name__}: {exc})"))
            for diagnostic in diagnostics:
                if diagnostic.code.startswith("AM0"):  # about the linter itself (syntax it cannot parse)
                    continue
                if diagnostic.code in _LAUNCH_SKIPS:
                    continue
                cached.append(_finding(diagnostic))
            with _LINT_LOCK:
                _LINT_CACHE[source] = cached
                while len(_LINT_CACHE) > _LINT_CACHE_SIZE:
                    _LINT_CACHE.popitem(last=False)
        for finding in cached:
            result.add(_Finding(f"{display}: {finding.text}", finding.hint, finding.fix))
    return result


def warm() -> None:
    """Import the linter and lint a one-line cell (what a first launch's lint would pay)."""
    from air_magic import lint

    lint.lint_cell("import torch\n")


def _finding(diagnostic: "Diagnostic") -> _Finding:
    """A diagnostic's text, its own hint, and which ``air-magic lint --fix`` run rewrites it."""
    fix = ""
    if getattr(diagnostic, "fixable", False):
        fix = "safe" if str(diagnostic.applicability) == "safe" else "unsafe"
    return _Finding(_diagnostic_text(diagnostic), str(getattr(diagnostic, "fix_title", "") or ""), fix)


def _diagnostic_text(diagnostic: "Diagnostic") -> str:
    """``AM101 line 2: use air_magic instead of serverless_gpu``."""
    if not diagnostic.message:
        return str(diagnostic)
    return " ".join(p for p in (diagnostic.code, f"line {diagnostic.line}:", diagnostic.message) if p)
