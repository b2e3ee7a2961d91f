"""Turning a notebook function or cell (or a script file) into a payload the ranks can run.

Only what the code uses travels:

* a cell: the names it reads before assigning them (free-name analysis of its
  syntax tree; names read inside functions it defines count unless the cell binds
  them), looked up in the notebook's namespace;
* a function: the function itself, by value when it was defined in the notebook,
  with the globals and closures it (and notebook functions it calls) reads —
  cloudpickle's own traversal; its arguments;
* a script (``air-magic run SCRIPT.py``): its compiled code and its file name, nothing
  of the launching process (a script starts from nothing, as under ``torchrun``).

Everything is pickled *before* any process starts.  Objects that cannot be pickled
are all named in one :class:`~air_magic.errors.CaptureError` (name, type, reason);
big objects and CUDA tensors get a warning that names them.
"""

from __future__ import annotations

import ast
import builtins
import dis
import io
import linecache
import marshal
import os
import pickle
import re
import sys
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import cloudpickle

from air_magic import settings as _settings_module
from air_magic.errors import CaptureError
from air_magic.protocol import RESULT_NAME

__all__ = [
    "Payload",
    "function_payload",
    "cell_payload",
    "script_payload",
    "free_names",
    "CaptureWarning",
    "settings",
]


class CaptureWarning(UserWarning):
    """Something sent to the ranks is large, or lives on a GPU."""


#: The capture threshold's variable and default, kept here under their old names.
WARN_MB_ENV = _settings_module.WARN_MB_ENV
DEFAULT_WARN_MB = _settings_module.DEFAULT_WARN_MB

#: Read at each capture through this name (tests put a fresh ``Settings`` here).
settings = _settings_module.settings

#: Names of IPython's history and output caches: never sent to the ranks.
_IPYTHON_CACHES = re.compile(r"_{1,3}|_[ido]h|In|Out|_i{1,3}|_i?\d+")
#: The shell's own objects in the user namespace (``exit``/``quit`` hold its history
#: database).  In a rank ``exit``/``quit`` are Python's own and ``display``/``get_ipython``
#: are defined by the rank (``_rank._install_notebook_builtins``).
_IPYTHON_OBJECTS = {"get_ipython", "exit", "quit"}


def is_ipython_variable(name: str, value: object, namespace: dict[str, Any]) -> bool:
    """Whether ``namespace[name]`` is IPython's own (never sent to the ranks).

    In the shell's user namespace, a name a user could reuse (``exit = 3``) counts only
    while its value is still the one IPython put there (``user_ns_hidden``, which also
    holds IPython's ``open`` wrapper).
    """
    if _IPYTHON_CACHES.fullmatch(name):
        return True
    shell = _shell()
    if shell is None or namespace is not getattr(shell, "user_ns", None):
        return name in _IPYTHON_OBJECTS  # a namespace of plain Python: by name alone
    hidden = getattr(shell, "user_ns_hidden", {})
    return name in hidden and hidden[name] is value


def _shell() -> Any:
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


@dataclass
class Payload:
    """What the ranks run: pickled once in the kernel, read by every rank."""

    kind: str  # "function", "cell" or "script" (a script runs as a cell does)
    label: str
    data: dict[str, Any]
    #: filename -> (display name, source) so rank tracebacks show the notebook's lines.
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: The ranks' ``sys.argv``: the cell or function name, then the script arguments.
    argv: list[str] = field(default_factory=list)
    #: What lists (the lab sidebar) show the launch as one item with: a pool's key, the same
    #: for each start of its ranks; '' for a launch of its own.
    group: str = ""

    def dumps(self) -> bytes:
        return dumps({"kind": self.kind, **self.data})


class _PayloadPickler(cloudpickle.Pickler):  # type: ignore[misc]
    # cloudpickle renames the file of every code object it pickles ("<dynamic-code>");
    # marshal keeps it, so a rank's traceback can name the notebook cell and line.
    # Ranks run the kernel's own interpreter, so marshal's format always matches.
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            return marshal.loads, (marshal.dumps(obj),)
        return super().reducer_override(obj)

    def _dynamic_function_reduce(self, func: types.FunctionType) -> Any:
        # A notebook function's globals travel with it (cloudpickle takes the names its
        # code reads); IPython's own variables among them stay behind, so that `exit()`
        # somewhere in the function does not try to pickle the shell's history database.
        reduced = super()._dynamic_function_reduce(func)
        state = reduced[2] if len(reduced) > 2 else None
        slots = state[1] if isinstance(state, tuple) and len(state) == 2 else None
        captured = slots.get("__globals__") if isinstance(slots, dict) else None
        if isinstance(captured, dict):
            for name in [n for n, v in captured.items() if is_ipython_variable(n, v, func.__globals__)]:
                del captured[name]
        return reduced


