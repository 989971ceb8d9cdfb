"""`python -m freetoken` start-up as a router sees it: /health is 503 (OpenAI error shape) while
the model loads, then 200 -- never a 200 before the engine can answer."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from freetoken.testing.process import ServerProcess

pytestmark = pytest.mark.real_model


def test_health_is_503_while_loading_then_200(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    server = ServerProcess(["--kv-cache-memory", "64MiB"], log_path=tmp_path / "server.log",
                           env=env).spawn()
    proc, url = server.proc, server.url
    seen = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.05)
                continue
            seen.append(r.status_code)
            if r.status_code == 503:
                err = r.json()["error"]
                assert err["type"] == "unavailable_error" and err["code"] == "loading"
                assert r.headers["Retry-After"] == "2"
                # every route is refused the same way, not half-served
                try:
                    c = httpx.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 1})
                    assert c.status_code in (503, 200)
                except httpx.TransportError:
                    pass  # the placeholder just closed; the real server binds next
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1] == 200, (seen[-5:], (tmp_path / "server.log").read_text()[-2000:])
        assert 503 in seen  # the model load takes seconds: the placeholder answered meanwhile
        assert set(seen) <= {503, 200}
        r = httpx.post(url + "/v1/completions", timeout=60,
                       json={"prompt": [1, 9690], "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2
    finally:
        server.stop()
