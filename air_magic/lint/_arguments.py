"""AM2xx: the arguments of ``@distributed(...)`` and ``.with_overrides(...)``."""

from __future__ import annotations

import libcst as cst

from air_magic.accelerators import GPUType
from air_magic.lint._source import (
    Source,
    accelerator_replacement,
    bool_value,
    int_value,
    is_distributed,
    quoted,
    string_value,
)

__all__ = ["check_arguments"]


def _legacy_value(src: Source, node: cst.CSTNode | None) -> GPUType | None:
    text = string_value(node)
    if text is not None:
        return GPUType.parse(text)
    if isinstance(node, cst.Attribute):
        for q in src.qnames(node):
            head, _, member = q.rpartition(".")
            if (head == "GPUType" or head.endswith(".GPUType")) and member in GPUType.__members__:
                return GPUType[member]
    return None


def check_arguments(src: Source) -> None:
    for call in src.nodes.calls:
        overrides = isinstance(call.func, cst.Attribute) and call.func.attr.value == "with_overrides"
        if not overrides and not is_distributed(src, call.func):
            continue
        keywords = {a.keyword.value: a for a in call.args if a.keyword is not None}
        positional = [a for a in call.args if a.keyword is None and not a.star]
        if not keywords and not positional:
            continue
        count_arg = keywords.get("num_accelerators") or keywords.get("gpus") or (positional[0] if positional else None)
        count = int_value(count_arg.value) if count_arg is not None else None
        accel_arg = keywords.get("accelerator_type") or (positional[1] if len(positional) > 1 else None)

        gpus = keywords.get("gpus")
        if gpus is not None:
            if "num_accelerators" in keywords or positional:
                src.report("AM205", gpus, old="gpus", new="num_accelerators")
            else:
                assert gpus.keyword is not None
                f = src.report("AM201", gpus)
                f.edits = [src.edit(gpus.keyword, "num_accelerators")]

        gpu_type = keywords.get("gpu_type")
        if gpu_type is not None:
            if accel_arg is not None:
                src.report("AM205", gpu_type, old="gpu_type", new="accelerator_type")
            else:
                assert gpu_type.keyword is not None
                legacy = _legacy_value(src, gpu_type.value)
                replacement = accelerator_replacement(legacy, count) if legacy is not None else None
                edits = [src.edit(gpu_type.keyword, "accelerator_type")]
                new = src.text(gpu_type.value)
                if replacement is not None:
                    new = quoted(replacement[0], gpu_type.value)
                    edits.append(src.edit(gpu_type.value, new))
                f = src.report("AM202", gpu_type, new=new)
                f.edits = edits
                if legacy is not None and replacement is None:
                    src.report("AM204", gpu_type.value, old=src.text(gpu_type.value))

        if accel_arg is not None:
            legacy = _legacy_value(src, accel_arg.value)
            if legacy is not None:
                replacement = accelerator_replacement(legacy, count)
                if replacement is None:
                    src.report("AM204", accel_arg.value, old=src.text(accel_arg.value))
                else:
                    new, reason = replacement
                    f = src.report("AM203", accel_arg.value, old=src.text(accel_arg.value), new=new, reason=reason)
                    f.edits = [src.edit(accel_arg.value, quoted(new, accel_arg.value))]

        remote = keywords.get("remote")
        if remote is not None and (overrides or bool_value(remote.value) is not False):
            src.report(
                "AM206",
                remote,
                arg=src.text(remote).replace(" ", ""),
                consequence="with_overrides() has no remote argument" if overrides else "rejects remote=True",
            )
