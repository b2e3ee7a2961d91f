"""The JupyterLab extension's view of the machine: every air_magic launch and pool on it, with Stop
on yours, served by the Jupyter server (no kernel needed: the sidebar shows the machine even from a
notebook whose kernel never loaded air_magic)::

    sidebar (labextension/src/machine.ts), every 5 s while it is shown
        --GET  <base>/air-magic/machine-->  kernel.machine.rows() + orphans(), as `air-magic ps --json`
                                            --> 200 {"user", "rows", "orphans", "skipped"}
    its Stop, after a confirmation
        --POST <base>/air-magic/machine/stop {"id"}-->  kernel.machine.stop(id, via="the JupyterLab sidebar")
                                            --> 200 {"message"} | 400 / 409 {"message"}

Beside ``kernel/machine/ps.py`` (the list ``air-magic ps`` and ``%distributed_ps`` read), not in
``panel/``: the Jupyter server imports it at start, and it needs the machine's list only, none of
the panel's modules.

The server runs as its user, so "yours" is that user's launches (root's server: everyone's), and
another user's rows carry what ``air-magic ps`` shows them: owner, kind, ranks, GPUs and age. Both
handlers do their work in a thread (NVML, psutil, and a stop's grace of seconds): the server's
event loop goes on serving meanwhile. They require the server's login, as every ``/api``
handler does. Registered by :func:`air_magic._jupyter_server_extension_points`.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

__all__ = ["ROUTE", "machine_reply", "stop_reply", "_load_jupyter_server_extension"]

ROUTE = "air-magic/machine"

#: What a stopped launch's cell names as the stopper.
VIA = "the JupyterLab sidebar"


def machine_reply() -> tuple[int, dict[str, Any]]:
    """Every launch and pool on this machine, and GPU memory no launch holds."""
    from air_magic.kernel.machine import ps as machine
    from air_magic.protocol import registry

    try:
        records, skipped = registry.records()
        rows, _ = machine.rows(records)
        strays = machine.orphans(records)
    except OSError as exc:  # the list's folder cannot be trusted: said, as air-magic ps says it
        return 500, {"message": f"air_magic: the machine's list of launches cannot be read: {exc}"}
    return 200, {"user": registry.user_name(os.getuid()), "rows": rows, "orphans": strays, "skipped": skipped}


def stop_reply(body: bytes) -> tuple[int, dict[str, Any]]:
    """Stop one launch or pool of this server's user, as ``air-magic stop ID`` does."""
    from air_magic.kernel.machine import ps as machine

    try:
        launch_id = json.loads(body or b"{}")["id"]
        if not isinstance(launch_id, str) or not launch_id:
            raise TypeError("id is not a launch's id")
    except (ValueError, KeyError, TypeError) as exc:
        return 400, {"message": f"air_magic stop: a bad request ({type(exc).__name__}: {exc})"}
    try:
        return 200, {"message": machine.stop(launch_id, via=VIA)}
    except (machine.StopError, OSError) as exc:
        return 409, {"message": f"air_magic stop: {exc}"}


def _handler_classes() -> list[tuple[str, Any]]:
    from jupyter_server.base.handlers import APIHandler
    from tornado import web

    class MachineHandler(APIHandler):  # type: ignore[misc]
        @web.authenticated
        async def get(self) -> None:
            status, reply = await asyncio.to_thread(machine_reply)
            self.set_status(status)
            self.finish(json.dumps(reply))

    class StopHandler(APIHandler):  # type: ignore[misc]
        @web.authenticated
        async def post(self) -> None:
            status, reply = await asyncio.to_thread(stop_reply, self.request.body)
            self.set_status(status)
            self.finish(json.dumps(reply))

    return [(ROUTE, MachineHandler), (f"{ROUTE}/stop", StopHandler)]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from jupyter_server.utils import url_path_join

    web_app = serverapp.web_app
    base = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [(url_path_join(base, route), handler) for route, handler in _handler_classes()])
