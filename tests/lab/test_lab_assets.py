"""The lab extension as installed: prebuilt assets that match their sources, the hooks Jupyter
reads, and the migration the command applies (the same as ``air-magic lint --fix``)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import nbformat
import pytest

import air_magic
from air_magic.lint.migrate import migrate_cells
from air_magic.lint.notebook import fix_notebook_file

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "labextension"
BUILT = ROOT / "air_magic" / "labextension"
SEEDS = ROOT / "tests" / "lint" / "fixtures" / "seeds" / "seeds.ipynb"


def _sources_hash() -> tuple[str, list[str]]:
    """As ``labextension/stamp.mjs`` computes it at each build."""
    files = ["package.json", "tsconfig.json"]
    for folder in ("src", "style"):
        files += [p.relative_to(SOURCES).as_posix() for p in (SOURCES / folder).rglob("*") if p.is_file()]
    files.sort()
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0")
        digest.update((SOURCES / name).read_bytes())
        digest.update(b"\0")
    return digest.hexdigest(), files


def test_the_committed_assets_are_built_from_the_current_sources() -> None:
    recorded = json.loads((BUILT / "build-sources.json").read_text())
    digest, files = _sources_hash()
    assert recorded["files"] == files, "labextension/ has other files than at the last build: run `npm run build` there"
    assert recorded["sha256"] == digest, "labextension/ changed since its assets were built: run `npm run build` there"


def test_the_built_extension_is_complete_and_found_by_jupyter() -> None:
    built = json.loads((BUILT / "package.json").read_text())
    source = json.loads((SOURCES / "package.json").read_text())
    assert built["name"] == source["name"] == "air-magic-labextension"
    load = built["jupyterlab"]["_build"]["load"]
    assert (BUILT / load).is_file(), load
    assert built["jupyterlab"]["_build"]["mimeExtension"] and built["jupyterlab"]["_build"]["extension"]
    assert air_magic._jupyter_labextension_paths() == [{"src": "labextension", "dest": "air-magic-labextension"}]
    assert air_magic._jupyter_server_extension_points() == [
        {"module": "air_magic.lint.server"},  # Migrate
        {"module": "air_magic.kernel.machine.server"},  # the sidebar's list of the machine's launches
    ]
    pyproject = (ROOT / "pyproject.toml").read_text()
    for path in ("share/jupyter/labextensions/air-magic-labextension", "etc/jupyter/jupyter_server_config.d"):
        assert f'"{path}' in pyproject, path


def test_the_built_extension_asks_the_oldest_supported_jupyterlab_for_its_shared_packages() -> None:
    # The builder would require the versions of the JupyterLab it builds with (4.6 here);
    # package.json's sharedPackages keep each to the range its dependencies declare, so a
    # JupyterLab 4.4 page loads it without an "Unsatisfied version" warning.
    source = json.loads((SOURCES / "package.json").read_text())
    shared = source["jupyterlab"]["sharedPackages"]
    assert {name: entry["requiredVersion"] for name, entry in shared.items()} == source["dependencies"]
    assert all(entry["singleton"] and entry["bundled"] is False for entry in shared.values())
    assert source["dependencies"]["@jupyterlab/application"] == "^4.4.0"
    assert source["dependencies"]["@jupyterlab/services"] == "^7.4.0"  # JupyterLab 4.4's
    remote = (BUILT / json.loads((BUILT / "package.json").read_text())["jupyterlab"]["_build"]["load"]).read_text()
    assert '"@jupyterlab/services",!1,[1,7,4,0]' in remote and '"@jupyterlab/application",!1,[1,4,4,0]' in remote


def test_the_migration_gives_what_lint_fix_writes(tmp_path: Path) -> None:
    notebook = nbformat.read(SEEDS, as_version=4)
    sources = [c.source if c.cell_type == "code" else None for c in notebook.cells]
    migrated = migrate_cells(sources, path="seeds.ipynb")
    copy = tmp_path / "seeds.ipynb"
    shutil.copy(SEEDS, copy)
    fix_notebook_file(copy)
    fixed = nbformat.read(copy, as_version=4)
    assert migrated["sources"] == [c.source if c.cell_type == "code" else None for c in fixed.cells]
    assert migrated["fixed"] == 17 and [c["cell"] for c in migrated["changes"]]
    assert all(c["diff"].startswith("--- seeds.ipynb:cell ") for c in migrated["changes"])
    assert [(f["code"], bool(f["hint"])) for f in migrated["remaining"]] == [("AM001", True)]
    assert migrated["summary"] == "1 finding left to fix by hand."


@pytest.mark.parametrize(
    ("gpus", "said"),
    [
        (
            (),
            "and this machine has no NVIDIA GPU (CPU only): such a launch stops with AcceleratorMismatchError here. "
            'To run it on this machine, pass num_accelerators=2 and accelerator_type="CPU" (CPU ranks), in the '
            "decorator or with .with_overrides(...); %%distributed: -n 2 --accelerator-type CPU.",
        ),
        (
            ("NVIDIA A10",) * 2,
            "and this machine has 2 x NVIDIA A10 (GPU_2xA10): such a launch stops with "
            "AcceleratorMismatchError here. To run it on this machine, omit accelerator_type to use what it has (GPU_2xA10).",
        ),
        (("NVIDIA H100 80GB HBM3",) * 8, None),
    ],
    ids=["no GPU", "other GPUs", "the GPUs asked for"],
)
def test_the_migration_says_when_the_code_asks_for_gpus_this_machine_lacks(
    monkeypatch: pytest.MonkeyPatch, gpus: tuple[str, ...], said: str | None
) -> None:
    from air_magic import accelerators

    monkeypatch.setattr(accelerators, "_physical_gpus", lambda: gpus)  # NVML's answer
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cells = [
        "from serverless_gpu import distributed\n\n\n@distributed(gpus=8, gpu_type='H100')\ndef train():\n    return 1",
        None,
        "%%distributed -n 8 --accelerator-type GPU_8xH100\nx = 1",
    ]
    migrated = migrate_cells(cells)
    if said is None:
        assert migrated["hardware"] == []
        return
    assert migrated["hardware"] == [f"The migrated code asks for GPU_8xH100 (8 H100 GPUs), {said}"]  # once for both