def dumps(obj: Any) -> bytes:
    """cloudpickle, keeping code objects' file names."""
    buffer = io.BytesIO()
    _PayloadPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


# -- free names of a cell ----------------------------------------------------------------


class _FreeNames(ast.NodeVisitor):
    """Names a cell reads before it binds them, in execution order (module level)."""

    def __init__(self) -> None:
        self.bound: set[str] = set()
        self.free: set[str] = set()
        self.deferred: set[str] = set()  # read inside function bodies / lambdas

    # statements that bind after evaluating their value
    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
        self.visit(node.annotation)
        self.visit(node.target)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if isinstance(node.target, ast.Name):
            self._load(node.target.id)
            self.bound.add(node.target.id)
        else:
            self.visit(node.target)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.bound.add(node.target.id)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self.visit(node.target)
        for stmt in node.body + node.orelse:
            self.visit(stmt)

    visit_AsyncFor = visit_For

    def visit_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            if alias.name != "*":
                self.bound.add(alias.asname or alias.name.split(".")[0])

    visit_ImportFrom = visit_Import

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.type is not None:
            self.visit(node.type)
        if node.name:
            self.bound.add(node.name)
        for stmt in node.body:
            self.visit(stmt)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.bound.add(node.id)
        else:
            self._load(node.id)

    def _load(self, name: str) -> None:
        if name not in self.bound:
            self.free.add(name)

    # scopes of their own
    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for expr in [*node.decorator_list, *_defaults(node.args), *_annotations(node)]:
            self.visit(expr)
        self.deferred |= _scope_reads(node)
        self.bound.add(node.name)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in _defaults(node.args):
            self.visit(expr)
        self.deferred |= _scope_reads(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        # A class body runs now; the methods inside it run later.
        for name in _scope_reads(node):
            self._load(name)
        self.bound.add(node.name)

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp) -> None:
        for name in _scope_reads(node):
            self._load(name)

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension


def _defaults(args: ast.arguments) -> list[ast.expr]:
    return [d for d in [*args.defaults, *args.kw_defaults] if d is not None]


