#!/usr/bin/env python3
"""What the int8 compute mode costs in fidelity, against the exact mode on the same file, with the
bare model (no server): the classify workload's prompts scored both ways (max |delta logprob| of
the exact mode's top-20 at the last position, the top-1 token's |delta| and top-1 agreement), and
greedy continuations of the 16 decode prompts (how many agree token for token with exact, and
where the others first part). llama-server's own drift on the same file is compare_peers.py's
drift table (its classify requests against FreeToken fp32).

    OMP_WAIT_POLICY=PASSIVE python3 scripts/int8_fidelity.py [--model F.gguf] [--classify-n 64]
        [--decode-tokens 64]

Progress goes to stderr; stdout gets the figures and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402

from freetoken import ops  # noqa: E402
from freetoken.engine.generate import build_forward_batch, generate  # noqa: E402
from freetoken.loader import load_model  # noqa: E402
from freetoken.testing.workloads import DECODE_PROMPTS, build_workload  # noqa: E402

BLOCK = 16


def last_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    kv = loaded.model.make_kv_cache(-(-len(ids) // BLOCK), BLOCK)
    batch = build_forward_batch([(ids, 0, list(range(-(-len(ids) // BLOCK))))], BLOCK)
    return loaded.model.compute_logits(loaded.model.forward(batch, kv))[0].log_softmax(-1)


def run_mode(path, mode: str, classify: list[str], decode_tokens: int) -> dict:
    ops.configure(compute=mode)
    t0 = time.perf_counter()
    loaded = load_model(path, progress=False)
    tok = loaded.tokenizer
    scores = []
    for i, text in enumerate(classify):
        scores.append(last_logprobs(loaded, tok.encode(text)))
        print(f"\r{mode}: classify {i + 1}/{len(classify)}", end="", file=sys.stderr)
    conts = []
    for i, text in enumerate(DECODE_PROMPTS):
        conts.append(generate(loaded, tok.encode(text), decode_tokens)[0])
        print(f"\r{mode}: decode {i + 1}/{len(DECODE_PROMPTS)}   ", end="", file=sys.stderr)
    print(f"\r{mode}: done in {time.perf_counter() - t0:.0f} s        ", file=sys.stderr)
    return {"scores": torch.stack(scores), "conts": conts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--classify-n", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    classify = [r.prompt for r in build_workload("classify", args.classify_n)]
    exact = run_mode(args.model, "exact", classify, args.decode_tokens)
    int8 = run_mode(args.model, "int8", classify, args.decode_tokens)
    top = exact["scores"].topk(20, dim=-1).indices
    delta = (exact["scores"].gather(1, top) - int8["scores"].gather(1, top)).abs()
    agree = float((exact["scores"].argmax(-1) == int8["scores"].argmax(-1)).float().mean())
    same, parts = 0, []
    for a, b in zip(exact["conts"], int8["conts"]):
        if a == b:
            same += 1
        else:
            parts.append(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y))
    out = {"model": os.path.basename(str(args.model or "SmolLM2-135M-Instruct.Q4_1.gguf")),
           "classify_n": len(classify), "top20_max_abs_delta": float(delta.max()),
           "top1_max_abs_delta": float(delta[:, 0].max()),
           "top1_mean_abs_delta": float(delta[:, 0].mean()), "top1_agreement": agree,
           "decode_prompts": len(DECODE_PROMPTS), "decode_tokens": args.decode_tokens,
           "decode_identical": same, "first_divergence": sorted(parts)}
    print(f"classify ({len(classify)} prompts): top-20 max |d logprob| "
          f"{out['top20_max_abs_delta']:.4f}, top-1 max {out['top1_max_abs_delta']:.4f} "
          f"mean {out['top1_mean_abs_delta']:.4f}, top-1 agreement {agree:.1%}")
    print(f"greedy {args.decode_tokens} tokens of the {len(DECODE_PROMPTS)} decode prompts: "
          f"{same} identical to exact; the others part at tokens {sorted(parts)}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
