"""Distributed checkpoints (``torch.distributed.checkpoint``) on any fsspec URL.

DCP writes one file per rank plus a metadata file and reshards on load (a checkpoint
saved by 2 ranks loads on 1, or on 4).  Local paths use DCP's ``FileSystemWriter`` /
``FileSystemReader``; other URLs (``s3://``, ``gs://``, ``memory://`` ...) DCP's fsspec
writer and reader.  ``save_training_state`` / ``load_training_state`` keep a model, its
optimizer and a data loader's position together, through DCP's ``get_state_dict`` /
``set_state_dict`` (which understand DDP, FSDP2 and plain modules).  ``open_checkpoint``
reads one in the kernel, with no process group: DCP's metadata for the keys, shapes and dtypes,
and ``dcp.load(no_dist=True)`` into plain CPU tensors of the full shapes (resharding from
however many ranks saved it).
"""

from __future__ import annotations

import os
import warnings
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
    "open_checkpoint",
    "Checkpoint",
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


class Checkpoint:
    """A DCP checkpoint opened with no process group (:func:`~air_magic.data.open_checkpoint`).  Keys are DCP's
    flattened names (``model.0.weight``, ``optimizer.state.0.weight.exp_avg``...)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._reader = checkpoint_reader(url)
        self._metadata = self._reader.read_metadata().state_dict_metadata

    def keys(self) -> list[str]:
        """Every key the checkpoint holds, in its order."""
        return list(self._metadata)

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{key: (shape, dtype)}`` of the tensors (other values are not listed)."""
        out = {}
        for key, meta in self._metadata.items():
            size = getattr(meta, "size", None)
            if size is not None:
                out[key] = (tuple(size), str(meta.properties.dtype).removeprefix("torch."))
        return out

    def __len__(self) -> int:
        return len(self._metadata)

    def __contains__(self, key: object) -> bool:
        return key in self._metadata

    def __repr__(self) -> str:
        shapes = self.shapes()
        lines = [f"<Checkpoint {self.url!r}: {len(self)} keys"]
        for key in list(self._metadata)[:20]:
            if key in shapes:
                shape, dtype = shapes[key]
                lines.append(f"  {key}: {dtype}[{', '.join(map(str, shape))}]")
            else:
                lines.append(f"  {key}: (a value)")
        if len(self._metadata) > 20:
            lines.append(f"  ... and {len(self._metadata) - 20} more")
        return "\n".join(lines) + ">"

    def load(self, keys: Any = None, *, prefix: str | None = None) -> dict[str, Any]:
        """A dict of plain CPU tensors (full shapes) for ``keys`` (all by default); ``prefix``
        (``"model."``) takes the keys that start with it and drops it from their names, ready for
        ``module.load_state_dict``."""
        import torch

        if isinstance(keys, str):
            keys = [keys]
        wanted = list(self._metadata) if keys is None else list(keys)
        unknown = [key for key in wanted if key not in self._metadata]
        if unknown:
            raise KeyError(f"not in the checkpoint at {self.url!r}: {unknown[:5]} (ck.keys() lists its keys)")
        if prefix is not None:
            wanted = [key for key in wanted if key.startswith(prefix)]
            if not wanted:
                raise KeyError(f"no key of the checkpoint at {self.url!r} starts with {prefix!r}")
        state: dict[str, Any] = {}
        for key in wanted:
            meta = self._metadata[key]
            size = getattr(meta, "size", None)
            state[key] = torch.empty(tuple(size), dtype=meta.properties.dtype) if size is not None else None
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(state, storage_reader=checkpoint_reader(self.url), no_dist=True)
        if prefix is not None:
            return {key[len(prefix) :]: value for key, value in state.items()}
        return state


def open_checkpoint(url: str) -> Checkpoint:
    """A checkpoint that ``save_training_state`` / ``save_checkpoint`` wrote, opened in the kernel
    (no process group): ``ck.keys()``, ``ck.load(keys=None, prefix=None)``."""
    return Checkpoint(url)
