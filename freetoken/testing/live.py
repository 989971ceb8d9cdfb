"""The server in process, over real HTTP: one Engine over an already loaded model, its app, and
uvicorn in a daemon thread on a free loopback port, with an httpx client bound to it.

For tests that need the engine's own state next to the HTTP answers (stats, the KV blocks in use)
and share one loaded model between several engines. What it is not: `python -m freetoken` as a
user starts it (process.py starts that), nor a way to serve (no signals, no access log).
"""

from __future__ import annotations

import threading
import time

import httpx

from freetoken.cluster import free_port

# A small engine that still batches: the default for tests that do not say otherwise.
SMALL_ENGINE = dict(
    max_model_len=256, kv_cache_memory=24 << 20, max_num_seqs=8, max_num_batched_tokens=256,
    max_queue_len=64,
)  # fmt: skip


class LiveServer:
    """One Engine + app + uvicorn thread on 127.0.0.1.

    `engine` is an EngineConfig, or a dict of fields over SMALL_ENGINE; `app_kw` go to
    create_app (served_model_name defaults to "m"). close() stops uvicorn and the engine."""

    def __init__(self, loaded, engine=None, *, start_timeout_s: float = 30,
                 http_timeout_s: float = 60, **app_kw):
        import uvicorn

        from freetoken.api import create_app
        from freetoken.config import EngineConfig
        from freetoken.engine import Engine

        if not isinstance(engine, EngineConfig):
            engine = EngineConfig(**{**SMALL_ENGINE, **(engine or {})})
        self.engine = Engine(engine, loaded).start()
        app_kw.setdefault("served_model_name", "m")
        self.model = app_kw["served_model_name"]
        self.app = create_app(self.engine, **app_kw)
        port = free_port()
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning",
                           access_log=False)
        )  # fmt: skip
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.time() + start_timeout_s
        while not self.uvicorn.started:
            assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=http_timeout_s)

    def post(self, path: str, body, **kw) -> httpx.Response:
        return self.http.post(path, json=body, **kw)

    def complete(self, body: dict) -> dict:
        """POST /v1/completions for the served model; the 200 answer's JSON."""
        r = self.post("/v1/completions", {"model": self.model, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict:
        return self.engine.stats()

    def wait_idle(self, timeout_s: float = 20) -> dict:
        """Wait until nothing runs, waits or holds a KV block; the engine's stats then."""
        return self.wait_until(
            lambda s: s["num_running"] == s["num_waiting"] == s["kv_blocks_used"] == 0,
            timeout_s, poll_s=0.02)

    def wait_until(self, cond, timeout_s: float = 30, poll_s: float = 0.01) -> dict:
        deadline = time.time() + timeout_s
        while True:
            s = self.stats()
            if cond(s):
                return s
            assert time.time() < deadline, s
            time.sleep(poll_s)

    def close(self) -> None:
        self.http.close()
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.engine.shutdown()
