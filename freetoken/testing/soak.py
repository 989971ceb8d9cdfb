"""Load / soak test of a FreeToken server: a seeded mix of classify, generation, chat, streaming,
invalid bodies and clients that disconnect, N requests with C in flight.

Every request must end in a complete answer or the documented error for what it sent; anything
else (a 5xx, a wrong status, a malformed body, a stream without [DONE], a transport error) is
counted as `unexpected`. While it runs, the server's RSS is sampled from /proc/PID/status.
Afterwards it waits for /metrics to show zero KV blocks in use and zero running / waiting
requests. Prints one JSON line (requests, outcomes by kind, p50/p99 latency, RSS, the metrics).

scripts/soak.py is its command line; tests/system/test_load.py runs it against a subprocess
server. What it is not: a benchmark (loadgen.py measures throughput on fixed workloads).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import time
from collections import Counter
from pathlib import Path

import httpx

from freetoken.testing.process import ServerProcess
from freetoken.testing.workloads import few_shot

MAX_MODEL_LEN = 512
MAX_BODY_BYTES = 1 << 20
# what soak_server passes; the invalid bodies below are built against these limits
SERVER_ARGS = [
    "--max-model-len", str(MAX_MODEL_LEN),
    "--kv-cache-memory", "64MiB",
    "--max-num-seqs", "32",
    "--max-num-batched-tokens", "512",
    "--max-body-bytes", str(MAX_BODY_BYTES),
    "--max-batch-prompts", "8",
    "--served-model-name", "soak",
    "--request-timeout", "120",
    "--log-level", "warning",
]  # fmt: skip

PREFIX = few_shot(2)
PRODUCTS = ["vacuum", "laptop stand", "rain coat", "desk lamp", "kettle", "phone case", "tent"]
VERDICTS = ["works perfectly", "broke on the first use", "feels cheap", "exceeded expectations"]
TOPICS = ["a dragon", "the ocean", "Mars", "a bicycle", "bees", "Rome", "magnets", "a forest"]

# (weight, kind)
MIX = [
    (30, "classify"),
    (15, "generate"),
    (10, "chat"),
    (15, "stream"),
    (18, "invalid"),
    (12, "disconnect"),
]


def _invalid_cases(vocab_size: int) -> list[tuple[str, object, int, str | None]]:
    """(name, body or raw bytes, expected status, expected param)."""
    big = "x" * (MAX_BODY_BYTES + 10)
    return [
        ("bad_json", b'{"prompt": "hi",', 400, None),
        ("not_object", b"[1, 2, 3]", 400, None),
        ("unknown_field", {"prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
        ("out_of_vocab", {"prompt": [1, vocab_size + 5]}, 400, "prompt[1]"),
        ("empty_ids", {"prompt": []}, 400, "prompt"),
        ("bool_id", {"prompt": [1, True]}, 400, "prompt[1]"),
        ("context", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        ("logprobs_cap", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
        ("n_zero", {"prompt": "hi", "n": 0}, 400, "n"),
        ("too_many_prompts", {"prompt": ["a"] * 9}, 400, "prompt"),
        ("stop_count", {"prompt": "hi", "stop": ["a"] * 33}, 400, "stop"),
        ("wrong_model", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
        ("unsupported", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
        ("nan", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
        ("too_large", json.dumps({"prompt": big}).encode(), 413, None),
        ("chat_no_messages", {"messages": []}, 400, "messages"),
    ]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def parse_metrics(text: str) -> dict[str, float]:
    """name{labels} -> value, for the lines of a Prometheus text scrape."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


