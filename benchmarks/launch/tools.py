"""The launchers under test, each described as the cells a notebook user runs.

Every tool gets the same payload, in the order of the air_magic spec cell: on
each rank the user code imports torch (``import os, time, torch,
torch.distributed as dist``), then records ``time.time()`` into
``<stampdir>/start-<pid>`` (the "first user line" stamp), then calls
``init_process_group("gloo")``, all-reduces a 1-element tensor of ones,
destroys the group, writes the reduced value to ``<stampdir>/done-<pid>`` and
returns ``(t0, value)`` where the tool can return values.  The stamp files let
the harness time every tool the same way (and check that all N ranks ran and
reduced to N) whether or not the tool hands results back.

A tool is a set of code snippets run in a fresh IPython kernel:

* ``setup``       untimed: harness helpers and payload definitions;
* ``init_body``   timed, once: the import / start cell (part of "cold");
* ``post_init``   untimed, once (e.g. switching nbdistributed's auto mode off);
* ``launch_body`` timed, every run: one launch of the payload;
* ``post_launch`` untimed, after each run (e.g. stopping torchpod's agent);
* ``teardown``    untimed: release workers/clusters before the kernel stops.

Timed snippets are wrapped in a kernel-side ``time.perf_counter()`` bracket by
the harness.  ``jupyter-distributed`` is the exception: it replaces the kernel
with a proxy that runs every cell on N rank kernels, so it is timed from the
client (see ``ProxyKernelTool``).
"""

from __future__ import annotations

import textwrap

# --- air_magic API the harness assumes (edit here if the package differs) ---
# Cell magic: "%load_ext air_magic", then "%%distributed <args>" whose value is
# a list with one entry per rank.
AIR_MAGIC_EXTENSION = "air_magic"
AIR_MAGIC_CELL_ARGS = "-n {n} --no-tracking"
# Decorator: "from air_magic import distributed"; "@distributed(<kwargs>)" on
# f; "f.distributed()" runs f on every rank and returns a per-rank list.
AIR_MAGIC_DECORATOR_KWARGS = "num_accelerators={n}, tracking=False"
AIR_MAGIC_LAUNCH_METHOD = "distributed"

TENSOR_256MB_NUMEL = 64 * 1024 * 1024  # float32 -> 256 MiB per rank


# Function form of the payload, defined in the kernel by the setup cell.
# ``rank`` is given only by tools that do not export torchrun-style variables
# themselves; then the payload sets them (MASTER_ADDR/PORT, RANK, WORLD_SIZE)
# so the call stays ``init_process_group("gloo")`` for every tool.
PAYLOAD_FUNCTION = """
def _bench_payload(sd, port=None, rank=None, world=None):
    import os, time, torch, torch.distributed as dist
    t0 = time.time()
    with open(os.path.join(sd, "start-%d" % os.getpid()), "w") as f:
        f.write(repr(t0))
    if rank is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    x = torch.ones(1)
    dist.all_reduce(x)
    dist.destroy_process_group()
    with open(os.path.join(sd, "done-%d" % os.getpid()), "w") as f:
        f.write(repr(x.item()))
    return (t0, x.item())
"""

# Script form, for torchrun (stamp dir in argv[1]).
PAYLOAD_SCRIPT = """\
import os, sys, time, torch, torch.distributed as dist
t0 = time.time()
with open(os.path.join(sys.argv[1], "start-%d" % os.getpid()), "w") as f:
    f.write(repr(t0))
dist.init_process_group("gloo")
x = torch.ones(1)
dist.all_reduce(x)
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], "done-%d" % os.getpid()), "w") as f:
    f.write(repr(x.item()))
print("rank", os.environ["RANK"], "t0", t0, "value", x.item())
"""


