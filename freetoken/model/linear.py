"""The model's linear layers, by the form their weight was packed into at load:

  * fp32 on the CPU with freetoken._C: panels (ops.pack_panels / ops.panel_linear,
    csrc/linear/linear_cpu.cpp), a layout that streams each weight once per call. Decode steps
    are weight-bandwidth bound and oneDNN read cold weights at half the rate (a decode step's
    linears at 8 rows: 43.7 -> 22.8 ms); at 224 rows (a batched prefill) the two are level;
  * bf16 on the CPU: oneDNN with the weight reordered once (torch.ops.mkldnn; 1.2-3.2x faster
    than MKL's F.linear on this project's AMD EPYC), plus panels for steps of few rows (below);
    fp32 without the extension: oneDNN;
  * everywhere else: F.linear.
All are fp32-accumulating GEMMs; they differ in summation order only (~1e-4 on a logit). The
panels' order, and the in-place kernel's, never depends on the row count: a row's result is the
same whatever steps beside it (batch invariance: docs/api.md, Determinism).

A GGUF file whose weights would take over IN_PLACE_MIN_BYTES as fp32, or under it whose
matrices all have block panels (Q4_1 / Q8_0 / Q4_K / Q6_K; fp32 on the CPU with freetoken._C,
linear "auto"; "gguf" whatever the file), is
never dequantized whole (gguf_in_place): its weights stay in the file's blocks where its
read-only memory map has them (GGUFMatrix, from freetoken/loader/gguf.py), every step size
computing with each weight decoded to exactly its dequantized fp32 value, fp32 FMAs in one
summation order whatever the row count. No fp32 copy exists: a 1B Q4_K_M file serves in ~1 GB
instead of ~5.5, SmolLM2 (Q4_1) in under 400 MiB instead of ~1.05 GiB. GGUFMatrix.pack gives each
matrix its form:
  * under "auto" and the exact mode, a matrix of one of block_panels_wanted's types (a small
    file: all of them; a larger one: its Q4_1 / Q4_K / Q6_K, LARGE_BLOCK_PANEL_TYPES): the
    blocks regrouped into panels (ops.pack_gguf_panels, csrc/linear/quant_linear_cpu.cpp; a
    repacked copy at 1.0x / 1.06x / 1.06x / 1.31x the file's bytes (Q4_1 / Q8_0 / Q4_K / Q6_K),
    whose pages of the file are then unmapped).
    Short steps dequantize them in registers, long ones decode a block of panels at a time into
    fp32 for the fp32 panels' micro-kernels: the fp32 panels' bits and, measured on SmolLM2, at
    most their time (0.40-1.01x by row count);
  * the other types (a q|k|v of mixed types too), and every type under "gguf": the descriptor
    of the blocks in place (ops.gguf_matrix, csrc/linear/gguf_linear.cpp);
  * in the int8 compute mode (ops.configure(compute="int8")): int8 matrices (ops.int8_matrix, a
    repacked copy of their codes at about the file's size, the file's pages unmapped once it
    exists); the types without an int8 kernel keep the descriptor.

Steps of at most FEW_ROWS rows can take a second form (`few_rows`):
  * fp32 weights of a smaller GGUF dequantized at load whose file stores some as Q4_1 / Q8_0
    blocks (GGUFBlocks): those blocks as panels (ops.pack_gguf_panels), each weight dequantized
    in registers to exactly the fp32 value of the plain weight;
  * bf16 weights: panels next to oneDNN (below).

The packed weight replaces the plain one: a panel tensor or a GGUF descriptor is 1-D (its header
carries N, K and the format), a oneDNN one an opaque mkldnn tensor of the same shape.
ops.configure(linear=...) chooses among them (A/B switches, a way out): "panels" dequantizes a
GGUF's weights into fp32 panels instead and gives bf16 weights panels for every row count (no
oneDNN: the same bits for any row count; a classify step takes 1.65-1.75x oneDNN's time),
"onednn" skips the panels too, "torch" keeps F.linear.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken import ops

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


# The types whose blocks a weight dequantized at load keeps beside it for steps of few rows
# (GGUFBlocks, pack_few_rows); block panels (GGUFMatrix) take every type of ops.GGUF_PANEL_TYPES.
GGUF_BLOCK_TYPES = ("Q4_1", "Q8_0")
# NOTE: a file over IN_PLACE_MIN_BYTES keeps its Q8_0 matrices in place: on a 1B-shaped Q8_0
# file's first 4 layers (scripts/bench_gguf_linear.py) one row took 1.17x the in-place kernel's
# time as block panels (8 rows 0.72x, 224 rows 0.84x), and a one-stream regression is not traded
# for the rest unmeasured. Its Q4_K (1B Q4_K_M, Zen 3, AVX2) as block panels: one row 1.06x, 4
# rows 1.11x, 8 rows 0.81x, 48 rows 0.83x, 224 rows 0.77x; its Q6_K (ffn_down, attn_v; Xeon,
# AVX-512, 21 GB/s read): 1-4 rows 1.00-1.02x, 8 rows 0.89x, 16-48 rows 1.02-1.08x, 224 rows
# 0.81x (1.31x the file's bytes: its codes as int8, one sign-extending load a row).
LARGE_BLOCK_PANEL_TYPES = ("Q4_1", "Q4_K", "Q6_K")

# NOTE: below this a GGUF with matrices of other types than Q4_1 / Q8_0 keeps an fp32 copy: it
# fits easily, and the in-place kernels were slower on SmolLM2 (classify 0.76x, decode 8
# streams 0.57x, one stream 0.64x the fp32 panels plus Q4_1 panels, scripts/ab_serve.py,
# 2026-12-03: their 32-weight blocks carry two fp16 scales each, converted per block per output
# in the native layout, where the packed panels hold them as fp32 once). Above it the fp32 copy
# is the problem (1B: 5.5 GB resident).
IN_PLACE_MIN_BYTES = 1 << 30


@dataclass(slots=True)
class GGUFBlocks:
    """A weight [out, in] as its GGUF file stores it: rows [out, in / 32 * block bytes] uint8 of
    `type`. What the loader hands over next to the dequantized weight."""

    type: str
    rows: torch.Tensor
    in_features: int

    @staticmethod
    def fuse(parts: list[GGUFBlocks | None]) -> GGUFBlocks | None:
        """The blocks of the weights concatenated along out (q/k/v, gate/up); None unless every
        part has blocks of one type."""
        if not parts or any(p is None for p in parts) or len({(p.type, p.in_features)
                                                               for p in parts}) != 1:
            return None
        rows = parts[0].rows if len(parts) == 1 else torch.cat([p.rows for p in parts])
        return GGUFBlocks(parts[0].type, rows, parts[0].in_features)


@dataclass(slots=True)
class GGUFMatrix:
    """A weight [out, in] left in a GGUF file's blocks: row n's blocks at byte offsets[n] of
    `mapping` (the file's read-only memory map, 1-D uint8), rows [ends[s - 1], ends[s]) of GGUF
    type types[s]. What the loader hands over instead of an fp32 tensor."""

    types: list[str]
    ends: list[int]
    offsets: torch.Tensor  # int64 [out]
    in_features: int
    mapping: torch.Tensor
    block_panels: bool = False  # repack as block panels (the loader: block_panels_wanted)

    @property
    def out_features(self) -> int:
        return int(self.offsets.numel())

    @staticmethod
    def fuse(parts: list[GGUFMatrix | None]) -> GGUFMatrix | None:
        """The weights concatenated along out (q/k/v, gate/up; their types may differ); None
        unless every part is a GGUFMatrix of one mapping and in_features."""
        if not parts or any(p is None for p in parts) or len(
                {(id(p.mapping), p.in_features) for p in parts}) != 1:
            return None
        types, ends, start = [], [], 0
        for p in parts:
            types += p.types
            ends += [start + e for e in p.ends]
            start += p.out_features
        offsets = torch.cat([p.offsets for p in parts]) if len(parts) > 1 else parts[0].offsets
        return GGUFMatrix(types, ends, offsets, parts[0].in_features, parts[0].mapping,
                          all(p.block_panels for p in parts))

    def int8_ready(self) -> bool:
        """True when the int8 compute mode is on and has a kernel for every type here."""
        return ops.config().compute == "int8" and all(ops.int8_matrix_available(t)
                                                      for t in self.types)

    def block_panels_ready(self) -> bool:
        """True when this weight becomes GGUF-block panels (`block_panels`, set by the loader
        where block_panels_wanted; one type of ops.GGUF_PANEL_TYPES): the blocks regrouped
        per 16 outputs, which every step size computes with (few rows dequantize in registers,
        many rows decode a block of panels at a time for the fp32 micro-kernels) in the fp32
        panels' summation order."""
        return self.block_panels and len(set(self.types)) == 1 \
            and self.types[0] in ops.GGUF_PANEL_TYPES \
            and self.in_features % (256 if self.types[0] in ("Q4_K", "Q6_K") else 32) == 0

    def pack(self) -> torch.Tensor:
        """What panel_linear computes with: the int8 matrix (ops.int8_matrix) where
        int8_ready(), the block panels (ops.pack_gguf_panels) where block_panels_ready() (both
        repacked copies: the file's pages are then unmapped), else the descriptor of the blocks
        in place (ops.gguf_matrix)."""
        if self.int8_ready():
            packed = ops.int8_matrix(self.mapping, self.offsets, self.types, self.ends,
                                     self.in_features)
        elif self.block_panels_ready():
            rows, in_map = self.block_rows()
            packed = ops.pack_gguf_panels(rows, self.types[0], self.in_features,
                                          release_rows=in_map)
        else:
            return ops.gguf_matrix(self.mapping, self.offsets, self.types, self.ends,
                                   self.in_features)
        self._drop_file_pages()
        return packed

    def block_rows(self) -> tuple[torch.Tensor, bool]:
        """(the rows' blocks as [out, row bytes] uint8 (one type), whether that is a view of the
        mapping): a view where they lie in order, else a copy of them in this order."""
        try:
            return self.row_table(), True
        except ValueError:
            row_bytes = ops.gguf_row_bytes(self.types[0], self.in_features)
            return self.mapping.unfold(0, row_bytes, 1).index_select(0, self.offsets), False

    def _drop_file_pages(self) -> None:
        """Unmap this weight's pages of the file from the process (madvise DONTNEED; they stay in
        the page cache): once its repacked copy exists they are not read again (an embedding's
        rows fault back in as they are looked up), so the peak holds one copy, not two."""
        starts = self.offsets
        row_bytes = max(ops.gguf_row_bytes(t, self.in_features) for t in self.types)
        lo, hi = int(starts.min()), int(starts.max()) + row_bytes
        base = self.mapping.data_ptr()
        page = mmap.PAGESIZE
        first = (base + lo) // page * page
        last = -(-(base + min(hi, self.mapping.numel())) // page) * page
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first),
                        mmap.MADV_DONTNEED)

    def row_table(self) -> torch.Tensor:
        """The rows as a [out, row bytes] uint8 view of the mapping (a single-type weight whose
        rows lie in order, as an embedding's do): a lookup is then one index_select."""
        row_bytes = ops.gguf_row_bytes(self.types[0], self.in_features)
        first = int(self.offsets[0])
        if len(self.types) != 1 or not torch.equal(
                self.offsets, first + row_bytes * torch.arange(self.out_features)):
            raise ValueError("GGUFMatrix.row_table: the rows are not one type in order")
        return self.mapping[first:first + self.out_features * row_bytes].view(
            self.out_features, row_bytes)


