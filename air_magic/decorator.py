"""``@distributed``: run a function on every accelerator of this machine.

Its keywords are the options of :data:`air_magic.options.OPTIONS` (a unit test keeps
the signature and the table in step); they are checked by :func:`~air_magic.spec.make_spec`.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, Generic, TypeVar, overload

from air_magic.accelerators import AcceleratorType, GPUType
from air_magic.capture import function_payload
from air_magic.errors import DirectCallError, render_lines
from air_magic.spec import DEFAULT_TIMEOUT, UNSET, AcceleratorArg, LaunchSpec, make_spec

if TYPE_CHECKING:
    from air_magic.kernel.launcher import Launch

__all__ = ["distributed", "DistributedFunction"]

R = TypeVar("R")


class DistributedFunction(Generic[R]):
    """A function that runs as one process per accelerator.

    Launch it with ``.distributed(*args, **kwargs)`` (blocks, returns one value per
    rank in rank order) or ``.submit(*args, **kwargs)`` (returns a
    :class:`~air_magic.kernel.launcher.Launch` at once).  ``.func`` is the original function.
    """

    def __init__(self, func: Callable[..., R], spec: LaunchSpec) -> None:
        if not callable(func):
            raise _shown_alone(
                TypeError(
                    f"@distributed decorates a function, got {type(func).__name__} {func!r}. "
                    "Put @distributed(...) on the line above a def."
                )
            )
        self.func = func
        self.spec = spec
        functools.update_wrapper(self, func)  # type: ignore[arg-type]
        try:
            self._signature: inspect.Signature | None = inspect.signature(func)
        except (ValueError, TypeError):  # a builtin without one (functools.partial(max, 3)):
            self._signature = None  # the call is checked where it runs, on the ranks
        #: Set on the object a method access returns (``obj.train``): the class attribute.
        self._unbound: DistributedFunction[R] | None = None
        self._last_launch: Launch | None = None

    @property
    def last_launch(self) -> "Launch | None":
        """The most recent :class:`~air_magic.kernel.launcher.Launch` of this function (its
        ``run_id``, ``log_paths``, ``status``), or ``None``."""
        return (self._unbound or self)._last_launch

    @last_launch.setter
    def last_launch(self, launch: "Launch | None") -> None:
        self._last_launch = launch
        if self._unbound is not None:
            self._unbound._last_launch = launch

    def __get__(self, instance: Any, owner: type | None = None) -> "DistributedFunction[R]":
        # ``@distributed`` on a method: ``obj.train`` is bound to ``obj`` like any method,
        # so ``obj.train.distributed(x)`` runs ``train(obj, x)`` on every rank.
        if instance is None:
            return self
        bound: DistributedFunction[R] = DistributedFunction(types.MethodType(self.func, instance), self.spec)
        bound._unbound = self
        return bound

    def __reduce__(self) -> tuple[Any, ...]:
        # An instance of a notebook class travels with its class, and the class holds this
        # object: send what defines it, not the launch handle it last made.
        return (DistributedFunction, (self.func, self.spec))

    @property
    def num_accelerators(self) -> int | None:
        """The number of ranks asked for (``None``: every GPU, or 1 CPU rank)."""
        return self.spec.num_accelerators

    @property
    def accelerator_type(self) -> AcceleratorType | GPUType | None:
        """The accelerator type asked for (``None``: detected at launch)."""
        return self.spec.accelerator_type

    @property
    def timeout(self) -> float | None:
        """Seconds a launch may run (``None``: no limit)."""
        return self.spec.timeout

    def __call__(self, *args: Any, **kwargs: Any) -> R:
        name = getattr(self.func, "__name__", "func")
        raise DirectCallError(
            f"{name} is decorated with @distributed and cannot be called directly. "
            f"Use {name}.distributed(...) to run it on every rank, or {name}.func(...) to call "
            "the original function in this process."
        )

    def _payload(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # A wrong call is a TypeError here, before anything is pickled or started.
        try:
            if self._signature is not None:
                self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            assert self._signature is not None
            message = f"{_call_name(self.func)}() takes {_parameters(self._signature)}: {exc}"
            raise _shown_alone(TypeError(message)) from None
        return function_payload(self.func, args, kwargs)

    def submit(self, *args: Any, **kwargs: Any) -> "Launch":
        """Start the launch and return its :class:`~air_magic.kernel.launcher.Launch` handle at once
        (``launch.debug()`` opens the prompts of its ranks stopped at a breakpoint)."""
        return self._start(args, kwargs, background=True)

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any], background: bool) -> "Launch":
        from air_magic.plugins import get_launcher

        payload = self._payload(args, kwargs)
        launch = get_launcher().start(self.spec, payload, background=background)
        self.last_launch = launch
        return launch

    def distributed(self, *args: Any, **kwargs: Any) -> list[R]:
        """Run on every rank and wait; one return value per rank, ordered by global rank.

        Examples
        --------
        >>> @distributed(num_accelerators=2)          # doctest: +SKIP
        ... def rank_and_size():
        ...     import os
        ...     return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        >>> rank_and_size.distributed()               # doctest: +SKIP
        [(0, 2), (1, 2)]
        """
        launch = self._start(args, kwargs, background=False)
        return launch.wait_streaming()

    def with_overrides(
        self,
        num_accelerators: int | None = None,
        accelerator_type: AcceleratorArg = None,
        timeout: Any = UNSET,
        *,
        gpus: int | None = None,
        gpu_type: AcceleratorArg = None,
        tracking: bool | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        backend: str | None = None,
        panel: bool | None = None,
        wait: bool | None = None,
    ) -> "DistributedFunction[R]":
        """A new, re-validated object with some settings changed (``timeout=None``: no limit)."""
        spec = self.spec
        count = num_accelerators
        if gpus is None and num_accelerators is None:
            count = spec.num_accelerators
        accel = accelerator_type
        if gpu_type is None and accelerator_type is None:
            accel = spec.accelerator_type
            if (
                count != spec.num_accelerators
                and isinstance(accel, AcceleratorType)
                and not accel.is_cpu
                and count is not None
                and count > accel.count
            ):
                accel = AcceleratorType(count, accel.model)  # keep the chip, follow the count
        new_spec = make_spec(
            count if gpus is None else None,
            accel,
            spec.timeout if timeout is UNSET else timeout,
            gpus=gpus,
            gpu_type=gpu_type,
            tracking=spec.tracking if tracking is None else tracking,
            experiment=spec.experiment if experiment is None else experiment,
            run_name=spec.run_name if run_name is None else run_name,
            backend=spec.backend if backend is None else backend,
            panel=spec.panel if panel is None else panel,
            wait=spec.wait if wait is None else wait,
        )
        return DistributedFunction(self.func, new_spec)

    def __repr__(self) -> str:
        name = getattr(self.func, "__qualname__", repr(self.func))
        return f"DistributedFunction({self.spec.describe()}, func={name})"


def _shown_alone(exc: BaseException) -> BaseException:
    # A wrong call caught before launch: in IPython the message is the whole story, like
    # air_magic's own errors (the frames would be air_magic's, not the caller's).
    exc._render_traceback_ = lambda: render_lines(exc)  # type: ignore[attr-defined]
    return exc


def _call_name(func: Any) -> str:
    """``train``, or ``Trainer.train`` for a method (without ``<locals>`` of enclosing functions)."""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return str(name).rsplit("<locals>.", 1)[-1]


def _parameters(signature: inspect.Signature) -> str:
    """The parameter list as a call would see it: ``(lr, *, epochs=3)``, without annotations."""
    if not signature.parameters:
        return "no arguments"
    plain = signature.replace(
        parameters=[p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()],
        return_annotation=inspect.Signature.empty,
    )
    return str(plain)


@overload
def distributed(func: Callable[..., R], /) -> DistributedFunction[R]: ...


@overload
def distributed(
    num_accelerators: int | None = None,
    accelerator_type: AcceleratorArg = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    *,
    gpus: int | None = None,
    gpu_type: AcceleratorArg = None,
    tracking: bool = True,
    experiment: str | None = None,
    run_name: str | None = None,
    backend: str = "local",
    remote: bool = False,
    panel: bool | None = None,
    wait: bool = True,
) -> Callable[[Callable[..., R]], DistributedFunction[R]]: ...


def distributed(
    num_accelerators: Any = None,
    accelerator_type: AcceleratorArg = None,
    timeout: Any = DEFAULT_TIMEOUT,
    *,
    gpus: Any = None,
    gpu_type: AcceleratorArg = None,
    tracking: Any = True,
    experiment: Any = None,
    run_name: Any = None,
    backend: Any = "local",
    remote: Any = False,
    panel: Any = None,
    wait: Any = True,
) -> Any:
    """Run a function as one process per accelerator of this machine (DDP, FSDP, DeepSpeed).

    Parameters
    ----------
    num_accelerators : int, optional
        Number of ranks. Default: every GPU of this machine, or 1 CPU rank where
        there is none (pass N to run N CPU ranks with gloo).
    accelerator_type : AcceleratorType or str, optional
        ``"GPU_8xH100"``, ``"GPU_1xA10"``, ``"GPU_<n>x<MODEL>"`` or ``"CPU"``, any case.
        Detected when omitted; checked against the hardware at launch.
    timeout : float or None
        Seconds before every rank is stopped and a ``LaunchTimeoutError`` is raised;
        ``None`` for no limit. Default 3 hours.
    gpus, gpu_type
        Deprecated names of ``num_accelerators`` and ``accelerator_type``.
    tracking : bool
        Record the launch as an MLflow run.
    experiment, run_name : str, optional
        MLflow experiment and run name for the launch.
    backend : str
        ``"local"`` (this machine).
    panel : bool, optional
        Show the launch's live panel; ``None`` (default) follows the kernel's setting
        (``%config DistributedMagics.panel``, ``AIR_MAGIC_PANEL``).
    wait : bool
        When the GPUs asked for are held by another launch (another notebook's), wait for
        them (the default, saying who holds them), or refuse at once (``False``).

    Returns
    -------
    DistributedFunction
        Launch with ``.distributed(*args, **kwargs)``; ``.func`` is the original.

    Examples
    --------
    >>> from air_magic import distributed                      # doctest: +SKIP
    >>> @distributed(num_accelerators=2)                       # doctest: +SKIP
    ... def train(lr):
    ...     import torch.distributed as dist
    ...     dist.init_process_group()
    ...     rank = dist.get_rank()
    ...     dist.destroy_process_group()
    ...     return rank, lr
    >>> train.distributed(0.1)                                 # doctest: +SKIP
    [(0, 0.1), (1, 0.1)]
    """
    if callable(num_accelerators) and not isinstance(num_accelerators, (int, AcceleratorType)):
        # Bare @distributed: the function arrives as the first argument.
        _warm_launcher()
        return DistributedFunction(num_accelerators, make_spec())
    spec = make_spec(
        num_accelerators,
        accelerator_type,
        timeout,
        gpus=gpus,
        gpu_type=gpu_type,
        tracking=tracking,
        experiment=experiment,
        run_name=run_name,
        backend=backend,
        remote=remote,
        panel=panel,
        wait=wait,
    )
    _warm_launcher(spec.tracking)

    def decorate(func: Callable[..., R]) -> DistributedFunction[R]:
        return DistributedFunction(func, spec)

    return decorate


def _warm_launcher(tracking: bool = True) -> None:
    # Start the helper (which imports torch) as early as possible, and MLflow with its
    # store: by the time the user calls .distributed(), the first launch is warm.
    try:
        from air_magic.plugins import get_launcher

        launcher = get_launcher()
        launcher.warm()
        ipython = sys.modules.get("IPython")
        if tracking and ipython is not None and ipython.get_ipython() is not None:
            # In a notebook the store is wanted anyway; a script importing a module does not
            # get an mlflow.db in its folder before it launches anything.
            from air_magic.tracking import warm_in_background

            warm_in_background(launcher.session_dir)
    except Exception:  # warming is an optimisation; the launch reports real problems
        pass
