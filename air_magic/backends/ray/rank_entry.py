"""A rank of a Ray launch: ``python -m air_magic.backends.ray.rank_entry REQUEST RANK PORT ALIVE_FD``.

Started by the rank's agent (:mod:`air_magic.backends.ray.agent`) on the node Ray placed it on, as a
fresh Python process -- what ``torchrun`` starts on each node -- and then exactly a local rank
(:func:`air_magic.rank.main.child_main`): its own session, its log file, the environment and
``sys.path`` of the request (with the placement's ``NODE_RANK``, ``LOCAL_RANK``,
``MASTER_ADDR``...), the user's code, a result record, ``os._exit``.  It dies with its agent:
the agent holds the only write end of the pipe ``ALIVE_FD`` reads.

``rank_entry --spare ALIVE_FD`` is such a process started ahead by an agent a pool keeps: it
imports torch, then reads ``REQUEST<TAB>RANK<TAB>PORT`` from its standard input and runs that
rank as above (an agent that goes away closes that input: the spare ends).
"""

from __future__ import annotations

import pickle
import sys


def main(argv: list[str]) -> None:
    if argv[0] == "--spare":
        alive_fd = int(argv[1])
        import air_magic.rank.main  # noqa: F401 - what every rank runs, imported ahead

        try:
            import torch  # noqa: F401 - what a launch's code imports first, imported ahead
        except ImportError:
            pass
        line = sys.stdin.readline()
        if not line.strip():  # the agent went away before it had a launch for this process
            return
        request_file, rank_text, port_text = line.rstrip("\n").split("\t")
        rank, port = int(rank_text), int(port_text)
    else:
        request_file, rank, port, alive_fd = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    with open(request_file, "rb") as handle:
        request = pickle.load(handle)  # written by this rank's agent in its private folder
    from air_magic.rank import main as _rank

    _rank.child_main(request, rank, port, alive_fd, [])  # never returns


if __name__ == "__main__":
    main(sys.argv[1:])