def block_panel_bytes(type: str, out_features: int, in_features: int) -> int:  # noqa: A002
    """The bytes of ops.pack_gguf_panels' tensor for a [out, in] weight of `type` (Q4_1 / Q8_0 /
    Q4_K / Q6_K): a 64-byte header, then per 16 outputs and 32 inputs Q4_1's 16 fp16 scales, 16
    fp16 mins and 512 4-bit codes, Q8_0's 16 fp32 scales and 512 int8 codes; Q4_K per 16 outputs
    and 256 inputs 16 fp32 d, 16 fp32 dmin, 256 bytes of 6-bit scales and mins, and the 4096
    nibbles; Q6_K 16 fp32 d, 256 bytes of int8 scales and the 4096 codes as int8."""
    values, block = {"Q4_1": (32, 2 * 32 + 256), "Q8_0": (32, 64 + 512),
                     "Q4_K": (256, 2 * 64 + 256 + 2048), "Q6_K": (256, 64 + 256 + 4096)}[type]
    return 64 + -(-out_features // 16) * (in_features // values) * block


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def gguf_in_place(dtype: torch.dtype, device: torch.device | str, fp32_bytes: int,
                  matrix_types: set[str] | frozenset[str] = frozenset()) -> bool:
    """True when a GGUF's weights (`fp32_bytes` as fp32; its 2-D weights of `matrix_types`) of
    `dtype` on `device` are never dequantized whole here: fp32 on the CPU extension, linear
    "gguf", or "auto" above IN_PLACE_MIN_BYTES or where block_panels_wanted (a small file whose
    matrices all have block panels); the loader dequantizes them otherwise."""
    mode = ops.config().linear
    int8 = ops.config().compute == "int8"  # the int8 kernels read the blocks' codes
    return (mode == "gguf" or int8 or (mode == "auto" and fp32_bytes > IN_PLACE_MIN_BYTES)
            or bool(block_panels_wanted(fp32_bytes, matrix_types))) \
        and dtype == torch.float32 and torch.device(device).type == "cpu" \
        and ops.panel_linear_available(torch.empty(0))


def block_panel_types(fp32_bytes: int, matrix_types: set[str] | frozenset[str]
                      ) -> frozenset[str]:
    """The types whose matrices (one type each) a GGUF (`fp32_bytes` as fp32, 2-D weights of
    `matrix_types`) keeps only as block panels (GGUFMatrix.pack), by size alone: at most
    IN_PLACE_MIN_BYTES as fp32 (SmolLM2), all of them where every matrix has block panels
    (ops.GGUF_PANEL_TYPES), else none (the file is dequantized at load); above it its
    LARGE_BLOCK_PANEL_TYPES, the rest staying in place."""
    types = frozenset(matrix_types)
    if fp32_bytes <= IN_PLACE_MIN_BYTES:
        return types if types and types <= set(ops.GGUF_PANEL_TYPES) else frozenset()
    return types & frozenset(LARGE_BLOCK_PANEL_TYPES)


def block_panels_wanted(fp32_bytes: int, matrix_types: set[str] | frozenset[str]
                        ) -> frozenset[str]:
    """block_panel_types under linear "auto" and the exact mode (empty otherwise, and so false):
    the types the loader marks for block panels (GGUFMatrix.block_panels)."""
    if ops.config().linear != "auto" or ops.config().compute != "exact":
        return frozenset()
    return block_panel_types(fp32_bytes, matrix_types)


def gguf_blocks_wanted(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True when a weight of `dtype` on `device` takes its GGUF blocks as the few-rows form here
    (fp32 on the CPU extension, linear "auto"); the loader reads the blocks only then."""
    return ops.config().linear == "auto" and ops.config().compute == "exact" \
        and dtype == torch.float32 and torch.device(device).type == "cpu" \
        and ops.panel_linear_available(torch.empty(0))


# NOTE: bf16 keeps a second form for few rows. oneDNN's AVX512-BF16 dot products run at twice the
# fp32 FLOP rate, while the panels widen bf16 to fp32 FMAs: on the classify step (8 x 28 rows)
# panels took 364-381 ms against oneDNN's 193-221. With few rows the panels win (half the bytes,
# read at stream rate; decode 1 x 1: 17-20 vs 32-35 ms). So a bf16 weight is packed both ways,
# and steps of at most FEW_ROWS rows take the panels: two bf16 copies are one fp32 copy's bytes.
FEW_ROWS = 8


def panels_available(weight: torch.Tensor) -> bool:
    """True when `weight`'s dtype and device have the panel kernel here (linear "auto" or
    "panels")."""
    return ops.config().linear in ("auto", "panels") and ops.panel_linear_available(weight)


def _onednn_available(weight: torch.Tensor) -> bool:
    return (
        ops.config().linear != "torch"
        and weight.device.type == "cpu"
        and weight.dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (weight.dtype != torch.bfloat16 or _onednn_bf16_supported())
    )


@functools.cache
def _onednn_bf16_supported() -> bool:
    """Whether this CPU runs oneDNN's packed bf16 linear: it needs AVX512-BW/VL/DQ or
    AVX-NE-CONVERT, and refuses the reorder otherwise (an AVX2-only Zen 3, say). There the
    panels serve a bf16 weight at every row count."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else True


def packing_available(weight: torch.Tensor) -> bool:
    """True when `weight` can be served by some packed form here (panels or oneDNN)."""
    return panels_available(weight) or _onednn_available(weight)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] plain weight -> its packed form for every row count (see the module docstring):
    panels for fp32, oneDNN for bf16 (panels where oneDNN is missing, or with linear "panels":
    then every row count has the panels' one summation order, batch invariance's switch for
    bf16). Call only where packing_available(weight)."""
    weight = weight.detach().contiguous()
    if _panels_for_every_row_count(weight):
        return ops.pack_panels(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def _panels_for_every_row_count(weight: torch.Tensor) -> bool:
    """Whether pack_weight gives `weight` panels (else oneDNN)."""
    return panels_available(weight) and (weight.dtype == torch.float32
                                         or ops.config().linear == "panels"
                                         or not _onednn_available(weight))


def pack_few_rows(weight: torch.Tensor, blocks: GGUFBlocks | None = None) -> torch.Tensor | None:
    """The second form, for steps of at most FEW_ROWS rows: the GGUF blocks of an fp32 weight
    (`blocks`: the same values, so the same results), or panels of a bf16 weight whose main form
    is oneDNN; None where the main form serves every row count."""
    if blocks is not None and gguf_blocks_wanted(weight.dtype, weight.device):
        if tuple(blocks.rows.shape[:1]) + (blocks.in_features,) != tuple(weight.shape):
            raise ValueError(f"GGUF blocks of shape [{blocks.rows.shape[0]}, "
                             f"{blocks.in_features}] for a weight {tuple(weight.shape)}")
        return ops.pack_gguf_panels(blocks.rows, blocks.type, blocks.in_features)
    if panels_available(weight) and not _panels_for_every_row_count(weight):  # bf16 on oneDNN
        return ops.pack_panels(weight.detach().contiguous())
    return None


def few_rows_form(few_rows: torch.Tensor | None) -> str | None:
    """What a few-rows form holds: "Q4_1" / "Q8_0" (GGUF blocks), "bf16 panels", or None."""
    if few_rows is None:
        return None
    return ops.gguf_panel_type(few_rows) or "bf16 panels"


def packed_form(weight: torch.Tensor) -> str:
    """"gguf" (a GGUF descriptor), "int8" (an int8 matrix), "block panels" (GGUF Q4_1 / Q8_0
    blocks as panels), "panels" (fp32 / bf16), "onednn" or "plain"."""
    if weight.is_mkldnn:
        return "onednn"
    if weight.dim() == 1:
        if ops.is_gguf_matrix(weight):
            return "gguf"
        if ops.is_int8_matrix(weight):
            return "int8"
        return "block panels" if ops.gguf_panel_type(weight) else "panels"
    return "plain"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           few_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., in] -> [..., out], by whichever form `weight` is in; `few_rows` (from
    pack_few_rows) takes over for at most FEW_ROWS rows."""
    if few_rows is not None and x.numel() <= FEW_ROWS * x.shape[-1]:
        return ops.panel_linear(x.contiguous(), few_rows, bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    if weight.dim() == 1:
        return ops.panel_linear(x.contiguous(), weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """nn.Linear's parameters (`weight` [out, in], optional `bias`), forward through `linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.few_rows: torch.Tensor | None = None  # the form for few rows (pack_few_rows)
        self.mapping: torch.Tensor | None = None  # a GGUF file's mapping, under a descriptor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.few_rows)

    def pack(self, matrix: GGUFMatrix | None = None, blocks: GGUFBlocks | None = None) -> bool:
        """Replace the plain weight by its packed form(s), `blocks` (its GGUF blocks, if any)
        for few rows; or by the descriptor of `matrix` (its GGUF blocks in place: the weight was
        never loaded). False where none is available."""
        if matrix is not None:
            if (matrix.out_features, matrix.in_features) != (self.out_features,
                                                              self.in_features):
                raise ValueError(f"GGUF weight [{matrix.out_features}, {matrix.in_features}] "
                                 f"for a layer [{self.out_features}, {self.in_features}]")
            self.weight = nn.Parameter(matrix.pack(), requires_grad=False)
            if packed_form(self.weight) == "gguf":
                self.mapping = matrix.mapping  # the descriptor's addresses point into it
            return True
        if packed_form(self.weight) != "plain":
            return True
        if not packing_available(self.weight):
            return False
        self.few_rows = pack_few_rows(self.weight, blocks)
        self.weight = nn.Parameter(pack_weight(self.weight), requires_grad=False)
        return True
