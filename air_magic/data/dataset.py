"""A streaming dataset over the files of a folder on any fsspec URL.

Files are listed recursively once, then each epoch:

1. the list is shuffled with ``random.Random(seed + epoch)`` (the same order on every rank);
2. it is padded by wrapping around (or cut, with ``drop_last=True``) to a multiple of the
   world size, and rank ``r`` takes every ``world_size``-th file starting at ``r`` —
   **every rank gets the same number of items**, so no rank waits in a collective for a
   rank that has run out (uneven shards hang DDP);
3. a rank's share is split between its DataLoader workers by stride.

Remote files are copied into a local cache (fsspec's ``simplecache``) whose size is
bounded: the least recently used files are evicted past ``cache_limit_bytes``.

Resuming: ``state_dict()`` says which epoch and how many items this stream has
delivered; ``load_state_dict()`` makes the next iteration skip them.  With workers,
torchdata's ``StatefulDataLoader`` (``air_magic.data.DataLoader``) collects and restores
the state of each worker.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from typing import Any, Callable, Iterator

import fsspec
from torch.utils.data import IterableDataset, get_worker_info

from air_magic.errors import AirMagicError

__all__ = ["StreamingDataset", "DataError"]


class DataError(AirMagicError):
    """A dataset or checkpoint problem; the message says what to do."""


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class StreamingDataset(IterableDataset):  # type: ignore[type-arg]
    """Stream the files under ``url`` (a folder or a glob), evenly across ranks and workers.

    Parameters
    ----------
    url : str
        A local path, ``/Volumes/...`` mount, or fsspec URL (``s3://bucket/prefix``,
        ``gs://...``, ``memory://...``); a glob (``.../*.jpg``) selects files.
    shuffle : bool
        Shuffle the file order every epoch (``set_epoch``) with ``seed``.
    seed : int
        The shuffle seed (the same on every rank).
    drop_last : bool
        Cut the list to a multiple of the world size instead of padding it.
    output : "path", "bytes" or callable
        What is yielded: a local path (valid until the next item for remote files),
        the file's bytes, or ``output(local_path)``.
    cache_dir, cache_limit_bytes
        Where remote files are cached, and how much disk the cache may use.
    storage_options : dict
        Passed to fsspec (credentials, endpoints).

    Examples
    --------
    >>> ds = StreamingDataset("s3://bucket/shards/", seed=1)          # doctest: +SKIP
    >>> loader = air_magic.data.DataLoader(ds, batch_size=None, num_workers=2)  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        output: str | Callable[[str], Any] = "path",
        cache_dir: str | None = None,
        cache_limit_bytes: int = 10 * 2**30,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if output not in ("path", "bytes") and not callable(output):
            raise DataError(f"output must be 'path', 'bytes' or a callable, got {output!r}")
        self.url = url
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.output = output
        self.cache_limit_bytes = cache_limit_bytes
        self.storage_options = dict(storage_options or {})
        self.epoch = 0
        self._skip = 0
        self._delivered = 0
        self._state_epoch = 0
        self._fs, self.files = self._list(url)
        self._remote = "file" not in self._protocols()
        self._cache_dir = cache_dir
        self._cache_lock = threading.Lock()
        self._cache_bytes: int | None = None  # what this process knows the cache holds
        self._current: tuple[list[str], int, int] | None = None

    # -- listing ------------------------------------------------------------------------------

    def _protocols(self) -> tuple[str, ...]:
        protocol = self._fs.protocol
        return (protocol,) if isinstance(protocol, str) else tuple(protocol)

    def _list(self, url: str) -> tuple[Any, list[str]]:
        try:
            fs, path = fsspec.core.url_to_fs(url, **self.storage_options)
        except (ImportError, ValueError) as exc:
            raise DataError(
                f"cannot open {url!r}: {exc}. Install the fsspec backend for that URL "
                "(s3fs, gcsfs, adlfs ...) or check the URL."
            ) from exc
        try:
            if fs.isdir(path):
                files = fs.find(path)
            elif any(ch in path for ch in "*?["):
                files = [p for p in fs.glob(path) if fs.isfile(p)]
            elif fs.exists(path):
                raise DataError(f"{url!r} is a file; pass the folder that holds the files, or a glob.")
            else:
                raise DataError(
                    f"the folder {url!r} does not exist. Check the path (and that the "
                    "volume or bucket is mounted / reachable)."
                )
        except DataError:
            raise
        except Exception as exc:  # each fsspec backend raises its own errors
            raise DataError(
                f"cannot list {url!r}: {type(exc).__name__}: {exc}. Check the storage is "
                "reachable and the credentials (storage_options)."
            ) from exc
        files = sorted(files)
        if not files:
            raise DataError(f"no files under {url!r}: the dataset would be empty.")
        return fs, files

    # -- epochs and partitioning ----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` from the next iteration on (call it on every rank)."""
        self.epoch = epoch

    def _epoch_order(self, epoch: int) -> list[str]:
        order = list(self.files)
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def rank_files(self, rank: int, world_size: int, epoch: int | None = None) -> list[str]:
        """The files ``rank`` gets in ``epoch``: the same count for every rank."""
        order = self._epoch_order(self.epoch if epoch is None else epoch)
        if self.drop_last:
            usable = len(order) - len(order) % world_size
            if usable == 0:
                raise DataError(
                    f"{len(order)} files cannot give each of {world_size} ranks one with "
                    "drop_last=True; use drop_last=False (pads by repeating files)."
                )
            order = order[:usable]
        else:
            padded = -(-len(order) // world_size) * world_size
            order = (order * (padded // len(order) + 1))[:padded]
        return order[rank::world_size]

    def _stream(self) -> tuple[list[str], int, int]:
        rank, world_size = _rank_and_world()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return self.rank_files(rank, world_size)[worker::workers], rank * workers + worker, world_size * workers

    def __len__(self) -> int:
        rank, world_size = _rank_and_world()
        return len(self.rank_files(rank, world_size))

    def __iter__(self) -> Iterator[Any]:
        files, stream, streams = self._current = self._stream()
        skip = self._skip if self._state_epoch == self.epoch else 0
        self._skip = 0
        self._delivered = skip
        for path in files[skip:]:
            self._delivered += 1
            yield self._load(path)

    # -- resuming ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this stream is: epoch and items delivered (per worker under StatefulDataLoader)."""
        # Called after every item by StatefulDataLoader: no re-shuffling here.
        _, stream, streams = self._current if self._current is not None else self._stream()
        return {
            "epoch": self.epoch,
            "delivered": self._delivered,
            "stream": stream,
            "streams": streams,
            "seed": self.seed,
            "files": len(self.files),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state['epoch']`` skips what was delivered."""
        _, stream, streams = self._stream()
        if state.get("streams") != streams:
            raise DataError(
                f"this state was saved with {state.get('streams')} streams (ranks x DataLoader "
                f"workers) and is loaded with {streams}. Resume with the same number of ranks and "
                "workers, or start the epoch again (call set_epoch without load_state_dict)."
            )
        if state.get("files") != len(self.files) or state.get("seed") != self.seed:
            raise DataError("this state was saved for another file list or seed; it cannot resume here.")
        self.epoch = self._state_epoch = int(state["epoch"])
        self._skip = int(state["delivered"])

    # -- reading ----------------------------------------------------------------------------------

    def _load(self, path: str) -> Any:
        if not self._remote:
            return self._read(path)
        # Ranks and workers on one machine share the cache folder: another one's eviction
        # can remove this copy between its download and its reading. Then fetch it again.
        for attempt in range(3):
            try:
                return self._read(self._local_copy(path))
            except FileNotFoundError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _read(self, local: str) -> Any:
        if self.output == "path":
            return local
        if self.output == "bytes":
            with open(local, "rb") as handle:
                return handle.read()
        return self.output(local)  # type: ignore[operator]

    def _cache_root(self) -> str:
        # The user's own cache folder, created 0700 and checked on every use: a folder another
        # user made (or a symlink to elsewhere) is refused, never read from or evicted into.
        from air_magic.protocol.private import private_dir, user_cache_dir

        if self._cache_dir is None:
            digest = hashlib.sha1(self.url.encode()).hexdigest()[:12]
            private_dir(os.path.join(user_cache_dir(), "data"), "the data cache")
            self._cache_dir = os.path.join(user_cache_dir(), "data", digest)
        return private_dir(self._cache_dir, "the data cache")

    def _local_copy(self, path: str) -> str:
        root = self._cache_root()
        protocol = self._protocols()[0]
        cached = fsspec.open_local(
            f"simplecache::{protocol}://{path}",
            simplecache={"cache_storage": root, "same_names": False},
            **({protocol: self.storage_options} if self.storage_options else {}),
        )
        self._evict(root, keep=cached)
        return str(cached)

    def _evict(self, root: str, keep: str) -> None:
        with self._cache_lock:
            # Rescan the folder only when the running total says the limit may be passed
            # (other workers share the folder, so the scan is the truth).
            if self._cache_bytes is not None:
                self._cache_bytes += os.path.getsize(keep)
                if self._cache_bytes <= self.cache_limit_bytes:
                    return
            entries = []
            total = 0
            for entry in os.scandir(root):
                if entry.is_file():
                    stat = entry.stat()
                    total += stat.st_size
                    entries.append((stat.st_atime, entry.path, stat.st_size))
            for _, path, size in sorted(entries):
                if total <= self.cache_limit_bytes:
                    break
                if path != keep:
                    try:
                        os.unlink(path)
                        total -= size
                    except FileNotFoundError:
                        pass
            self._cache_bytes = total
