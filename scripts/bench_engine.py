#!/usr/bin/env python3
"""Engine benchmark through the Python API (no HTTP): the classify and decode workloads, with the
prefix cache on and off. Prints progress to stderr, a table, then one JSON line.

classify: a shared ~170-token few-shot instruction prefix + a unique ~25-token review +
          "Sentiment:", max_tokens 1, temperature 0, logprobs 2; 200 requests, 8 in flight.
decode:   16 distinct short prompts, 8 in flight, 128 greedy tokens each (ignore_eos), plus the
          single-stream baseline (1 in flight) on the first --single-prompts of them; single and
          batched rounds alternate, and so do the cache-on/off classify rounds (the machine's
          speed drifts: other processes share its cores).

    OMP_WAIT_POLICY=PASSIVE python3 scripts/bench_engine.py [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when OpenMP starts
import torch  # noqa: E402

from freetoken.config import EngineConfig  # noqa: E402
from freetoken.engine import Engine  # noqa: E402
from freetoken.engine.sampling_params import SamplingParams  # noqa: E402
from freetoken.loader import load_model  # noqa: E402

# The workloads are scripts/bench_serve.py's (the same prompts through the engine API and over
# HTTP).
from freetoken.testing.workloads import DECODE_PROMPTS, PREFIX, reviews  # noqa: E402


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_concurrent(engine: Engine, prompts, params, in_flight: int, label: str):
    """Submit through the asyncio API with at most `in_flight` requests outstanding."""
    outs: list = [None] * len(prompts)
    step = max(1, len(prompts) // 10)

    async def main():
        nxt = iter(range(len(prompts)))
        done = [0]

        async def worker():
            for i in nxt:
                toks, cached = [], 0
                async for out in engine.submit(prompts[i], params):
                    toks += out.new_token_ids
                    cached = out.num_cached_tokens
                outs[i] = (toks, cached)
                done[0] += 1
                if done[0] % step == 0:
                    progress(f"  {label}: {done[0]}/{len(prompts)}")

        await asyncio.gather(*(worker() for _ in range(in_flight)))

    t0 = time.perf_counter()
    asyncio.run(main())
    return outs, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-classify", type=int, default=200)
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--num-decode", type=int, default=16)
    ap.add_argument("--single-prompts", type=int, default=2,
                    help="prompts run one at a time for the single-stream baseline")
    ap.add_argument("--num-kv-blocks", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5,
                    help="classify: interleaved on/off rounds the requests are split into")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--workload", choices=["all", "classify", "decode"], default="all")
    ap.add_argument("--cache", choices=["all", "both", "on", "partial", "off"], default="all",
                    help="on: full-block prefix cache (the default server); partial: also "
                    "token-granular hit ends (--partial-block-reuse); both: on and off")
    ap.add_argument("--quick", action="store_true", help="40 classify, 32 decode tokens")
    args = ap.parse_args()
    if args.quick:
        args.num_classify, args.decode_tokens = 40, 32
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)

    cfg0 = EngineConfig(device=args.device, dtype=args.dtype)
    progress(f"loading model on {args.device} ({cfg0.torch_dtype}) ...")
    loaded = load_model(args.model, dtype=cfg0.torch_dtype, device=args.device, progress=False)
    tok = loaded.tokenizer
    from freetoken import ops
    results: dict = {"device": args.device, "dtype": str(cfg0.torch_dtype).removeprefix("torch."),
                     "ops_backend": ops.backend_for(args.device),
                     "threads": torch.get_num_threads()}
    rows = []
    classify_prompts = [tok.encode(PREFIX + f"Review: {r}\nSentiment:")
                        for r in reviews(args.num_classify)]
    shared = len(os.path.commonprefix([tuple(p) for p in classify_prompts[:50]]))
    results["classify_prompt_tokens_mean"] = sum(map(len, classify_prompts)) / len(
        classify_prompts)
    results["classify_shared_prefix_tokens"] = shared
    decode_prompts = [tok.encode(p) for p in DECODE_PROMPTS[:args.num_decode]]
    modes = {"on": (True, False), "partial": (True, True), "off": (False, False)}
    tags = {"all": ["on", "partial", "off"], "both": ["on", "off"]}.get(args.cache, [args.cache])
    engines = {}
    for tag in tags:
        cache, partial = modes[tag]
        engines[tag] = Engine(EngineConfig(
            num_kv_blocks=args.num_kv_blocks, device=args.device, dtype=args.dtype,
            enable_prefix_cache=cache, enable_partial_block_reuse=partial,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=max(args.in_flight, 8)), loaded).start()
    for engine in engines.values():  # warm-up (allocator, kernels), outside the timings
        engine.generate([decode_prompts[0]], SamplingParams(max_tokens=2, temperature=0))

    # NOTE: the machine is shared and its speed drifts; the cache-on and cache-off engines run
    # the classify requests in interleaved rounds (alternating which goes first), so drift
    # hits both alike. The 200 requests are the same for both.
    if args.workload in ("all", "classify"):
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)
        n_rounds = max(1, min(args.rounds, len(classify_prompts)))
        per = -(-len(classify_prompts) // n_rounds)
        acc = {tag: {"wall": 0.0, "outs": []} for tag in engines}
        for r in range(n_rounds):
            chunk = classify_prompts[r * per:(r + 1) * per]
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for tag in order:
                progress(f"classify round {r + 1}/{n_rounds}, prefix cache {tag}: "
                         f"{len(chunk)} requests, {args.in_flight} in flight")
                outs, wall = run_concurrent(engines[tag], chunk, params, args.in_flight,
                                            f"classify/{tag}")
                acc[tag]["wall"] += wall
                acc[tag]["outs"] += outs
        n_prompt = sum(map(len, classify_prompts))
        for tag, a in acc.items():
            outs, wall = a["outs"], a["wall"]
            cached = sum(c for _, c in outs)
            r = {"requests_per_s": len(outs) / wall, "prompt_tokens_per_s": n_prompt / wall,
                 "wall_s": wall, "cached_tokens_frac": cached / n_prompt,
                 "labels": sorted({tok.decode(t) for t, _ in outs})[:4]}
            results[f"classify_cache_{tag}"] = r
            rows.append((f"classify cache {tag}", r["requests_per_s"], r["prompt_tokens_per_s"],
                         wall, f"cached {100 * r['cached_tokens_frac']:.0f}% of prompt tokens"))
        if "off" in acc:
            for tag in [t for t in acc if t != "off"]:
                same = all(x[0] == y[0] for x, y in zip(acc[tag]["outs"], acc["off"]["outs"]))
                results[f"classify_outputs_identical_{tag}_off"] = same

    if args.workload in ("all", "decode"):
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        for tag, engine in engines.items():
            if tag == "partial":  # decode prompts share nothing: the same as "on"
                continue
            # NOTE: single-stream runs and batched rounds alternate (drift hits both alike)
            single_prompts = decode_prompts[:args.single_prompts]
            rounds = max(1, len(single_prompts))
            per = -(-len(decode_prompts) // rounds)
            s_tok = s_wall = b_tok = b_wall = 0.0
            for r in range(rounds):
                if r < len(single_prompts):
                    progress(f"decode single stream, cache {tag}: prompt {r + 1}")
                    souts, w = run_concurrent(engine, [single_prompts[r]], params, 1,
                                              f"single/{tag}")
                    s_tok += sum(len(t) for t, _ in souts)
                    s_wall += w
                chunk = decode_prompts[r * per:(r + 1) * per]
                progress(f"decode round {r + 1}/{rounds}, cache {tag}: {len(chunk)} prompts x "
                         f"{args.decode_tokens} tokens, {args.in_flight} in flight")
                outs, w = run_concurrent(engine, chunk, params, args.in_flight, f"decode/{tag}")
                b_tok += sum(len(t) for t, _ in outs)
                b_wall += w
            r = {"requests_per_s": len(decode_prompts) / b_wall, "tokens_per_s": b_tok / b_wall,
                 "wall_s": b_wall}
            r["single_stream_tokens_per_s"] = s_tok / s_wall if s_wall else float("nan")
            r["speedup_vs_single"] = r["tokens_per_s"] / r["single_stream_tokens_per_s"]
            results[f"decode_cache_{tag}"] = r
            rows.append((f"decode x{args.in_flight} cache {tag}", r["requests_per_s"],
                         r["tokens_per_s"], b_wall,
                         f"single {r['single_stream_tokens_per_s']:.1f} tok/s, "
                         f"{r['speedup_vs_single']:.2f}x"))
    for tag, engine in engines.items():
        results[f"engine_stats_cache_{tag}"] = {k: v for k, v in engine.stats().items()
                                                if k != "finish_reasons"}
        engine.shutdown()
    engines.clear()
    gc.collect()

    for tag in ("on", "partial"):
        if f"classify_cache_{tag}" in results and "classify_cache_off" in results:
            results[f"classify_speedup_cache_{tag}_vs_off"] = (
                results[f"classify_cache_{tag}"]["requests_per_s"]
                / results["classify_cache_off"]["requests_per_s"])
    print(f"\n{'workload':<24}{'req/s':>10}{'tok/s':>12}{'wall s':>9}  notes")
    for name, rps, tps, wall, note in rows:
        print(f"{name:<24}{rps:>10.2f}{tps:>12.1f}{wall:>9.1f}  {note}")
    if "classify_speedup_cache_on_vs_off" in results:
        print(f"classify speedup, cache on vs off: "
              f"{results['classify_speedup_cache_on_vs_off']:.2f}x "
              f"(shared prefix {shared} tokens of {results['classify_prompt_tokens_mean']:.0f})")
    print(json.dumps(results, default=float))


if __name__ == "__main__":
    main()
