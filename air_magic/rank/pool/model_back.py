"""The model back, rank side: what a module's state dict holds here, and its bytes written
straight to their place in a file the kernel made (the kernel side is
:mod:`air_magic.kernel.pool.model_back`)::

    kernel                                         rank r (a pool rank; no collective, no group)
    ------                                         ------
    ("model", id, {op: "plan", name})  ------->    plan(): the module bound to ``name``, unwrapped
                                                   (DDP, torch.compile, DeepSpeed); per key: the
                                                   full shape and dtype, and which part of it this
                                                   rank holds and writes:
                                                     a plain tensor      all of it, rank 0 only
                                                     a DTensor (FSDP2,   its local shard's box
                                                       tensor parallel)  (offsets, sizes); a shard
                                                                         replicated on a mesh
                                                                         dimension: coordinate 0
                                                     ZeRO-3 parameter    its flat partition (one
                                                                         kept whole: rank 0)
                                                     a parameter a ZeRO  its fragment of the fp32
                                                       optimizer trains  master copy (as DeepSpeed's
                                                                         zero_to_fp32 reads it)
                                   <-------        the plan (small), rank 0's non-tensor entries
    lay out one area (offsets), or safetensors files
    ("model", id, {op: "write", places}) ----->    write(): each part copied once (converted to
                                                   the dtype asked for) into the file at its
                                                   place, mapped here (/dev/shm, a memfd of the
                                                   kernel's, or a file on disk)
                                   <-------        bytes written
    the kernel maps the area: one full state dict, no second copy

A rank never makes a collective here: a pool whose process group is stuck or gone still
gives its model back.
"""

from __future__ import annotations

import os
from typing import Any

from air_magic.rank.writing import pwrite_all

__all__ = ["unwrap", "plan", "write", "handle", "ModelBackError"]

#: Names that wrappers of submodules add inside keys (torch.compile, activation checkpointing);
#: the wrappers of the whole model (DDP's ``module.``) are taken off by :func:`unwrap`.
WRAPPER_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


class ModelBackError(Exception):
    """The name does not hold a module whose state dict can come back (the message says why)."""


def handle(namespace: dict[str, Any], data: dict[str, Any]) -> Any:
    """A ``("model", ...)`` message of the kernel."""
    if data["op"] == "plan":
        return plan(namespace, data["name"])
    if data["op"] == "write":
        return write(namespace, data["name"], data["places"], data.get("dtype"))
    raise ValueError(f"unknown model message {data['op']!r}")


def unwrap(value: Any, name: str) -> Any:
    """The ``nn.Module`` that ``value`` is or wraps (DDP, torch.compile, a DeepSpeed engine)."""
    import torch

    module = value
    for _ in range(8):
        inner = getattr(module, "module", None)  # DDP, DataParallel, a DeepSpeed engine
        if isinstance(inner, torch.nn.Module) and type(module).__name__ in (
            "DistributedDataParallel",
            "DataParallel",
            "DeepSpeedEngine",
            "PipelineEngine",
        ):
            module = inner
            continue
        orig = getattr(module, "_orig_mod", None)  # torch.compile
        if isinstance(orig, torch.nn.Module):
            module = orig
            continue
        break
    if not isinstance(module, torch.nn.Module):
        raise ModelBackError(
            f"{name!r} in the ranks is a {type(value).__module__}.{type(value).__qualname__}, not a torch.nn.Module "
            "(pool.state_dict and pool.model take the name a module is bound to; pool.pull takes any value)"
        )
    if type(module).__name__ == "FullyShardedDataParallel":
        raise ModelBackError(
            f"{name!r} is wrapped in FSDP (version 1), whose state dict needs a collective; use FSDP2 "
            "(torch.distributed.fsdp.fully_shard), or save it from the ranks with its own state_dict_type"
        )
    return module


