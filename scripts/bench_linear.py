#!/usr/bin/env python3
"""The panel linear (freetoken.ops.panel_linear) against oneDNN with packed weights
(freetoken.model.linear, what the model runs) and F.linear, on SmolLM2-135M's linears, fp32.

Cold: each method cycles round-robin through its own copies of the weight (> --cold-mb in all),
so every call reads a weight last touched hundreds of MB ago, from DRAM, as in a decode step
(the model's 425 MB of layer weights far exceed the 32 MB L3). Hot: one copy, called again and
again (from L2/L3 when it fits). sum(): torch's x.sum() over the same copies, cold, in the same
run: the panels' own bytes (sum packed) and the plain weights' (sum plain), as the read
bandwidth to compare with. A sample times enough calls to fill ~--sample-ms; the methods take
turns sample by sample; medians of --repeats samples. GB/s counts the fp32 weight (N * K * 4
bytes) once per call; GFLOP/s is 2 M N K per call.

Progress goes to stderr; stdout gets the table, a per-decode-step summary (30 layers of
qkv + o + gate_up + down, plus lm_head) and, last, one JSON line.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/bench_linear.py [--ms 1 8] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from freetoken import ops  # noqa: E402
from freetoken.model.linear import linear, pack_weight, packing_available  # noqa: E402

# SmolLM2-135M, per layer (30 layers), fused as the model runs them: [N, K]
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
NUM_LAYERS = 30
METHODS = ("panel", "onednn", "F")


def time_calls(fn, calls: int) -> float:
    """Seconds per call over `calls` back-to-back calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


class Cycle:
    """fn(x, weight copy) over the copies in turn: each call gets the copy least recently used."""

    def __init__(self, fn, x, weights):
        self.fn, self.x, self.weights, self.i = fn, x, weights, 0

    def __call__(self):
        w = self.weights[self.i]
        self.i = (self.i + 1) % len(self.weights)
        return self.fn(self.x, w)


