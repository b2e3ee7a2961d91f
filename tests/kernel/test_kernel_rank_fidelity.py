"""Code from anywhere runs unchanged in a rank: script arguments, IPython's builtins,
``display``, CUDA code on CPU ranks, and how a failure names every rank's end."""

from __future__ import annotations

import ast
from typing import Any, Iterator

import pytest
from harness import Kernel, strip_ansi

pytestmark = pytest.mark.kernel

ARGPARSE = """
import argparse, sys
parser = argparse.ArgumentParser(description="a training script")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--name", default="run")
parser.add_argument("data", nargs="?")
args = parser.parse_args()
(args.lr, args.name, args.data, sys.argv)"""


@pytest.fixture(scope="module")
def k(kernel: Kernel) -> Iterator[Kernel]:
    kernel.ok("from air_magic import distributed")
    yield kernel


def values(res: Any) -> Any:
    assert res.error is None, res.error_text
    assert res.result is not None, f"no Out; stdout={res.stdout!r}"
    return ast.literal_eval(res.result)


# -- sys.argv ---------------------------------------------------------------------------------


def test_an_argparse_script_takes_its_defaults_and_argv_is_the_cell_name(k: Kernel) -> None:
    res = k.run("%%distributed -n 2" + ARGPARSE)
    n = res.reply["execution_count"]
    assert values(res) == [(0.1, "run", None, [f"Cell In[{n}]"])] * 2


def test_arguments_after_double_dash_reach_the_script_split_like_a_shell(k: Kernel) -> None:
    res = k.run("%%distributed -n 2 --timeout 60 -- --lr 0.5 --name 'my run' data.csv" + ARGPARSE)
    n = res.reply["execution_count"]
    assert (
        values(res)
        == [(0.5, "my run", "data.csv", [f"Cell In[{n}]", "--lr", "0.5", "--name", "my run", "data.csv"])] * 2
    )


def test_a_script_s_own_usage_error_names_the_cell_and_both_ranks(k: Kernel) -> None:
    res = k.run("%%distributed -n 2 -- --lr fast" + ARGPARSE)
    n = res.reply["execution_count"]
    said = f"Cell In[{n}]: error: argument --lr: invalid float value: 'fast'"
    error = strip_ansi("\n".join(res.error["traceback"]))
    # In the cell as rank 0 printed it (on stderr, as argparse writes it); or, when rank 1
    # failed first and rank 0 was stopped before its parser ran (a loaded machine), with the
    # error, as rank 1 printed it.
    assert said in res.stderr or "rank 1 printed before it exited (" in error and said in error, error
    assert res.error["ename"] == "RankFailedError", error
    # the error's own line (notes, such as what rank 1 printed, follow it)
    summary = next((line for line in error.splitlines() if line.startswith("RankFailedError: ")), error)
    assert summary.startswith("RankFailedError: rank ")
    assert "raised SystemExit: 2; rank " in summary
    # the other rank failed on its own the same way: said so, not "stopped"
    assert summary.endswith("failed too (SystemExit: 2).") or summary.endswith("was stopped by air_magic."), summary


def test_a_usage_error_on_a_rank_the_cell_does_not_show_comes_with_the_error(k: Kernel) -> None:
    cell = (
        "%%distributed -n 2 -- --lr fast\nimport os, time\nif os.environ['RANK'] == '0':\n    time.sleep(60)" + ARGPARSE
    )
    res = k.run(cell)
    n = res.reply["execution_count"]
    error = strip_ansi("\n".join(res.error["traceback"]))
    assert res.error["ename"] == "RankFailedError", error
    assert "rank 1 of 2 raised SystemExit: 2; rank 0 was stopped by air_magic." in error
    printed = error[error.index("[air_magic] rank 1 printed before it exited (") :]
    assert printed.splitlines()[1:3] == [
        f"usage: Cell In[{n}] [-h] [--lr LR] [--name NAME] [data]",
        f"Cell In[{n}]: error: argument --lr: invalid float value: 'fast'",
    ]
    assert "error: argument" not in res.stdout  # rank 0 never parsed


