"""``air-magic``: the command line.

``air-magic lint`` is the migration linter (:mod:`air_magic.lint.cli`); ``air-magic run``
launches from a terminal what ``%%distributed`` and ``@distributed`` launch from a notebook,
with the same launcher, status lines and MLflow run::

    air-magic run TARGET [options] [-- ARGS]
      |  the options (air_magic.options: the magic's flags but --async, and --address)
      |      --> make_spec: a bad value is a usage error (exit 2) before anything starts
      |  the helper is warmed (it imports torch meanwhile)
      |  TARGET  SCRIPT.py             capture.script_payload: the script runs whole on each rank,
      |                                sys.argv = [SCRIPT.py, *ARGS], its folder first on sys.path
      |          MODULE:FUNC           imported here (the current folder on sys.path)  --+
      |          NOTEBOOK.ipynb:FUNC   the notebook's defining statements run here     --+
      |                                (nbformat; IPython syntax translated)             |
      |                                FUNC() on each rank, sys.argv = [FUNC, *ARGS] <---+
      v                                (capture.function_payload; a @distributed FUNC keeps its settings)
    Launcher.start --> wait_streaming: rank 0's output on stdout, status lines on stderr,
      |                the MLflow run's line; Ctrl-C stops every rank
      v
    the values, one line per rank (none if every rank returned None); exit status
    0 finished, 1 the launch failed (the rank's traceback on stderr), 2 usage error,
    130 interrupted
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import dataclasses
import importlib
import inspect
import linecache
import os
import sys
import traceback
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from air_magic._version import __version__
from air_magic.errors import CaptureError, ConfigurationError, LaunchCancelledError, render_lines
from air_magic.kernel.machine import verbs as machine_verbs
from air_magic.options import add_launch_arguments

if TYPE_CHECKING:  # what launches is imported by run only: ps and stop answer without it
    from air_magic.spec import LaunchSpec

__all__ = ["main", "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED"]

EXIT_OK = 0  # every rank finished
EXIT_FAILED = 1  # a rank raised or crashed, or the launch timed out
EXIT_USAGE = 2  # a bad option or target: nothing was launched
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as a shell reports it): every rank was stopped

_PROG = "air-magic run"

_RUN_DESCRIPTION = """\
Run TARGET as one process per accelerator of this machine (every GPU, or N CPU ranks
with gloo where there is none), as %%distributed and @distributed do from a notebook:
the same ranks and environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
status lines, logs and MLflow run.

TARGET is one of
  SCRIPT.py            the whole script runs on every rank, as `torchrun SCRIPT.py ARGS`
                       runs it: __name__ == "__main__", sys.argv == ["SCRIPT.py", *ARGS],
                       __file__ set, the script's folder first on sys.path
  MODULE:FUNC          FUNC of MODULE (imported from the current folder or the installed
                       packages) is called without arguments on every rank; ARGS become
                       its sys.argv[1:]
  NOTEBOOK.ipynb:FUNC  FUNC defined in the notebook, called the same way. What defines it
                       runs first, here, in order: every code cell's imports, defs, classes
                       and assignments (and if/try/with blocks made only of these), with
                       %magics and !shell lines dropped. Skipped: cells that start with a
                       cell magic (%%distributed ...), expressions and calls on their own
                       (print(...), train.distributed(...)), loops, and assignments from a
                       launch (x = train.distributed(...)); an assignment that fails (it
                       reads what was skipped) is skipped with a note.

A FUNC decorated with @distributed keeps its settings; the options here override them.
The values FUNC returns are printed, one line per rank ("rank 0: ..."), unless every
rank returned None. Rank 0's output is shown as it comes; every rank's full log is kept.
MLflow tracking is on (as in a notebook): one run per launch, in the experiment
--experiment, else MLFLOW_EXPERIMENT_NAME, else one named after TARGET.

exit status: 0 every rank finished; 1 the launch failed (a rank raised or crashed, or
the timeout expired: the rank's traceback is shown); 2 usage error (a bad option, a
TARGET that cannot be found or loaded: nothing was started); 130 interrupted (Ctrl-C
stops every rank)."""

_RUN_EXAMPLES = """\
examples:
  air-magic run train.py -n 2 -- --lr 0.01 --epochs 3
  air-magic run mypackage.train:main -n 8 --experiment resnet
  air-magic run experiments.ipynb:train -n 2 --no-tracking"""


class _Refused(Exception):
    """What ``air-magic run`` cannot run, said in one line (after ``details``: a traceback)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


