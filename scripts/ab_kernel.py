#!/usr/bin/env python3
"""A/B of the GGUF-block panel linear (ops.pack_gguf_panels + ops.panel_linear), of the int8
mode's matrix (ops.int8_matrix, --form int8) or of the blocks in place (ops.gguf_matrix, --form
gguf: the exact mode's form of a K-quant file), across source trees: one worker process per tree
holds the same random matrices, and the workers take turns in short bursts of calls,
round-robin, so the drift of this shared machine hits all alike. Prints each case's medians, as
times and as ratios to the first tree, then one JSON line.

    python3 scripts/ab_kernel.py A=/tmp/old-checkout B=.        # SmolLM2's lm_head at one row
    python3 scripts/ab_kernel.py A=/tmp/old B=. --type Q4_1 --n 1536 --k 576 --rows 8 --copies 80
    python3 scripts/ab_kernel.py A=/tmp/old B=. --form int8 --type Q4_K --n 8192 --k 2048 \
        --rows 224 --copies 1 --cases 2:hot          # the int8 mode's matrix

A tree is LABEL=PATH, a checkout whose freetoken/ has its extension built (setup.py build_ext
--inplace); its worker runs in it (cwd and PYTHONPATH). "cold" rotates the calls over --copies
copies of the matrix, so with enough copies (past the L3) the blocks come from DRAM as in a
decode step; "hot" calls one copy. Why this and not two separate runs: on this machine one
tree's kernel time moves by 1.5x from minute to minute, and separate runs compare the moments,
not the kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# The worker: builds the matrices, then times `n` calls per line read ("threads cold|hot n").
WORKER = r"""
import json, os, sys, time
import torch
from freetoken import ops
typ, form = sys.argv[1], sys.argv[6]
n, k, rows, copies = (int(a) for a in sys.argv[2:6])
if sys.argv[7] == "no-amx":  # the VNNI loop on an AMX host
    ops.set_int8_amx(False)
if sys.argv[8] != "auto":  # another ISA variant's loops (e.g. AVX2 on an AVX-512 host)
    ops.configure(cpu_isa=sys.argv[8])
# values and bytes a block, and where its fp16 scales lie (each set to 2^-7)
values, src, halves = {"Q4_1": (32, 20, (0, 2)), "Q8_0": (32, 34, (0,)), "Q4_0": (32, 18, (0,)),
                       "Q5_0": (32, 22, (0,)), "IQ4_NL": (32, 18, (0,)),
                       "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)),
                       "Q6_K": (256, 210, (208,))}[typ]
g = torch.Generator().manual_seed(0)
mats, blocks_alive = [], []  # a gguf descriptor holds its blocks' addresses
for _ in range(copies):
    raw = torch.randint(0, 256, (n, k // values * src), dtype=torch.uint8, generator=g)
    blocks = raw.view(n, k // values, src)
    for h in halves:
        blocks[:, :, h], blocks[:, :, h + 1] = 0, 0x20
    offsets = torch.arange(n, dtype=torch.int64) * raw.shape[1]
    if form == "int8":
        mats.append(ops.int8_matrix(raw.view(-1), offsets, [typ], [n], k))
    elif form == "gguf":  # the blocks in place
        blocks_alive.append(raw)
        mats.append(ops.gguf_matrix(raw.view(-1), offsets, [typ], [n], k))
    else:
        mats.append(ops.pack_gguf_panels(raw, typ, k))
x = torch.randn(rows, k, generator=g)
print(json.dumps(ops.panel_linear(x, mats[0])[0, :2].tolist()), flush=True)
for line in sys.stdin:
    threads, where, calls = line.split()
    torch.set_num_threads(int(threads))
    times = []
    for i in range(int(calls)):
        w = mats[i % copies] if where == "cold" else mats[0]
        t0 = time.perf_counter()
        ops.panel_linear(x, w)
        times.append(time.perf_counter() - t0)
    print(json.dumps(times[2:]), flush=True)  # the first calls of a burst warm the pool
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("trees", nargs="+", help="LABEL=PATH, the first is the baseline")
    ap.add_argument("--type", default="Q8_0", choices=["Q4_0", "Q4_1", "Q5_0", "Q8_0", "IQ4_NL",
                                                       "Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--form", default="panels", choices=["panels", "int8", "gguf"],
                    help="GGUF-block panels (Q4_1 / Q8_0), the int8 mode's matrix or the "
                         "blocks in place")
    ap.add_argument("--n", type=int, default=49152, help="output features")
    ap.add_argument("--k", type=int, default=576, help="input features (a multiple of 32)")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--cases", default="2:cold,1:cold,2:hot", help="threads:cold|hot,...")
    ap.add_argument("--bursts", type=int, default=30, help="bursts of 12 calls per tree")
    ap.add_argument("--no-amx", action="store_true",
                    help="--form int8 on an AMX host: the VNNI loop at every row count")
    ap.add_argument("--cpu-isa", default="auto", choices=("auto", "avx512", "avx2", "base"),
                    help="the kernels' ISA variant in every worker (ops.configure)")
    args = ap.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.trees)
    print(f"starting {len(trees)} workers ({args.copies} x {args.type} [{args.n}, {args.k}])",
          file=sys.stderr, flush=True)
    workers = {
        label: subprocess.Popen(
            [sys.executable, "-c", WORKER, args.type, str(args.n), str(args.k), str(args.rows),
             str(args.copies), args.form, "no-amx" if args.no_amx else "amx", args.cpu_isa],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            # cwd too: `python -c` puts the working directory first on sys.path
            env=dict(os.environ, PYTHONPATH=os.path.abspath(path), OMP_WAIT_POLICY="PASSIVE"),
            cwd=os.path.abspath(path))
        for label, path in trees.items()}
    for label, w in workers.items():
        print(f"{label}: y[0, :2] = {w.stdout.readline().strip()}", file=sys.stderr, flush=True)
    labels, report = list(workers), []
    for case in args.cases.split(","):
        threads, where = case.split(":")
        times: dict[str, list[float]] = {label: [] for label in labels}
        for burst in range(args.bursts):
            for label in labels[burst % len(labels):] + labels[:burst % len(labels)]:
                workers[label].stdin.write(f"{threads} {where} 12\n")
                workers[label].stdin.flush()
                times[label] += json.loads(workers[label].stdout.readline())
            if burst % 10 == 9:
                print(f"  {case}: {burst + 1}/{args.bursts} bursts", file=sys.stderr, flush=True)
        med = {label: statistics.median(v) for label, v in times.items()}
        base = med[labels[0]]
        print(f"rows {args.rows}, {threads} threads, {where}: " + "  ".join(
            f"{label} {med[label] * 1e3:.3f} ms ({med[label] / base:.3f})" for label in labels),
            flush=True)
        report.append({"threads": int(threads), "where": where,
                       "median_ms": {label: med[label] * 1e3 for label in labels}})
    for w in workers.values():
        w.stdin.close()
        w.wait()
    print(json.dumps({"type": args.type, "form": args.form, "n": args.n, "k": args.k,
                      "rows": args.rows, "copies": args.copies, "cases": report,
                      "loadavg": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
