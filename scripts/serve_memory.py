"""A server's peak memory and time to ready: `python -m freetoken ARGS` started fresh, timed to
its first 200 from /health, given one greedy completion, then its VmHWM (peak RSS) and its
resident anonymous / file-backed memory read from /proc before it stops.

    python3 scripts/serve_memory.py --reps 3 --trees /work/main . -- --linear gguf

Each tree (a checkout holding its built freetoken._C) serves in turn, interleaved per rep, under
OMP_WAIT_POLICY=PASSIVE (what scripts/serve sets). What it is not: a speed benchmark
(compare_peers.py records peak RSS and time to ready beside the speed of every workload).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import urllib.request
from pathlib import Path

from freetoken.testing.process import ServerProcess

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def status_mib(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[key] = int(value.split()[0]) / 1024  # kB
    return out


def one_run(tree: str, args: list[str], log_dir: str) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PYTHONPATH", None)  # the tree's own freetoken (cwd), not the caller's
    server = ServerProcess(args, log_path=Path(log_dir) / "server.log", env=env, cwd=tree)
    with server:
        at_ready = status_mib(server.pid)
        body = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
        request = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            json.load(response)
        after = status_mib(server.pid)
    return {"ready_s": server.ready_s, "hwm_at_ready": at_ready["VmHWM"], **after}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", nargs="+", default=["."], help="checkouts to serve from")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("args", nargs="*", help="python -m freetoken's arguments (after --)")
    opts = p.parse_args()
    print("| tree | rep | ready in s | peak RSS at ready | peak RSS | anon | file (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as log_dir:
        for rep in range(opts.reps):
            for tree in opts.trees:
                r = one_run(tree, opts.args, log_dir)
                print(f"| {tree} | {rep + 1} | {r['ready_s']:.2f} | {r['hwm_at_ready']:.0f} | "
                      f"{r['VmHWM']:.0f} | {r['RssAnon']:.0f} | {r['RssFile']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
