"""Under KV pressure (issue 25), over real HTTP with the real SmolLM2 in process.

What these show: with a small KV pool full of long generations, a one-token request is answered
within a generous bound while they still run (under both admission policies); streams whose
clients read nothing are paused, then aborted by the send timeout, and every KV block is free
afterwards; /metrics shows it; a priority that is not an integer is a 400 naming the field.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import httpx
import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

pytestmark = pytest.mark.real_model

COMP = "/v1/completions"
SHORT_BOUND_S = 10.0  # generous: a one-token request takes well under a second here
POOL = dict(num_kv_blocks=48, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256)


def long_stream(url: str, i: int, results: list, stop: threading.Event) -> None:
    """A long streamed generation, read until it ends or `stop` is set (then disconnected)."""
    body = {"prompt": f"Story number {i}:", "max_tokens": 200, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.Client(base_url=url, timeout=120) as c, c.stream("POST", COMP, json=body) as r:
        for line in r.iter_lines():
            if stop.is_set():
                results.append("stopped")
                return
            if line == "data: [DONE]":
                results.append("done")
                return


@pytest.mark.parametrize("admission", ["projected", "greedy"])
def test_one_token_request_answered_while_long_generations_fill_the_pool(live, admission):
    s = live(engine=dict(POOL, admission=admission))
    stop, results = threading.Event(), []
    threads = [threading.Thread(target=long_stream, args=(s.url, i, results, stop))
               for i in range(8)]
    for t in threads:
        t.start()
    try:
        # the long ones hold the pool: as much as the projection lets them, or all of it
        s.wait_until(lambda st: st["kv_blocks_used"] >= 24, timeout_s=60)
        t0 = time.time()
        r = s.post(COMP, {"prompt": "Is this positive? Answer:", "max_tokens": 1})
        elapsed = time.time() - t0
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
        assert elapsed < SHORT_BOUND_S, elapsed
        st = s.stats()
        assert st["num_running"] + st["num_waiting"] >= 4, st  # the long ones still run
        assert "done" not in results
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    st = s.wait_idle(30)  # the disconnected streams were aborted: every block is free
    assert st["kv_blocks_used"] == 0
    assert st["queue_time"]["short"][0][-1] == ("+Inf", 1)
    if admission == "greedy":  # the pool ran out: growth preempted, the short one took room
        assert st["preemptions_by_cause"]["kv"] + st["preemptions_by_cause"]["short"] > 0


def unread_stream(port: int) -> socket.socket:
    """A streamed request whose client reads nothing (a small receive buffer fills fast)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"prompt": "Count: one, two,", "max_tokens": 240, "ignore_eos": True,
                       "stream": True, "logprobs": 20, "temperature": 0}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


@pytest.fixture
def small_buffers(loaded):
    """The app over a listener whose connections get a 32 KiB kernel send buffer (Linux copies
    it to accepted sockets): a client that reads nothing blocks the server's sends after ~120 KB
    rather than the megabytes an autotuned loopback buffer takes (docs/api.md, Under load)."""
    import uvicorn

    from freetoken.api import create_app
    from freetoken.config import EngineConfig
    from freetoken.engine import Engine

    engine = Engine(EngineConfig(**dict(POOL, max_num_seqs=4, max_queue_len=64)), loaded).start()
    app = create_app(engine, served_model_name="m", stream_max_unread=4,
                     stream_send_timeout_s=3)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32 << 10)
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield engine, listener.getsockname()[1]
    server.should_exit = True
    thread.join(10)
    engine.shutdown()
    listener.close()


def wait_until(engine, cond, timeout_s: float):
    deadline = time.time() + timeout_s
    while not cond(st := engine.stats()):
        assert time.time() < deadline, st
        time.sleep(0.02)
    return st


def test_unread_streams_pause_then_abort_and_free_every_block(small_buffers):
    engine, port = small_buffers
    url = f"http://127.0.0.1:{port}"
    socks = [unread_stream(port) for _ in range(3)]
    try:
        st = wait_until(engine, lambda st: st["num_paused"] == 3, 90)
        assert st["kv_blocks_used"] > 0 and st["finish_reasons"] == {}
        # paused: nothing is computed for them, and a normal request is served at once
        steps = st["steps_total"]
        r = httpx.post(url + COMP, json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200
        assert engine.stats()["steps_total"] - steps <= 6
        # then the send timeout aborts them: their KV comes back
        st = wait_until(engine, lambda st: st["num_running"] == st["kv_blocks_used"] == 0, 30)
        assert st["num_paused"] == 0 and st["finish_reasons"].get("abort", 0) == 3
    finally:
        for sock in socks:
            sock.close()
    text = httpx.get(url + "/metrics").text
    assert "freetoken_stream_send_timeouts_total 3.0" in text
    assert "freetoken_streams_paused 0.0" in text
    assert 'freetoken_queue_time_seconds_count{size="long"} 3.0' in text
    assert 'freetoken_preemptions_by_cause_total{cause="paused"}' in text


def test_priority_is_an_integer(live):
    s = live()
    ok = s.post(COMP, {"prompt": "Hi", "max_tokens": 1, "priority": -3})
    assert ok.status_code == 200
    for bad in ("high", 1.5, True):
        r = s.post(COMP, {"prompt": "Hi", "max_tokens": 1, "priority": bad})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "priority"
