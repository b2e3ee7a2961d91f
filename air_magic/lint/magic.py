"""``%air_lint``: the migration linter inside the notebook."""

from __future__ import annotations

import difflib
import os
import shlex
from typing import Any, Sequence

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from air_magic.lint._files import UnreadableFile, finding_text, lines, lint_file, summary
from air_magic.lint.diagnostics import Diagnostic

__all__ = ["LintMagics"]


@magics_class
class LintMagics(Magics):
    """The ``%air_lint`` line magic."""

    @magic_arguments()
    @argument(
        "target",
        nargs="?",
        default=None,
        help="a function of the notebook, a cell number (In[N]) or a .py/.ipynb path; "
        "default: this notebook's file when known, else every cell run so far",
    )
    @argument(
        "--fix",
        action="store_true",
        help="print the fixed code of every cell that changes (the notebook is not rewritten)",
    )
    @argument("--diff", action="store_true", help="print what --fix would change, as a diff")
    @argument("--unsafe-fixes", action="store_true", help="include fixes that may change behaviour")
    @argument(
        "--history", action="store_true", help="lint the cells run in this session even when the notebook file is known"
    )
    @line_magic
    def air_lint(self, line: str) -> None:
        """Find code written for serverless_gpu, databricks.air or TorchDistributor.

        Prints one line per finding (``cell:line:col: CODE message``) and what to do.
        The rules are listed in the documentation's "Lint rules" page (docs/reference/lint-rules.rst).

        Examples
        --------
        ::

            In [1]: %load_ext air_magic

            In [2]: from serverless_gpu import distributed
               ...: train = distributed(gpus=2)(print)
            ModuleNotFoundError: No module named 'serverless_gpu'

            In [3]: %air_lint --history
            In [2]:1:28: AM101 [*] `serverless_gpu.distributed` comes from the legacy `serverless_gpu` ...
                fix: Use `air_magic.distributed` (the same API)
            In [2]:2:21: AM201 [*] `gpus` is the old name of `num_accelerators`
                fix: Rename to `num_accelerators`
            Found 2 findings (2 fixable with --fix).

            In [4]: %air_lint --fix --history
            # In [2], fixed:
            from air_magic import distributed
            train = distributed(num_accelerators=2)(print)
        """
        try:  # a trailing "# comment" is left out, as on air_magic's other magics
            split = shlex.split(line, comments=True)
        except ValueError as exc:  # "No closing quotation"
            raise UsageError(f"%air_lint: cannot read the options ({exc}): {line.strip()}") from None
        args = self.air_lint.parser.parse_args(split)  # type: ignore[attr-defined]
        fix = args.fix or args.diff
        target = args.target
        if target is not None and not target.isdigit() and not os.path.exists(target):
            self._lint_function(target)
            return
        if target is not None and not target.isdigit():
            self._lint_file(target, fix, args)
            return
        if target is None and not args.history:
            notebook = self._notebook_path()
            if notebook is not None:
                self._lint_file(notebook, fix, args)
                return
        sources, numbers = self._history(int(target) if target is not None else None)
        self._lint_cells(sources, numbers, fix, args)

    # -- what to lint ----------------------------------------------------------------------------

    def _notebook_path(self) -> str | None:
        ns = self.shell.user_ns if self.shell is not None else {}
        candidates = [ns.get("__vsc_ipynb_file__"), ns.get("__session__"), os.environ.get("JPY_SESSION_NAME")]
        for path in candidates:
            if isinstance(path, str) and path.endswith(".ipynb"):
                for option in (path, os.path.basename(path)):
                    if os.path.isfile(option):
                        return option
        return None

    def _history(self, number: int | None) -> tuple[list[str | None], list[int]]:
        if self.shell is None:
            raise UsageError("%air_lint: no IPython shell")
        history = self.shell.history_manager
        if history is None:
            raise UsageError("%air_lint: this shell keeps no history; name a function or a file instead")
        raw: Sequence[str] = history.input_hist_raw
        current = self.shell.execution_count
        if number is not None:
            if not 0 < number < len(raw) or number == current:
                raise UsageError(
                    f"%air_lint: there is no cell In[{number}] to lint (cells run so far: 1-{len(raw) - 1})"
                )
            return [raw[number]], [number]
        numbers = [n for n in range(1, len(raw)) if n != current]
        return [raw[n] for n in numbers], numbers

    def _lint_function(self, name: str) -> None:
        from air_magic.lint import lint_function

        ns = self.shell.user_ns if self.shell is not None else {}
        if name not in ns:
            raise UsageError(f"%air_lint: {name!r} is neither a function of this notebook, a cell number nor a file")
        diagnostics = lint_function(ns[name])
        self._report(diagnostics, label=None)

    def _lint_file(self, path: str, fix: bool, args: Any) -> None:
        try:
            result = lint_file(path, fix=fix, unsafe=args.unsafe_fixes)
        except UnreadableFile as exc:
            raise UsageError(f"%air_lint: {exc}") from None
        if not fix:
            self._report(result.remaining, label=None)
            return
        changed = [(path if cell is None else f"{path}:cell {cell}", old, new) for cell, old, new in result.changes]
        self._show_fixed(changed, args.diff)
        self._report(result.remaining, label=None, fixing=True)

    def _lint_cells(self, sources: list[str | None], numbers: list[int], fix: bool, args: Any) -> None:
        """Cells of this session's history, named ``In [N]``."""
        from air_magic.lint.notebook import fix_cells, lint_cells

        if not fix:
            self._report(lint_cells(sources, path="In", numbers=numbers), label="In")
            return
        result = fix_cells(sources, path="In", numbers=numbers, unsafe=args.unsafe_fixes)
        changed = [
            (f"In [{number}]", old, new)
            for number, old, new in zip(numbers, sources, result.sources)
            if old is not None and new is not None and old != new
        ]
        self._show_fixed(changed, args.diff)
        self._report(list(result.remaining), label="In", fixing=True)

    # -- output ------------------------------------------------------------------------------------

    @staticmethod
    def _show_fixed(changed: list[tuple[str, str, str]], as_diff: bool) -> None:
        if not changed:
            print("Nothing to fix automatically.")
            return
        for name, old, new in changed:
            if as_diff:
                print(
                    "".join(
                        difflib.unified_diff(
                            lines(old),
                            lines(new),
                            fromfile=name,
                            tofile=name + " (fixed)",
                        )
                    ),
                    end="",
                )
            else:
                print(f"# {name}, fixed:")
                print(new.rstrip("\n"))
                print()

    @staticmethod
    def _report(diagnostics: list[Diagnostic], label: str | None, fixing: bool = False) -> None:
        for d in diagnostics:
            where = f"In [{d.cell}]:{d.line}:{d.col}" if label == "In" else None
            print(finding_text(d, where, mark=not fixing), end="")
        if not diagnostics:
            print("No findings." if not fixing else "Nothing left to fix by hand.")
            return
        print(summary(diagnostics, fixing=fixing, unsafe_hint=False))
