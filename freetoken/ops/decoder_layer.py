"""decoder_layer: one Llama decoder layer as one C++ call (csrc/decoder_layer/), the fused ops of
elementwise.py, linear.py and attention.py chained without Python in between (~50 us a layer);
decoder_stack: all of a model's fused layers in one call.

Its twin is the Python layer itself (freetoken/model/llama.py DecoderLayer.forward calls the same
ops in the same order, so the results are the same; tests/model/test_decoder_layer.py holds them
equal). CPU extension only. Not the model's choice of when to use it (model/llama.py).
"""

from __future__ import annotations

import torch

from freetoken.ops.attention import paged_attention_available
from freetoken.ops.backend import _C, require_ext
from freetoken.ops.elementwise import fused_elementwise_available
from freetoken.ops.linear import panel_linear_available


def decoder_layer_available(x: torch.Tensor) -> bool:
    """True when decoder_layer serves a model whose activations are like x: the extension's
    fused elementwise ops, panel linears and paged attention all serve x's dtype and device."""
    return (fused_elementwise_available(x) and panel_linear_available(x)
            and paged_attention_available(x.device, x.dtype))


def decoder_layer(input_norm: torch.Tensor, post_norm: torch.Tensor,
                  weights: list[torch.Tensor | None], few_rows: list[torch.Tensor | None],
                  biases: list[torch.Tensor | None], *, num_heads: int, num_kv_heads: int,
                  head_dim: int, intermediate_size: int, eps: float, scale: float,
                  window: int | None, few_rows_max: int):
    """One Llama decoder layer as one C++ call (csrc/decoder_layer/): rms_norm / add_rms_norm,
    panel_linear, rope_, paged_attention and silu_mul in DecoderLayer.forward's order, with the
    same results. weights / few_rows / biases: 4 each (qkv, o, gate_up, down),
    None where absent: the main forms from pack_panels (None where the main form is not panels),
    the forms for steps of at most few_rows_max rows (bf16 pack_panels).
    -> an object with .serves(rows) -> bool and .forward(x, residual, cos, sin, k_cache,
    v_cache, block_tables, seq_lens, query_start_loc, slot_mapping) -> (out, residual), the
    arguments as for the ops it chains. Raises ValueError on misshapen weights."""
    require_ext("decoder_layer")
    return _C.DecoderLayer(input_norm, post_norm, list(weights), list(few_rows), list(biases),
                           num_heads, num_kv_heads, head_dim, intermediate_size, float(eps),
                           float(scale), int(window or 0), int(few_rows_max))


def decoder_stack(layers: list, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                  block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, slot_mapping: torch.Tensor,
                  out_rows: torch.Tensor | None = None,
                  out_query_start_loc: torch.Tensor | None = None):
    """The decoder_layer objects `layers` in order in one C++ call, layer i on k_caches[i] and
    v_caches[i], the first starting the residual stream: the results of calling each one's
    forward in turn. -> (the last layer's output, the residual stream), or None, having run
    nothing, where a layer does not serve a step of x's rows.
    out_rows [R] int64 (with out_query_start_loc [S + 1]: 0, 1, ..., R, one step where a
    sequence has its row): the last layer takes only these rows past its attention's K/V, each
    the last row of its sequence (those whose logits are needed); the results are then [R, H],
    those rows' bits as without it.
    NOTE: one return to Python a step instead of one a layer (SmolLM2's 30 layers: ~0.1 ms of a
    ~5 ms one-row step), and the GIL stays free for the server's event loop the whole forward."""
    require_ext("decoder_stack")
    return _C.decoder_stack(layers, x, cos, sin, k_caches, v_caches, block_tables, seq_lens,
                            query_start_loc, slot_mapping, out_rows, out_query_start_loc)
