"""The OpenAPI 3.1 document served at /openapi.json: the request schemas from protocol.py's
pydantic models, one error shape, and every route.

What it is not: a source of truth for validation (protocol.py is; the schemas are derived from it)
or for the route table (app.py is; a route added there is added here by hand).
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from freetoken import __version__
from freetoken.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from freetoken.protocol.scoring import GenerativeScoreRequest, ScoreRequest


def openapi_document() -> dict:
    models = [
        CompletionRequest,
        ChatCompletionRequest,
        TokenizeRequest,
        DetokenizeRequest,
        GenerativeScoreRequest,
        ScoreRequest,
    ]
    refs, schema = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    error = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "integer", "null"]},
                },
                "required": ["message", "type", "param", "code"],
            }
        },
        "required": ["error"],
    }
    components = dict(schema.get("$defs", {}))
    components["ErrorResponse"] = error
    errors = {
        str(code): {
            "description": desc,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
            },
        }
        for code, desc in (
            (400, "invalid request"),
            (401, "missing or wrong API key"),
            (404, "unknown model"),
            (413, "body too large"),
            (503, "overloaded or engine down"),
            (500, "server error"),
        )
    }

    def post(model, summary):
        ref = refs[(model, "validation")]
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
                "responses": {
                    "200": {"description": "OK (JSON, or text/event-stream when stream is true)"},
                    **errors,
                },
            }
        }

    def get(summary):
        return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "FreeToken", "version": __version__},
        "paths": {
            "/v1/completions": post(CompletionRequest, "Text completion"),
            "/v1/chat/completions": post(ChatCompletionRequest, "Chat completion"),
            "/v1/generative-scores": post(
                GenerativeScoreRequest, "Label probabilities after query + item (vLLM's shape)"
            ),
            "/v1/score": post(
                ScoreRequest, "Label probabilities after query + item (SGLang's shape)"
            ),
            "/tokenize": post(TokenizeRequest, "Tokenize a prompt or messages"),
            "/detokenize": post(DetokenizeRequest, "Detokenize token ids"),
            "/v1/models": get("The served model"),
            "/tokenizer_info": get("Tokenizer facts"),
            "/health": get("Liveness"),
            "/metrics": get("Prometheus metrics"),
            "/version": get("Version"),
            "/openapi.json": get("This document"),
        },
        "components": {"schemas": components},
    }
