"""HTTP load generator for OpenAI-compatible servers (FreeToken, llama.cpp's llama-server, ...):
sends a workload (workloads.py) with N requests in flight and summarizes the run: requests/s,
output tokens/s, p50/p99 latency, time to first token (streamed where it matters), the load
average before the run, and the server's cached-token share where it reports one.

What it is not: a server harness (process.py starts one) or the command line
(scripts/bench_serve.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

from freetoken.testing.workloads import WORKLOADS, Req, build_workload, payload, warmup_requests

# ---------------------------------------------------------------------------------------------
# Stats
# ---------------------------------------------------------------------------------------------

def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); nan for an empty list."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Result:
    ok: bool
    latency: float = 0.0
    ttft: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text: str = ""
    top: dict | None = None  # classify: top_logprobs of the one generated token
    error: str = ""
    chunk_times: list[float] = field(default_factory=list)


def summarize(results: list[Result], wall: float) -> dict:
    """Throughput and latency numbers of one run (seconds and per-second rates)."""
    ok = [r for r in results if r.ok]
    lat = [r.latency for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    out_tok = sum(r.output_tokens for r in ok)
    # time per output token after the first (streamed decode only)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.output_tokens > 1]
    pt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    ct = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    wall = max(wall, 1e-9)
    s = {
        "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
        "wall_s": round(wall, 4),
        "requests_per_s": len(ok) / wall,
        "output_tokens": out_tok, "output_tokens_per_s": out_tok / wall,
        "latency_p50_s": percentile(lat, 50), "latency_p99_s": percentile(lat, 99),
        "latency_mean_s": (sum(lat) / len(lat)) if lat else float("nan"),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
    }
    if pt:
        s["prompt_tokens_mean"] = sum(pt) / len(pt)
    if pt and ct and len(ct) == len(pt) and sum(pt):
        s["cached_tokens_frac"] = sum(ct) / sum(pt)
    return s


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------

def _usage_fields(obj: dict, res: Result, flavor: str) -> None:
    u = obj.get("usage") or {}
    if u.get("completion_tokens") is not None:
        res.output_tokens = int(u["completion_tokens"])
    if u.get("prompt_tokens") is not None:
        res.prompt_tokens = int(u["prompt_tokens"])
    det = u.get("prompt_tokens_details") or {}
    if det.get("cached_tokens") is not None:
        res.cached_tokens = int(det["cached_tokens"])
    tim = obj.get("timings") or {}  # llama-server: prompt_n = tokens it actually computed
    if (flavor == "llama-server" and res.cached_tokens is None and "prompt_n" in tim
            and res.prompt_tokens is not None):
        res.cached_tokens = max(0, res.prompt_tokens - int(tim["prompt_n"]))


def _top_of(choice: dict) -> dict | None:
    lp = choice.get("logprobs")
    if not lp:
        return None
    if isinstance(lp, dict) and lp.get("top_logprobs"):
        return lp["top_logprobs"][0]
    if isinstance(lp, dict) and lp.get("content"):  # chat-shaped logprobs
        c = lp["content"][0]
        return {t["token"]: t["logprob"] for t in c.get("top_logprobs", [])}
    return None


async def one_request(session, url: str, body: dict, flavor: str) -> Result:
    t0 = time.perf_counter()
    res = Result(ok=False)
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                res.latency = time.perf_counter() - t0
                return res
            if not body.get("stream"):
                obj = json.loads(await r.read())
                res.latency = time.perf_counter() - t0
                ch = obj["choices"][0]
                res.text = ch.get("text", "")
                res.top = _top_of(ch)
                res.ttft = res.latency  # non-streamed: the first token arrives with the response
                _usage_fields(obj, res, flavor)
                if not res.output_tokens:
                    res.output_tokens = req_tokens_fallback(body)
                res.ok = True
                return res
            n_chunks = 0
            async for raw in r.content:  # one SSE line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:200]
                    res.latency = time.perf_counter() - t0
                    return res
                for ch in obj.get("choices") or []:
                    txt = ch.get("text") or ""
                    if txt or ch.get("logprobs"):
                        now = time.perf_counter() - t0
                        if res.ttft is None:
                            res.ttft = now
                        res.chunk_times.append(now)
                        n_chunks += 1
                        res.text += txt
                if obj.get("usage") or obj.get("timings"):
                    _usage_fields(obj, res, flavor)
        res.latency = time.perf_counter() - t0
        if not res.output_tokens:
            res.output_tokens = n_chunks  # one token per chunk when the server reports no usage
        res.ok = True
        return res
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.latency = time.perf_counter() - t0
        res.error = f"{type(e).__name__}: {e}"[:200]
        return res


def req_tokens_fallback(body: dict) -> int:
    return int(body.get("max_tokens") or 0)


def progress(msg: str, quiet: bool = False) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


async def run_load(url: str, reqs: list[Req], concurrency: int, flavor: str = "openai",
                   model: str | None = None, stream: bool = False, label: str = "",
                   quiet: bool = False, timeout: float = 600.0,
                   warmup: list[Req] | None = None) -> tuple[list[Result], float]:
    """Send `reqs` with at most `concurrency` in flight; returns (results in order, wall s).

    NOTE: aiohttp, not httpx: the load generator shares the 2 cores with the server it measures,
    and httpx's async client spent ~1 ms of CPU a classify request (0.20 s per 200), aiohttp
    0.04 s, on the critical path between a step's answers and the next step's requests."""
    import aiohttp

    endpoint = url.rstrip("/") + "/v1/completions"
    # NOTE: llama-server closes the connection after a streamed response (while announcing
    # keep-alive), and aiohttp would reuse it for the next request and fail to write its body;
    # streamed requests (decode: a few long requests) each get their own connection.
    connector = aiohttp.TCPConnector(limit=concurrency + 2, force_close=stream)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as client:
        for w in warmup or []:
            wr = await one_request(client, endpoint, payload(w, flavor, model, stream), flavor)
            if not wr.ok:
                raise RuntimeError(f"warm-up request failed: {wr.error}")
        results: list[Result | None] = [None] * len(reqs)
        nxt = iter(range(len(reqs)))
        done = [0]
        step = max(1, len(reqs) // 10)
        t0 = time.perf_counter()

        async def worker():
            for i in nxt:
                results[i] = await one_request(
                    client, endpoint, payload(reqs[i], flavor, model, stream), flavor)
                done[0] += 1
                if done[0] % step == 0 or done[0] == len(reqs):
                    el = time.perf_counter() - t0
                    progress(f"  {label}: {done[0]}/{len(reqs)} in {el:.1f}s "
                             f"({done[0] / max(el, 1e-9):.2f} req/s)", quiet)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall


def server_model(url: str) -> str | None:
    """The first model id /v1/models lists (None if the server has no such route)."""
    import httpx
    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
        data = r.json().get("data") or []
        return data[0]["id"] if data else None
    except Exception:  # noqa: BLE001
        return None


def run_once(url: str, workload: str, *, n: int | None = None, concurrency: int | None = None,
             max_tokens: int | None = None, flavor: str = "openai", model: str | None = None,
             stream: bool | None = None, label: str = "", seed: int = 0, warmup: int = 2,
             quiet: bool = False, dump: str | None = None, extra: dict | None = None) -> dict:
    """One run of a workload against a server; returns the JSON-able record."""
    n_def, c_def, _, s_def = WORKLOADS[workload]
    concurrency = c_def if concurrency is None else concurrency
    stream = s_def if stream is None else stream
    reqs = build_workload(workload, n, seed, max_tokens)
    if model is None:
        model = server_model(url)
    load = os.getloadavg()
    progress(f"{label or url} {workload}: {len(reqs)} requests, {concurrency} in flight, "
             f"max_tokens {reqs[0].max_tokens}, stream {stream}, load avg {load[0]:.2f}", quiet)
    results, wall = asyncio.run(run_load(url, reqs, concurrency, flavor, model, stream,
                                         label or workload, quiet,
                                         warmup=warmup_requests(workload, warmup)))
    rec = {"label": label or url, "workload": workload, "url": url, "flavor": flavor,
           "concurrency": concurrency, "max_tokens": reqs[0].max_tokens, "stream": stream,
           "loadavg_before": [round(x, 2) for x in load], "time": time.strftime(
               "%Y-%m-%dT%H:%M:%S"), **summarize(results, wall)}
    errs = [r.error for r in results if not r.ok]
    if errs:
        rec["first_error"] = errs[0]
    if extra:
        rec.update(extra)
    if dump:
        with open(dump, "w") as f:
            for i, (q, r) in enumerate(zip(reqs, results)):
                f.write(json.dumps({"i": i, "tag": q.tag, "ok": r.ok, "text": r.text,
                                    "top": r.top, "output_tokens": r.output_tokens}) + "\n")
    return rec
