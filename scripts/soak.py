#!/usr/bin/env python3
"""Load / soak test of a FreeToken server (freetoken/testing/soak.py): a seeded mix of classify,
generation, chat, streaming, invalid bodies and disconnects; one JSON line of outcomes.

    python3 scripts/soak.py                          # spawns `python -m freetoken`, 1000 requests
    FREETOKEN_SOAK_REQUESTS=10000 python3 scripts/soak.py
    python3 scripts/soak.py --url http://127.0.0.1:8000 --pid 1234 --requests 500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from freetoken.testing.soak import Soak, soak_server


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: spawn one)")
    p.add_argument("--pid", type=int, help="the running server's pid, for RSS")
    p.add_argument(
        "--requests", type=int, default=int(os.environ.get("FREETOKEN_SOAK_REQUESTS", 1000))
    )
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", default="/tmp/freetoken-soak-server.log")
    args = p.parse_args()
    server = None
    url, pid = args.url, args.pid
    if url is None:
        server = soak_server(Path(args.log))
        url, pid = server.url, server.pid
    try:
        report = asyncio.run(
            Soak(
                url, pid=pid, requests=args.requests, concurrency=args.concurrency, seed=args.seed
            ).run()
        )
    finally:
        if server is not None:
            server.proc.terminate()
            report_rc = server.proc.wait(60)
    if server is not None:
        report["server_exit_code"] = report_rc
    print(json.dumps(report))
    return 0 if report["unexpected"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
