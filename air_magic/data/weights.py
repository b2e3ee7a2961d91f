"""Weights in Hugging Face's safetensors format: one ``model.safetensors``, or shards and
``model.safetensors.index.json``, as ``transformers`` and ``safetensors.torch.load_file``
read them.

A safetensors file is 8 bytes (the header's length, little-endian), a JSON header (each
key's dtype, shape and ``[begin, end)`` in the data), then the tensors' bytes back to back.
:func:`plan_files` lays the keys out (largest element first, so every tensor starts at a
multiple of its element size); :func:`create_files` writes the headers and sizes the files;
the bytes are copied straight from each tensor's memory into the file, once, by the kernel
(:func:`save_safetensors`) or by the ranks that hold them (``pool.save``)::

    entries {key: (shape, dtype)} --plan_files--> [FilePlan(name, header, offsets)]
        --create_files--> temporary files beside the final ones, headers written
        --each tensor's bytes--> file at 8 + len(header) + offset (every write's count checked:
                                 a full disk is an OSError naming the file)
        --commit_files--> each fsync'ed, then renamed over its final name (an earlier file of
                          that name is replaced whole, or left untouched); discard_files on error

The ``safetensors`` package reads them back (:func:`safetensors.torch.load_file`); writing
here rather than with ``safetensors.torch.save_file`` saves a copy of every tensor into one
``bytes`` object first, and lets ranks write their shards in place.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = [
    "FilePlan",
    "plan_files",
    "create_files",
    "commit_files",
    "discard_files",
    "save_safetensors",
    "parse_size",
    "DTYPES",
]

#: torch dtype name -> safetensors dtype name.
DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
}
_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


@dataclass
class FilePlan:
    """One file: its name, its header (padded to 8 bytes) and each key's offset in the data."""

    name: str
    header: bytes
    offsets: dict[str, int]
    size: int  # of the data, bytes

    @property
    def data_start(self) -> int:
        return 8 + len(self.header)