# -- the command line -----------------------------------------------------------------------------


def _parser(lint: bool = True) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """``air-magic``'s parser, and its ``run`` verb's (``lint=False``: without the linter's verb,
    whose import ``ps`` and ``stop`` do not wait for)."""

    parser = argparse.ArgumentParser(
        prog="air-magic",
        description="Tools for air_magic, the notebook launcher for multi-GPU training: "
        "lint moves serverless_gpu / databricks.air code to air_magic, run launches a script "
        "or a function on every accelerator of this machine from a terminal, ps lists the machine's "
        "launches and pools, stop stops one of yours.",
        epilog="`air-magic VERB --help` describes a verb.",
    )
    parser.add_argument("--version", action="version", version=f"air-magic {__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    if lint:
        from air_magic.lint import cli as lint_cli

        lint_cli.add_parser(verbs)
    run = verbs.add_parser(
        "run",
        help="run a script, or a function of a module or notebook, on every accelerator (or N CPU ranks)",
        description=_RUN_DESCRIPTION,
        epilog=_RUN_EXAMPLES,
        usage=f"{_PROG} [options] TARGET [-- ARGS ...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("target", metavar="TARGET", help="SCRIPT.py, MODULE:FUNC or NOTEBOOK.ipynb:FUNC")
    launch = run.add_argument_group("launch options (those of %%distributed)")
    add_launch_arguments(launch)
    launch.add_argument(
        "--address",
        metavar="ADDRESS",
        help="the Ray cluster to run on, with --backend ray (sets RAY_ADDRESS for the launch)",
    )
    machine_verbs.add_parsers(verbs)
    return parser, run


def _split_script_args(words: list[str]) -> tuple[list[str], list[str]]:
    """``run``'s own words, and the script's arguments after the first ``--``."""
    verb = next((i for i, word in enumerate(words) if not word.startswith("-")), None)
    if verb is None or words[verb] != "run" or "--" not in words[verb:]:
        return words, []
    cut = words.index("--", verb)
    return words[:cut], words[cut + 1 :]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``air-magic``; returns the exit status."""
    words, script_args = _split_script_args(list(sys.argv[1:] if argv is None else argv))
    parser, run_parser = _parser(lint=not words or words[0] not in ("ps", "stop"))
    try:
        args, extra = parser.parse_known_args(words)
        if extra and args.verb == "run":
            run_parser.error(
                f"unrecognized arguments: {' '.join(extra)} (the script's own arguments go after --: "
                f"{_PROG} train.py -n 2 -- --lr 0.01)"
            )
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # argparse: --help / --version exit 0, a usage error 2
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.verb == "lint":
        from air_magic.lint import cli as lint_cli

        return lint_cli.run(args)
    if args.verb in ("ps", "stop"):
        return machine_verbs.run(args)
    return run(args, script_args)


def run(args: argparse.Namespace, script_args: Sequence[str] = ()) -> int:
    """``air-magic run`` with its parsed arguments; returns the exit status."""
    with _air_magic_warnings_in_one_line():
        try:
            return _run(args, list(script_args))
        except _Refused as exc:
            if exc.details:
                sys.stderr.write(exc.details.rstrip("\n") + "\n")
            _error(str(exc))
        except (ConfigurationError, CaptureError) as exc:
            _error(str(exc))
        except KeyboardInterrupt as exc:
            # A blocking launch says how it was stopped; before it, nothing had started.
            message = str(exc) or "interrupted before the ranks started; nothing was left running."
            sys.stderr.write(f"{_PROG}: {message}\n")
            sys.stderr.flush()
            return EXIT_INTERRUPTED
    return EXIT_USAGE


def _error(message: str) -> None:
    sys.stderr.write(f"{_PROG}: error: {message}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def _air_magic_warnings_in_one_line() -> Iterator[None]:
    """air_magic's own warnings (CPU ranks sharing cores, a large captured object) as one
    line each; other warnings (the user's code's) as Python shows them."""
    shown = warnings.showwarning

    def show(
        message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None, line: Any = None
    ) -> None:
        if category.__module__.split(".")[0] == "air_magic":
            sys.stderr.write(f"{_PROG}: warning: {message}\n")
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


# -- one launch ------------------------------------------------------------------------------------


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``@distributed`` keywords the options set (those not given are left out),
    checked now: a bad value is a ``ConfigurationError`` before anything is loaded."""
    given: dict[str, Any] = {}
    for name in ("num_accelerators", "accelerator_type", "experiment", "run_name", "backend"):
        if getattr(args, name) is not None:
            given[name] = getattr(args, name)
    if args.timeout is not None:
        from air_magic.spec import timeout_from_text

        given["timeout"] = timeout_from_text(args.timeout)
    if args.no_tracking:
        given["tracking"] = False
    if args.no_wait:
        given["wait"] = False
    from air_magic.spec import make_spec

    spec = make_spec(**given)
    if args.address is not None and spec.backend != "ray":
        raise _Refused("--address is the address of a Ray cluster: use it with --backend ray.")
    return given


def _run(args: argparse.Namespace, script_args: list[str]) -> int:
    options = _options(args)
    target = _target(args.target)
    from air_magic.plugins import get_launcher

    launcher = get_launcher()
    launcher.warm()  # the helper imports torch while the target is read
    spec, payload, path_first = target.load(options, script_args)
    if spec.tracking:
        from air_magic.tracking import warm_in_background

        warm_in_background(launcher.session_dir)
    if args.address is not None:
        os.environ["RAY_ADDRESS"] = args.address  # read by the Ray backend, and by the ranks
    from air_magic.kernel.machine import claims

    claims.FRONT = "run"  # what this process's launch is in the machine's list
    with _first_on_sys_path(path_first):  # the ranks take sys.path as it is at the start
        launch = launcher.start(spec, payload)
    try:
        values = launch.wait_streaming()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the launch's error: the rank's own exception, or air_magic's
        sys.stdout.flush()
        sys.stderr.write("\n".join(render_lines(exc)) + "\n")
        sys.stderr.flush()
        # Stopped (air-magic stop, the sidebar's Stop): interrupted, as a shell's Ctrl-C says it.
        return EXIT_INTERRUPTED if isinstance(exc, LaunchCancelledError) else EXIT_FAILED
    if any(value is not None for value in values):
        for rank, value in enumerate(values):
            print(f"rank {rank}: {value!r}")
    sys.stdout.flush()
    return EXIT_OK


@contextlib.contextmanager
def _first_on_sys_path(folder: str | None) -> Iterator[None]:
    """``folder`` in the place of ``sys.path[0]`` (this command's own folder) while a
    launch starts: where ``python SCRIPT`` puts the script's folder."""
    if folder is None:
        yield
        return
    saved = list(sys.path)
    if sys.path and not getattr(sys.flags, "safe_path", False):  # (Python >= 3.11: -P)
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path[:] = saved


# -- what to run -------------------------------------------------------------------------------


@dataclass
class _Target:
    text: str  # as written
    kind: str  # "script", "module" or "notebook"
    path: str = ""  # the script or notebook
    module: str = ""
    func: str = ""

    def load(self, options: dict[str, Any], script_args: list[str]) -> tuple[LaunchSpec, Any, str | None]:
        """The launch's spec and payload, and the folder its ranks put first on ``sys.path``."""
        from air_magic.capture import script_payload

        if self.kind == "script":
            try:
                payload = script_payload(self.path, script_args)
            except SyntaxError as exc:
                raise _Refused(f"{self.path} does not compile", _syntax_error(exc)) from None
            except OSError as exc:
                raise _Refused(f"{self.path}: cannot read it ({exc.strerror or exc})") from None
            from air_magic.spec import make_spec

            spec = _named(make_spec(**options), _stem(self.path))
            return spec, payload, os.path.dirname(os.path.abspath(self.path))
        if self.kind == "module":
            _put_first_on_sys_path(os.getcwd())
            value = _module_function(self.module, self.func)
            experiment = self.module
        else:
            value = _notebook_function(self.path, self.func)
            experiment = _stem(self.path)
        spec, payload = _function_launch(value, self.text, options, script_args)
        return _named(spec, experiment), payload, None


def _target(text: str) -> _Target:
    """What ``TARGET`` names; a file that does not exist is refused here, before any start."""
    if ":" in text and not os.path.isfile(text):
        where, _, func = text.rpartition(":")
        if not func.strip() or not where.strip():
            raise _Refused(f"{text}: name a function after the colon, as MODULE:FUNC or NOTEBOOK.ipynb:FUNC.")
        if where.endswith(".ipynb"):
            if not os.path.isfile(where):
                raise _Refused(f"{where}: no such file")
            return _Target(text, "notebook", path=where, func=func)
        if where.endswith(".py"):
            raise _Refused(
                f"{text}: a script runs whole ({_PROG} {where} -- ARGS); to run one of its functions, "
                f"name its module: {_PROG} {_stem(where)}:{func} from the script's folder."
            )
        if not all(part.isidentifier() for part in where.split(".")):
            raise _Refused(f"{text}: {where!r} is not a module name (MODULE:FUNC, e.g. mypackage.train:main).")
        return _Target(text, "module", module=where, func=func)
    if text.endswith(".ipynb"):
        raise _Refused(f"{text}: name the function to run in the notebook, as {text}:FUNC.")
    if not os.path.isfile(text):
        raise _Refused(f"{text}: no such file")
    return _Target(text, "script", path=text)


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0] or path


def _named(spec: LaunchSpec, name: str) -> LaunchSpec:
    """The launch's experiment: the one asked for, else ``MLFLOW_EXPERIMENT_NAME``, else
    one named after the target (as a notebook's launches are named after the notebook)."""
    if spec.experiment is not None or os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return spec
    return dataclasses.replace(spec, experiment=name)


def _put_first_on_sys_path(folder: str) -> None:
    if folder not in sys.path and not (folder == os.getcwd() and "" in sys.path):
        sys.path.insert(0, folder)


def _syntax_error(exc: SyntaxError) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc))


