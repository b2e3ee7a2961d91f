"""A pool rank's training state after an interrupt: put back what was left half-way, say what
the kernel compares, and copy it from one rank to the others on request (the kernel side is
:mod:`air_magic.kernel.pool.interrupts.state`)::

    kernel                                      rank r (idle: every rank is back from the call)
    ("settle", id, {})            ------->      repair(): each name of the namespace that is
                                                  a module: FSDP2's iteration state reset and its
                                                  parameters resharded (``reset_iter_state``),
                                                  DDP's reducer made ready for a new backward
                                                  (and a half-reduced step's gradients dropped)
                                                fingerprint(): per module, optimizer, DeepSpeed
                                                  engine: its replicated tensors' checksums, how
                                                  many parameters are DTensors, the steps made
                                  <-------      {"repaired": [...], "names": {name: print}}
    ("sync", id, {names, src})    ------->      sync(): each module's replicated parameters and
                                                  buffers, and each optimizer's state, broadcast
                                                  from rank ``src`` in the pool's group
                                  <-------      what was copied

A checksum is a float64 sum of a strided sample of at most 4,096 elements of each tensor:
replicas that train in step are equal bit for bit, and a step apart they differ everywhere.
The steps an optimizer made are counted by a step hook (torch's optimizer step post-hook),
for every optimizer, whatever its state holds.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

__all__ = ["count_steps", "repair", "fingerprint", "sync", "SyncError", "SAMPLE"]

#: Elements of each tensor that its checksum reads at most.
SAMPLE = 4096

#: Steps each optimizer made on this rank (its step post-hook counts them).
_steps: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
_hooked: list[Any] = []


class SyncError(Exception):
    """A name that cannot be copied from one rank to the others (the message says why)."""


def count_steps() -> None:
    """Count every optimizer's steps from now on (once torch.optim is imported)."""
    if _hooked:
        return
    from air_magic.rank import patching

    def hook(module: Any) -> None:
        if _hooked:
            return
        register = getattr(module, "register_optimizer_step_post_hook", None)
        if register is None:
            return

        def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
            try:
                _steps[optimizer] = _steps.get(optimizer, 0) + 1
            except TypeError:  # (an optimizer that cannot be weakly referenced)
                pass

        _hooked.append(register(stepped))

    patching.on_import("torch.optim.optimizer", hook)


def _kind(value: Any) -> str:
    """``module``, ``optimizer``, ``engine`` (DeepSpeed) or ``''`` for anything else."""
    torch = sys.modules.get("torch")
    if torch is None:
        return ""
    cls = type(value).__name__
    if cls in ("DeepSpeedEngine", "PipelineEngine"):
        return "engine"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    return ""


