#!/usr/bin/env python3
"""Decode attention per layer: the extension's in-place paged kernel (ops.paged_decode_attention)
against the torch path (gather the context by blocks, then SDPA), on SmolLM2's shapes.

One call per layer over --layers separate KV pools (so the K/V come from memory, not cache, as in
a real step), interleaved rounds, medians. Prints one JSON line.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/bench_attention.py [--seqs 8] [--context 101]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from freetoken import ops  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--context", type=int, default=101)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    if not ops.paged_decode_available(torch.device("cpu")):
        print("freetoken._C has no paged_decode_attention (not built?)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    S, nh, kvh, hd, bs = args.seqs, args.heads, args.kv_heads, args.head_dim, 16  # noqa: N806
    nb = -(-args.context // bs)
    pool_blocks = max(4 * S * nb, 256)
    print(f"allocating {args.layers} layer pools of {pool_blocks} blocks ...", file=sys.stderr)
    pools = [(torch.randn(pool_blocks, bs, kvh, hd), torch.randn(pool_blocks, bs, kvh, hd))
             for _ in range(args.layers)]
    table = torch.randperm(pool_blocks)[: S * nb].view(S, nb)
    lens = torch.full((S,), args.context, dtype=torch.long)
    q = torch.randn(S, nh, hd)
    mask = torch.zeros(S, 1, 1, args.context)
    scale = hd**-0.5

    def kernel():
        for k, v in pools:
            ops.paged_decode_attention(q, k, v, table, lens, scale, None)

    def gather_sdpa():
        for k, v in pools:
            kg = k.index_select(0, table.reshape(-1)).view(S, -1, kvh, hd)[:, : args.context]
            vg = v.index_select(0, table.reshape(-1)).view(S, -1, kvh, hd)[:, : args.context]
            F.scaled_dot_product_attention(q.view(S, 1, nh, hd).transpose(1, 2),
                                           kg.transpose(1, 2), vg.transpose(1, 2),
                                           attn_mask=mask, scale=scale, enable_gqa=True)

    times = {"kernel": [], "gather_sdpa": []}
    for fn in (kernel, gather_sdpa):
        fn()  # warm-up
    for r in range(args.rounds):
        for name, fn in (("kernel", kernel), ("gather_sdpa", gather_sdpa)):
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / args.layers * 1e6)
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"per layer: kernel {med['kernel']:.0f} us, gather + SDPA {med['gather_sdpa']:.0f} us "
          f"({med['gather_sdpa'] / med['kernel']:.2f}x)", file=sys.stderr)
    print(json.dumps({"seqs": S, "context": args.context, "threads": args.threads,
                      "us_per_layer": med, "loadavg": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
