"""Will a model fit? Its resident bytes plus the KV pool, against this machine's free memory.

Read from the file's headers alone, before anything loads. A model that cannot fit is refused
at start with both figures (`check_fits` raises MemoryError), instead of being killed by the OOM
killer halfway through its load or at its first long request. The figures are what the loaded
model keeps resident today: a GGUF served in place (fp32 on the CPU extension) its file's tensor
bytes, which the memory map pages in as they are read; otherwise the weights dequantized into the
serving dtype, plus the forms the CPU kernels pack. The load's transient peak can exceed them, so
a model that passes this check can still need headroom.

What it is not: a limit on the KV pool's size (EngineConfig) or on anything that fits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.loader.gguf_file import GGUFFile

GiB = 2**30


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """What a model's weights will hold resident once loaded, and how it was counted."""

    total: int
    detail: str


def weight_bytes(path: Path, dtype: torch.dtype, device: str, reader=None) -> WeightBytes:
    """The bytes the loaded model's weights will hold: a GGUF served in place (model/linear.py
    gguf_in_place) its tensors' bytes as the file stores them, plus what its Q4_1 / Q8_0 block
    panels hold beyond their blocks (_block_panel_extra); otherwise every parameter in
    `dtype` and, on the CPU, the packed forms the kernels keep beside it (a tied lm_head's
    packed copy; bf16's second, panel copy of every matrix; fp32's Q4_1 / Q8_0 blocks for steps
    of few rows). `reader`: the GGUF's open GGUFFile, when the caller has one."""
    from freetoken.model.linear import block_panels_wanted, gguf_blocks_wanted, gguf_in_place

    elem = torch.empty((), dtype=dtype).element_size()
    blocks = 0
    if path.is_file():
        tensors = (reader or GGUFFile(path)).tensors
        params, matrices, tied, lm_head, file_bytes, blocks = _gguf_counts(tensors)
        types = {t.tensor_type.name for t in tensors if len(t.shape) == 2}
        if gguf_in_place(dtype, device, 4 * params, types):
            detail = (f"{params / 1e9:.2f}B parameters in the file's blocks, "
                      f"{file_bytes / GiB:.1f} GiB memory-mapped")
            panel_types = block_panels_wanted(4 * params, types)
            extra = _block_panel_extra(tensors, tied, panel_types)
            if extra:
                detail += (f", {extra / GiB:.2f} GiB more as {'/'.join(sorted(panel_types))} "
                           "block panels")
            return WeightBytes(file_bytes + extra, detail)
    else:
        params, matrices, tied, lm_head, _ = _safetensors_counts(path)
    total, parts = params * elem, [f"{params / 1e9:.2f}B parameters in {_name(dtype)}"]
    if torch.device(device).type == "cpu":
        if tied:
            total += lm_head * elem
            parts.append("a packed copy of the tied lm_head")
        if dtype != torch.float32:
            total += matrices * elem
            parts.append("a second (panel) copy of every matrix")
        elif blocks and gguf_blocks_wanted(dtype, device):
            total += blocks
            parts.append(f"{blocks / GiB:.1f} GiB of GGUF blocks for decode steps")
    return WeightBytes(total, ", ".join(parts))


def available_bytes() -> int | None:
    """The memory this process can still take: MemAvailable, capped by a cgroup v2 limit (None
    where neither can be read)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max" and avail is not None:
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def check_fits(path: Path, dtype: torch.dtype, device: str, kv_bytes: int,
               available: int | None = None, reader=None) -> None:
    """Raises MemoryError naming the weights' and the KV pool's bytes when together they exceed
    the available memory (CPU only: a GPU's memory is its allocator's to refuse)."""
    if torch.device(device).type != "cpu":
        return
    available = available_bytes() if available is None else available
    if available is None:
        return
    weights = weight_bytes(path, dtype, device, reader)
    if weights.total + kv_bytes > available:
        raise MemoryError(
            f"{path.name} needs about {weights.total / GiB:.1f} GiB for its weights "
            f"({weights.detail}) plus {kv_bytes / GiB:.1f} GiB for the KV pool, "
            f"{(weights.total + kv_bytes) / GiB:.1f} GiB in all, but this machine has "
            f"{available / GiB:.1f} GiB available; use a smaller model or a smaller "
            f"--kv-cache-memory")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# (parameters, parameters in 2-D matrices, tied lm_head, lm_head parameters, the GGUF's tensor
# bytes)
Counts = tuple[int, int, bool, int, int]


def _gguf_counts(tensors) -> tuple[int, int, bool, int, int, int]:
    """Counts (above) and the bytes of the Q4_1 / Q8_0 matrices kept for decode steps."""
    from freetoken.model.linear import GGUF_BLOCK_TYPES

    names = {t.name for t in tensors}
    params = sum(int(t.n_elements) for t in tensors)
    matrices = sum(int(t.n_elements) for t in tensors if len(t.shape) == 2)
    embed = next((int(t.n_elements) for t in tensors if t.name == "token_embd.weight"), 0)
    file_bytes = sum(int(t.n_bytes) for t in tensors)
    blocks = sum(int(t.n_bytes) for t in tensors
                 if len(t.shape) == 2 and t.tensor_type.name in GGUF_BLOCK_TYPES)
    return params, matrices, "output.weight" not in names, embed, file_bytes, blocks


def _block_panel_extra(tensors, tied: bool, panel_types) -> int:
    """The bytes the block panels of the matrices of `panel_types` (model/linear.py
    GGUFMatrix.pack) hold beyond the file's blocks they replace; a tied embedding's blocks stay
    mapped for its lookups beside the lm_head's panels. (A fused q|k|v of mixed types stays in
    place: its parts are counted as panels all the same, a slight overestimate.)"""
    from freetoken.model.linear import block_panel_bytes

    extra = 0
    for t in tensors:
        kind = t.tensor_type.name
        if len(t.shape) != 2 or kind not in panel_types:
            continue
        in_features, out_features = (int(n) for n in t.shape)
        panels = block_panel_bytes(kind, out_features, in_features)
        extra += panels if tied and t.name == "token_embd.weight" else panels - int(t.n_bytes)
    return extra


def _safetensors_counts(path: Path) -> Counts:
    from safetensors import safe_open

    from freetoken.loader.safetensors import weight_files

    params = matrices = embed = 0
    tied = True
    for f in weight_files(path):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 -- safe_open is not a mapping
                shape = st.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                params += n
                matrices += n if len(shape) == 2 else 0
                embed = n if name.endswith("embed_tokens.weight") else embed
                tied = tied and name != "lm_head.weight"
    config = json.loads((path / "config.json").read_text())
    tied = tied or bool(config.get("tie_word_embeddings", False))
    return params, matrices, tied, embed, 0
