"""Hangs that FSDP2's and DeepSpeed's hooks make, in a real kernel's pool of 2 CPU ranks: a rank
that skips a step leaves its peer waiting in a collective the framework issued from inside
``backward()`` or ``forward()``; the report names it at the user's line, Ctrl-C stops it there
(the collective never completes), every gloo group (DeepSpeed's own included) is rebuilt, the
framework's half-done step is put back, and the next steps train on every rank.  A ZeRO-3
engine stopped by ``q`` at a breakpoint trains on too."""

from __future__ import annotations

import ast
import re
import time
from typing import Any, Iterator

import pytest
from harness import CellResult, Kernel, kernel_with_a_pool, reports, the_pool_stays
from pool_training import CHECK, SETUP, consistent

pytestmark = pytest.mark.kernel

DEEPSPEED = """%%distributed --pool
import deepspeed
torch.manual_seed(0)
ds_net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": STAGE}}
ds_engine, _, _, _ = deepspeed.initialize(model=ds_net, model_parameters=ds_net.parameters(), config=config)
del ds_net


def ds_step(i):
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + i)
    x, y = torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)
    loss = F.mse_loss(ds_engine(x), y)
    ds_engine.backward(loss)
    ds_engine.step()
    return float(loss)
"""

DS_CHECK = """%%distributed --pool
losses = [ds_step(100 + i) for i in range(3)]
(ds_engine.global_steps, all(l == l for l in losses))"""


@pytest.fixture(scope="module")
def pool(kernel_factory: Any) -> Iterator[Kernel]:
    first = "import os\nos.environ['AIR_MAGIC_HANG_SECONDS'] = '2'\nos.environ['DS_ACCELERATOR'] = 'cpu'"
    for kernel in kernel_with_a_pool(kernel_factory, first):
        kernel.ok(SETUP["fsdp2"], timeout=120)
        yield kernel


@pytest.fixture(autouse=True)
def _pool_stays(pool: Kernel) -> Iterator[None]:
    yield from the_pool_stays(pool)


def stuck_then_interrupted(kernel: Kernel, code: str) -> tuple[CellResult, CellResult]:
    msg_id = kernel.execute(code)
    shown = kernel.collect(msg_id, timeout=60, until=lambda res: bool(reports(res)))
    assert reports(shown), f"no hang report: {shown.stdout[-2000:]}"
    kernel.km.interrupt_kernel()
    return shown, kernel.collect(msg_id, timeout=90)


def test_an_fsdp2_step_one_rank_skipped_is_reported_and_ctrl_c_leaves_one_model(pool: Kernel) -> None:
    code = (
        "%%distributed --pool\nfor i in range(3):\n    if dist.get_rank() == 1 and i == 1:\n        continue\n"
        "    x, y = batch()\n    opt.zero_grad()\n    loss = loss_fn(model(x), y)\n    loss.backward()\n"
        "    opt.step()\n    steps += 1"
    )
    shown, rest = stuck_then_interrupted(pool, code)
    verdict = reports(shown)[-1].splitlines()[0]
    assert re.fullmatch(
        r"\[air_magic\] hang report: rank 1 has ended \(finished the call\) while rank 0 waits in \S+ #\d+ "
        r"\(Cell In\[\d+\]:\d+ in <module>, FSDP's [a-z-]+\)",
        verdict,
    ), verdict
    assert rest.error is not None and re.fullmatch(
        r"you interrupted the pool's cell; rank 0 waited in .*, so it was stopped there: the process group was "
        r"rebuilt; your names are kept, and their state is intact\.",
        rest.error["evalue"],
    ), rest.error_text
    assert re.search(r"checked on every rank: .*model \(29 of 29 parameters DTensors\)", rest.error_text), (
        rest.error_text
    )
    # The ranks' steps differ (rank 1 skipped one): the check said nothing of a loop counter, so
    # this test evens it, then trains.
    pool.ok("%%distributed --pool\nsteps = 0")
    check = pool.run(CHECK, timeout=120)
    assert check.error is None, check.error_text
    assert not consistent(ast.literal_eval(check.result or "[]"))


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_step_one_rank_skipped_is_reported_and_ctrl_c_leaves_an_engine_that_trains(
    pool: Kernel, stage: int
) -> None:
    pool.ok(DEEPSPEED.replace("STAGE", str(stage)), timeout=300)
    code = (
        "%%distributed --pool\nfor i in range(4):\n    if dist.get_rank() == 1 and i == 2:\n        continue\n"
        "    ds_step(i)"
    )
    shown, rest = stuck_then_interrupted(pool, code)
    verdict = reports(shown)[-1].splitlines()[0]
    assert re.fullmatch(
        r"\[air_magic\] hang report: rank 1 has ended \(finished the call\) while rank 0 waits in \S+ #\d+ "
        r"\(Cell In\[\d+\]:\d+ in ds_step, DeepSpeed's \S+\)",
        verdict,
    ), verdict
    assert rest.error is not None and rest.error["evalue"].endswith(
        "so it was stopped there: the process group was rebuilt; your names are kept, and their state is intact."
    ), rest.error_text
    assert "put back: ds_engine: DeepSpeed's unfinished step dropped (gradients cleared) (every rank)" in (
        rest.error_text
    )
    res = pool.run(DS_CHECK, timeout=120)
    assert res.error is None, res.error_text
    (steps0, ok0), (steps1, ok1) = ast.literal_eval(res.result or "[]")
    assert steps0 == steps1 and ok0 and ok1, res.result


def test_q_at_a_breakpoint_in_a_zero3_step_stops_every_rank_at_one_point(pool: Kernel) -> None:
    pool.ok(DEEPSPEED.replace("STAGE", "3"), timeout=300)
    code = (
        "%%distributed --pool\nfor i in range(50):\n    g = torch.Generator().manual_seed(i)\n"
        "    loss = F.mse_loss(ds_engine(torch.randn(4, 16, generator=g)), torch.randn(4, 4, generator=g))\n"
        "    if dist.get_rank() == 1 and i == 3:\n        breakpoint()\n    ds_engine.backward(loss)\n"
        "    ds_engine.step()\n    time.sleep(0.01)"
    )
    pool.ok("%%distributed --pool\nimport time")
    began = time.monotonic()
    res = pool.run_with_stdin(code, ["q"], timeout=120)
    assert [p for p, _ in res.prompts] == ["(Pdb rank 1) "]
    assert res.error is not None and res.error["evalue"].startswith("you interrupted the pool's cell; "), res.error_text
    assert (
        "their state is intact" in res.error["evalue"] or "the pool and its state are intact" in (res.error["evalue"])
    ), res.error_text
    assert time.monotonic() - began < 60
    res = pool.run(DS_CHECK, timeout=120)
    assert res.error is None, res.error_text
    (steps0, ok0), (steps1, ok1) = ast.literal_eval(res.result or "[]")
    assert steps0 == steps1 and ok0 and ok1, res.result
