"""Distributed checkpoints (``torch.distributed.checkpoint``) on any fsspec URL.

DCP writes one file per rank plus a metadata file and reshards on load (a checkpoint
saved by 2 ranks loads on 1, or on 4).  Local paths use DCP's ``FileSystemWriter`` /
``FileSystemReader``; other URLs (``s3://``, ``gs://``, ``memory://`` ...) DCP's fsspec
writer and reader.  ``save_training_state`` / ``load_training_state`` keep a model, its
optimizer and a data loader's position together, through DCP's ``get_state_dict`` /
``set_state_dict`` (which understand DDP, FSDP2 and plain modules).
"""

from __future__ import annotations

import os
from typing import Any

import fsspec
import torch.distributed.checkpoint as dcp

from air_magic.data.dataset import DataError

__all__ = [
    "checkpoint_writer",
    "checkpoint_reader",
    "save_checkpoint",
    "async_save_checkpoint",
    "load_checkpoint",
    "save_training_state",
    "load_training_state",
]


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def checkpoint_writer(url: str, **kwargs: Any) -> Any:
    """A DCP storage writer for ``url`` (``kwargs`` go to the writer, e.g. ``thread_count``)."""
    if _is_local(url):
        return dcp.FileSystemWriter(_local(url), **kwargs)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, **kwargs)


def checkpoint_reader(url: str, **kwargs: Any) -> Any:
    """A DCP storage reader for ``url``; a missing checkpoint is a clear ``DataError``."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(f"{path.rstrip('/')}/.metadata"):
        raise DataError(
            f"no checkpoint at {url!r} (its .metadata file is missing). Check the path, "
            "or that the save finished (async saves: wait for the returned future)."
        )
    if _is_local(url):
        return dcp.FileSystemReader(_local(url), **kwargs)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **kwargs)


def save_checkpoint(state_dict: dict[str, Any], url: str, **kwargs: Any) -> Any:
    """``dcp.save`` to ``url``: every rank calls it with its own (sharded) state."""
    return dcp.save(state_dict, storage_writer=checkpoint_writer(url, **kwargs))


def async_save_checkpoint(state_dict: dict[str, Any], url: str, **kwargs: Any) -> Any:
    """``dcp.async_save`` to ``url``; returns a future: ``.result()`` before the next save."""
    return dcp.async_save(state_dict, storage_writer=checkpoint_writer(url, **kwargs))


def load_checkpoint(state_dict: dict[str, Any], url: str, **kwargs: Any) -> dict[str, Any]:
    """``dcp.load`` from ``url`` into ``state_dict`` in place (resharding as needed)."""
    dcp.load(state_dict, storage_reader=checkpoint_reader(url, **kwargs))
    return state_dict


def save_training_state(
    url: str, model: Any, optimizer: Any = None, dataloader: Any = None, *, asynchronous: bool = False
) -> Any:
    """Save model, optimizer and data-loader position together (call it on every rank)."""
    state = _training_state(model, optimizer)
    save = async_save_checkpoint if asynchronous else save_checkpoint
    result = save(state, url)
    if dataloader is not None:
        _save_loader_state(url, dataloader)
    return result


def load_training_state(url: str, model: Any, optimizer: Any = None, dataloader: Any = None) -> None:
    """Restore what :func:`save_training_state` wrote into ``model`` / ``optimizer`` / ``dataloader``."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _training_state(model, optimizer)
    load_checkpoint(state, url)
    set_state_dict(
        model, _optimizers(optimizer), model_state_dict=state["model"], optim_state_dict=state.get("optimizer", {})
    )
    if dataloader is not None:
        _load_loader_state(url, dataloader)


def _optimizers(optimizer: Any) -> Any:
    """``optimizer`` as torch's state-dict helpers take it: ``[]`` for none."""
    return optimizer if optimizer is not None else []


def _training_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The state dict :func:`save_training_state` writes: ``model``, and ``optimizer`` when given."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optim_state
    return state


def _loader_path(url: str) -> str:
    rank = int(os.environ.get("RANK", "0"))
    return f"{url.rstrip('/')}/dataloader-rank{rank}.pt"


def _save_loader_state(url: str, dataloader: Any) -> None:
    import torch

    with fsspec.open(_loader_path(url), "wb") as handle:
        torch.save(dataloader.state_dict(), handle)


def _load_loader_state(url: str, dataloader: Any) -> None:
    import torch

    path = _loader_path(url)
    fs, local = fsspec.core.url_to_fs(path)
    if not fs.exists(local):
        raise DataError(
            f"no data-loader state for this rank at {path!r}: the checkpoint was saved "
            "by fewer ranks. Resume with the same number of ranks, or without dataloader=."
        )
    with fsspec.open(path, "rb") as handle:
        dataloader.load_state_dict(torch.load(handle, weights_only=False))
