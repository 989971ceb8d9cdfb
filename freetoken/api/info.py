"""The routes that answer from what the server knows, without generating: /v1/models, /tokenize,
/detokenize, /tokenizer_info, /health, /metrics, /version, /openapi.json.

What it is not: the routes routers call (scaleout.py) or anything that submits to the engine.
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken import __version__
from freetoken.api.body import BodyReader
from freetoken.api.engine_client import EngineClient
from freetoken.api.metrics import Metrics
from freetoken.api.middleware import error_response
from freetoken.api.openapi import openapi_document
from freetoken.errors import EngineDead
from freetoken.protocol.parse import parse_detokenize, parse_tokenize


class InfoRoutes:
    def __init__(self, engine: EngineClient, reader: BodyReader, *, metrics: Metrics):
        self.engine = engine
        self.reader = reader
        self.tok = reader.tokenizer
        self.limits = reader.limits
        self.model_name = reader.served_model_name
        self.metrics = metrics
        self.created = int(time.time())

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "freetoken",
                        "max_model_len": self.limits.max_model_len,
                    }
                ],
            }
        )

    async def tokenize(self, request: Request) -> Response:
        body = await self.reader.read_json(request)
        if isinstance(body, dict):
            model = body.get("model")
            self.reader.check_model(model if isinstance(model, str) else None)
        return JSONResponse(parse_tokenize(body, self.limits, self.tok))

    async def detokenize(self, request: Request) -> Response:
        body = await self.reader.read_json(request)
        ids = parse_detokenize(body, self.limits)
        self.reader.check_model(body.get("model"))
        return JSONResponse({"prompt": self.tok.decode(ids, skip_special_tokens=False)})

    async def tokenizer_info(self, request: Request) -> Response:
        t = self.tok
        return JSONResponse(
            {
                "tokenizer_class": type(t).__name__,
                "vocab_size": self.limits.vocab_size,
                "bos_token": t.bos_token,
                "bos_token_id": t.bos_token_id,
                "eos_token": t.eos_token,
                "eos_token_id": t.eos_token_id,
                "add_bos_token": t.add_bos_token,
                "max_model_len": self.limits.max_model_len,
                "model_max_length": self.limits.max_model_len,
                "chat_template": t.chat_template,
            }
        )

    async def health(self, request: Request) -> Response:
        if not self.engine.is_alive():
            return error_response(EngineDead("The engine loop is not running."))
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(
            self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())
