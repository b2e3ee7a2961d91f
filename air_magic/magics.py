"""The ``%%distributed`` cell magic: a thin front over the same launcher as ``@distributed``.

Its flags come from :data:`air_magic.options.OPTIONS`; its ``%config`` traits that are
kernel-wide (``capture_warn_mb``, ``panel``) are written into :data:`air_magic.settings.settings`.
"""

from __future__ import annotations

import shlex
import traceback
import uuid
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from traitlets import Bool, CFloat, CInt, Unicode, default, observe

from air_magic import capture
from air_magic.errors import ConfigurationError
from air_magic.options import FLAG_TO_OPTION, POOL_KEYWORDS, apply_arguments
from air_magic.protocol import RESULT_NAME
from air_magic.settings import DEFAULT_WARN_MB, settings
from air_magic.spec import DEFAULT_TIMEOUT, LaunchSpec, check_timeout, make_spec, timeout_from_text

__all__ = ["DistributedMagics"]


def _timeout_arg(text: str) -> float | None:
    """``--timeout``: seconds > 0, or ``none`` for no limit (0 is refused, as ``timeout=0`` is)."""
    try:
        return timeout_from_text(text)
    except ConfigurationError as exc:
        raise UsageError(f"%%distributed: {exc}") from None


@magics_class
class DistributedMagics(Magics):
    """Defaults of ``%%distributed``, settable with ``%config DistributedMagics.<name> = ...``."""

    num_accelerators = CInt(None, allow_none=True, help="Ranks per launch (default: every GPU, or 1 CPU rank).").tag(
        config=True
    )
    accelerator_type = Unicode(None, allow_none=True, help="Default accelerator type.").tag(config=True)
    timeout = CFloat(DEFAULT_TIMEOUT, allow_none=True, help="Default timeout in seconds (None: none).").tag(config=True)
    tracking = Bool(True, help="Record each launch as an MLflow run.").tag(config=True)
    experiment = Unicode(None, allow_none=True, help="Default MLflow experiment.").tag(config=True)
    capture_warn_mb = CFloat(
        help="Warn when a captured object pickles to more MB than this (default: env AIR_MAGIC_CAPTURE_WARN_MB or 100)."
    ).tag(config=True)
    panel = Bool(
        True, help="Show each launch's live panel (decorator launches too); env AIR_MAGIC_PANEL=0 also turns it off."
    ).tag(config=True)

    @default("capture_warn_mb")
    def _capture_warn_mb_default(self) -> float:
        try:
            return settings.capture_warn_mb
        except ConfigurationError:  # a bad AIR_MAGIC_CAPTURE_WARN_MB is said at the launch that reads it
            return DEFAULT_WARN_MB

    # One setting for every launch of the kernel, decorator launches included.
    @observe("capture_warn_mb")
    def _capture_warn_mb_changed(self, change: Any) -> None:
        settings.capture_warn_mb = change["new"]

    @observe("panel")
    def _panel_changed(self, change: Any) -> None:
        settings.panel = change["new"]

    @magic_arguments(name="%distributed")  # IPython adds one "%": the help reads "%%distributed [-n N] ..."
    @apply_arguments(argument)  # the flags of air_magic.options.OPTIONS
    @cell_magic
    def distributed(self, line: str, cell: str) -> Any:
        """Run this cell on every rank; its last expression becomes a list, one value per rank.

        Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, so
        ``torch.distributed.init_process_group()`` works as under torchrun. Names the
        cell reads from the notebook are sent to the ranks (functions and classes
        defined in the notebook by value, modules by reference). Interrupt the
        kernel to stop the ranks.

        Script arguments: everything after ``--`` on the magic line becomes the
        ranks' ``sys.argv[1:]`` (split like a shell does), so an argparse, click or
        hydra program pasted into the cell reads them; without ``--``, ``sys.argv``
        is ``['Cell In[N]']`` and a parser takes its defaults::

            %%distributed -n 2 -- --lr 0.01 --epochs 3

        Examples
        --------
        ::

            In [1]: %load_ext air_magic

            In [2]: %%distributed -n 2
               ...: import torch, torch.distributed as dist
               ...: dist.init_process_group()
               ...: x = torch.ones(1) * dist.get_rank()
               ...: dist.all_reduce(x)
               ...: dist.destroy_process_group()
               ...: x.item()
            Out[2]: [1.0, 1.0]
        """
        options, script_args = _split_line(line)
        _given_once(options)
        args = self.distributed.parser.parse_args(options)  # type: ignore[attr-defined]
        spec = self._spec(args)
        if not cell.strip():
            raise UsageError("%%distributed: the cell is empty; write the code each rank runs below the magic.")
        number = _cell_number(self.shell)
        display = f"Cell In[{number}]"
        filename = f"<air_magic cell {number} {uuid.uuid4().hex[:8]}>"
        namespace = self.shell.user_ns if self.shell is not None else {}
        if args.pool:
            return self._pool_cell(args, spec, line, cell, script_args, namespace, display, filename)
        try:
            payload = capture.cell_payload(
                cell,
                namespace,
                display=display,
                filename=filename,
                header=f"%%distributed {line}".rstrip(),
                argv=[display, *script_args],
            )
        except SyntaxError as exc:
            raise _cell_syntax_error(exc, self.shell, number) from None
        from air_magic.plugins import get_launcher

        try:
            launch = get_launcher().start(spec, payload, background=args.run_async)
        except ConfigurationError as exc:
            raise UsageError(f"%%distributed: {exc}") from None
        if args.run_async:
            return launch
        values = launch.wait_streaming()
        # compile_cell stored a last expression's value under RESULT_NAME.
        return values if RESULT_NAME in payload.data["code"].co_names else None

    def _pool_cell(
        self,
        args: Any,
        spec: LaunchSpec,
        line: str,
        cell: str,
        script_args: list[str],
        namespace: dict[str, Any],
        display: str,
        filename: str,
    ) -> Any:
        """``%%distributed --pool``: the cell on the kernel's pool (started by the first such cell)."""
        for flag, given in (
            ("--async", args.run_async),
            ("--experiment", args.experiment),
            ("--run-name", args.run_name),
        ):
            if given:
                raise UsageError(
                    f"%%distributed --pool: {flag} is for a launch, not for a pool's cell "
                    "(a pool cell waits for its ranks; what it logs goes to a child run of the pool's MLflow run)."
                )
        from air_magic.pool import Pool, current_pool

        engine = current_pool()
        timeout = spec.timeout  # each cell is bounded as a launch is (--timeout, else %config's)
        if engine is None:  # the first pool cell starts the pool the spec describes
            try:
                engine = Pool(
                    spec.num_accelerators,
                    spec.accelerator_type,
                    tracking=spec.tracking,
                    backend=spec.backend,
                    wait=spec.wait,
                )._engine
            except ConfigurationError as exc:
                raise UsageError(f"%%distributed: {exc}") from None
        elif args.backend is not None and args.backend != engine.spec.backend:
            raise UsageError(
                f"%%distributed --pool --backend {args.backend}: the kernel's pool runs on {engine.spec.backend} "
                "(with its state). Leave out --backend to use it, or stop it first with %distributed_pool --stop "
                "(its state is lost) and start a new one."
            )
        elif args.num_accelerators is not None and args.num_accelerators != engine.world_size:
            raise UsageError(
                f"%%distributed --pool -n {args.num_accelerators}: the kernel's pool has {engine.world_size} "
                f"rank{'s' * (engine.world_size != 1)} (and their state). Leave out -n to use it, or stop it first "
                "with %distributed_pool --stop (its state is lost) and start a new one."
            )
        try:
            values = engine.run_cell(
                cell,
                namespace,
                display=display,
                filename=filename,
                header=f"%%distributed {line}".rstrip(),
                argv=[display, *script_args],
                timeout=timeout,
            )
        except SyntaxError as exc:
            raise _cell_syntax_error(exc, self.shell, _cell_number(self.shell)) from None
        return values if engine.last_had_value else None

    @magic_arguments()
    @argument("--restart", action="store_true", help="Start fresh ranks in place of the pool's (their state is lost).")
    @argument("--stop", action="store_true", help="Stop the pool's ranks (their state is lost).")
    @apply_arguments(argument, only=POOL_KEYWORDS)
    @line_magic
    def distributed_pool(self, line: str) -> Any:
        """The kernel's pool of ranks, which stay across ``%%distributed --pool`` cells.

        Alone, it shows the pool (ranks, state, memory per rank, cells run, uptime);
        ``-n N`` (with ``--accelerator-type T``, ``--no-tracking``) starts one;
        ``--stop`` stops it; ``--restart`` gives it fresh ranks::

            In [2]: %distributed_pool -n 2
            In [3]: %%distributed --pool
               ...: import torch, torch.distributed as dist
               ...: model = torch.nn.Linear(4, 1)      # stays on every rank
            In [4]: %%distributed --pool
               ...: model.weight.shape
            Out[4]: [torch.Size([1, 4]), torch.Size([1, 4])]
        """
        args = self.distributed_pool.parser.parse_args(words(line, "%distributed_pool"))  # type: ignore[attr-defined]
        from air_magic.kernel.pool import status as pool_status
        from air_magic.pool import Pool, current_pool

        engine = current_pool()
        wants_new = args.num_accelerators is not None or args.accelerator_type is not None or args.backend is not None
        if args.stop or args.restart:
            if engine is None:
                raise UsageError("%distributed_pool: this kernel has no pool; start one with %distributed_pool -n N.")
            if args.stop:
                from air_magic.kernel.pool.engine import close_all

                stopped = close_all()
                print(
                    "[air_magic] the pool was stopped."
                    if stopped <= 1
                    else f"[air_magic] {stopped} pools were stopped."
                )
                return None
            engine.restart()
            print(pool_status.describe(engine))
            return None
        if wants_new:
            if engine is not None:
                raise UsageError(
                    f"%distributed_pool: the kernel already has a pool of {engine.world_size} rank"
                    f"{'s' * (engine.world_size != 1)}; stop it first with %distributed_pool --stop (its state is lost)."
                )
            try:
                pool = Pool(
                    args.num_accelerators,
                    args.accelerator_type or self.accelerator_type,
                    tracking=self.tracking and not args.no_tracking,
                    timeout=_timeout_arg(args.timeout) if args.timeout is not None else None,
                    backend=args.backend or "local",
                    wait=not args.no_wait,
                )
            except ConfigurationError as exc:
                raise UsageError(f"%distributed_pool: {exc}") from None
            print(pool_status.describe(pool._engine))
            return None
        if engine is None:
            print(
                "[air_magic] this kernel has no pool; start one with %distributed_pool -n N (or a %%distributed --pool cell)."
            )
            return None
        from IPython.display import display

        from air_magic.panel._pool_status import bundle

        display(bundle(engine), raw=True)  # what Pool.current() shows, as text and as HTML
        report = engine.hang_report()
        if report is not None:  # a call (pool.submit) that hangs now
            display(report)
        return None

    @magic_arguments()
    @argument("--stop", metavar="ID", help="Stop your launch or pool ID (its cell says who stopped it).")
    @argument("--json", action="store_true", help="The list as JSON.")
    @line_magic
    def distributed_ps(self, line: str) -> Any:
        """Every air_magic launch and pool on this machine (every notebook's, every user's),
        as ``air-magic ps`` shows them; ``--stop ID`` stops one of yours, as ``air-magic stop``::

            In [7]: %distributed_ps
            ID             OWNER  KIND  RANKS  GPUS  GPU MEM      HOST MEM   STATE    AGE  NOTEBOOK / KERNEL
            0003-5f2c91ab  alice  pool  4      0,1,2,3  9.1G ...  2.3G ...   running  12m  train.ipynb
        """
        args = self.distributed_ps.parser.parse_args(words(line, "%distributed_ps"))  # type: ignore[attr-defined]
        from air_magic.kernel.machine import ps as machine

        if args.stop:
            try:
                print(f"[air_magic] {machine.stop(args.stop)}")
            except machine.StopError as exc:
                raise UsageError(f"%distributed_ps --stop: {exc}") from None
            return None
        found, skipped = machine.rows()
        if args.json:
            return found
        print(machine.table(found, machine.orphans(), skipped))
        return None

    @magic_arguments()
    @argument("rank", nargs="?", type=int, help="The rank to look into (default: the one that failed first).")
    @line_magic
    def distributed_debug(self, line: str) -> None:
        """The post-mortem of a pool cell that failed: pdb in a rank's frames, here.

        Right after a failed ``%%distributed --pool`` cell (the rank keeps its exception until
        the next pool cell; leaving pdb lets it go, with the memory its frames held)::

            In [5]: %%distributed --pool
               ...: loss = model(batch).sum() / 0   # fails on every rank
            In [6]: %distributed_debug 1
            (Pdb rank 1) p batch.shape

        ``%pdb on`` opens it on its own as a rank raises, in launches too.
        """
        args = self.distributed_debug.parser.parse_args(words(line, "%distributed_debug"))  # type: ignore[attr-defined]
        from air_magic.kernel.pool.engine import current_pool

        engine = current_pool()
        if engine is None:
            raise UsageError("%distributed_debug: this kernel has no pool (%pdb on opens a launch's post-mortem).")
        if args.rank is not None and not 0 <= args.rank < engine.world_size:
            raise UsageError(f"%distributed_debug: the pool has ranks 0 to {engine.world_size - 1}, not {args.rank}.")
        if not engine.debug(args.rank):
            which = (
                f"rank {args.rank} of the pool keeps no exception"
                if args.rank is not None
                else "no rank of the pool keeps an exception"
            )
            raise UsageError(
                f"%distributed_debug: {which}: the last pool cell did not fail there (a rank keeps its exception "
                "until the next pool cell)."
            )

    def _spec(self, args: Any) -> LaunchSpec:
        try:
            if args.timeout is not None:
                timeout = _timeout_arg(args.timeout)
            else:
                timeout = check_timeout(self.timeout, no_limit="%config DistributedMagics.timeout = None")
            return make_spec(
                args.num_accelerators if args.num_accelerators is not None else self.num_accelerators,
                args.accelerator_type or self.accelerator_type,
                timeout,
                tracking=self.tracking and not args.no_tracking,
                experiment=args.experiment if args.experiment is not None else self.experiment,
                run_name=args.run_name,
                backend=args.backend or "local",
                wait=not args.no_wait,
            )
        except ConfigurationError as exc:
            raise UsageError(f"%%distributed: {exc}") from None


