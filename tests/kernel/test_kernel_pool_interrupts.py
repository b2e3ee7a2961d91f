"""One model, whatever stops it: interrupts of a pool's DDP and FSDP2 training on 2 ranks, in
a real kernel, the way a notebook sends them (Jupyter's stop button; ``q`` typed at a
breakpoint's prompt).  Every try leaves equal step counts and replicated weights on every
rank, every FSDP2 parameter a DTensor, and ten more steps that train; the cell says "intact"
only after the pool compared the ranks.  The short version of ``benchmarks/consistency``;
then what the pool says when the ranks' state does differ, and ``pool.sync``, which repairs it.
"""

from __future__ import annotations

import ast
import random
import re
import time
from typing import Any, Iterator

import pytest
from harness import Kernel, kernel_with_a_pool, the_pool_stays
from pool_training import CHECK, INTACT, INTACT_REBUILT, SETUP, TRAIN, consistent

pytestmark = pytest.mark.kernel

TRIES = 3


def _stop(kernel: Kernel, mode: str, rng: random.Random) -> Any:
    if mode == "ctrl-c":
        msg_id = kernel.execute(TRAIN)
        time.sleep(rng.uniform(0.3, 1.2))  # from the cell's start: the ranks train meanwhile
        kernel.km.interrupt_kernel()
        return kernel.collect(msg_id, timeout=120)
    where = mode.removeprefix("q-").replace("-", "_")
    kernel.ok(f"%%distributed --pool\nstop = ({rng.randrange(2)}, steps + {rng.randrange(4)}, {where!r})")
    res = kernel.run_with_stdin(TRAIN, ["q"], timeout=120)
    assert len(res.prompts) == 1, res.prompts
    return res


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_ctrl_c_or_q_anywhere_in_training_leaves_one_model_on_every_rank(kernel_factory: Any, kind: str) -> None:
    kernel = kernel_factory()
    try:
        kernel.ok("%distributed_pool -n 2 --no-tracking", timeout=180)
        kernel.ok(SETUP[kind], timeout=120)
        rng = random.Random(f"{kind}-interrupts")
        for n in range(TRIES):
            for mode in ("ctrl-c", "q-before-backward", "q-before-step"):
                res = _stop(kernel, mode, rng)
                assert res.error is not None, f"{mode}, try {n + 1}: the cell did not stop"
                assert res.error["ename"] == "KeyboardInterrupt", f"{mode}, try {n + 1}: {res.error_text[-3000:]}"
                said = res.error["evalue"]
                # q stops every rank at its breakpoint's step; a Ctrl-C may find a rank already
                # waiting in a collective its peer stopped before (cut free, the group rebuilt).
                cut = mode == "ctrl-c" and INTACT_REBUILT.fullmatch(said) is not None
                assert said == INTACT or cut, f"{mode}, try {n + 1}: {res.error_text[-3000:]}"
                # What the pool checked, said once under the headline.
                assert re.search(r"\[air_magic\] .*checked on every rank: .*model \(", res.error_text), res.error_text
                check = kernel.run(CHECK, timeout=120)
                assert check.error is None, f"{mode}, try {n + 1}, the next cell: {check.error_text[-3000:]}"
                why = consistent(ast.literal_eval(check.result or "[]"))
                assert not why, f"{mode}, try {n + 1}: {why}"
    finally:
        kernel.shutdown()


@pytest.fixture(scope="module")
def ddp(kernel_factory: Any) -> Iterator[Kernel]:
    for kernel in kernel_with_a_pool(kernel_factory, "import air_magic"):
        kernel.ok(SETUP["ddp"], timeout=120)
        yield kernel


@pytest.fixture(autouse=True)
def _pool_stays(request: pytest.FixtureRequest) -> Iterator[None]:
    if "ddp" not in request.fixturenames:
        yield
        return
    yield from the_pool_stays(request.getfixturevalue("ddp"))


def _interrupted(kernel: Kernel, code: str) -> Any:
    msg_id = kernel.execute(code)
    time.sleep(1.5)
    kernel.km.interrupt_kernel()
    res = kernel.collect(msg_id, timeout=60)
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt", res.error_text
    return res


def test_ranks_whose_weights_and_steps_differ_are_named_and_pool_sync_repairs_them(ddp: Kernel) -> None:
    # Rank 1 takes a step of its own, on gradients of its own: its weights and step count move apart.
    code = (
        "%%distributed --pool\nimport time\nif dist.get_rank() == 1:\n    for p in model.parameters():\n"
        "        p.grad = torch.ones_like(p)\n    opt.step()\ntime.sleep(60)"
    )
    res = _interrupted(ddp, code)
    said = res.error["evalue"]
    assert said.startswith("you interrupted the pool's cell; every rank stopped it, but their state differs: "), said
    assert "model: rank 0 and rank 1 differ in 4 of 4 tensors" in said, said
    assert re.search(r"opt: (\d+|no) steps? on rank 0, \d+ steps? on rank 1", said), said
    assert said.endswith(
        "pool.sync('model', 'opt') copies rank 0's to the others (air_magic.Pool.current().sync(...)), or run the "
        "cells that build them again."
    ), said
    copied = ddp.value("import air_magic\nair_magic.Pool.current().sync('model', 'opt')")
    assert copied == ["model: 4 tensors", "opt: the state of its 0 parameters"]
    res = _interrupted(ddp, "%%distributed --pool\nimport time\ntime.sleep(60)")
    assert res.error["evalue"] == INTACT, res.error_text
    assert "checked on every rank: model (4 tensors), opt (" in res.error_text, res.error_text


