"""``%%distributed`` in a real kernel: results, capture, errors, options, the rank environment."""

from __future__ import annotations

import ast
import time
from typing import Any, Iterator

import pytest
from harness import Kernel, strip_ansi

pytestmark = pytest.mark.kernel

LAUNCH_DIRS = """
def _launch_dirs():
    import os, re
    from air_magic.settings import settings
    if not os.path.isdir(settings.log_dir):
        return []
    return sorted(n for n in os.listdir(settings.log_dir) if re.match(r"\\d{8}-\\d{6}-\\d{4}-", n))
"""


@pytest.fixture(scope="module")
def k(kernel_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    # A log folder of its own: each launch keeps one folder there, so launches can be counted.
    logs = tmp_path_factory.mktemp("magic-logs") / "logs"
    kernel = kernel_factory(extra_env={"AIR_MAGIC_LOG_DIR": str(logs)})
    kernel.ok(LAUNCH_DIRS)
    yield kernel
    kernel.shutdown()


def launch_count(k: Kernel) -> int:
    return len(k.value("_launch_dirs()"))


def out_value(res: Any) -> Any:
    assert res.error is None, res.error_text
    assert res.result is not None, f"no Out; stdout={res.stdout!r}"
    return ast.literal_eval(res.result)


# -- results -----------------------------------------------------------------------------------


def test_last_expression_is_a_list_ordered_by_rank(k: Kernel) -> None:
    res = k.run('%%distributed -n 2\nimport os\nint(os.environ["RANK"])')
    assert out_value(res) == [0, 1]
    n = res.reply["execution_count"]
    assert k.value(f"Out[{n}]") == [0, 1]


def test_no_last_expression_gives_no_out(k: Kernel) -> None:
    res = k.run('%%distributed -n 2\nimport os\nrank = int(os.environ["RANK"])')
    assert res.error is None, res.error_text
    assert res.result is None
    n = res.reply["execution_count"]
    assert k.value(f"{n} in Out") is False
    # and the cell's names do not leak back into the notebook
    assert k.value("'rank' in globals()") is False


def test_notebook_function_class_and_globals_travel(k: Kernel) -> None:
    k.ok(
        "FACTOR = 3\n"
        "OFFSET = 100\n"
        "def scale(x):\n"
        "    return x * FACTOR\n"
        "class Point:\n"
        "    def __init__(self, x):\n"
        "        self.x = x\n"
        "    def norm(self):\n"
        "        return abs(self.x)\n"
    )
    cell = (
        "%%distributed -n 2\n"
        "import os\n"
        'r = int(os.environ["RANK"])\n'
        "p = Point(-r - 1)\n"
        "(scale(r) + OFFSET, p.norm(), type(p).__name__, scale.__module__)"
    )
    assert out_value(k.run(cell)) == [(100, 1, "Point", "__main__"), (103, 2, "Point", "__main__")]
    # by value, as it is at launch time: a new value of the global is what travels next
    k.ok("FACTOR = 5")
    assert [v[0] for v in out_value(k.run(cell))] == [100, 105]


def test_modules_travel_by_reference(k: Kernel) -> None:
    # An attribute set on the kernel's module object does not travel: ranks import the module.
    k.ok('import json\njson.air_magic_kernel_only = "here"')
    res = k.run('%%distributed -n 2\n(json.dumps([1, "a"]), hasattr(json, "air_magic_kernel_only"))')
    assert out_value(res) == [('[1, "a"]', False), ('[1, "a"]', False)]


def test_name_assigned_in_cell_before_use_is_not_captured(k: Kernel) -> None:
    k.ok("import threading\nlock = threading.Lock()")
    before = launch_count(k)
    res = k.run("%%distributed -n 2\nlock = 1\nlock")
    assert out_value(res) == [1, 1]
    assert launch_count(k) == before + 1


def test_unpicklable_variable_is_named_before_any_process_starts(k: Kernel) -> None:
    k.ok("import threading\nlock = threading.Lock()")
    before = launch_count(k)
    res = k.run("%%distributed -n 2\nwith lock:\n    x = 1\nx")
    assert res.error is not None
    assert res.error["ename"] == "CaptureError"
    assert res.reply["status"] == "error"
    text = res.error_text
    assert "cannot send 'lock' to the ranks: it cannot be pickled." in text
    assert "- lock (_thread.lock): TypeError: cannot pickle '_thread.lock' object" in text
    assert "Create it inside the cell instead" in text
    assert launch_count(k) == before  # nothing was launched


def test_two_unpicklable_variables_are_both_named(k: Kernel) -> None:
    k.ok("import threading\nlock = threading.Lock()\nrlock = threading.RLock()")
    before = launch_count(k)
    res = k.run("%%distributed -n 2\n(lock, rlock)")
    assert res.error is not None and res.error["ename"] == "CaptureError"
    text = res.error_text
    assert "cannot send 'lock', 'rlock' to the ranks: they cannot be pickled." in text
    assert "- lock (_thread.lock)" in text
    assert "- rlock (_thread.RLock)" in text
    assert launch_count(k) == before


def test_large_captured_object_warns_by_name(k: Kernel) -> None:
    k.ok("%config DistributedMagics.capture_warn_mb = 1")
    try:
        k.ok('big_blob = b"x" * 5_000_000')
        res = k.run("%%distributed -n 2\nlen(big_blob)")
        assert out_value(res) == [5_000_000, 5_000_000]
        assert "CaptureWarning: 'big_blob' is 5 MB once pickled and is sent to every rank." in res.stderr
        assert "Load or build it inside the cell instead" in res.stderr
        # under the threshold: no warning
        k.ok('small_blob = b"x" * 1000')
        res = k.run("%%distributed -n 2\nlen(small_blob)")
        assert out_value(res) == [1000, 1000]
        assert "CaptureWarning" not in res.stderr
    finally:
        k.ok("%config DistributedMagics.capture_warn_mb = 100")


def test_syntax_error_is_reported_before_launch(k: Kernel) -> None:
    before = launch_count(k)
    res = k.run("%%distributed -n 2\nx = 1\ny = (\n")
    assert res.error is not None
    assert res.error["ename"] == "SyntaxError"
    assert "'(' was never closed" in res.error_text
    n = res.reply["execution_count"]
    # line 3 of the cell, counting the %%distributed line, as IPython shows its own syntax
    # errors: the line and a caret, no frame of IPython's or the magic's
    assert res.error_text.splitlines() == [
        f"  Cell In[{n}], line 3",
        "    y = (",
        "        ^",
        "SyntaxError: '(' was never closed",
    ]
    assert launch_count(k) == before
    # the same in a pool cell, and code that catches SyntaxError still catches it
    pool = k.run("%%distributed --pool -n 2\nx = 1\ny = (\n")
    assert pool.error is not None and pool.error["ename"] == "SyntaxError"
    m = pool.reply["execution_count"]
    assert pool.error_text.splitlines()[0] == f"  Cell In[{m}], line 3" and "magics.py" not in pool.error_text
    k.ok("%distributed_pool --stop")
    caught = k.ok(
        "try:\n    get_ipython().run_cell_magic('distributed', '-n 2', 'y = (')\n"
        "except SyntaxError as e:\n    print('caught', type(e).__name__, e.lineno)"
    )
    assert "caught SyntaxError 2" in caught.stdout


WAIT_FOR_RANK_0 = """
def _after_rank_0_ended(mark):
    # Rank 1 fails only once rank 0 has returned and its process ended, however loaded the machine.
    import os, time, psutil
    while not (os.path.exists(mark) and open(mark).read().endswith("\\n")):
        time.sleep(0.01)
    try:
        rank0 = psutil.Process(int(open(mark).read()))
        while rank0.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
    except psutil.NoSuchProcess:
        pass
"""


def test_rank_traceback_points_at_the_cells_own_lines(k: Kernel, tmp_path: Any) -> None:
    k.ok(WAIT_FOR_RANK_0)
    mark = tmp_path / "rank-0.pid"
    res = k.run(
        "%%distributed -n 2\n"
        "import os\n"
        'rank = int(os.environ["RANK"])\n'
        f"if rank == 1 and _after_rank_0_ended('{mark}') is None:\n"
        '    raise ValueError(f"bad value on rank {rank}")\n'
        f"print(os.getpid(), file=open('{mark}', 'w'))\n"
        "rank"
    )
    assert res.error is not None
    assert res.error["ename"] == "ValueError"
    n = res.reply["execution_count"]
    text = res.error_text
    assert f"Cell In[{n}], line 5" in text
    assert 'raise ValueError(f"bad value on rank {rank}")' in text
    assert "ValueError: bad value on rank 1" in text
    assert "[air_magic] raised on rank 1 of 2; rank 0 finished." in text  # rank 0 had returned
    # none of air_magic's own frames
    assert "air_magic/rank/main.py" not in text and "air_magic/kernel/launcher.py" not in text
    assert "air_magic/kernel/launch.py" not in text


def test_traceback_through_a_notebook_function_names_its_cell(k: Kernel) -> None:
    define = k.ok("def check(v):\n    if v == 1:\n        raise KeyError('missing')\n    return v")
    m = define.reply["execution_count"]
    res = k.run('%%distributed -n 2\nimport os\ncheck(int(os.environ["RANK"]))')
    assert res.error is not None and res.error["ename"] == "KeyError"
    n = res.reply["execution_count"]
    assert f"Cell In[{n}], line 3" in res.error_text
    assert f"Cell In[{m}], line 3, in check" in res.error_text
    assert "raise KeyError('missing')" in res.error_text


def test_custom_exception_class_from_the_notebook_is_reraised_as_itself(k: Kernel) -> None:
    k.ok(
        "from air_magic import distributed\n"
        "class TrainingDiverged(Exception):\n"
        "    pass\n"
        "@distributed(num_accelerators=2, tracking=False)\n"
        "def diverge(limit):\n"
        "    import os\n"
        '    if os.environ["RANK"] == "1":\n'
        '        raise TrainingDiverged("loss is nan", limit)\n'
        "    return limit\n"
    )
    caught = k.value(
        "try:\n"
        "    diverge.distributed(7)\n"
        "    caught = None\n"
        "except TrainingDiverged as exc:\n"
        "    caught = (type(exc) is TrainingDiverged, exc.args, exc.__notes__[0][:36])\n"
        "caught"
    )
    assert caught == (True, ("loss is nan", 7), "[air_magic] raised on rank 1 of 2; r")
    # and through the cell magic, shown as the notebook's own class
    res = k.run('%%distributed -n 2\nimport os\nif os.environ["RANK"] == "1":\n    raise TrainingDiverged("cell")')
    assert res.error is not None and res.error["ename"] == "TrainingDiverged"
    assert "TrainingDiverged: cell" in res.error_text


# -- help and options ---------------------------------------------------------------------------


def test_help_lists_options_and_example(k: Kernel) -> None:
    res = k.run("%%distributed?")
    assert res.error is None
    pages = [p["data"]["text/plain"] for p in res.reply["payload"] if p.get("source") == "page"]
    assert pages, res.reply
    text = strip_ansi(pages[0])
    assert "%%distributed [-n N]" in text and "%distributed [-n N]" not in text.replace("%%distributed", "")
    for option in (
        "-n N, --num-accelerators N",
        "--accelerator-type TYPE",
        "--timeout <SECONDS|none>",
        "--no-tracking",
        "--experiment EXPERIMENT",
        "--run-name RUN_NAME",
        "--async",
        "--backend",
    ):
        assert option in text, option
    assert "%%distributed -n 2" in text
    assert "dist.all_reduce(x)" in text
    assert "Out[2]: [1.0, 1.0]" in text


@pytest.mark.parametrize(
    "line, message",
    [
        (
            "-n 0",
            "UsageError: %%distributed: num_accelerators must be a positive integer (the number of ranks), got 0.",
        ),
        ("-n abc", "UsageError: argument -n/--num-accelerators: invalid int value: 'abc'"),
        ("--timeout abc", "UsageError: %%distributed: --timeout takes a number of seconds or 'none', got 'abc'"),
        (
            "--accelerator-type GPU_8xH100",
            "UsageError: %%distributed: accelerator_type='GPU_8xH100' was asked for, but this machine has "
            "no NVIDIA GPU (CPU only).",
        ),
    ],
    ids=["n-zero", "n-not-int", "timeout-not-number", "gpu-type-on-cpu"],
)
def test_bad_flags_are_usage_errors(k: Kernel, line: str, message: str) -> None:
    before = launch_count(k)
    res = k.run(f"%%distributed {line}\n1")
    assert res.reply["status"] == "error"
    assert message in res.stderr
    assert res.result is None
    assert launch_count(k) == before


def test_a_trailing_comment_on_any_magic_line_is_left_out(k: Kernel) -> None:
    # The pool guide's first line, as written: the apostrophe in its comment is a comment's.
    k.ok("%distributed_pool -n 2   # start the kernel's pool (or let the first --pool cell start it)", timeout=180)
    assert out_value(k.run("%%distributed --pool  # it's the pool's\nimport os\nos.environ['WORLD_SIZE']")) == [
        "2",
        "2",
    ]
    assert out_value(k.run("%%distributed -n 2 -- --lr 0.1  # what's passed\nimport sys\nsys.argv[1:]")) == [
        ["--lr", "0.1"],
        ["--lr", "0.1"],
    ]
    k.ok("%distributed_ps  # what's running")
    k.ok("%air_lint --history  # what's old")
    k.ok("%distributed_pool --stop  # that's all")
    for line, magic in (
        ('%distributed_pool -n "2', "%distributed_pool"),
        ("%distributed_ps --json 'x", "%distributed_ps"),
        ("%air_lint 'x", "%air_lint"),
    ):
        res = k.run(line)
        assert res.reply["status"] == "error", line
        said = f"UsageError: {magic}: cannot read the options (No closing quotation): {line.split(' ', 1)[1]}\n"
        assert res.stderr == said, res.stderr


def test_config_timeout_default_applies(k: Kernel) -> None:
    k.ok("%config DistributedMagics.timeout = 2")
    try:
        start = time.monotonic()
        res = k.run("%%distributed -n 2\nimport time\ntime.sleep(60)", timeout=30)
        elapsed = time.monotonic() - start
        assert res.error is not None and res.error["ename"] == "LaunchTimeoutError"
        assert "ran past its timeout of 2 s; all 2 ranks were stopped" in res.error_text
        assert "timeout=None" in res.error_text
        assert elapsed < 10, elapsed
    finally:
        k.ok("%config DistributedMagics.timeout = 10800")
    assert out_value(k.run("%%distributed -n 2\n'after'")) == ["after", "after"]


# -- the rank environment -------------------------------------------------------------------------

ENV_KEYS = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTHONUNBUFFERED",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
]


