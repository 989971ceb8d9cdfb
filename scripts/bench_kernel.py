"""Benchmark: the fused kernel (freetoken.ops.topk_logprobs, CPU extension, validation included)
against the obvious unfused torch code and this machine's read bandwidth, interleaved, medians.

    python scripts/bench_kernel.py            # the full table (B x V x K x allowed set)
    python scripts/bench_kernel.py --quick    # K = 20 only, fewer repeats
    python scripts/bench_kernel.py --device cuda   # on a GPU: fused vs unfused, CUDA events

Per shape, each repeat runs, in rotating order (each sample averages enough calls to fill ~2 ms,
after one untimed call at the new thread count): fused with 2 threads, fused with 1 thread, the
unfused code with 2 threads (mask fill + log_softmax + topk), and a read-only pass over the same
logits (torch.amax, 2 threads) as the bandwidth yardstick. Prints a table, then one JSON line.
"GB/s 1t" is logits bytes / wall time with one thread; "GB/s cpu" divides by the process CPU
time of that run instead, which stays meaningful when other processes share the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its OpenMP pool

import torch  # noqa: E402

import freetoken.ops as ops  # noqa: E402
from freetoken.ops.backend import _C  # noqa: E402


def make_allowed(B: int, V: int, n: int, gen: torch.Generator):
    if n == 0:
        return None, None
    lists = [torch.randperm(V, generator=gen)[:n] for _ in range(B)]
    ids = torch.cat(lists).to(torch.int32)
    offsets = torch.arange(0, B * n + 1, n, dtype=torch.int32)
    return (offsets, ids), lists


def unfused(logits, k, lists):
    """The obvious torch code a server would write."""
    if lists is not None:
        B, V = logits.shape
        keep = torch.zeros(B, V, dtype=torch.bool)
        rows = torch.arange(B).repeat_interleave(torch.tensor([len(x) for x in lists]))
        keep[rows, torch.cat(lists)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    lp = torch.log_softmax(logits.float(), dim=-1)
    return torch.topk(lp, k, dim=-1)


def timed(fn, threads: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per call: one untimed call after switching the thread count
    (the switch itself wakes or resizes pools), then enough calls to fill ~2 ms, averaged."""
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    inner = max(1, min(200, int(2e-3 / max(once, 1e-7))))
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner, (time.process_time() - c0) / inner


