"""A rank keeps every process group its code destroys until the rank ends.

torch's gloo process group joins its worker threads in its C++ destructor.  When the last
reference to a destroyed group is a DDP model's reducer, that destructor runs as the model
is freed (typically as the user's function returns), on the main thread, holding the GIL.
Since torch 2.13 the work of an all-reduce started in ``backward()`` carries a Python
object in its thread-local state, so the worker thread that frees the last such work
needs the GIL: the two wait for each other and the rank hangs for ever at the end of a
training that went well (seen with PyTorch's own DDP examples, under ``torchrun`` too).

Here ``destroy_process_group()`` keeps a Python reference to each group it destroys: the
reducer's is then never the last, and the group's object is never freed in the user's
code.  The rank leaves by ``os._exit``, so these groups are never destructed at all (their
backends were shut down by ``destroy_process_group`` itself: NCCL's communicators are
gone, gloo's sockets close with the process).
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

__all__ = ["keep_destroyed_groups", "kept"]

_C10D = "torch.distributed.distributed_c10d"
_MARK = "_air_magic_keeps_groups"

#: The groups the rank's code destroyed (their Python objects), oldest first.
kept: list[Any] = []


def keep_destroyed_groups() -> None:
    """Make ``torch.distributed.destroy_process_group`` keep what it destroys: now if
    torch is imported (the helper preloads it), else as soon as it is."""
    from air_magic.rank import patching

    patching.on_import(_C10D, _patch)


def _patch(c10d: types.ModuleType) -> None:
    real = c10d.destroy_process_group
    if getattr(real, _MARK, False):
        return

    @functools.wraps(real)
    def destroy_process_group(group: Any = None) -> None:
        kept.extend(_groups_destroyed(c10d, group))
        return real(group)

    setattr(destroy_process_group, _MARK, True)
    c10d.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is real:
        dist.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]


def _groups_destroyed(c10d: types.ModuleType, group: Any) -> list[Any]:
    """The groups ``destroy_process_group(group)`` is about to destroy: all of them for
    the default group (or None), else that one."""
    world = getattr(c10d, "GroupMember", None)
    if group is not None and group is not getattr(world, "WORLD", None):
        return [group]
    registry = getattr(getattr(c10d, "_world", None), "pg_map", None) or {}
    return list(registry)
