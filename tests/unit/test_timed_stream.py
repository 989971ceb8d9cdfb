"""The stream's send timeout (api/generation.py, _TimedStream) on its own, without a server.

What these show: a client that keeps reading is never cut, however long the stream lasts past
the timeout (the one timer re-arms); a send that waits past the timeout ends the stream with
ClientDisconnect, calls on_timeout once, closes the body and leaves the task uncancelled.
"""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from starlette.requests import ClientDisconnect

from freetoken.api.generation import _TimedStream

TIMEOUT_S = 0.1


def make_stream(chunks: int, gap_s: float, closed: list):
    async def body():
        try:
            for i in range(chunks):
                await asyncio.sleep(gap_s)
                yield f"chunk {i}\n".encode()
        finally:
            closed.append(True)

    timeouts = []
    stream = _TimedStream(body(), media_type="text/event-stream", send_timeout_s=TIMEOUT_S,
                          on_timeout=lambda: timeouts.append(time.monotonic()))
    return stream, timeouts


def test_a_reading_client_is_never_cut_however_long_the_stream():
    closed, sent = [], []
    stream, timeouts = make_stream(chunks=12, gap_s=0.03, closed=closed)  # ~0.36 s: > 3 timeouts

    async def send(message):
        sent.append(message)

    t0 = time.monotonic()
    asyncio.run(stream.stream_response(send))
    assert time.monotonic() - t0 > 3 * TIMEOUT_S
    assert timeouts == []
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 13 and bodies[-1]["more_body"] is False
    assert closed == [True]


def test_a_send_stuck_past_the_timeout_ends_the_stream_once():
    closed, sent = [], []
    stream, timeouts = make_stream(chunks=50, gap_s=0.01, closed=closed)

    async def send(message):
        sent.append(message)
        if len(sent) == 4:  # the client stops reading: this send never completes
            await asyncio.Event().wait()

    async def run():
        t0 = time.monotonic()
        with pytest.raises(ClientDisconnect):
            await stream.stream_response(send)
        task = asyncio.current_task()
        if sys.version_info >= (3, 11):
            assert task.cancelling() == 0  # the timeout's own cancel was taken back
        await asyncio.sleep(0.01)  # and the task can go on awaiting
        return time.monotonic() - t0, timeouts[0] - t0

    elapsed, fired = asyncio.run(run())
    assert len(timeouts) == 1
    assert TIMEOUT_S <= fired < TIMEOUT_S + 0.5  # the stuck send began ~0.03 s in
    assert elapsed < TIMEOUT_S + 0.5
    assert len(sent) == 4 and closed == [True]


def test_no_timeout_means_wait_forever_and_no_timer():
    sent = []

    async def body():
        yield b"a"

    stream = _TimedStream(body(), send_timeout_s=None, on_timeout=lambda: pytest.fail("timed out"))

    async def send(message):
        sent.append(message)

    asyncio.run(stream.stream_response(send))
    assert [m.get("body") for m in sent[1:]] == [b"a", b""]
