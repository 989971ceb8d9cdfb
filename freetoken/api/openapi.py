"""The OpenAPI 3.1 document served at /openapi.json: the request schemas from protocol.py's
pydantic models, one error shape, every route, and the generation responses' logprobs objects
(the shapes protocol/responses.py builds, written here by hand).

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

    doc = {
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
    _add_generation_responses(doc)
    return doc


_NUM_OR_NULL = {"type": ["number", "null"]}
_ALLOWED_MASS = (
    "FreeToken's extension, present only with allowed_token_ids: the log of the probability mass "
    "the full distribution (after logit_bias, before sampling transforms) puts on the allowed "
    "set at that position, <= 0; logprob + this = the unrenormalized logprob"
)


def _add_generation_responses(doc: dict) -> None:
    """The 200 bodies of /v1/completions and /v1/chat/completions (streamed chunks carry the same
    logprobs objects per choice)."""
    ref = "#/components/schemas/{}".format
    top_entry = {
        "type": "object",
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number"},
            "bytes": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["token", "logprob", "bytes"],
    }
    usage = {"type": "object", "additionalProperties": True}

    def response(obj: str, choice: dict) -> dict:
        """A 200 body: the envelope both routes share around their own choice fields."""
        return {
            "type": "object",
            "properties": {
                "id": {"type": "string"},
                "object": {"const": obj},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "index": {"type": "integer"},
                            **choice,
                            "finish_reason": {"type": ["string", "null"]},
                            "stop_reason": {"type": ["string", "integer", "null"]},
                        },
                    },
                },
                "usage": usage,
            },
        }

    schemas = {
        "CompletionLogprobs": {
            "type": "object",
            "properties": {
                "tokens": {"type": "array", "items": {"type": "string"}},
                "token_logprobs": {"type": "array", "items": _NUM_OR_NULL},
                "top_logprobs": {
                    "type": "array",
                    "items": {
                        "type": ["object", "null"],
                        "additionalProperties": {"type": "number"},
                    },
                },
                "text_offset": {"type": "array", "items": {"type": "integer"}},
                "allowed_logprobs": {
                    "type": "array",
                    "items": _NUM_OR_NULL,
                    "description": _ALLOWED_MASS + "; one per position, null at prompt positions",
                },
            },
            "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        },
        "ChatCompletionTokenLogprob": {
            "type": "object",
            "properties": {
                **top_entry["properties"],
                "top_logprobs": {"type": "array", "items": top_entry},
                "allowed_logprob": {**_NUM_OR_NULL, "description": _ALLOWED_MASS},
            },
            "required": ["token", "logprob", "bytes", "top_logprobs"],
        },
        "CompletionResponse": response("text_completion", {
            "text": {"type": "string"},
            "logprobs": {"anyOf": [{"$ref": ref("CompletionLogprobs")}, {"type": "null"}]},
        }),
        "ChatCompletionResponse": response("chat.completion", {
            "message": {"type": "object"},
            "logprobs": {
                "type": ["object", "null"],
                "properties": {
                    "content": {
                        "type": "array",
                        "items": {"$ref": ref("ChatCompletionTokenLogprob")},
                    }
                },
            },
        }),
    }
    doc["components"]["schemas"].update(schemas)
    for path, name in (
        ("/v1/completions", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionResponse"),
    ):
        ok = doc["paths"][path]["post"]["responses"]["200"]
        ok["content"] = {"application/json": {"schema": {"$ref": ref(name)}}}
