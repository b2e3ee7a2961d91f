"""How a rank's return value (or exception) gets back to the kernel.

Each rank writes one record to ``result-<rank>.pkl`` in the launch's work folder
(written to a temporary name, then renamed into place, so the kernel never reads a
half-written file):

* :class:`~air_magic.protocol.ValueRecord`: the function's return value / the cell's
  last expression;
* :class:`~air_magic.protocol.ErrorRecord`: the exception (pickled when it can be),
  its type's name, message and traceback, and when it was caught;
* :class:`~air_magic.protocol.UnpicklableRecord`: a value that cannot travel.

Large CPU tensors in a return value do not travel inside the pickle: their bytes
are copied once into a file of their own (named ``r<rank>-<n>``) under ``/dev/shm``,
and the pickle holds that name only.  The kernel finds the file among the launch's
folders (:func:`read_record`), maps it (``torch.from_file(shared=True)``) and unlinks
it at once, so the tensor arrives without a second copy and nothing stays behind in
``/dev/shm``.  A CPU tensor's bytes are written with ``pwrite`` (pages allocated as they are
written, none zeroed first), a CUDA tensor's copied into a mapping after its bytes are reserved
(``posix_fallocate``): where ``/dev/shm`` is too small (Docker's 64 MB), the write fails with
``ENOSPC`` and the tensor goes to a file in the launch's private folder instead, rather than the
rank dying of SIGBUS while it writes.
CUDA tensors arrive as CPU tensors: the kernel never touches CUDA.  A DTensor (FSDP2, tensor
parallel) travels as the rank's shard and its place; the kernel puts the full tensor together
from every rank's record, once (each rank's entry is that one tensor).

A rank on another machine (the Ray backend) writes its files the same way into folders
of its node; its agent hands each file's bytes to Ray as a raw buffer, next to the small
record, and the kernel writes them under the same names into the launch's own folders
(:func:`place_tensor_file`), where :func:`read_record` finds them as it finds a local
rank's::

    rank:   write_record --> result-<r>.pkl (names) + r<r>-0, r<r>-1 ... (bytes)
    kernel: read_record(folders) --> each name's file mapped, then unlinked
"""

from __future__ import annotations

import errno
import functools
import io
import os
import pickle
import re
import sys
from typing import IO, Any, Callable, Iterable

import cloudpickle

from air_magic.protocol import Record, result_path
from air_magic.rank.writing import pwrite_all

__all__ = ["SHM_THRESHOLD", "result_path", "write_record", "read_record", "rebuild_shared_tensor"]
__all__ += [
    "rank_prefix",
    "tensor_files",
    "place_tensor_file",
    "dumps_record",
    "loads_record",
    "assemble_piece",
    "aligned",
    "write_tensor_file",
]

#: Tensors at least this large (bytes) go through shared memory.
SHM_THRESHOLD = 1 << 20


def rank_prefix(rank: int) -> str:
    """How the names of ``rank``'s tensor files begin."""
    return f"r{rank}"


def _tensor_name(prefix: str, count: int) -> str:
    return f"{prefix}-{count}"


def tensor_files(folders: Iterable[str | None], prefix: str) -> dict[str, str]:
    """``{name: path}`` of the tensor files a rank whose ``prefix`` is ``prefix`` (``r<rank>``)
    wrote into ``folders``."""
    pattern = re.compile(re.escape(prefix) + r"-\d+")
    found: dict[str, str] = {}
    for folder in folders:
        if folder is None:
            continue
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        for name in names:
            if pattern.fullmatch(name):
                found.setdefault(name, os.path.join(folder, name))
    return found


