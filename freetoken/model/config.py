"""ModelConfig: the architecture hyper-parameters the forward needs, whatever the file format.

Both loaders (GGUF metadata, HF config.json) produce one of these; the model reads nothing else.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# HF `architectures[0]` / GGUF `general.architecture` -> our family name.
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass(slots=True)
class ModelConfig:
    arch: str  # one of SUPPORTED_ARCHS
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0 = hidden_size // num_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # {"rope_type": "llama3"|"linear", "factor": ..., ...}, or from a GGUF's rope_freqs tensor
    # {"rope_type": "freq_factors", "factors": [head_dim // 2 floats]} (inv_freq / factors)
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q/k/v projections have a bias (Qwen2; Llama attention_bias)
    o_bias: bool = False  # o_proj has a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # every layer attends to the last `sliding_window` keys
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {self.arch!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by "
                    f"num_heads {self.num_heads}; give head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {self.head_dim!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if not (self.rms_norm_eps > 0 and math.isfinite(self.rms_norm_eps)):
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if rope_type not in ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling type must be one of {ROPE_TYPES}, got {rope_type!r}"
                )
            self.rope_scaling = {**self.rope_scaling, "rope_type": rope_type}
            self.rope_scaling.pop("type", None)
            if rope_type == "default":
                self.rope_scaling = None
            elif rope_type == "freq_factors":
                if len(self.rope_scaling.get("factors", ())) != self.head_dim // 2:
                    raise ValueError(
                        f"rope freq_factors must have head_dim/2 = {self.head_dim // 2} values"
                    )
            elif not self.rope_scaling.get("factor", 0) > 0:
                raise ValueError(f"rope_scaling.factor must be > 0, got {self.rope_scaling!r}")
        if self.sliding_window is not None:
            if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
                raise ValueError(
                    f"sliding_window must be a positive int or None, got {self.sliding_window!r}"
                )
            if self.sliding_window >= self.max_position_embeddings:
                self.sliding_window = None  # the window covers the whole context: plain causal

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)
