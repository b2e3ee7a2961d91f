"""AM4xx: portability: CUDA-only code that cannot run on a machine without GPUs.

The documentation's examples pin every rank to a GPU: NCCL, ``torch.cuda.set_device``,
a ``cuda:N`` device, ``DistributedDataParallel(device_ids=[...])``.  Each fix puts that
choice behind ``torch.cuda.is_available()``::

    AM401  dist.init_process_group("nccl")
       ->  dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    AM402  torch.cuda.set_device(rank)
       ->  if torch.cuda.is_available():
               torch.cuda.set_device(rank)
    AM403  torch.device(f"cuda:{rank}")
       ->  torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
           torch.device("cuda", rank)
       ->  torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    AM404  DDP(model, device_ids=[rank])
       ->  DDP(model, device_ids=[rank] if torch.cuda.is_available() else None)

Where CUDA is available every rewritten expression has the value it had, so a GPU run is
unchanged; where it is not, the original fails (no NCCL, no device to set, DDP refuses
device ids for a CPU model) and the fixed code runs on CPU ranks with gloo.

Code already behind that test is left alone: an expression in the ``if`` branch of
``... if torch.cuda.is_available() else ...``, a statement under
``if torch.cuda.is_available():`` (or in the ``else`` of ``if not torch.cuda.is_available():``).
That is also why fixing twice equals fixing once.
"""

from __future__ import annotations

import libcst as cst

from air_magic.lint._source import Source, quoted, string_value
from air_magic.lint.diagnostics import Edit

__all__ = ["check_portability"]

_IS_AVAILABLE = frozenset({"torch.cuda.is_available"})
#: The qualified names, and the spellings of a snippet pasted without its imports.
_INIT_PROCESS_GROUP = frozenset(
    {
        "torch.distributed.init_process_group",
        "torch.distributed.distributed_c10d.init_process_group",
        "dist.init_process_group",
        "init_process_group",
    }
)
_SET_DEVICE = frozenset({"torch.cuda.set_device"})
_DEVICE = frozenset({"torch.device"})
_DDP = frozenset(
    {
        "torch.nn.parallel.DistributedDataParallel",
        "torch.nn.parallel.distributed.DistributedDataParallel",
        "DistributedDataParallel",
        "DDP",
    }
)
#: DistributedDataParallel(module, device_ids, output_device, ...): the GPU arguments.
_DDP_DEVICE_ARGS = ("device_ids", "output_device")


def check_portability(src: Source) -> None:
    for call in src.nodes.calls:
        func = call.func
        if src.matches(func, _INIT_PROCESS_GROUP):
            _check_backend(src, call)
        elif src.matches(func, _SET_DEVICE):
            _check_set_device(src, call)
        elif src.matches(func, _DEVICE):
            _check_device(src, call)
        elif src.matches(func, _DDP):
            _check_ddp(src, call)


# -- the CUDA test -------------------------------------------------------------------------------


