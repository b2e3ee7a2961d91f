"""A pool rank: the process group once, then the kernel's cells until it closes the pool.

A pool is a launch whose ranks stay (:mod:`air_magic.kernel.pool.engine` is its kernel side).
Each rank keeps one namespace (its ``__main__``) across cells, joins the default
process group once, and waits between cells on its connection to the kernel (a Unix
socket in the kernel's private session folder, or a TCP port of the kernel's machine for
Ray ranks on other nodes, with an auth key: no CPU while idle)::

    kernel                                    rank r         (air_magic.protocol.pool)
    ------                                    ------
    Listener(socket, authkey)  <-- connect -- RankHello(r, pid)
    PoolRequest(CELL, id, {code, names, sources}) -->  exec in the namespace; SIGINT raises
                                              only here, outside torch's frames
                                              (air_magic.rank.pool.interrupts.safe_point)
                                       <--    CallBegan(id): from now on SIGINT raises
    PoolRequest(CALL, id, {func, args, kwargs}) -->  func(*args, **kwargs)
    PUSH {names} / PULL {name, ranks}  -->    set names / read one (on the ranks asked)
    MODEL {op, name, ...}              -->    the model back (air_magic.rank.pool.model_back)
    SETTLE {}                          -->    after an interrupt: what it left half-way put
                                              back, and the state the kernel compares
                                              (air_magic.rank.pool.interrupts.state)
    SYNC {names, src}                  -->    pool.sync: names copied from one rank to the others
    REGROUP {round}                    -->    fresh connections for the group (a hang's way out)
                                       <--    CallDone(id, record, names of the namespace,
                                                       pids the call forked with os.fork())
    PoolClose() or the kernel gone     -->    the rank returns; the launch ends

Each call also carries the kernel's working directory, and its ``sys.path`` and environment
where they changed since the last call: a pool cell runs where a launch from the same
kernel would (after ``%cd``, a ``sys.path`` entry, an ``os.environ`` change).

Only the rank itself speaks on its connection.  A process the call's code forked (an
``os.fork()`` whose child runs on to the end of the cell) is ended when it comes back
here, with a line in the rank's log; a child that ends on its own (multiprocessing's,
DataLoader workers) never comes back here.

Code pasted from a script runs unchanged: ``init_process_group()`` on a pool returns
at once (the group is the pool's), and ``destroy_process_group()`` of the default group
leaves it alive.
"""

from __future__ import annotations

import functools
import linecache
import os
import signal
import sys
import types
from typing import Any, Callable

import cloudpickle

from air_magic.protocol import RESULT_NAME, ErrorRecord, Record, UnpicklableRecord, ValueRecord, printable
from air_magic.protocol.pool import CallBegan, CallDone, PoolKind, PoolRequest, RankHello
from air_magic.rank import results as _results
from air_magic.rank import tracking_shim as _tracking
from air_magic.rank.inspect import debugger as _debugger
from air_magic.rank.pool.interrupts import safe_point as _safe_point
from air_magic.rank.pool.interrupts import state as _state

__all__ = ["serve"]

#: The environment variable a pool rank has (so user code can tell, e.g. to skip its own set-up).
POOL_ENV = "AIR_MAGIC_POOL"


def serve(
    main: types.ModuleType,
    rank: int,
    data: dict[str, Any],
    error_record: Callable[[BaseException, dict[str, tuple[str, str]]], ErrorRecord],
    shm_dir: str | None = None,
    work_dir: str | None = None,
) -> None:
    """Join the group, connect to the kernel, and run what it sends until it closes the pool.
    A reply's large tensors travel as a launch's do: through files of ``shm_dir`` (or of
    ``work_dir`` where it has no room), when the kernel is on this machine."""
    from multiprocessing.connection import Client

    os.environ[POOL_ENV] = "1"
    _state.count_steps()  # each optimizer's steps, for the check after an interrupt
    _join_the_group(data["device"])
    _keep_the_group()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C between cells finds the rank idle
    address = data["address"]  # a Unix socket's path, or (host, port) for ranks of other machines
    if not isinstance(address, str):  # the kernel is on another machine: values go in the reply itself
        shm_dir = work_dir = None
    conn = Client(address if isinstance(address, str) else tuple(address), authkey=data["authkey"])
    me = os.getpid()
    _watch_forks(me)
    conn.send(RankHello(rank, me))
    while True:
        try:
            message = cloudpickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the kernel closed the pool, or is gone
            return
        if not isinstance(message, PoolRequest):  # PoolClose: the pool closed
            return
        kind = message.kind
        tracked = kind in (PoolKind.CELL, PoolKind.CALL)
        if tracked:  # what the call logs goes to a child run of the pool's (made if it logs)
            _tracking.begin_call(message.id, message.data.get("label") or str(kind))
        began = functools.partial(_say_began, conn, message.id, me)
        record = _handle(main, message, error_record, began)
        if os.getpid() != me:  # a process the call's code forked, back at the end of the call
            _end_forked_child(rank, me, message.data.get("label") or str(kind))
        if tracked:
            _tracking.end_call(message.id, _status(record))
        try:
            blob = _results.dumps_record(record, shm_dir, f"r{rank}c{message.id}", work_dir)
        except BaseException as exc:  # the value cannot be pickled
            value_type = type(record[0]).__module__ + "." + type(record[0]).__qualname__
            blob = cloudpickle.dumps(UnpicklableRecord(value_type, f"{type(exc).__name__}: {printable(exc)}"))
        names = _owned(main.__dict__)
        forked, _forked[:] = list(_forked), []
        try:
            conn.send(CallDone(message.id, blob, names, forked))
        except OSError:
            return


