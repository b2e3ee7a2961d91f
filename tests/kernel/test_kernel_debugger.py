"""A rank's breakpoint opens pdb in the waiting cell, through the kernel's own stdin.

The front end is played with jupyter_client as JupyterLab plays it: the cell is sent with
``allow_stdin=True`` and each ``input_request`` (the rank's pdb prompt) is answered on the
stdin channel (``Kernel.run_with_stdin``).  Launches and pool cells; ``breakpoint()``,
``pdb.set_trace()``, IPython's ``set_trace()`` and ``torch.distributed.breakpoint()``; ``q``,
the notebook's Interrupt and two ranks stopped at once; and where nobody can answer
(``allow_stdin=False``, as nbclient and papermill run cells): the one-line skip, never a
hang; ``PYTHONBREAKPOINT=0``; ``AIR_MAGIC_ON_BREAKPOINT=error``.
"""

from __future__ import annotations

import re
import time
from typing import Any, Iterator

import pytest
from harness import Kernel, kernel_with_a_pool, pool_pids, rank_processes, the_pool_stays, wait_until

pytestmark = pytest.mark.kernel

STOP_BOTH = "%%distributed -n 2\nx = 5\nbreakpoint()\ny = x + 1\n(x, y)"


@pytest.fixture(scope="module")
def kernel(kernel_factory: Any) -> Iterator[Kernel]:
    k = kernel_factory()
    yield k
    k.shutdown()


def test_a_breakpoint_in_a_launch_opens_pdb_in_the_cell_and_c_ends_it_with_every_value(kernel: Kernel) -> None:
    res = kernel.run_with_stdin(STOP_BOTH, ["p x", "l", "n", "p y", "c", "c"])
    assert res.error is None, res.error_text
    assert res.result == "[(5, 6), (5, 6)]"
    # One prompt per command, rank 0's first (then rank 1's, stopped at the same line meanwhile).
    assert [p for p, _ in res.prompts] == ["(Pdb rank 0) "] * 5 + ["(Pdb rank 1) "]
    out = res.stdout
    # The breakpoint's own line (3); whether rank 1 has stopped by then too is the machine's timing.
    assert re.search(r"\[air_magic\] rank 0 stopped at a breakpoint, Cell In\[\d+\], line 3( |;)", out), out
    assert "> Cell In[" in out and "-> y = x + 1" in out  # pdb names the cell as the notebook does
    assert "\n5\n" in out and "\n6\n" in out  # p x, then p y after n
    assert "  4  ->\ty = x + 1" in out.replace("  4  \t", "  4  ->\t")  # l shows the cell's own lines
    assert "source not available" not in out
    assert "[air_magic] rank 1 stopped at a breakpoint" in out


def test_q_at_the_prompt_stops_every_rank_and_the_next_cell_works(kernel: Kernel) -> None:
    code = "%%distributed -n 2\nimport os, time\nif os.environ['RANK'] == '1':\n    breakpoint()\ntime.sleep(60)"
    res = kernel.run_with_stdin(code, ["q"], timeout=60)
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt", res.error_text
    assert "[air_magic] you quit the debugger on rank 1: every rank stops" in res.stdout
    assert wait_until(lambda: not rank_processes(), timeout=10)
    assert kernel.value("%%distributed -n 2\n1") == [1, 1]


def test_the_notebook_s_interrupt_at_the_prompt_stops_every_rank(kernel: Kernel) -> None:
    code = "%%distributed -n 2\nbreakpoint()\nimport time\ntime.sleep(60)"
    res = kernel.run_with_stdin(code, lambda prompt, res: None, timeout=60)  # Interrupt, not an answer
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt", res.error_text
    assert "[air_magic] you interrupted the debugger on rank 0: every rank stops" in res.stdout
    assert wait_until(lambda: not rank_processes(), timeout=10)


