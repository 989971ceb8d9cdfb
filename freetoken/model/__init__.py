"""The model: ModelConfig and the Llama-shaped forward. See docs/architecture.md ("Model")."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from freetoken import ops
from freetoken.model.config import ModelConfig
from freetoken.model.linear import (
    FEW_ROWS,
    GGUFBlocks,
    GGUFMatrix,
    few_rows_form,
    packed_form,
)
from freetoken.model.llama import GGUFEmbedding, LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig", "build_model"]

logger = logging.getLogger("freetoken.model")


def int8_loops() -> str:
    """The int8 mode's loops on this CPU (the extension's choice), for the start-up log."""
    loop = ops.int8_bound_loop()
    if loop is None:
        return "portable loop"
    if "AMX" in loop:
        return f"{loop} for steps of 32+ rows, vpdpbusd (AVX512-VNNI) below"
    return loop


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    matrices: dict[str, GGUFMatrix] | None = None,
    blocks: dict[str, GGUFBlocks] | None = None,
    on_packed: Callable[[int, int], None] | None = None,
) -> LlamaForCausalLM:
    """Every supported architecture (llama, mistral, qwen2, qwen3) is the Llama shape.

    Built on the meta device (no random init), then each parameter is replaced by its HF-named
    tensor from `weights` (consumed), on `device` in `dtype`. On CPU the projections are then
    packed (panels for fp32; oneDNN for bf16), with a second form for steps of few rows: the
    GGUF blocks in `blocks` (consumed) for fp32, panels for bf16; or, for the names in
    `matrices` (consumed), left in their GGUF blocks (model/linear.py). `on_packed(done, total)`:
    called as the projections are packed (the loader's progress line).
    """
    matrices = dict(matrices or {})
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    embedding = matrices.pop("model.embed_tokens.weight", None)
    model.load_weights(weights, dtype=dtype, device=device,
                       in_place=set(matrices) | ({"model.embed_tokens.weight"} if embedding
                                                 else set()))
    if embedding is not None:
        model.embed_tokens = GGUFEmbedding(embedding)
    types = sorted({t for m in matrices.values() for t in m.types}
                   | set(embedding.types if embedding else []))
    linears = list(matrices.values()) + ([embedding] if embedding and model.lm_head is None
                                         else [])  # a tied lm_head packs the embedding's
    int8_types = sorted({t for m in linears if m.int8_ready() for t in m.types})
    exact_types = sorted({t for m in linears if not m.int8_ready() for t in m.types})
    form = model.pack_linears(matrices, blocks, on_packed=on_packed)
    weights = [m.weight for m, _ in model.projections()] + [
        model.lm_head.weight if model.lm_head is not None else model.lm_head_packed
        if model.lm_head_packed is not None else model.lm_head_weight]
    if ops.config().compute == "int8":
        logger.info("linear layers: int8 compute mode: %s weights' codes repacked for integer dot "
                    "products (%s), activations quantized to int8 per block of 32 (256 for "
                    "K-quants)%s",
                    "/".join(int8_types) or "no", int8_loops(), f"; {'/'.join(exact_types)} "
                    "weights computed exact "
                    "(no int8 kernel)" if exact_types else "")
    elif repacked := sorted({ops.gguf_panel_type(w) for w in weights} - {None}):
        in_place = sum(packed_form(w) == "gguf" for w in weights)
        logger.info("linear layers: the GGUF's %s blocks regrouped into panels of 16 outputs "
                    "(one copy; the file's pages unmapped)%s, decoded exactly in freetoken._C "
                    "(%s): in registers for short steps, into fp32 a block of panels at a time for "
                    "long ones; fp32 FMAs in one summation order for every step size",
                    "/".join(repacked), f"; {in_place} of {len(weights)} matrices (other types, "
                    "or a q|k|v of mixed types) in the file's blocks in place" if in_place else "",
                    ops.cpu_isa())
    elif form == "gguf":
        logger.info("linear layers: the GGUF's %s blocks in place (memory-mapped, no fp32 copy), "
                    "decoded exactly in freetoken._C (%s), fp32 FMAs in one summation order for "
                    "every step size", "/".join(types), ops.cpu_isa())
    else:
        few = {few_rows_form(m.few_rows) for m, _ in model.projections()} - {None}
        if model.lm_head_few_rows is not None:
            few.add(few_rows_form(model.lm_head_few_rows))
        logger.info("linear layers: %s%s", {
            "panels": "freetoken._C panels, pre-packed weights (small-M streaming GEMM)",
            "onednn": "oneDNN, pre-packed weights"}.get(form, "torch F.linear"),
            f"; for steps of <= {FEW_ROWS} rows freetoken._C panels of {'/'.join(sorted(few))}"
            + (" (GGUF blocks dequantized exactly in registers)" if few - {"bf16 panels"}
               else "") if few else "")
    fused = [layer.fused for layer in model.layers if layer.fused is not None]
    if fused:
        rows = "every step" if fused[0].serves(1 << 30) else f"steps of <= {FEW_ROWS} rows"
        logger.info("decoder layers: %d of %d as one freetoken._C call each (ops.decoder_layer) "
                    "for %s", len(fused), len(model.layers), rows)
    else:
        logger.info("decoder layers: the Python forward (no fused layer here)")
    return model.eval()
