"""Loading freetoken._C (once, here only), the backend choice per device, and configure(): the
ops' one process-wide configuration.

    configure(backend="auto", linear="auto", cpu_isa="auto", pool_poll_us=None, compute="exact")
    config() -> OpsConfig;  backend() / backend_for(device) -> "ext-cpu" | "ext-cuda" | "torch"

backend: auto (the extension where it supports the device, else the torch twin) | ext (the
extension or an error) | torch (always the twin). linear: the model's linear forms (see
freetoken/model/linear.py): auto | gguf (a GGUF's weights in place, whatever its size) |
panels (no GGUF blocks) | onednn (no panels) | torch (F.linear). cpu_isa: auto (cpuid) | avx512
| avx2 | base, the CPU kernels' variant.
compute: how a GGUF's quantized linears compute: exact (each weight its exact dequantized fp32
value, fp32 FMAs) | int8 (x quantized to int8 per block of 32, or 256 for K-quants, integer dot
products with the weights' codes: faster, not exact; freetoken/ops/int8.py). Attention, norms and
the sampler are fp32 in both.
pool_poll_us: how long the kernels' thread pool polls between calls before it sleeps (None: 200;
0: sleep at once; csrc/common/task_pool.h). Nothing here reads the environment: the CLI (or a
script's flags) decides and calls configure, before the model loads (packing follows `linear`).

Loading the extension also sets glibc's malloc to keep what a kernel call frees for the next call
(KEEPS_FREED_MEMORY; see _keep_freed_memory).

Not the ops themselves: those are the sibling modules, each with its torch twin.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Every name the Python side calls. The extension and the Python are built together: a build
# that lacks one is stale, and loading it is an error rather than a silent fallback.
_EXT_NAMES = ("topk_logprobs", "check_compact", "paged_attention", "rms_norm", "add_rms_norm",
              "silu_mul", "rope_", "cuda_compiled", "cpu_isa", "set_cpu_isa", "set_pool_poll_us",
              "panel_pack", "gguf_pack", "gguf_matrix", "gguf_matrix_types", "is_gguf_matrix",
              "panel_shape", "panel_linear", "DecoderLayer", "gguf_dequantize",
              "gguf_dequantize_types", "int8_matrix", "int8_matrix_types", "is_int8_matrix",
              "int8_matrix_unpack", "int8_matrix_superblocks", "int8_quantize_rows",
              "int8_silu_linear", "int8_vnni_available", "int8_peak_gops", "int8_bits_per_weight",
              "int8_amx_available", "set_int8_amx", "int8_avx_vnni_available",
              "set_int8_avx_vnni", "int8_bound_loop")

try:
    from freetoken import _C  # noqa: N813
    IMPORT_ERROR: BaseException | None = None
except ImportError as exc:  # a pure-Python install, or a broken build: the twins take over
    _C = None
    IMPORT_ERROR = exc

if _C is not None:
    _missing = [n for n in _EXT_NAMES if not hasattr(_C, n)]
    if _missing:
        raise ImportError(f"freetoken._C is stale (built from older sources: no "
                          f"{', '.join(_missing)}); rebuild it: "
                          f"pip install --no-build-isolation -e .")


def _keep_freed_memory() -> bool:
    """Tells glibc's malloc to keep the memory that the kernels free between calls (an mmap
    threshold set: 32 MiB, its ceiling; trimming past 1 GiB of free top only). False where the
    C library has no mallopt (not glibc).
    NOTE: a call's buffers (an int8 linear's copies of x and its y: ~6 MB for a 1B ffn_down at 224
    rows) are freed and taken again every call. glibc's defaults let them go back to the kernel
    (the mmap threshold moves with what was freed, the heap's top is trimmed past 2x it), and in
    ~1 process of 3 every call then faulted its pages in again: 1564 page faults a call, that
    kernel 1.25x its time (10.9 -> 13.6 ms, one thread), for the life of the process."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


KEEPS_FREED_MEMORY = _keep_freed_memory() if _C is not None else False

BACKENDS = ("auto", "ext", "torch")
LINEAR_MODES = ("auto", "gguf", "panels", "onednn", "torch")
CPU_ISAS = ("auto", "avx512", "avx2", "base")
COMPUTE_MODES = ("exact", "int8")
DEFAULT_POOL_POLL_US = 200


@dataclass(frozen=True, slots=True)
class OpsConfig:
    """What configure() last set (its defaults until then)."""

    backend: str = "auto"
    linear: str = "auto"
    cpu_isa: str = "auto"
    pool_poll_us: int = DEFAULT_POOL_POLL_US
    compute: str = "exact"


_config = OpsConfig()


def _choice(name: str, value, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def configure(backend: str = "auto", linear: str = "auto", cpu_isa: str = "auto",
              pool_poll_us: int | None = None, compute: str = "exact") -> None:
    """Sets the whole ops configuration (every argument; see the module docstring). Raises
    ValueError naming a bad value (or a cpu_isa this CPU or build lacks), ImportError for
    backend="ext" without the extension; nothing changes when it raises."""
    global _config
    _choice("backend", backend, BACKENDS)
    _choice("linear", linear, LINEAR_MODES)
    _choice("cpu_isa", cpu_isa, CPU_ISAS)
    _choice("compute", compute, COMPUTE_MODES)
    if pool_poll_us is None:
        pool_poll_us = DEFAULT_POOL_POLL_US
    if isinstance(pool_poll_us, bool) or not isinstance(pool_poll_us, int) or pool_poll_us < 0:
        raise ValueError(f"pool_poll_us must be an int >= 0, got {pool_poll_us!r}")
    if backend == "ext" and _C is None:
        raise ImportError(f"backend='ext' but freetoken._C does not import: {IMPORT_ERROR}")
    if _C is not None:
        try:
            _C.set_cpu_isa(cpu_isa)  # checks before it changes anything
        except RuntimeError:
            raise ValueError(f"cpu_isa {cpu_isa!r} is not available on this CPU or build "
                             f"(here: {', '.join(available_cpu_isas())})") from None
        _C.set_pool_poll_us(pool_poll_us)
    if compute == "int8" and (backend == "torch" or _C is None):
        raise ValueError("compute='int8' needs freetoken._C (the int8 kernels have no torch twin)")
    if compute == "int8" and linear not in ("auto", "gguf"):
        raise ValueError(f"compute='int8' computes a GGUF's weights with its own kernels; "
                         f"linear={linear!r} would pick others (use auto or gguf)")
    _config = OpsConfig(backend, linear, cpu_isa, pool_poll_us, compute)
    _backend_for_type.cache_clear()
    _log_choice.cache_clear()


def config() -> OpsConfig:
    """The configuration in force (what configure() last set)."""
    return _config


def cpu_isa() -> str | None:
    """The CPU kernels' variant in use ("avx512", "avx2", "base"); None without the extension."""
    return _C.cpu_isa() if _C is not None else None


@functools.cache
def available_cpu_isas() -> tuple[str, ...]:
    """The variants this CPU and build run (cpuid-checked); () without the extension."""
    if _C is None:
        return ()
    out = []
    for name in CPU_ISAS[1:]:
        try:
            _C.set_cpu_isa(name)
            out.append(name)
        except RuntimeError:
            pass
    _C.set_cpu_isa(_config.cpu_isa)
    return tuple(out)


def backend_for(device: torch.device | str) -> str:
    """Which implementation serves tensors on `device`: "ext-cpu", "ext-cuda" or "torch"."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _backend_for_type(kind)


@functools.cache
def _backend_for_type(kind: str) -> str:
    name = "torch"
    if _config.backend != "torch" and _C is not None:
        if kind == "cpu":
            name = "ext-cpu"
        elif kind == "cuda" and _C.cuda_compiled():
            name = "ext-cuda"
        elif _config.backend == "ext":
            raise RuntimeError(f"backend='ext' but freetoken._C has no kernel for {kind}")
    _log_choice(name, kind)
    return name


def backend() -> str:
    """The backend for CPU tensors (what `python -c "import freetoken.ops as o; ..."` shows)."""
    return backend_for("cpu")


def require_ext(fn: str) -> None:
    """Raises RuntimeError when `fn` (a kernel with no twin) has no extension to run on."""
    if _C is None:
        raise RuntimeError(f"{fn} needs freetoken._C: {IMPORT_ERROR}")


@functools.cache
def _log_choice(name: str, device_type: str) -> None:
    if name == "torch" and _C is None:
        log.info("freetoken.ops: %s tensors use the torch twin (freetoken._C: %s)",
                 device_type, IMPORT_ERROR)
    elif name == "ext-cpu":
        log.info("freetoken.ops: cpu tensors use freetoken._C (%s kernel; malloc keeps freed "
                 "memory: %s)", _C.cpu_isa(), "yes" if KEEPS_FREED_MEMORY else "no")
    else:
        log.info("freetoken.ops: %s tensors use %s (backend=%s)", device_type, name,
                 _config.backend)