def _entries(module: Any) -> dict[str, Any]:
    """The module's state dict with the parameters themselves (ZeRO-3's carry their partition)."""
    entries = module.state_dict(keep_vars=True)
    return {".".join(p for p in key.split(".") if p not in WRAPPER_NAMES): value for key, value in entries.items()}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def plan(namespace: dict[str, Any], name: str) -> dict[str, Any]:
    """What this rank holds of the module bound to ``name``: ``{"keys": {key: part}, "objects":
    {key: value}, "buffers": {name: tensor}, "order": [key...], "aliases": {key: key}}`` (a
    tied weight's second key names its first); a part is ``{"shape", "dtype", "kind", "box"}``
    where ``box`` is ``(offsets, sizes)`` of what this rank writes, or None (it writes nothing)."""
    import torch

    if name not in namespace:
        raise NameError(f"name {name!r} is not defined on this rank")
    module = unwrap(namespace[name], name)
    rank = _rank()
    keys: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    aliases: dict[str, str] = {}  # a tied weight's other keys (one Parameter): key -> its first key
    first: dict[int, str] = {}
    entries = _entries(module)
    for key, value in entries.items():
        if not isinstance(value, torch.Tensor):
            if rank == 0:
                objects[key] = value
            continue
        aliases[key] = first.setdefault(id(value), key)
        keys[key] = _part(value, rank)
        if hasattr(value, "ds_id") and keys[key]["kind"] == "plain" and not value.numel():
            raise ModelBackError(
                f"{name!r}: {key} is a DeepSpeed ZeRO-3 parameter whose partition this rank cannot read (an empty "
                "placeholder without its ds_tensor); nothing is returned rather than an empty tensor"
            )
    aliases = {key: to for key, to in aliases.items() if key != to}
    buffers = {}
    if rank == 0:  # buffers a state dict leaves out (registered with persistent=False): pool.model needs them
        for buffer_name, buffer in module.named_buffers():
            short = ".".join(p for p in buffer_name.split(".") if p not in WRAPPER_NAMES)
            if short not in keys and buffer is not None:
                buffers[short] = buffer.detach().cpu()
    return {"keys": keys, "objects": objects, "buffers": buffers, "order": list(entries), "aliases": aliases}


def _part(value: Any, rank: int) -> dict[str, Any]:
    dtype = str(value.dtype).removeprefix("torch.")
    if getattr(value, "requires_grad", False) and getattr(value, "_z3_optimizer", None) is not None:
        # A ZeRO-3 parameter the optimizer trains: its fp32 master copy, partitioned as the
        # parameter is (DeepSpeed's zero_to_fp32 puts these together too).
        numel = int(value.ds_numel)
        size = int(value.ds_tensor.numel())
        start = min(rank * size, numel)
        end = min(start + size, numel)
        return {"shape": list(value.ds_shape), "dtype": "float32", "kind": "master", "box": [[start], [end - start]]}
    if getattr(value, "requires_grad", False) and hasattr(value, "_hp_mapping"):
        # A ZeRO-1/2 (or bf16 optimizer) parameter: its fp32 master copy is split across the
        # ranks; this rank holds one contiguous fragment of it, or none.
        mapping = value._hp_mapping
        box = None
        if mapping is not None:
            box = [[int(mapping.lp_fragment_address.start)], [int(mapping.lp_fragment_address.numel)]]
        return {"shape": list(value.shape), "dtype": "float32", "kind": "master", "box": box}
    if hasattr(value, "ds_tensor") and hasattr(value, "ds_shape") and not getattr(value, "ds_persist", False):
        # A DeepSpeed ZeRO-3 parameter, partitioned (a small one it keeps whole is a plain tensor).
        numel = int(value.ds_numel)
        size = int(value.ds_tensor.numel())
        start = min(rank * size, numel)
        end = min(start + size, numel)
        return {"shape": list(value.ds_shape), "dtype": dtype, "kind": "zero3", "box": [[start], [end - start]]}
    placements = getattr(value, "placements", None)
    if placements is not None and hasattr(value, "to_local"):  # a DTensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = value.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the mesh
            return {"shape": list(value.shape), "dtype": dtype, "kind": "dtensor", "box": None}
        for dim, placement in enumerate(placements):
            if placement.is_partial():
                raise ModelBackError(
                    "a DTensor with a Partial placement holds sums not yet made; redistribute it first"
                )
            if placement.is_replicate() and coordinate[dim] != 0:  # the same bytes as coordinate 0's
                return {"shape": list(value.shape), "dtype": dtype, "kind": "dtensor", "box": None}
        sizes, offsets = compute_local_shape_and_global_offset(value.shape, mesh, placements)
        return {"shape": list(value.shape), "dtype": dtype, "kind": "dtensor", "box": [list(offsets), list(sizes)]}
    shape = list(value.shape)
    box = [[0] * len(shape), shape] if rank == 0 else None
    return {"shape": shape, "dtype": dtype, "kind": "plain", "box": box}


#: Parts that are a run of the key's flattened elements (a ZeRO partition, a fp32 master fragment).
_FLAT = ("zero3", "master")


