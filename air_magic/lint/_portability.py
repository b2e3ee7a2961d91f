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

Today's idioms (``torch.accelerator``, a rank number as the device) get the same treatment::

    AM405  model.to(local_rank)          (a rank number, or self.gpu_id, as the device)
       ->  model.to(local_rank if torch.cuda.is_available() else "cpu")
    AM406  torch.load(path, map_location=f"cuda:{rank}")
       ->  torch.load(path, map_location=f"cuda:{rank}" if torch.cuda.is_available() else "cpu")
    AM407  torch.accelerator.current_accelerator()          (None where there is no accelerator)
       ->  (torch.accelerator.current_accelerator() or torch.device("cpu"))
    AM408  torch.accelerator.set_device_index(rank)
       ->  if torch.accelerator.is_available():
               torch.accelerator.set_device_index(rank)
    AM409  dist.init_process_group(backend, device_id=device)
       ->  dist.init_process_group(backend, device_id=device if torch.cuda.is_available() else None)
    AM410  if torch.cuda.device_count() < 2: sys.exit(0)   (said, not rewritten: on CPU ranks
                                                             the program ends without training)

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

_IS_AVAILABLE = frozenset({"torch.cuda.is_available", "torch.accelerator.is_available"})
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
_SET_DEVICE_INDEX = frozenset({"torch.accelerator.set_device_index"})
_CURRENT_ACCELERATOR = frozenset({"torch.accelerator.current_accelerator"})
#: What a guard that needs GPUs reads: their number, or whether there are any.
_GPU_COUNT = frozenset(
    {
        "torch.cuda.device_count",
        "torch.accelerator.device_count",
        "torch.cuda.is_available",
        "torch.accelerator.is_available",
    }
)
_EXITS = frozenset({"sys.exit", "exit", "quit", "os._exit"})
#: Names that hold a rank's number (``model.to(local_rank)``, ``.to(self.gpu_id)``).
_RANK_NAMES = frozenset({"rank", "local_rank", "gpu_id", "gpu", "device_id", "gpu_rank", "lrank"})
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
        elif src.matches(func, _SET_DEVICE_INDEX):
            _check_set_device(src, call, code="AM408", family="accelerator")
        elif src.matches(func, _CURRENT_ACCELERATOR):
            _check_current_accelerator(src, call)
        elif isinstance(func, cst.Attribute) and func.attr.value == "to":
            _check_to_rank(src, call)
        if src.matches(func, _INIT_PROCESS_GROUP):
            _check_device_id(src, call)
        _check_map_location(src, call)
    for statement in src.nodes.ifs:
        _check_gpu_guard(src, statement)


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


def _cuda_test(src: Source, at: cst.CSTNode, family: str = "cuda") -> tuple[str, tuple[str, str | None] | None] | None:
    """``torch.cuda.is_available()`` (``family``: ``torch.accelerator.is_available()``)
    spelled as ``torch`` is named at ``at``, and the ``import torch`` it needs; ``None``
    when ``torch`` means something else there."""
    ref = src.module_ref("torch", at)
    if ref is None:
        return None
    name, need = ref
    return f"{name}.{family}.is_available()", need


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


def _check_set_device(src: Source, call: cst.Call, code: str = "AM402", family: str = "cuda") -> None:
    if _guarded(src, call):
        return
    test = _cuda_test(src, call, family)
    check, need = test if test is not None else (f"torch.{family}.is_available()", None)
    f = src.report(code, call, call=f"{src.text(call.func)}(...)", check=check)
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


# -- AM405: a rank's number as the device ----------------------------------------------------------


def _is_rank_number(src: Source, node: cst.BaseExpression) -> bool:
    """``local_rank``, ``self.gpu_id``, ``int(os.environ["LOCAL_RANK"])``, ``0``: a number
    that ``.to()`` takes for the index of an accelerator."""
    if isinstance(node, cst.Integer):
        return True
    if isinstance(node, cst.Name):
        return node.value.lower() in _RANK_NAMES
    if isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value == "self":
        return node.attr.value.lower() in _RANK_NAMES
    if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "int" and node.args:
        return "RANK" in src.text(node.args[0])
    return False


def _check_to_rank(src: Source, call: cst.Call) -> None:
    for index, arg in enumerate(call.args):
        keyword = arg.keyword.value if arg.keyword is not None else None
        if arg.star or not (keyword == "device" or keyword is None and index == 0):
            continue
        if _is_rank_number(src, arg.value) and not _handled(src, arg.value):
            _report_conditional(
                src, "AM405", arg.value, quoted("cpu", None), within=call, call=f".to({src.text(arg.value)})"
            )


# -- AM406: map_location on a GPU ------------------------------------------------------------------


