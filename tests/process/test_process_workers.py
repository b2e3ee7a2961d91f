"""What training frameworks expect of a rank: DataLoader workers that start and stop as in
any Python process, and the environment DeepSpeed and the Hugging Face Trainer read."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

import cloudpickle
import pytest
from harness import rank_processes, wait_until

from air_magic import distributed

pytestmark = pytest.mark.process

# The functions below travel by value, as a notebook's do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Objects a rank keeps past the end of its function, as a cell's variables stay until the
#: rank exits.
KEPT: list[Any] = []


@distributed(num_accelerators=2, tracking=False)
def load_with_workers(num_samples: int) -> dict[str, Any]:
    import os

    import psutil
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset, DistributedSampler

    class Tagged(Dataset):
        """Each sample says which process loaded it."""

        def __len__(self) -> int:
            return num_samples

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor([i, os.getpid()])

    dist.init_process_group()
    dataset = Tagged()
    loader = DataLoader(dataset, batch_size=4, num_workers=2, sampler=DistributedSampler(dataset, shuffle=False))
    seen, loaders = [], set()
    children_while_loading = 0
    for batch in loader:
        seen += batch[:, 0].tolist()
        loaders |= set(batch[:, 1].tolist())
        children_while_loading = max(children_while_loading, len(psutil.Process().children()))
    children_after = len(psutil.Process().children())
    dist.destroy_process_group()
    return {
        "seen": seen,
        "loaded_by": sorted(loaders),
        "rank_pid": os.getpid(),
        "children_while_loading": children_while_loading,
        "children_after": children_after,
    }


def test_dataloader_workers_in_a_rank_load_their_share_and_stop_with_the_epoch() -> None:
    results = load_with_workers.distributed(64)
    for result in results:
        # two worker processes per rank did the loading, not the rank itself
        assert len(result["loaded_by"]) == 2 and result["rank_pid"] not in result["loaded_by"]
        assert result["children_while_loading"] == 2
        assert result["children_after"] == 0  # the epoch's end stopped them
    # DistributedSampler: every sample once, split between the ranks
    assert sorted(results[0]["seen"] + results[1]["seen"]) == list(range(64))
    assert set(results[0]["seen"]).isdisjoint(results[1]["seen"])
    assert wait_until(lambda: not rank_processes(), timeout=5), rank_processes()


@distributed(num_accelerators=2, tracking=False)
def keep_workers_alive(marks: str) -> list[int]:
    import os
    import signal
    import tempfile

    from torch.utils.data import DataLoader, Dataset

    def on_start(worker_id: int) -> None:
        def on_term(*_: Any) -> None:  # how a worker is told to stop at its rank's exit
            open(os.path.join(marks, f"sigterm-{os.getpid()}"), "w").close()
            os._exit(0)

        signal.signal(signal.SIGTERM, on_term)

    class Pids(Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> int:
            return os.getpid()

    loader = DataLoader(Pids(), batch_size=4, num_workers=2, persistent_workers=True, worker_init_fn=on_start)
    pids = {pid for batch in loader for pid in batch.tolist()}
    # Still referenced when the function returns: the workers live until the rank exits,
    # and so does the temporary folder.
    KEPT.append(loader)
    KEPT.append(tempfile.TemporaryDirectory(dir=marks, prefix="kept-"))
    return sorted(pids)


def test_workers_and_temporary_folders_alive_at_the_end_are_cleaned_up_as_at_a_normal_exit() -> None:
    """A plain ``python train.py`` stops its daemonic DataLoader workers with SIGTERM at exit
    (multiprocessing's exit hook) and deletes its ``TemporaryDirectory`` folders
    (``weakref.finalize``'s). A rank does the same, not leave them to the final SIGKILL."""
    with tempfile.TemporaryDirectory() as marks:
        results = keep_workers_alive.distributed(marks)
        workers = sorted(pid for pids in results for pid in pids)
        assert len(workers) == 4
        assert wait_until(lambda: not rank_processes(), timeout=5), rank_processes()
        names = sorted(os.listdir(marks))
        assert names == sorted(f"sigterm-{pid}" for pid in workers)  # no "kept-" folder left


@distributed(num_accelerators=2, tracking=False)
def framework_environment() -> dict[str, str | None]:
    import os

    names = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "LOCAL_SIZE",
        "CROSS_RANK",
        "CROSS_SIZE",
        "DS_ACCELERATOR",
        "ACCELERATE_USE_CPU",
    )
    return {name: os.environ.get(name) for name in names}


def test_cpu_ranks_get_the_environment_deepspeed_and_the_trainer_read() -> None:
    first, second = framework_environment.distributed()
    common = {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "LOCAL_SIZE": "2",
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "DS_ACCELERATOR": "cpu",
        "ACCELERATE_USE_CPU": "true",
    }
    assert first == {**common, "RANK": "0", "LOCAL_RANK": "0"}
    assert second == {**common, "RANK": "1", "LOCAL_RANK": "1"}


def test_values_set_in_the_kernel_win_over_the_cpu_defaults() -> None:
    old = {name: os.environ.get(name) for name in ("DS_ACCELERATOR", "ACCELERATE_USE_CPU")}
    os.environ["DS_ACCELERATOR"] = "cuda"
    os.environ["ACCELERATE_USE_CPU"] = "false"
    try:
        first, _ = framework_environment.distributed()
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    assert (first["DS_ACCELERATOR"], first["ACCELERATE_USE_CPU"]) == ("cuda", "false")