def _user_traceback(exc: BaseException) -> str:
    """The traceback of an error in the user's code, without the frames of this module and
    of the import machinery that ran it."""
    machinery = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(importlib.__file__)))
    stack = [
        frame
        for frame in traceback.extract_tb(exc.__traceback__)
        if not frame.filename.startswith("<frozen importlib")
        and os.path.dirname(os.path.abspath(frame.filename)) not in machinery
    ]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(stack)]
    return "".join(lines + traceback.format_exception_only(type(exc), exc))


def _module_function(module_name: str, name: str) -> Any:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise _Refused(
                f"no module named {missing!r} (looked in the current folder and in the packages of {sys.executable})."
            ) from None
        raise _Refused(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}", _user_traceback(exc)) from None
    except (Exception, SystemExit) as exc:  # the module's own code failed as it was imported
        raise _Refused(f"importing {module_name!r} failed: {type(exc).__name__}: {exc}", _user_traceback(exc)) from None
    value: Any = module
    for part in name.split("."):
        if not hasattr(value, part):
            where = getattr(module, "__file__", None)
            functions = _functions(vars(module), module.__name__)
            hint = f"; its functions: {', '.join(functions)}" if functions else ""
            raise _Refused(f"module {module_name!r}{f' ({where})' if where else ''} has no attribute {name!r}{hint}.")
        value = getattr(value, part)
    if not callable(value):
        raise _Refused(f"{module_name}:{name} is {_a(value)}, not a function: name a function after the colon.")
    return value


