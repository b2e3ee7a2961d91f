"""``air_magic.Pool``: ranks that stay across cells (the front; the engine is
:mod:`air_magic.kernel.pool.engine`, the rank side :mod:`air_magic.rank.pool.serve`).

>>> pool = air_magic.Pool(2)                          # doctest: +SKIP
>>> pool.push(lr=0.01)                                # doctest: +SKIP
>>> pool.run(lambda: __import__("os").environ["RANK"])  # doctest: +SKIP
['0', '1']
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, overload

from air_magic.kernel.pool import status as pool_status
from air_magic.kernel.pool.engine import PoolBrokenError, PoolBusyError, PoolCall, PoolEngine, current_pool, open_pools
from air_magic.spec import AcceleratorArg, check_timeout, make_spec

__all__ = ["Pool", "PoolBrokenError", "PoolBusyError", "PoolCall", "current_pool"]


class Pool:
    """N ranks that keep their namespace and their process group from one call to the next.

    ``Pool(num_accelerators=None, accelerator_type=None, *, backend="local", tracking=True,
    timeout=None, wait=True)`` starts the ranks at once (the same ranks a launch with these options
    would start: ``backend="ray"`` places one rank per bundle on the nodes of the Ray
    cluster); ``timeout`` bounds each call.  ``%%distributed --pool`` runs a cell on the
    kernel's pool.

    A kernel has one pool: a new one closes the kernel's earlier pool first (its ranks and
    their state are gone, and a line says so), so that re-running ``pool = Pool(2)`` never
    leaves ranks running out of reach.
    """

    def __init__(
        self,
        num_accelerators: int | None = None,
        accelerator_type: AcceleratorArg = None,
        *,
        backend: str = "local",
        tracking: bool = True,
        timeout: float | None = None,
        wait: bool = True,
    ) -> None:
        spec = make_spec(
            num_accelerators, accelerator_type, None, tracking=tracking, backend=backend, panel=False, wait=wait
        )
        from air_magic.plugins import get_launcher

        self._engine = PoolEngine(spec, get_launcher, timeout=check_timeout(timeout) if timeout is not None else None)
        close_earlier()
        self._engine.start()

    @classmethod
    def _of(cls, engine: PoolEngine) -> "Pool":
        pool = cls.__new__(cls)
        pool._engine = engine
        return pool

    @classmethod
    def current(cls) -> "Pool | None":
        """The kernel's pool that ``%%distributed --pool`` uses (the most recently started open
        one, however it was started), or None."""
        engine = current_pool()
        return None if engine is None else cls._of(engine)

    @property
    def num_accelerators(self) -> int:
        """The pool's number of ranks."""
        return self._engine.world_size

    @property
    def state(self) -> str:
        """``idle``, ``running``, ``broken`` (the next call starts fresh ranks) or ``closed``."""
        return str(self._engine.state)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank and wait for it.

        A function defined in the notebook runs in the ranks' namespace, so it reads what cells
        and :meth:`push` left there.

        Returns
        -------
        list
            Each rank's return value, in rank order.

        Raises
        ------
        Exception
            The first failing rank's own exception (its traceback at your lines);
            :class:`~air_magic.PoolBusyError` while a :meth:`submit` call runs;
            :class:`~air_magic.PoolBrokenError` when a rank dies.

        Examples
        --------
        ::

            pool = air_magic.Pool(2)
            pool.run(lambda: torch.distributed.get_rank())   # [0, 1]
        """
        return self._engine.call(fn, *args, **kwargs)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PoolCall:
        """Call ``fn(*args, **kwargs)`` on every rank in the background.

        Returns
        -------
        PoolCall
            A handle, at once: ``result(timeout)``, ``exception()``, ``done()``, ``cancel()``.
            Until it ends, another call on the pool raises :class:`~air_magic.PoolBusyError`.
        """
        return self._engine.submit(fn, *args, **kwargs)

    def push(self, **values: Any) -> None:
        """Set each ``name=value`` in every rank's namespace (what later cells and calls read).

        Raises
        ------
        air_magic.CaptureError
            A value that cannot be sent (pickled) to the ranks, named with why.

        Examples
        --------
        ::

            pool.push(lr=1e-3, batch_size=64)
        """
        self._engine.push(**values)

    @overload
    def pull(self, name: str) -> list[Any]: ...
    @overload
    def pull(self, name: str, rank: int) -> Any: ...
    @overload
    def pull(self, name: str, *, ranks: list[int]) -> list[Any]: ...

    def pull(self, name: str, rank: int | None = None, *, ranks: list[int] | None = None) -> Any:
        """The value of ``name`` in the ranks' namespaces.

        Large tensors come through shared memory, as a launch's values do.

        Parameters
        ----------
        name:
            A name the ranks' code (or :meth:`push`) assigned.
        rank:
            Only this rank's value (the others send nothing).
        ranks:
            Only these ranks' values, in this order.

        Returns
        -------
        list or object
            Every rank's value in rank order; with ``rank=``, that one value.

        Raises
        ------
        air_magic.ResultError
            A value that cannot come back (it holds the ranks' process group, as a DDP module
            does: :meth:`state_dict` brings a module back).

        Examples
        --------
        ::

            losses = pool.pull("loss")          # [0.25, 0.25]
            weights = pool.pull("w", rank=0)
        """
        if rank is not None and ranks is not None:
            raise TypeError("pool.pull takes rank= or ranks=, not both")
        wanted = [rank] if rank is not None else ranks
        if wanted is not None:
            wanted = _check_ranks(wanted, self._engine.world_size, "pool.pull")
        values = self._engine.pull(name, wanted)
        return values[0] if rank is not None else values

    def state_dict(self, name: str, *, dtype: Any = None) -> dict[str, Any]:
        """The module bound to ``name`` in the ranks, as one full state dict of CPU tensors here.

        A DDP or plain module's comes from rank 0; an FSDP2 or tensor-parallel module's is put
        together from every rank's shards; a DeepSpeed ZeRO-3 module's from its partitions. The
        ranks write straight into one shared-memory area the kernel maps: no collective, no
        process group, one copy.

        Parameters
        ----------
        name:
            The name of the module in the ranks' namespace (``model`` after ``model = ...``).
        dtype:
            Convert floating-point tensors on the way (``torch.bfloat16``); ``None`` keeps them.

        Returns
        -------
        dict
            Keys as the unwrapped module names them (``a.weight``, not ``module.a.weight``).

        Raises
        ------
        air_magic.ModelBackError
            ``name`` is missing or not a module, the state dict is larger than the kernel's free
            memory (the message offers :meth:`save`), an FSDP1 module, a ``Partial`` DTensor, a
            pool on Ray.

        Examples
        --------
        ::

            sd = air_magic.Pool.current().state_dict("model")
            torch.save(sd, "model.pt")
        """
        from air_magic.kernel.pool import model_back

        return model_back.state_dict(self._engine, name, dtype)

    def model(self, name: str, factory: Callable[[], Any], *, dtype: Any = None) -> Any:
        """The module bound to ``name`` in the ranks, as an ``nn.Module`` on CPU here.

        ``factory()`` is built on the meta device (no memory), its keys and shapes are checked
        against the ranks' module before anything is copied, and it is filled with the ranks'
        weights (``load_state_dict(assign=True)``: no second copy). Tied weights stay tied.

        Parameters
        ----------
        name:
            The module's name in the ranks' namespace.
        factory:
            A callable that builds the same architecture (a class, or ``lambda: Net(...)``).
        dtype:
            As for :meth:`state_dict`.

        Returns
        -------
        torch.nn.Module
            ``factory()``'s module with the ranks' weights, in eval mode.

        Raises
        ------
        air_magic.ModelBackError
            As :meth:`state_dict`, and a factory whose keys differ (the missing and unexpected
            keys named).

        Examples
        --------
        ::

            model = pool.model("model", MyNet)
        """
        from air_magic.kernel.pool import model_back

        return model_back.model(self._engine, name, factory, dtype)

    def save(
        self, name: str, folder: str | os.PathLike[str], *, max_shard_size: int | str = "5GB", dtype: Any = None
    ) -> list[str]:
        """The module bound to ``name`` as safetensors files in ``folder``, written by the ranks.

        For a model larger than the kernel's memory: nothing passes through the kernel. The files
        load with ``safetensors.torch.load_file`` and Hugging Face's ``from_pretrained``.

        Parameters
        ----------
        name:
            The module's name in the ranks' namespace.
        folder:
            Where to write (created if missing).
        max_shard_size:
            Bytes per file (``"5GB"``, ``"500MB"`` or an int); a larger model is written as shards
            with ``model.safetensors.index.json``.
        dtype:
            As for :meth:`state_dict`.

        Returns
        -------
        list of str
            The paths of the files written.

        Examples
        --------
        ::

            pool.save("model", "out/", max_shard_size="2GB")
        """
        from air_magic.kernel.pool import model_back

        return model_back.save(self._engine, name, folder, max_shard_size, dtype)

    def sync(self, *names: str, from_rank: int = 0) -> list[str]:
        """Copy the state of ``names`` from one rank to every other: a repair for ranks whose
        replicated state came apart (the cell after an interrupt says which names differ).

        Each name's module parameters and buffers, or optimizer state (and step count), are
        broadcast from ``from_rank`` in the pool's process group. Sharded state is refused with a
        line saying why: an FSDP2 or tensor-parallel module (each rank holds its own part), a
        DeepSpeed engine (its optimizer is partitioned).

        Parameters
        ----------
        names:
            Names in the ranks' namespace (``"model"``, ``"opt"``).
        from_rank:
            The rank whose state the others take.

        Returns
        -------
        list of str
            What was copied, a line per name (``model: 4 tensors``).

        Raises
        ------
        ValueError
            No name, a rank out of range, a name that is missing, not a module or optimizer, or
            sharded (the message says which and why).

        Examples
        --------
        ::

            pool.sync("model", "opt")          # rank 0's weights and optimizer state everywhere
        """
        if not names:
            raise ValueError("pool.sync needs the names to copy: pool.sync('model', 'opt')")
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"pool.sync takes names of the ranks' namespace as strings; got {name!r}")
        if isinstance(from_rank, bool) or not isinstance(from_rank, int):
            raise ValueError(f"from_rank must be a rank number; got {from_rank!r}")
        _check_ranks([from_rank], self._engine.world_size, "pool.sync")
        return self._engine.sync(list(names), from_rank)

    def restart(self) -> None:
        """Fresh ranks (the state of the old ones is lost)."""
        self._engine.restart()

    def close(self) -> None:
        """Stop the ranks; the pool cannot be used again."""
        self._engine.close()

    def status(self) -> dict[str, Any]:
        """Ranks, state, memory per rank (bytes), calls run, uptime (s), restarts."""
        return pool_status.status(self._engine)

    def __repr__(self) -> str:
        return pool_status.text(self._engine)

    def _repr_html_(self) -> str:
        # The same status as %distributed_pool shows, drawn by the panel (panel/_pool_status.py).
        from air_magic.panel._pool_status import html

        return html(pool_status.facts(self._engine))

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_ranks(ranks: Any, world_size: int, what: str) -> list[int]:
    """``ranks`` as a list of the pool's rank numbers, or a clear error."""
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        raise TypeError(f"{what}: ranks must be a list of rank numbers, not {type(ranks).__name__}")
    checked = []
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{what}: a rank is a number from 0 to {world_size - 1}, not {rank!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"{what}: rank {rank} is not one of the pool's ranks (0 to {world_size - 1})")
        checked.append(rank)
    if not checked:
        raise ValueError(f"{what}: ranks is empty")
    return checked


def close_earlier() -> None:
    """Close the kernel's open pools before a new one starts, saying what was closed."""
    for engine in open_pools():
        running = f", running {engine.current} (that call ends with an error)" if engine.state == "running" else ""
        n = engine.world_size
        engine.close()
        print(
            f"[air_magic] closed the kernel's earlier pool ({n} rank{'s' * (n != 1)}, {engine.cells} "
            f"call{'s' * (engine.cells != 1)} run{running}): a kernel keeps one pool, and its state is gone.",
            file=sys.stderr,
        )
