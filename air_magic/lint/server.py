"""The Jupyter server extension: the lab extension's "Migrate from serverless_gpu" command.

Migrating needs no kernel (nor air_magic in the notebook's kernel): the server that
serves the extension has air_magic installed with it, so the fixer runs there::

    lab extension --POST /air-magic/migrate {"sources": [...], "path": "a.ipynb"}-->
        migrate.migrate_cells (as `air-magic lint --fix`)  --> 200 {"sources", "changes", "remaining", ...}
        a body that is not that                           --> 400 {"message"}
        fixes that do not settle                          --> 422 {"message"}

Enabled by ``jupyter-config/jupyter_server_config.d/air_magic.json`` (installed by pip) or
``jupyter server extension enable air_magic``.  The handler requires the server's login,
as every ``/api`` handler does.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ROUTE", "_load_jupyter_server_extension"]

ROUTE = "air-magic/migrate"


def _handler_class() -> Any:
    from jupyter_server.base.handlers import APIHandler
    from tornado import web

    class MigrateHandler(APIHandler):  # type: ignore[misc]
        @web.authenticated
        def post(self) -> None:
            from .diagnostics import ConvergenceError
            from .migrate import migrate_cells

            try:
                body = json.loads(self.request.body or b"{}")
                sources = body["sources"]
                path = str(body.get("path") or "<notebook>")
                result = migrate_cells(sources, path=path, unsafe=bool(body.get("unsafe", False)))
            except (ValueError, KeyError, TypeError) as exc:
                self.set_status(400)
                self.finish(json.dumps({"message": f"air_magic migrate: a bad request ({type(exc).__name__}: {exc})"}))
                return
            except ConvergenceError as exc:
                self.set_status(422)
                self.finish(json.dumps({"message": str(exc)}))
                return
            self.finish(json.dumps(result))

    return MigrateHandler


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from jupyter_server.utils import url_path_join

    web_app = serverapp.web_app
    route = url_path_join(web_app.settings["base_url"], ROUTE)
    web_app.add_handlers(".*$", [(route, _handler_class())])