def test_hydra_reads_its_overrides_from_the_magic_line(k: Kernel) -> None:
    cell = (
        "%%distributed -n 2 -- +lr=0.3 +model.depth=4\n"
        "import hydra\n"
        "from omegaconf import OmegaConf\n"
        "seen = {}\n"
        "@hydra.main(version_base=None, config_path=None, config_name=None)\n"
        "def main(cfg):\n"
        "    seen.update(OmegaConf.to_container(cfg))\n"
        "main()\n"
        "seen"
    )
    assert values(k.run(cell, timeout=120)) == [{"lr": 0.3, "model": {"depth": 4}}] * 2


def test_an_unbalanced_quote_on_the_magic_line_is_a_usage_error(k: Kernel) -> None:
    res = k.run("%%distributed -n 2 -- --name 'oops\n1")
    assert res.reply["status"] == "error"
    assert (
        "UsageError: %%distributed: cannot read the options (No closing quotation): -n 2 -- --name 'oops" in res.stderr
    )


def test_the_help_says_how_to_pass_script_arguments(k: Kernel) -> None:
    res = k.ok("print(get_ipython().find_cell_magic('distributed').__doc__)")
    assert "everything after ``--`` on the magic line becomes the\nranks' ``sys.argv[1:]``" in res.stdout
    assert "%%distributed -n 2 -- --lr 0.01 --epochs 3" in res.stdout


def test_a_decorated_function_sees_its_own_name_as_argv(k: Kernel) -> None:
    k.ok("@distributed(num_accelerators=2)\ndef trainer():\n    import sys\n    return sys.argv")
    assert k.value("trainer.distributed()") == [["trainer"], ["trainer"]]


# -- IPython's builtins -------------------------------------------------------------------------


def test_exit_and_quit_in_a_notebook_function_do_not_stop_it_from_launching(k: Kernel) -> None:
    k.ok(
        "def finish(code):\n"
        "    if code is None:\n"
        "        return 'done'\n"
        "    exit(code)\n"
        "@distributed(num_accelerators=2)\n"
        "def uses_exit(code=None):\n"
        "    import os\n"
        "    if os.environ['RANK'] == '1' and code:\n"
        "        quit(code)\n"
        "    return finish(None)\n"
    )
    assert k.value("uses_exit.distributed()") == ["done", "done"]
    res = k.run("uses_exit.distributed(3)")
    assert res.error["ename"] == "RankFailedError"
    assert res.error["traceback"][-1] == "RankFailedError: rank 1 of 2 raised SystemExit: 3; rank 0 finished."


def test_exit_in_a_cell_ends_the_rank_like_sys_exit(k: Kernel) -> None:
    assert values(
        k.run("%%distributed -n 2\nimport os\nif os.environ['RANK'] == '0':\n    exit()\nos.environ['RANK']")
    ) == [None, "1"]


def test_in_out_and_get_ipython_are_never_captured(k: Kernel) -> None:
    k.ok("BIG_OUT = list(range(10))\nBIG_OUT")  # Out holds it too
    k.ok(
        "@distributed(num_accelerators=2)\n"
        "def nosy():\n"
        "    found = []\n"
        "    for name in ('In', 'Out', '_ih', '_oh'):\n"
        "        try:\n"
        "            eval(name)\n"
        "            found.append(name)\n"
        "        except NameError:\n"
        "            pass\n"
        "    return found, get_ipython(), len(In) if False else 0\n"
    )
    assert k.value("nosy.distributed()") == [([], None, 0), ([], None, 0)]


def test_display_in_a_rank_shows_the_text_form_in_the_cell(k: Kernel) -> None:
    res = k.run("%%distributed -n 2\nimport os\ndisplay({'rank': int(os.environ['RANK']), 'ok': True}, 'text')\n")
    assert res.error is None, res.error_text
    assert "{'rank': 0, 'ok': True}\n'text'\n" in res.stdout  # rank 0's output, as IPython shows it