def payload_cell(sd: str, *, init: bool = True, pre: str = "") -> str:
    """Cell form of the payload, for tools that run cell source on each rank.

    ``init=False`` is for tools whose workers already own a process group
    (nbdistributed): the cell only all-reduces on it.
    """
    if init:
        collective = (
            'dist.init_process_group("gloo"); x = torch.ones(1); dist.all_reduce(x); dist.destroy_process_group()'
        )
    else:
        collective = "x = torch.ones(1); dist.all_reduce(x)"
    lines = [
        "import os, time, torch, torch.distributed as dist",
        "_t0 = time.time(); open(os.path.join(%r, 'start-%%d' %% os.getpid()), 'w').write(repr(_t0))" % sd,
    ]
    if pre:
        lines.append(pre)
    lines += [
        collective,
        "open(os.path.join(%r, 'done-%%d' %% os.getpid()), 'w').write(repr(x.item()))" % sd,
        "(_t0, x.item())",
    ]
    return "\n".join(lines) + "\n"


class Ctx:
    """What a tool needs to know about one (tool, N) session."""

    def __init__(self, n: int, sd: str, venv_python: str, torchrun: str, script: str):
        self.n = n
        self.sd = sd
        self.venv_python = venv_python
        self.torchrun = torchrun
        self.script = script


class Tool:
    name = ""
    dist = ""  # distribution name, for the version line
    module = ""  # import name, for the availability check
    returns = ""  # what comes back to the kernel
    model = ""  # process model, for the fairness notes
    fresh_interpreters = False  # every launch starts new Python processes
    kernel_mode = "in_kernel"
    check_returns = False  # _bench_out must be a per-rank list of (t0, N)
    fresh_folder = False  # the kernel starts in a new, empty notebook folder
    settle_s = 0.0  # untimed pause between the init cell and the first launch

    def setup(self, c: Ctx) -> str:
        return ""

    def init_body(self, c: Ctx) -> str:
        raise NotImplementedError

    def post_init(self, c: Ctx) -> str | None:
        return None

    def launch_body(self, c: Ctx, port: int) -> str:
        raise NotImplementedError

    def post_launch(self, c: Ctx) -> str | None:
        return None

    def teardown(self, c: Ctx) -> str | None:
        return None


class Torchrun(Tool):
    name = "torchrun"
    dist = "torch"
    module = "torch"
    returns = "no (exit code + stdout)"
    model = "subprocess.run(torchrun ...) from a cell; new agent + N fresh interpreters per launch"
    fresh_interpreters = True

    def init_body(self, c):
        return "import subprocess"

    def launch_body(self, c, port):
        return textwrap.dedent(f"""\
            _bench_out = subprocess.run(
                [{c.torchrun!r}, "--nproc-per-node", "{c.n}", "--master-addr", "127.0.0.1",
                 "--master-port", "{port}", {c.script!r}, {c.sd!r}],
                capture_output=True, text=True, timeout=600)
            if _bench_out.returncode != 0:
                raise RuntimeError("torchrun exit %d: %s" % (_bench_out.returncode, _bench_out.stderr[-1500:]))
            """)


class Accelerate(Tool):
    name = "accelerate"
    dist = "accelerate"
    module = "accelerate"
    returns = "no (notebook_launcher returns None)"
    model = (
        "forks the kernel (torch elastic agent in the kernel, start_method=fork) for N>1; "
        "N=1 runs the function in the kernel process itself"
    )

    def init_body(self, c):
        return "from accelerate import notebook_launcher"

    def launch_body(self, c, port):
        if c.n == 1:
            # No launcher env at N=1: the payload sets RANK/WORLD_SIZE/MASTER_PORT.
            args = f"(SD, {port}, 0, 1)"
        else:
            args = "(SD,)"
        return f"_bench_out = notebook_launcher(_bench_payload, args={args}, num_processes={c.n}, use_port='{port}')"