def _a(value: Any) -> str:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return f"{type(value).__name__} {shown}"


def _functions(namespace: dict[str, Any], module: str) -> list[str]:
    """The public functions defined in ``namespace`` (whose ``__module__`` is ``module``)."""
    return sorted(
        name
        for name, value in namespace.items()
        if not name.startswith("_") and callable(value) and getattr(value, "__module__", None) == module
    )


def _function_launch(value: Any, text: str, options: dict[str, Any], script_args: list[str]) -> tuple[LaunchSpec, Any]:
    """The spec and payload of ``value()`` on every rank (a ``@distributed`` function keeps
    its own settings under the options given)."""
    from air_magic.capture import function_payload
    from air_magic.decorator import DistributedFunction

    if isinstance(value, DistributedFunction):
        spec = value.with_overrides(**options).spec
        func: Callable[..., Any] = value.func
    else:
        from air_magic.spec import make_spec

        spec = make_spec(**options)
        func = value
    try:
        signature: inspect.Signature | None = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin without a signature: the rank says what is wrong
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError:
            parameters = ", ".join(
                str(p.replace(annotation=inspect.Parameter.empty)) for p in signature.parameters.values()
            )
            raise _Refused(
                f"{text} takes ({parameters}), and {_PROG} calls it without arguments: give its "
                "parameters defaults, or read them from sys.argv (the arguments after --)."
            ) from None
    payload = function_payload(func, (), {})
    payload.argv = [*payload.argv[:1], *script_args]
    return spec, payload


