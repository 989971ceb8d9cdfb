"""SIGINT past the grace period (issue 7): a `python -m freetoken` subprocess with
`--shutdown-grace-s 2` and two long requests in flight stops accepting at once; when the grace is
over the requests still running are stopped with a documented error (503 `unavailable_error`,
in a stream an error event then [DONE]), not a cut connection; and the process exits 0.
(SIGTERM with requests that finish inside the grace is tests/system/test_load.py's last test, on
the soaked server.)
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from freetoken.testing import soak

pytestmark = pytest.mark.real_model



def test_sigint_cuts_requests_after_the_grace_and_exits_0(tmp_path):
    log = tmp_path / "server.log"
    server = soak.soak_server(log, ["--shutdown-grace-s", "2"])
    proc, url = server.proc, server.url
    body = {"prompt": "Count to a million:", "max_tokens": 480, "ignore_eos": True}

    async def long_stream(client):
        lines = []
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
        return lines

    async def long_request(client):
        return await client.post("/v1/completions", json=body)

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            tasks = [asyncio.ensure_future(long_stream(client)),
                     asyncio.ensure_future(long_request(client))]  # fmt: skip
            deadline = time.time() + 60
            while time.time() < deadline:
                m = soak.parse_metrics((await client.get("/metrics")).text)
                if m["freetoken_requests_running"] == 2:
                    break
                await asyncio.sleep(0.05)
            t0 = time.time()
            proc.send_signal(signal.SIGINT)
            return await asyncio.gather(*tasks), time.time() - t0

    try:
        (events, r), stopped_after = asyncio.run(run())
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert 1.5 < stopped_after < 15, stopped_after  # the grace, not the 480 tokens
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "unavailable_error"
    assert "--shutdown-grace-s" in r.json()["error"]["message"]
    assert events[-1] == "[DONE]", events[-3:]
    assert json.loads(events[-2])["error"]["type"] == "unavailable_error"
    text = log.read_text()
    assert "grace period over: stopped 2 engine requests" in text
    assert "Traceback" not in text and "timeout graceful shutdown exceeded" not in text