def test_pdb_set_trace_ipython_s_set_trace_and_all_c_for_two_stopped_ranks(kernel: Kernel) -> None:
    code = (
        "%%distributed -n 2\n"
        "import os\n"
        "r = int(os.environ['RANK'])\n"
        "if r == 0:\n"
        "    import pdb; pdb.set_trace()\n"
        "else:\n"
        "    from IPython.core.debugger import set_trace; set_trace()\n"
        "r * 10"
    )

    def answer(prompt: str, res: Any) -> str:
        if not res.answers:
            time.sleep(1.0)  # rank 1 stops too meanwhile
            return ":ranks"
        return ":all c"

    res = kernel.run_with_stdin(code, answer)
    assert res.error is None, res.error_text
    assert res.result == "[0, 10]"
    # Both were stopped when ':ranks' was asked (rank 1 stops while rank 0's prompt waits).
    assert "  rank 0: Cell In[" in res.stdout and "  rank 1: Cell In[" in res.stdout, res.stdout
    assert len(res.prompts) == 2


def _slow_at_rank_0(prompt: str, res: Any) -> str:
    if prompt == "(Pdb rank 0) ":
        time.sleep(7)  # longer than a rank waits for a cell that serves nobody (5 s)
    return "c"


def test_every_stopped_rank_gets_its_prompt_however_long_the_one_before_takes(kernel: Kernel) -> None:
    res = kernel.run_with_stdin(STOP_BOTH, _slow_at_rank_0, timeout=90)
    assert res.error is None, res.error_text
    assert res.result == "[(5, 6), (5, 6)]"
    assert [p for p, _ in res.prompts] == ["(Pdb rank 0) ", "(Pdb rank 1) "]
    assert "skipped" not in res.stdout + res.stderr


def test_without_stdin_a_breakpoint_is_skipped_with_one_line_and_never_hangs(kernel: Kernel) -> None:
    res = kernel.run(STOP_BOTH, timeout=60)  # allow_stdin=False, as nbclient and papermill send cells
    assert res.error is None, res.error_text
    assert res.result == "[(5, 6), (5, 6)]"
    assert res.stderr.count("breakpoint at Cell In[") == 1  # rank 0's line (rank 1's is in its log)
    assert (
        "line 3 on rank 0 skipped: there is no stdin to debug it from (PYTHONBREAKPOINT=0 turns breakpoints off)"
    ) in res.stderr


def test_pythonbreakpoint_0_is_honoured(kernel: Kernel) -> None:
    kernel.ok("import os; os.environ['PYTHONBREAKPOINT'] = '0'")
    try:
        res = kernel.run_with_stdin(STOP_BOTH, [], timeout=60)
        assert res.error is None and res.result == "[(5, 6), (5, 6)]" and not res.prompts
        assert "breakpoint" not in res.stdout + res.stderr
    finally:
        kernel.ok("del os.environ['PYTHONBREAKPOINT']")


def test_on_breakpoint_error_fails_the_rank_that_stopped(kernel: Kernel) -> None:
    kernel.ok("import os; os.environ['AIR_MAGIC_ON_BREAKPOINT'] = 'error'")
    try:
        res = kernel.run(
            "%%distributed -n 2\nimport os\nif os.environ['RANK'] == '1':\n    breakpoint()\n1", timeout=60
        )
    finally:
        kernel.ok("del os.environ['AIR_MAGIC_ON_BREAKPOINT']")
    assert res.error is not None and res.error["ename"] == "BreakpointError", res.error_text
    assert "breakpoint at Cell In[" in res.error_text and "line 4 on rank 1: there is no stdin to debug it from" in (
        res.error_text
    )


# -- in a pool: the ranks and their names stay ------------------------------------------------


@pytest.fixture(scope="module")
def pool_kernel(kernel_factory: Any) -> Iterator[Kernel]:
    yield from kernel_with_a_pool(kernel_factory, "import air_magic")


@pytest.fixture(autouse=True)
def _pool_stays(request: pytest.FixtureRequest) -> Iterator[None]:
    if "pool_kernel" not in request.fixturenames:
        yield
        return
    yield from the_pool_stays(request.getfixturevalue("pool_kernel"))


def test_a_pool_cell_steps_over_a_collective_and_c_gives_every_value(pool_kernel: Kernel) -> None:
    kernel = pool_kernel
    code = (
        "%%distributed --pool\n"
        "import torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "if dist.get_rank() == 0:\n"
        "    breakpoint()\n"
        "dist.all_reduce(t)\n"
        "t.item()"
    )
    res = kernel.run_with_stdin(code, ["p t.item()", "n", "p t.item()", "c"])
    assert res.error is None, res.error_text
    assert res.result == "[3.0, 3.0]"
    assert "\n1.0\n" in res.stdout and "\n3.0\n" in res.stdout  # before and after the all_reduce
    assert {p for p, _ in res.prompts} == {"(Pdb rank 0) "}
    assert kernel.value("%%distributed --pool\nt.item()") == [3.0, 3.0]  # the names stay