def _implies_cuda(src: Source, test: cst.BaseExpression | None) -> bool:
    """``test`` is true only where CUDA is available: ``torch.cuda.is_available()``, alone
    or in an ``and``."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.And):
        return _implies_cuda(src, test.left) or _implies_cuda(src, test.right)
    return isinstance(test, cst.Call) and not test.args and src.matches(test.func, _IS_AVAILABLE)


def _negation(test: cst.BaseExpression) -> cst.BaseExpression | None:
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return test.expression
    return None


def _guarded(src: Source, node: cst.CSTNode) -> bool:
    """``node`` runs only where CUDA is available (it is in the CUDA branch of an ``if``
    statement or a conditional expression)."""
    child, parent = node, src.parent(node)
    while parent is not None:
        if isinstance(parent, (cst.If, cst.IfExp)):
            if child is parent.body and _implies_cuda(src, parent.test):
                return True
            if child is parent.orelse and _implies_cuda(src, _negation(parent.test)):
                return True
        child, parent = parent, src.parent(parent)
    return False


def _cuda_test(src: Source, at: cst.CSTNode) -> tuple[str, tuple[str, str | None] | None] | None:
    """``torch.cuda.is_available()`` spelled as ``torch`` is named at ``at``, and the
    ``import torch`` it needs; ``None`` when ``torch`` means something else there."""
    ref = src.module_ref("torch", at)
    if ref is None:
        return None
    name, need = ref
    return f"{name}.cuda.is_available()", need


def _stands_bare(src: Source, node: cst.CSTNode) -> bool:
    """A conditional expression can replace ``node`` without parentheses."""
    if getattr(node, "lpar", None):
        return True  # the parentheses are the node's own and stay
    parent = src.parent(node)
    if isinstance(parent, cst.IfExp):
        return parent.orelse is node
    return isinstance(
        parent,
        (
            cst.Arg,
            cst.Assign,
            cst.AnnAssign,
            cst.AugAssign,
            cst.Return,
            cst.Expr,
            cst.Element,
            cst.DictElement,
            cst.Index,
            cst.Lambda,
        ),
    )


def _needs_parentheses_as_body(node: cst.BaseExpression) -> bool:
    """``node`` must be parenthesized to be the first operand of ``x if c else y``."""
    return not node.lpar and isinstance(node, (cst.IfExp, cst.Lambda, cst.NamedExpr))


def _report_conditional(
    src: Source,
    code: str,
    node: cst.BaseExpression,
    otherwise: str,
    within: cst.CSTNode | None = None,
    **fields: str,
) -> None:
    """Replace ``node`` by ``node if torch.cuda.is_available() else otherwise``; the finding
    points at ``within`` (default: ``node``), and its fix title shows ``within``'s new text."""
    test = _cuda_test(src, node)
    check, need = test if test is not None else ("torch.cuda.is_available()", None)
    body = src.text(node)
    if _needs_parentheses_as_body(node):
        body = f"({body})"
    new = f"{body} if {check} else {otherwise}"
    if not _stands_bare(src, node):
        new = f"({new})"
    start, end = src.span(node)
    outer = src.span(within) if within is not None else (start, end)
    shown = src.data[outer[0] : start].decode("utf-8") + new + src.data[end : outer[1]].decode("utf-8")
    f = src.report(code, within if within is not None else node, new=shown, **fields)
    if test is not None:  # else ``torch`` names something else here: said, not rewritten
        f.edits = [src.edit(node, new)]
        f.needs = [need] if need else []


# -- AM401: the NCCL backend -------------------------------------------------------------------


def _check_backend(src: Source, call: cst.Call) -> None:
    for index, arg in enumerate(call.args):
        keyword = arg.keyword.value if arg.keyword is not None else None
        if arg.star or not (keyword == "backend" or keyword is None and index == 0):
            continue
        value = string_value(arg.value)
        if value is None or value.lower() != "nccl" or _guarded(src, arg.value):
            continue
        text = src.text(arg.value)
        what = f"backend={text}" if keyword else f"{src.text(call.func)}({text})"
        within = arg if keyword else None
        _report_conditional(src, "AM401", arg.value, quoted("gloo", arg.value), within=within, what=what)


# -- AM402: torch.cuda.set_device ----------------------------------------------------------------


def _check_set_device(src: Source, call: cst.Call) -> None:
    if _guarded(src, call):
        return
    test = _cuda_test(src, call)
    check, need = test if test is not None else ("torch.cuda.is_available()", None)
    f = src.report("AM402", call, call=f"{src.text(call.func)}(...)", check=check)
    stmt = src.parent(call)
    line = src.parent(stmt) if isinstance(stmt, cst.Expr) and stmt.value is call else None
    block = src.parent(line) if isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 else None
    if stmt is None or not isinstance(block, (cst.IndentedBlock, cst.Module)):
        return  # shares its line, or is part of an expression: a statement cannot be wrapped
    start, end = src.span(stmt)
    first = src.line_start(start)
    indent = src.data[first:start].decode("utf-8")
    if indent.strip() or test is None:
        return
    unit = (block.indent if isinstance(block, cst.IndentedBlock) else None) or src.module.default_indent
    newline = src.module.default_newline
    f.edits = [Edit(start, start, f"if {check}:{newline}{indent}{unit}")]
    if not _has_multiline_string(call):
        # Continuation lines move with the statement (inside a string they would be text).
        offset = src.line_end(start)
        while offset < end:
            if src.data[offset : offset + 1] not in (b"\n", b"\r"):
                f.edits.append(Edit(offset, offset, unit))
            offset = src.line_end(offset)
    f.needs = [need] if need else []


