"""Patch a module of the rank's code once it is imported (now, if it is already).

The helper preloads torch, so most patches apply at once; a rank whose helper did not (or a
module the user imports later, such as IPython's debugger) is patched as the import ends::

    on_import(name, patch) --> name in sys.modules: patch(module) now
                           --> else a finder first on sys.meta_path: the module's own
                               loader runs, then patch(module)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, Callable, Sequence

__all__ = ["on_import"]

Patch = Callable[[types.ModuleType], None]


def on_import(name: str, patch: Patch) -> None:
    """Run ``patch(module)`` for the module ``name``: now if it is imported, else once it is."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _PatchOnImport)), None)
    if finder is None:
        finder = _PatchOnImport()
        sys.meta_path.insert(0, finder)
    finder.patches.setdefault(name, []).append(patch)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.patches: dict[str, list[Patch]] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patches = self.patches.pop(fullname, None)
        if not patches:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patches)
                return spec
        self.patches[fullname] = patches  # not found now: perhaps later
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patches: list[Patch]) -> None:
        self._loader = loader
        self._patches = patches

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        for patch in self._patches:
            patch(module)
