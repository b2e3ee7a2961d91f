"""One-line hints for failure signatures found in a failing rank's traceback and log.

A data table: (substrings to look for, hint); a row's hint is given once when any
of its substrings occurs.  ``CPU_HINTS`` only apply to launches on CPU ranks, where
code written for GPUs fails in ways that say nothing about CPU ranks.
"""

from __future__ import annotations

__all__ = ["HINTS", "CPU_HINTS", "hints_for"]

HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("CUDA out of memory", "OutOfMemoryError"),
        "hint: the GPU ran out of memory. Lower the batch size, use mixed precision or "
        "activation checkpointing, or shard the model (FSDP, DeepSpeed ZeRO).",
    ),
    (
        ("Watchdog caught collective operation timeout",),
        "hint: an NCCL collective timed out: one rank stopped calling collectives (an exception, "
        "an uneven number of batches, a rank-dependent branch). Check that every rank runs the "
        "same collectives in the same order.",
    ),
    (("NCCL timeout",), "hint: an NCCL collective timed out: check that every rank runs the same collectives."),
    (
        ("Xid",),
        "hint: the log mentions an NVIDIA Xid error: a GPU or driver fault. Check `nvidia-smi` and "
        "the system log (dmesg) before retrying.",
    ),
    (
        ("does not match environment run ID",),
        "hint: mlflow.set_experiment() (or a run id) was used inside the distributed code. Call "
        "mlflow.set_experiment() in the notebook before launching; the ranks log to the launch's run.",
    ),
    (
        ("Duplicate GPU detected",),
        "hint: two ranks use the same GPU. Select the device with "
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before init_process_group().",
    ),
    (
        ("invalid device ordinal",),
        "hint: the rank asked for a GPU it cannot see. Its CUDA_VISIBLE_DEVICES holds the GPUs its launch "
        "claimed (on MIG instances, one per rank, which it sees as cuda:0): pick the device with "
        "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) on whole GPUs, torch.cuda.set_device(0) on MIG.",
    ),
    (
        ("Address already in use",),
        "hint: a port is taken. Do not set MASTER_PORT yourself: each launch gets its own free port.",
    ),
)


#: Code that asks for CUDA or NCCL, run on CPU ranks (a CPU build of torch, or no GPU visible).
CPU_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        (
            "_cuda_setDevice",
            "Torch not compiled with CUDA enabled",
            "No CUDA GPUs are available",
            "Found no NVIDIA driver",
            "doesn't have NCCL built in",
            "ProcessGroupNCCL is only supported with GPUs",
            "device_ids and output_device arguments only work",
            "Attempting to deserialize object on a CUDA device",
        ),
        "hint: these ranks run on CPU (no GPU was asked for or found), and the code asks for CUDA or "
        'NCCL. Write it so that it runs on both: torch.device(f"cuda:{local_rank}" if '
        'torch.cuda.is_available() else "cpu"), torch.cuda.set_device(...) only if '
        "torch.cuda.is_available(), dist.init_process_group() without a backend (it picks NCCL on "
        "GPUs and gloo on CPU), and DDP(model, device_ids=None) on CPU. `air-magic lint --fix` "
        "makes these changes (rules AM4xx).",
    ),
    (
        (
            "Cannot access accelerator device when none is available",
            "device_id parameter must be an accelerator with an index",
        ),
        "hint: these ranks run on CPU (no GPU was asked for or found), and the code asks for an "
        "accelerator: a rank's number as a device (model.to(local_rank)), "
        "torch.accelerator.set_device_index(...), or init_process_group(device_id=...). Write it so that "
        'it runs on both: device = torch.accelerator.current_accelerator() or torch.device("cpu"), '
        "model.to(device), set_device_index(...) only if torch.accelerator.is_available(), and "
        "device_id=None on CPU. `air-magic lint --fix` makes these changes (rules AM405-AM409).",
    ),
)


def hints_for(text: str, device: str = "cuda") -> list[str]:
    """The hints whose signature occurs in ``text``, in table order (``device``: where the
    ranks ran, ``"cuda"`` or ``"cpu"``)."""
    table = HINTS + CPU_HINTS if device == "cpu" else HINTS
    return [hint for needles, hint in table if any(needle in text for needle in needles)]