#: The processes the current call's code forked with a plain ``os.fork()`` (not
#: multiprocessing's, whose children end on their own): the kernel tells the cell.
_forked: list[int] = []


def _watch_forks(me: int) -> None:
    """Note each plain ``os.fork()`` of the rank's code (the kernel says so in the cell)."""
    real_fork = os.fork

    def fork() -> int:
        pid = real_fork()
        if pid > 0 and os.getpid() == me:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if not str(caller).startswith("multiprocessing"):
                _forked.append(pid)
        return pid

    fork.__doc__ = real_fork.__doc__
    os.fork = fork


def _say_began(conn: Any, call_id: int, me: int) -> None:
    if os.getpid() == me:
        conn.send(CallBegan(call_id))


def _end_forked_child(rank: int, parent: int, label: str) -> None:
    """A child the call's code forked ran on to the end of the call: it must not answer the
    kernel in the rank's place (its values would be taken for the call's).  It ends here."""
    line = (
        f"[air_magic] rank {rank}: process {os.getpid()}, forked by {label} (os.fork()), ran on to the end of "
        f"it; it ends here: only the rank itself (process {parent}) answers the kernel.\n"
    )
    try:
        os.write(2, line.encode())
    except OSError:
        pass
    os._exit(0)


def _status(record: Record) -> str:
    """The MLflow status of a call's child run, from this rank's record."""
    if isinstance(record, ErrorRecord):
        return "KILLED" if record.type_name == "KeyboardInterrupt" else "FAILED"
    return "FINISHED"


