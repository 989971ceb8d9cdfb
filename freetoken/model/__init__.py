"""The model: ModelConfig and the Llama-shaped forward. See docs/architecture.md ("Model")."""

from __future__ import annotations

import torch

from freetoken.model.config import ModelConfig
from freetoken.model.llama import LlamaForCausalLM, rope_inv_freq

__all__ = ["LlamaForCausalLM", "ModelConfig", "build_model"]


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor],
                dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """Every supported architecture (llama, mistral, qwen2, qwen3) is the Llama shape.

    Built on the meta device (no random init of parameters that are overwritten anyway), then
    materialised on `device` in `dtype` and filled from HF-named `weights`.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)
    # NOTE: to_empty leaves buffers uninitialised and .to(dtype) would round them; RoPE
    # frequencies stay fp32, as in transformers.
    model.inv_freq = rope_inv_freq(config).to(device)
    model.load_weights(weights)
    return model.eval().requires_grad_(False)
