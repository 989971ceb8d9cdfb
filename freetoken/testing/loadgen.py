#!/usr/bin/env python3
"""HTTP load generator for OpenAI-compatible servers (FreeToken, llama.cpp's llama-server, ...).

Workloads (deterministic prompts, fixed seeds, no downloads; the same as scripts/bench_engine.py):
  classify        a shared ~170-token few-shot sentiment prefix + a unique ~25-token review +
                  "Sentiment:"; max_tokens 1, temperature 0, logprobs 2; 200 requests, 8 in flight
  classify-multi  the same, but 16 distinct instruction prefixes (many classifiers behind one
                  server); each request picks one at random (seeded)
  decode          16 distinct short prompts, 8 in flight, 128 greedy tokens each, ignore_eos
  decode-1        the decode prompts one at a time (single stream), 4 requests by default

Prints progress to stderr and one JSON line per run to stdout (and appends it to --out):
requests/s, output tokens/s, p50/p99 latency, time to first token (streamed where it matters),
the load average before the run, and the server's cached-token share where it reports one.

    python3 scripts/bench_serve.py --url http://127.0.0.1:8000 --workload classify
    python3 scripts/bench_serve.py --url http://127.0.0.1:8081 --flavor llama-server \
        --workload decode --label llama-server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------

PREFIX = (
    "You are a careful assistant. Classify the sentiment of each product review as Positive or "
    "Negative. Answer with one word.\n\n"
    "Review: The blender broke after two days and the seller never answered my emails.\n"
    "Sentiment: Negative\n\n"
    "Review: Absolutely love this jacket, it is warm, light and the zipper feels solid.\n"
    "Sentiment: Positive\n\n"
    "Review: The headphones sound muddy and the left ear stopped working within a week.\n"
    "Sentiment: Negative\n\n"
    "Review: Great value for the price; my kids use this tablet every day without issues.\n"
    "Sentiment: Positive\n\n"
    "Review: Shipping took a month and the box arrived crushed with pieces missing inside.\n"
    "Sentiment: Negative\n\n"
    "Review: This coffee maker is quiet, fast and the coffee tastes better than the cafe.\n"
    "Sentiment: Positive\n\n"
)

_PRODUCTS = ["vacuum", "laptop stand", "rain coat", "desk lamp", "kettle", "phone case",
             "backpack", "air fryer", "keyboard", "water bottle", "monitor", "tent"]
_GOOD = ["works perfectly", "exceeded my expectations", "feels premium", "was easy to set up",
         "is worth every penny", "arrived early and well packed"]
_BAD = ["stopped working", "feels cheap and flimsy", "smells like burnt plastic",
        "was missing parts", "is far too loud", "broke on the first use"]
_TAIL = ["I would recommend it to friends.", "I am returning it tomorrow.",
         "My partner noticed the difference immediately.", "Customer service was polite.",
         "The instructions were confusing though.", "Not sure I would buy it again."]

# classify-multi: 16 classifiers = 16 instruction headers x seeded few-shot example choices.
_HEADERS = [
    "You are a careful assistant. Classify the sentiment of each product review as Positive or "
    "Negative. Answer with one word.",
    "Read the customer review and decide whether the customer was happy (Positive) or unhappy "
    "(Negative). Reply with a single word.",
    "Task: sentiment analysis for an online shop. Label every review Positive or Negative.",
    "You label support tickets and reviews. Output Positive when the writer is satisfied and "
    "Negative otherwise.",
    "Decide the polarity of the following marketplace reviews. Use only Positive or Negative.",
    "As a quality analyst, tag each review with its sentiment: Positive or Negative.",
    "Classify the opinion expressed in each review. The only allowed answers are Positive and "
    "Negative.",
    "Below are product reviews with their sentiment. Continue the pattern for the last review.",
]
_EXAMPLES = [
    ("The blender broke after two days and the seller never answered my emails.", "Negative"),
    ("Absolutely love this jacket, it is warm, light and the zipper feels solid.", "Positive"),
    ("The headphones sound muddy and the left ear stopped working within a week.", "Negative"),
    ("Great value for the price; my kids use this tablet every day without issues.", "Positive"),
    ("Shipping took a month and the box arrived crushed with pieces missing inside.", "Negative"),
    ("This coffee maker is quiet, fast and the coffee tastes better than the cafe.", "Positive"),
    ("The mattress sags in the middle already and the return process is a nightmare.",
     "Negative"),
    ("My new running shoes are comfortable from the first mile and look fantastic.", "Positive"),
    ("The printer jams on every second page and the ink runs out absurdly fast.", "Negative"),
    ("Setup took five minutes and the speaker fills the whole living room with sound.",
     "Positive"),
    ("The charger overheats and the cable frayed after a couple of weeks of use.", "Negative"),
    ("Beautiful frying pan, nothing sticks and it cleans up in seconds.", "Positive"),
]

DECODE_PROMPTS = [
    "Write a story about a dragon.", "Explain how a bicycle works.", "List facts about Mars.",
    "Describe your ideal breakfast.", "What is the history of Rome?", "How do magnets work?",
    "Tell me about the ocean.", "Give advice to a new programmer.", "Why is the sky blue?",
    "Describe a walk in the forest.", "How does a compiler work?", "Write a letter to a friend.",
    "What makes a good teacher?", "Explain photosynthesis simply.", "Plan a trip to Japan.",
    "Describe the life of a bee.",
]

WORKLOADS = {
    # name: (default requests, default in flight, max_tokens, stream by default)
    "classify": (200, 8, 1, False),
    "classify-multi": (200, 8, 1, False),
    "decode": (16, 8, 128, True),
    "decode-1": (4, 1, 128, True),
}


def reviews(n: int, seed: int = 0) -> list[str]:
    """The unique review tails: n deterministic ~25-token reviews, alternating bad/good."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        verdict = rng.choice(_GOOD if i % 2 else _BAD)
        out.append(f"The {rng.choice(_PRODUCTS)} I bought in week {i} {verdict} after "
                   f"{rng.randint(2, 30)} days. {rng.choice(_TAIL)}")
    return out


