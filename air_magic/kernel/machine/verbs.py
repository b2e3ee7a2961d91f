"""``air-magic ps`` and ``air-magic stop ID``: the machine's list from a terminal (the root's
:mod:`air_magic.cli` parses the command line; the list is read by :mod:`air_magic.kernel.machine.ps`).
Nothing of the launch is imported: both answer at once."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_parsers", "run"]


def add_parsers(verbs: Any) -> None:
    """The ``ps`` and ``stop`` verbs on ``air-magic``'s subparsers."""
    ps = verbs.add_parser(
        "ps",
        help="list the machine's air_magic launches and pools (every user's), and GPU memory no launch holds",
        description="Every air_magic launch and pool on this machine: yours in full (kernel, notebook, pids, "
        "GPUs, GPU and host memory, state, age), other users' as owner, GPUs and age; then the processes "
        "holding GPU memory that are no launch's.",
    )
    ps.add_argument("--json", action="store_true", help="a JSON list, for scripts")
    stop = verbs.add_parser(
        "stop",
        help="stop one of your launches or pools (its cell says it was stopped from outside)",
        description="Stop a launch or pool of yours by its id (air-magic ps lists them): its ranks get SIGTERM, "
        "then SIGKILL after 5 s; its notebook cell raises, saying who stopped it. Someone else's is refused "
        "(root may).",
    )
    stop.add_argument("id", metavar="ID", help="the launch's or pool's id, as air-magic ps shows it")


def run(args: argparse.Namespace) -> int:
    """``air-magic ps`` and ``air-magic stop ID``."""
    from air_magic.kernel.machine import ps as machine

    try:
        if args.verb == "stop":
            print(machine.stop(args.id))
            return 0  # (air-magic exit statuses: 0 done, 1 failed)
        found, skipped = machine.rows()
        if args.json:
            print(json.dumps(found, indent=1))
        else:
            print(machine.table(found, machine.orphans(), skipped))
        for line in skipped if args.json else ():
            sys.stderr.write(f"[air_magic] skipped a record: {line}\n")
        return 0
    except (machine.StopError, OSError) as exc:  # OSError: the list's folder cannot be trusted
        sys.stderr.write(f"air-magic {args.verb}: error: {exc}\n")
        return 1
