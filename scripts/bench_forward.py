"""Bare-forward benchmark: load time, peak RSS, prefill tokens/s, single-stream decode tokens/s
(and batched decode tokens/s) of FreeToken's model, no engine or server.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/bench_forward.py [--model PATH] [--threads N]
        [--dtype float32|bfloat16] [--prompt-len 256] [--decode-tokens 64] [--decode-batch 8]
    python3 scripts/bench_forward.py --compare-wait-policy   # PASSIVE vs the OpenMP default

Prints a table and, last, one JSON line. Progress goes to stderr.
NOTE: OMP_WAIT_POLICY is read once when OpenMP starts, so it must be set in the environment before
torch is imported; --compare-wait-policy re-runs this script in subprocesses for each setting.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench(args) -> dict:
    import torch

    from freetoken.engine.generate import build_forward_batch
    from freetoken.loader import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    loaded = load_model(
        args.model, dtype=dtype, device=args.device, load_tokenizer=args.with_tokenizer
    )
    load_s = time.perf_counter() - t0
    rss_after_load_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model, cfg = loaded.model, loaded.config
    bs = 16
    g = torch.Generator().manual_seed(0)

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def prompt(n):
        return torch.randint(100, cfg.vocab_size, (n,), generator=g).tolist()

    total = args.prompt_len + args.decode_tokens
    num_blocks_one = -(-total // bs)
    kv = model.make_kv_cache(num_blocks_one * max(1, args.decode_batch), bs)
    blocks = list(range(num_blocks_one))

    # prefill: one sequence of prompt_len tokens, best of `repeats`
    ids = prompt(args.prompt_len)
    prefill_s = []
    for r in range(args.repeats + 1):
        batch = build_forward_batch([(ids, 0, blocks)], bs, args.device)
        sync()
        t = time.perf_counter()
        model.compute_logits(model.forward(batch, kv))
        sync()
        if r:  # the first run is warm-up
            prefill_s.append(time.perf_counter() - t)
        log(f"prefill {r}/{args.repeats}: {time.perf_counter() - t:.3f}s")
    prefill_tps = args.prompt_len / min(prefill_s)

    # single-stream decode after the prompt
    token, step_s = ids[-1], []
    for i in range(args.decode_tokens):
        batch = build_forward_batch([([token], args.prompt_len + i, blocks)], bs, args.device)
        sync()
        t = time.perf_counter()
        logits = model.compute_logits(model.forward(batch, kv))
        token = int(logits[0].argmax())
        sync()
        step_s.append(time.perf_counter() - t)
        if i % 16 == 15:
            log(f"decode {i + 1}/{args.decode_tokens}: {1 / step_s[-1]:.1f} tok/s")
    steady = sorted(step_s[1:] or step_s)
    decode_tps = 1 / steady[len(steady) // 2]  # median step

    # batched decode: decode_batch sequences, each with prompt_len context
    batch_tps = None
    if args.decode_batch > 1:
        tables = [
            list(range(s * num_blocks_one, (s + 1) * num_blocks_one))
            for s in range(args.decode_batch)
        ]
        for s in range(1, args.decode_batch):  # their prompts, one prefill each
            model.forward(
                build_forward_batch([(prompt(args.prompt_len), 0, tables[s])], bs, args.device), kv
            )
        tokens, times = [ids[-1]] * args.decode_batch, []
        for i in range(min(16, args.decode_tokens)):
            seqs = [([tokens[s]], args.prompt_len + i, tables[s]) for s in range(args.decode_batch)]
            batch = build_forward_batch(seqs, bs, args.device)
            sync()
            t = time.perf_counter()
            tokens = model.compute_logits(model.forward(batch, kv)).argmax(-1).tolist()
            sync()
            times.append(time.perf_counter() - t)
        times = sorted(times[1:])
        batch_tps = args.decode_batch / times[len(times) // 2]
        log(f"batched decode x{args.decode_batch}: {batch_tps:.1f} tok/s")

    import torch as _t

    return {
        "model": str(loaded.path.name),
        "arch": cfg.arch,
        "dtype": args.dtype,
        "device": args.device,
        "threads": _t.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "load_s": round(load_s, 2),
        "load_includes_tokenizer": args.with_tokenizer,
        "rss_after_load_mb": round(rss_after_load_mb),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "prompt_len": args.prompt_len,
        "prefill_tok_s": round(prefill_tps, 1),
        "decode_tok_s": round(decode_tps, 2),
        "decode_batch": args.decode_batch,
        "batched_decode_tok_s": round(batch_tps, 1) if batch_tps else None,
    }


def print_table(rows: list[dict]) -> None:
    keys = [
        "omp_wait_policy",
        "threads",
        "dtype",
        "load_s",
        "peak_rss_mb",
        "prefill_tok_s",
        "decode_tok_s",
        "batched_decode_tok_s",
    ]
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    print("  ".join(k.ljust(w) for k, w in zip(keys, widths)))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--with-tokenizer", action="store_true", help="include the tokenizer in the load (as serve)"
    )
    p.add_argument(
        "--compare-wait-policy",
        action="store_true",
        help="run PASSIVE and the OpenMP default in subprocesses, 1 and 2 threads",
    )
    p.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.compare_wait_policy:
        rows = []
        base = [a for a in sys.argv[1:] if a != "--compare-wait-policy"]
        for policy in ("PASSIVE", None):
            for threads in (1, 2):
                env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
                if policy:
                    env["OMP_WAIT_POLICY"] = policy
                log(f"== OMP_WAIT_POLICY={policy or '(default)'} threads={threads}")
                out = subprocess.run(
                    [sys.executable, __file__, *base, "--threads", str(threads), "--json-only"],
                    env=env,
                    check=True,
                    text=True,
                    stdout=subprocess.PIPE,
                ).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
        print_table(rows)
        print(json.dumps({"runs": rows}))
        return
    result = bench(args)
    if not args.json_only:
        print_table([result])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