# -- a notebook's definitions ---------------------------------------------------------------------------

#: Calls that start a launch (``train.distributed(...)``, ``train.submit(...)``): an
#: assignment from one is not run while the notebook is read.
_LAUNCHES = ("distributed", "submit")


@dataclass
class _NotebookRun:
    """The statements of a notebook's code cells that define names, run in one namespace."""

    path: str
    namespace: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def run(self) -> None:
        import nbformat
        from IPython.core.inputtransformer2 import TransformerManager

        try:
            notebook = nbformat.read(self.path, as_version=4)
        except Exception as exc:  # nbformat raises JSON, schema and OS errors alike
            raise _Refused(f"{self.path}: cannot read it as a notebook ({type(exc).__name__}: {exc})") from None
        self.namespace.update(__name__="__main__", __builtins__=builtins)
        transform = TransformerManager().transform_cell
        for number, cell in enumerate(notebook.cells, start=1):  # every cell counts, as `air-magic lint` counts
            if cell.cell_type != "code" or cell.source.lstrip().startswith("%%"):
                continue
            filename = f"<{self.path} cell {number}>"
            python = transform(cell.source)
            try:
                tree = ast.parse(python, filename=filename)
            except SyntaxError as exc:
                raise _Refused(f"{self.path}: cell {number} does not compile", _syntax_error(exc)) from None
            # Tracebacks (here and on the ranks) show the cell's own lines.
            shown = cell.source if cell.source.count("\n") == python.rstrip("\n").count("\n") else python
            linecache.cache[filename] = (len(shown), None, shown.splitlines(True), filename)
            for statement in tree.body:
                if _defines(statement):
                    self._execute(statement, filename, number)

    def _execute(self, statement: ast.stmt, filename: str, number: int) -> None:
        code = compile(ast.Module([statement], []), filename, "exec", dont_inherit=True)
        try:
            exec(code, self.namespace)
        except Exception as exc:
            if isinstance(statement, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                raise _Refused(
                    f"{self.path}: cell {number}, line {statement.lineno} failed: {type(exc).__name__}: {exc}",
                    _user_traceback(exc),
                ) from None
            self.notes.append(
                f"{_PROG}: note: {self.path}: skipped cell {number}, line {statement.lineno} "
                f"({type(exc).__name__}: {exc})"
            )


def _defines(statement: ast.stmt) -> bool:
    """Whether a notebook's top-level statement only defines names (see ``--help``)."""
    if isinstance(statement, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        return statement.value is not None and not _launches_or_ipython(statement.value)
    if isinstance(statement, ast.Pass):
        return True
    if isinstance(statement, ast.If):
        return all(map(_defines, statement.body + statement.orelse))
    if isinstance(statement, ast.With):
        return all(map(_defines, statement.body))
    if isinstance(statement, ast.Try):
        handlers = [s for handler in statement.handlers for s in handler.body]
        return all(map(_defines, statement.body + handlers + statement.orelse + statement.finalbody))
    return False


def _launches_or_ipython(value: ast.expr) -> bool:
    """A launch (``x.distributed(...)``, ``x.submit(...)``; ``air_magic.distributed(...)`` is
    the decorator) or IPython's syntax translated (``x = !ls``: ``get_ipython().getoutput``)."""
    for node in ast.walk(value):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "get_ipython":
            return True
        if isinstance(func, ast.Attribute) and func.attr in _LAUNCHES:
            owner = func.value
            if not (isinstance(owner, ast.Name) and owner.id == "air_magic"):
                return True
    return False


def _notebook_function(path: str, name: str) -> Any:
    loaded = _NotebookRun(path)
    _put_first_on_sys_path(os.getcwd())
    _put_first_on_sys_path(os.path.dirname(os.path.abspath(path)))  # first, as for a kernel started beside it
    loaded.run()
    for note in loaded.notes:
        sys.stderr.write(note + "\n")
    value = loaded.namespace.get(name)
    if value is None or not callable(value):
        functions = _functions(loaded.namespace, "__main__")
        hint = f"; they define: {', '.join(functions)}" if functions else ""
        if value is None:
            raise _Refused(f"{path}: no function {name!r} is defined by the statements that run{hint}.")
        raise _Refused(f"{path}:{name} is {_a(value)}, not a function{hint}.")
    return value


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