def multi_prefixes(k: int = 16, seed: int = 1) -> list[str]:
    """k distinct few-shot prefixes of about the classify prefix's length (6 examples each)."""
    rng = random.Random(seed)
    out = []
    for j in range(k):
        header = _HEADERS[j % len(_HEADERS)]
        shots = rng.sample(_EXAMPLES, 6)
        body = "".join(f"Review: {r}\nSentiment: {s}\n\n" for r, s in shots)
        out.append(f"{header}\n\n{body}")
    assert len(set(out)) == k
    return out


@dataclass
class Req:
    prompt: str
    max_tokens: int
    classify: bool
    tag: str = ""  # e.g. which prefix a classify-multi request uses


def build_workload(name: str, n: int | None = None, seed: int = 0,
                   max_tokens: int | None = None) -> list[Req]:
    """The requests of a workload, in submission order (deterministic for a given seed)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {sorted(WORKLOADS)}")
    n_def, _, mt_def, _ = WORKLOADS[name]
    n = n_def if n is None else n
    mt = mt_def if max_tokens is None else max_tokens
    if name == "classify":
        return [Req(PREFIX + f"Review: {r}\nSentiment:", mt, True, "p0")
                for r in reviews(n, seed)]
    if name == "classify-multi":
        pre = multi_prefixes()
        rng = random.Random(seed + 12345)
        out = []
        for r in reviews(n, seed):
            j = rng.randrange(len(pre))
            out.append(Req(pre[j] + f"Review: {r}\nSentiment:", mt, True, f"p{j}"))
        return out
    # decode / decode-1: cycle through the 16 prompts
    return [Req(DECODE_PROMPTS[i % len(DECODE_PROMPTS)], mt, False, f"d{i % 16}")
            for i in range(n)]


def warmup_requests(name: str, k: int) -> list[Req]:
    """k requests of the workload's shape that are not among the measured ones."""
    if k <= 0:
        return []
    if name.startswith("classify"):
        reqs = build_workload(name, k, seed=999)
        return [Req(r.prompt.replace(" in week ", " in month "), r.max_tokens, True, r.tag)
                for r in reqs]
    return [Req("Say something nice about autumn.", 8, False, "w")] * k


def payload(req: Req, flavor: str, model: str | None, stream: bool) -> dict:
    """The request body. FreeToken refuses unknown fields (400), so only OpenAI fields plus
    vLLM's `ignore_eos` go to it; llama-server takes its own extras (`cache_prompt`)."""
    body: dict = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0}
    if model:
        body["model"] = model
    if req.classify:
        body["logprobs"] = 2
    else:
        body["ignore_eos"] = True
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if flavor == "llama-server":
        # llama-server maps max_tokens -> n_predict, `logprobs` -> n_probs and reads ignore_eos
        # from the body; temperature 0 is greedy there too. Keep its prompt cache on explicitly
        # (the default).
        body["cache_prompt"] = True
    return body


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


def wait_ready(url: str, timeout: float = 300.0, proc=None) -> None:
    """Poll /health until it answers 200 (raises on timeout or when `proc` exits)."""
    import httpx
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url.rstrip("/") + "/health", timeout=2).status_code == 200:
                return
        except Exception:  # noqa: BLE001
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s")


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), action="append",
                    help="repeatable; default: classify")
    ap.add_argument("--num-requests", "-n", type=int, default=None)
    ap.add_argument("--concurrency", "-c", type=int, default=None, help="requests in flight")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--flavor", choices=["openai", "llama-server"], default="openai",
                    help="llama-server adds its own fields (cache_prompt, top_k 1)")
    ap.add_argument("--model", default=None, help="model id (default: what /v1/models lists)")
    ap.add_argument("--stream", choices=["auto", "on", "off"], default="auto",
                    help="auto: streamed for decode (for TTFT), not for classify")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file")
    ap.add_argument("--dump", default=None, help="write per-request outputs (JSONL) here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    stream = {"auto": None, "on": True, "off": False}[args.stream]
    rc = 0
    for wl in args.workload or ["classify"]:
        rec = run_once(args.url, wl, n=args.num_requests, concurrency=args.concurrency,
                       max_tokens=args.max_tokens, flavor=args.flavor, model=args.model,
                       stream=stream, label=args.label, seed=args.seed, warmup=args.warmup,
                       quiet=args.quiet, dump=args.dump)
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
        if rec["errors"]:
            progress(f"{rec['errors']} failed requests; first: {rec.get('first_error')}")
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
