#!/usr/bin/env python3
"""Synthetic GGUF models at real shapes, random but valid blocks, SmolLM2's tokenizer
(freetoken/testing/gguf_files.py says what and why).

    python3 scripts/make_gguf.py --shape llama-3.2-1b --mix q4_k_m      # ~0.6 GB
    python3 scripts/make_gguf.py --shape llama-3.1-8b --mix q4_k_m      # ~4.2 GB
    python3 scripts/make_gguf.py --shape llama-3.2-1b --mix Q8_0 --out /tmp/x.gguf

--mix q4_k_m lays the types out as llama-quantize's Q4_K_M does; any GGUF type name instead
makes every 2-D weight that type. Written to ~/.cache/freetoken-models/ by default.
"""

from __future__ import annotations

import argparse
import os
import sys

from gguf import GGMLQuantizationType

from freetoken.testing.gguf_files import SHAPES, write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--mix", default="q4_k_m",
                    help="q4_k_m, or one GGUF type name for every 2-D weight (Q8_0, Q4_K, ...)")
    ap.add_argument("--out", default=None,
                    help="path (default: ~/.cache/freetoken-models/<shape>.<MIX>.gguf)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.mix != "q4_k_m" and args.mix not in GGMLQuantizationType.__members__:
        ap.error(f"--mix {args.mix!r}: q4_k_m or a GGUF type name")
    out = args.out or os.path.expanduser(
        f"~/.cache/freetoken-models/{args.shape}.{args.mix.upper()}.gguf")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    size = write(out, args.shape, args.mix, args.seed)
    print(f"wrote {out} ({size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
