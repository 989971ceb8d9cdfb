#!/usr/bin/env python3
"""One decode step's layer linears over SmolLM2's own Q4_1 blocks (ops.pack_gguf_panels,
csrc/linear/quant_linear_cpu.cpp) against the same weights as fp32 panels (ops.pack_panels): every
attn_q/k/v, attn_output, ffn_gate/up/down of the 30 layers called once per step, in order, so
each weight comes from DRAM as in a decode step (425 MB fp32, 80 MB of blocks). The two forms
take turns step by step; medians of --repeats. The lm_head (token_embd, Q8_0) is timed apart.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/bench_gguf_linear.py [--ms 1 8 16] [--threads 2]

Progress goes to stderr; stdout gets the table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np  # noqa: E402
import torch  # noqa: E402

from freetoken import ops  # noqa: E402
from freetoken.loader import default_model_path  # noqa: E402

LAYER_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def load_forms(path) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, int]]]:
    """{"layers": [(blocks packed, fp32 packed, K)], "lm_head": [...]} from the GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    forms: dict[str, list] = {"layers": [], "lm_head": []}
    tensors = [t for t in reader.tensors if t.tensor_type.name in ops.GGUF_PANEL_TYPES]
    for i, t in enumerate(tensors):
        part = t.name.split(".")[2] if t.name.startswith("blk.") else t.name.split(".")[0]
        group = "layers" if part in LAYER_TENSORS else "lm_head" if part == "token_embd" else None
        if group is None:
            continue
        k, n = (int(s) for s in t.shape)
        raw = np.asarray(t.data).reshape(n, -1)
        w = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, t.tensor_type), np.float32))
        forms[group].append((ops.pack_gguf_panels(torch.from_numpy(np.array(raw)),
                                                  t.tensor_type.name, k),
                             ops.pack_panels(w.reshape(n, k)), k))
        print(f"\rpacking {i + 1}/{len(tensors)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return forms


def step_s(linears, which: int, m: int, xs: dict) -> float:
    start = time.perf_counter()
    for packed in linears:
        k = packed[2]
        x = xs.setdefault((m, k), torch.randn(m, k))
        ops.panel_linear(x, packed[which])
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    forms = load_forms(default_model_path())
    rows, xs = [], {}
    print(f"# GGUF Q4_1 blocks vs fp32 panels, one decode step's layer linears (30 layers), "
          f"{args.threads} threads, isa {ops.cpu_isa()}, medians of {args.repeats}")
    print(" rows | layers: blocks ms  fp32 ms  speed-up | lm_head (Q8_0): blocks ms  fp32 ms")
    for m in args.ms:
        times = {(g, w): [] for g in forms for w in (0, 1)}
        for _ in range(args.repeats):
            for g in forms:
                for w in (0, 1):
                    times[(g, w)].append(step_s(forms[g], w, m, xs))
        med = {key: statistics.median(v) * 1e3 for key, v in times.items()}
        row = {"M": m, "layers_blocks_ms": round(med[("layers", 0)], 3),
               "layers_fp32_ms": round(med[("layers", 1)], 3),
               "lm_head_blocks_ms": round(med[("lm_head", 0)], 3),
               "lm_head_fp32_ms": round(med[("lm_head", 1)], 3)}
        rows.append(row)
        print(f" {m:4d} | {row['layers_blocks_ms']:16.2f} {row['layers_fp32_ms']:8.2f} "
              f"{row['layers_fp32_ms'] / row['layers_blocks_ms']:8.2f}x | "
              f"{row['lm_head_blocks_ms']:24.2f} {row['lm_head_fp32_ms']:8.2f}", flush=True)
    print(json.dumps({"bench": "gguf_linear", "threads": args.threads,
                      "isa": ops.cpu_isa(), "rows": rows, "loadavg": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
