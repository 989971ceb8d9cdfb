"""The one seam between FreeToken and its compiled kernels, freetoken._C: every fast path with its
pure-torch twin in the same module, one module per op family.

    backend.py        loading _C once, configure() / config(), backend() / backend_for(device)
    topk.py           topk_logprobs (mask, logit bias, log-softmax, top-k) + twin
    sampling.py       sample_tokens, gumbel_noise (one torch implementation for every backend)
    attention.py      paged_attention over the KV pool (the twin: model/attention.py's SDPA path)
    elementwise.py    rms_norm, silu_mul, rope_ + twins
    linear.py         panel linear over packed fp32 / bf16 weights or GGUF descriptors (no twin)
    gguf.py           GGUF blocks -> exact fp32 weights (the twin: the gguf package), and
                      the block-resident weight descriptor (gguf_matrix) for panel_linear
    int8.py           the int8 compute mode's repacked weights (int8_matrix) for panel_linear
    decoder_layer.py  one Llama decoder layer as one C++ call, and all of them as one

Importing loads freetoken._C (a stale build is an ImportError); nothing here reads the
environment. Not the model (freetoken/model/) that chooses among these.
"""

from freetoken.ops.attention import paged_attention, paged_attention_available
from freetoken.ops.backend import (
    BACKENDS,
    COMPUTE_MODES,
    CPU_ISAS,
    LINEAR_MODES,
    OpsConfig,
    available_cpu_isas,
    backend,
    backend_for,
    config,
    configure,
    cpu_isa,
)
from freetoken.ops.decoder_layer import decoder_layer, decoder_layer_available, decoder_stack
from freetoken.ops.elementwise import fused_elementwise_available, rms_norm, rope_, silu_mul
from freetoken.ops.gguf import (
    dequantize_gguf,
    gguf_dequantize_available,
    gguf_matrix,
    gguf_matrix_available,
    gguf_row_bytes,
    is_gguf_matrix,
)
from freetoken.ops.int8 import (
    int8_amx_available,
    int8_avx_vnni_available,
    int8_bound_loop,
    int8_matrix,
    int8_matrix_available,
    int8_matrix_superblocks,
    int8_matrix_unpack,
    int8_peak_gops,
    int8_quantize_rows,
    int8_silu_linear,
    int8_vnni_available,
    is_int8_matrix,
    set_int8_amx,
    set_int8_avx_vnni,
)
from freetoken.ops.linear import (
    GGUF_PANEL_TYPES,
    gguf_panel_type,
    pack_gguf_panels,
    pack_panels,
    panel_linear,
    panel_linear_available,
    panel_shape,
)
from freetoken.ops.sampling import gumbel_noise, sample_tokens
from freetoken.ops.topk import MAX_K, topk_logprobs

__all__ = [
    "BACKENDS", "COMPUTE_MODES", "CPU_ISAS", "GGUF_PANEL_TYPES", "LINEAR_MODES", "MAX_K",
    "OpsConfig", "available_cpu_isas", "backend", "backend_for", "config", "configure", "cpu_isa",
    "decoder_layer", "decoder_layer_available", "decoder_stack", "dequantize_gguf",
    "fused_elementwise_available", "gguf_dequantize_available", "gguf_matrix",
    "gguf_matrix_available", "gguf_panel_type",
    "gguf_row_bytes", "gumbel_noise", "int8_amx_available", "int8_avx_vnni_available",
    "int8_bound_loop", "int8_matrix",
    "int8_matrix_available", "int8_matrix_superblocks", "int8_matrix_unpack", "int8_peak_gops",
    "int8_quantize_rows", "int8_silu_linear", "int8_vnni_available", "is_gguf_matrix",
    "is_int8_matrix",
    "pack_gguf_panels", "pack_panels",
    "paged_attention", "paged_attention_available", "panel_linear", "panel_linear_available",
    "panel_shape", "rms_norm", "rope_", "sample_tokens", "set_int8_amx", "set_int8_avx_vnni",
    "silu_mul",
    "topk_logprobs",
]
