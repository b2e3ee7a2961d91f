"""Safetensors files written in place (``air_magic.data.weights``): read back by the
safetensors package bit for bit, sharded with an index as Hugging Face writes them, and the
errors of what the format cannot hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from air_magic.data.weights import parse_size, plan_files, save_safetensors


def _mixed() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(3, 5),
        "half": torch.randn(4, dtype=torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int8),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(6, 4).t(),  # not contiguous
    }


def test_one_file_reads_back_bit_for_bit_with_its_dtypes(tmp_path: Path) -> None:
    state = _mixed()
    paths = save_safetensors(state, tmp_path)
    assert [Path(p).name for p in paths] == ["model.safetensors"]
    back = load_file(paths[0])
    assert sorted(back) == sorted(state)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key


def test_shards_and_their_index_as_hugging_face_writes_them(tmp_path: Path) -> None:
    state = _mixed()
    paths = save_safetensors(state, tmp_path, max_shard_size=40)
    names = [Path(p).name for p in paths]
    assert len(names) >= 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(state)
    assert set(index["weight_map"].values()) == set(names)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in state.values())
    merged: dict[str, torch.Tensor] = {}
    for name in names:
        merged.update(load_file(tmp_path / name))
    assert all(torch.equal(merged[k], v) for k, v in state.items())


def test_every_tensor_starts_at_a_multiple_of_its_element_size() -> None:
    entries = {"a": ([3], "int8"), "b": ([5], "float64"), "c": ([1], "float16"), "d": ([2], "float32")}
    (plan,) = plan_files(entries)
    assert len(plan.header) % 8 == 0
    sizes = {"int8": 1, "float64": 8, "float16": 2, "float32": 4}
    for key, offset in plan.offsets.items():
        assert (plan.data_start + offset) % sizes[entries[key][1]] == 0, key


def test_sizes_read_as_transformers_reads_them() -> None:
    assert parse_size("5GB") == 5_000_000_000
    assert parse_size("500MiB") == 500 << 20
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match="max_shard_size is bytes or a size such as '5GB'"):
        parse_size("lots")
    with pytest.raises(ValueError, match="max_shard_size must be positive"):
        parse_size(0)


def test_what_the_format_cannot_hold_is_named(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="'step' is a int, not a tensor: safetensors holds tensors only"):
        save_safetensors({"w": torch.ones(2), "step": 3}, tmp_path)
    with pytest.raises(ValueError, match="'z' is a complex64 tensor, which safetensors cannot store"):
        save_safetensors({"z": torch.ones(2, dtype=torch.complex64)}, tmp_path)
