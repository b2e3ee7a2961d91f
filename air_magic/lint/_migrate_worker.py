"""Runs one migration for the server extension, in a process of its own (``python -m
air_magic.lint._migrate_worker``): the request's JSON on stdin, the answer's on stdout,
``{"status": 200, "body": {...}}``.  A process, so that the server can stop a migration
that takes too long and its event loop never waits for the fixer (nor its GIL)."""

from __future__ import annotations

import json
import sys
from typing import Any


def answer(request: dict[str, Any]) -> dict[str, Any]:
    from air_magic.lint.diagnostics import ConvergenceError
    from air_magic.lint.migrate import migrate_cells

    try:
        sources = request["sources"]
        path = str(request.get("path") or "<notebook>")
        result = migrate_cells(sources, path=path, unsafe=bool(request.get("unsafe", False)))
    except (ValueError, KeyError, TypeError) as exc:
        return {"status": 400, "body": {"message": f"air_magic migrate: a bad request ({type(exc).__name__}: {exc})"}}
    except ConvergenceError as exc:
        return {"status": 422, "body": {"message": str(exc)}}
    return {"status": 200, "body": result}


def main() -> int:
    try:
        request = json.loads(sys.stdin.buffer.read() or b"{}")
    except ValueError as exc:
        reply = {"status": 400, "body": {"message": f"air_magic migrate: a bad request (ValueError: {exc})"}}
    else:
        reply = answer(request) if isinstance(request, dict) else answer({})
    sys.stdout.write(json.dumps(reply))
    return 0


if __name__ == "__main__":
    sys.exit(main())
