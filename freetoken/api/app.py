"""`create_app`: the Starlette app over one started engine, and its route table.

What it is not: any route's behaviour (generation.py, scoring.py, info.py, scaleout.py), the
per-request wrapping and error rendering (middleware.py), or the engine's lifetime (the caller
owns it).
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from freetoken.api.body import BodyReader
from freetoken.api.engine_client import EngineClient
from freetoken.api.generation import Generation
from freetoken.api.info import InfoRoutes
from freetoken.api.metrics import Metrics
from freetoken.api.middleware import EdgeMiddleware, exception_handlers
from freetoken.api.scaleout import ScaleOut
from freetoken.api.scoring import Scoring
from freetoken.config import ServerConfig


def create_app(
    engine: EngineClient,
    *,
    served_model_name: str = "SmolLM2-135M-Instruct",
    api_key: str | Sequence[str] | None = None,
    max_batch_prompts: int = ServerConfig.max_batch_prompts,
    max_body_bytes: int = ServerConfig.max_body_bytes,
    request_timeout_s: float | None = None,
    allowed_origins: Sequence[str] = (),
    stream_max_unread: int = ServerConfig.stream_max_unread,
    stream_send_timeout_s: float | None = ServerConfig.stream_send_timeout_s,
) -> Starlette:
    """The app over a started engine. The caller owns the engine's lifetime.

    api_key: one key or several (any of them is accepted); None or empty: no auth.
    request_timeout_s: the deadline of a generation request from arrival (None: none).
    allowed_origins: CORS origins ("*" for any); empty: no CORS headers at all.
    stream_max_unread, stream_send_timeout_s: backpressure on streams (generation.py)."""
    metrics = Metrics(engine, served_model_name)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    reader = BodyReader(
        tokenizer=engine.tokenizer,
        limits=engine.limits,
        served_model_name=served_model_name,
        max_batch_prompts=max_batch_prompts,
        max_body_bytes=max_body_bytes,
    )
    gen = Generation(engine, reader, metrics=metrics, request_timeout_s=request_timeout_s,
                     stream_max_unread=stream_max_unread,
                     stream_send_timeout_s=stream_send_timeout_s)
    scoring = Scoring(gen, reader)
    info = InfoRoutes(engine, reader, metrics=metrics)
    scaleout = ScaleOut(engine, reader)  # render endpoints, load reports
    routes = [
        Route("/v1/completions", gen.completions, methods=["POST"]),
        Route("/v1/chat/completions", gen.chat_completions, methods=["POST"]),
        Route("/v1/generative-scores", scoring.generative_scores, methods=["POST"]),
        Route("/v1/score", scoring.score, methods=["POST"]),
        Route("/v1/models", info.models, methods=["GET"]),
        Route("/tokenize", info.tokenize, methods=["POST"]),
        Route("/detokenize", info.detokenize, methods=["POST"]),
        Route("/tokenizer_info", info.tokenizer_info, methods=["GET"]),
        Route("/health", info.health, methods=["GET"]),
        Route("/metrics", info.metrics_endpoint, methods=["GET"]),
        Route("/version", info.version, methods=["GET"]),
        Route("/openapi.json", info.openapi, methods=["GET"]),
        *scaleout.routes(),
    ]
    app = Starlette(routes=routes, exception_handlers=exception_handlers(metrics))
    app.add_middleware(EdgeMiddleware, api_keys=[k for k in keys if k], metrics=metrics)
    if allowed_origins:  # outermost: a preflight is answered before auth
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    app.state.metrics = metrics
    app.state.engine = engine
    app.state.stop_requests = gen.stop_requests  # for the CLI's shutdown past the grace
    return app
