"""The two generation routes, /v1/completions and /v1/chat/completions: one HTTP request becomes
prompts x n engine requests (one ChoiceJob each), submitted up front, then collected into one
JSON response or streamed as SSE chunks.

Reliability (docs/reliability.md): every request is watched for its deadline
(`--request-timeout`) and for the engine loop's death, and its engine requests are aborted -- their
KV freed -- when it times out, fails, its client leaves, or the server stops past its grace.
Backpressure (docs/api.md, "Under load"): a stream whose client stops reading pauses its engine
requests once `--stream-max-unread` chunks wait unsent, and is aborted when one chunk waits longer
than `--stream-send-timeout`.

What it is not: validation (protocol.py), the response shapes (responses.py), the body limits
(body.py) or error rendering (middleware.py); an error after a stream started is the one thing
rendered here, as an SSE event, since the status line is already sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import traceback
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from freetoken.api.body import BodyReader, decode_json
from freetoken.api.engine_client import EngineClient
from freetoken.api.metrics import Metrics
from freetoken.api.middleware import ClientGone, access_log
from freetoken.config import ServerConfig
from freetoken.errors import (
    EngineDead,
    FreeTokenError,
    InvalidRequest,
    RequestTimeout,
    ServerError,
)
from freetoken.protocol import responses
from freetoken.protocol.parse import ParsedRequest

if TYPE_CHECKING:
    from freetoken.sequence import RequestOutput

# NOTE: the logger keeps the name the server's log lines have always had (docs/api.md).
logger = logging.getLogger("freetoken.server")

# Bodies larger than this are decoded and validated on a worker thread, so one big request does
# not stall the event loop (every other request's I/O, and the 503s of a full queue).
OFF_LOOP_BYTES = 64 * 1024
WATCH_INTERVAL_S = 0.25  # how often an in-flight request checks its deadline and the engine


@dataclass(slots=True)
class ChoiceJob:
    """One choice of a response: sample j of prompt i, served by one engine request."""

    index: int  # the choice's index in the response: i * n + j
    request_id: str  # the engine request's id: "<response id>-<index>"
    stream: AsyncIterator[RequestOutput]
    state: responses.ChoiceState  # ChatChoiceState for chat: turns deltas into fragments


class Generation:
    """The generation routes over one engine, and the engine requests they hold."""

    def __init__(
        self,
        engine: EngineClient,
        reader: BodyReader,
        *,
        metrics: Metrics,
        request_timeout_s: float | None = None,
        stream_max_unread: int = ServerConfig.stream_max_unread,
        stream_send_timeout_s: float | None = ServerConfig.stream_send_timeout_s,
    ):
        self.engine = engine
        self.reader = reader
        self.model_name = reader.served_model_name
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s or None
        self.stream_max_unread = stream_max_unread
        self.stream_send_timeout_s = stream_send_timeout_s or None
        # engine requests one HTTP request may hold (prompts x n): more could never be queued
        self.max_queue_len = engine.config.max_queue_len
        self.inflight: set[str] = set()  # engine request ids of the requests being served
        self.stopping = False  # stop_requests() was called: the server is going down

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    def stop_requests(self) -> int:
        """Shutdown past its grace: abort every request in flight. Each then ends with a 503
        (or a stream's error event) rather than being cut off mid-response."""
        self.stopping = True
        erids = list(self.inflight)
        for erid in erids:
            self.engine.abort(erid)
        return len(erids)

    # ---- submit ------------------------------------------------------------------------------

    def _parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        parsed = self.reader.parse_generation(decode_json(raw), chat)
        num_jobs = len(parsed.prompts) * parsed.n
        if num_jobs > self.max_queue_len:
            raise InvalidRequest(
                f"This request needs {num_jobs} sequences (prompts x n), more than the server's "
                f"queue holds ({self.max_queue_len}, --max-queue-len)",
                param="n",
            )
        return parsed

    def _start(self, parsed: ParsedRequest, rid: str, chat: bool) -> list[ChoiceJob]:
        """Submit prompts x n engine requests up front, so a refusal is still an HTTP error."""
        jobs: list[ChoiceJob] = []
        state_cls = responses.ChatChoiceState if chat else responses.ChoiceState
        tok = self.reader.tokenizer
        try:
            for i, prompt in enumerate(parsed.prompts):
                for j in range(parsed.n):
                    index = i * parsed.n + j
                    erid = f"{rid}-{index}"
                    stream = self.engine.submit(
                        prompt.ids, parsed.choice_params(j), request_id=erid
                    )
                    self.inflight.add(erid)
                    jobs.append(ChoiceJob(index, erid, stream, state_cls(tok, parsed, prompt)))
        except BaseException:
            for job in jobs:
                self.engine.abort(job.request_id)
                self.inflight.discard(job.request_id)
            raise
        return jobs

    async def _generate(self, request: Request, chat: bool) -> Response:
        t0 = time.perf_counter()
        rid = ("chatcmpl-" if chat else "cmpl-") + access_log(request)["id"]
        raw = await self.reader.read(request)
        if len(raw) > OFF_LOOP_BYTES:
            parsed = await asyncio.to_thread(self._parse, raw, chat)
        else:
            parsed = self._parse(raw, chat)
        jobs = self._start(parsed, rid, chat)
        if parsed.stream:
            unfinished = {job.request_id for job in jobs}
            # NOTE: a client gone before the body starts never runs the generator's `finally`;
            # the background task (run by starlette after a disconnect too) aborts for it.
            return _TimedStream(
                self._stream(request, parsed, rid, jobs, chat, t0, unfinished),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(self._finish_stream, unfinished, jobs),
                send_timeout_s=self.stream_send_timeout_s,
                on_timeout=lambda: self._send_timed_out(rid, unfinished, jobs),
            )
        return await self._collect(request, parsed, rid, jobs, chat, t0)

    # ---- while it runs -----------------------------------------------------------------------

    async def watch(self, t0: float) -> FreeTokenError:
        """Returns (never raises) the error that ends a request: its deadline passed, or the
        engine loop died (its streams would never finish). Runs until cancelled otherwise."""
        deadline = t0 + self.request_timeout_s if self.request_timeout_s else None
        while True:
            if not self.engine.is_alive():
                return EngineDead("The engine loop stopped before this request finished.")
            delay = WATCH_INTERVAL_S
            if deadline is not None:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return RequestTimeout(self.request_timeout_s)
                delay = min(delay, left)
            await asyncio.sleep(delay)

    async def await_work(self, request: Request, work: asyncio.Future, t0: float,
                         abort) -> Any:
        """`work`'s result, unless the deadline passes, the engine loop dies or the client leaves
        first: then `work` is cancelled, `abort()` frees its engine requests, and the error
        (RequestTimeout, EngineDead, ClientGone) is raised."""
        gone = asyncio.ensure_future(_wait_disconnect(request))
        watch = asyncio.ensure_future(self.watch(t0))
        try:
            done, _ = await asyncio.wait({work, gone, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            if watch in done:
                raise watch.result()
            raise ClientGone()
        except BaseException:
            work.cancel()
            work.add_done_callback(_retrieve)  # no "exception was never retrieved" log
            abort()
            raise
        finally:
            gone.cancel()
            watch.cancel()

    def check_output(self, out: RequestOutput) -> None:
        if out.finish_reason == "error" or out.error:
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

    def _usage(self, parsed: ParsedRequest, jobs: list[ChoiceJob]) -> dict:
        n = parsed.n
        prompt_tokens = sum(len(p.ids) for p in parsed.prompts)
        cached = sum(jobs[i * n].state.num_cached_tokens for i in range(len(parsed.prompts)))
        output = sum(job.state.num_output_tokens for job in jobs)
        return responses.usage_dict(prompt_tokens, output, cached)

    def _account(self, request: Request, usage: dict, jobs: list[ChoiceJob], t0: float) -> None:
        info = access_log(request)
        info["prompt_tokens"] = usage["prompt_tokens"]
        info["cached_tokens"] = usage["prompt_tokens_details"]["cached_tokens"]
        info["output_tokens"] = usage["completion_tokens"]
        m = self.metrics
        m.prompt_tokens.inc(usage["prompt_tokens"])
        m.generation_tokens.inc(usage["completion_tokens"])
        m.cached_tokens.inc(info["cached_tokens"])
        m.e2e.observe(time.perf_counter() - t0)
        for job in jobs:
            m.success.labels(job.state.finish_reason or "unknown").inc()

    # ---- collect -----------------------------------------------------------------------------

    async def _collect(self, request, parsed, rid, jobs: list[ChoiceJob], chat, t0) -> Response:
        first = [True]

        async def run(job: ChoiceJob):
            frags = []
            async for out in job.stream:
                self.check_output(out)
                if first[0]:
                    first[0] = False
                    self.metrics.ttft.observe(time.perf_counter() - t0)
                frags.append(job.state.feed(out))
            return responses.merge_fragments(frags)

        def abort():
            for job in jobs:
                self.engine.abort(job.request_id)

        work = asyncio.gather(*(run(job) for job in jobs))
        try:
            merged = await self.await_work(request, work, t0, abort)
        finally:
            self.inflight.difference_update(job.request_id for job in jobs)
        usage = self._usage(parsed, jobs)
        self._account(request, usage, jobs, t0)
        model = self.model_name
        if chat:
            choices = [responses.chat_choice(job.index, f) for job, f in zip(jobs, merged)]
            return JSONResponse(responses.chat_response(rid, model, choices, usage))
        choices = [responses.completion_choice(job.index, f) for job, f in zip(jobs, merged)]
        return JSONResponse(responses.completion_response(rid, model, choices, usage))

    # ---- stream ------------------------------------------------------------------------------

    def _send_timed_out(self, rid: str, unfinished: set[str], jobs: list[ChoiceJob]) -> None:
        logger.warning("%s: the client read nothing for %gs (--stream-send-timeout): aborted",
                       rid, self.stream_send_timeout_s)
        self.metrics.send_timeouts.inc()
        self._finish_stream(unfinished, jobs)

    def _finish_stream(self, unfinished: set[str], jobs: list[ChoiceJob]) -> None:
        for erid in list(unfinished):
            self.engine.abort(erid)
        unfinished.clear()
        self.inflight.difference_update(job.request_id for job in jobs)

    async def _stream(self, request, parsed, rid, jobs: list[ChoiceJob], chat, t0, unfinished):
        created = int(time.time())
        model = self.model_name
        queue: asyncio.Queue = asyncio.Queue()
        # backpressure: a choice's chunks waiting in `queue`; past the bound its engine request
        # is paused until the client has read half of them
        unread = dict.fromkeys((job.index for job in jobs), 0)
        paused: set[int] = set()
        erids = {job.index: job.request_id for job in jobs}

        async def pump(job: ChoiceJob):
            try:
                async for out in job.stream:
                    self.check_output(out)
                    await queue.put((job.index, job.state.feed(out), None))
                    unread[job.index] += 1
                    if out.finished:
                        unfinished.discard(job.request_id)
                    elif unread[job.index] >= self.stream_max_unread and job.index not in paused:
                        paused.add(job.index)
                        self.engine.pause(job.request_id, True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 -- forwarded to the SSE loop
                await queue.put((job.index, None, exc))
                return
            await queue.put((job.index, None, None))

        async def watch():
            await queue.put((None, None, await self.watch(t0)))

        tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
        tasks.append(asyncio.ensure_future(watch()))
        first_chunk = {job.index: True for job in jobs}
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
                unread[index] -= 1
                if index in paused and unread[index] <= self.stream_max_unread // 2:
                    paused.discard(index)
                    self.engine.pause(erids[index], False)
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
            self._account(request, usage, jobs, t0)
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


class _TimedStream(StreamingResponse):
    """A StreamingResponse whose every send may wait at most `send_timeout_s` for the client to
    read (None: forever). Past it, `on_timeout()` aborts the engine requests and the connection
    is closed, so a client that stopped reading holds neither KV nor a task."""

    def __init__(self, content, *, send_timeout_s: float | None, on_timeout, **kw):
        super().__init__(content, **kw)
        self.send_timeout_s = send_timeout_s
        self.on_timeout = on_timeout

    async def stream_response(self, send) -> None:
        if self.send_timeout_s is None:
            return await super().stream_response(send)
        # NOTE: one timer a stream, re-armed when it fires, rather than a wait_for a send: before
        # Python 3.12 wait_for runs each send as a new task, two more turns of the event loop a
        # chunk, which cost a single stream 4 % of its tokens/s (docs/benchmarks.md, stop 47).
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        timeout = self.send_timeout_s
        sending_since: float | None = None  # loop time the send in progress began
        timed_out = False

        def check() -> None:
            nonlocal timer, timed_out
            now = loop.time()
            if sending_since is not None and now - sending_since >= timeout:
                timed_out = True
                task.cancel()  # the task waits in that send: it raises CancelledError there
            else:
                timer = loop.call_at((now if sending_since is None else sending_since) + timeout,
                                     check)

        async def timed_send(message) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            try:
                await send(message)
            except asyncio.CancelledError:
                if not timed_out:
                    raise
                if hasattr(task, "uncancel"):  # Python >= 3.11: the cancel was ours, not a caller's
                    task.uncancel()
                self.on_timeout()
                await self.body_iterator.aclose()
                raise ClientDisconnect() from None
            finally:
                sending_since = None

        timer = loop.call_later(timeout, check)
        try:
            await super().stream_response(timed_send)
        finally:
            timer.cancel()


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