def _cell_syntax_error(exc: SyntaxError, shell: Any = None, number: int | None = None) -> BaseException:
    """A cell's syntax error as the notebook shows it: a line of IPython's own syntax named,
    else the error alone, without the frames of the magic's machinery."""
    ipython_line = _ipython_syntax(exc)
    if ipython_line:
        return UsageError(ipython_line)
    name = exc.filename
    names = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if isinstance(names, dict) and number is not None:  # IPython names it "Cell In[n], line L"
        name = f"<air_magic cell {number} syntax>"
        names[name] = number
    args = (name, exc.lineno, exc.offset, exc.text, exc.end_lineno, exc.end_offset)
    cell_error = CellSyntaxError(exc.msg, args)
    lines = traceback.format_exception_only(SyntaxError, cell_error)
    cell_error._render_traceback_ = lambda: "".join(lines).rstrip("\n").splitlines()  # type: ignore[attr-defined]
    return cell_error


#: A cell's syntax error, as the magics raise it: a ``SyntaxError`` (``except SyntaxError``
#: catches it, and it is named so), of a class of its own so that IPython draws it as its own
#: (:func:`show_cell_syntax_errors`) and any other syntax error as before.
CellSyntaxError = type("SyntaxError", (SyntaxError,), {"__module__": "builtins", "__qualname__": "SyntaxError"})


