"""The parsed module every check reads, and what the checks report into.

:class:`Source` parses once and resolves libcst's metadata in one batched walk:
positions (lines and byte offsets), parents, scopes and qualified names.  Matching goes
through ``QualifiedNameProvider``, so aliases are followed:
``import serverless_gpu as sg; @sg.distributed(gpus=8)`` is found as
``serverless_gpu.distributed``.  A name that is not bound at all (a snippet pasted
without its imports) is matched by its spelling.

Checks add :class:`Finding`s with byte edits; an import a fix needs is asked for with
:meth:`Source.import_ref` (a name) or :meth:`Source.module_ref` (a module) and inserted
once, after the last top-level import that precedes its first use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence, cast

import libcst as cst
from libcst._metadata_dependent import LazyValue
from libcst.metadata import (
    ByteSpanPositionProvider,
    CodeRange,
    CodeSpan,
    GlobalScope,
    ImportAssignment,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    QualifiedNameProvider,
    Scope,
    ScopeProvider,
)

from air_magic.accelerators import GPUType
from air_magic.lint.diagnostics import Diagnostic, Edit, Fix
from air_magic.lint.rules import DISTRIBUTED_MATCHES, LEGACY_PACKAGES, MOVES, NO_EQUIVALENT, Applicability, rule

__all__ = [
    "EMPTY",
    "LEGACY_MODULES",
    "Region",
    "Source",
    "Finding",
    "accelerator_replacement",
    "bool_value",
    "dotted",
    "int_value",
    "is_distributed",
    "legacy_package",
    "module_name",
    "no_equivalent_hint",
    "quoted",
    "string_value",
]

EMPTY = cst.Module(body=[])

#: Legacy modules (as opposed to names): an import of one binds a module object.
LEGACY_MODULES = frozenset(
    f"{pkg}{suffix}"
    for pkg in LEGACY_PACKAGES
    for suffix in ("", ".data", ".compute", ".runtime", ".utils", ".utils.sgc_dist", ".launcher")
)


@dataclass(frozen=True)
class Region:
    """Lines ``start..end`` (1-based, inclusive) that run on every rank as they are: the
    body of a ``%%distributed`` cell, which has no function around it."""

    start: int
    end: int
    label: str


# -- accelerator values (shared with the %%distributed header check) ------------------------------


def accelerator_replacement(legacy: GPUType, count: int | None) -> tuple[str, str] | None:
    """``(new value, reason)`` for a legacy GPU type, or ``None`` when the count decides and
    is unknown.

    >>> accelerator_replacement(GPUType.H100, 8)
    ('GPU_8xH100', 'with 8 GPUs')
    >>> accelerator_replacement(GPUType.A10, None)
    ('GPU_1xA10', 'an A10 node has one GPU, so')
    >>> accelerator_replacement(GPUType.H100, None) is None
    True
    """
    shape = legacy.to_accelerator_type(count)
    if shape is None:
        return None
    if legacy is GPUType.A10:
        return shape.value, "an A10 node has one GPU, so"
    if legacy is GPUType.B300:
        return shape.value, "a B300 node has eight GPUs, so"
    return shape.value, f"with {count} GPU{'s' if count != 1 else ''}"


# -- the parsed source ---------------------------------------------------------------------------


@dataclass
class Need:
    """An import some fix needs: ``from module import name`` (or ``import module``)."""

    module: str
    name: str | None
    at: int  # byte offset of the first use


@dataclass
class Finding:
    code: str
    node: cst.CSTNode
    fields: dict[str, Any] = field(default_factory=dict)
    edits: list[Edit] = field(default_factory=list)
    needs: list[tuple[str, str | None]] = field(default_factory=list)
    applicability: Applicability | None = None  # default: the rule's


class Source:
    """A module parsed once, with the metadata every checker uses."""

    def __init__(self, code: str, describe_line: Callable[[int], str], launched_names: Sequence[str] = ()) -> None:
        self.launched_names = frozenset(launched_names)
        self.data = code.encode("utf-8")
        self.module = cst.parse_module(code)
        wrapper = MetadataWrapper(self.module, unsafe_skip_copy=True)
        # One batched walk for every provider (resolving them one by one walks the tree each time).
        metadata = wrapper.resolve_many(
            [PositionProvider, ByteSpanPositionProvider, ParentNodeProvider, ScopeProvider, QualifiedNameProvider]
        )
        self.positions = cast("Mapping[cst.CSTNode, CodeRange]", metadata[PositionProvider])
        self.spans = cast("Mapping[cst.CSTNode, CodeSpan]", metadata[ByteSpanPositionProvider])
        self.parents = cast("Mapping[cst.CSTNode, cst.CSTNode]", metadata[ParentNodeProvider])
        self.scopes = cast("Mapping[cst.CSTNode, Scope | None]", metadata[ScopeProvider])
        self._qualified = cast("Mapping[cst.CSTNode, Any]", metadata[QualifiedNameProvider])
        self.global_scope = next((s for s in self.scopes.values() if isinstance(s, GlobalScope)), None)
        self.describe_line = describe_line
        self.findings: list[Finding] = []
        self.needs: dict[tuple[str, str | None], Need] = {}
        collector = Collector()
        self.module.visit(collector)
        self.nodes = collector

    # -- positions and text --------------------------------------------------------------------

    def span(self, node: cst.CSTNode) -> tuple[int, int]:
        s = self.spans[node]
        return s.start, s.start + s.length

    def start(self, node: cst.CSTNode) -> tuple[int, int]:
        p = self.positions[node].start
        return p.line, p.column

    def text(self, node: cst.CSTNode) -> str:
        a, b = self.span(node)
        return self.data[a:b].decode("utf-8")

    def edit(self, node: cst.CSTNode, text: str) -> Edit:
        a, b = self.span(node)
        return Edit(a, b, text)

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.parents.get(node)

    def line_start(self, offset: int) -> int:
        return self.data.rfind(b"\n", 0, offset) + 1

    def line_end(self, offset: int) -> int:
        """Offset just past the newline that ends the line containing ``offset``."""
        nl = self.data.find(b"\n", offset)
        return len(self.data) if nl == -1 else nl + 1

    # -- names -----------------------------------------------------------------------------------

    def qnames(self, node: cst.CSTNode) -> set[str]:
        """Qualified names of ``node``; the dotted spelling when nothing binds its root name."""
        value = self._qualified.get(node)
        if isinstance(value, LazyValue):
            value = value()
        names = {q.name for q in value} if value else set()
        if names:
            return names
        spelled = dotted(node)
        if spelled is not None and self._unbound(node):
            return {spelled}
        return set()

    def _unbound(self, node: cst.CSTNode) -> bool:
        root = node
        while isinstance(root, cst.Attribute):
            root = root.value
        if not isinstance(root, cst.Name):
            return False
        scope = self.scopes.get(root)
        return scope is None or root.value not in scope

    def matches(self, node: cst.CSTNode, names: Iterable[str]) -> bool:
        return bool(self.qnames(node) & set(names))

    # -- findings --------------------------------------------------------------------------------

    def report(self, code: str, node: cst.CSTNode, **fields: Any) -> Finding:
        finding = Finding(code, node, fields)
        self.findings.append(finding)
        return finding

    def import_ref(self, module: str, name: str, at: cst.CSTNode) -> tuple[str, tuple[str, str | None] | None]:
        """How a fix refers to ``module.name`` at ``at``, and the import it needs (if any)."""
        offset = self.span(at)[0]
        scope = self.scopes.get(at) or self.global_scope
        if self._imports(scope, name, module):
            return name, None
        bound = self._binding(scope, name)
        if bound is None or self._imports(scope, name, module, dropped=True):
            return name, self._need(module, name, offset)
        # ``name`` means something else here: use the module.
        root = module.split(".")[0]
        if self._binding(scope, root) == root:
            return f"{module}.{name}", (self._need(module, None, offset) if "." in module else None)
        return f"{module}.{name}", self._need(module, None, offset)

    def module_ref(self, module: str, at: cst.CSTNode) -> tuple[str, tuple[str, str | None] | None] | None:
        """How a fix refers to the top-level module ``module`` at ``at`` (``torch``, or ``th``
        after ``import torch as th``) and the ``import module`` it needs, if any.

        ``None`` when ``module``'s name means something else there and no alias of it is
        in scope: a fix would have to rename code it does not own.
        """
        scope = self.scopes.get(at) or self.global_scope
        aliases = sorted(
            {
                alias.evaluated_alias
                for stmt in self.nodes.imports
                if isinstance(stmt, cst.Import)
                for alias in stmt.names
                if alias.evaluated_alias is not None and alias.evaluated_name == module
            }
        )
        for name in (module, *aliases):
            if self._names_module(scope, name, module):
                return name, None
        if self._binding(scope, module) is None:
            return module, self._need(module, None, self.span(at)[0])
        return None

    def _names_module(self, scope: Scope | None, name: str, module: str) -> bool:
        """``name`` is bound in ``scope`` only by imports of the module ``module``."""
        if scope is None or name not in scope:
            return False
        assignments = list(scope[name])
        return bool(assignments) and all(
            isinstance(a, ImportAssignment) and module in {q.name for q in a.get_qualified_names_for(name)}
            for a in assignments
        )

    def _imports(self, scope: Scope | None, name: str, module: str, dropped: bool = False) -> bool:
        """``name`` is bound only by imports of ``module.name`` (or legacy imports that AM101
        moves there).  With ``dropped``: only by unused legacy imports, which AM106 removes."""
        if scope is None or name not in scope:
            return False
        assignments = list(scope[name])
        for assignment in assignments:
            if not isinstance(assignment, ImportAssignment):
                return False
            targets = {q.name for q in assignment.get_qualified_names_for(name)}
            legacy = {q for q in targets if q in MOVES and (MOVES[q].module, MOVES[q].name) == (module, name)}
            if dropped:
                if not legacy or assignment.references:
                    return False
            elif f"{module}.{name}" not in targets and not (legacy and assignment.references):
                return False
        return bool(assignments)

    def _binding(self, scope: Scope | None, name: str) -> str | None:
        """What ``name`` is bound to in ``scope``: a qualified name, ``"?"`` for a local
        value, or ``None`` when unbound."""
        if scope is None or name not in scope:
            return None
        found = "?"
        for assignment in scope[name]:
            if isinstance(assignment, ImportAssignment):
                for q in assignment.get_qualified_names_for(name):
                    found = q.name
        return found

    def _need(self, module: str, name: str | None, offset: int) -> tuple[str, str | None]:
        key = (module, name)
        need = self.needs.get(key)
        if need is None:
            self.needs[key] = Need(module, name, offset)
        elif offset < need.at:
            need.at = offset
        return key

    def _import_edit(self, need: Need) -> Edit:
        nl = self.module.default_newline
        line = (f"from {need.module} import {need.name}" if need.name else f"import {need.module}") + nl
        after = None
        containing = None
        for stmt in self.module.body:
            start, end = self.span(stmt)
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.decorators:
                start = self.span(stmt.decorators[0])[0]
            if end <= need.at and is_import_line(stmt):
                after = end
            if start <= need.at < end:
                containing = start
                break
        if after is not None:
            at = self.line_end(after)
            if at == len(self.data) and not self.data.endswith(b"\n"):
                return Edit(at, at, nl + line[: -len(nl)])
            return Edit(at, at, line)
        at = self.line_start(containing if containing is not None else need.at)
        return Edit(at, at, line)

    def delete_statement(self, stmt: cst.CSTNode) -> list[Edit] | None:
        """Edits that remove the simple statement ``stmt`` with its line, or ``None`` when
        it shares its line with other code.  The only statement of a block becomes ``pass``."""
        line = self.parent(stmt)
        if not isinstance(line, cst.SimpleStatementLine) or len(line.body) != 1:
            return None
        block = self.parent(line)
        start, end = self.span(line)
        first = self.line_start(start)
        if self.data[first:start].strip():
            return None
        if isinstance(block, cst.IndentedBlock) and len(block.body) == 1:
            return [Edit(start, end, "pass")]
        if not isinstance(block, (cst.IndentedBlock, cst.Module)):
            return None
        return [Edit(first, self.line_end(end), "")]

    # -- results ---------------------------------------------------------------------------------

    def diagnostics(self, path: str) -> list[Diagnostic]:
        import_edits = {key: self._import_edit(need) for key, need in self.needs.items()}
        out = []
        for f in self.findings:
            applicability = f.applicability or rule(f.code).fix
            fix = None
            if f.edits and applicability is not Applicability.DISPLAY_ONLY:
                edits = set(f.edits) | {import_edits[k] for k in f.needs}
                fix = Fix(applicability, tuple(sorted(edits)))
            else:
                applicability = Applicability.DISPLAY_ONLY
            pos = self.positions[f.node]
            out.append(
                Diagnostic.from_rule(
                    f.code,
                    f.fields,
                    path=path,
                    line=pos.start.line,
                    col=pos.start.column + 1,
                    end_line=pos.end.line,
                    end_col=pos.end.column + 1,
                    applicability=applicability,
                    fix=fix,
                )
            )
        out.sort(key=lambda d: (d.line, d.col, d.code))
        return out


def is_import_line(stmt: cst.CSTNode) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and all(
        isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
    )


def dotted(node: cst.CSTNode) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def module_name(node: cst.ImportFrom) -> str | None:
    if node.relative or node.module is None:
        return None
    return dotted(node.module)


def legacy_package(qualified: str) -> str | None:
    for pkg in LEGACY_PACKAGES:
        if qualified == pkg or qualified.startswith(pkg + "."):
            return pkg
    return None


def no_equivalent_hint(qualified: str) -> str:
    best = ""
    for prefix in NO_EQUIVALENT:
        if (qualified == prefix or qualified.startswith(prefix + ".")) and len(prefix) > len(best):
            best = prefix
    return NO_EQUIVALENT.get(best, "this name is Databricks-only")


def string_value(node: cst.CSTNode | None) -> str | None:
    if isinstance(node, cst.SimpleString) and "b" not in node.prefix.lower():
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def int_value(node: cst.CSTNode | None) -> int | None:
    if isinstance(node, cst.Integer):
        value = node.evaluated_value
        return value if isinstance(value, int) else None
    return None


def bool_value(node: cst.CSTNode | None) -> bool | None:
    if isinstance(node, cst.Name) and node.value in ("True", "False"):
        return node.value == "True"
    return None


def quoted(value: str, like: cst.CSTNode | None) -> str:
    quote = like.quote if isinstance(like, cst.SimpleString) and len(like.quote) == 1 else '"'
    return f"{quote}{value}{quote}"


class Collector(cst.CSTVisitor):
    """Every node some checker looks at, gathered in one walk."""

    def __init__(self) -> None:
        self.calls: list[cst.Call] = []
        self.imports: list[cst.Import | cst.ImportFrom] = []
        self.functions: list[cst.FunctionDef] = []
        self.assigns: list[cst.Assign] = []
        self.strings: list[cst.SimpleString] = []
        self.ifs: list[cst.If] = []

    def visit_Call(self, node: cst.Call) -> None:
        self.calls.append(node)

    def visit_Import(self, node: cst.Import) -> None:
        self.imports.append(node)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        self.imports.append(node)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.functions.append(node)

    def visit_Assign(self, node: cst.Assign) -> None:
        self.assigns.append(node)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        self.strings.append(node)

    def visit_If(self, node: cst.If) -> None:
        self.ifs.append(node)


def is_distributed(src: Source, node: cst.CSTNode) -> bool:
    return src.matches(node, DISTRIBUTED_MATCHES)
