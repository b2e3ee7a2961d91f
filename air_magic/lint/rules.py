"""The migration rules, as data.

Each :class:`Rule` is one row: its code, what it finds (a message template filled by
the engine), what to do (``fix_title``), how safe its fix is, an example, and the
name of its fixture under ``tests/lint/fixtures/``.  Codes are grouped by kind:
``AM0xx`` the linter itself, ``AM1xx`` imports and names, ``AM2xx`` arguments,
``AM3xx`` patterns, ``AM4xx`` portability (GPU-only code made to run on CPU ranks too).
The tables after the rules say which legacy names move where.

Nothing here imports libcst: the table is read by the CLI's help, the docs (their lint rules page and its test) and
the notebook panel without parsing any code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Applicability",
    "Rule",
    "RULES",
    "RULES_BY_CODE",
    "Move",
    "MOVES",
    "NO_EQUIVALENT",
    "LEGACY_PACKAGES",
    "LEGACY_ENV_VARS",
    "DISTRIBUTED_NAMES",
    "TORCH_DISTRIBUTOR_NAMES",
    "rule",
]


class Applicability(str, enum.Enum):
    """How far a fix can be trusted (ruff's three levels).

    ``SAFE`` keeps the meaning and the comments and is applied by ``--fix``;
    ``UNSAFE`` is valid code whose behaviour may differ and needs ``--unsafe-fixes``;
    ``DISPLAY_ONLY`` is advice: the finding says what to do, nothing is rewritten.
    """

    SAFE = "safe"
    UNSAFE = "unsafe"
    DISPLAY_ONLY = "display-only"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Rule:
    """One migration rule.

    ``message`` and ``fix_title`` are ``str.format`` templates; the engine fills them
    with the names it found (``{old}``, ``{new}``, ``{name}``, ...).
    """

    code: str
    name: str
    kind: str  # "linter", "imports", "arguments", "patterns" or "portability"
    message: str
    fix_title: str
    fix: Applicability
    before: str  # an example the rule finds
    after: str  # the same after --fix --unsafe-fixes, or after doing by hand what it says
    fixture: str

    def format_message(self, **fields: Any) -> str:
        return self.message.format(**fields)

    def format_fix_title(self, **fields: Any) -> str:
        return self.fix_title.format(**fields)


SAFE, UNSAFE, DISPLAY_ONLY = Applicability.SAFE, Applicability.UNSAFE, Applicability.DISPLAY_ONLY

RULES: tuple[Rule, ...] = (
    # -- AM0xx: the linter itself ------------------------------------------------------------
    Rule(
        code="AM001",
        name="unparsable",
        kind="linter",
        message="cannot lint {what}: {error}",
        fix_title="Fix the syntax error (the rest is linted without it)",
        fix=DISPLAY_ONLY,
        before="def train(:\n    pass\n",
        after="def train():\n    pass\n",
        fixture="AM001",
    ),
    # -- AM1xx: imports and names --------------------------------------------------------------
    Rule(
        code="AM101",
        name="legacy-import",
        kind="imports",
        message="`{old}` comes from {package}, which is not installed outside Databricks",
        fix_title="Use `{new}` (the same API)",
        fix=SAFE,
        before="from serverless_gpu import distributed\n\n@distributed()\ndef train():\n    return 0\n",
        after="from air_magic import distributed\n\n@distributed()\ndef train():\n    return 0\n",
        fixture="AM101",
    ),
    Rule(
        code="AM102",
        name="legacy-checkpoint-io",
        kind="imports",
        message="`{old}` wrote and read checkpoints on Unity Catalog volumes; `{new}` takes the same "
        "arguments and any local path or fsspec URL",
        fix_title="Use `{new}`",
        fix=SAFE,
        before='from serverless_gpu.data import UCVolumeWriter\n\nwriter = UCVolumeWriter("/Volumes/main/ckpt")\n',
        after='from air_magic.data import checkpoint_writer\n\nwriter = checkpoint_writer("/Volumes/main/ckpt")\n',
        fixture="AM102",
    ),
    Rule(
        code="AM103",
        name="legacy-data-helper",
        kind="imports",
        message="`{old}` is a Databricks helper; its open equivalent `{new}` {difference}",
        fix_title="Use `{new}` (review the difference)",
        fix=UNSAFE,
        before='from databricks.air.data import UCVolumeDataset\n\nds = UCVolumeDataset("/Volumes/main/raw")\n',
        after="from air_magic.data import StreamingDataset\n\n"
        'ds = StreamingDataset("/Volumes/main/raw", shuffle=False)\n',
        fixture="AM103",
    ),
    Rule(
        code="AM104",
        name="legacy-no-equivalent",
        kind="imports",
        message="`{old}` has no equivalent in air_magic: {hint}",
        fix_title="Replace it by hand as described",
        fix=DISPLAY_ONLY,
        before="from serverless_gpu import ray_launch\n\nray_launch()\n",
        after="from air_magic import ray_init\n\nray_init()\n",
        fixture="AM104",
    ),
    Rule(
        code="AM105",
        name="legacy-env-var",
        kind="imports",
        message="`{name}` configures the Databricks serverless GPU service; it means nothing to air_magic",
        fix_title="Remove it{instead}",
        fix=DISPLAY_ONLY,
        before='import os\n\nos.environ["SGC_JOB_TIMEOUT_SECONDS"] = "3600"\n',
        after="from air_magic import distributed\n\n@distributed(timeout=3600)\ndef train():\n    return 0\n",
        fixture="AM105",
    ),
    Rule(
        code="AM106",
        name="unused-legacy-import",
        kind="imports",
        message="`{old}` is imported but not used{why}",
        fix_title="Remove the import",
        fix=SAFE,
        before="import serverless_gpu\nimport os\n",
        after="import os\n",
        fixture="AM106",
    ),
    # -- AM2xx: arguments ------------------------------------------------------------------------
    Rule(
        code="AM201",
        name="gpus-argument",
        kind="arguments",
        message="`gpus` is the old name of `num_accelerators`",
        fix_title="Rename to `num_accelerators`",
        fix=SAFE,
        before="from air_magic import distributed\n\n@distributed(gpus=8)\ndef train():\n    return 0\n",
        after="from air_magic import distributed\n\n@distributed(num_accelerators=8)\ndef train():\n    return 0\n",
        fixture="AM201",
    ),
    Rule(
        code="AM202",
        name="gpu-type-argument",
        kind="arguments",
        message="`gpu_type` is the old name of `accelerator_type`",
        fix_title="Use `accelerator_type={new}`",
        fix=SAFE,
        before="from air_magic import AcceleratorType, distributed\n\n"
        "@distributed(num_accelerators=8, gpu_type=AcceleratorType.GPU_8xH100)\ndef train():\n    return 0\n",
        after="from air_magic import AcceleratorType, distributed\n\n"
        "@distributed(num_accelerators=8, accelerator_type=AcceleratorType.GPU_8xH100)\ndef train():\n    return 0\n",
        fixture="AM202",
    ),
    Rule(
        code="AM203",
        name="legacy-accelerator-value",
        kind="arguments",
        message="`{old}` is a legacy GPU type name; {reason} the node shape is `{new}`",
        fix_title="Use `{new}`",
        fix=SAFE,
        before="from air_magic import distributed\n\n@distributed(num_accelerators=8, accelerator_type='H100')\n"
        "def train():\n    return 0\n",
        after="from air_magic import distributed\n\n@distributed(num_accelerators=8, accelerator_type='GPU_8xH100')\n"
        "def train():\n    return 0\n",
        fixture="AM203",
    ),
    Rule(
        code="AM204",
        name="ambiguous-accelerator-value",
        kind="arguments",
        message="`{old}` names the chip but not how many: the replacement depends on the number of GPUs",
        fix_title="Use 'GPU_1xH100' (one GPU) or 'GPU_8xH100' (eight), or omit it: the type is detected",
        fix=DISPLAY_ONLY,
        before="from air_magic import distributed\n\n"
        "@distributed(accelerator_type='H100')\ndef train():\n    return 0\n",
        after="from air_magic import distributed\n\n@distributed()\ndef train():\n    return 0\n",
        fixture="AM204",
    ),
    Rule(
        code="AM205",
        name="conflicting-arguments",
        kind="arguments",
        message="`{old}` and `{new}` are both given; `{old}` is the old name of `{new}` and air_magic rejects the pair",
        fix_title="Keep only `{new}`",
        fix=DISPLAY_ONLY,
        before="from air_magic import distributed\n\n"
        "@distributed(gpus=8, num_accelerators=8)\ndef train():\n    return 0\n",
        after="from air_magic import distributed\n\n@distributed(num_accelerators=8)\ndef train():\n    return 0\n",
        fixture="AM205",
    ),
    Rule(
        code="AM206",
        name="remote-argument",
        kind="arguments",
        message="`remote` chose between this node and Databricks serverless GPUs; air_magic always runs the "
        "ranks on this machine and {consequence}",
        fix_title="Remove `{arg}` (run on a machine with the GPUs you need)",
        fix=DISPLAY_ONLY,
        before="from air_magic import distributed\n\n"
        "@distributed(num_accelerators=16, remote=True)\ndef train():\n    return 0\n",
        after="from air_magic import distributed\n\n@distributed(num_accelerators=8)\ndef train():\n    return 0\n",
        fixture="AM206",
    ),
    Rule(
        code="AM207",
        name="magic-legacy-accelerator-value",
        kind="arguments",
        message="`--accelerator-type {old}` is a legacy GPU type name; {reason} the node shape is `{new}`",
        fix_title="Use `--accelerator-type {new}`",
        fix=SAFE,
        before="%%distributed -n 8 --accelerator-type H100\nprint(1)",
        after="%%distributed -n 8 --accelerator-type GPU_8xH100\nprint(1)",
        fixture="AM207",
    ),
    # -- AM3xx: patterns -------------------------------------------------------------------------
    Rule(
        code="AM301",
        name="torch-distributor",
        kind="patterns",
        message="`TorchDistributor(...).run({func}, ...)` launches through Spark; on this machine "
        "`@distributed` runs the same function on {count} rank(s)",
        fix_title="Launch with `{launch}`",
        fix=SAFE,
        before="from pyspark.ml.torch.distributor import TorchDistributor\n\n\ndef train(lr):\n    return lr\n\n\n"
        "TorchDistributor(num_processes=2, local_mode=True, use_gpu=True).run(train, 1e-3)\n",
        after="from air_magic import distributed\n\n\ndef train(lr):\n    return lr\n\n\n"
        "distributed(num_accelerators=2)(train).distributed(1e-3)\n",
        fixture="AM301",
    ),
    Rule(
        code="AM302",
        name="torch-distributor-manual",
        kind="patterns",
        message="`{what}` cannot be converted automatically: {why}",
        fix_title="Decorate the training function with `@distributed(num_accelerators=N)` and call `.distributed(...)`",
        fix=DISPLAY_ONLY,
        before="from pyspark.ml.torch.distributor import TorchDistributor\n\n\ndef train():\n    return 0\n\n\n"
        "TorchDistributor(num_processes=16, local_mode=False).run(train)\n",
        after="from air_magic import distributed\n\n\ndef train():\n    return 0\n\n\n"
        "distributed(num_accelerators=8)(train).distributed()\n",
        fixture="AM302",
    ),
    Rule(
        code="AM303",
        name="captured-data",
        kind="patterns",
        message="`{name}` is built outside `{func}` ({where}) and read inside it: it is pickled and sent "
        "to every rank, and large data can exceed what pickle can send",
        fix_title="Build `{name}` inside `{func}`",
        fix=DISPLAY_ONLY,
        before="from air_magic import distributed\n\ndataset = get_dataset(path)\n\n\n"
        "@distributed()\ndef train():\n    return len(dataset)\n",
        after="from air_magic import distributed\n\n\n@distributed()\ndef train():\n"
        "    dataset = get_dataset(path)\n    return len(dataset)\n",
        fixture="AM303",
    ),
    Rule(
        code="AM304",
        name="set-experiment-inside",
        kind="patterns",
        message="`mlflow.set_experiment` inside `{func}` runs on every rank, after the launch's run was "
        "opened in the notebook's experiment",
        fix_title="Call `mlflow.set_experiment(...)` in the notebook before the launch, or pass "
        "`experiment=...` to `@distributed`",
        fix=DISPLAY_ONLY,
        before="import mlflow\nfrom air_magic import distributed\n\n\n@distributed()\ndef train():\n"
        '    mlflow.set_experiment("/exp")\n',
        after='import mlflow\nfrom air_magic import distributed\n\n\n@distributed(experiment="/exp")\ndef train():\n'
        '    mlflow.log_metric("loss", 0.1)\n',
        fixture="AM304",
    ),
    Rule(
        code="AM305",
        name="hard-coded-rendezvous",
        kind="patterns",
        message="`{what}` replaces the address air_magic gives the ranks (127.0.0.1 and a fresh port per "
        "launch), so launches can collide or wait for a peer that never comes",
        fix_title="Remove it: `init_process_group()` reads the MASTER_ADDR and MASTER_PORT air_magic sets",
        fix=UNSAFE,
        before='import os\n\nos.environ["MASTER_PORT"] = "29500"\n',
        after="import os\n\n",
        fixture="AM305",
    ),
    Rule(
        code="AM306",
        name="direct-call",
        kind="patterns",
        message="`{func}` is decorated with `@distributed`; calling it directly raises DirectCallError",
        fix_title="Launch with `{func}.distributed(...)` (or run it here with `{func}.func(...)`)",
        fix=UNSAFE,
        before="from air_magic import distributed\n\n\n@distributed(num_accelerators=2)\ndef train(epochs):\n"
        "    return epochs\n\n\ntrain(3)\n",
        after="from air_magic import distributed\n\n\n@distributed(num_accelerators=2)\ndef train(epochs):\n"
        "    return epochs\n\n\ntrain.distributed(3)\n",
        fixture="AM306",
    ),
    # -- AM4xx: portability ----------------------------------------------------------------------
    # Each fix puts the GPU choice behind `torch.cuda.is_available()`. They are safe: where
    # CUDA is available every rewritten expression has the value it had, so a GPU run is
    # unchanged; where it is not, the original cannot train (NCCL and set_device raise, DDP
    # refuses device ids for a CPU model, the first tensor moved to a CUDA device fails) and
    # the fixed code runs on CPU ranks with gloo instead.
    Rule(
        code="AM401",
        name="nccl-backend",
        kind="portability",
        message="`{what}` asks for NCCL, which needs a GPU: on CPU ranks the process group cannot start",
        fix_title="Use `{new}`",
        fix=SAFE,
        before='import torch\nimport torch.distributed as dist\n\ndist.init_process_group("nccl")\n',
        after="import torch\nimport torch.distributed as dist\n\n"
        'dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")\n',
        fixture="AM401",
    ),
    Rule(
        code="AM402",
        name="unguarded-set-device",
        kind="portability",
        message="`{call}` raises where there is no GPU, so CPU ranks stop before training",
        fix_title="Call it only where CUDA is available: `if {check}:`",
        fix=SAFE,
        before='import os\nimport torch\n\ntorch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n',
        after="import os\nimport torch\n\nif torch.cuda.is_available():\n"
        '    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))\n',
        fixture="AM402",
    ),
    Rule(
        code="AM403",
        name="cuda-device",
        kind="portability",
        message="`{call}` is a GPU: where there is none, the first model or tensor moved to it fails",
        fix_title="Fall back to the CPU: `{new}`",
        fix=SAFE,
        before='import torch\n\ndevice = torch.device(f"cuda:{rank}")\n',
        after='import torch\n\ndevice = torch.device(f"cuda:{rank}" if torch.cuda.is_available() else "cpu")\n',
        fixture="AM403",
    ),
    Rule(
        code="AM404",
        name="ddp-device-ids",
        kind="portability",
        message="`{arg}` names GPU devices; DistributedDataParallel refuses it for a model on the CPU",
        fix_title="Pass `None` where there is no GPU: `{new}`",
        fix=SAFE,
        before="from torch.nn.parallel import DistributedDataParallel as DDP\nimport torch\n\n"
        "model = DDP(model, device_ids=[rank])\n",
        after="from torch.nn.parallel import DistributedDataParallel as DDP\nimport torch\n\n"
        "model = DDP(model, device_ids=[rank] if torch.cuda.is_available() else None)\n",
        fixture="AM404",
    ),
    # Today's idioms: a rank's number as the device, torch.accelerator, device_id=, and guards
    # that end the program without GPUs. The fixes are safe for the same reason as above.
    Rule(
        code="AM405",
        name="rank-as-device",
        kind="portability",
        message="`{call}` takes a rank's number for an accelerator's index: where there is none it raises",
        fix_title="Fall back to the CPU: `{new}`",
        fix=SAFE,
        before="import torch\n\nmodel = model.to(local_rank)\n",
        after='import torch\n\nmodel = model.to(local_rank if torch.cuda.is_available() else "cpu")\n',
        fixture="AM405",
    ),
    Rule(
        code="AM406",
        name="cuda-map-location",
        kind="portability",
        message="`{what}` loads onto a GPU: where there is none, loading the checkpoint fails",
        fix_title="Load onto the CPU where there is no GPU: `{new}`",
        fix=SAFE,
        before='import torch\n\nstate = torch.load(path, map_location=f"cuda:{rank}")\n',
        after='import torch\n\nstate = torch.load(path, map_location=f"cuda:{rank}" if torch.cuda.is_available() else "cpu")\n',
        fixture="AM406",
    ),
    Rule(
        code="AM407",
        name="no-current-accelerator",
        kind="portability",
        message="`{call}` is None where there is no accelerator: its `.type`, or a device made from it, fails",
        fix_title="Fall back to the CPU: `{new}`",
        fix=SAFE,
        before="import torch\n\ndevice = torch.accelerator.current_accelerator()\n",
        after='import torch\n\ndevice = torch.accelerator.current_accelerator() or torch.device("cpu")\n',
        fixture="AM407",
    ),
    Rule(
        code="AM408",
        name="unguarded-set-device-index",
        kind="portability",
        message="`{call}` raises where there is no accelerator, so CPU ranks stop before training",
        fix_title="Call it only where there is one: `if {check}:`",
        fix=SAFE,
        before="import torch\n\ntorch.accelerator.set_device_index(local_rank)\n",
        after="import torch\n\nif torch.accelerator.is_available():\n    torch.accelerator.set_device_index(local_rank)\n",
        fixture="AM408",
    ),
    Rule(
        code="AM409",
        name="process-group-device-id",
        kind="portability",
        message="`{what}` binds the process group to an accelerator; on CPU ranks (gloo) it cannot start",
        fix_title="Pass `None` where there is no GPU: `{new}`",
        fix=SAFE,
        before="import torch\nimport torch.distributed as dist\n\ndist.init_process_group(device_id=device)\n",
        after="import torch\nimport torch.distributed as dist\n\n"
        "dist.init_process_group(device_id=device if torch.cuda.is_available() else None)\n",
        fixture="AM409",
    ),
    Rule(
        code="AM410",
        name="gpu-count-guard",
        kind="portability",
        message="`if {test}:` stops here (`{leaves}`) where there are no GPUs: CPU ranks end without training",
        fix_title="Let it run on CPU ranks: keep the guard for what needs the GPUs (or count CPU ranks too)",
        fix=DISPLAY_ONLY,
        before="import sys\nimport torch\n\nif torch.cuda.device_count() < 2:\n    sys.exit(0)\n",
        after="import sys\nimport torch\n\nif torch.cuda.is_available() and torch.cuda.device_count() < 2:\n    sys.exit(0)\n",
        fixture="AM410",
    ),
)

RULES_BY_CODE: dict[str, Rule] = {r.code: r for r in RULES}


def rule(code: str) -> Rule:
    return RULES_BY_CODE[code]


# -- where legacy names go ----------------------------------------------------------------------

#: Packages whose code this linter migrates; ``databricks.air`` is the package that
#: replaced ``serverless_gpu`` on Databricks.
LEGACY_PACKAGES: tuple[str, ...] = ("serverless_gpu", "databricks.air")
#: How AM101 names each: ``databricks.air`` is Databricks' current SDK, ``serverless_gpu`` the legacy one.
PACKAGE_NAMES: dict[str, str] = {
    "serverless_gpu": "the legacy `serverless_gpu` package",
    "databricks.air": "Databricks' `databricks.air` SDK (`databricks-sdk-air`)",
}


@dataclass(frozen=True)
class Move:
    """A legacy name with an open equivalent: ``from <module> import <name>``.

    ``call_args`` is added to every call of it (keeping the old default);
    ``difference`` (for ``AM103``) says what behaves differently.
    """

    code: str
    module: str
    name: str
    difference: str = ""
    call_args: str = ""


def _air(name: str) -> Move:
    return Move("AM101", "air_magic", name)


_LOADER_DIFFERENCE = (
    "starts no worker processes unless num_workers is given (the Databricks loader picked 6 or 48, "
    "prefetched 4 batches, kept its workers alive and logged timing metrics to MLflow)"
)
_DATASET_DIFFERENCE = (
    "lists the folder recursively and gives every rank the same number of files (wrapping around), "
    "from a local path or any fsspec URL; shuffle=False keeps the old file order"
)
_STATEFUL_DIFFERENCE = "is torch's protocol for objects with state_dict() and load_state_dict()"

MOVES: dict[str, Move] = {}
for _pkg in LEGACY_PACKAGES:
    MOVES.update(
        {
            f"{_pkg}.distributed": _air("distributed"),
            f"{_pkg}.ray_init": _air("ray_init"),
            f"{_pkg}.GPUType": _air("GPUType"),
            f"{_pkg}.AcceleratorType": _air("AcceleratorType"),
            f"{_pkg}.compute.GPUType": _air("GPUType"),
            f"{_pkg}.compute.AcceleratorType": _air("AcceleratorType"),
            f"{_pkg}.data.UCVolumeWriter": Move("AM102", "air_magic.data", "checkpoint_writer"),
            f"{_pkg}.data.UCVolumeReader": Move("AM102", "air_magic.data", "checkpoint_reader"),
            f"{_pkg}.data.UCVolumeDataset": Move(
                "AM103", "air_magic.data", "StreamingDataset", _DATASET_DIFFERENCE, "shuffle=False"
            ),
            f"{_pkg}.data.DataLoader": Move("AM103", "air_magic.data", "DataLoader", _LOADER_DIFFERENCE),
            f"{_pkg}.data.Checkpointable": Move(
                "AM103", "torch.distributed.checkpoint.stateful", "Stateful", _STATEFUL_DIFFERENCE
            ),
        }
    )

_RANK_HINT = (
    "read RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE from os.environ (air_magic sets them "
    "on every rank) or ask torch.distributed"
)

#: Legacy names (or name prefixes) without an open equivalent, and what to do instead.
#: The longest matching prefix wins.
NO_EQUIVALENT: dict[str, str] = {}
for _pkg in LEGACY_PACKAGES:
    NO_EQUIVALENT.update(
        {
            _pkg: "this name is Databricks-only",
            f"{_pkg}.data": (
                "air_magic.data has the open equivalents of UCVolumeDataset, UCVolumeWriter, UCVolumeReader "
                "and DataLoader; import the ones you use by name"
            ),
            f"{_pkg}.ray_launch": (
                "it starts Ray on Databricks workers; start Ray with air_magic.ray_init() and use Ray's own API"
            ),
            f"{_pkg}.runtime": _RANK_HINT,
            f"{_pkg}.utils": "use torch.distributed directly (init_process_group, barrier, all_gather_object)",
        }
    )

#: Settings of the Databricks service, read from the environment by the legacy packages.
LEGACY_ENV_VARS: dict[str, str] = {
    "SGC_JOB_TIMEOUT_SECONDS": "; pass timeout=SECONDS to @distributed instead",
    "DATABRICKS_INTERNAL_JOB_TIMEOUT_SECONDS": "; pass timeout=SECONDS to @distributed instead",
    "ENV_SYNC_TIMEOUT_SECONDS": "",
    "ENV_SYNC_SIZE_BYTES": "",
    "REMOTE_CALL_LIMIT": "",
    "MAX_A10_ALLOWED_PER_NOTEBOOK": "",
    "MAX_H100_ALLOWED_PER_NOTEBOOK": "",
    "MAX_B300_ALLOWED_PER_NOTEBOOK": "",
    "SGC_USE_POOL": "",
    "DATABRICKS_USE_POOL": "",
    "REMOTE_GPU_POOL_ID": "",
    "SGC_USER_WORKSPACE_DIR": "",
    "SGC_FSLAYER_MIN_FREE_DISK_BYTES": "",
    "DATABRICKS_INTERNAL_LAUNCH_CMD": "",
}

#: Qualified names of the decorator, legacy and current.
DISTRIBUTED_NAMES: frozenset[str] = frozenset(
    {
        "serverless_gpu.distributed",
        "databricks.air.distributed",
        "databricks.air.launcher.distributed",
        "air_magic.distributed",
        "air_magic.decorator.distributed",
    }
)

TORCH_DISTRIBUTOR_NAMES: frozenset[str] = frozenset(
    {"pyspark.ml.torch.distributor.TorchDistributor", "pyspark.ml.torch.TorchDistributor"}
)

DEEPSPEED_DISTRIBUTOR_NAMES: frozenset[str] = frozenset(
    {
        "pyspark.ml.deepspeed.deepspeed_distributor.DeepspeedTorchDistributor",
        "pyspark.ml.deepspeed.DeepspeedTorchDistributor",
    }
)

#: The names above plus the bare name of the decorator or class, as it is spelled.
DISTRIBUTED_MATCHES: frozenset[str] = DISTRIBUTED_NAMES | {"distributed"}
TORCH_DISTRIBUTOR_MATCHES: frozenset[str] = TORCH_DISTRIBUTOR_NAMES | {"TorchDistributor"}
DEEPSPEED_DISTRIBUTOR_MATCHES: frozenset[str] = DEEPSPEED_DISTRIBUTOR_NAMES | {"DeepspeedTorchDistributor"}
