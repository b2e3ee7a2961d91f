"""air_magic: run PyTorch training on every accelerator of this machine from a notebook.

>>> %load_ext air_magic                       # doctest: +SKIP
>>> from air_magic import distributed         # doctest: +SKIP

``import air_magic`` stays light: IPython, torch and MLflow are imported where
they are used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from air_magic import plugins as _plugins
from air_magic._version import __version__
from air_magic.errors import (
    AcceleratorMismatchError,
    AirMagicError,
    CaptureError,
    ConfigurationError,
    CPUOversubscriptionWarning,
    DirectCallError,
    LaunchCancelledError,
    LaunchError,
    LaunchTimeoutError,
    RankCrashedError,
    RankFailedError,
    RayClusterError,
    RayNotInstalledError,
    ResultError,
    TooManyCPURanksError,
)

if TYPE_CHECKING:
    from air_magic.accelerators import AcceleratorType, GPUType
    from air_magic.backends.ray.ray_init import ray_init
    from air_magic.data.weights import save_safetensors
    from air_magic.decorator import DistributedFunction, distributed
    from air_magic.kernel.launcher import Launch
    from air_magic.kernel.machine.claims import GPUClaimsError, GPUsBusyError
    from air_magic.kernel.pool.model_back import ModelBackError
    from air_magic.pool import Pool, PoolBrokenError, PoolBusyError, PoolCall

__all__ = [
    "__version__",
    "distributed",
    "DistributedFunction",
    "Launch",
    "Pool",
    "PoolCall",
    "PoolBrokenError",
    "PoolBusyError",
    "ModelBackError",
    "GPUsBusyError",
    "GPUClaimsError",
    "AcceleratorType",
    "GPUType",
    "ray_init",
    "save_safetensors",
    "load_ipython_extension",
    "unload_ipython_extension",
    "AirMagicError",
    "ConfigurationError",
    "AcceleratorMismatchError",
    "DirectCallError",
    "CaptureError",
    "LaunchError",
    "RankFailedError",
    "RankCrashedError",
    "LaunchTimeoutError",
    "LaunchCancelledError",
    "ResultError",
    "TooManyCPURanksError",
    "RayClusterError",
    "RayNotInstalledError",
    "CPUOversubscriptionWarning",
]


#: Public names imported when first used (PEP 562), and their modules: ``import air_magic``
#: stays a few milliseconds (``air-magic ps`` and ``stop`` import the package first), and
#: ``from air_magic import distributed`` imports the decorator then.
_LAZY = {
    "distributed": "air_magic.decorator",
    "DistributedFunction": "air_magic.decorator",
    "AcceleratorType": "air_magic.accelerators",
    "GPUType": "air_magic.accelerators",
    "ray_init": "air_magic.backends.ray.ray_init",
    # what ``.submit()`` returns: the launcher's
    "Launch": "air_magic.kernel.launcher",
    # imports torch
    "save_safetensors": "air_magic.data.weights",
    # the pool's engine is the launcher's too
    "Pool": "air_magic.pool",
    "PoolCall": "air_magic.pool",
    "PoolBrokenError": "air_magic.pool",
    "PoolBusyError": "air_magic.pool",
    # what pool.state_dict/model/save refuse
    "ModelBackError": "air_magic.kernel.pool.model_back",
    # a launch told not to wait for GPUs another one holds
    "GPUsBusyError": "air_magic.kernel.machine.claims",
    "GPUClaimsError": "air_magic.kernel.machine.claims",
}


def __getattr__(name: str) -> Any:
    import importlib
    import importlib.util

    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # the next lookup is a plain one
        return value
    # A subpackage or module (``air_magic.tracking.flush()`` after ``import air_magic``): imported
    # now, as ``import air_magic.tracking`` would.
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'air_magic' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext air_magic``: register ``%%distributed`` and ``%air_lint``, start the helper process."""
    from air_magic.lint.magic import LintMagics
    from air_magic.magics import DistributedMagics, show_cell_syntax_errors

    ipython.register_magics(DistributedMagics, LintMagics)
    show_cell_syntax_errors(ipython)
    from air_magic.plugins import get_launcher, lab_target, warm_front_end

    launcher = get_launcher()
    launcher.warm()
    warm_front_end()  # the panel, the linter and NVML, while the helper imports torch
    lab_target(ipython)  # the JupyterLab extension's comm target (import air_magic registered it too)
    from air_magic.tracking import recover_in_background, warm_in_background

    recover_in_background()  # what launches of a kernel that died left unsent (in the background)
    magics = getattr(getattr(ipython, "magics_manager", None), "registry", {}).get("DistributedMagics")
    if getattr(magics, "tracking", True):  # off in the kernel's config: MLflow is not needed
        warm_in_background(launcher.session_dir)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext air_magic``: remove ``%%distributed``, ``%distributed_pool``, ``%distributed_debug``
    and ``%air_lint``;
    running launches and the kernel's pool are not touched (``air_magic.Pool`` still works).
    Waits (bounded, said after a second) for ended launches' points to be stored in MLflow."""
    from air_magic.magics import forget_cell_syntax_errors
    from air_magic.plugins import flush_tracking

    flush_tracking(30.0)
    forget_cell_syntax_errors(ipython)
    ipython.magics_manager.magics["cell"].pop("distributed", None)
    ipython.magics_manager.magics["line"].pop("distributed_pool", None)
    ipython.magics_manager.magics["line"].pop("distributed_debug", None)
    ipython.magics_manager.magics["line"].pop("air_lint", None)


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where Jupyter finds the prebuilt JupyterLab extension (``labextension/``, built into
    ``air_magic/labextension``; pip installs it under ``share/jupyter/labextensions``)."""
    return [{"src": "labextension", "dest": "air-magic-labextension"}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    """The Jupyter server extension: the lab extension's migration command (``air_magic.lint.server``)
    and its list of the machine's launches and pools (``air_magic.kernel.machine.server``)."""
    return [{"module": "air_magic.lint.server"}, {"module": "air_magic.kernel.machine.server"}]


# In a kernel: the comm target the JupyterLab extension opens its comm to (the list of
# launches, Stop, logs), there as soon as anything imports air_magic.  Cheap: nothing is
# imported for it (``_plugins.lab_target``).
_plugins.lab_target()