def measure(fns: dict, repeats: int, sample_ms: float) -> dict:
    """{name: callable} -> {name: median seconds per call}, samples interleaved by name."""
    calls = {}
    for name, fn in fns.items():
        fn()
        one = time_calls(fn, 2)
        calls[name] = max(1, min(5000, int(sample_ms * 1e-3 / max(one, 1e-7))))
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(time_calls(fns[name], calls[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_shape(name: str, N: int, K: int, args, log) -> list[dict]:
    nbytes = N * K * 4
    copies = max(2, -(-(args.cold_mb << 20) // nbytes))
    g = torch.Generator().manual_seed(N * 7 + K)
    plain = [torch.randn(N, K, generator=g) for _ in range(copies)]
    packed = {"F": plain, "panel": [ops.pack_panels(w) for w in plain],
              "onednn": [pack_weight(w) for w in plain]}
    call = {"panel": lambda x, w: ops.panel_linear(x, w),
            "onednn": lambda x, w: linear(x, w, None),
            "F": lambda x, w: F.linear(x, w)}
    log(f"{name} [{N} x {K}]: {copies} copies of {nbytes / 2**20:.1f} MB per method")
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        sums = measure({"packed": Cycle(lambda _, w: w.sum(), None, packed["panel"]),
                        "plain": Cycle(lambda _, w: w.sum(), None, plain)},
                       args.repeats, args.sample_ms)
        sum_gbs = {k: nbytes / t / 1e9 for k, t in sums.items()}
        for M in args.ms:
            x = torch.randn(M, K, generator=g)
            fns = {}
            for m in METHODS:
                fns[f"{m}_cold"] = Cycle(call[m], x, packed[m])
                fns[f"{m}_hot"] = Cycle(call[m], x, packed[m][:1])
            t = measure(fns, args.repeats, args.sample_ms)
            row = {"shape": name, "N": N, "K": K, "M": M, "threads": threads,
                   "sum_packed_gbs": round(sum_gbs["packed"], 2),
                   "sum_plain_gbs": round(sum_gbs["plain"], 2)}
            for key, sec in t.items():
                row[f"{key}_ms"] = round(sec * 1e3, 4)
                row[f"{key}_gbs"] = round(nbytes / sec / 1e9, 2)
                row[f"{key}_gflops"] = round(2 * M * N * K / sec / 1e9, 2)
            rows.append(row)
            log(f"  {threads}t M={M}: cold ms " + ", ".join(
                f"{m} {row[f'{m}_cold_ms']:.3f}" for m in METHODS)
                + f" | sum packed {sum_gbs['packed']:.1f} GB/s")
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':>8} {'thr':>3} {'M':>4} |"
          f"{'panel cold':>20} |{'oneDNN cold':>20} |{'F.linear cold':>20} |"
          f"{'hot GB/s: panel':>16} {'oneDNN':>7} {'F':>6} | {'sum() GB/s':>11} |"
          f" {'panel/oneDNN':>7}")
    print(f"{'':>8} {'':>3} {'':>4} |" + f"{'ms  GB/s GFLOP/s':>20} |" * 3
          + f"{'':>31} | {'pack plain':>11} | {'cold':>5} {'hot':>5}")
    for r in rows:
        cells = " |".join(f"{r[f'{m}_cold_ms']:>7.3f} {r[f'{m}_cold_gbs']:>5.1f} "
                          f"{r[f'{m}_cold_gflops']:>6.1f}" for m in METHODS)
        hot = (f"{r['panel_hot_gbs']:>16.1f} {r['onednn_hot_gbs']:>7.1f} "
               f"{r['F_hot_gbs']:>6.1f}")
        cold_x = r["onednn_cold_ms"] / r["panel_cold_ms"]
        hot_x = r["onednn_hot_ms"] / r["panel_hot_ms"]
        print(f"{r['shape']:>8} {r['threads']:>3} {r['M']:>4} | {cells} |{hot} |"
              f" {r['sum_packed_gbs']:>5.1f} {r['sum_plain_gbs']:>5.1f} |"
              f" {cold_x:>5.2f}x {hot_x:>4.2f}x")


def step_summary(rows: list[dict]) -> list[dict]:
    """Cold ms per decode step: 30 x (qkv + o + gate_up + down) + lm_head, where all measured."""
    out = []
    keys = sorted({(r["threads"], r["M"]) for r in rows})
    for threads, M in keys:
        by = {r["shape"]: r for r in rows if r["threads"] == threads and r["M"] == M}
        if set(by) != set(SHAPES):
            continue
        step = {"threads": threads, "M": M}
        for m in METHODS:
            layer = sum(by[s][f"{m}_cold_ms"] for s in ("qkv", "o", "gate_up", "down"))
            step[f"{m}_step_ms"] = round(NUM_LAYERS * layer + by["lm_head"][f"{m}_cold_ms"], 2)
        out.append(step)
    if out:
        print("\n# one decode step's linears, cold (30 layers + lm_head), ms")
        print(f"{'thr':>3} {'M':>4} | {'panel':>8} {'oneDNN':>8} {'F.linear':>8} | panel/oneDNN")
        for s in out:
            print(f"{s['threads']:>3} {s['M']:>4} | {s['panel_step_ms']:>8.2f} "
                  f"{s['onednn_step_ms']:>8.2f} {s['F_step_ms']:>8.2f} | "
                  f"{s['onednn_step_ms'] / s['panel_step_ms']:>5.2f}x")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 224])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cold-mb", type=int, default=256, help="bytes of copies per method")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sample-ms", type=float, default=15.0)
    args = ap.parse_args()
    probe = torch.empty(1)
    if not ops.panel_linear_available(probe) or not packing_available(probe):
        print(f"needs freetoken._C with panel_linear (backend {ops.backend()}) and oneDNN",
              file=sys.stderr)
        return 1
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    rows = []
    for name in args.shapes:
        rows += bench_shape(name, *SHAPES[name], args, log)
    print(f"# panel_linear ({ops.cpu_isa()}) vs oneDNN packed vs F.linear, fp32, torch "
          f"{torch.__version__}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')}, medians of "
          f"{args.repeats}; cold = round-robin over > {args.cold_mb} MB per method")
    print_table(rows)
    steps = step_summary(rows)
    print(json.dumps({"bench": "linear", "isa": ops.cpu_isa(), "torch": torch.__version__,
                      "repeats": args.repeats, "cold_mb": args.cold_mb,
                      "thp_env": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
                      "wall_s": round(time.perf_counter() - t0, 1), "rows": rows,
                      "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
