"""AM3xx: patterns: TorchDistributor launches, what launched code captures or sets."""

from __future__ import annotations

from typing import Any, Sequence

import libcst as cst
from libcst.metadata import Assignment, BaseAssignment, Scope

from air_magic.lint._source import EMPTY, Region, Source, bool_value, is_distributed, string_value
from air_magic.lint.diagnostics import Edit
from air_magic.lint.rules import DEEPSPEED_DISTRIBUTOR_MATCHES, TORCH_DISTRIBUTOR_MATCHES

__all__ = ["check_torch_distributor", "check_launched_code", "check_rendezvous", "check_direct_calls"]

#: Calls whose result is small and cheap to send: a module-level ``x = <call>`` of one
#: of these read inside a launched function is not reported.
_LIGHT_CALLS = frozenset(
    {
        "int",
        "float",
        "str",
        "bool",
        "bytes",
        "complex",
        "len",
        "range",
        "dict",
        "list",
        "set",
        "tuple",
        "frozenset",
        "sorted",
        "reversed",
        "min",
        "max",
        "sum",
        "abs",
        "round",
        "zip",
        "enumerate",
        "object",
        "type",
        "print",
        "repr",
        "format",
        "getattr",
        "hash",
        "id",
        "iter",
        "torch.device",
        "torch.dtype",
        "torch.cuda.device_count",
        "torch.cuda.is_available",
        "torch.manual_seed",
        "torch.Generator",
    }
)
_LIGHT_PREFIXES = (
    "os.",
    "sys.",
    "pathlib.",
    "logging.",
    "argparse.",
    "re.",
    "collections.",
    "functools.",
    "itertools.",
    "typing.",
    "dataclasses.",
    "datetime.",
    "time.",
    "math.",
    "json.",
    "uuid.",
    "enum.",
    "string.",
    "textwrap.",
    "operator.",
    "warnings.",
    "air_magic.",
    "serverless_gpu.",
    "databricks.air.",
    "mlflow.",
)
_SET_EXPERIMENT = frozenset({"mlflow.set_experiment", "mlflow.tracking.fluent.set_experiment"})
_ENVIRON = frozenset({"os.environ"})
_RENDEZVOUS_VARS = frozenset({"MASTER_PORT", "MASTER_ADDR"})


def _statement_of(src: Source, node: cst.CSTNode) -> cst.CSTNode | None:
    """The small statement (``Expr``, ``Assign`` ...) whose value is exactly ``node``."""
    parent = src.parent(node)
    if isinstance(parent, (cst.Expr, cst.Assign)) and parent.value is node:
        return parent
    return None


def _simple(node: cst.CSTNode) -> bool:
    """A literal or a name: moving it from ``d = TorchDistributor(...)`` to the launch line
    does not change when anything is computed."""
    return isinstance(node, (cst.Integer, cst.Float, cst.SimpleString, cst.Name, cst.Attribute))


def check_torch_distributor(src: Source) -> None:
    for ctor in src.nodes.calls:
        deepspeed = src.matches(ctor.func, DEEPSPEED_DISTRIBUTOR_MATCHES)
        if deepspeed:
            src.report(
                "AM302",
                ctor,
                what="DeepspeedTorchDistributor(...)",
                why="it configures DeepSpeed through Spark; call deepspeed.initialize(...) inside the "
                "decorated function instead",
            )
            continue
        if not src.matches(ctor.func, TORCH_DISTRIBUTOR_MATCHES):
            continue
        runs, removal, problem = _distributor_runs(src, ctor)
        if problem is not None:
            src.report("AM302", ctor, what="TorchDistributor(...)", why=problem)
            continue
        settings = _distributor_settings(src, ctor, movable=removal is not None)
        if isinstance(settings, str):
            src.report("AM302", ctor, what="TorchDistributor(...)", why=settings)
            continue
        for run in runs:
            _convert_run(src, run, settings, removal)


