"""Run a notebook headless in a real Jupyter kernel and print what each cell showed.

python scripts/run_notebook.py notebooks/quickstart.ipynb [--output executed.ipynb]
"""

from __future__ import annotations

import argparse
import sys

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def _show(cell: nbformat.NotebookNode) -> None:
    for output in cell.get("outputs", []):
        kind = output.get("output_type")
        if kind == "stream":
            sys.stdout.write(output.get("text", ""))
        elif kind in ("execute_result", "display_data"):
            text = output.get("data", {}).get("text/plain")
            if text:
                print(text)
        elif kind == "error":
            print("\n".join(output.get("traceback", [])))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook")
    parser.add_argument("--output", help="write the executed notebook here")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    args = parser.parse_args(argv)
    notebook = nbformat.read(args.notebook, as_version=4)
    client = NotebookClient(notebook, timeout=args.timeout, kernel_name="python3")
    status = 0
    try:
        client.execute()
    except CellExecutionError:
        status = 1
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            print(f"--- cell {index} ---")
            print(cell.source)
            print("--- output ---")
            _show(cell)
    if args.output:
        nbformat.write(notebook, args.output)
    return status


if __name__ == "__main__":
    sys.exit(main())
