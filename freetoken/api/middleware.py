"""What wraps every HTTP request: its id, auth, the one access-log line, the 500 catch-all, and
the rendering of errors. Errors are raised anywhere (a FreeTokenError from protocol.py, the
engine or the routes) and rendered here once, in the OpenAI shape.

What it is not: CORS (starlette's middleware, added by app.py outside this one so a preflight is
answered before auth) or an error raised inside a stream that has started (generation.py turns
that into an SSE error event; only its count reaches this module).
"""

from __future__ import annotations

import hmac
import logging
import time
import traceback
import uuid
from collections.abc import Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from freetoken.api.metrics import Metrics
from freetoken.errors import FreeTokenError, InvalidRequest, NotFound, ServerError, Unauthorized

# NOTE: the logger keeps the name the access log has always had (docs/api.md).
logger = logging.getLogger("freetoken.server")

_OPEN_PATHS = ("/health", "/metrics", "/version", "/openapi.json")
_LOG_KEY = "freetoken.log"


class ClientGone(Exception):
    """The client disconnected before its response started: rendered as a bare 499."""


def error_response(exc: FreeTokenError) -> JSONResponse:
    return JSONResponse(exc.to_body(), status_code=exc.status, headers=exc.headers or None)


def access_log(request: Request) -> dict[str, Any]:
    """The request's access-log record (id, token counts, status), which routes fill in."""
    return request.scope[_LOG_KEY]


class EdgeMiddleware:
    """Pure ASGI middleware: request id, auth, the per-request log line, the 500 catch-all."""

    def __init__(self, app, *, api_keys: Sequence[str], metrics: Metrics):
        self.app = app
        self.api_keys = [k.encode() for k in api_keys]  # NOTE: never logged, never rendered
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        info = {
            "id": uuid.uuid4().hex,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "output_tokens": 0,
            "status": 500,
            "started": False,
        }
        scope[_LOG_KEY] = info

        async def _send(message):
            if message["type"] == "http.response.start":
                info["status"] = message["status"]
                info["started"] = True
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (b"x-request-id", info["id"].encode())
                ]
            await send(message)

        try:
            self._check_auth(scope)
            await self.app(scope, receive, _send)
        except ClientDisconnect:  # gone while we read its body: nothing was submitted
            info["status"] = 499
        except FreeTokenError as exc:  # raised here (auth) or escaped from a streaming body
            self.metrics.errors.labels(exc.type).inc()
            if not info["started"]:
                await error_response(exc)(scope, receive, _send)
        except Exception:
            logger.error("request %s failed:\n%s", info["id"], traceback.format_exc())
            self.metrics.errors.labels("server_error").inc()
            if not info["started"]:
                err = ServerError(
                    f"Internal server error; request id {info['id']}", code=info["id"]
                )
                await error_response(err)(scope, receive, _send)
        finally:
            route = scope.get("path", "")
            self.metrics.http.labels(
                route if route.startswith(("/v1/", "/tok", "/det")) else "other",
                str(info["status"]),
            ).inc()
            logger.info(
                "%s %s %s status=%s prompt_tokens=%d cached_tokens=%d "
                "output_tokens=%d latency_ms=%.1f",
                info["id"],
                scope.get("method"),
                route,
                info["status"],
                info["prompt_tokens"],
                info["cached_tokens"],
                info["output_tokens"],
                1000 * (time.perf_counter() - t0),
            )

    def _check_auth(self, scope) -> None:
        if not self.api_keys or scope.get("path", "").startswith(_OPEN_PATHS):
            return
        header = b""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                header = v
        token = header[7:].strip() if header[:7].lower() == b"bearer " else b""
        ok = False
        for key in self.api_keys:  # every key compared, in constant time: no early exit
            ok |= hmac.compare_digest(token, key)
        if not ok:
            raise Unauthorized("Invalid or missing API key (Authorization: Bearer KEY).")


def exception_handlers(metrics: Metrics) -> dict:
    """Starlette's handlers for what a route raises: FreeTokenError in the OpenAI shape,
    starlette's own HTTPException (unknown path, wrong method) in the same shape, ClientGone."""

    async def on_error(request: Request, exc: FreeTokenError) -> Response:
        metrics.errors.labels(exc.type).inc()
        return error_response(exc)

    async def on_http(request: Request, exc: HTTPException) -> Response:
        kind = NotFound if exc.status_code == 404 else InvalidRequest
        err = kind(f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(err.to_body(), status_code=exc.status_code, headers=exc.headers)

    async def on_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    return {FreeTokenError: on_error, HTTPException: on_http, ClientGone: on_gone}