def _has_multiline_string(node: cst.CSTNode) -> bool:
    found = False

    class Strings(cst.CSTVisitor):
        def visit_SimpleString(self, string: cst.SimpleString) -> None:
            nonlocal found
            found = found or "\n" in string.value

        def visit_FormattedString(self, string: cst.FormattedString) -> None:
            nonlocal found
            found = found or len(string.start.lstrip("rRbBfF")) == 3  # a triple-quoted f-string

    node.visit(Strings())
    return found


# -- AM403: a CUDA device ------------------------------------------------------------------------


def _leading_text(node: cst.BaseExpression) -> str | None:
    """The literal text a string expression starts with: ``"cuda:"`` for ``f"cuda:{rank}"``,
    ``"cuda:%d" % rank`` or ``"cuda:{}".format(rank)``."""
    if isinstance(node, cst.SimpleString):
        return string_value(node)
    if isinstance(node, cst.FormattedString):
        first = node.parts[0] if node.parts else None
        return first.value if isinstance(first, cst.FormattedStringText) else None
    if isinstance(node, cst.ConcatenatedString):
        return _leading_text(node.left)  # type: ignore[arg-type]
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, (cst.Add, cst.Modulo)):
        return _leading_text(node.left)
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value == "format":
        return _leading_text(node.func.value)
    return None


def _is_cuda(node: cst.BaseExpression) -> bool:
    text = _leading_text(node)
    return text is not None and (text == "cuda" or text.startswith("cuda:"))


def _check_device(src: Source, call: cst.Call) -> None:
    args = [a for a in call.args if not a.star]
    if len(args) != len(call.args) or not args:
        return
    kind = next((a for a in args if a.keyword is not None and a.keyword.value == "type"), args[0])
    if kind.keyword is not None and kind.keyword.value != "type":
        return
    if not _is_cuda(kind.value) or _guarded(src, call):
        return
    text = src.text(call)
    if len(args) == 1:
        # torch.device("cuda:0") -> torch.device("cuda:0" if ... else "cpu"): the same call shape
        _report_conditional(src, "AM403", kind.value, quoted("cpu", kind.value), within=call, call=text)
    else:
        # torch.device("cuda", rank): a CPU device has no such index; choose the whole device
        cpu = quoted("cpu", kind.value)
        _report_conditional(src, "AM403", call, f"{src.text(call.func)}({cpu})", call=text)


# -- AM404: DistributedDataParallel's device arguments -------------------------------------------


def _handled(src: Source, value: cst.BaseExpression) -> bool:
    """``value`` already chooses per machine: a conditional with a ``None`` branch or on
    ``torch.cuda.is_available()``, or it is evaluated only where CUDA is available."""
    if isinstance(value, cst.Name) and value.value == "None":
        return True
    if isinstance(value, cst.IfExp):
        branches = (value.body, value.orelse)
        if _implies_cuda(src, value.test) or any(isinstance(b, cst.Name) and b.value == "None" for b in branches):
            return True
    return _guarded(src, value)


def _check_ddp(src: Source, call: cst.Call) -> None:
    position: int | None = 0  # of a positional argument: module, device_ids, output_device
    for arg in call.args:
        if arg.star:
            position = None  # after *args, which value lands where is not known
            continue
        if arg.keyword is not None:
            name = arg.keyword.value
        elif position is None:
            continue
        else:
            name = _DDP_DEVICE_ARGS[position - 1] if 1 <= position <= len(_DDP_DEVICE_ARGS) else ""
            position += 1
        if name not in _DDP_DEVICE_ARGS or _handled(src, arg.value):
            continue
        within = arg if arg.keyword is not None else None
        _report_conditional(src, "AM404", arg.value, "None", within=within, arg=name)
