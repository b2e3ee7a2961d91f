"""Items per second through air_magic.data.StreamingDataset against a plain DataLoader.

    python benchmarks/data/run.py [--files 4000] [--size 4096]

2 ranks x 2 DataLoader workers each read every file of a folder once (one epoch):
(1) a plain torch DataLoader over a map-style dataset of the same local paths with a
DistributedSampler; (2) StreamingDataset over the local folder; (3) StreamingDataset over
the same files behind an fsspec "remote" (memory://, filled in each rank) with a cold
cache, then (4) the same again with the cache warm. Each rank times its own epoch; the
table shows items/s summed over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from air_magic import distributed


@distributed(num_accelerators=2, tracking=False, timeout=1800)
def epoch(folder: str, mode: str, files: int, size: int) -> dict:
    import shutil

    import fsspec
    import torch.distributed as dist
    from torch.utils.data import DataLoader as TorchLoader
    from torch.utils.data import Dataset, DistributedSampler

    from air_magic.data import DataLoader, StreamingDataset

    dist.init_process_group()
    results = {}
    if mode == "plain":
        paths = sorted(str(p) for p in Path(folder).rglob("*") if p.is_file())

        class Files(Dataset):
            def __len__(self) -> int:
                return len(paths)

            def __getitem__(self, i: int) -> bytes:
                with open(paths[i], "rb") as handle:
                    return handle.read()

        loader = TorchLoader(Files(), sampler=DistributedSampler(Files(), seed=0), batch_size=None, num_workers=2)
        runs = {"plain DataLoader (local files)": loader}
    elif mode == "local":
        runs = {
            "StreamingDataset (local files)": DataLoader(
                StreamingDataset(folder, output="bytes"), batch_size=None, num_workers=2
            )
        }
    else:
        fs = fsspec.filesystem("memory")
        payload = b"x" * size
        for i in range(files):
            fs.pipe(f"/bench/f{i:06d}", payload)
        cache = tempfile.mkdtemp(prefix="air-magic-bench-cache-")
        dataset = StreamingDataset("memory://bench", output="bytes", cache_dir=cache)
        runs = {
            "StreamingDataset (memory:// remote, cold cache)": DataLoader(dataset, batch_size=None, num_workers=2),
            "StreamingDataset (memory:// remote, warm cache)": DataLoader(dataset, batch_size=None, num_workers=2),
        }
    for name, loader in runs.items():
        dist.barrier()
        start = time.perf_counter()
        count = sum(1 for _ in loader)
        results[name] = (count, time.perf_counter() - start)
    if mode == "memory":
        shutil.rmtree(cache, ignore_errors=True)
    dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4000)
    parser.add_argument("--size", type=int, default=4096, help="bytes per file")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="air-magic-bench-data-")
    for i in range(args.files):
        sub = Path(folder) / f"d{i % 16:02d}"
        sub.mkdir(exist_ok=True)
        (sub / f"f{i:06d}").write_bytes(b"x" * args.size)
    table = {}
    for mode in ("plain", "local", "memory"):
        per_rank = epoch.distributed(folder, mode, args.files, args.size)
        for name in per_rank[0]:
            items = sum(r[name][0] for r in per_rank)
            seconds = max(r[name][1] for r in per_rank)
            table[name] = {"items": items, "seconds": seconds, "items_per_s": items / seconds}
    base = table["plain DataLoader (local files)"]["items_per_s"]
    print(
        f"{args.files} files of {args.size} B, 2 ranks x 2 workers, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}\n"
    )
    print("| reader | items | seconds | items/s | ÷ plain DataLoader |\n|---|---|---|---|---|")
    for name, row in table.items():
        print(
            f"| {name} | {row['items']} | {row['seconds']:.2f} | {row['items_per_s']:.0f} | "
            f"{row['items_per_s'] / base:.2f} |"
        )
    out = Path(__file__).with_name("results.json")
    out.write_text(json.dumps({"files": args.files, "size": args.size, "results": table}, indent=1))


if __name__ == "__main__":
    main()