def _annotations(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
    args = node.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    found = [a.annotation for a in every if a is not None and a.annotation is not None]
    return found + ([node.returns] if node.returns is not None else [])


def _scope_reads(node: ast.AST) -> set[str]:
    """Names read in a nested scope that the scope itself does not bind (approximate)."""
    reads: set[str] = set()
    binds: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            (binds if isinstance(child.ctx, ast.Store) else reads).add(child.id)
        elif isinstance(child, ast.arg):
            binds.add(child.arg)
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child is not node:
            binds.add(child.name)
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            binds.update(a.asname or a.name.split(".")[0] for a in child.names)
        elif isinstance(child, ast.ExceptHandler) and child.name:
            binds.add(child.name)
        elif isinstance(child, (ast.Global, ast.Nonlocal)):
            reads.update(child.names)
    return reads - binds


def free_names(tree: ast.Module) -> set[str]:
    """The names a cell needs from the notebook namespace."""
    visitor = _FreeNames()
    for stmt in tree.body:
        visitor.visit(stmt)
    return visitor.free | (visitor.deferred - visitor.bound)


# -- checks shared by both fronts ------------------------------------------------------


def _describe_type(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def pickle_each(items: Iterable[tuple[str, Any]]) -> tuple[dict[str, bytes], list[tuple[str, str, str]]]:
    blobs: dict[str, bytes] = {}
    problems: list[tuple[str, str, str]] = []
    for name, value in items:
        try:
            blobs[name] = dumps(value)
        except Exception as exc:  # broad: pickling runs user code (__reduce__, __getstate__)
            problems.append((name, _describe_type(value), f"{type(exc).__name__}: {exc}"))
    return blobs, problems


def raise_problems(problems: list[tuple[str, str, str]], where: str) -> None:
    lines = [f"  - {name} ({kind}): {reason}" for name, kind, reason in problems]
    names = ", ".join(f"'{name}'" for name, _, _ in problems)
    raise CaptureError(
        f"cannot send {names} to the ranks: {'it' if len(problems) == 1 else 'they'} cannot be "
        f"pickled.\n" + "\n".join(lines) + f"\nCreate {'it' if len(problems) == 1 else 'them'} "
        f"inside {where} instead (load data, open files and connections on each rank).",
        problems,
    )


def _warn_sizes(sizes: dict[str, int], where: str, limit: float) -> None:
    for name, size in sizes.items():
        if size > limit:
            warnings.warn(
                f"'{name}' is {size / 1e6:.0f} MB once pickled and is sent to every rank. "
                f"Load or build it inside {where} instead: each rank then makes its own copy "
                "without going through the kernel.",
                CaptureWarning,
                stacklevel=_user_stacklevel(),
            )


def _warn_cuda(values: Iterable[tuple[str, Any]]) -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for name, value in values:
        on_gpu = False
        if isinstance(value, torch.Tensor):
            on_gpu = value.device.type != "cpu"
        elif isinstance(value, torch.nn.Module):
            on_gpu = any(p.device.type != "cpu" for p in value.parameters())
        if on_gpu:
            warnings.warn(
                f"'{name}' is on a GPU in the kernel; every rank would load it onto that same "
                "device. Create it inside the function and move it to cuda:LOCAL_RANK there.",
                CaptureWarning,
                stacklevel=_user_stacklevel(),
            )


def _user_stacklevel() -> int:
    # ``level()`` counts this frame as 1; ``warnings.warn`` counts its caller (one frame
    # further down) as 1.
    from air_magic.spec import _user_stacklevel as level

    return level() - 1


def _notebook_sources(codes: Iterable[types.CodeType]) -> dict[str, tuple[str, str]]:
    """Sources of notebook cells (not real files) that the code comes from."""
    found: dict[str, tuple[str, str]] = {}
    names = _cell_names()
    for code in codes:
        filename = code.co_filename
        if filename in found or os.path.exists(filename):
            continue
        entry = linecache.cache.get(filename)
        if entry and len(entry) == 4 and entry[2]:  # (a lazy entry is a 1-tuple)
            display = f"Cell In[{names[filename]}]" if filename in names else f'File "{filename}"'
            found[filename] = (display, "".join(entry[2]))
    return found


def _cell_names() -> dict[str, int]:
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return {}
    shell = ipython.get_ipython()
    compiler = getattr(shell, "compile", None)
    return dict(getattr(compiler, "_filename_map", {}) or {})


def _referenced_globals(func: Callable[..., Any]) -> list[tuple[str, Any]]:
    """The notebook globals a function reads, following notebook functions it calls."""
    seen: set[int] = set()
    found: dict[str, Any] = {}
    stack = [func]
    while stack:
        fn = stack.pop()
        if id(fn) in seen or not isinstance(fn, types.FunctionType):
            continue
        seen.add(id(fn))
        for name, value in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                found.setdefault(name, value.cell_contents)
            except ValueError:
                pass
        for name in _global_names(fn.__code__):
            if name in fn.__globals__:
                value = fn.__globals__[name]
                if is_ipython_variable(name, value, fn.__globals__):
                    continue
                found.setdefault(name, value)
                if isinstance(value, types.FunctionType) and value.__module__ == "__main__":
                    stack.append(value)
    return list(found.items())


def _global_names(code: types.CodeType) -> set[str]:
    names = {
        instr.argval
        for instr in dis.get_instructions(code)
        if instr.opname in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL") and isinstance(instr.argval, str)
    }
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _code_objects(values: Iterable[Any]) -> list[types.CodeType]:
    return [v.__code__ for v in values if isinstance(getattr(v, "__code__", None), types.CodeType)]


def function_payload(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Payload:
    """Pickle a function call for the ranks; name everything that cannot travel.

    A bound method (``@distributed`` on a method, reached through an instance) travels
    as its function, with the instance as the first argument, named after that parameter.
    """
    limit = settings.warn_mb * 1e6  # a bad AIR_MAGIC_CAPTURE_WARN_MB is said before any pickling
    receiver: list[tuple[str, Any]] = []
    if isinstance(func, types.MethodType):
        receiver = [(_first_parameter(func.__func__), func.__self__)]
        func = func.__func__
    label = getattr(func, "__qualname__", repr(func))
    argv = [getattr(func, "__name__", label)]
    where = f"'{label}'"
    positional = receiver + [(f"argument {i}", a) for i, a in enumerate(args)]
    keywords = [(f"keyword argument {k}", v) for k, v in kwargs.items()]
    arguments = positional + keywords
    refs = _referenced_globals(func)  # one walk of the function's code, used four times
    arg_blobs, problems = pickle_each(arguments)
    try:
        func_blob = dumps(func)
    except Exception as exc:  # broad: pickling runs user code (__reduce__, __getstate__)
        # Find which globals / closure variables are to blame, to name every one of them.
        _, culprits = pickle_each((name, value) for name, value in refs if not isinstance(value, types.ModuleType))
        problems = culprits + problems
        if not culprits:
            problems.insert(0, (label, _describe_type(func), f"{type(exc).__name__}: {exc}"))
        func_blob = b""
    if problems:
        raise_problems(problems, where)
    sizes = {name: len(blob) for name, blob in arg_blobs.items()}
    if len(func_blob) > limit:
        sizes.update(
            (name, len(dumps(value)))
            for name, value in refs
            if not isinstance(value, (types.ModuleType, types.FunctionType, type))
        )
    _warn_sizes(sizes, where, limit)
    _warn_cuda([*refs, *arguments])
    payload = Payload(
        kind="function",
        label=label,
        data={
            "func": func_blob,
            "args": [arg_blobs[name] for name, _ in positional],
            "kwargs": {k: arg_blobs[f"keyword argument {k}"] for k in kwargs},
        },
        sources=_notebook_sources(_code_objects([func, *(value for _, value in refs)])),
        argv=argv,
    )
    return payload


def _first_parameter(func: Any) -> str:
    code = getattr(func, "__code__", None)
    if isinstance(code, types.CodeType) and code.co_argcount > 0:
        return code.co_varnames[0]
    return "self"


def compile_cell(body: str, display: str, filename: str, first_line: int = 2) -> tuple[types.CodeType, ast.Module]:
    """Compile a cell body so its line numbers match the notebook cell (syntax errors here)."""
    # Blank lines in front put every statement on its line of the notebook cell,
    # syntax errors included.
    tree = ast.parse("\n" * (first_line - 1) + body, filename=filename, mode="exec")
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = tree.body[-1]
        tree.body[-1] = ast.copy_location(
            ast.Assign(targets=[ast.Name(RESULT_NAME, ast.Store())], value=last.value), last
        )
        ast.fix_missing_locations(tree)
    return compile(tree, filename, "exec"), tree


def cell_payload(
    body: str,
    namespace: dict[str, Any],
    *,
    display: str,
    filename: str,
    header: str = "%%distributed",
    argv: list[str] | None = None,
) -> Payload:
    """Pickle a ``%%distributed`` cell and the notebook names it reads.

    ``argv`` is the ranks' ``sys.argv`` (default: ``[display]``, the cell's name)."""
    try:
        code, tree = compile_cell(body, display, filename)
    except SyntaxError as exc:
        if exc.filename == filename:
            exc.filename = display
        raise
    wanted = sorted(
        name
        for name in free_names(tree)
        if name in namespace
        and not is_ipython_variable(name, namespace[name], namespace)
        and not (hasattr(builtins, name) and namespace[name] is getattr(builtins, name))
    )
    items = [(name, namespace[name]) for name in wanted]
    limit = settings.warn_mb * 1e6
    blobs, problems = pickle_each(items)
    if problems:
        raise_problems(problems, "the cell")
    _warn_sizes({name: len(blob) for name, blob in blobs.items()}, "the cell", limit)
    _warn_cuda(items)
    sources = _notebook_sources(_code_objects(value for _, value in items))
    sources[filename] = (display, header + "\n" + body)
    return Payload(
        kind="cell",
        label=display,
        data={"code": code, "names": blobs},
        sources=sources,
        argv=list(argv) if argv is not None else [display],
    )


def script_payload(path: str, args: list[str] | None = None, *, argv0: str | None = None) -> Payload:
    """A Python script for the ranks, run as ``python SCRIPT ARGS`` (``torchrun``'s workers) runs it.

    Each rank executes the script's code as its ``__main__`` module: ``__name__`` is
    ``"__main__"``, ``__file__`` the script's absolute path, ``sys.argv`` is ``[argv0, *args]``
    (``argv0``: the path as the user wrote it).  Tracebacks name the script's file and lines
    (the source read now is the one shown, even if the file changes during the launch).
    The script's folder first on ``sys.path`` is the launcher's to arrange (the ranks take
    the launching process's ``sys.path``).  ``OSError`` when it cannot be read,
    ``SyntaxError`` when it does not compile, both before any process starts.
    """
    import importlib.util

    absolute = os.path.abspath(path)
    with open(absolute, "rb") as handle:
        raw = handle.read()
    source = importlib.util.decode_source(raw)  # its coding cookie, as Python reads it
    # dont_inherit: the script gets its own __future__ imports, not this module's.
    code = compile(raw, absolute, "exec", dont_inherit=True)
    names = {"__file__": dumps(absolute), "__cached__": dumps(None)}
    return Payload(
        kind="script",
        label=os.path.basename(absolute),
        data={"code": code, "names": names},
        sources={absolute: (f'File "{absolute}"', source)},
        argv=[argv0 if argv0 is not None else path, *(args or [])],
    )