def _named(namespace: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """The namespace's modules, optimizers and DeepSpeed engines, by name."""
    found = {}
    for name, value in list(namespace.items()):
        if name.startswith("_"):
            continue
        kind = _kind(value)
        if kind:
            found[name] = (kind, value)
    return found


# -- repair --------------------------------------------------------------------------------------


def repair(namespace: dict[str, Any]) -> list[str]:
    """Put back what an interrupt left half-way in the namespace's modules; what was done,
    a line each (``model: FSDP2's iteration reset, 16 parameters resharded``)."""
    done: list[str] = []
    seen: set[int] = set()
    named = sorted(_named(namespace).items(), key=lambda item: item[1][0] != "engine")  # engines first
    for name, (kind, value) in named:
        module = getattr(value, "module", None) if kind == "engine" else value
        if kind == "optimizer" or module is None or id(module) in seen:
            continue
        seen.add(id(module))
        said = []
        if kind == "engine":
            said += _repair_deepspeed(value)
        said += _repair_ddp(module)
        said += _repair_fsdp2(module)
        if said:
            done.append(f"{name}: {', '.join(said)}")
    return done


def _repair_deepspeed(engine: Any) -> list[str]:
    """A DeepSpeed engine whose step an interrupt cut: the gradients it was reducing dropped
    (ZeRO-1/2's buckets and partitions; ZeRO-3's parameters gathered for the step released),
    on every rank alike, so that its next backward reduces what its peers reduce."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None:
        return []
    for bucket in (getattr(optimizer, "ipg_buckets", None) or {}).values():
        if hasattr(bucket, "clear_params"):  # ZeRO-3's: its buffer is kept for the next step
            bucket.clear_params()
        else:
            bucket.clear()
            bucket.index = 0
    reduced = getattr(optimizer, "params_already_reduced", None)
    if isinstance(reduced, list):
        reduced[:] = [False] * len(reduced)
    if getattr(optimizer, "partition_gradients", False) and hasattr(optimizer, "reset_partition_gradient_structures"):
        optimizer.reset_partition_gradient_structures()
    if isinstance(getattr(optimizer, "averaged_gradients", None), dict):
        optimizer.averaged_gradients = {}
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is not None:  # ZeRO-3: what the cut step gathered is given back
        try:
            offload.get_param_coordinator().reset_step()
        except Exception:
            pass
        try:
            engine.empty_partition_cache()
        except Exception:
            pass
    try:
        optimizer.zero_grad(set_to_none=True)
    except Exception:  # (ZeRO-3's records a CUDA stream, which a CPU rank has not): by hand
        for param in engine.module.parameters():
            param.grad = None
    return ["DeepSpeed's unfinished step dropped (gradients cleared)"]


def _repair_ddp(module: Any) -> list[str]:
    """DDP modules (the name's or inside it): the reducer made ready for a new backward and the
    interrupted step's gradients dropped, on every rank alike (a rank whose backward finished
    and one whose backward was cut must not differ: the reset rebuilds DDP's buckets in the
    next forward, a collective every rank must make)."""
    said = []
    for sub in _walk(module):
        if type(sub).__name__ != "DistributedDataParallel":
            continue
        reducer = getattr(sub, "reducer", None)
        if reducer is None:
            continue
        try:
            sub._has_rebuilt_buckets = False
            reducer._reset_state()
        except Exception as exc:  # (a torch without it)
            said.append(f"DDP's reducer could not be reset ({type(exc).__name__}: {exc})")
            continue
        for param in sub.parameters():
            param.grad = None
        said.append("DDP's reducer reset and the interrupted step's gradients cleared")
    return said


def _repair_fsdp2(module: Any) -> list[str]:
    """FSDP2 roots (the name's module or its submodules): their iteration state reset and every
    parameter group resharded, as ``FSDPModule.reset_iter_state()`` does (torch ≥ 2.13); where
    a collective it would wait for was cut, the wait is dropped first."""
    roots: list[Any] = []
    for sub in _walk(module):
        state = _fsdp_state(sub)
        if state is not None and state._is_root is not False and all(r is not sub for r in roots):
            roots.append(sub)
    said = []
    for root in roots:
        state = _fsdp_state(root)
        groups = [g for s in _fsdp_states(root) for g in getattr(s, "_fsdp_param_groups", [])]
        unsharded = sum(1 for g in groups if not getattr(g, "is_sharded", True))
        if state._is_root is None and not unsharded:
            continue  # never run: nothing to reset
        reset = getattr(root, "reset_iter_state", None)
        try:
            if reset is None:
                raise AttributeError("reset_iter_state")
            reset()
        except Exception:  # a wait on a collective the kernel cut (it raises), or an older torch
            for group in groups:
                group._all_gather_result = None
            for group in groups:
                try:
                    if reset is not None:
                        group._reset_iter_state()
                    else:
                        group.reshard()
                except Exception:
                    group._to_sharded()
            if reset is not None:
                try:
                    reset()
                except Exception:
                    pass
        if unsharded:
            said.append(f"FSDP2's iteration reset ({unsharded} parameter group{'s' * (unsharded != 1)} resharded)")
    return said


def _walk(module: Any) -> list[Any]:
    modules = getattr(module, "modules", None)
    return list(modules()) if callable(modules) else []


def _fsdp_state(module: Any) -> Any:
    get = getattr(module, "_get_fsdp_state", None)
    if get is None:
        return None
    try:
        return get()
    except Exception:
        return None


def _fsdp_states(root: Any) -> list[Any]:
    state = _fsdp_state(root)
    ctx = getattr(state, "_state_ctx", None)
    return list(getattr(ctx, "all_states", None) or [state])


# -- fingerprint ---------------------------------------------------------------------------------


def fingerprint(namespace: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per module, optimizer and DeepSpeed engine of the namespace: ``{"kind", "tensors":
    {key: checksum or None (sharded)}, "dtensors": (DTensor parameters, parameters),
    "steps": optimizer steps, "sharded": why it is not replicated ('' if it is)}``."""
    found: dict[str, dict[str, Any]] = {}
    for name, (kind, value) in _named(namespace).items():
        try:
            if kind == "optimizer":
                found[name] = _optimizer_print(value)
            elif kind == "engine":
                found[name] = _engine_print(value)
            else:
                found[name] = _module_print(value)
        except Exception as exc:  # a module whose tensors cannot be read here: said, not compared
            found[name] = {"kind": kind, "error": f"{type(exc).__name__}: {exc}"}
    return found


def _checksums(named: list[tuple[str, Any]]) -> dict[str, float | None]:
    """Each tensor's checksum (None for a sharded one: a DTensor that is not replicated, a
    ZeRO-3 partition); one transfer to the CPU for all of them."""
    import torch

    keys: list[str] = []
    sums = []
    out: dict[str, float | None] = {}
    for key, tensor in named:
        if tensor is None:
            continue
        local = tensor
        placements = getattr(tensor, "placements", None)
        if placements is not None and hasattr(tensor, "to_local"):
            if not all(p.is_replicate() for p in placements):
                out[key] = None
                continue
            local = tensor.to_local()
        if hasattr(tensor, "ds_tensor") and (not getattr(tensor, "ds_persist", False) or not tensor.numel()):
            out[key] = None  # a ZeRO-3 partition (its data, outside a gather, is an empty placeholder)
            continue
        flat = local.detach().reshape(-1)
        if flat.numel() > SAMPLE:
            flat = flat[:: -(-flat.numel() // SAMPLE)]
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        sums.append(flat.to(torch.float64).sum() if flat.numel() else torch.zeros((), dtype=torch.float64))
        keys.append(key)
    if sums:
        values = torch.stack([s.cpu() for s in sums]).tolist()
        out.update(zip(keys, values))
    return out


def _module_print(module: Any) -> dict[str, Any]:
    params = list(module.named_parameters())
    dtensors = sum(1 for _, p in params if hasattr(p, "placements") and hasattr(p, "to_local"))
    tensors = _checksums(params + [(f"buffer:{k}", b) for k, b in module.named_buffers()])
    wrapped = "DDP" if type(module).__name__ == "DistributedDataParallel" else ""
    return {"kind": "module", "tensors": tensors, "dtensors": (dtensors, len(params)), "wrapped": wrapped}


def _optimizer_print(optimizer: Any) -> dict[str, Any]:
    import torch

    tensors: list[tuple[str, Any]] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            for key, value in sorted(optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor) and key != "step":
                    tensors.append((f"{g}.{i}.{key}", value))
    return {"kind": "optimizer", "tensors": _checksums(tensors), "steps": _steps.get(optimizer, 0)}


def _engine_print(engine: Any) -> dict[str, Any]:
    stage = int(getattr(engine, "zero_optimization_stage", lambda: 0)() or 0)
    module = _module_print(engine.module)
    module["kind"] = "engine"
    module["steps"] = int(getattr(engine, "global_steps", 0) or 0)
    module["stage"] = stage
    return module


# -- sync ----------------------------------------------------------------------------------------


def sync(namespace: dict[str, Any], names: list[str], src: int) -> list[str]:
    """Each name's state broadcast from rank ``src`` in the pool's group: a module's parameters
    and buffers, an optimizer's state dict; what was copied, a line each.  A sharded name
    (FSDP2's DTensors, a DeepSpeed engine) raises :class:`SyncError`."""
    import torch
    import torch.distributed as dist

    found = _named(namespace)
    refused = ""
    try:
        _check_sync(namespace, found, names)
    except SyncError as exc:
        refused = str(exc)
    # Every rank refuses, or none does: a rank that went on alone would wait in its broadcast.
    device = "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
    agreed = torch.tensor([0 if refused else 1], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if refused:
        raise SyncError(refused)
    if not int(agreed.item()):
        raise SyncError("another rank refused it (its reason comes first)")
    copied = []
    for name in names:
        kind, value = found[name]
        if kind == "module":
            tensors = [p.data for p in value.parameters()] + [b for b in value.buffers()]
            with torch.no_grad():
                for tensor in tensors:
                    dist.broadcast(tensor, src=src)
            copied.append(f"{name}: {len(tensors)} tensors")
        else:
            state = [_on_cpu(value.state_dict()) if dist.get_rank() == src else None]
            dist.broadcast_object_list(state, src=src)
            if dist.get_rank() != src:
                value.load_state_dict(state[0])
            steps = [_steps.get(value, 0)]
            dist.broadcast_object_list(steps, src=src)
            _steps[value] = steps[0]
            copied.append(f"{name}: the state of its {len(value.state)} parameters")
    return copied


def _check_sync(namespace: dict[str, Any], found: dict[str, tuple[str, Any]], names: list[str]) -> None:
    for name in names:
        if name not in namespace:
            raise SyncError(f"{name!r} is not defined on the ranks")
        if name not in found:
            value = namespace[name]
            raise SyncError(
                f"{name!r} is a {type(value).__module__}.{type(value).__qualname__}: pool.sync copies modules "
                "and optimizers (pool.push sends any value from the notebook)"
            )
        kind, value = found[name]
        if kind == "engine":
            raise SyncError(
                f"{name!r} is a DeepSpeed engine: its optimizer's state is partitioned across the ranks (ZeRO), so "
                "there is no whole copy on one rank to send; load a checkpoint on every rank instead"
            )
        if kind == "module" and any(hasattr(p, "placements") for p in value.parameters()):
            raise SyncError(
                f"{name!r} is sharded (FSDP2 or tensor parallel: DTensor parameters): each rank holds its own part, "
                "so no rank has the others' to send; load a checkpoint on every rank instead"
            )


def _on_cpu(value: Any) -> Any:
    """A state dict with its tensors on the CPU (each rank loads them onto its own device)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value
