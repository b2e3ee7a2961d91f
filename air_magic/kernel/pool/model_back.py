"""The model back, kernel side: a pool's module as one full state dict in the kernel, as a
module, or as safetensors files, with no process group and no CUDA here (the rank side is
:mod:`air_magic.rank.pool.model_back`)::

    state_dict(engine, "model")
      1. ask every rank for its plan ("model", plan)  ->  per key: full shape, dtype, each
         rank's box; the kernel checks the boxes cover every element, and that the bytes fit
         the kernel's free memory (else: how large, and pool.save)
      2. one area of the full size, in parts of >= 64 MiB (whole keys each): files of the
         launch's /dev/shm folder where it has room, else memfds of the kernel's (ranks open
         /proc/<kernel>/fd/<n>), else files of the launch's private folder
      3. ("model", write, {key: (part, offset)})  ->  each rank writes its parts in place,
         starting at a part of its own (a file takes one writer at a time); its bytes are
         allocated as written (pwrite) or reserved first: a full folder is ENOSPC, never SIGBUS
      4. the kernel maps the parts: each key a view of one (one copy of the model, no second)

    save(engine, "model", folder): the same, the area being the safetensors files themselves
    (headers written here, :mod:`air_magic.data.weights`): the kernel never holds the bytes.
"""

from __future__ import annotations

import errno
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import psutil

from air_magic.data import weights as _weights
from air_magic.errors import AirMagicError
from air_magic.rank.results import aligned

if TYPE_CHECKING:
    from air_magic.kernel.pool.engine import PoolEngine

__all__ = ["ModelBackError", "state_dict", "model", "save", "Area", "parts"]

#: Free memory the kernel keeps besides the model (its own work, the front end's).
HEADROOM = 256 << 20

#: The least bytes of one part of the area (:func:`parts`).
PART_BYTES = 64 << 20


class ModelBackError(AirMagicError, ValueError):
    """A model that cannot come back as asked (the message says why, and what to do)."""


@dataclass
class Layout:
    """The keys of a module's state dict: full shape and dtype (as it comes back), rank 0's
    non-tensor entries, the buffers a state dict leaves out, and the keys of tied weights
    (``aliases``: a second key of one Parameter names its first; it comes back as the same tensor)."""

    shapes: dict[str, list[int]]
    dtypes: dict[str, str]
    objects: dict[str, Any]
    buffers: dict[str, Any]
    aliases: dict[str, str]

    def nbytes(self, key: str) -> int:
        return _nbytes(self.shapes[key], self.dtypes[key])

    @property
    def total(self) -> int:
        """The bytes of the area: each tied weight once."""
        return sum(self.nbytes(key) for key in self.shapes if key not in self.aliases)


def _nbytes(shape: list[int], dtype: str) -> int:
    import torch

    numel = 1
    for dim in shape:
        numel *= dim
    return numel * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    import torch

    name = str(dtype).removeprefix("torch.")
    if not isinstance(getattr(torch, name, None), torch.dtype) or not getattr(torch, name).is_floating_point:
        raise ModelBackError(f"dtype= is a floating-point torch dtype (torch.bfloat16, 'float16'...), not {dtype!r}")
    return name