def test_pool_sync_refuses_what_it_cannot_copy_with_one_line_each(ddp: Kernel) -> None:
    def refusal(call: str) -> str:
        res = ddp.run(f"import air_magic\nair_magic.Pool.current().{call}")
        assert res.error is not None, call
        return f"{res.error['ename']}: {res.error['evalue']}"

    assert refusal("sync()") == "ValueError: pool.sync needs the names to copy: pool.sync('model', 'opt')"
    assert refusal("sync('nope')") == "ValueError: pool.sync: 'nope' is not defined on the ranks"
    assert refusal("sync('steps')") == (
        "ValueError: pool.sync: 'steps' is a builtins.int: pool.sync copies modules and optimizers (pool.push sends "
        "any value from the notebook)"
    )
    assert refusal("sync('model', from_rank=2)") == (
        "ValueError: pool.sync: rank 2 is not one of the pool's ranks (0 to 1)"
    )
    ddp.ok(
        "%%distributed --pool\nfrom torch.distributed.fsdp import fully_shard\nsharded = nn.Linear(4, 4)\n"
        "fully_shard(sharded)\nNone"
    )
    assert refusal("sync('sharded')") == (
        "ValueError: pool.sync: 'sharded' is sharded (FSDP2 or tensor parallel: DTensor parameters): each rank holds "
        "its own part, so no rank has the others' to send; load a checkpoint on every rank instead"
    )
    ddp.ok("%%distributed --pool\ndel sharded")
    # Nothing was left half-way: the pool still trains.
    assert ddp.value("%%distributed --pool\nx, y = batch()\nloss_fn(model(x), y).backward()\nopt.step()\n1") == [1, 1]


NOT_SENT = (
    "you interrupted the pool's cell before it reached the ranks: nothing ran there, and the pool and its state "
    "are as they were."
)


def test_ctrl_c_while_a_large_cell_is_pickled_or_sent_keeps_the_pool_in_step(ddp: Kernel) -> None:
    """A cell that names 200 MB of the notebook's takes a second or more to pickle and send:
    a Ctrl-C while it is pickled says nothing reached the ranks; one while it goes out is held
    until every rank has it, then interrupts the call (a message cut half-way had left the
    connections out of step: the next cell broke the pool).  One line either way, and the next
    cell runs on the same model."""
    ddp.ok("import numpy as np\nblob = np.ones(25 * 2**20)")
    said = []
    for delay in (0.05, 0.4, 0.8):
        msg_id = ddp.execute("%%distributed --pool\nfloat(blob[:4].sum())")
        time.sleep(delay)
        ddp.km.interrupt_kernel()
        res = ddp.collect(msg_id, timeout=120)
        if res.error is not None:
            assert res.error["ename"] == "KeyboardInterrupt" and res.error["evalue"] in (NOT_SENT, INTACT), (
                res.error_text[-3000:]
            )
            assert res.error_text.splitlines()[0] == f"KeyboardInterrupt: {res.error['evalue']}", res.error_text
            said.append(res.error["evalue"])
        else:  # (the cell was done before the interrupt came)
            said.append(res.result)
        check = ddp.run(CHECK, timeout=120)
        assert check.error is None, f"after a Ctrl-C {delay} s in ({said[-1]}): {check.error_text[-3000:]}"
        assert not consistent(ast.literal_eval(check.result or "[]"))
    ddp.ok("del blob")


def test_after_a_rebuilt_group_q_stops_the_ranks_at_one_point_without_cutting_them(ddp: Kernel) -> None:
    """A hang's Ctrl-C rebuilds the group; then ``q`` before ``loss.backward()`` on rank 1 stops
    both ranks where they agree (rank 0 is not left in its gradient all-reduce and cut free):
    the ranks compare the rebuilt group's own count of collectives, not the first backend's,
    frozen at the rebuild (every interrupt after a rebuild had cut and rebuilt again, 2 s)."""
    hang = ddp.execute("%%distributed --pool\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1))")
    time.sleep(2.0)
    ddp.km.interrupt_kernel()
    res = ddp.collect(hang, timeout=60)
    assert res.error is not None and "the process group was rebuilt" in res.error["evalue"], res.error_text
    for _ in range(2):
        ddp.ok("%%distributed --pool\nstop = (1, steps + 1, 'before_backward')")
        res = ddp.run_with_stdin(TRAIN, ["q"], timeout=120)
        assert res.error is not None and res.error["evalue"] == INTACT, res.error_text[-3000:]
    check = ddp.run(CHECK, timeout=120)
    assert check.error is None and not consistent(ast.literal_eval(check.result or "[]")), check.error_text
