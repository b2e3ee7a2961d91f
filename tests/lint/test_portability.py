"""AM4xx: GPU-only code behind ``torch.cuda.is_available()``, with ``torch`` spelled as the code
spells it, and nothing flagged twice."""

from __future__ import annotations

from air_magic.lint import fix_source, lint_source
from air_magic.lint.notebook import fix_cells


def codes(source: str) -> list[tuple[int, str]]:
    return [(d.line, d.code) for d in lint_source(source)]


def test_code_already_behind_the_cuda_test_is_not_reported() -> None:
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "\n"
        "def setup(rank):\n"
        "    if torch.cuda.is_available():\n"
        "        torch.cuda.set_device(rank)\n"
        '        dist.init_process_group("nccl")\n'
        '        return torch.device("cuda", rank)\n'
        "    if not torch.cuda.is_available():\n"
        '        dist.init_process_group("gloo")\n'
        "    else:\n"
        "        torch.cuda.set_device(rank)\n"
        "    if rank >= 0 and torch.cuda.is_available():\n"
        "        torch.cuda.set_device(rank)\n"
        '    return torch.device(f"cuda:{rank}") if torch.cuda.is_available() else torch.device("cpu")\n'
    )
    assert codes(source) == []


def test_the_cpu_branch_of_the_cuda_test_is_reported() -> None:
    source = "import torch\nif torch.cuda.is_available():\n    pass\nelse:\n    torch.cuda.set_device(0)\n"
    assert codes(source) == [(5, "AM402")]


def test_torch_is_imported_when_only_a_submodule_is() -> None:
    source = 'import os\nimport torch.distributed as dist\n\n\ndef setup():\n    dist.init_process_group("nccl")\n'
    assert fix_source(source) == (
        "import os\nimport torch.distributed as dist\nimport torch\n\n\n"
        'def setup():\n    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")\n'
    )


def test_an_alias_of_torch_is_used_as_it_is() -> None:
    source = 'import torch as th\n\ndevice = th.device("cuda")\n'
    assert (
        fix_source(source) == 'import torch as th\n\ndevice = th.device("cuda" if th.cuda.is_available() else "cpu")\n'
    )


def test_a_torch_name_that_means_something_else_is_reported_not_rewritten() -> None:
    source = (
        'torch = "not the module"\n\n\n'
        'def setup():\n    import torch.distributed as dist\n    dist.init_process_group("nccl")\n'
    )
    found = lint_source(source)
    assert [(d.code, d.fixable) for d in found] == [("AM401", False)]
    assert fix_source(source) == source


def test_a_conditional_is_parenthesized_where_the_call_stood_in_an_expression() -> None:
    source = 'import torch\nkind = torch.device("cuda", 0).type\nmaybe = torch.device("cuda", 0) if pinned else None\n'
    fixed = fix_source(source)
    assert fixed.splitlines()[1:] == [
        'kind = (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")).type',
        'maybe = (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")) if pinned else None',
    ]
    assert fix_source(fixed) == fixed


def test_ddp_device_arguments_that_already_choose_are_left_alone() -> None:
    source = (
        "import torch\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "a = DDP(model, device_ids=None)\n"
        'b = DDP(model, device_ids=[rank] if device.type == "cuda" else None)\n'
        "c = DDP(model, device_ids=[rank] if torch.cuda.is_available() else None)\n"
        "d = DDP(model, [rank], rank)\n"
    )
    assert codes(source) == [(6, "AM404"), (6, "AM404")]


def test_in_a_notebook_the_import_goes_after_the_imports_of_an_earlier_cell() -> None:
    cells = [
        "import os\nimport torch.distributed as dist",
        "%%distributed -n 2\ndist.init_process_group(backend='nccl')\ndist.destroy_process_group()",
    ]
    fixed = fix_cells(cells)
    assert fixed.sources == (
        "import os\nimport torch.distributed as dist\nimport torch",
        "%%distributed -n 2\ndist.init_process_group(backend='nccl' if torch.cuda.is_available() else 'gloo')\n"
        "dist.destroy_process_group()",
    )
    assert fix_cells(list(fixed.sources)).sources == fixed.sources