def layout(plans: list[dict[str, Any]], name: str, dtype: str | None) -> Layout:
    """Every rank's plan merged; an error where the ranks disagree on a key or leave part of
    a tensor unwritten."""
    import torch

    first = plans[0]
    shapes: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    for key, part in first["keys"].items():
        shapes[key] = list(part["shape"])
        own = part["dtype"]
        dtypes[key] = dtype if dtype and getattr(torch, own).is_floating_point else own
    for rank, plan in enumerate(plans[1:], start=1):
        if set(plan["keys"]) != set(first["keys"]):
            missing = sorted(set(first["keys"]) - set(plan["keys"]))[:5]
            extra = sorted(set(plan["keys"]) - set(first["keys"]))[:5]
            raise ModelBackError(
                f"{name!r} differs between rank 0 and rank {rank}: keys only on rank 0 {missing}, only on rank "
                f"{rank} {extra}"
            )
    for key in shapes:
        numel = 1
        for dim in shapes[key]:
            numel *= dim
        covered = 0
        for plan in plans:
            box = plan["keys"][key]["box"]
            if box is not None:
                count = 1
                for size in box[1]:
                    count *= size
                covered += count
        if covered != numel:
            raise ModelBackError(
                f"{name!r}: the ranks hold {covered} of the {numel} elements of {key!r} (shape {shapes[key]}); "
                "a tensor sharded over ranks outside the pool, or replicated shards, cannot be put together"
            )
    return Layout(shapes, dtypes, first["objects"], first["buffers"], dict(first.get("aliases") or {}))


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def check_fits(nbytes: int, name: str) -> None:
    """An error, before anything is copied, when ``nbytes`` would not fit the kernel's free memory."""
    free = psutil.virtual_memory().available
    if nbytes + HEADROOM > free:
        raise ModelBackError(
            f"{name!r}'s state dict is {_size(nbytes)} and this machine has {_size(free)} of memory free: it would not "
            f"fit in the kernel. Write it from the ranks instead: pool.save({name!r}, folder) (safetensors files the "
            "kernel never holds), or ask for a smaller dtype (dtype=torch.bfloat16)."
        )


class Area:
    """The files the ranks write into and the kernel maps, one per part (``sizes``: each part's
    bytes), of one ``kind``: ``"shm"`` (files of ``shm_dir``, where statvfs says it has room),
    ``"memfd"`` (not bounded by /dev/shm's size) or ``"file"`` (in ``fallback_dir``).  The kernel
    only sizes them (``ftruncate``); each rank reserves the bytes it writes
    (:func:`air_magic.rank.pool.model_back.write`).  Several parts rather than one file: a file takes
    one writer at a time (its inode's lock), so ranks that write different parts at once write
    in parallel."""

    def __init__(self, sizes: list[int], kind: str, shm_dir: str | None, fallback_dir: str) -> None:
        self.sizes = sizes
        self.kind = kind
        self._fds: list[int] = []
        self._paths: list[str] = []
        try:
            for size in sizes:
                if kind == "memfd":
                    self._fds.append(os.memfd_create("air_magic-model", 0))
                    os.ftruncate(self._fds[-1], size)
                    continue
                folder = shm_dir if kind == "shm" else fallback_dir
                assert folder is not None
                fd, path = tempfile.mkstemp(prefix="model-", dir=folder)
                self._paths.append(path)
                try:
                    os.ftruncate(fd, size)
                finally:
                    os.close(fd)
        except BaseException:  # nothing left behind; re-raised
            self.close()
            raise

    @classmethod
    def kinds(cls, size: int, shm_dir: str | None) -> list[str]:
        """The kinds worth trying for ``size`` bytes in all, in order."""
        kinds = ["shm"] if shm_dir and _room(shm_dir) >= size else []
        if hasattr(os, "memfd_create"):
            kinds.append("memfd")
        return kinds + ["file"]

    @property
    def paths_for_ranks(self) -> list[str]:
        """The path of each part, as a rank of this machine opens it."""
        if self.kind == "memfd":
            return [f"/proc/{os.getpid()}/fd/{fd}" for fd in self._fds]
        return list(self._paths)

    def map(self) -> list[Any]:
        """Each part as one uint8 tensor; the files are gone (unlinked, or their fds closed) after."""
        import torch

        paths = [f"/proc/self/fd/{fd}" for fd in self._fds] if self.kind == "memfd" else self._paths
        try:
            return [
                torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                if size
                else torch.empty(0, dtype=torch.uint8)
                for path, size in zip(paths, self.sizes)
            ]
        finally:
            self.close()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths = []


def _no_room(exc: BaseException) -> bool:
    return getattr(exc, "errno", None) in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG) or "No space left" in str(exc)


def _room(folder: str) -> int:
    try:
        stat = os.statvfs(folder)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


def _plans(engine: "PoolEngine", name: str, what: str) -> list[dict[str, Any]]:
    if not isinstance(name, str) or not name.isidentifier():
        raise ModelBackError(f"{what} takes the name a module is bound to in the ranks (a string), not {name!r}")
    plans = engine.ask("model", {"op": "plan", "name": name}, f"{what}")  # (starts the pool if need be)
    launch = engine.launch
    if launch is None or not launch.local_processes:
        raise ModelBackError(
            f"{what} needs the pool's ranks on this machine (backend='local'); on Ray, save from the ranks "
            "(air_magic.data.save_training_state) and open it with air_magic.data.open_checkpoint"
        )
    return plans


def state_dict(engine: "PoolEngine", name: str, dtype: Any = None) -> dict[str, Any]:
    """One full CPU state dict of the module bound to ``name`` in the ranks."""
    wanted = _dtype_name(dtype)
    plans = _plans(engine, name, f"pool.state_dict({name!r})")
    lay = layout(plans, name, wanted)
    tensors = _fill(engine, name, lay, wanted)
    out: dict[str, Any] = {}
    for key in plans[0]["order"]:
        out[key] = tensors[key] if key in tensors else lay.objects[key]
    return out


def parts(lay: Layout) -> tuple[list[int], dict[str, tuple[int, int]]]:
    """The area's parts: consecutive keys, each part :data:`PART_BYTES` or more (a larger key a
    part of its own); each part's size, and each key's place (part, byte offset)."""
    sizes = [0]
    places: dict[str, tuple[int, int]] = {}
    for key in lay.shapes:
        if key in lay.aliases:
            continue
        if sizes[-1] >= PART_BYTES:
            sizes.append(0)
        at = aligned(sizes[-1])
        places[key] = (len(sizes) - 1, at)
        sizes[-1] = at + lay.nbytes(key)
    return sizes, places


def _fill(engine: "PoolEngine", name: str, lay: Layout, dtype: str | None) -> dict[str, Any]:
    import torch

    check_fits(lay.total, name)
    sizes, where = parts(lay)
    launch = engine.launch
    assert launch is not None
    kinds = Area.kinds(sum(sizes), launch.shm_dir)
    mapped = None
    for kind in kinds:
        area = Area(sizes, kind, launch.shm_dir, launch.work_dir)
        try:
            paths = area.paths_for_ranks
            places = {key: (paths[part], offset) for key, (part, offset) in where.items()}
            message = {"op": "write", "name": name, "places": places, "dtype": dtype}
            engine.ask("model", message, f"pool.state_dict({name!r})")
            mapped = area.map()
            break
        except OSError as exc:  # a rank found no room (ENOSPC, ENOMEM): the next kind of area
            if kind == kinds[-1] or not _no_room(exc):
                raise
        finally:
            area.close()
    assert mapped is not None
    tensors = {}
    for key, (part, offset) in where.items():
        dt = getattr(torch, lay.dtypes[key])
        tensors[key] = mapped[part][offset : offset + lay.nbytes(key)].view(dt).view(lay.shapes[key])
    for key, first in lay.aliases.items():  # a tied weight: the same tensor, as torch's state_dict gives it
        tensors[key] = tensors[first]
    return tensors


