#!/usr/bin/env python3
"""One engine step's forward, bare: the classify step (8 sequences x 28 new tokens behind a
176-token cached prefix) and the decode steps (8 x 1 and 1 x 1 at context 100) on SmolLM2 (or
--model), with
the lm_head timed apart. Medians. For A/B runs of the forward's pieces:

    OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=2 python3 scripts/bench_step.py [--profile]
    ... --linear panels     # fp32 panels only: no GGUF blocks for the few-row steps
    ... --linear onednn     # oneDNN packed weights instead of the panel kernel (fp32)
    ... --linear torch      # MKL F.linear
    ... --backend torch     # every freetoken._C kernel off: the torch twins (decode attention
                            # by gather + SDPA, unfused norms/RoPE/SiLU, no panels)
    ... --pool-poll-us 0    # the kernels' thread pool sleeps at once between calls
    ... --compute int8      # the int8 compute mode (a GGUF's quantized linears)
(each flag is a freetoken.ops.configure argument, set before the model loads).

--profile adds torch.profiler's op table for the classify and decode steps; --unfused runs each
decoder layer's Python path instead of its one C++ call (ops.decoder_layer), for A/B runs;
--breakdown then times the classify step's pieces on that Python path (each projection, attention,
RMSNorm, SiLU-mul, RoPE: wall time around each call, so the elementwise pieces read slower than
inside the fused layer).
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

from freetoken import ops  # noqa: E402
from freetoken.engine.generate import build_forward_batch  # noqa: E402
from freetoken.loader import load_model  # noqa: E402

BS = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF or HF folder (default: SmolLM2)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--unfused", action="store_true", help="decoder layers in Python")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the classify step's pieces (on the Python path)")
    ap.add_argument("--linear", default="auto", choices=ops.LINEAR_MODES)
    ap.add_argument("--backend", default="auto", choices=ops.BACKENDS)
    ap.add_argument("--pool-poll-us", type=int, default=None)
    ap.add_argument("--compute", default="exact", choices=ops.COMPUTE_MODES)
    args = ap.parse_args()
    ops.configure(backend=args.backend, linear=args.linear, pool_poll_us=args.pool_poll_us,
                  compute=args.compute)
    print(f"loading {args.model or 'SmolLM2'} ...", file=sys.stderr)
    lm = load_model(args.model, dtype=getattr(torch, args.dtype), load_tokenizer=False,
                    progress=False)
    m, vocab = lm.model, lm.config.vocab_size
    if args.unfused:
        for layer in m.layers:
            layer.fused = None
    kv = m.make_kv_cache(256, BS)
    g = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    prefix_blocks = list(range(11))  # 176 tokens, computed once: the cached prefix
    m.forward(build_forward_batch([(tokens(176), 0, prefix_blocks)], BS), kv)
    steps = {
        "classify_8x28": build_forward_batch(
            [(tokens(28), 176, prefix_blocks + [11 + 2 * s, 12 + 2 * s]) for s in range(8)], BS),
        "decode_8x1": build_forward_batch(
            [(tokens(1), 100, list(range(40 + 7 * s, 47 + 7 * s))) for s in range(8)], BS),
        "decode_1x1": build_forward_batch([(tokens(1), 100, list(range(40, 47)))], BS),
    }
    out = {}
    for name, batch in steps.items():
        for _ in range(3):
            m.compute_logits(m.forward(batch, kv))
        fwd, head = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            h = m.forward(batch, kv)
            t1 = time.perf_counter()
            m.compute_logits(h)
            fwd.append(t1 - t0)
            head.append(time.perf_counter() - t1)
        out[name] = {"forward_ms": statistics.median(fwd) * 1e3,
                     "lm_head_ms": statistics.median(head) * 1e3}
        print(f"{name}: forward {out[name]['forward_ms']:.1f} ms, lm_head "
              f"{out[name]['lm_head_ms']:.1f} ms", file=sys.stderr)
    if args.breakdown:
        out["classify_pieces_ms"] = breakdown(m, steps["classify_8x28"], kv, args.repeats)
    if args.profile:
        from torch.profiler import profile
        for name in ("classify_8x28", "decode_8x1"):
            with profile() as p:
                for _ in range(5):
                    m.compute_logits(m.forward(steps[name], kv))
            print(name, file=sys.stderr)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15),
                  file=sys.stderr)
    print(json.dumps({"dtype": args.dtype, "compute": args.compute,
                      "threads": torch.get_num_threads(),
                      "linear": args.linear, "ops": args.backend,
                      "pool_poll_us": ops.config().pool_poll_us,
                      "fused_layers": sum(layer.fused is not None for layer in m.layers),
                      "steps": out,
                      "loadavg": os.getloadavg()}))
    return 0


def breakdown(m, batch, kv, repeats: int) -> dict[str, float]:
    """Mean ms a step of each piece of the Python path (timers around each call; the layers'
    fused calls are off meanwhile)."""
    from freetoken.model import linear as linear_mod
    from freetoken.model import llama

    spent: dict[str, float] = {}

    def timed(label, fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t0
        return call

    names = {id(mod): name.rsplit(".", 1)[-1] for layer in m.layers
             for name, mod in layer.named_modules() if isinstance(mod, linear_mod.Linear)}
    patched = [(llama, "paged_attention"), (ops, "silu_mul"), (ops, "rms_norm"), (ops, "rope_")]
    saved = [getattr(mod, name) for mod, name in patched]
    forward, fused = linear_mod.Linear.forward, [layer.fused for layer in m.layers]
    for mod, name in patched:
        setattr(mod, name, timed(name, getattr(mod, name)))

    def linear_forward(self, x):
        return timed(names.get(id(self), "other linear"), forward)(self, x)

    linear_mod.Linear.forward = linear_forward
    for layer in m.layers:
        layer.fused = None
    try:
        t0 = time.perf_counter()
        for _ in range(repeats):
            m.compute_logits(m.forward(batch, kv))
        total = (time.perf_counter() - t0) / repeats * 1e3
    finally:
        for (mod, name), fn in zip(patched, saved):
            setattr(mod, name, fn)
        linear_mod.Linear.forward = forward
        for layer, f in zip(m.layers, fused):
            layer.fused = f
    pieces = {k: v / repeats * 1e3 for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    pieces["rest"] = total - sum(pieces.values())
    print(f"classify_8x28 pieces ({total:.1f} ms a step):", file=sys.stderr)
    for k, v in pieces.items():
        print(f"  {k:16s} {v:8.1f} ms  {100 * v / total:5.1f} %", file=sys.stderr)
    return pieces


if __name__ == "__main__":
    sys.exit(main())