def test_rank_0s_stderr_is_the_cells_stderr_stream(k: Kernel) -> None:
    res = k.run(
        "%%distributed -n 2 --no-tracking\nimport logging, sys\nprint('to stdout', flush=True)\n"
        "print('to stderr', file=sys.stderr, flush=True)\nlogging.warning('a log line')\nprint('stdout again')\n0",
        timeout=120,
    )
    assert res.error is None, res.error_text
    ours = [line for line in res.stdout.splitlines() if not line.startswith("[air_magic]")]
    assert ours == ["to stdout", "stdout again"], res.stdout
    assert res.stderr.splitlines() == ["to stderr", "WARNING:root:a log line"], res.stderr
    # In the order the rank wrote them.
    lines = [(name, line) for name, text in res.streams for line in text.splitlines()]
    assert [(name, line) for name, line in lines if not line.startswith("[air_magic]")] == [
        ("stdout", "to stdout"),
        ("stderr", "to stderr"),
        ("stderr", "WARNING:root:a log line"),
        ("stdout", "stdout again"),
    ], res.streams


# -- CUDA code on CPU ranks ----------------------------------------------------------------------

CPU_HINT = "hint: these ranks run on CPU (no GPU was asked for or found), and the code asks for CUDA or NCCL."


@pytest.mark.parametrize(
    "line, signature",
    [
        ("torch.cuda.set_device(0)", "no attribute '_cuda_setDevice'"),
        ("torch.zeros(1).cuda()", "Torch not compiled with CUDA enabled"),
        ("torch.distributed.init_process_group('nccl')", "Distributed package doesn't have NCCL built in"),
    ],
)
def test_cuda_code_on_cpu_ranks_gets_the_portable_idiom_as_a_hint(k: Kernel, line: str, signature: str) -> None:
    res = k.run(f"%%distributed -n 2\nimport torch, torch.distributed\n{line}")
    assert signature in res.error_text
    assert any(row.startswith(CPU_HINT) for row in res.error["traceback"]), res.error_text
    hint = next(row for row in res.error["traceback"] if row.startswith(CPU_HINT))
    assert 'torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")' in hint
    assert "dist.init_process_group() without a backend" in hint
    assert "`air-magic lint --fix` makes these changes" in hint


ACCELERATOR_HINT = "hint: these ranks run on CPU (no GPU was asked for or found), and the code asks for an accelerator"


@pytest.mark.parametrize(
    "line, signature",
    [
        ("torch.ones(1).to(int(os.environ['LOCAL_RANK']))", "Cannot access accelerator device when none is available"),
        ("torch.accelerator.set_device_index(0)", "Cannot access accelerator device when none is available"),
    ],
)
def test_accelerator_code_on_cpu_ranks_gets_the_portable_idiom_as_a_hint(k: Kernel, line: str, signature: str) -> None:
    res = k.run(f"%%distributed -n 2\nimport os, torch\n{line}")
    assert signature in res.error_text
    hint = next((row for row in res.error["traceback"] if row.startswith(ACCELERATOR_HINT)), None)
    assert hint is not None, res.error_text
    assert 'torch.accelerator.current_accelerator() or torch.device("cpu")' in hint
    assert "`air-magic lint --fix` makes these changes (rules AM405-AM409)" in hint
    assert not any(row.startswith(CPU_HINT) for row in res.error["traceback"])  # one hint, the one that fits


# -- failure wording ---------------------------------------------------------------------------


