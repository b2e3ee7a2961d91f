"""Validation of @distributed's arguments: no processes, no hardware needed."""

from __future__ import annotations

import warnings

import pytest

from air_magic import (
    AcceleratorMismatchError,
    AcceleratorType,
    ConfigurationError,
    DirectCallError,
    GPUType,
    distributed,
)
from air_magic.accelerators import Hardware, model_from_device_name
from air_magic.spec import make_spec

# Eight cores each: the CPU-rank bound and warning are tested on their own below.
CPU_ONLY = Hardware(0, None, cpu_count=8)
EIGHT_H100 = Hardware(8, "NVIDIA H100 80GB HBM3", cpu_count=8)
TWO_H200 = Hardware(2, "NVIDIA H200", cpu_count=8)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (0, "num_accelerators must be a positive integer (the number of ranks), got 0"),
        (-2, "got -2"),
        (True, "got bool True"),
        ("2", "got str '2'"),
        (1.5, "got float 1.5"),
    ],
)
def test_bad_num_accelerators(value: object, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=None) as info:
        distributed(num_accelerators=value)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (True, "timeout must be a number of seconds or None (no limit), got bool True"),
        ("60", "got str '60'"),
        (0, "timeout must be more than 0 seconds, got 0. Pass timeout=None for no limit."),
        (-1.0, "got -1.0"),
        (float("nan"), "got nan"),
    ],
)
def test_bad_timeout(value: object, fragment: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        distributed(timeout=value)
    assert fragment in str(info.value)


def test_timeout_defaults_and_none() -> None:
    assert make_spec().timeout == 10800
    assert make_spec(timeout=None).timeout is None
    assert make_spec(timeout=float("inf")).timeout is None
    assert make_spec(timeout=5).timeout == 5.0


def test_accelerator_type_parsing_is_case_insensitive() -> None:
    assert AcceleratorType.parse("gpu_8xh100") == AcceleratorType.GPU_8xH100
    assert AcceleratorType.parse("GPU_4xL40S").count == 4
    assert AcceleratorType.parse("GPU_4xL40S").model == "L40S"
    assert AcceleratorType.parse("cpu").is_cpu
    assert AcceleratorType.GPU_1xA10 == "GPU_1xA10"
    assert repr(AcceleratorType.GPU_8xB300) == "AcceleratorType('GPU_8xB300')"


@pytest.mark.parametrize("value", ["H100x8", "GPU_0xH100", "TPU", "", 8])
def test_bad_accelerator_type(value: object) -> None:
    with pytest.raises(ConfigurationError) as info:
        distributed(accelerator_type=value)  # type: ignore[arg-type]
    message = str(info.value)
    assert "GPU_8xH100" in message or "AcceleratorType" in message


def test_legacy_gpus_warns_at_user_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = make_spec(gpus=8)
    assert spec.num_accelerators == 8
    [warning] = caught
    assert warning.category is FutureWarning
    assert str(warning.message) == "gpus is deprecated; use num_accelerators=8 instead."
    assert warning.filename == __file__


@pytest.mark.parametrize(
    ("kwargs", "expected", "advice"),
    [
        ({"gpus": 8, "gpu_type": "H100"}, AcceleratorType.GPU_8xH100, "accelerator_type='GPU_8xH100'"),
        ({"gpus": 1, "gpu_type": "h100_80gb"}, AcceleratorType.GPU_1xH100, "accelerator_type='GPU_1xH100'"),
        ({"gpu_type": "a10g"}, AcceleratorType.GPU_1xA10, "accelerator_type='GPU_1xA10'"),
        ({"gpu_type": "B300"}, AcceleratorType.GPU_8xB300, "accelerator_type='GPU_8xB300'"),
        ({"num_accelerators": 8, "accelerator_type": "H100"}, AcceleratorType.GPU_8xH100, "GPU_8xH100"),
    ],
)
def test_legacy_gpu_type_values(kwargs: dict, expected: AcceleratorType, advice: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = make_spec(**kwargs)
    assert spec.accelerator_type == expected
    messages = [str(w.message) for w in caught if w.category is FutureWarning]
    assert any(advice in m for m in messages), messages
    assert all(w.filename == __file__ for w in caught)


def test_legacy_h100_without_count_keeps_chip_and_names_both_shapes() -> None:
    with pytest.warns(FutureWarning, match="'GPU_1xH100' \\(one GPU\\) or 'GPU_8xH100' \\(eight\\)"):
        spec = make_spec(gpu_type="H100")
    assert spec.accelerator_type is GPUType.H100


def test_old_and_new_names_together_are_errors() -> None:
    with pytest.raises(ConfigurationError, match="gpus and num_accelerators cannot be combined"):
        distributed(num_accelerators=2, gpus=2)
    with pytest.raises(ConfigurationError, match="gpu_type and accelerator_type cannot be combined"):
        distributed(accelerator_type="GPU_8xH100", gpu_type="H100")


def test_remote_true_is_explained() -> None:
    with pytest.raises(ConfigurationError, match="remote=True has no meaning in air_magic"):
        distributed(remote=True)


def test_backends_are_checked_at_decoration() -> None:
    # Ray is in the test environment: backend="ray" is accepted (without Ray it says how to
    # install it: tests/unit/test_ray_missing.py); launching needs a cluster (tests/ray/).
    assert distributed(backend="ray")(lambda: None).spec.backend == "ray"
    with pytest.raises(ConfigurationError) as info:
        distributed(backend="slurm")
    assert str(info.value) == "backend must be one of 'local', 'ray', got 'slurm'."
    assert distributed(backend="local")(lambda: None).func() is None


def test_decoration_on_cpu_machine_does_not_check_hardware() -> None:
    @distributed(num_accelerators=8, accelerator_type="GPU_8xH100")
    def train() -> None:
        pass

    assert train.num_accelerators == 8
    assert train.accelerator_type == AcceleratorType.GPU_8xH100


def test_hardware_checks_at_launch() -> None:
    spec = make_spec(8, "GPU_8xH100")
    with pytest.raises(AcceleratorMismatchError) as info:
        spec.resolve(CPU_ONLY)
    assert str(info.value) == (
        "accelerator_type='GPU_8xH100' was asked for, but this machine has no NVIDIA GPU (CPU only). "
        "Omit accelerator_type (or pass 'CPU') to run CPU ranks here."
    )
    placement = spec.resolve(EIGHT_H100)
    assert (placement.world_size, placement.device) == (8, "cuda")
    with pytest.raises(AcceleratorMismatchError) as info:
        spec.resolve(TWO_H200)
    assert "this machine has 2 x NVIDIA H200 (GPU_2xH200). Use accelerator_type='GPU_2xH200' or omit it." in str(
        info.value
    )


def test_defaults_on_each_kind_of_machine() -> None:
    assert make_spec().resolve(CPU_ONLY).world_size == 1
    assert make_spec(4).resolve(CPU_ONLY).world_size == 4  # N CPU ranks with gloo
    assert make_spec().resolve(EIGHT_H100).world_size == 8
    assert make_spec(2).resolve(EIGHT_H100).world_size == 2  # a subset of the node
    assert make_spec(None, "GPU_1xH100").resolve(EIGHT_H100).world_size == 1
    assert make_spec(3, "CPU").resolve(EIGHT_H100).device == "cpu"


def test_too_many_gpus_names_both_numbers() -> None:
    with pytest.raises(AcceleratorMismatchError) as info:
        make_spec(4).resolve(TWO_H200)
    assert "num_accelerators=4 was asked for, but only 2 GPUs are visible" in str(info.value)


def test_legacy_chip_mismatch() -> None:
    with pytest.warns(FutureWarning):
        spec = make_spec(gpu_type="A10", num_accelerators=None)
    with pytest.raises(AcceleratorMismatchError, match="GPU_1xA10"):
        spec.resolve(EIGHT_H100)


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A10G", "A10"),
        ("NVIDIA A10-24Q", "A10"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("NVIDIA B300", "B300"),
        ("Tesla V100-SXM2-16GB", "V100"),
    ],
)
def test_any_nvidia_model_is_detected(name: str, model: str) -> None:
    assert model_from_device_name(name) == model
    assert Hardware(2, name).accelerator_type == AcceleratorType(2, model)


def test_cuda_visible_devices_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    from air_magic import accelerators

    monkeypatch.setattr(accelerators, "_physical_gpus", lambda: ("NVIDIA H100 80GB HBM3",) * 8)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert accelerators.detect_hardware().accelerator_type == AcceleratorType(2, "H100")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert accelerators.detect_hardware().gpu_count == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert AcceleratorType.detect() == AcceleratorType.GPU_8xH100


def test_direct_call_names_both_alternatives() -> None:
    @distributed
    def train(lr: float) -> float:
        return lr

    with pytest.raises(DirectCallError) as info:
        train(0.1)
    assert str(info.value) == (
        "train is decorated with @distributed and cannot be called directly. Use "
        "train.distributed(...) to run it on every rank, or train.func(...) to call the original "
        "function in this process."
    )
    assert train.func(0.1) == 0.1
    assert isinstance(info.value, TypeError)


def test_wrong_call_is_type_error_before_launch() -> None:
    @distributed(num_accelerators=2)
    def train(lr: float) -> float:
        return lr

    with pytest.raises(TypeError, match="missing a required argument: 'lr'"):
        train.distributed()


def test_with_overrides_revalidates_and_keeps_the_rest() -> None:
    @distributed(num_accelerators=2, timeout=60, experiment="exp")
    def train() -> None:
        pass

    other = train.with_overrides(timeout=None)
    assert other.timeout is None and other.num_accelerators == 2 and other.spec.experiment == "exp"
    assert train.timeout == 60  # the original is unchanged
    assert train.with_overrides(num_accelerators=4).num_accelerators == 4
    with pytest.raises(ConfigurationError, match="got 0"):
        train.with_overrides(num_accelerators=0)
    with pytest.raises(ConfigurationError, match="got bool True"):
        train.with_overrides(timeout=True)


def test_repr_is_readable() -> None:
    @distributed(num_accelerators=2, accelerator_type="gpu_8xh100", timeout=30)
    def train() -> None:
        pass

    assert repr(train) == (
        "DistributedFunction(num_accelerators=2, accelerator_type='GPU_8xH100', timeout=30.0, func="
        "test_repr_is_readable.<locals>.train)"
    )
