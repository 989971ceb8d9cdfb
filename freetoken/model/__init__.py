"""The model: ModelConfig and the Llama-shaped forward. See docs/architecture.md ("Model")."""

from __future__ import annotations

import logging

import torch

from freetoken.model.config import ModelConfig
from freetoken.model.linear import FEW_ROWS
from freetoken.model.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "ModelConfig", "build_model"]

logger = logging.getLogger("freetoken.model")


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """Every supported architecture (llama, mistral, qwen2, qwen3) is the Llama shape.

    Built on the meta device (no random init), then each parameter is replaced by its HF-named
    tensor from `weights` (consumed), on `device` in `dtype`. On CPU the projections are then
    packed (panels for fp32; oneDNN, plus panels for few rows, for bf16: model/linear.py).
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_weights(weights, dtype=dtype, device=device)
    form = model.pack_linears()
    few = model.layers[0].mlp.gate_up_proj.few_rows is not None if model.layers else False
    logger.info("linear layers: %s%s", {
        "panels": "freetoken._C panels, pre-packed weights (small-M streaming GEMM)",
        "onednn": "oneDNN, pre-packed weights"}.get(form, "torch F.linear"),
        f"; freetoken._C panels for steps of <= {FEW_ROWS} rows" if few else "")
    return model.eval()
