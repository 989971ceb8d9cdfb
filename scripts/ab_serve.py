#!/usr/bin/env python3
"""A/B of two FreeToken source trees over HTTP: the same workloads, interleaved, fresh servers.

    python3 scripts/ab_serve.py --a /tmp/old-checkout --b . --reps 3
    python3 scripts/ab_serve.py --a . --b . --b-args --linear panels     # one tree, two settings
    python3 scripts/ab_serve.py --a /tmp/old --b . --both-args "--compute int8" --model M.gguf

Each tree is served as `python -m freetoken` with that tree first on PYTHONPATH (build its
extension in place first: `python setup.py build_ext --inplace`, or copy a built
`freetoken/_C*.so` into it), under OMP_WAIT_POLICY=PASSIVE as scripts/serve runs it. Each run
starts a fresh server; the order alternates A B, B A, ... per rep, so the drift of this shared
machine hits both alike. Prints one JSON line per run, then per workload the medians and B / A.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys

from freetoken.testing import loadgen
from freetoken.testing.process import ServerProcess


def run(tree: str, extra: list[str], label: str, wl: str, n: int, model: str | None,
        logdir: str) -> dict:
    server = ServerProcess(["--host", "127.0.0.1", "--log-level", "warning",
                            *(["--model", model] if model else []), *extra],
                           env=dict(os.environ, PYTHONPATH=os.path.abspath(tree),
                                    OMP_WAIT_POLICY="PASSIVE"),
                           log_path=os.path.join(logdir, f"{label}-{wl}.log"), new_session=True,
                           cwd=os.path.abspath(tree))
    try:
        server.start(timeout_s=300)
        return loadgen.run_once(server.url, wl, n=n, label=label, warmup=2, quiet=True)
    finally:
        server.stop(timeout_s=20)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--a", required=True, help="source tree A (the baseline)")
    ap.add_argument("--b", required=True, help="source tree B")
    ap.add_argument("--both-args", default="",
                    help='server arguments for both trees, one string ("--compute int8")')
    ap.add_argument("--a-args", nargs=argparse.REMAINDER, default=[])
    ap.add_argument("--b-args", nargs=argparse.REMAINDER, default=[])
    ap.add_argument("--workloads", nargs="+", default=["classify", "decode", "decode-1"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--logdir", default="/tmp/ab_serve")
    ap.add_argument("--requests", nargs="+", default=[], metavar="WORKLOAD=N",
                    help="requests a run for a workload (decode-1's default 2 is quick, noisy)")
    args = ap.parse_args(argv)
    os.makedirs(args.logdir, exist_ok=True)
    n_for = {"classify": 200, "classify-multi": 200, "decode": 16, "decode-4": 8, "decode-1": 2}
    for item in args.requests:
        wl, _, n = item.partition("=")
        if wl not in n_for or not n.isdigit() or int(n) < 1:
            ap.error(f"--requests {item!r}: want WORKLOAD=N, WORKLOAD one of {', '.join(n_for)}")
        n_for[wl] = int(n)
    both = shlex.split(args.both_args)
    sides = [("A", args.a, both + args.a_args), ("B", args.b, both + args.b_args)]
    got: dict = {}
    for wl in args.workloads:
        key = "requests_per_s" if wl.startswith("classify") else "output_tokens_per_s"
        for rep in range(args.reps):
            for label, tree, extra in (sides if rep % 2 == 0 else sides[::-1]):
                r = run(tree, extra, label, wl, n_for[wl], args.model, args.logdir)
                print(json.dumps({**r, "rep": rep}), flush=True)
                got.setdefault((wl, label), []).append(r[key])
        a, b = got[(wl, "A")], got[(wl, "B")]
        print(f"{wl}: A {statistics.median(a):.1f} ({', '.join(f'{x:.1f}' for x in a)})  "
              f"B {statistics.median(b):.1f} ({', '.join(f'{x:.1f}' for x in b)})  "
              f"B/A {statistics.median(b) / statistics.median(a):.3f}", file=sys.stderr,
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
