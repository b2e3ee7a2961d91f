"""Ranks start from a fresh torch, whatever the kernel did with its own.

Ranks are forked from the helper process, which is started with ``exec`` and never
touches CUDA, never from the kernel: the kernel's torch settings, seeds and CUDA state
(``torch.cuda.init()`` on a GPU machine; not testable here) do not reach them, as they do
not reach the processes ``torchrun`` starts. Set them inside the launched code.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.kernel

STATE = (
    "%%distributed -n 2\n"
    "import random, torch, numpy\n"
    "(str(torch.get_default_dtype()), torch.initial_seed(), torch.get_num_threads(), int(os.environ['OMP_NUM_THREADS']),\n"
    " torch.are_deterministic_algorithms_enabled(), torch.is_grad_enabled(), torch.cuda.is_initialized(),\n"
    " random.random(), float(numpy.random.random()))"
)


def test_ranks_do_not_inherit_the_kernels_torch_state(kernel_factory: Any) -> None:
    # numpy.random preloaded in the helper too: each rank must still draw its own numbers.
    kernel = kernel_factory(
        extra_env={"AIR_MAGIC_PRELOAD": "torch,torch.distributed,torch.nn,torch.optim,torch.utils.data,numpy.random"},
        load=False,
    )
    try:
        kernel.ok(
            "import os, torch\n"
            "torch.set_default_dtype(torch.float64)\n"
            "torch.manual_seed(1234)\n"
            "torch.set_num_threads(1)\n"
            "torch.use_deterministic_algorithms(True)\n"
            "torch.set_grad_enabled(False)\n"
            "torch.cuda.is_available()\n"
            "kernel_tensor = torch.ones(3)"
        )
        kernel.ok("%load_ext air_magic")
        kernel.ok("%config DistributedMagics.tracking = False")
        ranks = kernel.value(STATE, timeout=120)
        assert len(ranks) == 2
        for dtype, seed, threads, omp_threads, deterministic, grad, cuda_initialized, _, _ in ranks:
            assert dtype == "torch.float32"
            assert seed != 1234
            assert threads == omp_threads  # this launch's OMP_NUM_THREADS, not the kernel's set_num_threads
            assert deterministic is False and grad is True and cuda_initialized is False
        # a fresh seed on every rank, as a process torchrun starts draws one at torch's import
        # (before, every rank of every launch had the helper's: the same dropout masks)
        assert ranks[0][1] != ranks[1][1]
        # Python's and NumPy's global generators: different in every rank
        assert ranks[0][7] != ranks[1][7]
        assert ranks[0][8] != ranks[1][8]
        # and the kernel kept its own settings
        assert kernel.value("(str(torch.get_default_dtype()), torch.initial_seed(), torch.is_grad_enabled())") == (
            "torch.float64",
            1234,
            False,
        )
    finally:
        kernel.shutdown()  # its helper must not outlive the test