class Soak:
    def __init__(self, url: str, *, pid: int | None, requests: int, concurrency: int, seed: int):
        self.url = url
        self.pid = pid
        self.num_requests = requests
        self.concurrency = concurrency
        self.rng = random.Random(seed)
        self.outcomes: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.latency: dict[str, list[float]] = {}
        self.rss_samples: list[tuple[float, int]] = []
        self.vocab_size = 49152

    # -- one request of each kind --------------------------------------------------------------
    def _fail(self, kind: str, why: str) -> None:
        self.outcomes[f"{kind}:UNEXPECTED"] += 1
        if len(self.unexpected) < 20:
            self.unexpected.append(f"{kind}: {why}"[:500])

    @staticmethod
    def _is_error_shape(body: object) -> bool:
        return (
            isinstance(body, dict)
            and set(body) == {"error"}
            and isinstance(body["error"], dict)
            and set(body["error"]) == {"message", "type", "param", "code"}
            and isinstance(body["error"]["message"], str)
        )

    async def _json_request(self, client, kind, path, body, check) -> None:
        r = await client.post(path, json=body)
        if r.status_code != 200:
            return self._fail(kind, f"status {r.status_code}: {r.text[:200]}")
        data = r.json()
        why = check(data)
        if why:
            return self._fail(kind, why)
        self.outcomes[f"{kind}:ok"] += 1

    async def classify(self, client, i: int) -> None:
        review = (
            f"Review: The {self.rng.choice(PRODUCTS)} I bought in week {i} "
            f"{self.rng.choice(VERDICTS)}.\nSentiment:"
        )
        body = {"prompt": PREFIX + review, "max_tokens": 1, "temperature": 0, "logprobs": 2}

        def check(d):
            c = d["choices"]
            if len(c) != 1 or c[0]["finish_reason"] not in ("length", "stop"):
                return f"choices {c}"
            lp = c[0]["logprobs"]
            if c[0]["finish_reason"] == "length" and (
                len(lp["tokens"]) != 1 or len(lp["top_logprobs"][0]) < 2
            ):
                return f"logprobs {lp}"
            return None

        await self._json_request(client, "classify", "/v1/completions", body, check)

    async def generate(self, client, i: int) -> None:
        mt = self.rng.randint(1, 6)
        n = self.rng.choice([1, 1, 1, 2])
        body = {
            "prompt": f"Write one sentence about {self.rng.choice(TOPICS)}.",
            "max_tokens": mt,
            "temperature": 0.8,
            "seed": i,
            "n": n,
        }

        def check(d):
            if len(d["choices"]) != n or d["usage"]["completion_tokens"] > mt * n:
                return f"choices/usage {d['usage']}"
            if any(c["finish_reason"] not in ("length", "stop") for c in d["choices"]):
                return f"finish {d['choices']}"
            return None

        await self._json_request(client, "generate", "/v1/completions", body, check)

    async def chat(self, client, i: int) -> None:
        body = {
            "messages": [{"role": "user", "content": f"Say hi to {self.rng.choice(TOPICS)}."}],
            "max_tokens": self.rng.randint(1, 5),
            "temperature": 0,
        }

        def check(d):
            c = d["choices"]
            if len(c) != 1 or not isinstance(c[0]["message"]["content"], str):
                return f"choices {c}"
            return None

        await self._json_request(client, "chat", "/v1/chat/completions", body, check)

    async def stream(self, client, i: int) -> None:
        chat = self.rng.random() < 0.4
        mt = self.rng.randint(1, 6)
        body = {"max_tokens": mt, "stream": True, "stream_options": {"include_usage": True}}
        if chat:
            body["messages"] = [{"role": "user", "content": f"Tell me about {TOPICS[i % 8]}."}]
            path = "/v1/chat/completions"
        else:
            body["prompt"] = f"Once upon a time, {TOPICS[i % 8]}"
            path = "/v1/completions"
        events, done = [], False
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return self._fail("stream", f"status {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                events.append(json.loads(line[6:]))
        if not done:
            return self._fail("stream", "no [DONE]")
        if any("error" in e for e in events):
            return self._fail("stream", f"error event {events}")
        if not events or events[-1].get("choices") != [] or "usage" not in events[-1]:
            return self._fail("stream", "no usage chunk")
        if events[-1]["usage"]["completion_tokens"] > mt:
            return self._fail("stream", "too many tokens")
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        if len(finishes) != 1:
            return self._fail("stream", f"finish reasons {finishes}")
        self.outcomes["stream:ok"] += 1

    async def invalid(self, client, i: int) -> None:
        name, body, status, param = self.rng.choice(_invalid_cases(self.vocab_size))
        path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = await client.post(path, json=body)
        try:
            data = r.json()
        except ValueError:
            return self._fail("invalid", f"{name}: not JSON: {r.text[:200]}")
        if r.status_code != status or not self._is_error_shape(data):
            return self._fail("invalid", f"{name}: {r.status_code} {r.text[:200]}")
        if param is not None and data["error"]["param"] != param:
            return self._fail("invalid", f"{name}: param {data['error']['param']!r} != {param!r}")
        self.outcomes[f"invalid:{status}"] += 1

    async def disconnect(self, client, i: int) -> None:
        body = {
            "prompt": f"Count slowly from one to a thousand about {TOPICS[i % 8]}:",
            "max_tokens": 64,
            "ignore_eos": True,
        }
        if self.rng.random() < 0.5:
            body["stream"] = True
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return self._fail("disconnect", f"status {r.status_code}")
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # leave after the first chunk
            self.outcomes["disconnect:mid_stream"] += 1
        else:
            task = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await asyncio.sleep(self.rng.uniform(0.01, 0.3))  # mid-queue, -prefill or -decode
            if task.done():
                r = task.result()
                if r.status_code != 200:
                    return self._fail("disconnect", f"status {r.status_code}")
                self.outcomes["disconnect:finished_first"] += 1
                return
            task.cancel()  # closes the connection: the server must abort the request
            try:
                await task
            except asyncio.CancelledError:
                pass
            self.outcomes["disconnect:mid_request"] += 1

    # -- the run ---------------------------------------------------------------------------------
    async def _one(self, client, i: int, kind: str) -> None:
        t0 = time.perf_counter()
        try:
            await getattr(self, kind)(client, i)
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
            self._fail(kind, f"{type(exc).__name__}: {exc}")
        self.latency.setdefault(kind, []).append(time.perf_counter() - t0)

    async def _sample_rss(self, stop: asyncio.Event) -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            if self.pid:
                self.rss_samples.append((time.perf_counter() - t0, rss_kib(self.pid)))
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass

    async def metrics(self, client) -> dict[str, float]:
        r = await client.get("/metrics")
        return parse_metrics(r.text)

    async def run(self) -> dict:
        weights = [w for w, _ in MIX]
        kinds = self.rng.choices([k for _, k in MIX], weights, k=self.num_requests)
        limits = httpx.Limits(max_connections=self.concurrency + 8, max_keepalive_connections=64)
        timeout = httpx.Timeout(120.0, connect=30.0)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as client:
            info = (await client.get("/tokenizer_info")).json()
            self.vocab_size = info["vocab_size"]
            rss_start = rss_kib(self.pid) if self.pid else 0
            stop = asyncio.Event()
            sampler = asyncio.ensure_future(self._sample_rss(stop))
            sem = asyncio.Semaphore(self.concurrency)
            t0 = time.perf_counter()

            async def bounded(i, kind):
                async with sem:
                    await self._one(client, i, kind)

            await asyncio.gather(*(bounded(i, k) for i, k in enumerate(kinds)))
            wall = time.perf_counter() - t0
            # the aborts of the last disconnects are one inbox message away: let them land
            deadline = time.perf_counter() + 30
            while True:
                m = await self.metrics(client)
                idle = (
                    m.get("freetoken_kv_blocks_used", -1) == 0
                    and m.get("freetoken_requests_running", -1) == 0
                    and m.get("freetoken_requests_waiting", -1) == 0
                )
                if idle or time.perf_counter() > deadline:
                    break
                await asyncio.sleep(0.2)
            settle = time.perf_counter() - t0 - wall
            stop.set()
            await sampler
        rss = [kib for _, kib in self.rss_samples]
        served = [x for k, v in self.latency.items() if k != "disconnect" for x in v]
        errors_by_type = {
            k.split('"')[1]: v
            for k, v in m.items()
            if k.startswith("freetoken_request_errors_total{")
        }
        http_5xx = sum(
            v for k, v in m.items() if re.search(r'freetoken_http_requests_total\{.*status="5', k)
        )
        return {
            "requests": self.num_requests,
            "concurrency": self.concurrency,
            "wall_s": round(wall, 2),
            "requests_per_s": round(self.num_requests / wall, 1),
            "outcomes": dict(sorted(self.outcomes.items())),
            "unexpected": sum(v for k, v in self.outcomes.items() if k.endswith("UNEXPECTED")),
            "unexpected_examples": self.unexpected,
            "p50_s": round(_percentile(served, 0.50), 3),
            "p99_s": round(_percentile(served, 0.99), 3),
            "p99_s_by_kind": {k: round(_percentile(v, 0.99), 3) for k, v in self.latency.items()},
            "rss_mib": {
                "start": round(rss_start / 1024, 1),
                "peak": round(max(rss, default=0) / 1024, 1),
                "end": round((rss[-1] if rss else 0) / 1024, 1),
                # growth over the second half of the run: a leak shows here, warm-up does not
                "second_half_growth": round(
                    (max(rss[len(rss) // 2 :], default=0) - (rss[len(rss) // 2] if rss else 0))
                    / 1024,
                    1,
                ),
            },
            "settle_s": round(settle, 2),
            "after": {
                "kv_blocks_used": m.get("freetoken_kv_blocks_used"),
                "requests_running": m.get("freetoken_requests_running"),
                "requests_waiting": m.get("freetoken_requests_waiting"),
                "engine_step_errors": m.get("freetoken_engine_step_errors_total"),
                "http_5xx": http_5xx,
                "errors_by_type": errors_by_type,
            },
        }


# -- a server to soak ----------------------------------------------------------------------------
def soak_server(log_path: Path, extra_args=(), timeout_s: float = 240) -> ServerProcess:
    """`python -m freetoken` on a free loopback port with SERVER_ARGS, started (/health is 200)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    server = ServerProcess([*SERVER_ARGS, *extra_args], log_path=log_path, env=env)
    return server.start(timeout_s)