class Torchpod(Tool):
    name = "torchpod"
    dist = "torchpod"
    module = "torchpod"
    returns = "no (decorator returns a Job handle)"
    model = (
        "decorator; each call starts a local agent process that fork+execs N fresh "
        "`python3 -m torchpod.worker` interpreters; function shipped with cloudpickle"
    )
    fresh_interpreters = True

    def setup(self, c):
        # Built at launch time so the decorator call is inside the timed cell;
        # torchpod is resolved as a global when _tp_make runs.
        return textwrap.dedent("""\
            def _tp_make(n, port):
                @torchpod.distributed(gpus_per_host=n, master_port=port)
                def _tp_payload(ctx):
                    # torchpod's Ctx.init_distributed() calls torch.cuda.set_device,
                    # so on CPU the payload exports the variables itself.
                    return _bench_payload(SD, ctx.master_port, ctx.rank, ctx.world_size)
                return _tp_payload
            """)

    def init_body(self, c):
        return "import torchpod"

    def launch_body(self, c, port):
        return f"_bench_out = _tp_make({c.n}, {port})()\n_bench_job = _bench_out"

    def post_launch(self, c):
        # Job.stop() terminates the agent this call started (not timed).
        return "_bench_job.stop()"


class NbDistributed(Tool):
    name = "nbdistributed"
    dist = "nbdistributed"
    module = "nbdistributed"
    returns = "no (per-rank output text is printed; values stay on the workers)"
    model = (
        "persistent workers started by %dist_init (N fresh interpreters that import torch and "
        "init_process_group at start; %dist_init sleeps a fixed 2 s); each %%distributed cell is sent "
        "over ZMQ and only all-reduces on the workers' existing group"
    )

    def init_body(self, c):
        return textwrap.dedent(f"""\
            get_ipython().run_line_magic("load_ext", "nbdistributed")
            get_ipython().run_line_magic("dist_init", "-n {c.n} -a 127.0.0.1")
            _m = get_ipython().magics_manager.registry["DistributedMagic"]
            if _m._comm_manager is None:
                raise RuntimeError("%dist_init did not start workers")
            # %dist_init returns after a fixed 2 s sleep, possibly before the
            # workers (still importing torch / in init_process_group) have
            # connected; a message sent then is dropped by the ROUTER socket and
            # the cell hangs 30 s.  Wait until every rank answers a ping.
            import time as _time
            _deadline = _time.time() + 120
            while True:
                try:
                    _m._comm_manager.send_to_all("get_status", {{}}, timeout=0.25)
                    break
                except TimeoutError:
                    if _time.time() > _deadline:
                        raise
            """)

    def post_init(self, c):
        # %dist_init turns every later non-magic cell into %%distributed; the
        # harness's own cells must stay local.  Must be the whole cell.
        return "%dist_mode --disable"

    def launch_body(self, c, port):
        # The workers' group was initialised by %dist_init and is reused.
        cell = payload_cell(c.sd, init=False)
        return f'_bench_out = get_ipython().run_cell_magic("distributed", "", {cell!r})'

    def teardown(self, c):
        # Deliberately NOT %dist_shutdown / %dist_reset: those run broad
        # `pkill -f` patterns (worker.py, python.*worker, ...) that would hit
        # unrelated processes on the machine.  Stop our workers by handle.
        return textwrap.dedent("""\
            _m = get_ipython().magics_manager.registry["DistributedMagic"]
            if _m._comm_manager is not None:
                _m._comm_manager.shutdown()
                _m._comm_manager = None
            if _m._process_manager is not None:
                _m._process_manager.shutdown()
                _m._process_manager = None
            """)


class IpyParallel(Tool):
    name = "ipyparallel"
    dist = "ipyparallel"
    module = "ipyparallel"
    returns = "yes (map_sync returns per-rank values)"
    model = (
        "persistent engines (controller + N engine interpreters) started once; each launch is "
        "view.map_sync of the payload, which inits/destroys a gloo group on a fresh port every call"
    )
    check_returns = True

    def init_body(self, c):
        return textwrap.dedent(f"""\
            import ipyparallel as ipp
            _ipp_cluster = ipp.Cluster(n={c.n})
            _ipp_rc = _ipp_cluster.start_and_connect_sync()
            _ipp_view = _ipp_rc[:]
            """)

    def launch_body(self, c, port):
        n = c.n
        return (
            f"_bench_out = _ipp_view.map_sync(_bench_payload, [SD] * {n}, [{port}] * {n}, "
            f"list(range({n})), [{n}] * {n})"
        )

    def teardown(self, c):
        return textwrap.dedent("""\
            try:
                _ipp_rc.close()
            finally:
                _ipp_cluster.stop_cluster_sync()
            """)