def _handle(
    main: types.ModuleType,
    message: PoolRequest,
    error_record: Callable[[BaseException, dict[str, tuple[str, str]]], ErrorRecord],
    began: Callable[[], None] = lambda: None,
) -> Record:
    """Run one message of the kernel.  ``began`` tells the kernel that a SIGINT raises now:
    it interrupts a rank only after that (one sent before would find the rank idle, and be
    ignored: a rank the machine had not scheduled yet when the call was cancelled)."""
    kind, _id, data = message.kind, message.id, message.data
    namespace = main.__dict__
    _take_kernel_state(data)
    _sources.update(data.get("sources", {}))
    # Every cell the pool ran so far: a function an earlier cell defined is named by its cell
    # ("Cell In[3]") in a traceback, as the notebook names it.
    sources: dict[str, tuple[str, str]] = dict(_sources)
    for filename, (_display, source) in data.get("sources", {}).items():
        lines = source.splitlines(keepends=True)
        linecache.cache[filename] = (len(source), None, lines, filename)
    _debugger.remember_sources(sources)  # a breakpoint names the cell as the notebook does
    _debugger.reset()
    if kind != "debug":  # the last call's exception, kept for %distributed_debug until the next call
        _debugger.last_error["exc"] = None
    try:
        if kind == "settle":  # after an interrupt: put back what it left half-way; what is compared
            return ValueRecord({"repaired": _state.repair(namespace), "names": _state.fingerprint(namespace)})
        if kind == "sync":  # pool.sync: names copied from one rank to the others
            try:
                return ValueRecord(_state.sync(namespace, list(data["names"]), int(data["src"])))
            except _state.SyncError as exc:  # (refused on every rank alike, before any collective)
                return ValueRecord({"refused": str(exc)})
        if kind == "regroup":  # the group's connections were cut (a hang's way out): fresh ones
            from air_magic.rank.pool.interrupts import regroup

            return ValueRecord(regroup.rebuild(data["round"]))
        _safe_point.install(_id)  # SIGINT raises, at a point the rank's training can go on from
        try:
            began()
            if kind == "cell":
                # What a script's argparse/hydra/click parser reads: the cell's name, then the
                # arguments after `--` on this cell's %%distributed line.
                sys.argv[:] = list(data.get("argv") or sys.argv[:1])
                for name, blob in data["names"].items():
                    _set_captured(namespace, name, _load(blob, f"the captured name {name!r}"))
                exec(data["code"], namespace)
                value = namespace.pop(RESULT_NAME, None)
            elif kind == "call":
                func = _load(data["func"], "the function")
                args = [_load(blob, f"argument {i}") for i, blob in enumerate(data["args"])]
                kwargs = {key: _load(blob, f"keyword argument {key}") for key, blob in data["kwargs"].items()}
                func = _in_namespace(func, namespace)
                value = func(*args, **kwargs)
            elif kind == "push":
                for name, blob in data["names"].items():
                    namespace[name] = _load(blob, f"the pushed name {name!r}")
                    _captured.pop(name, None)  # pushed: the ranks' own from now on
                value = None
            elif kind == "debug":  # %distributed_debug: the post-mortem of the last call's exception
                value = _post_mortem_here(data)
            elif kind == "pull":
                name = data["name"]
                wanted = data.get("ranks")
                if wanted is not None and int(os.environ.get("RANK", "0")) not in wanted:
                    return ValueRecord(None)  # another rank's value was asked for
                if name not in namespace:
                    raise NameError(f"name {name!r} is not defined on this rank")
                value = namespace[name]
            elif kind == "model":  # pool.state_dict / model / save: air_magic.rank.pool.model_back
                from air_magic.rank.pool import model_back

                value = model_back.handle(namespace, data)
            else:
                raise ValueError(f"unknown pool message {kind!r}")
        finally:
            _safe_point.uninstall()
        return ValueRecord(value)
    except SystemExit as exc:
        return ValueRecord(None) if exc.code in (None, 0) else error_record(exc, sources)
    except BaseException as exc:  # the user's code: KeyboardInterrupt included, is the cell's outcome
        if _debugger.wants_post_mortem(exc):
            if data.get("postmortem"):  # the kernel's %pdb is on: pdb in this rank's frames first
                _debugger.post_mortem(exc)
            _debugger.last_error["exc"] = exc
        return error_record(exc, sources)


#: The cells (and a call's functions' files) of every call so far: file name -> (the name the
#: notebook shows, its source).
_sources: dict[str, tuple[str, str]] = {}


def _post_mortem_here(data: dict[str, Any]) -> bool:
    """The rank ``data["rank"]`` opens the post-mortem of its last call's exception, then lets
    it go (a traceback holds every frame's tensors); True where there was one."""
    if int(os.environ.get("RANK", "0")) != data["rank"]:
        return False
    exc, _debugger.last_error["exc"] = _debugger.last_error["exc"], None
    if exc is None:
        return False
    _debugger.post_mortem(exc)
    del exc
    return True


#: What air_magic gave this rank's environment (its place in the launch, the rendezvous, the
#: launch's MLflow spool): a change of the same name in the kernel does not reach the rank.
_OWN_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "NODE_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCAL_SIZE",
        "CROSS_RANK",
        "CROSS_SIZE",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_RUN_ID",
    }
)
_OWN_ENV_PREFIXES = ("TORCHELASTIC_", "AIR_MAGIC_")


def _take_kernel_state(data: dict[str, Any]) -> None:
    """The kernel's working directory, and its ``sys.path`` and environment where they changed
    since the last call (the rank's own changes of other names stay)."""
    env = data.get("env")
    if env is not None:
        changed, removed = env
        for key in removed:
            if key not in _OWN_ENV and not key.startswith(_OWN_ENV_PREFIXES):
                os.environ.pop(key, None)
        for key, value in changed.items():
            if key not in _OWN_ENV and not key.startswith(_OWN_ENV_PREFIXES):
                os.environ[key] = value
        threads = changed.get("OMP_NUM_THREADS", "")
        torch = sys.modules.get("torch")
        if threads.isdigit() and int(threads) > 0 and torch is not None:
            torch.set_num_threads(min(int(threads), 4 * (os.cpu_count() or 1)))
    if data.get("sys_path") is not None:
        sys.path[:] = data["sys_path"]
    cwd = data.get("cwd")
    if cwd:
        try:
            if os.getcwd() != cwd:
                os.chdir(cwd)
        except OSError:  # (the kernel found it a moment ago: the machines differ, a Ray node)
            pass


