"""The model back's area: parts of whole keys, and the order in which each rank writes them."""

from __future__ import annotations

import pytest

from air_magic.kernel.pool import model_back
from air_magic.kernel.pool.model_back import Layout, parts
from air_magic.rank.pool.model_back import _in_turn


def _layout(sizes: dict[str, int], aliases: dict[str, str] | None = None) -> Layout:
    return Layout(
        shapes={key: [n] for key, n in sizes.items()},
        dtypes={key: "uint8" for key in sizes},
        objects={},
        buffers={},
        aliases=aliases or {},
    )


def test_parts_hold_whole_keys_and_start_a_new_part_once_one_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_back, "PART_BYTES", 100)
    sizes, places = parts(_layout({"a": 60, "b": 60, "c": 300, "d": 10, "tied": 60}, {"tied": "a"}))
    # a and b share a part (64-byte aligned); c, larger than a part, is one of its own; d follows.
    assert places == {"a": (0, 0), "b": (0, 64), "c": (1, 0), "d": (2, 0)}
    assert sizes == [124, 300, 10]


def test_one_part_when_the_model_is_small() -> None:
    sizes, places = parts(_layout({"a": 10, "b": 20}))
    assert sizes == [84] and places == {"a": (0, 0), "b": (0, 64)}


def test_each_rank_starts_at_a_part_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = {f"k{i}": i for i in range(8)}
    places = {key: (f"part{i // 2}", 0) for i, key in enumerate(entries)}  # 4 parts of 2 keys
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert [key for key, _ in _in_turn(entries, places, 0)] == [f"k{i}" for i in range(8)]
    assert [key for key, _ in _in_turn(entries, places, 1)] == ["k4", "k5", "k6", "k7", "k0", "k1", "k2", "k3"]
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert [key for key, _ in _in_turn(entries, places, 3)][:2] == ["k6", "k7"]
    # Keys with no place (not this call's) are left out.
    assert [key for key, _ in _in_turn(entries, {"k3": ("p", 0)}, 1)] == ["k3"]
