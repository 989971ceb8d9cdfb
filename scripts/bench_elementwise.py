#!/usr/bin/env python3
"""The fused elementwise kernels (freetoken.ops rms_norm / silu_mul / rope_ on the CPU extension)
against their torch twins (llama.py's code), per op, on SmolLM2-135M's shapes, 1 and 2 threads.

Each sample times enough back-to-back calls to fill ~--sample-ms; fused and twin alternate
sample by sample at each thread count; the table shows medians of --repeats samples, in us per
call, and the mean minor page faults per call at 1 thread (fused, twin). Progress goes to stderr;
the last stdout line is one JSON object with every row.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/bench_elementwise.py [--tokens 8 224] [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from freetoken import ops  # noqa: E402
from freetoken.ops import elementwise as ew  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 576, 9, 3, 64, 1536  # SmolLM2-135M
EPS = 1e-5


def cases(T: int, dtype: torch.dtype):
    """-> [(op name, fused callable, twin callable)] for T tokens (inputs built once)."""
    g = torch.Generator().manual_seed(T)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)  # noqa: E731
    x, h, w = rand(T, HIDDEN), rand(T, HIDDEN), rand(HIDDEN)
    res_fused, res_twin = rand(T, HIDDEN), rand(T, HIDDEN)  # updated in place by every call
    gate_up = rand(T, 2 * INTERMEDIATE)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    qkv = rand(T, q_size + 2 * kv_size)
    q = qkv[:, :q_size].view(T, HEADS, HEAD_DIM)
    k = qkv[:, q_size:q_size + kv_size].view(T, KV_HEADS, HEAD_DIM)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]  # [T, 1, hd]
    return [
        ("rms_norm", lambda: ops.rms_norm(x, w, EPS), lambda: ew._rms_norm_torch(x, w, EPS)),
        ("add_rms_norm", lambda: ops.rms_norm(h, w, EPS, res_fused),
         lambda: ew._rms_norm_torch(h, w, EPS, res_twin)),
        ("silu_mul", lambda: ops.silu_mul(gate_up, INTERMEDIATE),
         lambda: ew._silu_mul_torch(gate_up, INTERMEDIATE)),
        ("rope_", lambda: ops.rope_(q, k, cos, sin), lambda: ew._rope_torch_(q, k, cos, sin)),
    ]


def sample_us(fn, calls: int, faults: list | None = None) -> float:
    """us per call; appends the minor page faults per call to `faults` (fresh pages of large
    temporaries that the allocator gave back to the OS: part of what torch's ops cost here)."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    if faults is not None:
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / calls)
    return us


def calls_for(fn, sample_ms: float) -> int:
    fn()
    one = sample_us(fn, 3)
    return max(3, min(2000, int(sample_ms * 1e3 / max(one, 0.5))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 224])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--sample-ms", type=float, default=2.0)
    args = ap.parse_args()
    probe = torch.empty(1)
    if not ops.fused_elementwise_available(probe):
        print(f"the fused kernels are not in use (backend {ops.backend()}, freetoken._C built "
              "without them?)", file=sys.stderr)
        return 1
    rows = []
    plan = [(dt, T) for dt in args.dtypes for T in args.tokens]
    for i, (dt, T) in enumerate(plan):
        dtype = getattr(torch, dt)
        for op, fused, twin in cases(T, dtype):
            row = {"op": op, "dtype": dt, "tokens": T}
            for n in args.threads:
                torch.set_num_threads(n)
                counts = {"fused": calls_for(fused, args.sample_ms),
                          "twin": calls_for(twin, args.sample_ms)}
                times = {"fused": [], "twin": []}
                faults = {"fused": [], "twin": []}
                for r in range(args.repeats):
                    order = (("fused", fused), ("twin", twin))
                    for name, fn in order if r % 2 == 0 else order[::-1]:
                        times[name].append(sample_us(fn, counts[name], faults[name]))
                for name in ("fused", "twin"):
                    row[f"{name}_{n}t_us"] = round(statistics.median(times[name]), 2)
                    row[f"{name}_{n}t_faults"] = round(statistics.mean(faults[name]), 1)
            rows.append(row)
            print(f"[{i + 1}/{len(plan)}] {dt} T={T} {op}: " + ", ".join(
                f"{k} {v}" for k, v in row.items() if k.endswith("_us")), file=sys.stderr)
    torch.set_num_threads(max(args.threads))

    cols = [f"{kind}_{n}t_us" for n in args.threads for kind in ("fused", "twin")]
    head = " ".join(f"{c.removesuffix('_us').replace('_', ' '):>10}" for c in cols)
    speed = " ".join(f"{'x ' + str(n) + 't':>7}" for n in args.threads)
    speed += f" | {'faults/call 1t':>15}" if 1 in args.threads else ""
    print(f"# freetoken.ops {ops.backend()} ({ops.cpu_isa()}), torch {torch.__version__}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, medians, us per call")
    print(f"{'op':>12} {'dtype':>8} {'T':>4} | {head} | {speed}")
    for row in rows:
        vals = " ".join(f"{row[c]:>10.1f}" for c in cols)
        ratios = " ".join(f"{row[f'twin_{n}t_us'] / row[f'fused_{n}t_us']:>6.1f}x"
                          for n in args.threads)
        if 1 in args.threads:
            ratios += f" | {row['fused_1t_faults']:>6.0f} {row['twin_1t_faults']:>8.0f}"
        print(f"{row['op']:>12} {row['dtype']:>8} {row['tokens']:>4} | {vals} | {ratios}")
    print(json.dumps({"bench": "elementwise", "isa": ops.cpu_isa(),
                      "torch": torch.__version__, "repeats": args.repeats, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
