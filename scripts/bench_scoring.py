#!/usr/bin/env python3
"""Scoring benchmark (issue 22): one /v1/generative-scores request of 64 items x 4 multi-token
labels after a shared ~200-token query, against the same numbers obtained the way a client must
without it: one echo request (max_tokens 0, logprobs 0) per item and label, all in flight at
once (--concurrency), so the server may batch them and share the query through its prefix cache.

Both ways run on the same fresh `python -m freetoken` server, interleaved, each repetition with
its own query (a cold cache for both). Prints progress to stderr and one JSON line: the median
seconds of each way, the speed-up, and the largest |logprob difference| between the two.

    python scripts/bench_scoring.py                 # default model, 5 repetitions
    python scripts/bench_scoring.py --reps 3 --model PATH.gguf

SGLang's /v1/score is the peer for single-token labels, but SGLang needs a GPU: on this CPU-only
machine there is no SGLang to measure (docs/benchmarks.md says so).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

import httpx

from freetoken.testing.process import ServerProcess

WORDS = ("the service was slow but the food arrived warm and the staff apologised twice for "
         "the wait while the room stayed loud and crowded all evening long").split()
LABELS = [" very positive", " somewhat positive", " somewhat negative", " very negative"]


def query_text(rep: int, num_words: int) -> str:
    words = [WORDS[(rep * 7 + i * 3) % len(WORDS)] for i in range(num_words)]
    return f"Review {rep}: " + " ".join(words) + ". Overall, the reviewer's view of item"


def items_text(num_items: int) -> list[str]:
    return [f" number {i}, the {WORDS[i % len(WORDS)]} {WORDS[(i * 5) % len(WORDS)]} part, was"
            for i in range(num_items)]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def by_scoring(client: httpx.AsyncClient, query: str, items: list[str]) -> list:
    r = await client.post("/v1/generative-scores",
                          json={"query": query, "items": items, "labels": LABELS})
    r.raise_for_status()
    return [[lab["token_logprobs"] for lab in res["labels"]] for res in r.json()["results"]]


async def by_echo(client: httpx.AsyncClient, query: str, items: list[str],
                  concurrency: int) -> list:
    tok = await client.post("/tokenize", json={"prompt": query})
    q = tok.json()["tokens"]
    gate = asyncio.Semaphore(concurrency)

    async def ids(text: str) -> list[int]:
        r = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        return r.json()["tokens"]

    item_ids = await asyncio.gather(*(ids(it) for it in items))
    label_ids = await asyncio.gather(*(ids(lab) for lab in LABELS))

    async def one(prompt: list[int], n: int) -> list[float]:
        async with gate:
            r = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
        r.raise_for_status()
        return r.json()["choices"][0]["logprobs"]["token_logprobs"][-n:]

    jobs = [one(q + it + lab, len(lab)) for it in item_ids for lab in label_ids]
    flat = await asyncio.gather(*jobs)
    k = len(LABELS)
    return [flat[i * k:(i + 1) * k] for i in range(len(items))]


def max_diff(a: list, b: list) -> float:
    return max(abs(x - y) for ia, ib in zip(a, b) for la, lb in zip(ia, ib)
               for x, y in zip(la, lb))


async def run(url: str, args) -> dict:
    items = items_text(args.items)
    times = {"scoring": [], "echo": []}
    diff = 0.0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for rep in range(args.reps + 1):  # rep 0 warms up, unmeasured
            got = {}
            order = ("scoring", "echo") if rep % 2 == 0 else ("echo", "scoring")
            for way in order:
                query = query_text(2 * rep + (way == "echo"), args.query_words)
                t0 = time.perf_counter()
                if way == "scoring":
                    got[way] = await by_scoring(client, query, items)
                else:
                    got[way] = await by_echo(client, query, items, args.concurrency)
                dt = time.perf_counter() - t0
                if rep:
                    times[way].append(dt)
                log(f"rep {rep}{' (warm-up)' if not rep else ''}: {way} {dt:.2f} s")
            # same query for both in the check below: score the scoring's query by echo too
            query = query_text(2 * rep, args.query_words)
            diff = max(diff, max_diff(got["scoring"], await by_echo(client, query, items,
                                                                     args.concurrency)))
        q = (await client.post("/tokenize", json={"prompt": query_text(0, args.query_words)}))
        query_tokens = q.json()["count"]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"bench": "scoring", "items": args.items, "labels": len(LABELS),
            "query_tokens": query_tokens, "reps": args.reps, "concurrency": args.concurrency,
            "scoring_s": med["scoring"], "echo_s": med["echo"],
            "speedup": med["echo"] / med["scoring"], "max_abs_logprob_diff": diff,
            "scoring_all_s": times["scoring"], "echo_all_s": times["echo"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--model", default=None, help="model file (default: the embedded SmolLM2)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--items", type=int, default=64)
    ap.add_argument("--query-words", type=int, default=170, help="~200 tokens at 170")
    ap.add_argument("--concurrency", type=int, default=64, help="echo requests in flight")
    ap.add_argument("--out", default=None, help="append the JSON line here")
    args = ap.parse_args(argv)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    server_args = ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory() as tmp:
        log("starting python -m freetoken ...")
        with ServerProcess(server_args, log_path=os.path.join(tmp, "server.log"), env=env) as srv:
            rec = asyncio.run(run(srv.url, args))
    line = json.dumps(rec)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    log(f"scoring {rec['scoring_s']:.2f} s vs echo {rec['echo_s']:.2f} s: "
        f"{rec['speedup']:.1f}x; max |dlogprob| {rec['max_abs_logprob_diff']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