def test_q_on_a_pool_s_dist_breakpoint_keeps_the_pool_and_its_names(pool_kernel: Kernel) -> None:
    kernel = pool_kernel
    pids = pool_pids(kernel)
    kernel.ok("%%distributed --pool\nkept = 41")
    code = "%%distributed --pool\nimport torch.distributed as dist\ndist.breakpoint(rank=1)\ndist.barrier()\nkept"
    res = kernel.run_with_stdin(code, ["q"], timeout=60)
    assert [p for p, _ in res.prompts] == ["(Pdb rank 1) "]
    assert res.error is not None and res.error["evalue"] == (
        "you interrupted the pool's cell; every rank stopped it, and the pool and its state are intact."
    ), res.error_text
    assert pool_pids(kernel) == pids
    assert kernel.value("%%distributed --pool\nimport torch.distributed as dist\ndist.barrier()\nkept + 1") == [42, 42]


def test_a_pool_s_stopped_ranks_each_get_their_prompt_however_long_the_one_before_takes(
    pool_kernel: Kernel,
) -> None:
    code = "%%distributed --pool\nx = 5\nbreakpoint()\ny = x + 1\n(x, y)"
    res = pool_kernel.run_with_stdin(code, _slow_at_rank_0, timeout=90)
    assert res.error is None, res.error_text
    assert res.result == "[(5, 6), (5, 6)]"
    assert [p for p, _ in res.prompts] == ["(Pdb rank 0) ", "(Pdb rank 1) "]
    assert "skipped" not in res.stdout + res.stderr


def test_a_pool_cell_without_stdin_skips_its_breakpoint(pool_kernel: Kernel) -> None:
    res = pool_kernel.run("%%distributed --pool\nbreakpoint()\n'went on'", timeout=60)
    assert res.error is None and res.result == "['went on', 'went on']", res.error_text
    assert "on rank 0 skipped: there is no stdin to debug it from" in res.stderr


def test_pdb_on_opens_the_failing_rank_s_frames_not_the_kernel_s(kernel: Kernel) -> None:
    kernel.ok("%pdb on")
    try:
        code = (
            "%%distributed -n 2\n"
            "import os\n"
            "def f(v):\n"
            "    w = v * 2\n"
            "    return 1 / (v - 3)\n"
            "f(3 if os.environ['RANK'] == '1' else 4)"
        )
        res = kernel.run_with_stdin(code, ["p w", "u", "p v", "c"])
    finally:
        kernel.ok("%pdb off")
    assert res.error is not None and res.error["ename"] == "ZeroDivisionError", res.error_text
    # Rank 1's own frames: w and, one frame up, the cell's line; never the kernel's ipdb.
    assert [p for p, _ in res.prompts] == ["(Pdb rank 1) "] * 4, res.prompts
    assert "[air_magic] rank 1's post-mortem, where it raised: Cell In[" in res.stdout
    assert "\n6\n" in res.stdout and "-> f(3 if os.environ['RANK'] == '1' else 4)" in res.stdout
    assert "ipdb>" not in res.stdout


