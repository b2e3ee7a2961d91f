"""What a pool's ranks know of the kernel, kept to send only what changed: each call takes the
kernel's working directory, its ``%pdb``, and its ``sys.path`` and environment where they
changed since the last call (the rank side applies them: :mod:`air_magic.rank.pool.serve`);
a cell takes the notebook's names it reads, but those the ranks have their own of."""

from __future__ import annotations

import os
import sys
from typing import Any

from air_magic.kernel.inspect.debugger import post_mortem_on
from air_magic.kernel.request import working_directory

__all__ = ["KernelMirror", "sys_path"]


class KernelMirror:
    """The kernel's environment and ``sys.path`` as the ranks have them."""

    def __init__(self) -> None:
        self.env: dict[str, str] = {}
        self.path: list[str] = []
        self.names: set[str] = set()  # names every rank's own code assigned (or push set)
        self._told: set[str] = set()  # the shadowed names said once

    def forget_names(self) -> None:
        """Fresh ranks have no names of their own."""
        self.names = set()
        self._told.clear()

    def visible(self, namespace: dict[str, Any], read: set[str]) -> dict[str, Any]:
        """The notebook's names a cell takes: all but those the ranks have their own of (said
        once per name, for a name the cell reads)."""
        for name in sorted(read):
            if name in namespace and name in self.names and name not in self._told:
                if isinstance(namespace[name], type(sys)):
                    continue  # a module is the same module on the ranks: nothing to say
                self._told.add(name)
                print(
                    f"[air_magic] {name}: the pool's ranks have their own (a pool cell or pool.push set it), so "
                    f"the notebook's {name} is not sent; pool.push({name}=...) sends it.",
                    file=sys.stderr,
                )
        return {k: v for k, v in namespace.items() if k not in self.names}

    def reset(self) -> None:
        """Fresh ranks start with the kernel's environment and ``sys.path`` as they are now."""
        self.env = dict(os.environ)
        self.path = sys_path()

    def state(self) -> dict[str, Any]:
        """What a launch takes from the kernel at each launch, for this call: the working
        directory, and ``sys.path`` and the environment where they changed since the last call;
        whether the kernel's ``%pdb`` is on."""
        state: dict[str, Any] = {"cwd": working_directory(), "postmortem": post_mortem_on()}
        path = sys_path()
        if path != self.path:
            state["sys_path"] = self.path = path
        now = dict(os.environ)
        if now != self.env:
            changed = {k: v for k, v in now.items() if self.env.get(k) != v}
            removed = [k for k in self.env if k not in now]
            state["env"] = (changed, removed)
            self.env = now
        return state


def sys_path() -> list[str]:
    """``sys.path`` with its empty entry (the working directory) spelled out."""
    cwd = os.getcwd() if os.path.isdir(".") else "/"
    return [p if p else cwd for p in sys.path]
