"""AM1xx: imports and names of ``serverless_gpu`` / ``databricks.air``.

An import statement is migrated as a whole: names with an exact equivalent move (the
statement is rewritten in place, split when some names stay), unused legacy names are
dropped, and uses of a renamed name are renamed with it.  A module import whose every
use exists in air_magic is pointed at air_magic; otherwise each use is rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import libcst as cst
from libcst.metadata import ImportAssignment

from air_magic.lint._source import (
    EMPTY,
    LEGACY_MODULES,
    Source,
    dotted,
    legacy_package,
    module_name,
    no_equivalent_hint,
    string_value,
)
from air_magic.lint.diagnostics import Edit
from air_magic.lint.rules import (
    DEEPSPEED_DISTRIBUTOR_NAMES,
    LEGACY_ENV_VARS,
    MOVES,
    PACKAGE_NAMES,
    TORCH_DISTRIBUTOR_NAMES,
    Applicability,
    Move,
    rule,
)

__all__ = ["check_imports", "check_env_vars"]

#: Not legacy, but left behind by a migration: removed when nothing uses them.
_LEFTOVERS = (
    TORCH_DISTRIBUTOR_NAMES | DEEPSPEED_DISTRIBUTOR_NAMES | {"air_magic.GPUType", "air_magic.accelerators.GPUType"}
)


@dataclass
class _Alias:
    """One name an import statement binds, and what becomes of it."""

    node: cst.ImportAlias
    qualified: str  # what it imports: "serverless_gpu.distributed", "serverless_gpu"
    bound: str  # the local name: "distributed", "sg"
    references: list[cst.CSTNode]
    is_module: bool


def _aliases(src: Source, stmt: cst.Import | cst.ImportFrom) -> list[_Alias] | None:
    scope = src.scopes.get(stmt)
    if scope is None or isinstance(stmt.names, cst.ImportStar):
        return None
    module = module_name(stmt) if isinstance(stmt, cst.ImportFrom) else ""
    if module is None:
        return None
    out = []
    for alias in stmt.names:
        name = dotted(alias.name) or ""
        qualified = f"{module}.{name}" if module else name
        bound = alias.evaluated_alias or name
        refs: list[cst.CSTNode] = []
        for assignment in scope.assignments:
            if not isinstance(assignment, ImportAssignment) or assignment.node is not stmt:
                continue
            # ``import a.b`` binds ``a.b`` and ``a``: uses of either are uses of this import
            parent_package = not module and alias.asname is None and name.startswith(assignment.name + ".")
            if assignment.name == bound or parent_package:
                refs.extend(access.node for access in assignment.references)
        is_module = not module or qualified in LEGACY_MODULES
        out.append(_Alias(alias, qualified, bound, refs, is_module))
    return out


def _chain(src: Source, node: cst.CSTNode) -> list[cst.CSTNode]:
    """``node`` and the attribute accesses built on it: ``sg``, ``sg.data``, ``sg.data.X``."""
    chain = [node]
    while True:
        parent = src.parent(chain[-1])
        if isinstance(parent, cst.Attribute) and parent.value is chain[-1]:
            chain.append(parent)
        else:
            return chain


def _use_move(src: Source, ref: cst.CSTNode) -> tuple[cst.CSTNode, str, Move | None] | None:
    """The part of a use that names a legacy object, its qualified name and its move
    (``None`` for the move when there is no equivalent; ``None`` when nothing is legacy)."""
    longest: tuple[cst.CSTNode, str] | None = None
    for node in _chain(src, ref):
        for q in src.qnames(node):
            if q in MOVES:
                return node, q, MOVES[q]
            if legacy_package(q):
                longest = (node, q)
    if longest is None:
        return None
    return longest[0], longest[1], None


def check_imports(src: Source) -> None:
    for stmt in src.nodes.imports:
        if isinstance(stmt, cst.ImportFrom) and isinstance(stmt.names, cst.ImportStar):
            module = module_name(stmt)
            if module and legacy_package(module):
                src.report(
                    "AM104",
                    stmt,
                    old=f"{module}.*",
                    hint="import each name you use by name; the equivalents are in air_magic and air_magic.data",
                )
            continue
        aliases = _aliases(src, stmt)
        if not aliases:
            continue
        legacy = [a for a in aliases if legacy_package(a.qualified)]
        leftovers = [a for a in aliases if not a.references and a.qualified in _LEFTOVERS]
        if not legacy and not leftovers:
            continue
        plans = {
            level: _plan_statement(src, stmt, aliases, level) for level in (Applicability.SAFE, Applicability.UNSAFE)
        }
        for alias in aliases:
            if not alias.references and (alias in legacy or alias in leftovers):
                why = ""
                if alias in legacy:
                    why = (
                        f"; {PACKAGE_NAMES[legacy_package(alias.qualified) or '']} is not installed outside Databricks"
                    )
                f = src.report("AM106", alias.node, old=alias.qualified, why=why)
                f.edits = plans[Applicability.SAFE]
                continue
            if alias not in legacy:
                continue
            if alias.is_module:
                _check_module_uses(src, alias, plans[Applicability.SAFE])
                continue
            move = MOVES.get(alias.qualified)
            if move is None:
                src.report("AM104", alias.node, old=alias.qualified, hint=no_equivalent_hint(alias.qualified))
                continue
            level = rule(move.code).fix
            f = src.report(move.code, alias.node, **_move_fields(alias.qualified, move))
            f.edits = plans[level]


def _move_fields(qualified: str, move: Move) -> dict[str, Any]:
    return {
        "old": qualified,
        "package": PACKAGE_NAMES.get(legacy_package(qualified) or "", ""),
        "new": f"{move.module}.{move.name}",
        "difference": move.difference,
    }


def _plan_statement(
    src: Source, stmt: cst.Import | cst.ImportFrom, aliases: list[_Alias], level: Applicability
) -> list[Edit]:
    """The edits that migrate a whole import statement at ``level``: unused legacy names are
    dropped, names with an exact equivalent move (``SAFE`` ones only, at the safe level),
    the rest stay.  Uses of a renamed name are renamed with it."""
    allowed = {Applicability.SAFE}
    if level is Applicability.UNSAFE:
        allowed.add(Applicability.UNSAFE)
    keep: list[cst.ImportAlias] = []
    groups: dict[str, list[str]] = {}
    module_imports: list[str] = []
    edits: list[Edit] = []
    same_module_only = isinstance(stmt, cst.ImportFrom)
    for alias in aliases:
        if not alias.references and (legacy_package(alias.qualified) or alias.qualified in _LEFTOVERS):
            same_module_only = False
            continue
        move = MOVES.get(alias.qualified) if not alias.is_module else None
        if move is not None and rule(move.code).fix in allowed:
            name = alias.node.evaluated_name.split(".")[-1]
            asname = alias.node.evaluated_alias
            if move.name != name and asname is None:
                if _free_for(src, move.name, alias.references):
                    edits.extend(src.edit(ref, move.name) for ref in alias.references)
                else:
                    asname = name
            if move.name != name or move.module != "air_magic":
                same_module_only = False
            groups.setdefault(move.module, []).append(move.name + (f" as {asname}" if asname else ""))
            for ref in alias.references:
                edits.extend(_call_args_edits(src, ref, move))
            continue
        if alias.is_module and legacy_package(alias.qualified) and _all_uses_air_magic(src, alias):
            # ``import serverless_gpu as sg`` whose every use exists in air_magic
            same_module_only = False
            if isinstance(stmt, cst.Import) and alias.node.asname is None:
                edits.extend(src.edit(ref, "air_magic") for ref in alias.references)
                module_imports.append("air_magic")
            else:
                module_imports.append(f"air_magic as {alias.bound}")
            continue
        keep.append(alias.node)
        same_module_only = False
    if isinstance(stmt, cst.ImportFrom) and same_module_only and list(groups) == ["air_magic"] and not keep:
        assert stmt.module is not None
        return [src.edit(stmt.module, "air_magic"), *edits]
    if not groups and not module_imports and len(keep) == len(aliases):
        return []
    parts: list[str] = []
    if keep:
        kept = [*keep[:-1], keep[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)]
        node = stmt.with_changes(names=kept)
        one_line = len(kept) == 1 and "\n" not in EMPTY.code_for_node(kept[0])
        if isinstance(node, cst.ImportFrom) and node.rpar is not None and one_line:
            node = node.with_changes(lpar=None, rpar=None)
        parts.append(EMPTY.code_for_node(node))
    parts.extend(f"import {m}" for m in module_imports)
    parts.extend(f"from {module} import {', '.join(names)}" for module, names in groups.items())
    if not parts:
        deletion = src.delete_statement(stmt)
        return [] if deletion is None else deletion + edits
    line = src.parent(stmt)
    if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1:
        start = src.span(stmt)[0]
        indent = src.data[src.line_start(start) : start].decode("utf-8")
        joiner = src.module.default_newline + indent if not indent.strip() else "; "
    else:
        joiner = "; "
    return [src.edit(stmt, joiner.join(parts)), *edits]


def _call_args_edits(src: Source, ref: cst.CSTNode, move: Move) -> list[Edit]:
    """Add ``move.call_args`` to a call of ``ref`` that does not set it already."""
    call = src.parent(ref)
    if not move.call_args or not isinstance(call, cst.Call) or call.func is not ref:
        return []
    keyword = move.call_args.split("=")[0]
    if any(a.keyword is not None and a.keyword.value == keyword for a in call.args):
        return []
    if call.args:
        end = src.span(call.args[-1])[1]
        return [Edit(end, end, ", " + move.call_args)]
    paren = src.data.index(b"(", src.span(ref)[1]) + 1
    return [Edit(paren, paren, move.call_args)]


def _free_for(src: Source, name: str, refs: list[cst.CSTNode]) -> bool:
    """``name`` can be introduced at module level without changing what any use means."""
    scopes = [src.global_scope] + [src.scopes.get(r) for r in refs]
    return all(s is None or name not in s for s in scopes)


def _all_uses_air_magic(src: Source, alias: _Alias) -> bool:
    for ref in alias.references:
        use = _use_move(src, ref)
        if use is None:
            return False  # this binding is also used for something else
        node, _, move = use
        if move is None or move.module != "air_magic" or node is ref:
            return False
        if isinstance(node, cst.Attribute) and src.parent(ref) is not node:
            return False  # sg.compute.GPUType: air_magic has no ``compute``
        if isinstance(node, cst.Attribute) and node.attr.value != move.name:
            return False
    return True


def _check_module_uses(src: Source, alias: _Alias, safe_plan: list[Edit]) -> None:
    """Uses of a legacy module (``sg.distributed``): one finding each; the import is pointed
    at air_magic (``safe_plan``, the statement's safe edits) when every use exists there,
    else each use is rewritten."""
    plan = safe_plan if _all_uses_air_magic(src, alias) else None
    for ref in alias.references:
        use = _use_move(src, ref)
        if use is None:
            continue  # a use of another import of the same top-level package
        node, qualified, move = use
        if move is None:
            src.report("AM104", node, old=qualified, hint=no_equivalent_hint(qualified))
            continue
        f = src.report(move.code, node, **_move_fields(qualified, move))
        if plan is not None:
            f.edits = list(plan)
            continue
        text, need = src.import_ref(move.module, move.name, node)
        f.edits = [src.edit(node, text), *_call_args_edits(src, node, move)]
        f.needs = [need] if need else []


def check_env_vars(src: Source) -> None:
    for node in src.nodes.strings:
        value = string_value(node)
        if value in LEGACY_ENV_VARS:
            src.report("AM105", node, name=value, instead=LEGACY_ENV_VARS[value])
