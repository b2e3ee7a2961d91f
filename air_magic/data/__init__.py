"""data/: data loading and checkpoints for ranks, on any storage fsspec can reach.
Stands alone: imports errors and protocol/'s private folders only, nothing of the engine.

Data loading and checkpoints for ranks, on any storage fsspec can reach.

``StreamingDataset`` streams the files of a folder evenly across ranks and workers,
``DataLoader`` is torchdata's ``StatefulDataLoader`` (resumable mid-epoch) where
torchdata is installed, and the checkpoint helpers wrap ``torch.distributed.checkpoint``.
The reference product's names (``UCVolumeDataset``, ``UCVolumeWriter``,
``UCVolumeReader``) still work, with a ``FutureWarning`` naming the replacement.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from air_magic.data.checkpoint import (
        async_save_checkpoint,
        checkpoint_reader,
        checkpoint_writer,
        load_checkpoint,
        load_training_state,
        open_checkpoint,
        save_checkpoint,
        save_training_state,
    )
    from air_magic.data.dataset import DataError, StreamingDataset
    from air_magic.data.weights import save_safetensors

__all__ = [
    "StreamingDataset",
    "DataLoader",
    "DataError",
    "checkpoint_writer",
    "checkpoint_reader",
    "save_checkpoint",
    "async_save_checkpoint",
    "load_checkpoint",
    "save_training_state",
    "load_training_state",
    "open_checkpoint",
    "save_safetensors",
    "UCVolumeDataset",
    "UCVolumeWriter",
    "UCVolumeReader",
]


#: Public names imported when first used (PEP 562): ``from air_magic.data import weights`` (the
#: pool's model back) no longer imports ``torch.distributed.checkpoint`` (1.7 s) with them.
_LAZY = {
    "async_save_checkpoint": "air_magic.data.checkpoint",
    "checkpoint_reader": "air_magic.data.checkpoint",
    "checkpoint_writer": "air_magic.data.checkpoint",
    "load_checkpoint": "air_magic.data.checkpoint",
    "load_training_state": "air_magic.data.checkpoint",
    "open_checkpoint": "air_magic.data.checkpoint",
    "save_checkpoint": "air_magic.data.checkpoint",
    "save_training_state": "air_magic.data.checkpoint",
    "DataError": "air_magic.data.dataset",
    "StreamingDataset": "air_magic.data.dataset",
    "save_safetensors": "air_magic.data.weights",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "DataLoader":  # torchdata's StatefulDataLoader (resumable mid-epoch) where installed
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader as value
        except ImportError:  # pragma: no cover - without torchdata, no mid-epoch resume with workers
            from torch.utils.data import DataLoader as value
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'air_magic.data' has no attribute {name!r}")
    globals()[name] = value  # the next lookup is a plain one
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"DataLoader"})


def _moved(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is the reference product's name; use air_magic.data.{new} instead.", FutureWarning, stacklevel=3
    )


def UCVolumeDataset(path: str, **kwargs: Any) -> "StreamingDataset":  # noqa: N802 - the old name
    """Deprecated name of :class:`StreamingDataset` (its files are no longer limited to /Volumes)."""
    from air_magic.data.dataset import StreamingDataset

    _moved("UCVolumeDataset", "StreamingDataset")
    kwargs.setdefault("shuffle", False)  # the reference did not shuffle
    return StreamingDataset(path, **kwargs)


def UCVolumeWriter(path: str, **kwargs: Any) -> Any:  # noqa: N802
    """Deprecated name of :func:`checkpoint_writer`."""
    from air_magic.data.checkpoint import checkpoint_writer

    _moved("UCVolumeWriter", "checkpoint_writer")
    return checkpoint_writer(path, **kwargs)


def UCVolumeReader(path: str, **kwargs: Any) -> Any:  # noqa: N802
    """Deprecated name of :func:`checkpoint_reader`."""
    from air_magic.data.checkpoint import checkpoint_reader

    _moved("UCVolumeReader", "checkpoint_reader")
    return checkpoint_reader(path, **kwargs)
