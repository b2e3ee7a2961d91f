"""The Jupyter server extension: the lab extension's "Migrate from serverless_gpu" command.

Migrating needs no kernel (nor air_magic in the notebook's kernel): the server that
serves the extension has air_magic installed with it, so the fixer runs there::

    lab extension --POST /air-magic/migrate {"sources": [...], "path": "a.ipynb"}-->
        migrate.migrate_cells (as `air-magic lint --fix`)  --> 200 {"sources", "changes", "remaining", ...}
        a body that is not that                           --> 400 {"message"}
        fixes that do not settle                          --> 422 {"message"}
        more than MAX_LINES of code, or MAX_BYTES          --> 413 {"message"}
        more than MAX_SECONDS of the fixer's time          --> 408 {"message"}

The fixer runs in a child process (``air_magic.lint._migrate_worker``), awaited by the
handler: the server's event loop serves every other request meanwhile, and a migration
that takes too long is stopped.

Enabled by ``jupyter-config/jupyter_server_config.d/air_magic.json`` (installed by pip) or
``jupyter server extension enable air_magic``.  The handler requires the server's login,
as every ``/api`` handler does.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ROUTE", "MAX_LINES", "MAX_BYTES", "MAX_SECONDS", "_load_jupyter_server_extension"]

ROUTE = "air-magic/migrate"

#: The most a request may ask for: lines of code in all its cells, bytes of its body, and
#: seconds of the fixer's time.  Past them the answer is 413 or 408, naming the terminal
#: command that migrates a notebook of any size.
MAX_LINES = 10_000
MAX_BYTES = 4 << 20
MAX_SECONDS = 60.0


def _refusal(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"message": f"air_magic migrate: {message}"}


def _terminal(path: str) -> str:
    return f"run `air-magic lint --fix {path}` in a terminal instead (it has no limit)"


async def migrate_reply(body: bytes) -> tuple[int, dict[str, Any]]:
    """The status and JSON answer to one request's body; the fixer runs in a child process,
    stopped at :data:`MAX_SECONDS`, so the server's event loop goes on serving meanwhile."""
    import asyncio
    import sys

    if len(body) > MAX_BYTES:
        return _refusal(
            413,
            f"the request is {len(body):,} bytes, more than the {MAX_BYTES:,} this command takes; "
            + _terminal("NOTEBOOK.ipynb"),
        )
    try:
        request = json.loads(body or b"{}")
        sources = request["sources"]
        path = str(request.get("path") or "<notebook>")
        lines = sum(len(str(cell).splitlines()) for cell in sources)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return _refusal(400, f"a bad request ({type(exc).__name__}: {exc})")
    if lines > MAX_LINES:
        return _refusal(
            413,
            f"the notebook's code is {lines:,} lines, more than the {MAX_LINES:,} this command "
            f"migrates; {_terminal(path)}",
        )
    worker = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "air_magic.lint._migrate_worker",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(worker.communicate(body), MAX_SECONDS)
    except asyncio.TimeoutError:
        worker.kill()
        await worker.wait()
        return _refusal(408, f"migrating {path} took longer than {MAX_SECONDS:g} s and was stopped; {_terminal(path)}")
    try:
        reply = json.loads(out)
        return int(reply["status"]), reply["body"]
    except (ValueError, KeyError, TypeError):
        tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or [f"exit {worker.returncode}"]
        return _refusal(500, f"the fixer failed ({tail[0]})")


def _handler_class() -> Any:
    from jupyter_server.base.handlers import APIHandler
    from tornado import web

    class MigrateHandler(APIHandler):  # type: ignore[misc]
        @web.authenticated
        async def post(self) -> None:
            status, reply = await migrate_reply(self.request.body)
            self.set_status(status)
            self.finish(json.dumps(reply))

    return MigrateHandler


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from jupyter_server.utils import url_path_join

    web_app = serverapp.web_app
    route = url_path_join(web_app.settings["base_url"], ROUTE)
    web_app.add_handlers(".*$", [(route, _handler_class())])
