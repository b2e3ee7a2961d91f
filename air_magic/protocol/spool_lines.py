"""The format of a tracking spool line (``tracking-<rank>.tsv``): written by ranks, read by the kernel."""

from __future__ import annotations

import json
from typing import Any

# -- tracking spool lines ----------------------------------------------------------------------
#
# ``tracking-<rank>.tsv``: tab-separated fields, the first is the kind::
#
#     m <key> <value> <step> <timestamp ms>      a metric point (float repr, whole numbers)
#     p <key> <value>                            a param
#     t <key> <value>                            a tag
#     a <local path> <artifact path>             a file to upload ("" for the run's root)
#     c <call> <label>                           a pool's call begins (``Cell In[5]``, a
#                                                function's name): what follows is its child
#                                                run's (made when something follows)
#     e <call> <status>                          that call ended on this rank (FINISHED,
#                                                FAILED or KILLED)
#
# A text field that is not a plain MLflow name is written as a JSON string (it starts with
# ``"``, which no MLflow name does), so any text round-trips.  Lines end with ``\n`` only.

METRIC, PARAM, TAG, ARTIFACT, CALL, CALL_END = "m", "p", "t", "a", "c", "e"


def text_field(value: str) -> str:
    """``value`` as one field of a line: itself when it is a plain name, else a JSON string."""
    if value.isascii() and value.isprintable() and "\t" not in value and not value.startswith('"'):
        return value
    return json.dumps(value)


def _text(field: str) -> str:
    return json.loads(field) if field.startswith('"') else field  # type: ignore[no-any-return]


def metric_line(key_field: str, value: float, step: int, timestamp_ms: float) -> str:
    """One metric line; ``key_field`` is already a :func:`text_field` (ranks cache it)."""
    return f"{METRIC}\t{key_field}\t{float(value)!r}\t{int(step)}\t{int(timestamp_ms)}\n"


def text_line(kind: str, key: str, value: str) -> str:
    """A param, tag or artifact line: two text fields."""
    return f"{kind}\t{text_field(key)}\t{text_field(value)}\n"


def call_line(call: int, label: str) -> str:
    """The line a pool's rank writes as one of its calls begins."""
    return f"{CALL}\t{int(call)}\t{text_field(label)}\n"


def call_end_line(call: int, status: str) -> str:
    """The line a pool's rank writes as one of its calls ends (``FINISHED``, ``FAILED``, ``KILLED``)."""
    return f"{CALL_END}\t{int(call)}\t{status}\n"


def parse_line(line: bytes) -> tuple[Any, ...] | None:
    """One spool line -> ``("m", key, value, step, ts)`` / ``("p"|"t", key, value)`` /
    ``("a", local_path, artifact_path | None)`` / ``("c", call, label)`` / ``("e", call, status)``;
    None for a line that cannot be read."""
    fields = line.decode("utf-8", "surrogateescape").split("\t")
    try:
        kind = fields[0]
        if kind == METRIC and len(fields) == 5:
            return (METRIC, _text(fields[1]), float(fields[2]), int(fields[3]), int(fields[4]))
        if kind in (PARAM, TAG) and len(fields) == 3:
            return (kind, _text(fields[1]), _text(fields[2]))
        if kind == ARTIFACT and len(fields) == 3:
            return (ARTIFACT, _text(fields[1]), _text(fields[2]) or None)
        if kind == CALL and len(fields) == 3:
            return (CALL, int(fields[1]), _text(fields[2].rstrip("\n")))
        if kind == CALL_END and len(fields) == 3:
            return (CALL_END, int(fields[1]), fields[2].rstrip("\n"))
    except ValueError:  # json.JSONDecodeError included
        pass
    return None