def _distributor_runs(src: Source, ctor: cst.Call) -> tuple[list[cst.Call], list[Edit] | None, str | None]:
    """The ``.run(...)`` calls of this distributor, the edits that remove its variable (when
    it is stored in one), or why it cannot be followed."""
    parent = src.parent(ctor)
    if isinstance(parent, cst.Attribute) and parent.value is ctor:
        outer = src.parent(parent)
        if parent.attr.value == "run" and isinstance(outer, cst.Call) and outer.func is parent:
            return [outer], None, None
        return [], None, f"only `.run(...)` is converted, not `.{parent.attr.value}`"
    assign = src.parent(ctor)
    if not (
        isinstance(assign, cst.Assign)
        and assign.value is ctor
        and len(assign.targets) == 1
        and isinstance(assign.targets[0].target, cst.Name)
    ):
        return [], None, "it is not called as `TorchDistributor(...).run(...)` or stored in a variable"
    name = assign.targets[0].target
    scope = src.scopes.get(name)
    assignments = list(scope.assignments[name.value]) if scope is not None else []
    if len(assignments) != 1:
        return [], None, f"`{name.value}` is assigned more than once"
    runs = []
    for access in assignments[0].references:
        attr = src.parent(access.node)
        call = src.parent(attr) if attr is not None else None
        if not (
            isinstance(attr, cst.Attribute)
            and attr.attr.value == "run"
            and isinstance(call, cst.Call)
            and call.func is attr
        ):
            return [], None, f"`{name.value}` is used for more than `.run(...)`"
        runs.append(call)
    if not runs:
        return [], None, f"`{name.value}.run(...)` is never called"
    removal = src.delete_statement(assign)
    if removal is None:
        return [], None, f"`{name.value} = TorchDistributor(...)` shares its line with other code"
    return runs, removal, None


def _distributor_settings(src: Source, ctor: cst.Call, movable: bool) -> dict[str, str] | str:
    names = ("num_processes", "local_mode", "use_gpu")
    given: dict[str, cst.BaseExpression] = {}
    for index, arg in enumerate(ctor.args):
        if arg.star:
            return "its arguments are unpacked with * or **"
        key = arg.keyword.value if arg.keyword is not None else (names[index] if index < len(names) else None)
        if key not in names:
            return f"`{key or 'argument ' + str(index + 1)}` has no counterpart in @distributed"
        given[key] = arg.value
    local_mode = given.get("local_mode")
    if local_mode is not None and bool_value(local_mode) is not True:
        return (
            "local_mode=False trains on the Spark workers, and @distributed runs on this machine only; "
            "if the job fits on one machine, launch the function with @distributed"
        )
    use_gpu = given.get("use_gpu")
    if use_gpu is not None and bool_value(use_gpu) is None:
        return "use_gpu is not a literal True or False"
    count = given.get("num_processes")
    if count is not None and movable and not _simple(count):
        return "num_processes is computed where the distributor is created"
    settings = {"count": src.text(count) if count is not None else "1"}
    if bool_value(use_gpu) is False:
        settings["type"] = '"CPU"'
    return settings


def _convert_run(src: Source, run: cst.Call, settings: dict[str, str], removal: list[Edit] | None) -> None:
    args = list(run.args)
    if not args or args[0].keyword is not None or args[0].star:
        src.report(
            "AM302", run, what="TorchDistributor.run(...)", why="the training function is not its first argument"
        )
        return
    target = args[0].value
    if isinstance(target, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)):
        src.report(
            "AM302",
            run,
            what="TorchDistributor.run(" + src.text(target) + ", ...)",
            why="it runs a script file; air_magic launches functions, so call the script's main "
            "function from a function decorated with @distributed",
        )
        return
    ref, need = src.import_ref("air_magic", "distributed", run)
    options = f"num_accelerators={settings['count']}"
    if "type" in settings:
        options += f", accelerator_type={settings['type']}"
    rest = ""
    if len(args) > 1:
        rest = src.data[src.span(args[1])[0] : src.span(args[-1])[1]].decode("utf-8")
    launch = f"{ref}({options})({src.text(target)}).distributed({rest})"
    if not isinstance(src.parent(run), cst.Expr):
        launch += "[0]"  # .run() returned rank 0's value; .distributed() returns every rank's
    f = src.report("AM301", run, func=src.text(target), count=settings["count"], launch=launch)
    f.edits = [src.edit(run, launch), *(removal or [])]
    f.needs = [need] if need else []


