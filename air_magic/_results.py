"""How a rank's return value (or exception) gets back to the kernel.

Each rank writes one record to ``result-<rank>.pkl`` in the launch's work folder
(written to a temporary name, then renamed into place, so the kernel never reads a
half-written file):

* :class:`~air_magic._protocol.ValueRecord`: the function's return value / the cell's
  last expression;
* :class:`~air_magic._protocol.ErrorRecord`: the exception (pickled when it can be),
  its type's name, message and traceback, and when it was caught;
* :class:`~air_magic._protocol.UnpicklableRecord`: a value that cannot travel.

Large CPU tensors in a return value do not travel inside the pickle: their bytes
are copied once into a file under ``/dev/shm`` and the pickle holds its name.  The
kernel maps that file (``torch.from_file(shared=True)``) and unlinks it at once, so
the tensor arrives without a second copy and nothing stays behind in ``/dev/shm``.
The file's space is reserved first (``posix_fallocate``): where ``/dev/shm`` is too
small (Docker's 64 MB), the tensor goes to a file in the launch's private folder
instead, rather than the rank dying of SIGBUS while it writes.
CUDA tensors arrive as CPU tensors: the kernel never touches CUDA.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import sys
from typing import Any

import cloudpickle

from ._protocol import Record, result_path

__all__ = ["SHM_THRESHOLD", "result_path", "write_record", "read_record", "rebuild_shared_tensor"]

#: Tensors at least this large (bytes) go through shared memory.
SHM_THRESHOLD = 1 << 20


class _ResultPickler(cloudpickle.Pickler):  # type: ignore[misc]
    def __init__(self, file: io.BufferedWriter, shm_dir: str | None, prefix: str, fallback_dir: str | None) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._shm_dir = shm_dir
        self._fallback_dir = fallback_dir
        self._prefix = prefix
        self._count = 0
        self.shm_paths: list[str] = []

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if (
            self._shm_dir is not None
            and torch is not None
            and type(obj) is torch.Tensor
            and obj.layout == torch.strided
            and not obj.is_quantized
            and obj.numel() > 0
            and obj.element_size() * obj.numel() >= SHM_THRESHOLD
        ):
            return self._to_shared_memory(torch, obj)
        return super().reducer_override(obj)

    def _reserve(self, name: str, size: int) -> str:
        """A file of ``size`` bytes whose space is really there: in shared memory if it has
        room, else in the private folder (an error there is a full disk, said as such)."""
        for directory in (self._shm_dir, self._fallback_dir):
            if directory is None:
                continue
            path = os.path.join(directory, name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            self.shm_paths.append(path)
            try:
                os.posix_fallocate(fd, 0, size)
                return path
            except OSError as exc:
                if exc.errno != errno.ENOSPC or directory == self._fallback_dir:
                    raise
                os.unlink(path)
                self.shm_paths.remove(path)
            finally:
                os.close(fd)
        raise OSError(errno.ENOSPC, f"no room for a {size}-byte result tensor")

    def _to_shared_memory(self, torch: Any, tensor: Any) -> Any:
        source = tensor.detach()
        if source.device.type != "cpu":
            source = source.cpu()
        name = f"{self._prefix}-{self._count}"
        self._count += 1
        path = self._reserve(name, source.numel() * source.element_size())
        target = torch.from_file(path, shared=True, size=source.numel(), dtype=source.dtype)
        target.copy_(source.reshape(-1))
        return rebuild_shared_tensor, (path, source.dtype, tuple(source.shape), tensor.requires_grad)


def rebuild_shared_tensor(path: str, dtype: Any, shape: tuple[int, ...], requires_grad: bool) -> Any:
    """Map a tensor written by a rank and unlink its file (the mapping stays valid)."""
    import torch

    numel = 1
    for dim in shape:
        numel *= dim
    try:
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def write_record(path: str, record: Record, shm_dir: str | None, prefix: str, fallback_dir: str | None = None) -> None:
    """Pickle ``record`` to ``path`` atomically; large tensors go to ``shm_dir`` (or to
    ``fallback_dir`` when shared memory has no room for them)."""
    tmp = f"{path}.tmp"
    pickler_paths: list[str] = []
    try:
        with open(tmp, "wb") as handle:
            pickler = _ResultPickler(handle, shm_dir, prefix, fallback_dir)
            pickler_paths = pickler.shm_paths
            pickler.dump(record)
        os.replace(tmp, path)
    except BaseException:  # no half-written result is left behind; re-raised
        for leftover in [tmp, *pickler_paths]:
            try:
                os.unlink(leftover)
            except FileNotFoundError:
                pass
        raise


def read_record(path: str) -> Record:
    with open(path, "rb") as handle:
        return pickle.load(handle)  # type: ignore[no-any-return]  # written by our own rank, in our own private folder
