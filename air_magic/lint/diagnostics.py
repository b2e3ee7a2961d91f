"""What a lint run reports: :class:`Diagnostic` and the :class:`Fix` it may carry."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from air_magic.errors import AirMagicError
from air_magic.lint.rules import Applicability, rule

__all__ = ["Edit", "Fix", "Diagnostic", "ConvergenceError"]


@dataclass(frozen=True, order=True)
class Edit:
    """Replace the UTF-8 bytes ``[start, end)`` of the linted source by ``text``."""

    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Fix:
    """Edits that are applied together or not at all."""

    applicability: Applicability
    edits: tuple[Edit, ...]


@dataclass(frozen=True)
class Diagnostic:
    """One finding.

    ``line`` and ``col`` are 1-based.  In a notebook, ``cell`` is the 1-based position of
    the cell in the notebook (markdown cells count) and ``line`` is the line inside that
    cell; for a ``.py`` file ``cell`` is ``None``.  ``applicability`` is that of the fix
    this finding carries (``display-only`` when there is none).
    """

    code: str
    message: str
    path: str
    cell: int | None
    line: int
    col: int
    applicability: Applicability
    fix_title: str = ""
    end_line: int = 0
    end_col: int = 0
    fix: Fix | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_rule(
        cls,
        code: str,
        fields: Mapping[str, Any],
        *,
        path: str,
        line: int,
        col: int,
        end_line: int,
        end_col: int,
        cell: int | None = None,
        applicability: Applicability = Applicability.DISPLAY_ONLY,
        fix: Fix | None = None,
        fix_title: str | None = None,
    ) -> Diagnostic:
        """A finding of rule ``code``, its message and fix title filled with ``fields``
        (``fix_title`` replaces the rule's)."""
        r = rule(code)
        return cls(
            code=code,
            message=r.format_message(**fields),
            path=path,
            cell=cell,
            line=line,
            col=col,
            applicability=applicability,
            fix_title=r.format_fix_title(**fields) if fix_title is None else fix_title,
            end_line=end_line,
            end_col=end_col,
            fix=fix,
        )

    @property
    def name(self) -> str:
        return rule(self.code).name

    @property
    def fixable(self) -> bool:
        return self.fix is not None and self.applicability is not Applicability.DISPLAY_ONLY

    @property
    def location(self) -> str:
        """``path:line:col`` or, in a notebook, ``path:cell N:line:col``."""
        where = f"cell {self.cell}:" if self.cell is not None else ""
        return f"{self.path}:{where}{self.line}:{self.col}"

    def __str__(self) -> str:
        mark = " [*]" if self.fixable and self.applicability is Applicability.SAFE else ""
        return f"{self.location}: {self.code}{mark} {self.message}"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("fix")
        data["applicability"] = str(self.applicability)
        data["name"] = self.name
        data["fixable"] = self.fixable
        return data


class ConvergenceError(AirMagicError, RuntimeError):
    """Fixing kept changing the code for the maximum number of passes."""

    def __init__(self, path: str, passes: int, codes: list[str]) -> None:
        self.path = path
        self.codes = codes
        super().__init__(
            f"{path}: fixes did not settle after {passes} passes (still changing: {', '.join(codes)}); "
            "nothing was written. Please report this with the file."
        )
