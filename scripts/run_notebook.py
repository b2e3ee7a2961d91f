"""Run a notebook headless in a real Jupyter kernel and print what each cell shows, as it runs.

python scripts/run_notebook.py notebooks/quickstart.ipynb [--output executed.ipynb]

Each code cell's source is printed when it starts, then its output as the kernel sends it
(streams, displays, errors: nbclient's ``output`` step, extended); a display updated in
place (a launch's panel turning into its summary) is printed again once its cell is done,
as it ended.

The kernel talks to this script over Unix sockets in a private folder (ZeroMQ's IPC
transport), not over loopback TCP: no other user of the machine can reach it, and ipykernel
has nothing to warn about.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from typing import Any

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def _text(output: Any) -> str:
    kind = output.get("output_type")
    if kind == "stream":
        return str(output.get("text", ""))
    if kind in ("execute_result", "display_data"):
        text = output.get("data", {}).get("text/plain")
        return f"{text}\n" if text else ""
    if kind == "error":
        return "\n".join(output.get("traceback", [])) + "\n"
    return ""


class StreamingClient(NotebookClient):  # type: ignore[misc]
    """nbclient's client, printing each cell's outputs as they come."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_cell_start = self._started
        self.on_cell_executed = self._executed
        self._updated: dict[str, int] = {}  # display ids updated in place while their cell ran

    def _started(self, cell: Any, cell_index: int) -> None:
        sys.stdout.write(f"--- cell {cell_index} ---\n{cell.source}\n--- output ---\n")
        sys.stdout.flush()
        self._updated = {}

    def output(self, outs: list[Any], msg: dict[str, Any], display_id: str | None, cell_index: int) -> Any:
        out = super().output(outs, msg, display_id, cell_index)
        if out is not None:
            text = _text(out)
            stream = sys.stderr if out.get("name") == "stderr" else sys.stdout
            stream.write(text)
            stream.flush()
        return out

    def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
        if msg.get("msg_type") == "update_display_data":
            display_id = (msg.get("content", {}).get("transient") or {}).get("display_id")
            if display_id:
                self._updated[display_id] = cell_index
        return super().process_message(msg, cell, cell_index)

    def _executed(self, cell: Any, cell_index: int, execute_reply: Any) -> None:
        shown = {i for ids in self._updated for i in self._display_id_map.get(ids, {}).get(cell_index, [])}
        for index in sorted(shown):
            text = _text(cell.outputs[index])
            if text:
                sys.stdout.write(f"--- as it ended ---\n{text}")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--output", help="write the executed notebook here")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    args = parser.parse_args(argv)
    notebook = nbformat.read(args.notebook, as_version=4)
    sockets = tempfile.mkdtemp(prefix="am-kernel-")  # 0700: the kernel's sockets are this user's only
    # A kernel that ends takes its ranks and helper along and deletes its temporary folders:
    # on a loaded machine that can take longer than the 5 s after which it would be terminated.
    km = KernelManager(kernel_name="python3", transport="ipc", ip=f"{sockets}/kernel", shutdown_wait_time=60.0)
    client = StreamingClient(notebook, km=km, timeout=args.timeout, kernel_name="python3")
    status = 0
    try:
        client.execute()
    except CellExecutionError:
        status = 1
    finally:
        # nbclient shuts down only the kernels of managers it made: this one is ours to end.
        # Left alone, the kernel sees this process gone and leaves at once (os._exit), before
        # its exit hooks end the helper and delete its temporary folders.
        if km.has_kernel:
            km.shutdown_kernel()
        shutil.rmtree(sockets, ignore_errors=True)
    if args.output:
        nbformat.write(notebook, args.output)
    return status


if __name__ == "__main__":
    sys.exit(main())