def model(engine: "PoolEngine", name: str, factory: Callable[[], Any], dtype: Any = None) -> Any:
    """``factory()`` built on the meta device, its keys checked against the ranks' module
    before anything is copied, then filled with the ranks' weights (``assign=True``: the module's
    tensors are the state dict's, no second copy)."""
    import torch

    if not callable(factory):
        raise ModelBackError(
            f"pool.model({name!r}, factory): factory builds the module (a class or function), not {factory!r}"
        )
    wanted = _dtype_name(dtype)
    plans = _plans(engine, name, f"pool.model({name!r})")
    lay = layout(plans, name, wanted)
    with torch.device("meta"):
        module = factory()
    if not isinstance(module, torch.nn.Module):
        raise ModelBackError(
            f"pool.model({name!r}, factory): factory() made a {type(module).__name__}, not a torch.nn.Module"
        )
    expected = set(module.state_dict().keys())
    have = set(lay.shapes) | set(lay.objects)
    if expected != have:
        missing = sorted(expected - have)
        unexpected = sorted(have - expected)
        raise ModelBackError(
            f"pool.model({name!r}, factory): the module factory() builds does not match the ranks' {name!r}. "
            f"Keys the factory's module has and the ranks' does not (missing): {_few(missing)}; keys the ranks' "
            f"module has and the factory's does not (unexpected): {_few(unexpected)}."
        )
    own = module.state_dict()
    for key in lay.shapes:
        if list(own[key].shape) != lay.shapes[key]:
            raise ModelBackError(
                f"pool.model({name!r}, factory): {key!r} is {lay.shapes[key]} in the ranks and {list(own[key].shape)} "
                "in the factory's module"
            )
    tensors = _fill(engine, name, lay, wanted)
    state = {key: tensors.get(key, lay.objects.get(key)) for key in own}
    ties = _ties(module)
    module.load_state_dict(state, assign=True)
    for alias, first in ties:  # assign=True made a Parameter per key: the factory's ties again
        _set_parameter(module, alias, module.get_parameter(first))
    for buffer_name, value in lay.buffers.items():  # buffers no state dict holds (persistent=False)
        owner_name, _, attr = buffer_name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if attr in owner._buffers:
            owner._buffers[attr] = (
                value if wanted is None or not value.is_floating_point() else value.to(getattr(torch, wanted))
            )
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise ModelBackError(f"pool.model({name!r}, factory): {_few(left)} stayed on the meta device")
    return module.eval()


def _ties(module: Any) -> list[tuple[str, str]]:
    """``(name, first name)`` of each parameter that is another's (tied weights: one Parameter)."""
    first: dict[int, str] = {}
    ties = []
    for param_name, param in module.named_parameters(remove_duplicate=False):
        seen = first.setdefault(id(param), param_name)
        if seen != param_name:
            ties.append((param_name, seen))
    return ties


def _set_parameter(module: Any, name: str, param: Any) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._parameters[attr] = param


def _few(keys: list[str]) -> str:
    if not keys:
        return "none"
    shown = ", ".join(repr(k) for k in keys[:8])
    return shown + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")


def save(
    engine: "PoolEngine",
    name: str,
    folder: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    dtype: Any = None,
) -> list[str]:
    """The module bound to ``name`` written by the ranks themselves into safetensors files in
    ``folder`` (the kernel writes the headers only, and never holds the weights)."""
    wanted = _dtype_name(dtype)
    plans = _plans(engine, name, f"pool.save({name!r})")
    lay = layout(plans, name, wanted)
    if lay.objects:
        raise ModelBackError(
            f"pool.save({name!r}): safetensors holds tensors only, and the state dict also has {_few(sorted(lay.objects))}"
        )
    files = _weights.plan_files({key: (lay.shapes[key], lay.dtypes[key]) for key in lay.shapes}, max_shard_size)
    paths = _weights.create_files(os.fspath(folder), files)  # (temporary: renamed once whole)
    try:
        places = {}
        for plan, path in zip(files, paths):
            for key, offset in plan.offsets.items():
                places[key] = (os.path.abspath(path), plan.data_start + offset)
        engine.ask("model", {"op": "write", "name": name, "places": places, "dtype": wanted}, f"pool.save({name!r})")
        return _weights.commit_files(os.fspath(folder), files, paths)
    except BaseException:
        _weights.discard_files(paths)
        raise
