#!/usr/bin/env python3
"""Side-by-side launch latency of notebook launchers for torch.distributed.

    python benchmarks/launch/run.py [--quick] [--tools a,b] [--ranks 1,2] [--warm K]

Runs each (tool, N) in its own fresh IPython kernel driven over ZMQ with
jupyter_client, like a notebook front end, and writes
benchmarks/launch/results/launch.json and launch.md.  See README.md.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENV = HERE / ".venv"
VENV_PY = VENV / "bin" / "python"


def _reexec_in_venv() -> None:
    """Run under benchmarks/launch/.venv (made by setup_env.sh) if not already."""
    if Path(sys.prefix).resolve() == VENV.resolve():
        return
    if not VENV_PY.exists():
        sys.exit(f"{VENV} not found: run `bash {HERE / 'setup_env.sh'}` first")
    os.execv(str(VENV_PY), [str(VENV_PY), str(Path(__file__).resolve()), *sys.argv[1:]])


_reexec_in_venv()
sys.path.insert(0, str(HERE))

import harness as H  # noqa: E402
import psutil  # noqa: E402
import split as S  # noqa: E402
import tools as T  # noqa: E402

RESULTS = HERE / "results"
PEER_DISTS = [
    "torch",
    "accelerate",
    "torchpod",
    "nbdistributed",
    "ipyparallel",
    "jupyter-distributed",
    "air_magic",
    "ipykernel",
    "jupyter_client",
    "pyzmq",
    "cloudpickle",
]
DEFAULT_TOOLS = [t.name for t in T.ALL_TOOLS] + ["bigreturn", "split"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------
class Env:
    def __init__(self, run_id: str, root: Path, logs: Path):
        self.run_id = run_id
        self.root = root
        self.logs = logs
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True, exist_ok=True)
        self.jupyter_path = root / "jupyter"
        self.kernel_name = "airbench-python"
        H.write_kernelspec(
            self.jupyter_path, self.kernel_name, [str(VENV_PY), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        )
        os.environ["JUPYTER_PATH"] = str(self.jupyter_path)  # harness finds the spec
        self.script = root / "payload_script.py"
        self.script.write_text(T.PAYLOAD_SCRIPT)
        self.torchrun = str(VENV / "bin" / "torchrun")

    def kernel_env(self, session: str) -> dict:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "PYTHONPATH")
        }
        env.update(
            {
                "OMP_NUM_THREADS": "1",
                "MASTER_ADDR": "127.0.0.1",
                "PATH": f"{VENV / 'bin'}:{os.environ.get('PATH', '')}",
                "VIRTUAL_ENV": str(VENV),
                "JUPYTER_PATH": str(self.jupyter_path),
                "JUPYTER_RUNTIME_DIR": str(self.root / "runtime"),
                "JUPYTER_DATA_DIR": str(self.root / "data"),
                "JUPYTER_CONFIG_DIR": str(self.root / "config"),
                "IPYTHONDIR": str(self.root / "ipython"),
                "AIR_MAGIC_STATE_DIR": str(self.root / "state"),
                "HF_HUB_OFFLINE": "1",
                "PYTHONWARNINGS": "ignore",
                H.RUN_VAR: self.run_id,
                H.TAG_VAR: session,
            }
        )
        return env


def machine_info() -> dict:
    from importlib import metadata

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for d in PEER_DISTS:
        try:
            versions[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            versions[d] = None
    return {
        "cpu_model": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "loadavg_start": os.getloadavg(),
    }


def air_magic_status() -> tuple[bool, str]:
    """Is air_magic importable in the bench venv (outside the repo tree)?"""
    import subprocess

    code = (
        "import air_magic\n"
        "assert hasattr(air_magic, 'load_ipython_extension'), 'no load_ipython_extension (cannot %load_ext)'\n"
        "from air_magic import distributed\n"
    )
    r = subprocess.run(
        [str(VENV_PY), "-c", code], capture_output=True, text=True, cwd=tempfile.gettempdir(), timeout=120
    )
    if r.returncode == 0:
        return True, ""
    tail = (r.stderr.strip().splitlines() or ["?"])[-1]
    return False, f"`import air_magic` failed in {VENV}: {tail}"


# ---------------------------------------------------------------------------
# one (tool, N) session
# ---------------------------------------------------------------------------
def run_tool(env: Env, tool: T.Tool, n: int, warm: int, cfg) -> dict:
    res = {
        "tool": tool.name,
        "n": n,
        "status": "ok",
        "reason": None,
        "returns": tool.returns,
        "model": tool.model,
        "timing": ("client" if tool.kernel_mode == "proxy" else "kernel"),
        "init_s": None,
        "cold": {},
        "warm": {},
        "warm_runs_requested": warm,
        "failures": [],
        "notes": [],
    }
    session = f"{env.run_id}-{tool.name}-{n}"
    sd = env.root / "stamps" / f"{tool.name}-{n}"
    sd.mkdir(parents=True, exist_ok=True)
    c = T.Ctx(n, str(sd), str(VENV_PY), env.torchrun, str(env.script))
    kenv = env.kernel_env(session)
    ks = None
    runs: list[dict] = []
    t_session = time.perf_counter()
    try:
        if tool.kernel_mode == "proxy":
            ks, cold_init = _start_proxy(env, tool, n, kenv)
            res["init_s"] = cold_init["dt"]
            res["notes"].append(
                "init = proxy kernel start (client-side); its N rank kernels start "
                "on the first cell, so they are in cold TTR, not in init"
            )
        else:
            cwd = env.root
            if tool.fresh_folder:  # a new notebook folder: no mlflow.db yet
                cwd = env.root / "folders" / session
                cwd.mkdir(parents=True)
            ks = H.KernelSession(env.kernel_name, kenv, cwd=str(cwd), log_path=env.logs / f"{tool.name}-{n}.log")
            ks.run_plain(_setup_code(c, tool), timeout=60)
            cold_init = None
        res["kernel_start_s"] = ks.start_s

        for i in range(1 + warm):
            if i > 0 and time.perf_counter() - t_session > cfg.tool_budget:
                res["notes"].append(f"stopped after {i - 1} warm runs: per-tool budget {cfg.tool_budget:.0f} s reached")
                break
            if i == 0 and tool.kernel_mode != "proxy":
                H.clear_stamps(sd)
                r = ks.run_bracketed(tool.init_body(c), timeout=cfg.init_timeout)
                if not r["rec"]["ok"]:
                    raise H.CellError("init cell failed: " + r["rec"].get("err", "")[-1500:])
                cold_init = {"w0": r["rec"]["w0"], "dt": r["rec"]["p1"] - r["rec"]["p0"], "client_s": r["client_s"]}
                res["init_s"] = cold_init["dt"]
                if tool.post_init(c):
                    ks.run_plain(tool.post_init(c), timeout=60)
                if tool.settle_s:
                    time.sleep(tool.settle_s)
            one = _one_launch(ks, tool, c, sd, cfg)
            if one.get("error"):
                res["failures"].append({"run": i, "error": one["error"]})
                log(f"  {tool.name} N={n} run {i}: FAILED {one['error'][:300]}")
                if i == 0 or len(res["failures"]) >= 2:
                    raise H.CellError(one["error"])
                continue
            if i == 0:
                res["cold"] = {
                    "ttfl_s": one["max_start"] - cold_init["w0"],
                    "ttr_s": cold_init["dt"] + one["ttr_s"],
                    "ttr_client_s": cold_init["client_s"] + one["client_s"],
                    "launch_only_ttr_s": one["ttr_s"],
                }
            else:
                runs.append(one)
            log(
                f"  {tool.name} N={n} {'cold' if i == 0 else 'warm %d' % i}: "
                f"ttfl={one['ttfl_s']:.3f}s ttr={one['ttr_s']:.3f}s client={one['client_s']:.3f}s"
            )
    except Exception as e:  # noqa: BLE001 - one broken peer must not stop the run
        # A failure after the cold launch keeps the runs measured so far.
        res["status"] = "partial" if res["cold"] and runs else "failed"
        res["reason"] = f"{type(e).__name__}: {e}"[:2000]
        if isinstance(e, H.CellTimeout):
            res["failures"].append({"run": len(runs) + 1, "error": res["reason"]})
        log(f"  {tool.name} N={n}: {res['status'].upper()} {res['reason'][:400]}")
        if ks is not None and isinstance(e, H.CellTimeout):
            ks.interrupt()
        if ks is not None:
            res["kernel_log_tail"] = ks.log_tail()
    finally:
        if ks is not None:
            td = tool.teardown(c) if tool.kernel_mode != "proxy" else None
            if td:
                try:
                    ks.run_plain(td, timeout=60)
                except Exception as e:  # noqa: BLE001
                    res["notes"].append(f"teardown: {type(e).__name__}: {str(e)[:300]}")
            ks.shutdown()
        res["warm"] = {
            "ttfl": H.summarize([r["ttfl_s"] for r in runs]),
            "ttr": H.summarize([r["ttr_s"] for r in runs]),
            "ttr_client": H.summarize([r["client_s"] for r in runs]),
        }
        if res["status"] != "failed" and len(runs) < warm:
            res["notes"].append(f"{len(runs)} of {warm} warm runs measured")
        left = H.reap(H.TAG_VAR, session)
        if left:
            res["notes"].append(f"killed {len(left)} leftover process(es) after shutdown")
        res["session_s"] = time.perf_counter() - t_session
    return res


def _setup_code(c: T.Ctx, tool: T.Tool) -> str:
    return f"SD = {c.sd!r}\n" + T.PAYLOAD_FUNCTION + "\n" + tool.setup(c)


def _start_proxy(env: Env, tool: T.Tool, n: int, kenv: dict):
    name = f"airbench-jd-{n}"
    H.write_kernelspec(
        env.jupyter_path,
        name,
        [str(VENV_PY), "-m", "jupyter_distributed.kernel", "-f", "{connection_file}"],
        interrupt_mode="message",
    )
    kenv = dict(kenv)
    kenv.update(
        {
            "JUPYTER_DISTRIBUTED_WORLD_SIZE": str(n),
            "JUPYTER_DISTRIBUTED_BASE_KERNEL": env.kernel_name,
            "JUPYTER_DISTRIBUTED_CWD": str(env.root),
        }
    )
    w0 = time.time()
    t0 = time.perf_counter()
    ks = H.KernelSession(name, kenv, cwd=str(env.root), log_path=env.logs / f"{tool.name}-{n}.log")
    dt = time.perf_counter() - t0
    return ks, {"w0": w0, "dt": dt, "client_s": dt}


def _one_launch(ks: H.KernelSession, tool: T.Tool, c: T.Ctx, sd: Path, cfg) -> dict:
    port = H.free_port()
    H.clear_stamps(sd)
    try:
        if tool.kernel_mode == "proxy":
            r = ks.execute(tool.launch_body(c, port), timeout=cfg.launch_timeout)
            if r["reply"].get("status") != "ok" or r["errors"]:
                return {"error": f"cell error: {r['errors'] or r['reply'].get('evalue')} {r['stdout'][-500:]}"}
            w0, ttr = r["w_send"], r["client_s"]
        else:
            r = ks.run_bracketed(tool.launch_body(c, port), timeout=cfg.launch_timeout)
            rec = r["rec"]
            if not rec["ok"]:
                return {"error": rec.get("err", "?")[-1500:]}
            w0, ttr = rec["w0"], rec["p1"] - rec["p0"]
            post = tool.post_launch(c)
            if post:
                ks.run_plain(post, timeout=60)
    except H.CellTimeout as e:
        raise H.CellTimeout(f"launch: {e}") from e
    starts, dones = H.read_stamps(sd)
    if len(starts) != c.n or len(dones) != c.n or any(abs(v - c.n) > 1e-6 for v in dones):
        return {
            "error": f"expected {c.n} ranks reducing to {c.n}: saw {len(starts)} start "
            f"stamps, done values {dones}; stdout tail: {r['stdout'][-600:]}"
        }
    if tool.check_returns and tool.kernel_mode != "proxy":
        vals = r["rec"].get("out_list")
        if not (
            isinstance(vals, list)
            and len(vals) == c.n
            and all(isinstance(v, list) and len(v) == 2 and abs(v[1] - c.n) < 1e-6 for v in vals)
        ):
            return {"error": f"return value is not a per-rank list of (t0, {c.n}): {r['rec'].get('out')}"}
    return {"ttfl_s": max(starts) - w0, "ttr_s": ttr, "client_s": r["client_s"], "max_start": max(starts)}


# ---------------------------------------------------------------------------
# 256 MiB return path
# ---------------------------------------------------------------------------
def run_bigreturn(env: Env, reps: int, have_air: bool, air_reason: str, cfg) -> dict:
    numel = T.TENSOR_256MB_NUMEL
    out = {"numel_per_rank": numel, "mib_per_rank": numel * 4 / 2**20, "ranks": 2, "rows": []}
    variants = [("pipe (multiprocessing fork + pickle.dumps bytes)", "pipe")]
    variants.append(("air_magic f.distributed()", "air_magic"))
    for label, key in variants:
        row = {"method": label, "status": "ok", "reason": None}
        if key == "air_magic" and not have_air:
            row.update(status="pending", reason=air_reason)
            out["rows"].append(row)
            log(f"  bigreturn {key}: pending ({air_reason})")
            continue
        session = f"{env.run_id}-bigreturn-{key}"
        ks = None
        try:
            ks = H.KernelSession(
                env.kernel_name, env.kernel_env(session), cwd=str(env.root), log_path=env.logs / f"bigreturn-{key}.log"
            )
            setup = T.RSS_SAMPLER + (T.PIPE_BASELINE if key == "pipe" else T.air_magic_big_setup(numel))
            ks.run_plain(setup, timeout=cfg.init_timeout)
            big = "_pipe_return(%d, 2)" % numel if key == "pipe" else "_am_big.distributed()"
            tiny = "_pipe_return(1, 2)" if key == "pipe" else "_am_tiny.distributed()"
            # warm-up (untimed): first launch costs are not part of this measurement
            ks.run_plain(f"_bench_w = {tiny}\ndel _bench_w", timeout=cfg.launch_timeout)
            samples = {"tiny": [], "big": []}
            for kind, call in (("tiny", tiny), ("big", big)):
                for _ in range(reps):
                    r = ks.run_bracketed(T.big_body(call), timeout=cfg.launch_timeout)
                    rec = r["rec"]
                    if not rec["ok"]:
                        raise H.CellError(rec.get("err", "?")[-1500:])
                    want = [[numel if kind == "big" else 1]] * 2
                    if rec.get("shapes") != want or not rec.get("ok_values"):
                        raise H.CellError(f"unexpected result shapes {rec.get('shapes')}")
                    samples[kind].append(
                        {"s": rec["call_s"], "rss_delta_mib": (rec["rss_peak"] - rec["rss_base"]) / 2**20}
                    )
                    ks.run_plain(T.BIG_CLEANUP, timeout=60)
                    log(
                        f"  bigreturn {key} {kind}: {samples[kind][-1]['s']:.3f}s "
                        f"peak RSS +{samples[kind][-1]['rss_delta_mib']:.0f} MiB"
                    )
            row["tiny"] = H.summarize([s["s"] for s in samples["tiny"]])
            row["big"] = H.summarize([s["s"] for s in samples["big"]])
            row["rss_delta_mib"] = H.summarize([s["rss_delta_mib"] for s in samples["big"]])
            row["transfer_estimate_s"] = row["big"]["median"] - row["tiny"]["median"]
        except Exception as e:  # noqa: BLE001
            row.update(status="failed", reason=f"{type(e).__name__}: {e}"[:1500])
            log(f"  bigreturn {key}: FAILED {row['reason'][:300]}")
        finally:
            if ks is not None:
                ks.shutdown()
            H.reap(H.TAG_VAR, session)
        out["rows"].append(row)
    return out


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------
def _f(x, nd=2):
    return "—" if x is None else f"{x:.{nd}f}"


def _med(s):
    return None if not s else s["median"]


def render_markdown(data: dict) -> str:
    m = data["machine"]
    lines = ["# Launch latency: notebook launchers for torch.distributed", ""]
    lines.append(
        f"Run {data['started']} ({'quick' if data['config']['quick'] else 'full'} mode, "
        f"{data['config']['warm']} warm runs requested per tool, "
        f"{data['config']['warm_fresh']} for tools that start fresh interpreters per launch)."
    )
    lines.append("")
    lines.append(
        f"Machine: {m['cpu_model']}, {m['usable_cpus']} usable CPUs, {m['ram_gib']} GiB RAM, "
        f"{m['os']}, Python {m['python']}.  Load average at start "
        f"{', '.join('%.2f' % x for x in m['loadavg_start'])}, at end "
        f"{', '.join('%.2f' % x for x in data.get('loadavg_end', [0, 0, 0]))}."
    )
    lines.append(
        "Versions: "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
        + (
            "; not installed: " + ", ".join(k for k, v in m["versions"].items() if not v)
            if any(not v for v in m["versions"].values())
            else ""
        )
    )
    if data.get("merged_with_run"):
        la = data.get("merged_run_loadavg") or [None, None]
        la_txt = (
            f" (load average {', '.join('%.2f' % x for x in la[0])} at its start, "
            f"{', '.join('%.2f' % x for x in la[1])} at its end)"
            if la[0] and la[1]
            else ""
        )
        lines.append(
            f"Merged with the run of {data['merged_with_run']}{la_txt}: rows not re-measured now come "
            "from that run (see `measured` in launch.json); compare rows from different runs with care."
        )
    if data.get("plain_kernel_start_s") is not None:
        lines.append(f"Plain ipykernel start (not counted in any number below): {data['plain_kernel_start_s']:.2f} s.")
    lines.append("")
    lines.append(
        "TTFL = time to first user line (kernel `time.time()` before the call → latest rank's "
        "first-line stamp).  TTR = time to result (kernel-side `perf_counter` bracket around "
        "the call; jupyter-distributed: client-side execute_request → execute_reply, marked †).  "
        "Cold = import/start cell + first launch in a fresh kernel.  Seconds; warm = median / p90 "
        "(nearest rank) over the warm runs.  Ratios: warm TTR median ÷ the same for torchrun / "
        "air_magic at the same N."
    )
    by_n: dict[int, list] = {}
    for r in data["launch"]:
        by_n.setdefault(r["n"], []).append(r)
    for n in sorted(by_n):
        rows = by_n[n]
        title = f"## N = {n}" + (" (oversubscribed: more ranks than the 2 cores)" if n > m["usable_cpus"] else "")
        lines += [
            "",
            title,
            "",
            "| tool | init | cold TTFL | cold TTR | warm TTFL med / p90 | warm TTR med / p90 | "
            "warm client med | runs | returns values | × torchrun | × air_magic |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        ref_tr = next(
            (_med(r["warm"].get("ttr")) for r in rows if r["tool"] == "torchrun" and r["status"] in ("ok", "partial")),
            None,
        )
        ref_am = next(
            (_med(r["warm"].get("ttr")) for r in rows if r["tool"] == "air_magic" and r["status"] in ("ok", "partial")),
            None,
        )
        for r in rows:
            if r["status"] not in ("ok", "partial"):
                lines.append(f"| {r['tool']} | **{r['status']}** (see notes) |" + " — |" * 9)
                continue
            w = r["warm"]
            dag = " †" if r["timing"] == "client" else ""
            med = _med(w.get("ttr"))
            x_tr = _ratio(med, ref_tr)
            x_am = _ratio(med, ref_am)
            ttfl, ttr = w.get("ttfl"), w.get("ttr")
            tag = " (partial)" if r["status"] == "partial" else ""
            lines.append(
                f"| {r['tool']}{tag} | {_f(r['init_s'])} | {_f(r['cold'].get('ttfl_s'))} | "
                f"{_f(r['cold'].get('ttr_s'))}{dag} | "
                f"{_f(ttfl and ttfl['median'], 3)} / {_f(ttfl and ttfl['p90'], 3)} | "
                f"{_f(ttr and ttr['median'], 3)} / {_f(ttr and ttr['p90'], 3)}{dag} | "
                f"{_f(_med(w.get('ttr_client')), 3)} | {ttr['n'] if ttr else 0} | "
                f"{r['returns'].split(' ')[0]} | {x_tr} | {x_am} |"
            )
    big = data.get("bigreturn")
    if big:
        lines += [
            "",
            f"## Returning a {big['mib_per_rank']:.0f} MiB float32 tensor from each of {big['ranks']} ranks",
            "",
            "Warm launches (one untimed warm-up first).  Time = kernel-side `perf_counter` around the "
            "call; tiny = same call returning 1 element; transfer ≈ big − tiny (medians).  Peak RSS = "
            "kernel process peak above its level before the call, sampled every ~1 ms over the call "
            "plus one read of every returned element (so shared-memory results are counted once "
            f"touched); the {2 * big['mib_per_rank']:.0f} MiB of results themselves are included.",
            "",
            "| method | big: median s (runs) | tiny: median s | transfer ≈ s | peak kernel RSS Δ MiB |",
            "|---|---|---|---|---|",
        ]
        for r in big["rows"]:
            if r["status"] != "ok":
                lines.append(f"| {r['method']} | **{r['status']}**: {_oneline(r['reason'])} | — | — | — |")
                continue
            lines.append(
                f"| {r['method']} | {_f(r['big']['median'], 3)} ({r['big']['n']}) | "
                f"{_f(r['tiny']['median'], 3)} | {_f(r['transfer_estimate_s'], 3)} | "
                f"{_f(r['rss_delta_mib']['max'], 0)} |"
            )
    lines += S.render(data.get("split") or [])
    notes = []
    seen = set()
    for r in data["launch"]:
        if r["status"] != "ok":
            key = (r["tool"], r["status"], r["reason"])
            if r["status"] == "skipped" and key in seen:
                continue
            seen.add(key)
            where = "all N" if r["status"] == "skipped" else f"N={r['n']}"
            notes.append((r["tool"], where, f"{r['status']}: {_oneline(r['reason'], 600)}"))
    notes += [(r["tool"], f"N={r['n']}", x) for r in data["launch"] for x in r.get("notes", [])]
    notes += [
        (r["tool"], f"N={r['n']}", f"run {f['run']} failed: {_oneline(f['error'], 300)}")
        for r in data["launch"]
        for f in r.get("failures", [])
        if r["status"] in ("ok", "partial")
    ]
    if notes:
        grouped: dict[tuple, list] = {}
        for t, n, x in notes:
            grouped.setdefault((t, x), []).append(n)
        lines += ["", "Notes:", ""]
        for (t, x), ns in grouped.items():
            where = ns[0] if len(ns) == 1 else "N=" + ",".join(w.removeprefix("N=") for w in ns)
            lines.append(f"- {t} {where}: {x}")
    return "\n".join(lines) + "\n"


def _ratio(a, b):
    if not a or not b:
        return "—"
    x = a / b
    return f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def _oneline(s, n=160):
    s = " ".join(str(s or "").split())
    return (s[:n] + "…") if len(s) > n else s


def merge_results(old: dict, new: dict) -> dict:
    """New rows replace old rows for the same (tool, N); old rows are kept
    and stamped with the run they came from."""
    fresh = {(r["tool"], r["n"]) for r in new["launch"] if r["status"] != "skipped"}
    kept = []
    for r in old.get("launch", []):
        if (r["tool"], r["n"]) in fresh:
            continue
        r = dict(r)
        r.setdefault("measured", old.get("started"))
        if r["status"] == "skipped" and any((x["tool"], x["n"]) == (r["tool"], r["n"]) for x in new["launch"]):
            continue
        kept.append(r)
    for r in new["launch"]:
        r.setdefault("measured", new["started"])
    order = {t.name: i for i, t in enumerate(T.ALL_TOOLS)}
    new["launch"] = sorted(kept + new["launch"], key=lambda r: (r["n"], order.get(r["tool"], 99)))
    if new.get("bigreturn") is None:
        new["bigreturn"] = old.get("bigreturn")
    new["merged_with_run"] = old.get("started")
    new["merged_run_loadavg"] = [old.get("machine", {}).get("loadavg_start"), old.get("loadavg_end")]
    return new


# ---------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: N=1,2, 3 warm runs, 1 big-return rep (numbers are indicative only)",
    )
    ap.add_argument("--tools", default=None, help="comma list from: " + ",".join(DEFAULT_TOOLS) + " (default: all)")
    ap.add_argument("--ranks", default=None, help="comma list of N (default 1,2,4; quick 1,2)")
    ap.add_argument("--warm", type=int, default=None, help="warm runs per tool (default 10; quick 3)")
    ap.add_argument(
        "--warm-fresh",
        type=int,
        default=None,
        help="warm runs for tools that start fresh interpreters per launch (torchrun, torchpod; default 5; quick 3)",
    )
    ap.add_argument("--big-reps", type=int, default=None, help="big-return repetitions (default 3; quick 1)")
    ap.add_argument("--init-timeout", type=float, default=300.0)
    ap.add_argument("--launch-timeout", type=float, default=180.0)
    ap.add_argument(
        "--tool-budget",
        type=float,
        default=None,
        help="seconds per (tool, N) session before warm runs stop (default 600; quick 180)",
    )
    ap.add_argument(
        "--load",
        type=int,
        default=0,
        help="busy loops (one process each) kept running beside the whole run: the machine under load",
    )
    ap.add_argument("--out", default=str(RESULTS / "launch.json"))
    ap.add_argument(
        "--merge",
        action="store_true",
        help="merge into an existing --out file: rows for the (tool, N) measured now "
        "replace the old ones, the rest are kept (marked with their run time)",
    )
    cfg = ap.parse_args()
    cfg.ranks = [int(x) for x in (cfg.ranks or ("1,2" if cfg.quick else "1,2,4")).split(",")]
    cfg.warm = cfg.warm if cfg.warm is not None else (3 if cfg.quick else 10)
    cfg.warm_fresh = cfg.warm_fresh if cfg.warm_fresh is not None else (3 if cfg.quick else 5)
    cfg.big_reps = cfg.big_reps if cfg.big_reps is not None else (1 if cfg.quick else 3)
    cfg.tool_budget = cfg.tool_budget if cfg.tool_budget is not None else (180.0 if cfg.quick else 600.0)
    names = cfg.tools.split(",") if cfg.tools else DEFAULT_TOOLS
    unknown = [x for x in names if x not in DEFAULT_TOOLS]
    if unknown:
        ap.error(f"unknown tool(s) {unknown}; choose from {DEFAULT_TOOLS}")

    run_id = uuid.uuid4().hex[:12]
    root = Path(tempfile.mkdtemp(prefix="airbench-launch-"))
    torchpod_dir_existed = Path("/tmp/torchpod").exists()

    def _cleanup(*_a):
        killed = H.reap(H.RUN_VAR, run_id)
        if killed:
            log(f"killed {len(killed)} leftover process(es): {killed}")
        shutil.rmtree(root, ignore_errors=True)
        if not torchpod_dir_existed:
            shutil.rmtree("/tmp/torchpod", ignore_errors=True)  # torchpod's fixed log dir

    atexit.register(_cleanup)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))

    env = Env(run_id, root, Path(cfg.out).parent / "logs")
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], env={**os.environ, H.RUN_VAR: run_id})
        for _ in range(cfg.load)
    ]
    atexit.register(lambda: [p.kill() for p in busy])
    if busy:
        log(f"{len(busy)} busy loop(s) run beside the whole run (pids {[p.pid for p in busy]})")
    data = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine_info(),
        "config": {
            "quick": cfg.quick,
            "ranks": cfg.ranks,
            "warm": cfg.warm,
            "warm_fresh": cfg.warm_fresh,
            "big_reps": cfg.big_reps,
            "tools": names,
            "load": cfg.load,
        },
        "launch": [],
        "bigreturn": None,
    }
    have_air, air_reason = air_magic_status()
    if not have_air:
        log(
            f"air_magic: SKIPPED - {air_reason}.  Install it (bash {HERE / 'setup_env.sh'}) and rerun "
            f"`run.py --tools air_magic,air_magic_decorator,bigreturn` to measure it."
        )
    data["air_magic_available"] = have_air
    data["air_magic_reason"] = air_reason or None

    # reference: what a plain kernel start costs (excluded from every cold number)
    try:
        ks = H.KernelSession(
            env.kernel_name, env.kernel_env(f"{run_id}-plain"), cwd=str(root), log_path=env.logs / "plain-kernel.log"
        )
        data["plain_kernel_start_s"] = ks.start_s
        ks.shutdown()
    except Exception as e:  # noqa: BLE001
        data["plain_kernel_start_s"] = None
        log(f"plain kernel start failed: {e}")
    H.reap(H.TAG_VAR, f"{run_id}-plain")

    try:
        for name in names:
            if name in ("bigreturn", "split"):
                continue
            tool = T.TOOLS_BY_NAME[name]
            for n in cfg.ranks:
                if tool.dist == "air_magic" and not have_air:
                    data["launch"].append(
                        {
                            "tool": name,
                            "n": n,
                            "status": "skipped",
                            "reason": air_reason,
                            "returns": tool.returns,
                            "model": tool.model,
                            "warm": {},
                            "cold": {},
                            "notes": [],
                        }
                    )
                    continue
                warm = cfg.warm_fresh if tool.fresh_interpreters else cfg.warm
                log(f"{name} N={n}: fresh kernel, 1 cold + {warm} warm launches")
                data["launch"].append(run_tool(env, tool, n, warm, cfg))
        if "bigreturn" in names:
            log(f"bigreturn: 2 ranks x {T.TENSOR_256MB_NUMEL * 4 / 2**20:.0f} MiB, {cfg.big_reps} rep(s)")
            data["bigreturn"] = run_bigreturn(env, cfg.big_reps, have_air, air_reason, cfg)
        if "split" in names and have_air:
            data["split"] = []
            for n in [n for n in cfg.ranks if n > 1]:
                for tracking in (False, True):
                    log(f"split: where a warm launch spends its time, N={n}, tracking {'on' if tracking else 'off'}")
                    data["split"].append(
                        S.run_split(
                            env,
                            env.kernel_name,
                            n,
                            tracking,
                            cfg.warm,
                            3,
                            env.logs,
                            f"{run_id}-split-{n}-{int(tracking)}",
                        )
                    )
    except KeyboardInterrupt:
        log("interrupted: writing partial results")
        data["interrupted"] = True
    except Exception:  # noqa: BLE001
        data["harness_error"] = traceback.format_exc()
        log("harness error:\n" + data["harness_error"])
    data["loadavg_end"] = os.getloadavg()
    data["tool_models"] = {t.name: {"model": t.model, "returns": t.returns} for t in T.ALL_TOOLS}

    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if cfg.merge and out.exists():
        data = merge_results(json.loads(out.read_text()), data)
    out.write_text(json.dumps(data, indent=2, default=str))
    md = render_markdown(data)
    out.with_suffix(".md").write_text(md)
    print()
    print(md)
    log(f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if "harness_error" not in data else 1


if __name__ == "__main__":
    sys.exit(main())
