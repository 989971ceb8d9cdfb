#!/usr/bin/env python3
"""Paged attention per layer on SmolLM2's shapes: the extension's in-place kernel
(ops.paged_attention, every sequence in one call, the step's K/V written by the op: "kernel";
"kernel_read" without the write) against the torch path (index_copy_ of the step's K/V, gather
the context by blocks, then one padded SDPA with an additive mask).

Two steps: the classify step (8 sequences x 28 queries behind a 176-token prefix whose blocks
they share) and decode (--seqs x 1 query at --context). One call per layer over --layers
separate KV pools (so K/V come from memory, not cache, as in a real step), interleaved rounds,
medians. Prints one JSON line.

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
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from freetoken import ops  # noqa: E402

BS = 16


def make_step(num_seqs, num_q, context, shared_prefix, layers, nh, kvh, hd):
    """-> (pools, block_tables, seq_lens, query_start_loc, q, additive mask [S, 1, Q, L],
    (k, v, slot_mapping) of the step's tokens; q, k, v are views into one qkv tensor)."""
    nb = -(-context // BS)
    own = nb - shared_prefix // BS  # blocks of each sequence's own (shared: the prefix's)
    pool_blocks = max(shared_prefix // BS + num_seqs * own + 8, 256)
    perm = torch.randperm(pool_blocks)
    prefix = perm[: shared_prefix // BS].tolist()
    rest = perm[len(prefix):].tolist()
    tables = torch.tensor([prefix + rest[s * own: (s + 1) * own] for s in range(num_seqs)])
    pools = [(torch.randn(pool_blocks, BS, kvh, hd), torch.randn(pool_blocks, BS, kvh, hd))
             for _ in range(layers)]
    lens = torch.full((num_seqs,), context, dtype=torch.long)
    qsl = torch.arange(num_seqs + 1) * num_q
    T = num_seqs * num_q  # noqa: N806
    qkv = torch.randn(T, (nh + 2 * kvh) * hd)
    q = qkv[:, : nh * hd].view(T, nh, hd)
    k = qkv[:, nh * hd : (nh + kvh) * hd].view(T, kvh, hd)
    v = qkv[:, (nh + kvh) * hd :].view(T, kvh, hd)
    slots = torch.tensor([int(tables[s, p // BS]) * BS + p % BS for s in range(num_seqs)
                          for p in range(context - num_q, context)])
    q_pos = torch.arange(context - num_q, context)
    hidden = torch.arange(context)[None, :] > q_pos[:, None]  # [Q, L]
    mask = torch.zeros(num_q, context).masked_fill_(hidden, -float("inf"))
    mask = mask.expand(num_seqs, 1, num_q, context).contiguous()
    return pools, tables, lens, qsl, q, mask, (k, v, slots)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=8, help="decode sequences")
    ap.add_argument("--context", type=int, default=101, help="decode context")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args()
    if not ops.paged_attention_available(torch.device("cpu"), torch.float32):
        print("freetoken._C has no paged_attention (not built?)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    nh, kvh, hd = args.heads, args.kv_heads, args.head_dim
    scale = hd**-0.5
    print(f"allocating 2 x {args.layers} layer pools ...", file=sys.stderr)
    steps = {
        "classify_8x28": make_step(8, 28, 204, 176, args.layers, nh, kvh, hd),
        f"decode_{args.seqs}x1": make_step(args.seqs, 1, args.context, 0, args.layers, nh, kvh,
                                           hd),
    }

    def kernel(pools, tables, lens, qsl, q, mask, new):
        k, v, slots = new
        for kc, vc in pools:
            ops.paged_attention(q, kc, vc, tables, lens, qsl, scale, None, k=k, v=v,
                                slot_mapping=slots)

    def kernel_read(pools, tables, lens, qsl, q, mask, new):
        for kc, vc in pools:
            ops.paged_attention(q, kc, vc, tables, lens, qsl, scale, None)

    def gather_sdpa(pools, tables, lens, qsl, q, mask, new):
        S, Q, L = mask.shape[0], mask.shape[2], mask.shape[3]  # noqa: N806
        qg = q.view(S, Q, nh, hd).transpose(1, 2)
        for k, v in pools:
            k.view(-1, kvh, hd).index_copy_(0, new[2], new[0])
            v.view(-1, kvh, hd).index_copy_(0, new[2], new[1])
            kg = k.index_select(0, tables.reshape(-1)).view(S, -1, kvh, hd)[:, :L]
            vg = v.index_select(0, tables.reshape(-1)).view(S, -1, kvh, hd)[:, :L]
            F.scaled_dot_product_attention(qg, kg.transpose(1, 2), vg.transpose(1, 2),
                                           attn_mask=mask, scale=scale, enable_gqa=True)

    methods = {"kernel": kernel, "kernel_read": kernel_read, "gather_sdpa": gather_sdpa}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in steps}
    for r in range(args.rounds + 1):  # round 0: warm-up
        for name, step in steps.items():
            for method, fn in methods.items():
                t0 = time.perf_counter()
                fn(*step)
                if r:
                    us = (time.perf_counter() - t0) / args.layers * 1e6
                    times[name].setdefault(method, []).append(us)
        print(f"round {r}/{args.rounds}", file=sys.stderr)
    med = {name: {m: statistics.median(v) for m, v in t.items()} for name, t in times.items()}
    for name, t in med.items():
        print(f"{name}: us per layer " + ", ".join(f"{m} {v:.0f}" for m, v in t.items())
              + f" (gather + SDPA / kernel {t['gather_sdpa'] / t['kernel']:.2f}x)",
              file=sys.stderr)
    print(json.dumps({"threads": args.threads, "us_per_layer": med,
                      "loadavg": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