def _span(part: dict[str, Any], element: int) -> tuple[int, int]:
    """The bytes of the key's full tensor that this rank's box lies in: its own rows where the
    box spans whole rows (a Shard(0), a ZeRO-3 partition), else the whole tensor."""
    shape, (offsets, sizes) = part["shape"], part["box"]
    if part["kind"] in _FLAT:
        return offsets[0] * element, sizes[0] * element
    row = element
    for dim in shape[1:]:
        row *= dim
    if shape and list(sizes[1:]) == list(shape[1:]):
        return offsets[0] * row, sizes[0] * row
    total = row * (shape[0] if shape else 1)
    return 0, total


def _exact_span(part: dict[str, Any]) -> bool:
    """Whether this rank's box is exactly its span's bytes (whole rows, or a ZeRO-3 partition)."""
    shape, sizes = part["shape"], part["box"][1]
    return part["kind"] in _FLAT or not shape or list(sizes[1:]) == list(shape[1:])


def _in_turn(entries: dict[str, Any], places: dict[str, Any], rank: int) -> list[tuple[str, Any]]:
    """The entries ``places`` has, grouped by file, the files in turn from one of this rank's
    own (rank r of n starts at file r*files//n): a file takes one writer at a time (its inode's
    lock), so ranks that start apart write at the same time."""
    files = list(dict.fromkeys(places[key][0] for key in entries if key in places))
    if not files:
        return []
    first = rank * len(files) // max(_world(), 1)
    turn = {path: (index - first) % len(files) for index, path in enumerate(files)}
    chosen = [(key, value) for key, value in entries.items() if key in places]
    return sorted(chosen, key=lambda item: turn[places[item[0]][0]])


def write(namespace: dict[str, Any], name: str, places: dict[str, Any], dtype: str | None) -> int:
    """Copy this rank's part of each key to its place: ``places[key] = (path, byte offset)`` of
    the key's full tensor (row-major, in ``dtype`` or its own), in a file the kernel made and
    sized; each file in turn (:func:`_in_turn`).  A part that is whole rows (a Shard(0), a ZeRO-3 partition, a plain tensor) is one
    ``pwrite`` from the tensor's memory (the file's pages are allocated as they are written: a
    full /dev/shm is an ENOSPC error here, never a SIGBUS); another part (a column shard) is
    copied into a mapping of the file after its bytes are reserved (``posix_fallocate``).  The
    bytes written."""
    import torch

    module = unwrap(namespace[name], name)
    rank = _rank()
    target = getattr(torch, dtype) if dtype else None
    areas: dict[str, Any] = {}
    fds: dict[str, int] = {}
    written = 0
    try:
        for key, value in _in_turn(_entries(module), places, rank):
            if not isinstance(value, torch.Tensor):
                continue
            held: Any = value  # a DTensor or a ZeRO-3 parameter, as _part found
            part = _part(value, rank)
            if part["box"] is None:
                continue
            path, offset = places[key]
            if path not in fds:
                fds[path] = os.open(path, os.O_RDWR)
            native = torch.float32 if part["kind"] == "master" else value.dtype
            out_dtype = target if target is not None and value.is_floating_point() else native
            element = torch.empty((), dtype=out_dtype).element_size()
            start, length = _span(part, element)
            offsets, sizes = part["box"]
            if part["kind"] == "master" and getattr(held, "_z3_optimizer", None) is not None:
                local = held._z3_optimizer.get_local_fp32_param(held).detach().reshape(-1)[: sizes[0]]
            elif part["kind"] == "master":
                local = held._hp_mapping.hp_fragment.detach().reshape(-1)[: sizes[0]]
            elif part["kind"] == "zero3":
                local = held.ds_tensor.detach().reshape(-1)[: sizes[0]]
            else:
                local = (held.to_local() if part["kind"] == "dtensor" else held).detach()
            if not length:
                continue
            if _exact_span(part):
                data = local.to(device="cpu", dtype=out_dtype).contiguous().reshape(-1)
                pwrite_all(fds[path], data.view(torch.uint8).numpy(), offset + start)
                written += length
                continue
            os.posix_fallocate(fds[path], offset + start, length)
            area = areas.get(path)
            if area is None:
                area = areas[path] = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
            full_shape = part["shape"]
            numel = 1
            for dim in full_shape:
                numel *= dim
            view = area[offset : offset + numel * element].view(out_dtype).view(full_shape)
            for dim, (begin, size) in enumerate(zip(offsets, sizes)):
                view = view.narrow(dim, begin, size)
            if local.numel():
                view.copy_(local.reshape(view.shape))
            written += local.numel() * element
    finally:
        areas.clear()
        for fd in fds.values():
            os.close(fd)
    return written