class AirMagicCell(Tool):
    name = "air_magic"
    dist = "air_magic"
    module = "air_magic"
    returns = "yes (cell value: per-rank list)"
    model = (
        "%%distributed cell magic: per launch, N fresh ranks forked from a per-kernel helper process "
        "(started by %load_ext) that imported torch once; results come back as pickles, large "
        "tensors through /dev/shm"
    )
    check_returns = True

    def init_body(self, c):
        return f'get_ipython().run_line_magic("load_ext", "{AIR_MAGIC_EXTENSION}")'

    def launch_body(self, c, port):
        cell = payload_cell(c.sd)
        args = AIR_MAGIC_CELL_ARGS.format(n=c.n)
        return f'_bench_out = get_ipython().run_cell_magic("distributed", {args!r}, {cell!r})'


class AirMagicTracking(AirMagicCell):
    name = "air_magic_tracking"
    returns = "yes (cell value: per-rank list)"
    model = (
        "%%distributed with MLflow tracking on (the default), in a fresh notebook folder: the "
        "first launch's run goes into a new sqlite store (mlflow.db)"
    )
    fresh_folder = True

    def launch_body(self, c, port):
        cell = payload_cell(c.sd)
        return f'_bench_out = get_ipython().run_cell_magic("distributed", {f"-n {c.n}"!r}, {cell!r})'


class AirMagicTrackingImport(AirMagicTracking):
    name = "air_magic_import_mlflow"
    model = (
        "as air_magic_tracking, the cell's code also does `import mlflow` (the documentation's "
        "example does), after the first-user-line stamp: its cost is in the time to result"
    )

    def launch_body(self, c, port):
        cell = payload_cell(c.sd, pre="import mlflow")
        return f'_bench_out = get_ipython().run_cell_magic("distributed", {f"-n {c.n}"!r}, {cell!r})'


class AirMagicSettled(AirMagicCell):
    name = "air_magic+3s"
    model = "as air_magic, the first launch 3 s after %load_ext (a user reading the next cell)"
    fresh_folder = True
    settle_s = 3.0


class AirMagicTrackingSettled(AirMagicTracking):
    name = "air_magic_tracking+3s"
    model = "as air_magic_tracking, the first launch 3 s after %load_ext"
    settle_s = 3.0


class AirMagicDecorator(Tool):
    name = "air_magic_decorator"
    dist = "air_magic"
    module = "air_magic"
    returns = "yes (f.distributed() returns a per-rank list)"
    model = (
        "@distributed decorator, f.distributed(): same launcher as the cell magic (decorating "
        "starts the helper process)"
    )
    check_returns = True

    def init_body(self, c):
        kwargs = AIR_MAGIC_DECORATOR_KWARGS.format(n=c.n)
        return textwrap.dedent(f"""\
            from air_magic import distributed
            @distributed({kwargs})
            def _am_payload():
                return _bench_payload(SD)
            """)

    def launch_body(self, c, port):
        return f"_bench_out = _am_payload.{AIR_MAGIC_LAUNCH_METHOD}()"


class JupyterDistributed(Tool):
    """The kernel itself is the tool: a proxy kernel that runs each cell on N
    persistent rank kernels (what the Jupyter Server extension launches when a
    notebook's "Processes" field is set).  Started here exactly as the server
    extension configures it: ``python -m jupyter_distributed.kernel`` with
    JUPYTER_DISTRIBUTED_WORLD_SIZE / _BASE_KERNEL in the environment."""

    name = "jupyter-distributed"
    dist = "jupyter-distributed"
    module = "jupyter_distributed"
    returns = "no (each rank's output is rendered per rank; no object in a coordinator)"
    model = (
        "proxy kernel + N persistent rank ipykernels (started on the first cell); every cell runs "
        "on all ranks; the payload cell inits/destroys a gloo group on a fresh port each time"
    )
    kernel_mode = "proxy"

    def launch_body(self, c, port):
        return payload_cell(c.sd, pre=f'os.environ["MASTER_PORT"] = "{port}"')


