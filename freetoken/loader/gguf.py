"""GGUF file -> (ModelConfig, HF-named weights), the file read by loader/gguf_file.py.

Two ways to read the weights (model/linear.py gguf_in_place chooses):
  * read_in_place (fp32 on the CPU extension, models over 1 GiB as fp32 or whose matrices are
    all Q4_1 / Q8_0): every matrix stays where the file's read-only memory map has it, handed
    over as a GGUFMatrix (row offsets into the map, q/k rows un-permuted by reordering their
    offsets: a row's blocks move with it); only the small tensors (norms, biases) are
    dequantised. A matrix of a type the in-place kernel does not take is an error naming the
    tensor and its type. (GGUFMatrix.pack may then repack the blocks: model/linear.py.)
  * read_weights: every tensor dequantised to fp32, each weight exactly the value
    `gguf.quants.dequantize` gives (through freetoken.ops.dequantize_gguf's C++ kernel where it
    covers the type, through the gguf package itself for the rest); the model casts to its dtype.
    read_blocks also hands over the Q4_1 / Q8_0 matrices as their raw blocks, which an fp32 model
    on the CPU keeps packed for steps of few rows (dequantised in registers to the same values).
Not here: the tokenizer (freetoken/tokenizer/gguf_vocab.py reads the same file's vocabulary).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from freetoken import ops
from freetoken.loader.gguf_file import GGUFFile
from freetoken.loader.progress import progress as show_progress
from freetoken.loader.progress import progress_done
from freetoken.model.config import ModelConfig
from freetoken.model.linear import GGUF_BLOCK_TYPES, GGUFBlocks, GGUFMatrix

logger = logging.getLogger(__name__)

# GGUF general.architecture -> our arch name. Mistral GGUFs are written as "llama".
GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def reverse_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (convert_hf_to_gguf `permute`).

    The converter stores each head's rows interleaved for llama.cpp's adjacent-pair RoPE; HF's
    rotate_half RoPE wants the two halves of the head contiguous. w: [num_heads * hd, ...].
    """
    head_dim = w.shape[0] // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_freq_factors(reader: GGUFFile) -> list[float] | None:
    import gguf

    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).tolist()
    return None