def rank_env(k: Kernel) -> list[dict[str, str | None]]:
    return out_value(k.run(f"%%distributed -n 2\nimport os\n{{k: os.environ.get(k) for k in {ENV_KEYS!r}}}"))


def test_rank_environment_contract(k: Kernel) -> None:
    envs = rank_env(k)
    assert len(envs) == 2
    for rank, env in enumerate(envs):
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == "2"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == "0"
        assert env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] is not None and env["MASTER_PORT"].isdigit()
        assert 0 < int(env["MASTER_PORT"]) < 65536
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["OMP_NUM_THREADS"] is not None and int(env["OMP_NUM_THREADS"]) >= 1
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


def test_each_launch_gets_its_own_rendezvous_port(k: Kernel) -> None:
    first = rank_env(k)[0]["MASTER_PORT"]
    second = rank_env(k)[0]["MASTER_PORT"]
    assert first != second


def test_kernel_state_at_launch_time_reaches_ranks(k: Kernel, tmp_path: Any) -> None:
    module_dir = tmp_path / "extra_path"
    module_dir.mkdir()
    (module_dir / "air_magic_probe_mod.py").write_text("VALUE = 'imported from the new path'\n")
    work = tmp_path / "workdir"
    work.mkdir()
    old_cwd = k.value("import os\nos.getcwd()")
    k.ok(
        "import os, sys\n"
        f"os.chdir({str(work)!r})\n"
        'os.environ["AIR_MAGIC_SET_AFTER_LOAD"] = "visible"\n'
        f"sys.path.append({str(module_dir)!r})\n"
    )
    try:
        res = k.run(
            "%%distributed -n 2\n"
            "import os, air_magic_probe_mod\n"
            '(os.getcwd(), os.environ.get("AIR_MAGIC_SET_AFTER_LOAD"), air_magic_probe_mod.VALUE)'
        )
        expected = (str(work), "visible", "imported from the new path")
        assert out_value(res) == [expected, expected]
    finally:
        k.ok(
            f'os.chdir({old_cwd!r})\ndel os.environ["AIR_MAGIC_SET_AFTER_LOAD"]\nsys.path.remove({str(module_dir)!r})\n'
        )
    # removed again in the kernel: gone from the ranks at the next launch
    res = k.run('%%distributed -n 2\nimport os\n(os.getcwd(), os.environ.get("AIR_MAGIC_SET_AFTER_LOAD"))')
    assert out_value(res) == [(old_cwd, None), (old_cwd, None)]


def test_init_process_group_without_backend_and_all_reduce(k: Kernel) -> None:
    res = k.run(
        "%%distributed -n 2\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "backend = dist.get_backend_config()\n"
        "dist.destroy_process_group()\n"
        "(backend, t.item())"
    )
    # no CUDA here: the default process group runs its CPU tensors on gloo
    assert out_value(res) == [("cpu:gloo", 3.0), ("cpu:gloo", 3.0)]