def parse_size(size: int | str) -> int:
    """Bytes from ``5_000_000_000`` or ``"5GB"`` / ``"500MiB"`` (as transformers' max_shard_size)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, not {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*", str(size), re.IGNORECASE)
    if not match:
        raise ValueError(f"max_shard_size is bytes or a size such as '5GB' or '500MiB', not {size!r}")
    number, unit = float(match.group(1)), match.group(2).upper()
    base = 1024 if "I" in unit else 1000
    power = "KMGT".index(unit[0]) + 1
    return int(number * base**power)


def _nbytes(shape: list[int] | tuple[int, ...], dtype: str) -> int:
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel * _SIZES.get(DTYPES[dtype], 1)


def plan_files(
    entries: Mapping[str, tuple[list[int] | tuple[int, ...], str]],
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
) -> list[FilePlan]:
    """Lay ``entries`` (``{key: (shape, torch dtype name)}``) out in files of at most
    ``max_shard_size`` bytes of data each (a larger tensor gets a file of its own)."""
    limit = parse_size(max_shard_size)
    for key, (_, dtype) in entries.items():
        if dtype not in DTYPES:
            raise ValueError(f"{key!r} is a {dtype} tensor, which safetensors cannot store")
    ordered = sorted(entries, key=lambda key: (-_SIZES.get(DTYPES[entries[key][1]], 1), key))
    groups: list[list[str]] = [[]]
    filled = 0
    for key in ordered:
        size = _nbytes(*entries[key])
        if groups[-1] and filled + size > limit:
            groups.append([])
            filled = 0
        groups[-1].append(key)
        filled += size
    plans = []
    for index, keys in enumerate(groups):
        name = "model.safetensors" if len(groups) == 1 else f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
        offsets: dict[str, int] = {}
        at = 0
        for key in keys:
            shape, dtype = entries[key]
            size = _nbytes(shape, dtype)
            header[key] = {"dtype": DTYPES[dtype], "shape": [int(d) for d in shape], "data_offsets": [at, at + size]}
            offsets[key] = at
            at += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        plans.append(FilePlan(name, text, offsets, at))
    return plans


def create_files(folder: str, plans: list[FilePlan]) -> list[str]:
    """Each planned file as a temporary file beside its final name, at its full size (sparse:
    its bytes are allocated as they are written), its header written.  The temporary paths, in
    the plans' order; :func:`commit_files` gives them their names."""
    os.makedirs(folder, exist_ok=True)
    paths: list[str] = []
    try:
        for plan in plans:
            path = os.path.join(folder, f".{plan.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            paths.append(path)
            try:
                # Sized only: the bytes are written in place (a full disk is an error of that write;
                # a rank that maps a part of the file reserves that part first).
                os.ftruncate(fd, plan.data_start + plan.size)
                _pwrite_all(
                    fd, len(plan.header).to_bytes(8, "little") + plan.header, 0, os.path.join(folder, plan.name)
                )
            finally:
                os.close(fd)
    except BaseException:
        discard_files(paths)
        raise
    return paths


def commit_files(folder: str, plans: list[FilePlan], paths: list[str]) -> list[str]:
    """The temporary files written whole: each fsync'ed and renamed over its final name, the index
    written the same way where there are several; the final paths.  Until the last rename an
    earlier file of the same name is untouched."""
    final = [os.path.join(folder, plan.name) for plan in plans]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    index_tmp = None
    if len(plans) > 1:
        weight_map = {key: plan.name for plan in plans for key in plan.offsets}
        total_size = sum(plan.size for plan in plans)
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        index_tmp = os.path.join(folder, f".model.safetensors.index.json.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        text = json.dumps(index, indent=2).encode()
        fd = os.open(index_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            _pwrite_all(fd, text, 0, os.path.join(folder, "model.safetensors.index.json"))
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            discard_files([index_tmp])
            raise
        os.close(fd)
    for path, name in zip(paths, final):
        os.replace(path, name)
    if index_tmp is not None:
        os.replace(index_tmp, os.path.join(folder, "model.safetensors.index.json"))
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)  # the renames themselves
        finally:
            os.close(fd)
    except OSError:
        pass
    return final


def discard_files(paths: list[str]) -> None:
    """Temporary files of a write that did not finish, removed."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _pwrite_all(fd: int, data: Any, at: int, name: str) -> None:
    """All of ``data`` at byte ``at`` (``pwrite`` may write less: the rest is written again); a
    full disk is an ``OSError`` (ENOSPC) that names the file being saved."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        try:
            done = os.pwrite(fd, view, at)
        except OSError as exc:
            raise _naming(exc, name) from None
        if done == 0:
            raise _naming(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), name)
        view, at = view[done:], at + done


def _naming(exc: OSError, name: str) -> OSError:
    earlier = " (the earlier file of that name, if any, is untouched)" if exc.errno == errno.ENOSPC else ""
    return OSError(exc.errno, f"{exc.strerror}: writing {name}{earlier}", name)


def save_safetensors(
    state_dict: Mapping[str, Any], folder: str | os.PathLike[str], max_shard_size: int | str = "5GB"
) -> list[str]:
    """Write ``state_dict`` (tensors on any device) to ``folder`` as Hugging Face saves a model:
    ``model.safetensors``, or shards of at most ``max_shard_size`` and
    ``model.safetensors.index.json``.  Tensors that share memory are written each under its key.
    The files are written beside their names and renamed into place once whole: a full disk
    raises ``OSError`` (ENOSPC) naming the file, leaves no part of a file behind and leaves an
    earlier file of the same name untouched.  The paths of the files written."""
    import torch

    folder = os.fspath(folder)
    entries: dict[str, tuple[list[int], str]] = {}
    for key, value in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"a state dict's keys are strings; {key!r} is a {type(key).__name__}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key!r} is a {type(value).__name__}, not a tensor: safetensors holds tensors only")
        if hasattr(value, "to_local") and hasattr(value, "placements"):
            raise TypeError(
                f"{key!r} is a DTensor (one rank's shard): take the whole state dict with pool.state_dict or save it "
                "from the ranks with pool.save"
            )
        entries[key] = (list(value.shape), str(value.dtype).removeprefix("torch."))
    plans = plan_files(entries, max_shard_size)
    paths = create_files(folder, plans)
    try:
        for plan, path in zip(plans, paths):
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                for key, offset in plan.offsets.items():
                    tensor = state_dict[key].detach()
                    if tensor.device.type != "cpu":
                        tensor = tensor.cpu()
                    tensor = tensor.contiguous()
                    if tensor.numel() == 0:
                        continue
                    data = tensor.reshape(-1).view(torch.uint8).numpy()
                    _pwrite_all(fd, data, plan.data_start + offset, os.path.join(folder, plan.name))
            finally:
                os.close(fd)
        return commit_files(folder, plans, paths)
    except BaseException:
        discard_files(paths)
        raise