def _new_file(name: str, size: int, folders: Iterable[str | None], fill: Callable[[int], None]) -> str:
    """A new file ``name`` of ``size`` bytes, written by ``fill(fd)``, in the first of ``folders``
    with room (a later one where ``fill`` finds an earlier one full; an error in the last one, a
    full disk, is raised as such); its path.  A half-written file is not left behind."""
    candidates = [folder for folder in folders if folder is not None]
    for index, folder in enumerate(candidates):
        path = os.path.join(folder, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            fill(fd)
            return path
        except BaseException as exc:  # re-raised, but where a later folder may have room
            os.unlink(path)
            if getattr(exc, "errno", None) != errno.ENOSPC or index == len(candidates) - 1:
                raise
        finally:
            os.close(fd)
    raise OSError(errno.ENOSPC, f"no room for a {size}-byte result tensor")


def place_tensor_file(name: str, data: Any, folders: Iterable[str | None]) -> str:
    """Write ``data`` (a buffer: a rank's tensor file as it came from another machine) to a
    new file ``name`` in the first of ``folders`` with room (its bytes reserved first); its path."""
    view = memoryview(data).cast("B")

    def fill(fd: int) -> None:
        if view.nbytes:
            os.posix_fallocate(fd, 0, view.nbytes)
        pwrite_all(fd, view, 0)

    return _new_file(name, view.nbytes, folders, fill)


def write_tensor_file(name: str, size: int, places: list[tuple[Any, int]], folders: Iterable[str | None]) -> str:
    """A new file ``name`` of ``size`` bytes holding each ``(tensor, offset)`` of ``places``, in
    the first of ``folders`` with room; its path.  A contiguous CPU tensor is one
    :func:`~air_magic.rank.writing.pwrite_all` from its memory; another (CUDA, strided) is copied into a mapping of the
    file after its bytes are reserved (``posix_fallocate``)."""
    return _new_file(name, size, folders, lambda fd: _copy_places(fd, size, places))


def _copy_places(fd: int, size: int, places: list[tuple[Any, int]]) -> None:
    import mmap
    import warnings

    import torch

    area = None
    for source, offset in places:
        nbytes = source.numel() * source.element_size()
        if source.device.type == "cpu" and source.is_contiguous():
            pwrite_all(fd, source.reshape(-1).view(torch.uint8).numpy(), offset)
            continue
        os.posix_fallocate(fd, offset, nbytes)
        if area is None:
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            with warnings.catch_warnings():  # "non-writable buffer": it is writable
                warnings.simplefilter("ignore", UserWarning)
                area = torch.frombuffer(mapped, dtype=torch.uint8)
        area[offset : offset + nbytes].view(source.dtype).view(source.shape).copy_(source)


def aligned(offset: int) -> int:
    """``offset`` rounded up to 64 bytes: where a tensor of a shared file may start."""
    return (offset + 63) // 64 * 64


class _ResultPickler(cloudpickle.Pickler):  # type: ignore[misc]
    """Pickles a record; each large CPU or CUDA tensor becomes a place in one file of the
    record's (its name, offset, dtype and shape), whose bytes :meth:`write_tensors` copies
    once, after the pickle is made (so the file's size is known first)."""

    def __init__(self, file: IO[bytes], shm_dir: str | None, prefix: str, fallback_dir: str | None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._shm_dir = shm_dir
        self._fallback_dir = fallback_dir
        self._name = _tensor_name(prefix, 0)
        self._places: list[tuple[Any, int]] = []
        self._size = 0
        self._pieces = 0
        self.shm_paths: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is not None and type(obj).__name__ == "DTensor" and hasattr(obj, "placements"):
            return self._dtensor_piece(obj)
        if (
            self._shm_dir is not None
            and torch is not None
            and type(obj) is torch.Tensor
            and obj.layout == torch.strided
            and not obj.is_quantized
            and obj.numel() > 0
            and obj.element_size() * obj.numel() >= SHM_THRESHOLD
        ):
            source = obj.detach()
            offset = aligned(self._size)
            self._places.append((source, offset))
            self._size = offset + source.numel() * source.element_size()
            # The name and place only: the kernel finds the file among its launch's folders.
            return rebuild_shared_tensor, (self._name, source.dtype, tuple(source.shape), obj.requires_grad, offset)
        return super().reducer_override(obj)

    def _dtensor_piece(self, dtensor: Any) -> Any:
        """A DTensor travels as this rank's shard and where it goes in the full tensor: the
        kernel puts the full tensor together from every rank's record (:func:`assemble_piece`)."""
        from air_magic.rank.pool.model_back import _part

        part = _part(dtensor, int(os.environ.get("RANK", "0")))
        index = self._pieces
        self._pieces += 1
        local = dtensor.to_local().detach() if part["box"] is not None else None
        if local is not None and local.device.type != "cpu" and self._shm_dir is None:
            local = local.cpu()
        return assemble_piece, (index, dtensor.dtype, tuple(dtensor.shape), part["box"], local)

    def write_tensors(self) -> None:
        """Copy the tensors to their places: in shared memory if it has room, else in the
        private folder (CUDA tensors straight from the device)."""
        if not self._places:
            return
        path = write_tensor_file(self._name, self._size, self._places, (self._shm_dir, self._fallback_dir))
        self.shm_paths.append(path)
        self._places.clear()


def rebuild_shared_tensor(
    name: str,
    dtype: Any,
    shape: tuple[int, ...],
    requires_grad: bool,
    offset: int = 0,
    folders: tuple[str | None, ...] = (),
    mapped: dict[str, Any] | None = None,
) -> Any:
    """The tensor at ``offset`` of the file ``name`` a rank wrote (found in the first of
    ``folders`` that has it).  The file is mapped once (kept in ``mapped`` for the record's
    other tensors) and unlinked at once: the mapping stays valid, nothing stays behind."""
    import torch

    area = mapped.get(name) if mapped is not None else None
    if area is None:
        found = next((path for path in _candidates(name, folders) if os.path.exists(path)), None)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, f"the file of a result tensor is missing ({name})")
        try:
            area = torch.from_file(found, shared=True, size=os.path.getsize(found), dtype=torch.uint8)
        finally:
            try:
                os.unlink(found)
            except FileNotFoundError:
                pass
        if mapped is not None:
            mapped[name] = area
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    tensor = area[offset : offset + nbytes].view(dtype).view(shape)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def assemble_piece(
    index: int, dtype: Any, shape: tuple[int, ...], box: Any, local: Any, assembled: dict[int, Any] | None = None
) -> Any:
    """The full tensor of the ``index``-th DTensor of the ranks' records, this rank's shard
    copied into its ``box`` (offsets, sizes).  ``assembled`` is shared by the records of every
    rank of one launch (or one pool call): each rank's entry is the same tensor, held once."""
    import torch

    full = assembled.get(index) if assembled is not None else None
    if full is None:
        full = torch.zeros(shape, dtype=dtype)
        if assembled is not None:
            assembled[index] = full
    if box is not None and local is not None and local.numel():
        view = full
        for dim, (start, size) in enumerate(zip(*box)):
            view = view.narrow(dim, start, size)
        view.copy_(local.reshape(view.shape))
    return full


def _candidates(name: str, folders: tuple[str | None, ...]) -> list[str]:
    if os.path.basename(name) != name:  # a file name, never a path
        return []
    return [os.path.join(folder, name) for folder in folders if folder is not None]


class _RecordUnpickler(pickle.Unpickler):
    """Loads a record, its tensors' file found in ``folders``."""

    def __init__(self, file: IO[bytes], folders: tuple[str | None, ...], assembled: dict[int, Any] | None) -> None:
        super().__init__(file)
        self._folders = folders
        self._mapped: dict[str, Any] = {}
        self._assembled = assembled

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == rebuild_shared_tensor.__name__:
            return functools.partial(rebuild_shared_tensor, folders=self._folders, mapped=self._mapped)
        if module == __name__ and name == assemble_piece.__name__:
            return functools.partial(assemble_piece, assembled=self._assembled)
        return super().find_class(module, name)


def _dump(pickler: _ResultPickler, record: Record) -> None:
    try:
        pickler.dump(record)
        pickler.write_tensors()
    except BaseException:  # no tensor file of a value that cannot travel is left behind
        for leftover in pickler.shm_paths:
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        raise


def write_record(path: str, record: Record, shm_dir: str | None, prefix: str, fallback_dir: str | None = None) -> None:
    """Pickle ``record`` to ``path`` atomically; large tensors go to one file in ``shm_dir`` (or
    in ``fallback_dir`` when shared memory has no room for it), written before ``path`` appears."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as handle:
            _dump(_ResultPickler(handle, shm_dir, prefix, fallback_dir), record)
        os.replace(tmp, path)
    except BaseException:  # no half-written result is left behind; re-raised
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def dumps_record(record: Record, shm_dir: str | None, prefix: str, fallback_dir: str | None = None) -> bytes:
    """``record`` pickled to bytes (a pool rank's reply), its large tensors written to a file as
    :func:`write_record` writes them; ``prefix`` names the file (unique to the call)."""
    buffer = io.BytesIO()
    _dump(_ResultPickler(buffer, shm_dir, prefix, fallback_dir), record)
    return buffer.getvalue()


def loads_record(blob: bytes, folders: tuple[str | None, ...] = (), assembled: dict[int, Any] | None = None) -> Record:
    """The record :func:`dumps_record` made; its tensors' files are looked for in ``folders``;
    ``assembled``: the full tensors of DTensors, shared with the other ranks' records."""
    return _RecordUnpickler(io.BytesIO(blob), folders, assembled).load()  # type: ignore[no-any-return]


def read_record(path: str, folders: tuple[str | None, ...] = (), assembled: dict[int, Any] | None = None) -> Record:
    """The record at ``path``; its large tensors' files are looked for in ``folders``;
    ``assembled``: the full tensors of DTensors, shared with the other ranks' records."""
    with open(path, "rb") as handle:
        # written by our own rank, in our own private folder
        return _RecordUnpickler(handle, folders, assembled).load()  # type: ignore[no-any-return]