#: Names of the namespace that hold a value sent from the kernel (captured by a cell or with a
#: function), with that value: the kernel sends such a name again at each cell, so that a
#: notebook value changed since reaches the ranks.  A name the ranks' code rebinds, or that
#: ``push`` sets, is the ranks' own from then on, and the kernel's is no longer sent.
_captured: dict[str, Any] = {}


def _set_captured(namespace: dict[str, Any], name: str, value: Any) -> None:
    namespace[name] = value
    _captured[name] = value


def _owned(namespace: dict[str, Any]) -> list[str]:
    """The names the ranks' own code assigned (or ``push`` set), sorted."""
    owned = []
    for name, value in namespace.items():
        if name.startswith("__"):
            continue
        if name in _captured:
            if _captured[name] is value:
                continue  # still the kernel's value
            del _captured[name]  # rebound by the rank's code: its own now
        owned.append(name)
    for name in [n for n in _captured if n not in namespace]:  # deleted by the rank's code
        del _captured[name]
    return sorted(owned)


def _in_namespace(func: Any, namespace: dict[str, Any]) -> Any:
    """A notebook function (sent by value) made to live in the rank's namespace: it reads
    what earlier cells and ``push`` left there, and its ``global`` statements write there.
    The names it was sent with are set, but for names the ranks' own code assigned."""
    if not isinstance(func, types.FunctionType) or func.__module__ != "__main__" or func.__globals__ is namespace:
        return func
    owned = set(_owned(namespace))
    for key, item in func.__globals__.items():
        if not key.startswith("__") and key not in owned:
            _set_captured(namespace, key, item)
    moved = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
    moved.__kwdefaults__ = func.__kwdefaults__
    moved.__dict__.update(func.__dict__)
    moved.__qualname__ = func.__qualname__
    return moved


def _load(blob: bytes, what: str) -> Any:
    try:
        return cloudpickle.loads(blob)
    except Exception as exc:
        exc.add_note(f"[air_magic] while loading {what}, sent from the kernel, on this rank")
        raise


def _join_the_group(device: str) -> None:
    """The default process group, once: gloo on CPU ranks; NCCL on GPUs with the rank's
    device bound (``device_id``), so that NCCL's set-up is paid now, not in the first cell."""
    import torch
    import torch.distributed as dist

    if device == "cuda" and torch.cuda.is_available():
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=local)
    else:
        dist.init_process_group("gloo")
    dist.barrier()  # every rank is in (NCCL's communicator made): the first cell finds the group ready
    if dist.get_backend() == "gloo":  # what a hang's way out cuts (air_magic.rank.pool.interrupts.regroup)
        from air_magic.rank.pool.interrupts import regroup

        regroup.note_links()
        regroup.watch_new_groups()  # (the groups of the user's code, DeepSpeed's, a DeviceMesh's)


def _keep_the_group() -> None:
    """``init_process_group()`` returns at once on a pool; ``destroy_process_group()`` of the
    default group leaves it alive (the pool owns it).  Other groups behave as always."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    real_init = c10d.init_process_group
    real_destroy = c10d.destroy_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            _take_what_can_be(real_init, args, kwargs)
            return None
        return real_init(*args, **kwargs)

    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is c10d.GroupMember.WORLD:
            return None
        return real_destroy(group)

    for target in (dist, c10d):
        target.init_process_group = init_process_group  # type: ignore[attr-defined]
        target.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]


#: What the pool already said of an ``init_process_group`` argument it cannot take.
_said: set[str] = set()


def _take_what_can_be(real_init: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """What the user's ``init_process_group(...)`` asks of the pool's group: its ``timeout``
    becomes the group's collective timeout; a ``backend`` or ``device_id`` other than the
    group's is said once (on rank 0, whose lines the cell shows), not dropped silently."""
    import inspect

    import torch.distributed as dist

    try:
        asked = inspect.signature(real_init).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return
    timeout = asked.get("timeout")
    if timeout is not None:
        from air_magic.rank.pool.interrupts import regroup

        regroup.set_timeout(timeout)
    have = str(dist.get_backend())
    notes = []
    backend = asked.get("backend")
    if backend is not None and str(backend).lower() not in (have, f"cpu:{have}", f"cuda:{have}"):
        notes.append(f"backend={str(backend)!r}")
    device = asked.get("device_id")
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    if device is not None and str(device) != str(bound):
        notes.append(f"device_id={device!r}")
    for note in notes:
        if note in _said:
            continue
        _said.add(note)
        if int(os.environ.get("RANK", "0")) == 0:
            sys.stderr.write(
                f"[air_magic] init_process_group({note}) is not taken on a pool: its ranks joined their {have} "
                "group when the pool started (%distributed_pool --restart with other options makes another).\n"
            )
