"""``air-magic run`` from a terminal: a script, a module's function, a notebook's function on
real ranks, run as a separate process (``python -m air_magic.cli``); its output, exit codes
(0 finished, 1 a rank failed, 2 usage error, 130 interrupted), MLflow run and Ctrl-C."""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
from harness import alive, wait_until

import air_magic
from air_magic import cli

pytestmark = pytest.mark.process

#: Where the air_magic under test lives: the command's Python imports it from there.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(air_magic.__file__)))

#: The text panel's line that names the launch's log folder.
_LOGS_LINE = re.compile(r"^\[air_magic\]\s+logs: (.+)$", re.M)


def environment(tmp_path: Path) -> dict[str, str]:
    """The command's environment: this session's private state folder, a log folder of
    the test's own, the checkout under test first on PYTHONPATH, MLflow's defaults."""
    env = dict(os.environ)
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    env["AIR_MAGIC_LOG_DIR"] = str(logs)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_CHECKOUT, env.get("PYTHONPATH")]))
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "AIR_MAGIC_WARM", "AIR_MAGIC_PANEL"):
        env.pop(name, None)
    return env


def air_magic_run(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m air_magic.cli run ARGS`` in ``tmp_path``."""
    return subprocess.run(
        [sys.executable, "-m", "air_magic.cli", "run", *args],
        cwd=tmp_path,
        env=environment(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rank_log(done: subprocess.CompletedProcess[str], rank: int) -> str:
    """What ``rank`` printed, from the launch's log folder (the status lines name it)."""
    folders = _LOGS_LINE.findall(done.stderr)
    assert len(folders) == 1, done.stderr
    return Path(folders[0], f"rank-{rank}.log").read_text()


def program_lines(text: str) -> list[str]:
    """The lines of the launched code and of the command, air_magic's status lines left out."""
    return [line for line in text.splitlines() if not line.startswith("[air_magic]")]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with a script (in a sub-folder, beside a module it imports), a module of
    functions, and a notebook."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "settings.py").write_text("GREETING = 'hello'\n")
    (tmp_path / "scripts" / "train.py").write_text(
        textwrap.dedent(
            '''\
            """Trains nothing; says what it was given."""
            import argparse
            import os
            import sys

            import settings  # beside the script: its folder is first on sys.path

            parser = argparse.ArgumentParser()
            parser.add_argument("--lr", type=float, default=0.1)
            parser.add_argument("--epochs", type=int, default=1)
            parser.add_argument("--name", default="none")

            if __name__ == "__main__":
                args = parser.parse_args()
                print(
                    f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: lr={args.lr} epochs={args.epochs} "
                    f"name={args.name} argv={sys.argv} file={__file__} path0={sys.path[0]} {settings.GREETING}",
                    flush=True,
                )
            '''
        )
    )
    (tmp_path / "jobs.py").write_text(
        textwrap.dedent(
            """\
            import os
            import sys

            from air_magic import distributed

            VALUE = 3


            def rank_and_argv():
                return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv


            @distributed(num_accelerators=2, tracking=False)
            def decorated():
                return os.environ["RANK"]


            def needs(lr, epochs=2):
                return lr
            """
        )
    )
    return tmp_path


# -- a script ------------------------------------------------------------------------------------


def test_a_script_runs_on_every_rank_with_its_arguments_after_the_double_dash(project: Path) -> None:
    done = air_magic_run(project, "scripts/train.py", "-n", "2", "--no-tracking", "--", "--lr", "0.5", "--name", "x y")
    assert done.returncode == 0, done.stderr
    script = project / "scripts" / "train.py"
    for rank in (0, 1):
        expected = (
            f"rank {rank} of 2: lr=0.5 epochs=1 name=x y argv=['scripts/train.py', '--lr', '0.5', '--name', 'x y'] "
            f"file={script} path0={script.parent} hello"
        )
        assert expected in rank_log(done, rank)
    # Rank 0's output is the command's own (the values of a script are None: none printed).
    assert program_lines(done.stdout) == [line for line in rank_log(done, 0).splitlines()]
    assert "[air_magic] train.py on 2 CPU ranks" in done.stderr
    assert "[air_magic] tracking is off" in done.stderr  # air_magic's own lines: stdout is the program's


def test_a_hydra_script_reads_its_config_beside_it_and_its_overrides(project: Path) -> None:
    (project / "app").mkdir()
    (project / "app" / "conf").mkdir()
    (project / "app" / "conf" / "config.yaml").write_text("lr: 0.1\nmodel:\n  depth: 2\n")
    (project / "app" / "main.py").write_text(
        textwrap.dedent(
            """\
            import os
            import hydra
            from omegaconf import OmegaConf


            @hydra.main(version_base=None, config_path="conf", config_name="config")
            def main(cfg):
                print("rank", os.environ["RANK"], OmegaConf.to_container(cfg), flush=True)


            if __name__ == "__main__":
                main()
            """
        )
    )
    outputs = project / "outputs"
    done = air_magic_run(
        project, "app/main.py", "-n", "2", "--no-tracking", "--", "lr=0.5", "+seed=3", f"hydra.run.dir={outputs}"
    )
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"rank {rank} {{'lr': 0.5, 'model': {{'depth': 2}}, 'seed': 3}}" in rank_log(done, rank)


def test_a_failing_rank_shows_its_traceback_at_the_scripts_lines_and_exits_1(tmp_path: Path) -> None:
    (tmp_path / "fails.py").write_text(
        "import os\n\n\ndef check(rank):\n    if rank == 1:\n        raise ValueError(f'rank {rank} is bad')\n\n\n"
        "check(int(os.environ['RANK']))\nprint('rank', os.environ['RANK'], 'passed')\n"
    )
    done = air_magic_run(tmp_path, "fails.py", "-n", "2", "--no-tracking")
    assert done.returncode == 1
    path = tmp_path / "fails.py"
    assert program_lines(done.stderr) == [
        "Traceback (most recent call last):",
        f'  File "{path}", line 9, in <module>',
        "    check(int(os.environ['RANK']))",
        f'  File "{path}", line 6, in check',
        "    raise ValueError(f'rank {rank} is bad')",
        "ValueError: rank 1 is bad",
    ]
    assert re.search(
        r"^\[air_magic\] raised on rank 1 of 2; rank 0 finished\. Full log: .+/rank-1\.log$", done.stderr, re.M
    )
    assert program_lines(done.stdout)[-1] == "rank 0 passed"


def test_a_launch_past_its_timeout_is_stopped_and_exits_1(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text("import time\nprint('waiting', flush=True)\ntime.sleep(120)\n")
    done = air_magic_run(tmp_path, "slow.py", "-n", "2", "--no-tracking", "--timeout", "3")
    assert done.returncode == 1
    assert (
        "LaunchTimeoutError: slow.py ran past its timeout of 3 s; all 2 ranks were stopped. Pass a larger timeout"
        in done.stderr
    )


STREAMS_SCRIPT = """\
import logging
import os
import sys

rank = os.environ["RANK"]
# One write a line: torchrun's two ranks share its pipes, and print() writes a line's end apart.
sys.stdout.write(f"out {rank}\\n")
sys.stdout.flush()
sys.stderr.write(f"err {rank}\\n")
sys.stderr.flush()
logging.warning("warned %s", rank)
sys.stdout.write(f"out again {rank}\\n")
sys.stdout.flush()
"""


def test_a_ranks_stdout_and_stderr_stay_apart_as_torchrun_keeps_them(tmp_path: Path) -> None:
    (tmp_path / "streams.py").write_text(STREAMS_SCRIPT)
    done = air_magic_run(tmp_path, "streams.py", "-n", "2", "--no-tracking")
    assert done.returncode == 0, done.stderr
    # Rank 0's lines, each on the stream it wrote to; air_magic's own lines on stderr.
    assert done.stdout.splitlines() == ["out 0", "out again 0"], done.stdout
    assert program_lines(done.stderr) == ["err 0", "WARNING:root:warned 0"], done.stderr
    # torchrun (every rank's lines, its workers inheriting its streams) splits them the same way.
    torchrun = subprocess.run(
        # --standalone: its rendezvous on a free loopback port (not 29500, which another may hold)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "streams.py"],
        cwd=tmp_path,
        env={**environment(tmp_path), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert torchrun.returncode == 0, torchrun.stderr
    of_rank_0 = [line for line in torchrun.stdout.splitlines() if line.endswith(" 0")]
    assert of_rank_0 == ["out 0", "out again 0"], torchrun.stdout
    assert [line for line in torchrun.stderr.splitlines() if line in ("err 0", "WARNING:root:warned 0")] == [
        "err 0",
        "WARNING:root:warned 0",
    ], torchrun.stderr


# -- a function of a module or a notebook ---------------------------------------------------------------


def test_a_module_function_prints_one_value_per_rank(project: Path) -> None:
    done = air_magic_run(project, "jobs:rank_and_argv", "-n", "2", "--no-tracking", "--", "--flag", "1")
    assert done.returncode == 0, done.stderr
    assert program_lines(done.stdout) == [
        "rank 0: (0, 2, ['rank_and_argv', '--flag', '1'])",
        "rank 1: (1, 2, ['rank_and_argv', '--flag', '1'])",
    ]


def test_a_decorated_module_function_keeps_its_settings_and_options_override_them(project: Path) -> None:
    done = air_magic_run(project, "jobs:decorated")  # num_accelerators=2, tracking=False: its own
    assert done.returncode == 0, done.stderr
    assert program_lines(done.stdout) == ["rank 0: '0'", "rank 1: '1'"]
    assert "[air_magic] tracking is off" in done.stderr
    done = air_magic_run(project, "jobs:decorated", "-n", "1")
    assert done.returncode == 0, done.stderr
    assert program_lines(done.stdout) == ["rank 0: '0'"]


#: Beside the notebook: rank 1 of ``fails`` raises once rank 0 has ended (its process reaped by
#: air_magic's helper), so that rank 0 is told as finished, not as stopped by rank 1's failure,
#: however loaded the machine.
RANK_ORDER = """import os
import time


def rank_0_pid_written():
    with open('rank-0.pid', 'w') as f:
        f.write(str(os.getpid()))
    return 0


def rank_0_has_ended():
    for _ in range(1200):
        try:
            os.kill(int(open('rank-0.pid').read()), 0)
        except (OSError, ValueError):
            if os.path.exists('rank-0.pid') and open('rank-0.pid').read():
                return True
        time.sleep(0.05)
    return True
"""


def write_notebook(path: Path) -> None:
    (path.parent / "rank_order.py").write_text(RANK_ORDER)
    cells = [
        nbformat.v4.new_markdown_cell("# Training"),
        nbformat.v4.new_code_cell(
            "%load_ext air_magic\nimport os\nfrom air_magic import distributed\nSCALE = 10\n!echo hello\nlisting = !ls\n"
            "import rank_order"
        ),
        nbformat.v4.new_code_cell(
            "def scaled(x):\n    return x * SCALE\n\n\n@distributed(num_accelerators=2, tracking=False)\n"
            "def train():\n    return scaled(int(os.environ['RANK']))\n\n\n"
            "def fails():\n    if os.environ['RANK'] == '1' and rank_order.rank_0_has_ended():\n"
            "        raise KeyError('no such key')\n    return rank_order.rank_0_pid_written()"
        ),
        nbformat.v4.new_code_cell("results = train.distributed()\nprint(results)"),
        nbformat.v4.new_code_cell("%%distributed -n 2\nraise SystemExit('a %%distributed cell never runs here')"),
        nbformat.v4.new_code_cell(
            "total = sum(results)\ntry:\n    import not_a_module\nexcept ImportError:\n    not_a_module = None"
        ),
    ]
    notebook = nbformat.v4.new_notebook()
    notebook.cells = cells
    nbformat.write(notebook, str(path))


def test_a_notebook_function_runs_with_what_the_notebook_defines(tmp_path: Path) -> None:
    write_notebook(tmp_path / "training.ipynb")
    done = air_magic_run(tmp_path, "training.ipynb:train")
    assert done.returncode == 0, done.stderr
    assert program_lines(done.stdout) == ["rank 0: 0", "rank 1: 10"]
    # The cell that launches, the %%distributed cell and the shell lines did not run here;
    # an assignment that reads what did not run is skipped, and said so.
    assert program_lines(done.stderr) == [
        "air-magic run: note: training.ipynb: skipped cell 6, line 1 (NameError: name 'results' is not defined)"
    ]
    assert "hello" not in done.stdout


def test_a_notebook_function_that_fails_names_the_rank_and_the_notebook_cell(tmp_path: Path) -> None:
    write_notebook(tmp_path / "training.ipynb")
    done = air_magic_run(tmp_path, "training.ipynb:fails", "-n", "2", "--no-tracking")
    assert done.returncode == 1
    assert "\n".join(program_lines(done.stderr)[1:]).startswith(
        "Traceback (most recent call last):\n"
        '  File "<training.ipynb cell 3>", line 12, in fails\n'
        "    raise KeyError('no such key')\n"
        "KeyError: 'no such key'"
    ), done.stderr
    assert "[air_magic] raised on rank 1 of 2; rank 0 finished." in done.stderr


# -- usage errors: one line, exit 2, nothing started ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.py"], "missing.py: no such file"),
        (["nowhere:main"], "no module named 'nowhere' (looked in the current folder and in the packages of {python})."),
        (
            ["jobs:trian"],
            "module 'jobs' ({project}/jobs.py) has no attribute 'trian'; its functions: decorated, needs, rank_and_argv.",
        ),
        (["jobs:VALUE"], "jobs:VALUE is int 3, not a function: name a function after the colon."),
        (
            ["jobs:needs"],
            "jobs:needs takes (lr, epochs=2), and air-magic run calls it without arguments: give its parameters "
            "defaults, or read them from sys.argv (the arguments after --).",
        ),
        (["jobs:"], "jobs:: name a function after the colon, as MODULE:FUNC or NOTEBOOK.ipynb:FUNC."),
        (["training.ipynb"], "training.ipynb: name the function to run in the notebook, as training.ipynb:FUNC."),
        (["other.ipynb:train"], "other.ipynb: no such file"),
        (
            ["training.ipynb:evaluate"],
            "training.ipynb: no function 'evaluate' is defined by the statements that run; they define: fails, scaled, "
            "train.",
        ),
        (
            ["jobs:rank_and_argv", "-n", "0"],
            "num_accelerators must be a positive integer (the number of ranks), got 0. Pass 1 or more, or omit it to "
            "use every GPU of this machine.",
        ),
        (["jobs:rank_and_argv", "--backend", "slurm"], "backend must be one of 'local', 'ray', got 'slurm'."),
        (
            ["jobs:rank_and_argv", "--address", "127.0.0.1:6379"],
            "--address is the address of a Ray cluster: use it with --backend ray.",
        ),
        (
            ["jobs:rank_and_argv", "--timeout", "0"],
            "timeout must be more than 0 seconds, got 0. Pass --timeout none for no limit.",
        ),
    ],
)
def test_a_usage_error_is_one_line_and_exits_2(project: Path, args: list[str], message: str) -> None:
    write_notebook(project / "training.ipynb")
    done = air_magic_run(project, *args)
    assert done.returncode == 2, done.stderr
    error = message.format(project=project, python=sys.executable)
    assert [line for line in done.stderr.splitlines() if "error" in line] == [f"air-magic run: error: {error}"]
    assert "Traceback" not in done.stderr and "[air_magic]" not in done.stderr + done.stdout  # nothing started


def test_a_bad_option_shows_the_usage_and_where_script_arguments_go(project: Path) -> None:
    done = air_magic_run(project, "scripts/train.py", "--lr", "0.5")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "usage: air-magic run [options] TARGET [-- ARGS ...]",
        "air-magic run: error: unrecognized arguments: --lr 0.5 (the script's own arguments go after --: "
        "air-magic run train.py -n 2 -- --lr 0.01)",
    ]


def test_a_module_that_fails_to_import_shows_its_traceback_and_exits_2(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("import os\nraise RuntimeError('not today')\n")
    done = air_magic_run(tmp_path, "broken:main")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "Traceback (most recent call last):",
        f'  File "{tmp_path / "broken.py"}", line 2, in <module>',
        "    raise RuntimeError('not today')",
        "RuntimeError: not today",
        "air-magic run: error: importing 'broken' failed: RuntimeError: not today",
    ]


# -- Ctrl-C -------------------------------------------------------------------------------------------------


def _where_it_hangs(command: subprocess.Popen[str]) -> str:
    """What a failure to stop has to show: the command's processes, its and this test's
    blocked, ignored and caught signals (SIGINT is bit 2), and its stderr ending with its
    threads' stacks (faulthandler, on SIGABRT)."""
    below = psutil.Process(command.pid).children(recursive=True)
    shown = [f"{p.pid} {p.ppid()} {p.status()} {' '.join(p.cmdline()[:4])}" for p in below if alive(p)]
    for pid, who in ((command.pid, "the command"), (os.getpid(), "this test")):
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        shown.append(f"{who}: " + " ".join(line for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt"))))
    command.send_signal(signal.SIGABRT)
    _, err = command.communicate()
    return "\n".join(["processes:", *shown, "its stderr:", err[-6000:]])


def test_ctrl_c_stops_every_rank_says_so_in_one_line_and_exits_130(tmp_path: Path) -> None:
    (tmp_path / "slow.py").write_text(
        "import os, time\nprint('started', os.environ['RANK'], flush=True)\ntime.sleep(120)\n"
    )
    command = subprocess.Popen(
        [sys.executable, "-m", "air_magic.cli", "run", "slow.py", "-n", "2", "--no-tracking"],
        cwd=tmp_path,
        # faulthandler: should it not end, SIGABRT shows where each of its threads was
        env={**environment(tmp_path), "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # with Ctrl-C's default action, as a terminal's foreground job has it: a test run
        # started in the background (`pytest &`) ignores SIGINT, and so would the command
        # (it rightly keeps an ignored SIGINT ignored, as `nohup` and `&` expect)
        preexec_fn=functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert command.stdout is not None
        for line in command.stdout:  # rank 0 runs: the ranks are started
            if line.startswith("started 0"):
                break
        # The helper and both ranks (rank 0 can print before rank 1 is forked on a busy machine).
        assert wait_until(lambda: len(psutil.Process(command.pid).children(recursive=True)) >= 3, 30)
        below = psutil.Process(command.pid).children(recursive=True)
        os.killpg(command.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        try:
            out, err = command.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after Ctrl-C:\n{_where_it_hangs(command)}")
    finally:
        if command.poll() is None:
            command.kill()
            command.communicate()
    assert command.returncode == 130
    said = [line for line in err.splitlines() if not line.startswith(("[air_magic]", "  "))]
    assert len(said) == 1, err
    assert re.fullmatch(
        r"air-magic run: slow\.py was cancelled: you interrupted it after \d+\.\d s; its 2 ranks were stopped\.",
        said[0],
    )
    assert "Traceback" not in err + out
    assert wait_until(lambda: not any(alive(p) for p in below), timeout=5), [p.pid for p in below if alive(p)]


# -- MLflow ---------------------------------------------------------------------------------------------------


def test_tracking_makes_a_finished_run_in_the_default_store_with_the_ranks_metrics(tmp_path: Path) -> None:
    (tmp_path / "tracked.py").write_text(
        "import os\nimport mlflow\n\nrank = int(os.environ['RANK'])\n"
        "mlflow.log_metric('loss', 1.0 / (1 + rank), step=1)\nprint('logged', rank)\n"
    )
    done = air_magic_run(tmp_path, "tracked.py", "-n", "2", timeout=180)
    assert done.returncode == 0, done.stderr
    store = tmp_path / "mlflow.db"
    # The run is said once, on stderr with air_magic's other lines: the summary's line, with
    # the command that opens the store; stdout has the program's output only.
    assert "MLflow run" not in done.stdout, done.stdout
    found = re.findall(r"^\[air_magic\]  MLflow run \S+ \(([0-9a-f]{32})\); open it with: (.+)$", done.stderr, re.M)
    assert len(found) == 1, done.stderr
    found_id, command = found[0]
    assert shlex.split(command)[1:] == ["-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{store}"], command
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{store}")
    run = client.get_run(found_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "tracked"  # named after the script
    metrics = {key: value for key, value in run.data.metrics.items() if not key.startswith("system/")}
    assert metrics == {"loss": 1.0, "rank1/loss": 0.5}
    assert run.data.params["air_magic.code"] == "script tracked.py"


# -- the command and its help (no ranks) -----------------------------------------------------------------


def test_help_lists_both_verbs_and_runs_help_says_the_forms_and_exit_codes(capsys: Any) -> None:
    assert cli.main(["--help"]) == 0
    top = capsys.readouterr().out
    assert "lint " in top and "run " in top
    assert cli.main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: air-magic run [options] TARGET [-- ARGS ...]\n")
    for form in ("SCRIPT.py ", "MODULE:FUNC ", "NOTEBOOK.ipynb:FUNC "):
        assert f"\n  {form}" in text
    assert "exit status: 0 every rank finished; 1 the launch failed" in text
    assert "130 interrupted" in text
    for flag in (
        "--num-accelerators",
        "--accelerator-type",
        "--timeout",
        "--no-tracking",
        "--experiment",
        "--backend",
        "--address",
    ):
        assert flag in text
    assert "--async" not in text  # a notebook's only


def test_run_has_every_flag_of_the_magic_that_the_decorator_has_too() -> None:
    from air_magic.options import OPTIONS

    _, run = cli._parser()
    flags = {flag for action in run._actions for flag in action.option_strings}
    expected = {flag for option in OPTIONS if option.keyword is not None for flag in option.flags}
    assert expected <= flags and "--async" not in flags
    assert flags - expected == {"-h", "--help", "--address"}


def test_lint_is_a_verb_of_the_same_command(tmp_path: Path, capsys: Any) -> None:
    legacy = tmp_path / "legacy.py"
    legacy.write_text("from serverless_gpu import distributed\n")
    assert cli.main(["lint", "-q", str(legacy)]) == 1
    assert "AM106" in capsys.readouterr().out
    assert cli.main(["lint", str(tmp_path / "missing.py")]) == 2
    assert "air-magic lint: error: " in capsys.readouterr().err
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("air-magic ")


def test_the_console_script_is_this_command() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads(Path(_CHECKOUT, "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"air-magic": "air_magic.cli:main"}