def show_cell_syntax_errors(shell: Any) -> None:
    """Show a cell's syntax error as IPython shows one in its own cells: the line and a caret,
    without the frames of IPython and the magic it passed through on the way.  (IPython draws
    a ``SyntaxError`` raised while code runs with every frame, and never asks the exception how
    to draw itself.)  Only where no other handler is set: the user's own comes first."""
    if getattr(shell, "custom_exceptions", None) != ():
        return
    shell.set_custom_exc((CellSyntaxError,), _show_syntax_error)


def forget_cell_syntax_errors(shell: Any) -> None:
    if getattr(shell, "custom_exceptions", None) == (CellSyntaxError,):
        shell.set_custom_exc((), None)


def _show_syntax_error(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> Any:
    stb = shell.SyntaxTB.structured_traceback(etype, value, [])
    shell._showtraceback(etype, value, stb)
    return stb


def words(line: str, magic: str) -> list[str]:
    """A magic's line split like a shell splits it, a trailing ``# comment`` left out (an
    apostrophe in it included: ``-n 2  # let's see``); a line that cannot be split is one
    ``UsageError`` naming the magic."""
    try:
        return shlex.split(line, comments=True)
    except ValueError as exc:  # "No closing quotation"
        raise UsageError(f"{magic}: cannot read the options ({exc}): {line.strip()}") from None


def _split_line(line: str) -> tuple[list[str], list[str]]:
    """The magic's own options and the script arguments after ``--``, split like a shell."""
    words_ = words(line, "%%distributed")
    if "--" in words_:
        cut = words_.index("--")
        return words_[:cut], words_[cut + 1 :]
    return words_, []


def _given_once(words: list[str]) -> None:
    """Refuse an option given twice (``-n 2 -n 3``): argparse would keep the last silently."""
    seen: dict[str, list[str]] = {}
    for word in words:
        if not word.startswith("-") or word == "-":
            continue
        name = word.split("=", 1)[0]
        if not name.startswith("--") and len(name) > 2:
            name = name[:2]  # -n3
        option = FLAG_TO_OPTION.get(name)
        if option is not None:
            seen.setdefault("/".join(option.flags), []).append(word)
    for flags, given in seen.items():
        if len(given) > 1:
            raise UsageError(f"%%distributed: {flags} is given {len(given)} times on the line; give it once.")


def _ipython_syntax(exc: SyntaxError) -> str:
    """The error for a cell whose syntax error is a line of IPython's own syntax (a
    ``%magic`` or a ``!shell`` line), which the ranks cannot run; ``''`` otherwise."""
    text = (exc.text or "").strip()  # the line as the cell has it
    number = exc.lineno  # counted as the notebook shows it (the magic's line is line 1)
    if text.startswith("!"):
        kind = "a shell command"
        instead = "run it with subprocess.run([...]) in the cell, or in a cell of its own"
    elif text.startswith("%"):
        kind = "an IPython magic"
        instead = "write it in Python, or run it in a cell of its own"
    else:
        return ""
    return (
        f"%%distributed: line {number} of the cell, {text!r}, is {kind}: the ranks run the cell as plain "
        f"Python, without IPython's syntax; {instead}."
    )


def _cell_number(shell: Any) -> int:
    """The ``In[N]`` number of the running cell (IPython has already counted it)."""
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if numbers:
        return max(numbers.values())
    return int(getattr(shell, "execution_count", 0) or 0)
