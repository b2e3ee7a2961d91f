"""Limits a user can hit by mistake: rank counts beyond the machine, timeouts, numeric types."""

from __future__ import annotations

import os
import warnings
from fractions import Fraction

import numpy as np
import pytest
from IPython.core.error import UsageError

from air_magic import AcceleratorType, ConfigurationError, distributed
from air_magic.accelerators import Hardware, detect_hardware, usable_cpu_count
from air_magic.errors import CPUOversubscriptionWarning, TooManyCPURanksError
from air_magic.magics import _timeout_arg
from air_magic.spec import make_spec

TWO_CORES = Hardware(0, None, cpu_count=2)


@pytest.fixture(autouse=True)
def no_rank_bound_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIR_MAGIC_MAX_CPU_RANKS", raising=False)


# -- CPU ranks ---------------------------------------------------------------------------------


def test_a_million_cpu_ranks_are_refused_naming_cores_bound_and_override() -> None:
    with pytest.raises(TooManyCPURanksError) as info:
        make_spec(1_000_000).resolve(TWO_CORES)
    assert str(info.value) == (
        "num_accelerators=1000000 was asked for (CPU ranks), but this machine has 2 usable CPU "
        "cores and air_magic starts at most 8 CPU ranks on it (4 per core). Pass "
        "num_accelerators=8 or fewer, or set the environment variable AIR_MAGIC_MAX_CPU_RANKS to "
        "allow more."
    )
    assert isinstance(info.value, ConfigurationError)


def test_the_bound_is_four_ranks_per_core() -> None:
    with pytest.warns(CPUOversubscriptionWarning):
        assert make_spec(8).resolve(TWO_CORES).world_size == 8
    with pytest.raises(TooManyCPURanksError, match="num_accelerators=9 was asked for"):
        make_spec(9).resolve(TWO_CORES)
    one_core = Hardware(0, None, cpu_count=1)
    with pytest.raises(TooManyCPURanksError, match="has 1 usable CPU core and air_magic starts at most 4"):
        make_spec(5).resolve(one_core)


def test_cpu_ranks_asked_for_on_a_gpu_machine_are_bounded_too() -> None:
    with pytest.raises(TooManyCPURanksError, match="at most 8 CPU ranks"):
        make_spec(64, "CPU").resolve(Hardware(8, "NVIDIA H100 80GB HBM3", cpu_count=2))


def test_gpu_ranks_are_bounded_by_the_gpus_not_the_cores() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placement = make_spec(8).resolve(Hardware(8, "NVIDIA H100 80GB HBM3", cpu_count=1))
    assert (placement.world_size, placement.device) == (8, "cuda")


def test_the_environment_variable_replaces_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIR_MAGIC_MAX_CPU_RANKS", "16")
    with pytest.warns(CPUOversubscriptionWarning):
        assert make_spec(16).resolve(TWO_CORES).world_size == 16
    with pytest.raises(TooManyCPURanksError) as info:
        make_spec(17).resolve(TWO_CORES)
    assert str(info.value) == (
        "num_accelerators=17 was asked for (CPU ranks), but this machine has 2 usable CPU cores and "
        "AIR_MAGIC_MAX_CPU_RANKS=16 allows at most 16. Pass num_accelerators=16 or fewer, or raise "
        "AIR_MAGIC_MAX_CPU_RANKS."
    )


@pytest.mark.parametrize("text", ["lots", "0", "-3", "2.5"])
def test_a_bad_bound_in_the_environment_is_named(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("AIR_MAGIC_MAX_CPU_RANKS", text)
    with pytest.raises(ConfigurationError) as info:
        make_spec(2).resolve(TWO_CORES)
    assert str(info.value) == (
        f"AIR_MAGIC_MAX_CPU_RANKS must be a whole number of CPU ranks above 0, got {text!r}. Set it "
        "to a number such as 16, or unset it for the default (4 per CPU core: 8 here)."
    )


def test_more_cpu_ranks_than_cores_warn_at_the_callers_line() -> None:
    with pytest.warns(CPUOversubscriptionWarning) as record:
        make_spec(3).resolve(TWO_CORES)
    [warning] = record
    assert str(warning.message) == (
        "num_accelerators=3 starts 3 CPU ranks on 2 usable CPU cores: the ranks share the cores and "
        "run slower than 2 ranks would. Fine for trying out distributed code; pass "
        "num_accelerators=2 or fewer for speed."
    )
    assert warning.filename == __file__
    assert not issubclass(CPUOversubscriptionWarning, FutureWarning)


def test_up_to_one_rank_per_core_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert make_spec(2).resolve(TWO_CORES).world_size == 2
        assert make_spec().resolve(TWO_CORES).world_size == 1


def test_detected_hardware_counts_the_usable_cores() -> None:
    assert usable_cpu_count() == len(os.sched_getaffinity(0))
    assert detect_hardware().cpu_count == usable_cpu_count()


# -- timeouts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (30 * 86400, 2_592_000.0),  # thirty days
        (1e12, 1e12),
        (np.float32(2.5), 2.5),
        (np.float64(60), 60.0),
        (np.int64(90), 90.0),
        (Fraction(3, 2), 1.5),
        (float("inf"), None),
    ],
)
def test_every_positive_number_of_seconds_is_a_timeout(value: object, seconds: float | None) -> None:
    timeout = make_spec(timeout=value).timeout
    assert timeout == seconds
    assert timeout is None or type(timeout) is float