ALL_TOOLS = [
    Torchrun(),
    Accelerate(),
    Torchpod(),
    NbDistributed(),
    IpyParallel(),
    JupyterDistributed(),
    AirMagicCell(),
    AirMagicSettled(),
    AirMagicTracking(),
    AirMagicTrackingSettled(),
    AirMagicTrackingImport(),
    AirMagicDecorator(),
]
TOOLS_BY_NAME = {t.name: t for t in ALL_TOOLS}


# --- second measurement: 256 MiB float32 tensor back from each of 2 ranks ---

RSS_SAMPLER = '''
import threading as _bench_threading, psutil as _bench_psutil
class _RSSPeak:
    """Peak RSS of this (kernel) process while the block runs, sampled every ~1 ms."""
    def __enter__(self):
        self._p = _bench_psutil.Process()
        self.base = self.peak = self._p.memory_info().rss
        self._stop = _bench_threading.Event()
        def run():
            while not self._stop.is_set():
                r = self._p.memory_info().rss
                if r > self.peak:
                    self.peak = r
                self._stop.wait(0.001)
        self._t = _bench_threading.Thread(target=run, daemon=True)
        self._t.start()
        return self
    def __exit__(self, *exc):
        self._stop.set(); self._t.join()
        self.peak = max(self.peak, self._p.memory_info().rss)
        return False
'''

PIPE_BASELINE = """
import multiprocessing as _bench_mp, pickle as _bench_pickle, gc as _bench_gc
import torch
def _pipe_child(conn, numel):
    import torch, pickle
    t = torch.ones(numel, dtype=torch.float32)
    # Plain pickle to bytes: torch's shared-memory reducers are not involved.
    conn.send_bytes(pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL))
    conn.close()
def _pipe_return(numel, nproc=2):
    ctx = _bench_mp.get_context("fork")
    readers, procs = [], []
    for _ in range(nproc):
        r, w = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_pipe_child, args=(w, numel))
        p.start(); w.close()
        readers.append(r); procs.append(p)
    out = [_bench_pickle.loads(r.recv_bytes()) for r in readers]
    for p in procs:
        p.join()
    return out
"""


def air_magic_big_setup(numel: int) -> str:
    kwargs = AIR_MAGIC_DECORATOR_KWARGS.format(n=2)
    return textwrap.dedent(f"""\
        import gc as _bench_gc
        from air_magic import distributed
        @distributed({kwargs})
        def _am_big():
            import torch
            return torch.ones({numel}, dtype=torch.float32)
        @distributed({kwargs})
        def _am_tiny():
            import torch
            return torch.ones(1, dtype=torch.float32)
        """)


def big_body(call: str) -> str:
    # "call_s" times the call alone.  The RSS window also covers one read of
    # every element (the value check): results that arrive as shared-memory
    # mappings only count in the kernel's RSS once their pages are touched.
    return textwrap.dedent(f"""\
        with _RSSPeak() as _bench_rss:
            _bench_c0 = _bench_time.perf_counter()
            _bench_out = {call}
            _bench_rec["call_s"] = _bench_time.perf_counter() - _bench_c0
            _bench_rec["ok_values"] = all(bool((t == 1).all()) for t in _bench_out)
        _bench_rec["rss_base"] = _bench_rss.base
        _bench_rec["rss_peak"] = _bench_rss.peak
        _bench_rec["shapes"] = [list(t.shape) for t in _bench_out]
        """)


BIG_CLEANUP = "del _bench_out\n_bench_gc.collect()\n"
