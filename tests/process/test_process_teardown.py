"""``destroy_process_group()`` in a rank: the group is gone when the call returns, as in a
torchrun worker; only the freeing of a gloo group's C++ objects (20 ms of waiting for
gloo's event loop) happens in a thread."""

from __future__ import annotations

import sys

import cloudpickle
import pytest

from air_magic import distributed

pytestmark = pytest.mark.process

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@distributed(num_accelerators=2, tracking=False)
def destroy_then_again() -> tuple[bool, bool, float, float, list[str], bool]:
    import threading

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sub = dist.new_group([0, 1])
    first = torch.ones(1)
    dist.all_reduce(first, group=sub)
    dist.destroy_process_group()
    gone = not dist.is_initialized()
    # A new group at once: the old one is shut down and forgotten already.
    dist.init_process_group("gloo")
    second = torch.full((1,), 2.0)
    dist.all_reduce(second)
    again = dist.is_initialized()
    dist.destroy_process_group()
    freeing = sorted({t.name for t in threading.enumerate() if t.name.startswith("air_magic-")})
    wrapped = dist.destroy_process_group.__wrapped__ is torch.distributed.distributed_c10d.destroy_process_group
    return gone, again, first.item(), second.item(), freeing, wrapped


def test_destroy_process_group_ends_the_group_and_a_new_one_works_at_once() -> None:
    for gone, again, first, second, freeing, wrapped in destroy_then_again.distributed():
        assert (gone, again, first, second) == (True, True, 2.0, 4.0)
        assert set(freeing) <= {"air_magic-gloo-teardown"}  # the only thread air_magic may leave
        assert wrapped  # torch's own function does the work


@distributed(num_accelerators=2, tracking=False)
def destroy_one_group() -> tuple[bool, float]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    sub = dist.new_group([0, 1])
    dist.destroy_process_group(sub)  # a subgroup only: the default group stays
    value = torch.ones(1)
    dist.all_reduce(value)
    alive = dist.is_initialized()
    dist.destroy_process_group()
    return alive, value.item()


def test_destroying_a_subgroup_keeps_the_default_group() -> None:
    assert destroy_one_group.distributed() == [(True, 2.0), (True, 2.0)]
