"""Ctrl-C at random points of a pool's DDP and FSDP2 training on 2 ranks, in a real kernel
as Jupyter's stop button sends it: every try leaves the pool and its model intact, with both
ranks at the same step (the short version of ``benchmarks/pool/interrupts.py``)."""

from __future__ import annotations

import ast
import random
import time
from typing import Any

import pytest
from pool_training import CHECK, INTACT, SETUP, TRAIN

pytestmark = pytest.mark.kernel

TRIES = 6


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_ctrl_c_anywhere_in_training_leaves_the_pool_and_its_model_intact(kernel_factory: Any, kind: str) -> None:
    kernel = kernel_factory()
    try:
        kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
        kernel.ok(SETUP[kind], timeout=120)
        rng = random.Random(f"{kind}-interrupts")
        total = 0
        for n in range(TRIES):
            msg_id = kernel.execute(TRAIN)
            time.sleep(rng.uniform(0.3, 1.2))  # from the cell's start: the ranks train meanwhile
            kernel.km.interrupt_kernel()
            res = kernel.collect(msg_id, timeout=120)
            assert res.error is not None, f"try {n + 1}: the cell did not stop"
            assert (res.error["ename"], res.error["evalue"]) == ("KeyboardInterrupt", INTACT), (
                f"try {n + 1}: {res.error_text[-3000:]}"
            )
            check = kernel.run(CHECK, timeout=120)
            assert check.error is None, f"try {n + 1}, the next cell: {check.error_text[-3000:]}"
            steps = ast.literal_eval(check.result or "[]")
            assert len(steps) == 2 and steps[0] == steps[1], f"try {n + 1}: the ranks are steps apart: {steps}"
            assert steps[0] >= total + 2
            total = steps[0]
    finally:
        kernel.shutdown()
