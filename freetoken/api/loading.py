"""What the port answers while the model loads: 503 on every route, so routers and health checks
see "not ready" (a status) instead of a refused connection.

The placeholder runs uvicorn in a thread while the main thread loads the model; `stop()` closes it
and the real server binds the same port right after (SO_REUSEADDR, set by uvicorn).

What it is not: the app itself (app.py), which exists only once the engine is built.
"""

from __future__ import annotations

import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from freetoken.errors import EngineDead

_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


async def _loading(request: Request) -> JSONResponse:
    err = EngineDead("The model is still loading; retry shortly.", code="loading")
    return JSONResponse(err.to_body(), status_code=err.status, headers={"Retry-After": "2"})


class LoadingServer:
    def __init__(self, host: str, port: int):
        app = Starlette(routes=[Route("/{path:path}", _loading, methods=_METHODS)])
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                     access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="freetoken-loading",
                                        daemon=True)

    def start(self, timeout_s: float = 10.0) -> LoadingServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        # NOTE: a port already in use makes uvicorn exit the thread; the real server then reports
        # the same error, so nothing here needs to fail.
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
