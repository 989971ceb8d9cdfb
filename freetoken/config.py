"""EngineConfig: the engine's knobs, validated once at construction (ValueError, never assert).

The KV pool is sized either by bytes (`kv_cache_memory`) or by blocks (`num_kv_blocks`); the
engine resolves the byte budget to a block count once it knows the model's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}

DEFAULT_KV_CACHE_MEMORY = 512 * 1024 * 1024  # bytes, when neither budget is given


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None     # bytes for K, V and the hidden states of the pool
    num_kv_blocks: int | None = None       # overrides kv_cache_memory when set
    max_num_seqs: int = 64                 # sequences in one step
    max_num_batched_tokens: int = 2048     # tokens computed in one step (prefill chunks + decodes)
    max_model_len: int | None = None       # None: the model's max_position_embeddings
    device: str = "cpu"
    dtype: str = "auto"                    # auto: float32 on CPU, bfloat16 on CUDA
    enable_prefix_cache: bool = True
    # Off by default: the contract's cache is full blocks (cached_tokens = the shared full-block
    # length). On: the end of a hit is token-granular, the donor's leading slots are copied.
    enable_partial_block_reuse: bool = False
    max_logprobs: int = 20
    max_queue_len: int = 1024              # waiting requests before submit() raises Overloaded
    # Requests about to arrive share the next step: after a step that finished requests the
    # engine waits for their replacements, an idle one for the rest of a burst (arrivals within
    # arrival_gap_ms of each other); at most arrival_window_ms (0: off). Engine._await_arrivals.
    arrival_window_ms: float = 25.0
    arrival_gap_ms: float = 2.0

    def __post_init__(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_queue_len"):
            positive(name)
        for name in ("kv_cache_memory", "num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                positive(name)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device is not a torch device: {self.device!r}") from exc
        if dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        for name in ("arrival_window_ms", "arrival_gap_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number of ms >= 0, got {value!r}")
        for name in ("enable_prefix_cache", "enable_partial_block_reuse"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        return _DTYPES[self.dtype]

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """Blocks in the pool: num_kv_blocks, else the byte budget divided by one block's bytes."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        budget = self.kv_cache_memory if self.kv_cache_memory is not None \
            else DEFAULT_KV_CACHE_MEMORY
        num = budget // bytes_per_block
        if num < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no block of {bytes_per_block} "
                             "bytes")
        return int(num)
