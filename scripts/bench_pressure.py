#!/usr/bin/env python3
"""KV-pressure benchmark (issue 25): long greedy generations (`ignore_eos`) from C clients, each
sending its next one as soon as the last ends, against a fresh `python -m freetoken` server.

  * lower concurrencies (--levels), then saturation (--clients, 100), each with a classify
    request (`max_tokens: 1`) every --classify-every seconds beside the long load: generation
    tokens/s and the classify p50 / p99 latency of each phase. The classify stream runs in every
    phase, so the tokens/s of two phases differ by their concurrency only.

Each phase warms up (--warmup s) and then measures (--window s); tokens/s is the server's own
`vllm:generation_tokens` counter over the window. Between phases the clients disconnect (their
requests are aborted) and the server is left to empty. Prints progress to stderr and one JSON
line: per phase tok/s, the classify percentiles, preemptions by cause, and the two targets
(classify p99 < 2 s; saturation tok/s >= 0.8x the best lower level).

    python scripts/bench_pressure.py                           # the issue's load: 100 x 2,000
    python scripts/bench_pressure.py --max-tokens 400 --server-args="--num-kv-blocks 139"
    python scripts/bench_pressure.py --server-args="--admission greedy"   # vLLM's admission
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import sys
import tempfile
import time

import httpx

from freetoken.testing.loadgen import percentile
from freetoken.testing.process import ServerProcess


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def scrape(url: str) -> dict[str, float]:
    """The /metrics series this benchmark reads, by name (labels kept in the name)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm:generation_tokens_total|freetoken_preemptions_by_cause_total'
                     r'|freetoken_requests_running|freetoken_requests_waiting'
                     r'|freetoken_kv_blocks_used)(\{[^}]*\})? (\S+)$', line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def gen_tokens(m: dict) -> float:
    return next(v for k, v in m.items() if k.startswith("vllm:generation_tokens_total"))


async def long_client(session, url: str, rng: random.Random, max_tokens: int) -> None:
    while True:
        body = {"prompt": f"Tell story {rng.randrange(10**9)} of a lighthouse.",
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        async with session.post(url + "/v1/completions", json=body) as r:
            await r.read()


async def classify_loop(session, url: str, every: float, lat: list[float], errors: list[str],
                        inflight: dict, rng: random.Random) -> None:
    """A classify request every `every` s; latencies into `lat`, starts of the unanswered ones
    in `inflight` (counted at the end of the window with the time they had waited)."""
    async def one(k: int):
        body = {"prompt": f"Review {rng.randrange(10**6)}: the food was cold. Sentiment:",
                "max_tokens": 1, "temperature": 0}
        inflight[k] = time.perf_counter()
        try:
            async with session.post(url + "/v1/completions", json=body) as r:
                await r.read()
                if r.status == 200:
                    lat.append(time.perf_counter() - inflight[k])
                else:
                    errors.append(f"HTTP {r.status}")
        except Exception as exc:  # noqa: BLE001 - counted, not fatal
            errors.append(type(exc).__name__)
        finally:
            inflight.pop(k, None)

    tasks = []
    for k in range(10**9):
        tasks.append(asyncio.ensure_future(one(k)))
        await asyncio.sleep(every)


async def phase(url: str, clients: int, args) -> dict:
    import aiohttp

    rng = random.Random(clients)
    lat: list[float] = []
    errors: list[str] = []
    inflight: dict[int, float] = {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = [asyncio.ensure_future(long_client(session, url, rng, args.max_tokens))
                 for _ in range(clients)]
        await asyncio.sleep(args.warmup)
        m0, t0 = scrape(url), time.perf_counter()
        tasks.append(asyncio.ensure_future(
            classify_loop(session, url, args.classify_every, lat, errors, inflight, rng)))
        for k in range(int(args.window // 10)):
            await asyncio.sleep(10)
            m = scrape(url)
            rate = (gen_tokens(m) - gen_tokens(m0)) / (time.perf_counter() - t0)
            log(f"  c={clients}: {10 * (k + 1)}s  {rate:.1f} tok/s  running "
                f"{m['freetoken_requests_running']:.0f} waiting "
                f"{m['freetoken_requests_waiting']:.0f} kv {m['freetoken_kv_blocks_used']:.0f}"
                f"  classify {len(lat)} p99 {percentile(lat, 99):.2f}s")
        m1, t1 = scrape(url), time.perf_counter()
        unanswered = [t1 - start for start in inflight.values()]
        num_errors = len(errors)  # in the window (the ones cut off below are not counted)
        lat += unanswered  # a request still waiting counts with the time it has waited
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    out = {"clients": clients, "tok_s": round((gen_tokens(m1) - gen_tokens(m0)) / (t1 - t0), 1),
           "preemptions": {re.search(r'cause="(\w+)"', k).group(1): v - m0.get(k, 0)
                           for k, v in m1.items() if "cause=" in k}}
    out.update(classify_n=len(lat), classify_unanswered=len(unanswered),
               classify_errors=num_errors, classify_p50_s=round(percentile(lat, 50), 3),
               classify_p99_s=round(percentile(lat, 99), 3),
               classify_max_s=round(max(lat, default=float("nan")), 3))
    return out


def wait_idle(url: str, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        m = scrape(url)
        if m["freetoken_requests_running"] == m["freetoken_requests_waiting"] == 0:
            return
        time.sleep(0.5)
    raise RuntimeError("the server did not empty after the clients left")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=100, help="long clients at saturation")
    ap.add_argument("--levels", default="1,4,16,32", help="lower concurrencies, comma list")
    ap.add_argument("--max-tokens", type=int, default=2000)
    ap.add_argument("--classify-every", type=float, default=0.1, help="seconds")
    ap.add_argument("--warmup", type=float, default=60.0, help="seconds before each window")
    ap.add_argument("--window", type=float, default=120.0, help="seconds measured per phase")
    ap.add_argument("--server-args", default="", help="extra `python -m freetoken` flags")
    ap.add_argument("--url", help="an already running server instead of a fresh one")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp:
        srv = None
        if args.url is None:
            srv = ServerProcess(shlex.split(args.server_args), log_path=f"{tmp}/server.log")
            srv.start()
            log(f"server up in {srv.ready_s:.1f}s: {srv.url} {args.server_args}")
        url = args.url or srv.url
        try:
            lower = []
            for c in levels:
                log(f"phase: {c} clients x {args.max_tokens} tokens, classify every "
                    f"{args.classify_every}s")
                lower.append(asyncio.run(phase(url, c, args)))
                wait_idle(url)
            log(f"phase: saturation, {args.clients} clients")
            sat = asyncio.run(phase(url, args.clients, args))
        finally:
            if srv is not None:
                srv.stop()
    best = max((p["tok_s"] for p in lower), default=float("nan"))
    result = {"max_tokens": args.max_tokens, "server_args": args.server_args, "lower": lower,
              "saturation": sat, "best_lower_tok_s": best,
              "saturation_vs_best": round(sat["tok_s"] / best, 3) if best else None,
              "classify_p99_under_2s": sat.get("classify_p99_s", 99) < 2.0,
              "tok_s_at_least_0.8x": sat["tok_s"] >= 0.8 * best}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
