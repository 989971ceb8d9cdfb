"""The HTTP edge: a Starlette app over one Engine.

What it does: routes of SPEC.md, SSE streaming, `--api-key`, CORS (only with
`--allowed-origins`), metrics, one log line per request, and rendering every error once, in the
OpenAI shape. Reliability (docs/reliability.md): every generation request is watched for its
deadline (`--request-timeout`) and for the engine loop's death, and is aborted -- its KV freed --
when it times out, fails or its client leaves. What it does not: validation (protocol.py) or
anything with tensors (the engine thread). No route reads or writes a file.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import re
import time
import traceback
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from freetoken import __version__, protocol, responses
from freetoken.errors import (
    BodyTooLarge,
    EngineDead,
    FreeTokenError,
    InvalidRequest,
    NotFound,
    RequestTimeout,
    ServerError,
    Unauthorized,
)
from freetoken.metrics import Metrics

logger = logging.getLogger("freetoken.server")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
# Bodies larger than this are decoded and validated on a worker thread, so one big request does
# not stall the event loop (every other request's I/O, and the 503s of a full queue).
OFF_LOOP_BYTES = 64 * 1024
WATCH_INTERVAL_S = 0.25  # how often an in-flight request checks its deadline and the engine
_OPEN_PATHS = ("/health", "/metrics", "/version", "/openapi.json")
_LOG_KEY = "freetoken.log"


def _error_response(exc: FreeTokenError) -> JSONResponse:
    return JSONResponse(exc.to_body(), status_code=exc.status, headers=exc.headers or None)


class _Edge:
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
                await _error_response(exc)(scope, receive, _send)
        except Exception:
            logger.error("request %s failed:\n%s", info["id"], traceback.format_exc())
            self.metrics.errors.labels("server_error").inc()
            if not info["started"]:
                err = ServerError(
                    f"Internal server error; request id {info['id']}", code=info["id"]
                )
                await _error_response(err)(scope, receive, _send)
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


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class _Handlers:
    def __init__(
        self,
        engine,
        *,
        served_model_name: str,
        max_batch_prompts: int,
        max_body_bytes: int,
        metrics: Metrics,
        request_timeout_s: float | None = None,
    ):
        self.engine = engine
        self.tok = engine.tokenizer
        self.limits = engine.limits
        self.model_name = served_model_name
        self.max_batch_prompts = max_batch_prompts
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s or None
        # engine requests one HTTP request may hold (prompts x n): more could never be queued
        self.max_queue_len = getattr(getattr(engine, "config", None), "max_queue_len", None)
        self.inflight: set[str] = set()  # engine request ids of the requests being served
        self.stopping = False  # stop_requests() was called: the server is going down
        self.created = int(time.time())

    # ---- helpers -----------------------------------------------------------------------------

    async def _json(self, request: Request) -> Any:
        return _decode_json(await self._body(request))

    async def _body(self, request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise BodyTooLarge(f"The request body exceeds {self.max_body_bytes} bytes.")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge(f"The request body exceeds {self.max_body_bytes} bytes.")
            chunks.append(chunk)
        return b"".join(chunks)

    def _parse(self, raw: bytes, chat: bool) -> protocol.ParsedRequest:
        body = _decode_json(raw)
        if chat:
            parsed = protocol.parse_chat(body, self.limits, self.tok)
        else:
            parsed = protocol.parse_completion(
                body, self.limits, self.tok, max_batch_prompts=self.max_batch_prompts
            )
        self._check_model(parsed.model)
        num_jobs = len(parsed.prompts) * parsed.n
        if self.max_queue_len is not None and num_jobs > self.max_queue_len:
            raise InvalidRequest(
                f"This request needs {num_jobs} sequences (prompts x n), more than the server's "
                f"queue holds ({self.max_queue_len}, --max-queue-len)",
                param="n",
            )
        return parsed

    def _engine_alive(self) -> bool:
        alive = getattr(self.engine, "is_alive", None)
        return alive() if callable(alive) else (True if alive is None else bool(alive))

    async def _watch(self, t0: float) -> FreeTokenError:
        """Returns (never raises) the error that ends a request: its deadline passed, or the
        engine loop died (its streams would never finish). Runs until cancelled otherwise."""
        deadline = t0 + self.request_timeout_s if self.request_timeout_s else None
        while True:
            if not self._engine_alive():
                return EngineDead("The engine loop stopped before this request finished.")
            delay = WATCH_INTERVAL_S
            if deadline is not None:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return RequestTimeout(self.request_timeout_s)
                delay = min(delay, left)
            await asyncio.sleep(delay)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise NotFound(
                f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )

    async def _submit(self, prompt_ids, params, erid):
        stream = self.engine.submit(prompt_ids, params, request_id=erid)
        if inspect.isawaitable(stream):
            stream = await stream
        return stream

    async def _start(self, parsed: protocol.ParsedRequest, rid: str, chat: bool):
        """Submit prompts x n engine requests up front, so a refusal is still an HTTP error."""
        jobs = []
        state_cls = responses.ChatChoiceState if chat else responses.ChoiceState
        try:
            for i, prompt in enumerate(parsed.prompts):
                for j in range(parsed.n):
                    index = i * parsed.n + j
                    erid = f"{rid}-{index}"
                    stream = await self._submit(prompt.ids, parsed.choice_params(j), erid)
                    self.inflight.add(erid)
                    jobs.append((index, erid, stream, state_cls(self.tok, parsed, prompt)))
        except BaseException:
            for _, erid, _, _ in jobs:
                self.engine.abort(erid)
                self.inflight.discard(erid)
            raise
        return jobs

    def stop_requests(self) -> int:
        """Shutdown past its grace: abort every request in flight. Each then ends with a 503
        (or a stream's error event) rather than being cut off mid-response."""
        self.stopping = True
        erids = list(self.inflight)
        for erid in erids:
            self.engine.abort(erid)
        return len(erids)

    def _check_out(self, out) -> None:
        if out.finish_reason == "error" or getattr(out, "error", None):
            # NOTE: the engine logged the traceback; the client gets the id, not the internals
            logger.error("request %s failed in the engine: %s", out.request_id, out.error)
            raise ServerError(
                f"Internal server error in the engine; request id {out.request_id}",
                code=out.request_id,
            )
        if out.finish_reason == "abort":  # not ours: we stop reading before we abort
            if self.stopping:
                raise EngineDead(
                    "The server is shutting down and this request did not finish within the "
                    "grace period (--shutdown-grace-s)."
                )
            raise EngineDead("The engine stopped before this request finished.")

    def _usage(self, parsed, jobs) -> dict:
        n = parsed.n
        states = [s for _, _, _, s in jobs]
        prompt_tokens = sum(len(p.ids) for p in parsed.prompts)
        cached = sum(states[i * n].num_cached_tokens for i in range(len(parsed.prompts)))
        output = sum(s.num_output_tokens for s in states)
        return responses.usage_dict(prompt_tokens, output, cached)

    def _account(self, request: Request, usage: dict, states, t0: float) -> None:
        info = request.scope.get(_LOG_KEY, {})
        info["prompt_tokens"] = usage["prompt_tokens"]
        info["cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
        info["output_tokens"] = usage["completion_tokens"]
        m = self.metrics
        m.prompt_tokens.inc(usage["prompt_tokens"])
        m.generation_tokens.inc(usage["completion_tokens"])
        m.cached_tokens.inc(info["cached_tokens"])
        m.e2e.observe(time.perf_counter() - t0)
        for s in states:
            m.success.labels(s.finish_reason or "unknown").inc()

    # ---- generation --------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        info = request.scope.get(_LOG_KEY, {"id": uuid.uuid4().hex})
        rid = ("chatcmpl-" if chat else "cmpl-") + info["id"]
        raw = await self._body(request)
        if len(raw) > OFF_LOOP_BYTES:
            parsed = await asyncio.to_thread(self._parse, raw, chat)
        else:
            parsed = self._parse(raw, chat)
        jobs = await self._start(parsed, rid, chat)
        if parsed.stream:
            unfinished = {erid for _, erid, _, _ in jobs}
            # NOTE: a client gone before the body starts never runs the generator's `finally`;
            # the background task (run by starlette after a disconnect too) aborts for it.
            return StreamingResponse(
                self._stream(request, parsed, rid, jobs, chat, t0, unfinished),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(self._finish_stream, unfinished, jobs),
            )
        return await self._collect(request, parsed, rid, jobs, chat, t0)

    async def _collect(self, request, parsed, rid, jobs, chat, t0) -> Response:
        first = [True]

        async def run(stream, state):
            frags = []
            async for out in stream:
                self._check_out(out)
                if first[0]:
                    first[0] = False
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                frags.append(state.feed(out))
            return responses.merge_fragments(frags)

        work = asyncio.gather(*(run(stream, state) for _, _, stream, state in jobs))
        gone = asyncio.ensure_future(_wait_disconnect(request))
        watch = asyncio.ensure_future(self._watch(t0))
        try:
            done, _ = await asyncio.wait({work, gone, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                merged = work.result()
            elif watch in done:
                raise watch.result()
            else:
                raise _ClientGone()
        except BaseException:
            work.cancel()
            work.add_done_callback(_retrieve)  # no "exception was never retrieved" log
            for _, erid, _, _ in jobs:
                self.engine.abort(erid)
            raise
        finally:
            gone.cancel()
            watch.cancel()
            self.inflight.difference_update(erid for _, erid, _, _ in jobs)
        usage = self._usage(parsed, jobs)
        self._account(request, usage, [s for *_, s in jobs], t0)
        model = self.model_name
        if chat:
            choices = [responses.chat_choice(idx, frag) for (idx, *_), frag in zip(jobs, merged)]
            return JSONResponse(responses.chat_response(rid, model, choices, usage))
        choices = [responses.completion_choice(idx, frag) for (idx, *_), frag in zip(jobs, merged)]
        return JSONResponse(responses.completion_response(rid, model, choices, usage))

    def _abort(self, erids: set[str]) -> None:
        for erid in list(erids):
            self.engine.abort(erid)
        erids.clear()

    def _finish_stream(self, unfinished: set[str], jobs) -> None:
        self._abort(unfinished)
        self.inflight.difference_update(erid for _, erid, _, _ in jobs)

    async def _stream(self, request, parsed, rid, jobs, chat, t0, unfinished: set[str]):
        created = int(time.time())
        model = self.model_name
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index, erid, stream, state):
            try:
                async for out in stream:
                    self._check_out(out)
                    await queue.put((index, state.feed(out), None))
                    if out.finished:
                        unfinished.discard(erid)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 -- forwarded to the SSE loop
                await queue.put((index, None, exc))
                return
            await queue.put((index, None, None))

        async def watch():
            await queue.put((None, None, await self._watch(t0)))

        tasks = [asyncio.ensure_future(pump(*job)) for job in jobs]
        tasks.append(asyncio.ensure_future(watch()))
        first_chunk = {idx: True for idx, *_ in jobs}
        obj = "chat.completion.chunk" if chat else "text_completion"
        try:
            pending, got_first = len(jobs), False
            while pending:
                index, frag, exc = await queue.get()
                if exc is not None:
                    raise exc
                if frag is None:
                    pending -= 1
                    continue
                if not got_first:
                    got_first = True
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                if chat:
                    if not (frag.text or frag.logprobs or frag.finish_reason or first_chunk[index]):
                        continue
                    yield _sse(
                        responses.chat_chunk(
                            rid, model, created, index, frag, first=first_chunk[index]
                        )
                    )
                else:
                    if not (
                        frag.text or frag.logprobs or frag.finish_reason or frag.prompt_logprobs
                    ):
                        continue
                    yield _sse(responses.completion_chunk(rid, model, created, index, frag))
                first_chunk[index] = False
            usage = self._usage(parsed, jobs)
            self._account(request, usage, [s for *_, s in jobs], t0)
            if parsed.include_usage:
                yield _sse(responses.usage_chunk(rid, model, created, obj, usage))
        except FreeTokenError as exc:
            self.metrics.errors.labels(exc.type).inc()
            logger.warning("%s failed mid-stream: %s", rid, exc.message)
            yield _sse(exc.to_body())
        except Exception:
            logger.error("%s failed mid-stream:\n%s", rid, traceback.format_exc())
            self.metrics.errors.labels("server_error").inc()
            yield _sse(ServerError(f"Internal server error; request id {rid}", code=rid).to_body())
        finally:
            for t in tasks:
                t.cancel()
            self._finish_stream(unfinished, jobs)
        yield b"data: [DONE]\n\n"

    # ---- other endpoints ---------------------------------------------------------------------

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
        body = await self._json(request)
        if isinstance(body, dict):
            self._check_model(body.get("model") if isinstance(body.get("model"), str) else None)
        return JSONResponse(protocol.parse_tokenize(body, self.limits, self.tok))

    async def detokenize(self, request: Request) -> Response:
        body = await self._json(request)
        ids = protocol.parse_detokenize(body, self.limits)
        self._check_model(body.get("model"))
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
                "add_bos_token": bool(getattr(t, "add_bos_token", False)),
                "max_model_len": self.limits.max_model_len,
                "model_max_length": self.limits.max_model_len,
                "chat_template": getattr(t, "chat_template", None),
            }
        )

    async def health(self, request: Request) -> Response:
        if not self._engine_alive():
            return _error_response(EngineDead("The engine loop is not running."))
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(
            self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())


class _ClientGone(Exception):
    pass


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _decode_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(raw):  # NOTE: only JSON escapes can smuggle in a lone one
        _check_surrogates(body)
    return body


def _check_surrogates(body: Any) -> None:
    """A lone UTF-16 surrogate ("\\ud800") is valid JSON but not Unicode text: it cannot be
    tokenized or even written back in an error message. A 400 naming where it is."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                name = f"{where}.{k}" if where else str(k)
                if not _is_utf8(k):
                    raise InvalidRequest(
                        "A field name holds a lone UTF-16 surrogate, which is not valid Unicode",
                        param=where or None,
                    )
                stack.append((v, name))
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(value))
        elif isinstance(value, str) and not _is_utf8(value):
            raise InvalidRequest(
                f"{where} holds a lone UTF-16 surrogate, which is not valid Unicode", param=where
            )


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def openapi_document() -> dict:
    models = [
        protocol.CompletionRequest,
        protocol.ChatCompletionRequest,
        protocol.TokenizeRequest,
        protocol.DetokenizeRequest,
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
            "/v1/completions": post(protocol.CompletionRequest, "Text completion"),
            "/v1/chat/completions": post(protocol.ChatCompletionRequest, "Chat completion"),
            "/tokenize": post(protocol.TokenizeRequest, "Tokenize a prompt or messages"),
            "/detokenize": post(protocol.DetokenizeRequest, "Detokenize token ids"),
            "/v1/models": get("The served model"),
            "/tokenizer_info": get("Tokenizer facts"),
            "/health": get("Liveness"),
            "/metrics": get("Prometheus metrics"),
            "/version": get("Version"),
            "/openapi.json": get("This document"),
        },
        "components": {"schemas": components},
    }


def create_app(
    engine,
    *,
    served_model_name: str = "SmolLM2-135M-Instruct",
    api_key: str | Sequence[str] | None = None,
    max_batch_prompts: int = 64,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_timeout_s: float | None = None,
    allowed_origins: Sequence[str] = (),
) -> Starlette:
    """The app over a started engine. The caller owns the engine's lifetime.

    api_key: one key or several (any of them is accepted); None or empty: no auth.
    request_timeout_s: the deadline of a generation request from arrival (None: none).
    allowed_origins: CORS origins ("*" for any); empty: no CORS headers at all."""
    metrics = Metrics(engine)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    h = _Handlers(
        engine,
        served_model_name=served_model_name,
        max_batch_prompts=max_batch_prompts,
        max_body_bytes=max_body_bytes,
        metrics=metrics,
        request_timeout_s=request_timeout_s,
    )
    routes = [
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/chat/completions", h.chat_completions, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/tokenize", h.tokenize, methods=["POST"]),
        Route("/detokenize", h.detokenize, methods=["POST"]),
        Route("/tokenizer_info", h.tokenizer_info, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/metrics", h.metrics_endpoint, methods=["GET"]),
        Route("/version", h.version, methods=["GET"]),
        Route("/openapi.json", h.openapi, methods=["GET"]),
    ]
    from freetoken.scaleout import scaleout_routes  # render endpoints, load reports

    routes += scaleout_routes(h)

    async def on_error(request: Request, exc: FreeTokenError) -> Response:
        metrics.errors.labels(exc.type).inc()
        return _error_response(exc)

    async def on_http(request: Request, exc: HTTPException) -> Response:
        kind = NotFound if exc.status_code == 404 else InvalidRequest
        err = kind(f"{request.method} {request.url.path}: {exc.detail}")
        return JSONResponse(
            err.to_body(), status_code=exc.status_code, headers=getattr(exc, "headers", None)
        )

    async def on_gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)

    app = Starlette(
        routes=routes,
        exception_handlers={FreeTokenError: on_error, HTTPException: on_http, _ClientGone: on_gone},
    )
    app.add_middleware(_Edge, api_keys=[k for k in keys if k], metrics=metrics)
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
    app.state.stop_requests = h.stop_requests  # for the CLI's shutdown past the grace
    return app