def test_distributed_debug_opens_the_failed_rank_s_post_mortem_in_a_pool(pool_kernel: Kernel) -> None:
    kernel = pool_kernel
    failed = kernel.run(
        "%%distributed --pool\nimport os\nq = 10\nif os.environ['RANK'] == '1':\n    raise ValueError(q)\nq"
    )
    assert failed.error is not None and failed.error["ename"] == "ValueError"
    assert (
        "[air_magic] %distributed_debug opens rank 1's post-mortem (pdb in its frames) until the next pool cell."
        in (failed.error_text)
    )
    res = kernel.run_with_stdin("%distributed_debug", ["p q", "q"])
    assert res.error is None, res.error_text
    assert [p for p, _ in res.prompts] == ["(Pdb rank 1) "] * 2
    assert "ValueError: 10" in res.stdout and "\n10\n" in res.stdout
    assert "[air_magic] rank 1's post-mortem ended" in res.stdout
    # Once left, the rank has let the exception go.
    again = kernel.run("%distributed_debug 1")  # (a UsageError: IPython shows its line on stderr)
    assert again.stderr.strip() == (
        "UsageError: %distributed_debug: rank 1 of the pool keeps no exception: the last pool cell did not fail "
        "there (a rank keeps its exception until the next pool cell)."
    )
    bad = kernel.run("%distributed_debug 5")
    assert bad.stderr.strip() == "UsageError: %distributed_debug: the pool has ranks 0 to 1, not 5."
    assert kernel.value("%%distributed --pool\nq + 1") == [11, 11]


def test_while_its_prompt_waits_the_rank_reads_paused_where_it_is(kernel: Kernel) -> None:
    """What the panel and the sidebar read (``panel._state.rank_state``): the rank's paused
    file, with the breakpoint's place, there while it waits in pdb and gone after."""
    import glob
    import tempfile

    pattern = f"{tempfile.gettempdir()}/air_magic-{kernel.pid}-*/*/debug-0.paused"
    seen: list[list[str]] = []

    def answer(prompt: str, res: Any) -> str:
        seen.append([open(path).read() for path in glob.glob(pattern)])
        return "c"

    res = kernel.run_with_stdin("%%distributed -n 1\nx = 1\nbreakpoint()\nx", answer)
    assert res.error is None and res.result == "[1]", res.error_text
    assert len(seen) == 1 and len(seen[0]) == 1 and re.fullmatch(r"Cell In\[\d+\], line 3", seen[0][0]), seen
    assert not glob.glob(pattern)


def test_a_background_launch_waits_at_its_breakpoint_for_launch_debug(kernel: Kernel) -> None:
    kernel.ok("%%distributed -n 2 --async\nx = 5\nbreakpoint()\nx + 1")
    kernel.ok("h = _", timeout=10)
    time.sleep(6.0)  # longer than a waited launch's rank gives the kernel: a background one waits on
    res = kernel.run_with_stdin("h.debug()", ["p x", "c", "c"])
    assert res.error is None, res.error_text
    assert [p for p, _ in res.prompts] == ["(Pdb rank 0) ", "(Pdb rank 0) ", "(Pdb rank 1) "], res.prompts
    assert "\n5\n" in res.stdout
    assert kernel.value("h.result(timeout=30)") == [6, 6]


def test_help_and_interact_at_a_function_s_breakpoint(kernel: Kernel) -> None:
    """An ``@distributed`` function's breakpoint; ``help`` lists air_magic's commands before
    pdb's; ``interact`` is a console in the same input box, ``exit()`` returns to pdb."""
    kernel.ok(
        "from air_magic import distributed\n"
        "@distributed(num_accelerators=1, accelerator_type='CPU', tracking=False)\n"
        "def train(x):\n"
        "    breakpoint()\n"
        "    return x"
    )
    res = kernel.run_with_stdin("train.distributed(5)", ["help", "interact", "x * 3", "exit()", "p x", "c"])
    assert res.error is None and res.result == "[5]", res.error_text
    assert [p for p, _ in res.prompts] == ["(Pdb rank 0) "] * 2 + [">>> "] * 2 + ["(Pdb rank 0) "] * 2
    out = res.stdout
    assert out.index(":all CMD   send CMD to every rank stopped now") < out.index("Documented commands")
    assert "*interactive* (Ctrl-D or exit() returns to pdb)" in out and "\n15\n" in out


def test_where_starts_at_the_user_s_code_not_at_the_frames_that_run_the_rank(kernel: Kernel) -> None:
    code = "%%distributed -n 1\ndef inner():\n    breakpoint()\n    return 1\ninner()"
    res = kernel.run_with_stdin(code, ["w", "u", "u", "c"])
    assert res.error is None and res.result == "[1]", res.error_text
    assert "zygote" not in res.stdout and "air_magic/rank" not in res.stdout and "<frozen" not in res.stdout
    assert "-> inner()" in res.stdout and "*** Oldest frame" in res.stdout  # u stops at the cell
