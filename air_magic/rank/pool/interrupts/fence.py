"""The fence: once a pool rank is told to stop, the next collective it starts raises there,
before a byte is sent, wherever it starts it from (the user's ``dist.all_reduce``, FSDP's
hooks, DeepSpeed, or DDP's reducer in C++).

Every collective of torch's process groups, Python's and C++'s alike, goes through torch's
dispatcher as an operator of the ``c10d`` library (``c10d::allreduce_``, ``c10d::broadcast_``,
...).  :func:`arm` registers, for each, a kernel at the ``Autograd`` key (above the one that
runs it): it raises ``KeyboardInterrupt``; :func:`disarm` removes them::

    arm()     main thread, in a Python line (the rank's SIGINT handling): a kernel
              per c10d operator, 0.05 ms of Python per collective while armed
    the rank's next collective  -> KeyboardInterrupt, before it is issued: no peer
              can pair with it, and nothing completes with data a rank did not send
    disarm()  at the end of the call (a rank is idle between calls)

Armed only while an interrupt waits for its stop (a kernel in Python costs each collective
tens of microseconds), and only from the main thread while it runs Python: the thread that
could be inside one of these operators then (the autograd engine's) is not running.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["arm", "disarm", "armed", "OPERATORS"]

#: The collectives of torch's ``c10d`` library (the operators each ``ProcessGroup`` method
#: calls).  Point-to-point ones are among them: a send that a stopped peer never receives
#: would wait just the same.
OPERATORS = (
    "allreduce_",
    "allreduce_coalesced_",
    "allgather_",
    "_allgather_base_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "broadcast_",
    "reduce_",
    "gather_",
    "scatter_",
    "alltoall_",
    "alltoall_base_",
    "barrier",
    "monitored_barrier_",
    "send",
    "recv_",
    "recv_any_source_",
)

#: The torch library whose kernels are registered while armed (None: disarmed), and why the
#: rank stops (the text of the KeyboardInterrupt).
_state: dict[str, Any] = {"library": None, "why": ""}


def armed() -> bool:
    return _state["library"] is not None


def arm(why: str = "the pool's interrupt") -> bool:
    """From now on the rank's next collective raises KeyboardInterrupt before it starts.
    False where torch is not imported or has no ``c10d`` operators (nothing to fence)."""
    if _state["library"] is not None:
        return True
    torch = sys.modules.get("torch")
    if torch is None or "torch.distributed" not in sys.modules:
        return False
    try:
        library = torch.library.Library("c10d", "IMPL")
    except Exception:  # a torch without the library API
        return False
    made = 0
    for name in OPERATORS:
        packet = getattr(torch.ops.c10d, name, None)
        op = getattr(packet, "default", None)
        if op is None:
            continue
        try:
            library.impl(name, _kernel(torch, name), "Autograd")
            made += 1
        except Exception:  # (an operator this torch does not have)
            continue
    if not made:
        library._destroy()
        return False
    _state.update(library=library, why=why)
    return True


def disarm() -> None:
    """The collectives run again as torch runs them."""
    library, _state["library"] = _state["library"], None
    if library is not None:
        try:
            library._destroy()
        except Exception:  # (an interpreter on its way out)
            pass


def _kernel(torch: Any, name: str) -> Any:
    def stop(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt(f"stopped before a collective ({_op_name(name)}): {_state['why']}")

    return stop


def _op_name(name: str) -> str:
    return name.strip("_").replace("allreduce", "all_reduce").replace("allgather", "all_gather")
