#!/usr/bin/env python3
"""A GGUF's layer linears computed in place (ops.gguf_matrix, csrc/linear/gguf_linear.cpp)
against the same weights dequantized into fp32 panels (ops.pack_panels), as block panels
(ops.pack_gguf_panels, csrc/linear/quant_linear_cpu.cpp: Q4_1 / Q8_0 / Q4_K / Q6_K, the other
types in place) and, with --int8, the int8 compute mode
(ops.int8_matrix, csrc/linear/int8_linear.cpp), by step size: every layer's
matrices called once per step, in order, so each weight comes from DRAM as in a forward. The
forms take turns step by step; medians of --repeats. GF/s = 2 x rows x weights / time (int8:
integer ops); with --int8 the int8 bound is measured first (the int8 loop's instructions on
registers, --threads threads, best of 5) and each int8 rate is also given as its fraction.

    OMP_WAIT_POLICY=PASSIVE python3 scripts/bench_gguf_linear.py [--model F.gguf]
        [--rows 1 8 64 224] [--layers N] [--types Q6_K ...] [--threads 2] [--no-panels]
        [--int8] [--no-amx] [--cpu-isa avx2] [--no-avx-vnni]

--layers: only the first N layers (the fp32 panels of a 1B file are ~4 GB); --types: only the
matrices of these GGUF types; --no-panels: no fp32 panels. Progress goes to stderr; stdout
gets the table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np  # noqa: E402
import torch  # noqa: E402

from freetoken import ops  # noqa: E402
from freetoken.loader import default_model_path  # noqa: E402


def load_forms(path: str, layers: int | None, panels: bool, int8: bool,
               types: list[str] | None = None) -> list[dict]:
    """[{k, n, type, in_place, panels, int8}] for every 2-D tensor of the first `layers`
    layers (of `types` only, where given)."""
    import gguf

    reader = gguf.GGUFReader(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the read-only map is only read
        mapping = torch.from_numpy(reader.data)
    out = []
    for t in reader.tensors:
        if not t.name.startswith("blk.") or len(t.shape) != 2:
            continue
        if layers is not None and int(t.name.split(".")[1]) >= layers:
            continue
        if types and t.tensor_type.name not in types:
            continue
        k, n = int(t.shape[0]), int(t.shape[1])
        offsets = torch.arange(n) * (int(t.n_bytes) // n) + int(t.data_offset)
        form = {"k": k, "n": n, "type": t.tensor_type.name, "mapping": mapping,
                "in_place": ops.gguf_matrix(mapping, offsets, [t.tensor_type.name], [n], k)}
        if int8 and ops.int8_matrix_available(t.tensor_type.name):
            form["int8"] = ops.int8_matrix(mapping, offsets, [t.tensor_type.name], [n], k)
        elif int8:  # no int8 kernel for this type: the int8 mode computes it exact
            form["int8"] = form["in_place"]
        rows = np.asarray(t.data).view(np.uint8).reshape(n, -1)
        if panels:
            form["panels"] = ops.pack_panels(ops.dequantize_gguf(rows, t.tensor_type.name, k))
        if t.tensor_type.name in ops.GGUF_PANEL_TYPES:
            form["block_panels"] = ops.pack_gguf_panels(torch.from_numpy(np.array(rows)),
                                                        t.tensor_type.name, k)
        else:  # the types without block panels stay in place there, as in the server
            form["block_panels"] = form["in_place"]
        out.append(form)
        print(f"\r{len(out)} matrices", end="", file=sys.stderr)
    print(file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 224])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--types", nargs="+", default=None, help="only these GGUF types")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-panels", action="store_true")
    ap.add_argument("--int8", action="store_true", help="the int8 mode too, and its bound")
    ap.add_argument("--no-amx", action="store_true",
                    help="the int8 mode without its AMX loop (the VNNI loop and bound instead)")
    ap.add_argument("--cpu-isa", default="auto", choices=("auto", "avx512", "avx2", "base"),
                    help="every loop at this ISA variant (e.g. AVX2 on an AVX-512 host)")
    ap.add_argument("--no-avx-vnni", action="store_true",
                    help="the int8 AVX2 loop by vpmaddubsw where the CPU has AVX-VNNI")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cpu_isa != "auto":
        ops.configure(cpu_isa=args.cpu_isa)
    if args.no_amx and ops.int8_amx_available():
        ops.set_int8_amx(False)
    if args.no_avx_vnni:
        ops.set_int8_avx_vnni(False)
    path = args.model or str(default_model_path())
    bound = None
    if args.int8:
        bound = max(ops.int8_peak_gops(2_000_000, args.threads) for _ in range(5))
        print(f"int8 bound: {bound:.0f} GOP/s ({args.threads} threads of register "
              f"{ops.int8_bound_loop()})")
    forms = load_forms(path, args.layers, not args.no_panels, args.int8, args.types)
    if not forms:
        sys.exit(f"no layer matrices of {args.types} in {path}")
    names = ["in_place"] + ([] if args.no_panels else ["panels"]) \
        + (["block_panels"] if any(f["block_panels"] is not f["in_place"] for f in forms)
           else []) \
        + (["int8"] if args.int8 else [])
    weights = sum(f["k"] * f["n"] for f in forms)
    results = []
    print(f"{os.path.basename(path)}: {len(forms)} matrices, {weights / 1e6:.0f}M weights, "
          f"{args.threads} threads")
    print(" rows | " + " | ".join(f"{n:>20}" for n in names))
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k in {f["k"] for f in forms}}
        times: dict[str, list[float]] = {n: [] for n in names}
        for _ in range(args.repeats):
            for name in names:
                t0 = time.perf_counter()
                for f in forms:
                    ops.panel_linear(xs[f["k"]], f[name])
                times[name].append(time.perf_counter() - t0)
        med = {n: statistics.median(v) for n, v in times.items()}
        rate = {n: 2 * m * weights / med[n] / 1e9 for n in names}
        print(f"{m:5d} | " + " | ".join(
            f"{med[n] * 1e3:8.2f} ms {rate[n]:5.0f} G/s" for n in names)
            + (f" | int8 {rate['int8'] / bound:.2f} of its bound" if bound else ""))
        results.append({"rows": m, **{f"{n}_ms": med[n] * 1e3 for n in names}})
    print(json.dumps({"model": os.path.basename(path), "threads": args.threads,
                      "weights": weights, "int8_bound_gops": bound, "results": results}))


if __name__ == "__main__":
    main()