def bench_cpu(args) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for V in args.V:
        for B in args.B:
            logits = torch.randn(B, V, generator=gen) * 3
            nbytes = logits.numel() * logits.element_size()
            for n_allowed in args.allowed:
                allowed, lists = make_allowed(B, V, n_allowed, gen)
                for k in args.K:
                    fns = {
                        "fused2": (lambda: ops.topk_logprobs(logits, k, allowed), 2),
                        "fused1": (lambda: ops.topk_logprobs(logits, k, allowed), 1),
                        "unfused": (lambda: unfused(logits, k, lists), 2),
                        "read": (lambda: torch.amax(logits), 2),
                    }
                    names = list(fns)
                    for name in names:  # warm-up
                        timed(fns[name][0], fns[name][1])
                    times = {name: [] for name in names}
                    cpu1 = []
                    reps = args.reps if B * V < 4_000_000 else max(3, args.reps // 2)
                    for rep in range(reps):
                        order = names[rep % 4:] + names[:rep % 4]
                        for name in order:
                            fn, threads = fns[name]
                            wall, cpu = timed(fn, threads)
                            times[name].append(wall)
                            if name == "fused1":
                                cpu1.append(cpu)
                    med = {name: statistics.median(t) for name, t in times.items()}
                    row = dict(B=B, V=V, K=k, allowed=n_allowed,
                               fused2_us=med["fused2"] * 1e6, fused1_us=med["fused1"] * 1e6,
                               unfused_us=med["unfused"] * 1e6, read_us=med["read"] * 1e6,
                               speedup=med["unfused"] / med["fused2"],
                               threads_2v1=med["fused1"] / med["fused2"],
                               fused1_gbps=nbytes / med["fused1"] / 1e9,
                               fused1_cpu_gbps=nbytes / max(statistics.median(cpu1), 1e-9) / 1e9,
                               read_gbps=nbytes / med["read"] / 1e9)
                    rows.append(row)
                    print(fmt_row(row), flush=True)
    torch.set_num_threads(2)
    return rows


HEADER = (f"{'B':>4} {'V':>7} {'K':>3} {'allowed':>7} | {'fused 2t':>10} {'fused 1t':>10} "
          f"{'unfused':>10} {'read':>9} | {'speedup':>8} {'2t/1t':>6} {'GB/s 1t':>8} "
          f"{'GB/s cpu':>8} {'read GB/s':>9}")


def fmt_row(r: dict) -> str:
    allowed = "none" if r["allowed"] == 0 else str(r["allowed"])
    return (f"{r['B']:>4} {r['V']:>7} {r['K']:>3} {allowed:>7} | {r['fused2_us']:>8.1f}us "
            f"{r['fused1_us']:>8.1f}us {r['unfused_us']:>8.1f}us {r['read_us']:>7.1f}us | "
            f"{r['speedup']:>7.1f}x {r['threads_2v1']:>5.2f}x {r['fused1_gbps']:>8.1f} "
            f"{r['fused1_cpu_gbps']:>8.1f} {r['read_gbps']:>9.1f}")


def summarize(rows: list[dict]) -> dict:
    dense = [r for r in rows if r["allowed"] == 0]
    m100 = [r for r in rows if r["allowed"] == 100 and r["B"] >= 8]
    b8 = [r for r in rows if r["B"] >= 8 and r["allowed"] in (0, 5000)]
    out = {
        "min_speedup_no_mask": min((r["speedup"] for r in dense), default=None),
        "min_fused_gbps_per_core_no_mask": min((r["fused1_gbps"] for r in dense), default=None),
        "min_fused_gbps_per_cpu_second_no_mask": min((r["fused1_cpu_gbps"] for r in dense),
                                                     default=None),
        "min_speedup_allowed100_B>=8": min((r["speedup"] for r in m100), default=None),
        "min_threads_2v1_dense_B>=8": min((r["threads_2v1"] for r in b8), default=None),
        "min_speedup_any": min((r["speedup"] for r in rows), default=None),
        "isa": ops.cpu_isa(),
    }
    return {k: (round(v, 2) if isinstance(v, float) else v) for k, v in out.items()}


def bench_cuda(args) -> list[dict]:
    """GPU: kernel time by CUDA events (fused vs unfused), medians of interleaved repeats."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []

    def ev_time(fn, reps=20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / reps * 1e3  # us

    for V in args.V:
        for B in args.B:
            logits = (torch.randn(B, V, generator=gen) * 3).to(dev)
            for n_allowed in args.allowed:
                allowed, lists = make_allowed(B, V, n_allowed, gen)
                a_dev = None if allowed is None else tuple(t.to(dev) for t in allowed)
                l_dev = None if lists is None else [t.to(dev) for t in lists]
                k = 20

                def raw():
                    return _C.topk_logprobs(logits, k, *(a_dev or (None, None)))

                def unf():
                    x = logits
                    if l_dev is not None:
                        keep = torch.zeros(B, V, dtype=torch.bool, device=dev)
                        r = torch.arange(B, device=dev).repeat_interleave(n_allowed)
                        keep[r, torch.cat(l_dev)] = True
                        x = x.masked_fill(~keep, float("-inf"))
                    return torch.topk(torch.log_softmax(x, -1), k, -1)
                raw(), unf()
                ts = {"fused": [], "unfused": []}
                for _ in range(5):
                    ts["fused"].append(ev_time(raw))
                    ts["unfused"].append(ev_time(unf))
                f, u = statistics.median(ts["fused"]), statistics.median(ts["unfused"])
                row = dict(B=B, V=V, K=k, allowed=n_allowed, fused_us=f, unfused_us=u,
                           speedup=u / f, hbm_tbps=B * V * 4 / (f * 1e-6) / 1e12)
                rows.append(row)
                print(f"{B:>4} {V:>7} {k:>3} {n_allowed or 'none':>7} | fused {f:8.1f}us "
                      f"unfused {u:8.1f}us | {u / f:6.1f}x  {row['hbm_tbps']:.2f} TB/s",
                      flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--B", type=int, nargs="*", default=[1, 8, 32, 128])
    p.add_argument("--V", type=int, nargs="*", default=[49152, 151936])
    p.add_argument("--K", type=int, nargs="*", default=[2, 5, 20])
    p.add_argument("--allowed", type=int, nargs="*", default=[0, 2, 100, 5000])
    args = p.parse_args()
    if args.quick:
        args.K, args.reps = [20], 5
    if args.device == "cuda":
        rows = bench_cuda(args)
        print(json.dumps({"bench": "topk_logprobs_cuda", "rows": rows}))
        return
    if ops.backend() != "ext-cpu":
        sys.exit(f"the CPU extension is not in use (backend {ops.backend()}); build it first")
    print(f"# freetoken.ops {ops.backend()} ({ops.cpu_isa()}), torch {torch.__version__}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, medians of interleaved runs")
    print(HEADER)
    rows = bench_cpu(args)
    print(json.dumps({"bench": "topk_logprobs_cpu", "summary": summarize(rows), "rows": rows}))


if __name__ == "__main__":
    main()