def read_config(reader: GGUFFile) -> ModelConfig:
    gguf_arch = reader.get("general.architecture")
    if gguf_arch not in GGUF_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {gguf_arch!r}; FreeToken supports {sorted(GGUF_ARCHS)}"
        )
    a = gguf_arch

    def req(key: str):
        value = reader.get(f"{a}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata is missing {a}.{key}")
        return value

    num_heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    tok_embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab_size = reader.get(f"{a}.vocab_size")
    if vocab_size is None:
        vocab_size = int(tok_embd.shape[1])  # gguf shapes are [ne0=hidden, ne1=vocab]
    head_dim = reader.get(f"{a}.attention.key_length") or hidden // num_heads
    rope_scaling = None
    scaling_type = reader.get(f"{a}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {
            "rope_type": "linear",
            "factor": float(reader.get(f"{a}.rope.scaling.factor")),
        }
    elif scaling_type not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {scaling_type!r}")
    freq_factors = _rope_freq_factors(reader)
    if freq_factors is not None:
        if rope_scaling is not None:
            raise ValueError("GGUF has both rope_freqs and rope.scaling; not supported")
        rope_scaling = {"rope_type": "freq_factors", "factors": freq_factors}
    eos = reader.get("tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        extra = reader.get(key)
        if extra is not None and int(extra) not in eos_ids:
            eos_ids.append(int(extra))
    bos = reader.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=GGUF_ARCHS[gguf_arch],
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(reader.get(f"{a}.attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        max_position_embeddings=int(req("context_length")),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(reader.get(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
    )


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{idx}.{_LAYER_NAMES[rest]}"
    return None


def fp32_bytes(reader: GGUFFile) -> int:
    """The bytes of the file's weights as fp32 (what dequantising them would keep)."""
    return 4 * sum(int(t.n_elements) for t in reader.tensors)


def matrix_types(reader: GGUFFile) -> set[str]:
    """The GGUF types of the file's 2-D weights."""
    return {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2}


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensor infos over its memory map (open once, share with the
    tokenizer)."""
    return GGUFFile(path)


def load_gguf(source, progress: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read metadata and dequantise every tensor of `source` (a path or an open GGUFFile).
    Weights come back fp32, keyed by HF names."""
    reader = source if isinstance(source, GGUFFile) else open_gguf(source)
    config = read_config(reader)
    return config, read_weights(reader, config, progress)


def read_weights(reader: GGUFFile, config: ModelConfig, progress: bool = True
                 ) -> dict[str, torch.Tensor]:
    """Dequantise every tensor to fp32, keyed by HF names (reader.fields is not used)."""
    weights: dict[str, torch.Tensor] = {}
    tensors = list(reader.tensors)
    start = time.perf_counter()
    for i, (t, name) in enumerate(_model_tensors(tensors, config)):
        weights[name] = _dequantized(t, config)
        if progress and (i + 1 == len(tensors) or i % 16 == 0):
            show_progress(f"dequantising {i + 1}/{len(tensors)} tensors "
                          f"({time.perf_counter() - start:.1f}s)")
    if progress:
        progress_done()
    return weights


def _model_tensors(tensors, config: ModelConfig):
    """(tensor, HF name) of every weight; rope_freqs (read into config.rope_scaling) skipped, any
    other unknown tensor a ValueError."""
    for t in tensors:
        name = _hf_name(t.name)
        if name is None:
            if t.name != "rope_freqs.weight":
                raise ValueError(f"unexpected GGUF tensor {t.name!r} for {config.arch}")
            continue
        yield t, name


def _unpermuted_order(name: str, config: ModelConfig, rows: int) -> np.ndarray | None:
    """The row order reverse_permute gives a q/k tensor (None for the rest). NOTE: only the
    llama converter permutes q/k (for llama.cpp's RoPE layout); qwen2/qwen3 GGUFs keep HF's row
    order (llama.cpp uses NEOX-style RoPE for them)."""
    if config.arch not in ("llama", "mistral"):
        return None
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return reverse_permute(np.arange(rows), config.num_heads)
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return reverse_permute(np.arange(rows), config.num_kv_heads)
    return None


def read_in_place(reader: GGUFFile, config: ModelConfig, progress: bool = True
                  ) -> tuple[dict[str, torch.Tensor], dict[str, GGUFMatrix]]:
    """(the 1-D tensors dequantised to fp32, every 2-D weight as a GGUFMatrix over the file's
    memory map), keyed by HF names. Raises ValueError naming a matrix whose type the in-place
    kernel does not take."""
    import warnings

    with warnings.catch_warnings():
        # NOTE: the map is read-only and only ever read; torch warns about writes through it.
        warnings.simplefilter("ignore", UserWarning)
        mapping = torch.from_numpy(reader.data)  # the whole file, np.memmap mode "r"
    small: dict[str, torch.Tensor] = {}
    matrices: dict[str, GGUFMatrix] = {}
    tensors = list(reader.tensors)
    start = time.perf_counter()
    for i, (t, name) in enumerate(_model_tensors(tensors, config)):
        kind = t.tensor_type.name
        if len(t.shape) != 2:
            small[name] = _dequantized(t, config)
            continue
        in_features, out_features = (int(n) for n in t.shape)  # gguf shapes are [ne0, ne1]
        if not ops.gguf_matrix_available(kind) or in_features % 16:
            raise ValueError(
                f"GGUF tensor {t.name!r} has type {kind}, which FreeToken does not compute with "
                f"in place (it does F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, "
                f"Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS); --linear panels dequantises every weight "
                f"to fp32 instead (about 4 bytes a weight)")
        order = _unpermuted_order(t.name, config, out_features)
        rows = np.arange(out_features) if order is None else order
        row_bytes = int(t.n_bytes) // out_features
        offsets = torch.from_numpy(int(t.data_offset) + rows.astype(np.int64) * row_bytes)
        matrices[name] = GGUFMatrix([kind], [out_features], offsets, in_features, mapping)
        if progress and (i + 1 == len(tensors) or i % 64 == 0):
            show_progress(f"mapping {i + 1}/{len(tensors)} tensors "
                          f"({time.perf_counter() - start:.1f}s)")
    if progress:
        progress_done()
    return small, matrices


def _dequantized(t, config: ModelConfig) -> torch.Tensor:
    """A tensor dequantised to fp32 ([out, in] for a matrix), q/k rows un-permuted."""
    ne = [int(n) for n in t.shape]  # gguf order: ne0 (the row length) first
    rows = np.asarray(t.data).view(np.uint8).reshape(int(np.prod(ne[1:])), -1)
    try:
        array = ops.dequantize_gguf(rows, t.tensor_type.name, ne[0]).numpy()
    except NotImplementedError as exc:  # from the gguf package, the kernel's twin
        raise ValueError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which the gguf "
                         f"package cannot dequantise") from exc
    array = array.reshape(tuple(reversed(ne)))
    order = _unpermuted_order(t.name, config, array.shape[0])
    return torch.from_numpy(np.ascontiguousarray(array if order is None else array[order]))


def read_blocks(reader: GGUFFile, config: ModelConfig) -> dict[str, GGUFBlocks]:
    """The 2-D weights stored as GGUF_BLOCK_TYPES, as raw blocks keyed by HF names: rows [out,
    row bytes] uint8, q/k rows un-permuted as read_weights does (a row's blocks move with it)."""
    blocks: dict[str, GGUFBlocks] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None or t.tensor_type.name not in GGUF_BLOCK_TYPES or len(t.shape) != 2:
            continue
        in_features, out_features = (int(n) for n in t.shape)  # gguf shapes are [ne0, ne1]
        rows = np.asarray(t.data).reshape(out_features, -1)
        order = _unpermuted_order(t.name, config, out_features)
        rows = np.array(rows if order is None else rows[order])
        blocks[name] = GGUFBlocks(t.tensor_type.name, torch.from_numpy(rows), in_features)
    return blocks