def test_a_timeout_beyond_any_float_is_refused() -> None:
    with pytest.raises(ConfigurationError) as info:
        distributed(timeout=10**400)
    assert str(info.value) == (
        "timeout is an integer beyond 1.8e+308: more seconds than any clock holds. Pass timeout=None for no limit."
    )
    with pytest.raises(ConfigurationError) as info:
        distributed(timeout=-(10**400))
    assert str(info.value) == (
        "timeout must be more than 0 seconds, got a negative integer of 1329 bits. Pass timeout=None for no limit."
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.bool_(True), "timeout must be a number of seconds or None (no limit), got bool np.True_."),
        (np.float64("nan"), "timeout must be more than 0 seconds, got nan. Pass timeout=None for no limit."),
        (float("-inf"), "timeout must be more than 0 seconds, got -inf. Pass timeout=None for no limit."),
        (np.int64(0), "timeout must be more than 0 seconds, got 0. Pass timeout=None for no limit."),
    ],
)
def test_numpy_values_that_are_no_timeout_are_refused(value: object, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        distributed(timeout=value)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0", "%%distributed: timeout must be more than 0 seconds, got 0. Pass --timeout none for no limit."),
        ("-5", "%%distributed: timeout must be more than 0 seconds, got -5. Pass --timeout none for no limit."),
        ("0.0", "%%distributed: timeout must be more than 0 seconds, got 0.0. Pass --timeout none for no limit."),
        ("nan", "%%distributed: timeout must be more than 0 seconds, got nan. Pass --timeout none for no limit."),
        ("soon", "%%distributed: --timeout takes a number of seconds or 'none', got 'soon'"),
    ],
)
def test_magic_timeout_zero_is_refused_like_the_decorators(text: str, message: str) -> None:
    with pytest.raises(UsageError) as info:
        _timeout_arg(text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "seconds"), [("none", None), ("None", None), ("off", None), ("2592000", 2592000.0), ("1e12", 1e12)]
)
def test_magic_timeout_values(text: str, seconds: float | None) -> None:
    assert _timeout_arg(text) == seconds


def test_magic_timeout_set_by_config_names_config_for_no_limit() -> None:
    import argparse

    from air_magic.magics import DistributedMagics

    magics = DistributedMagics(shell=None)
    magics.timeout = 0
    args = argparse.Namespace(
        timeout=None,
        num_accelerators=None,
        accelerator_type=None,
        no_tracking=False,
        experiment=None,
        run_name=None,
        backend=None,
    )
    with pytest.raises(UsageError) as info:
        magics._spec(args)
    assert str(info.value) == (
        "%%distributed: timeout must be more than 0 seconds, got 0.0. Pass %config "
        "DistributedMagics.timeout = None for no limit."
    )


def test_a_magic_cell_of_blanks_is_refused() -> None:
    from air_magic.magics import DistributedMagics

    with pytest.raises(UsageError) as info:
        DistributedMagics(shell=None).distributed("-n 2", "  \n\n")
    assert str(info.value) == ("%%distributed: the cell is empty; write the code each rank runs below the magic.")


# -- numeric types of a rank count -------------------------------------------------------------


@pytest.mark.parametrize("value", [np.int64(2), np.int32(2), np.uint8(2)])
def test_numpy_integers_are_rank_counts(value: object) -> None:
    spec = make_spec(value)
    assert spec.num_accelerators == 2 and type(spec.num_accelerators) is int
    assert repr(distributed(value)(lambda: None)).startswith("DistributedFunction(num_accelerators=2,")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (np.bool_(True), "num_accelerators must be a positive integer (the number of ranks), got bool np.True_."),
        (
            np.float64(2.0),
            "num_accelerators must be a positive integer (the number of ranks), got float64 np.float64(2.0).",
        ),
        (
            np.int64(0),
            "num_accelerators must be a positive integer (the number of ranks), got 0. Pass 1 or more, "
            "or omit it to use every GPU of this machine.",
        ),
    ],
)
def test_numpy_values_that_are_no_rank_count_are_refused(value: object, message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        distributed(num_accelerators=value)
    assert str(info.value) == message


def test_numpy_rank_count_with_a_gpu_type() -> None:
    spec = make_spec(np.int64(2), "GPU_2xH200")
    assert spec.accelerator_type == AcceleratorType(2, "H200")
    assert make_spec(np.int64(2)).resolve(Hardware(2, "NVIDIA H200", cpu_count=2)).world_size == 2


def test_a_bad_on_breakpoint_setting_is_named_with_its_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    from air_magic.settings import settings

    monkeypatch.setenv("AIR_MAGIC_ON_BREAKPOINT", "x")
    with pytest.raises(ConfigurationError) as info:
        settings.check()
    assert (
        str(info.value) == "AIR_MAGIC_ON_BREAKPOINT must be one of prompt, skip, error, got 'x'; unset it for prompt."
    )
    monkeypatch.setenv("AIR_MAGIC_ON_BREAKPOINT", " Skip ")
    assert settings.on_breakpoint == "skip"
