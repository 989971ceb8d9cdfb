#!/usr/bin/env python3
"""HTTP load generator for OpenAI-compatible servers (FreeToken, llama.cpp's llama-server, ...).

Workloads: classify, classify-multi, decode, decode-4, decode-1 (freetoken/testing/workloads.py
says what each sends; deterministic prompts, fixed seeds, no downloads).

Prints progress to stderr and one JSON line per run to stdout (and appends it to --out):
requests/s, output tokens/s, p50/p99 latency, time to first token (streamed where it matters),
the load average before the run, and the server's cached-token share where it reports one.

    python3 scripts/bench_serve.py --url http://127.0.0.1:8000 --workload classify
    python3 scripts/bench_serve.py --url http://127.0.0.1:8081 --flavor llama-server \
        --workload decode --label llama-server
"""

from __future__ import annotations

import argparse
import json
import sys

from freetoken.testing.loadgen import progress, run_once
from freetoken.testing.workloads import WORKLOADS


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