def _check_map_location(src: Source, call: cst.Call) -> None:
    for arg in call.args:
        if arg.keyword is None or arg.keyword.value != "map_location":
            continue
        if _is_cuda(arg.value) and not _handled(src, arg.value):
            what = f"map_location={src.text(arg.value)}"
            _report_conditional(src, "AM406", arg.value, quoted("cpu", arg.value), within=arg, what=what)
        elif isinstance(arg.value, cst.Name):
            _check_map_location_name(src, arg.value)


def _check_map_location_name(src: Source, name: cst.Name) -> None:
    """``loc = f"cuda:{rank}"`` then ``map_location=loc``: the one assignment of the name in
    its scope is where the device is chosen, and where the fix goes."""
    scope = src.scopes.get(name)
    if scope is None or name.value not in scope:
        return
    assignments = list(scope[name.value])
    if len(assignments) != 1:
        return  # bound more than once (or a parameter, an import): not a choice made here
    target = getattr(assignments[0], "node", None)
    holder = src.parent(target) if target is not None else None
    statement = src.parent(holder) if holder is not None else None
    if not (
        isinstance(statement, cst.Assign) and len(statement.targets) == 1 and statement.targets[0].target is target
    ):
        return
    value = statement.value
    if _is_cuda(value) and not _handled(src, value):
        what = f"map_location={name.value}, where {name.value} = {src.text(value)}"
        _report_conditional(src, "AM406", value, quoted("cpu", value), within=statement, what=what)


# -- AM407: torch.accelerator.current_accelerator() ------------------------------------------------


def _check_current_accelerator(src: Source, call: cst.Call) -> None:
    parent = src.parent(call)
    if isinstance(parent, cst.BooleanOperation) and isinstance(parent.operator, cst.Or) and parent.left is call:
        return  # already `... or <a fallback>`
    if _guarded(src, call):
        return
    ref = src.module_ref("torch", call)
    name, need = ref if ref is not None else ("torch", None)
    new = f"{src.text(call)} or {name}.device({_string_inside(src, call, 'cpu')})"
    bare = (cst.Assign, cst.AnnAssign, cst.Return, cst.Expr, cst.Arg)
    if not _stands_bare(src, call) or not isinstance(src.parent(call), bare):
        new = f"({new})"
    f = src.report("AM407", call, new=new, call=src.text(call))
    if ref is not None:
        f.edits = [src.edit(call, new)]
        f.needs = [need] if need else []


def _string_inside(src: Source, node: cst.CSTNode, value: str) -> str:
    """``value`` quoted so that it can stand at ``node``: inside an f-string (before Python
    3.12), with the quote that f-string does not use."""
    parent = src.parent(node)
    while parent is not None:
        if isinstance(parent, cst.FormattedString):
            return f"'{value}'" if '"' in parent.start else f'"{value}"'
        parent = src.parent(parent)
    return f'"{value}"'


# -- AM409: init_process_group(device_id=...) ------------------------------------------------------


def _check_device_id(src: Source, call: cst.Call) -> None:
    for arg in call.args:
        if arg.keyword is None or arg.keyword.value != "device_id" or _handled(src, arg.value):
            continue
        _report_conditional(src, "AM409", arg.value, "None", within=arg, what=f"device_id={src.text(arg.value)}")


# -- AM410: a guard that ends the program where there is no GPU -----------------------------------


def _reads_gpu_count(src: Source, test: cst.BaseExpression) -> bool:
    found = False

    class Calls(cst.CSTVisitor):
        def visit_Call(self, node: cst.Call) -> None:
            nonlocal found
            found = found or src.matches(node.func, _GPU_COUNT)

    test.visit(Calls())
    return found


def _exits(src: Source, body: cst.BaseSuite) -> cst.CSTNode | None:
    """The statement of ``body`` (its own lines, not nested blocks) that ends the program."""
    for line in getattr(body, "body", ()):
        for small in getattr(line, "body", ()) if isinstance(line, cst.SimpleStatementLine) else ():
            if isinstance(small, cst.Return):
                return small
            if isinstance(small, cst.Raise) and small.exc is not None and "SystemExit" in src.text(small.exc):
                return small
            value = small.value if isinstance(small, cst.Expr) else None
            if isinstance(value, cst.Call) and src.matches(value.func, _EXITS):
                return small
    return None


def _check_gpu_guard(src: Source, statement: cst.If) -> None:
    if not _reads_gpu_count(src, statement.test) or _implies_cuda(src, statement.test):
        return  # (a guard behind `torch.cuda.is_available() and ...` is for GPU machines only)
    leaves = _exits(src, statement.body)
    if leaves is None:
        return
    src.report("AM410", statement.test, test=src.text(statement.test), leaves=src.text(leaves).strip())