def _launched(src: Source) -> list[tuple[cst.FunctionDef, str]]:
    """Functions whose body runs on the ranks: decorated with @distributed, wrapped with
    ``distributed(...)(f)``, handed to ``TorchDistributor(...).run(f)``, or named by the caller."""
    found: dict[int, tuple[cst.FunctionDef, str]] = {}
    by_name: dict[str, cst.FunctionDef] = {}
    for fn in src.nodes.functions:
        by_name.setdefault(fn.name.value, fn)
        launched = fn.name.value in src.launched_names and src.parent(fn) is src.module
        if launched or any(is_distributed(src, _decorator_callee(d)) for d in fn.decorators):
            found[id(fn)] = (fn, fn.name.value)
    for call in src.nodes.calls:
        wrapped = None
        if isinstance(call.func, cst.Call) and is_distributed(src, call.func.func):
            wrapped = call.args[0].value if call.args else None
        elif isinstance(call.func, cst.Attribute) and call.func.attr.value == "run" and call.args:
            owner = call.func.value
            if isinstance(owner, cst.Call) and src.matches(owner.func, TORCH_DISTRIBUTOR_MATCHES):
                wrapped = call.args[0].value
        if isinstance(wrapped, cst.Name) and wrapped.value in by_name:
            fn = by_name[wrapped.value]
            found.setdefault(id(fn), (fn, fn.name.value))
    return list(found.values())


def _decorator_callee(decorator: cst.Decorator) -> cst.BaseExpression:
    """``distributed`` for both ``@distributed`` and ``@distributed(...)``."""
    expr = decorator.decorator
    return expr.func if isinstance(expr, cst.Call) else expr


def _inside(src: Source, node: cst.CSTNode, outer: cst.CSTNode) -> bool:
    a, b = src.span(outer)
    x, y = src.span(node)
    return a <= x and y <= b


def _captured_values(src: Source) -> dict[BaseAssignment, cst.BaseExpression]:
    """Module-level ``name = <call>`` assignments (the call not a cheap one)."""
    out: dict[BaseAssignment, cst.BaseExpression] = {}
    if src.global_scope is None:
        return out
    for assignment in src.global_scope.assignments:
        if not isinstance(assignment, Assignment) or not isinstance(assignment.node, cst.Name):
            continue
        target = src.parent(assignment.node)
        stmt = src.parent(target) if isinstance(target, cst.AssignTarget) else target
        value = getattr(stmt, "value", None)
        if isinstance(stmt, cst.AnnAssign) and stmt.target is not assignment.node:
            continue
        if not isinstance(stmt, (cst.Assign, cst.AnnAssign)) or not isinstance(value, cst.Call):
            continue
        if _is_light(src, value):
            continue
        out[assignment] = value
    return out


def _is_light(src: Source, call: cst.Call) -> bool:
    func = call.func
    while isinstance(func, cst.Call):  # distributed(...)(f)
        func = func.func
    names = src.qnames(func)
    if not names:
        return False
    return all(
        n in _LIGHT_CALLS or n.startswith(_LIGHT_PREFIXES) or n == "distributed" or n.startswith("builtins.")
        for n in names
    )


def check_launched_code(src: Source, regions: Sequence[Region]) -> None:
    captured = _captured_values(src)
    launched = _launched(src)
    all_scopes = {s for s in src.scopes.values() if s is not None}
    for fn, label in launched:
        body = fn.body.body[0] if fn.body.body else None
        fscope = src.scopes.get(body) if body is not None else None
        if fscope is None or fscope is src.global_scope:
            continue
        inner = [s for s in all_scopes if _within(s, fscope)]
        _report_captures(src, captured, [a for s in inner for a in s.accesses], label, outside=fn)
        for call in src.nodes.calls:
            if src.matches(call.func, _SET_EXPERIMENT) and _inside(src, call, fn.body):
                src.report("AM304", call, func=label)
    for region in regions:
        if src.global_scope is None:
            continue
        accesses = [a for a in src.global_scope.accesses if region.start <= src.start(a.node)[0] <= region.end]
        _report_captures(src, captured, accesses, region.label, region=region)
        for call in src.nodes.calls:
            if src.matches(call.func, _SET_EXPERIMENT) and region.start <= src.start(call)[0] <= region.end:
                src.report("AM304", call, func=region.label)


def _within(scope: Scope, outer: Scope) -> bool:
    while scope is not None:
        if scope is outer:
            return True
        parent = scope.parent
        if parent is scope:
            return False
        scope = parent
    return False