def test_a_failure_is_shown_once_and_names_how_every_other_rank_ended(k: Kernel) -> None:
    res = k.run(
        "%%distributed -n 3\n"
        "import os, time\n"
        "rank = int(os.environ['RANK'])\n"
        "if rank == 1:\n"
        "    time.sleep(1)\n"
        "    raise ValueError('bad batch')\n"
        "if rank == 2:\n"
        "    time.sleep(60)\n"
        "rank\n",
        timeout=60,
    )
    lines = res.error["traceback"]
    assert res.error["ename"] == "ValueError"
    assert lines.count("ValueError: bad batch") == 1  # the rank's own line, not repeated
    note = next(row for row in lines if row.startswith("[air_magic] raised on"))
    assert note.startswith(
        "[air_magic] raised on rank 1 of 3; rank 0 finished; rank 2 was stopped by air_magic. Full log: "
    ), note


def test_an_interrupt_says_where_each_rank_was_at_the_cells_lines(k: Kernel) -> None:
    msg_id = k.execute(
        "%%distributed -n 2\n"
        "import os, time, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "print('ready', flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(60)\n"
        "t = torch.ones(1)\n"
        "dist.all_reduce(t)\n"
    )
    k.collect(msg_id, timeout=60, until=lambda r: "ready" in r.stdout)
    import time

    time.sleep(0.5)
    k.km.interrupt_kernel()
    res = k.collect(msg_id, timeout=30)
    n = res.reply["execution_count"]
    assert res.error is not None and res.error["ename"] == "KeyboardInterrupt"
    where = res.stderr[res.stderr.index("[air_magic] where each rank was:") :].splitlines()
    assert where[1] == f"  rank 0: in all_reduce (torch.distributed), called at Cell In[{n}], line 8 in <module>"
    assert where[2] == f"  rank 1: at Cell In[{n}], line 6 in <module>  <- behind: rank 0 waits for it"


# -- an exception that is hard to report ------------------------------------------------------


def test_an_exception_whose_str_raises_keeps_its_type_and_traceback(k: Kernel) -> None:
    res = k.run(
        "%%distributed -n 2\n"
        "class Odd(ValueError):\n"
        "    def __str__(self):\n"
        "        raise RuntimeError('no words for it')\n"
        "raise Odd('x')"
    )
    assert res.error is not None and res.error["ename"] == "Odd", res.error_text
    shown = strip_ansi("\n".join(res.error["traceback"]))
    assert "raise Odd('x')" in shown  # the rank's traceback, at the cell's line
    assert "Odd: <unprintable Odd>" in shown
    assert "RankCrashedError" not in shown and "code 70" not in shown


def test_a_rank_that_closed_its_stdout_and_stderr_still_reports_its_exception(k: Kernel) -> None:
    res = k.run("%%distributed -n 2\nimport os\nos.close(1)\nos.close(2)\nraise KeyError('gone quiet')")
    assert res.error is not None and res.error["ename"] == "KeyError", res.error_text
    assert res.error["evalue"] == "'gone quiet'"
    shown = strip_ansi("\n".join(res.error["traceback"]))
    assert "raise KeyError('gone quiet')" in shown
    assert k.value("%%distributed -n 2\n1") == [1, 1]


def test_a_captured_value_that_cannot_be_rebuilt_on_a_rank_names_the_value(k: Kernel) -> None:
    k.ok(
        "class Fragile:\n"
        "    def __setstate__(self, state):\n"
        "        raise ValueError('cannot be rebuilt here')\n"
        "fragile = Fragile()\n"
        "fragile.size = 3"
    )
    res = k.run("%%distributed -n 2\nfragile.size")
    assert res.error is not None and res.error["ename"] == "ValueError", res.error_text
    shown = strip_ansi("\n".join(res.error["traceback"]))
    assert "[air_magic] while loading the captured name 'fragile', sent from the kernel, on this rank" in shown


def test_a_partial_of_a_builtin_runs_on_every_rank(k: Kernel) -> None:
    k.ok("import functools\nbiggest = distributed(num_accelerators=2)(functools.partial(max, 3))")
    assert k.value("biggest.distributed(5), biggest.distributed(1)") == ([5, 5], [3, 3])