def _report_captures(
    src: Source,
    captured: dict[BaseAssignment, cst.BaseExpression],
    accesses: list[Any],
    label: str,
    outside: cst.CSTNode | None = None,
    region: Region | None = None,
) -> None:
    first: dict[BaseAssignment, cst.CSTNode] = {}
    for access in accesses:
        for referent in access.referents:
            if referent not in captured:
                continue
            line = src.start(referent.node)[0]
            if outside is not None and _inside(src, referent.node, outside):
                continue
            if region is not None and region.start <= line <= region.end:
                continue
            seen = first.get(referent)
            if seen is None or src.span(access.node)[0] < src.span(seen)[0]:
                first[referent] = access.node
    for referent, node in sorted(first.items(), key=lambda kv: src.span(kv[1])[0]):
        assert isinstance(referent, Assignment)
        where = src.describe_line(src.start(referent.node)[0])
        src.report("AM303", node, name=referent.name, func=label, where=f"built at {where}")


def check_rendezvous(src: Source) -> None:
    for assign in src.nodes.assigns:
        for target in assign.targets:
            sub = target.target
            if not (isinstance(sub, cst.Subscript) and src.matches(sub.value, _ENVIRON) and len(sub.slice) == 1):
                continue
            index = sub.slice[0].slice
            key = string_value(index.value) if isinstance(index, cst.Index) else None
            if key in _RENDEZVOUS_VARS:
                f = src.report("AM305", assign, what=f'os.environ["{key}"] = ...')
                if len(assign.targets) == 1:
                    f.edits = src.delete_statement(assign) or []
    for call in src.nodes.calls:
        func = call.func
        if src.matches(func, {"os.environ.setdefault", "os.putenv"}):
            key = string_value(call.args[0].value) if call.args else None
            if key in _RENDEZVOUS_VARS:
                f = src.report("AM305", call, what=f'{src.text(func)}("{key}", ...)')
                stmt = _statement_of(src, call)
                if isinstance(stmt, cst.Expr):
                    f.edits = src.delete_statement(stmt) or []
        elif src.matches(func, {"os.environ.update"}):
            keys = {a.keyword.value for a in call.args if a.keyword is not None}
            for arg in call.args:
                if isinstance(arg.value, cst.Dict):
                    keys |= {string_value(el.key) or "" for el in arg.value.elements if isinstance(el, cst.DictElement)}
            if keys & _RENDEZVOUS_VARS:
                src.report("AM305", call, what="os.environ.update(MASTER_...)")
        elif src.matches(func, {"torch.distributed.init_process_group", "init_process_group"}) or (
            isinstance(func, cst.Attribute) and func.attr.value == "init_process_group"
        ):
            for arg in call.args:
                value = string_value(arg.value)
                if (
                    arg.keyword is not None
                    and arg.keyword.value == "init_method"
                    and value
                    and value.startswith("tcp://")
                ):
                    f = src.report("AM305", arg, what=f"init_method={src.text(arg.value)}")
                    f.edits = [src.edit(call, EMPTY.code_for_node(_without_arg(call, arg)))]


def _without_arg(call: cst.Call, arg: cst.Arg) -> cst.Call:
    args = [a for a in call.args if a is not arg]
    if args and arg is call.args[-1]:
        args[-1] = args[-1].with_changes(comma=call.args[-1].comma)
    return call.with_changes(args=args)


def check_direct_calls(src: Source) -> None:
    if src.global_scope is None:
        return
    decorated = {
        id(fn) for fn in src.nodes.functions if any(is_distributed(src, _decorator_callee(d)) for d in fn.decorators)
    }
    for assignment in src.global_scope.assignments:
        if not isinstance(assignment, Assignment):
            continue
        node = assignment.node
        wrapped = isinstance(node, cst.FunctionDef) and id(node) in decorated
        if isinstance(node, cst.Name):
            target = src.parent(node)
            stmt = src.parent(target) if isinstance(target, cst.AssignTarget) else None
            value = getattr(stmt, "value", None)
            wrapped = (
                isinstance(stmt, cst.Assign)
                and isinstance(value, cst.Call)
                and isinstance(value.func, cst.Call)
                and is_distributed(src, value.func.func)
            )
        if not wrapped:
            continue
        for access in assignment.references:
            call = src.parent(access.node)
            if isinstance(call, cst.Call) and call.func is access.node:
                f = src.report("AM306", call, func=assignment.name)
                end = src.span(access.node)[1]
                f.edits = [Edit(end, end, ".distributed")]
