// The int8 compute mode's linear (issue 24): y = x @ W^T (+ bias), where x is quantized to int8 per
// block with an fp32 scale (32 values as llama.cpp's Q8_0; 256 when W holds a K-quant, as its
// Q8_K) and W keeps its GGUF integer codes, so each group of 32 (16 for Q6_K) weights times x is
// one exact integer dot product. Not exact: x loses its low bits (the exact mode is
// gguf_linear.cpp). Four loops with the same bits: AMX-INT8 tiles (steps of 32+ rows where the CPU
// has them, int8_amx.cpp), AVX512-VNNI, AVX2 (CPUs without AVX512-VNNI; its steps by AVX-VNNI's
// vpdpbusd where the CPU has that), portable (baseline x86-64).
//
// The weight: every GGUF format whose weight is w = a * (u - c) + b with an unsigned integer code
// u, per-group fp32 a and b (b = 0 where the format has no min) and a per-format integer offset c
// (Q8_0 128, Q4_0 8, Q5_0 16, Q6_K 32, Q3_K 4, IQ4_NL and IQ4_XS 128 (u = the table's value +
// 128), else 0) is repacked at load, 16 outputs at a time, so that
// one 64-byte vector holds 4 consecutive codes of each of the 16 outputs: VNNI's vpdpbusd then
// adds 4 products per output lane, and the 16 lanes are 16 outputs (no horizontal sums). The
// codes keep their width (4-bit two a byte; 6-bit as a 4-bit and a 2-bit plane; 3-bit as a 2-bit
// and a 1-bit plane; 2-bit four a byte; 5-bit in a byte; IQ4's 4-bit indices, looked up in
// registers) and the scales stay the file's own numbers (fp16 d, 4-bit, 6-bit or int8 group
// scales in a byte), so the copy is about the file's size (Q4_K 4.6 bits a weight, Q6_K 6.6,
// Q8_0 8.5, Q5_x 8.5-9, Q3_K 3.6, Q2_K 3.1, IQ4_XS 4.3, IQ4_NL 4.5);
// a and b are computed from them as the dequantization does (gguf_blocks.h), so a * (u - c) + b
// is each dequantized weight bit for bit (tested). The repacked copy is the one copy in use
// (the file's pages are only read while packing).
//
// The arithmetic, for row m and output n (integer sums exact, then fp32 without FMA contraction,
// so a NumPy reference reproduces it bit for bit, and no input but the row itself changes it:
// the same bits for any row count, rows beside it, thread count or ISA).
//  * Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL (x per 32): q[m, k] = rint(x[m, k] * (127 / amax)) and
//    d = amax / 127 over x's 32; S_g = sum_{k in g} q[m, k]. In increasing group order g:
//      P   = sum_{k in g} u[n, k] * q[m, k] - c * S_g                       (int32)
//      acc = acc + float(P) * (a[n, g] * d)
//      acc = acc + b[n, g] * (d * float(S_g))                             (formats with a min)
//  * Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_XS (x per 256, as llama.cpp's Q8_K: one d a superblock,
//    so its groups' sums combine in integer), with the superblock's fp16 d[n] (and dmin[n])
//    and its groups' integer scales sc[n, g] (and mins mn[n, g]), a = d * sc and
//    b = -(dmin * mn), in increasing superblock order:
//      I   = sum_g sc[n, g] * sum_{k in g} u[n, k] * q[m, k]                (int32)
//      with a min:  T = sum_g mn[n, g] * S_g;   else:  I = I - c * sum_g sc[n, g] * S_g
//      acc = acc + float(I) * (d[n] * d)
//      acc = acc + float(T) * ((-dmin[n]) * d)                            (Q4_K, Q5_K, Q2_K)
//    (A format of 32 in the same matrix reads the 256 block's d for each of its 32s.)
//    NOTE: why a superblock at a time: on Zen 5 vpdpbusd shares its two pipes with vmulps,
//    vpmulld and vpdpwssd (and, add, shift and convert run beside it), so a group's fp32 steps
//    (3 products a row) cost what 3 of its 8 vpdpbusd do; the superblock's way takes one
//    vpmulld a group and a row. 1B-shaped matrices at 224 rows: Q4_K 0.93, Q6_K 0.73 of the time.
//    Tried and dropped: a power-of-two exponent per 32 under the 256 block's d (x nearer its
//    per-32 precision: 1.62e-2 -> 1.10e-2 relative error on heavy-tailed x) cost Q4_K 5-11 % and
//    Q6_K 22-25 % more time: the loop is bound by instruction throughput now, and the shift
//    adds two instructions a group and a row.
#include "linear/int8_linear.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>

#include "common/isa.h"
#include "common/task_pool.h"
#include "elementwise/elementwise_cpu.h"
#include "linear/gguf_args.h"
#include "linear/int8_kernels.h"
#include "linear/int8_layout.h"
#include "linear/panel_common.h"

namespace freetoken {

using namespace int8;  // NOLINT: this file is the int8 mode's entry

namespace {

bool use_vnni() { return cpu_has_vnni() && current_isa() == Isa::kAvx512; }
std::atomic<bool>& amx_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}
// The AMX loop takes every panel where the CPU has AMX-INT8, from kAmxRows rows:
// below, widening the 4-bit codes for the tiles costs what the tiles save (SmolLM2's Q4_1, two
// threads: 16 rows 1.1x the VNNI loop's time, 32 rows 0.85-1.0x, 128 rows 0.75-0.9x).
constexpr int64_t kAmxRows = 32;
// NOTE: the AMX loop's x (its tile copy of a K-quant's rows) is read again by every panel; past
// ~1 MiB it falls out of L2 (2 MiB a core on AMX CPUs) and each panel streams it from L3. In
// ranges of K of 1 MiB of x, at 224 rows: the 8B-shaped ffn_down (4096 x 14336, four ranges)
// Q4_K 0.70-0.84x the time on two threads, 0.69-0.73x on one; the 1B-shaped (2048 x 8192, two)
// 0.93-1.08x and 0.86-0.91x (two runs of each tree, interleaved). 512 KiB ranges gained less and
// cost K = 4096 1.07-1.11x. Level: 8192 x 2048 at 1024 rows (2 MB of x, two ranges), and the
// VNNI loop in ranges (1.00-1.07x: its products, not x, hold it).
constexpr int64_t kAmxRangeBytes = int64_t{1} << 20;
// NOTE: the AMX loop's pool tasks by count, not by weight bytes (at most 4 a thread there): its
// calls are compute-bound, and a thread that claims the last big task leaves the other waiting.
// 16 a thread, against the bytes' 4, at 224 rows on two threads (medians of 5 bursts, one
// process): 1B-shaped Q4_K 16384 x 2048 0.97x the time, 2048 x 8192 0.93x, Q6_K 2048 x 8192
// 0.91x, 8B-shaped 4096 x 14336 0.92x, 6144 x 4096 0.94x, 28672 x 4096 0.97x, the small 3072 x
// 2048 and 2048 x 2048 level (1.02x, 0.99x; 32 a thread: 1.04x, 1.08x). Served 1B int8 classify
// 1.024x the requests a second (scripts/ab_serve.py, 4 reps).
constexpr int64_t kAmxTasksPerThread = 16;
bool use_amx() { return use_vnni() && amx_allowed().load() && cpu_has_amx(); }
// AVX2 (and AVX-512 without VNNI): the 8-lane kernel.
bool use_avx2() { return !use_vnni() && current_isa() != Isa::kBase; }
std::atomic<bool>& avx_vnni_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}
// The 8-lane kernel's steps by AVX-VNNI's vpdpbusd where the CPU has it (the same bits).
bool use_avx_vnni() { return use_avx2() && avx_vnni_allowed().load() && cpu_has_avx_vnni(); }

struct ActStore {
  at::Tensor q, d, s16, s32, xs32, qt, qa, sd;
  int64_t qa_rows = 0;
  Acts view() const {
    return {q.data_ptr<int8_t>(),    d.data_ptr<float>(), s16.data_ptr<int16_t>(),
            s32.data_ptr<int16_t>(), xs32.data_ptr<float>(), q.size(1),
            qt.defined() ? qt.data_ptr<int32_t>() : nullptr,
            qa.defined() ? qa.data_ptr<int8_t>() : nullptr,
            sd.defined() ? sd.data_ptr<uint8_t>() : nullptr,
            qa_rows};
  }
};

// The tile copy of q that the VNNI K-quant loop reads (Acts::qt).
void tile_rows(ActStore& s) {
  const int64_t M = s.q.size(0), K4 = s.q.size(1) / 4, tiles = (M + kTileRows - 1) / kTileRows;
  s.qt = at::empty({tiles * K4 * kTileRows}, s.q.options().dtype(at::kInt));
  const auto* q = reinterpret_cast<const int32_t*>(s.q.data_ptr<int8_t>());
  int32_t* qt = s.qt.data_ptr<int32_t>();
  TaskPool::get().run(tiles, tiles < 4 ? 1 : at::get_num_threads(), [&](int64_t t) {
    const int64_t rows = std::min<int64_t>(kTileRows, M - t * kTileRows);
    for (int64_t r = 0; r < rows; ++r) {
      const int32_t* src = q + (t * kTileRows + r) * K4;
      int32_t* dst = qt + t * K4 * kTileRows + r;
      for (int64_t k = 0; k < K4; ++k) dst[k * kTileRows] = src[k];
    }
  });
}

// The tile copy of q that the AMX loop reads for a K-quant (Acts::qa; K is whole 64s).
// NOTE: read in place, a tile's 16 rows are K bytes apart, and at K = 2048 / 8192 they share
// one or two L1 sets: a 1B-shaped Q4_K 2048 x 8192 at 224 rows took 1.13-1.16x the time of the
// copy (8192 x 2048: 0.97x, level). The 32-value formats' loop reads q in place: there the copy
// cost more than it saved (SmolLM2's Q4_1 1536 x 576 at 224 rows: 1.10x the time, one thread).
// With it, the steps' sums of 32 and d (Acts::sd). The rows past the last whole 16 make a tile of
// their own, zeros past M.
// NOTE: not the VNNI loop for them (it read them in place, K bytes apart): a 1B-shaped Q4_K
// 8192 x 2048 at 238 rows took 6.9 ms (two threads) that way against 4.9 as a tile; 1 and 4
// rows past 224 level (4.71 / 4.75 ms, 4.91 / 4.87).
void amx_rows(ActStore& s) {
  const int64_t M = s.q.size(0), K = s.q.size(1), chunks = K / 64, units = K / 256;
  const int64_t tiles = (M + 15) / 16, ld32 = K / kXBlock;
  s.qa_rows = tiles * 16;
  s.qa = at::empty({tiles * K * 16}, s.q.options());
  s.sd = at::empty({tiles * units * 16 * kSdRowBytes}, s.q.options().dtype(at::kByte));
  const int8_t* q = s.q.data_ptr<int8_t>();
  const int16_t* s32 = s.s32.data_ptr<int16_t>();
  const float* d = s.d.data_ptr<float>();
  int8_t* qa = s.qa.data_ptr<int8_t>();
  uint8_t* sd = s.sd.data_ptr<uint8_t>();
  TaskPool::get().run(tiles, tiles < 8 ? 1 : at::get_num_threads(), [&](int64_t t) {
    const int64_t rows = std::min<int64_t>(16, M - t * 16);
    for (int64_t c = 0; c < chunks; ++c) {
      int8_t* tile = qa + (t * chunks + c) * 16 * 64;
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(tile + r * 64, q + (t * 16 + r) * K + 64 * c, 64);
      std::memset(tile + rows * 64, 0, (16 - rows) * 64);
    }
    for (int64_t u = 0; u < units; ++u) {
      uint8_t* tile = sd + (t * units + u) * 16 * kSdRowBytes;
      std::memset(tile, 0, 16 * kSdRowBytes);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = t * 16 + r;
        std::memcpy(tile + r * kSdRowBytes, s32 + m * ld32 + u * 8, 16);
        std::memcpy(tile + r * kSdRowBytes + 16, d + m * ld32 + u * 8, sizeof(float));
      }
    }
  });
}

// The activation store for M rows of K values. d and s16 hold whole tiles of 16 rows, zeros past
// M: the AMX loop's Q2_K steps read them for every row of its last tile (Acts::qa_rows).
ActStore empty_acts(int64_t M, int64_t K, const at::TensorOptions& f32) {
  const int64_t B32 = K / kXBlock, tiled = (M + 15) / 16 * 16;
  const auto i16 = f32.dtype(at::kShort);
  at::Tensor d = at::empty({tiled, B32}, f32), s16 = at::empty({tiled, 2 * B32}, i16);
  if (tiled > M) {
    d.narrow(0, M, tiled - M).zero_();
    s16.narrow(0, M, tiled - M).zero_();
  }
  return {at::empty({M, K}, f32.dtype(at::kChar)), d, s16, at::empty({M, B32}, i16),
          at::empty({M, B32}, f32)};
}

ActsOut acts_out(const ActStore& s) {
  return {s.q.data_ptr<int8_t>(), s.d.data_ptr<float>(), s.s16.data_ptr<int16_t>(),
          s.s32.data_ptr<int16_t>(), s.xs32.data_ptr<float>()};
}

// Blocks [b0, b1) of B values of x (x + b * B) into out, in the loop of this CPU's ISA.
void quantize_range(const float* x, int B, const ActsOut& out, int64_t b0, int64_t b1) {
#if FT_HAS_ISA_VARIANTS
  if (use_vnni()) return quantize_blocks_vnni(x, B, out, b0, b1);
  if (use_avx2()) return quantize_blocks_avx2(x, B, out, b0, b1);
#endif
  for (int64_t b = b0; b < b1; ++b) quantize_block(x, B, out, b);
}

// x [M, K] quantized per block of B values (32 or 256).
ActStore quantize(const at::Tensor& x, int B) {
  const int64_t M = x.size(0), K = x.size(1), B32 = K / kXBlock;
  ActStore s = empty_acts(M, K, x.options());
  const ActsOut out = acts_out(s);
  const float* xp = x.data_ptr<float>();
  // Worth the pool from a few thousand blocks of 32 (a prefill step).
  const int64_t nblocks = M * K / B;
  const int nthreads = M * B32 < 4096 ? 1 : at::get_num_threads();
  const int64_t n = nthreads == 1 ? 1 : 4 * nthreads;
  TaskPool::get().run(n, nthreads, [&](int64_t t) {
    quantize_range(xp, B, out, nblocks * t / n, nblocks * (t + 1) / n);
  });
  return s;
}

// silu(gate) * up quantized as quantize() would quantize silu_mul_cpu's result (the same bits),
// gate | up = gate_up [M, 2K]: each row's activation made into a thread's scratch and quantized
// from there, never stored whole.
// NOTE: silu_mul's [M, K] written out and read back: the 1B-shaped ffn_down (Q4_K 2048 x 8192,
// 224 rows, two threads) took 6.7-7.0 ms after silu_mul, 6.4 ms so (silu_mul 0.47 ms alone).
ActStore quantize_silu(const at::Tensor& gate_up, int64_t K, int B) {
  const int64_t M = gate_up.size(0), B32 = K / kXBlock;
  ActStore s = empty_acts(M, K, gate_up.options());
  const ActsOut out = acts_out(s);
  const float* gu = gate_up.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  // silu_mul_cpu's split (elementwise_cpu.cpp: from 2^15 elements of gate_up): a decode step's 8
  // rows of 1B-shaped gate_up go to both threads, as they did there.
  const int nthreads = M * 2 * K < (int64_t{1} << 15) ? 1 : at::get_num_threads();
  const int64_t n = std::min<int64_t>(M, nthreads == 1 ? 1 : 4 * nthreads);
  TaskPool::get().run(n, nthreads, [&](int64_t t) {
    thread_local std::vector<float> act;
    if (act.size() < static_cast<size_t>(K)) act.resize(K);
    for (int64_t m = M * t / n; m < M * (t + 1) / n; ++m) {
      silu_mul_rows_fp32(gu, stride, K, m, m + 1, act.data());
      const ActsOut row{out.q + m * K, out.d + m * B32, out.s16 + m * 2 * B32, out.s32 + m * B32,
                        out.xs32 + m * B32};
      quantize_range(act.data(), B, row, 0, K / B);
    }
  });
  return s;
}

// y [M, N] = the quantized rows in `store` times the matrix (+ bias): the loops, threads and
// ranges of K; `weight` is the matrix's tensor (its size sets the task count).
at::Tensor multiply(ActStore& store, const Matrix& mat, const at::Tensor& weight,
                    const float* b, int64_t M, const at::TensorOptions& f32) {
  at::Tensor y = at::empty({M, mat.N}, f32);
  const bool vnni = use_vnni(), avx2 = use_avx2(), amx = M >= kAmxRows && use_amx();
  const bool avx_vnni = use_avx_vnni();
  // NOTE: from two tiles of rows: the copy's one base address for the tile's 12 broadcasts saves
  // the loop its row-pointer upkeep (1B-shaped Q4_K / Q6_K: 64 rows 0.81x, 224 rows 0.92-0.95x
  // the time, copy included), while at 8 rows (decode) it bought nothing (1.09x at 2 threads).
  // And from 9 rows where K bytes put every row's line in one or two L1 sets (K = 2048, 8192):
  // 12 rows in place evicted each other (1B ffn_down, 12 rows: 1.21x the time of K = 7936).
  const bool rows_share_sets = std::gcd<int64_t>(mat.K / 64, 64) >= 32;
  if (vnni && !amx && mat.xblock == 256 &&
      (M > kTileRows || (M > 8 && rows_share_sets)))
    tile_rows(store);
  if (amx && mat.xblock == 256) amx_rows(store);
  const Acts acts = store.view();
  float* yp = y.data_ptr<float>();
  const auto run = [&](int64_t p0, int64_t p1, int64_t u0, int64_t u1) {
#if FT_HAS_ISA_VARIANTS
    if (amx) return run_panels_amx(mat.base, mat.panels, p0, p1, acts, M, u0, u1, yp, mat.N, b);
#endif
    for (int64_t p = p0; p < p1; ++p) {
      const PanelInfo& pi = mat.panels[p];
#if FT_HAS_ISA_VARIANTS
      if (vnni) {
        run_panel_vnni(mat.base + pi.offset, pi, acts, M, yp, mat.N, b);
        continue;
      }
      if (avx2) {
        run_panel_avx2(mat.base + pi.offset, pi, acts, M, yp, mat.N, b, avx_vnni);
        continue;
      }
#endif
      panel_portable(mat.base + pi.offset, pi, acts, M, yp, mat.N, b);
    }
  };
  // One thread's time, roughly: ~1 byte a weight at ~20 GB/s, or ~300 G int8 products/s.
  const double est_ns = std::max(static_cast<double>(mat.N) * mat.K / 20.0,
                                 static_cast<double>(M) * mat.N * mat.K / 300.0);
  const int nthreads = est_ns < panel::kInlineNs ? 1 : at::get_num_threads();
  const int64_t n =
      amx ? std::min<int64_t>(nthreads == 1 ? 1 : kAmxTasksPerThread * nthreads, mat.P)
          : std::min(panel::pool_tasks(static_cast<double>(weight.nbytes()), nthreads), mat.P);
  // The AMX loop takes a K-quant matrix in ranges of K whose x (Acts::qa) stays in L2 while every
  // panel reads it again (kAmxRangeBytes of it a range), each range's sums parked in y.
  const int64_t superblocks = (mat.K + 255) / 256;
  const int64_t ranges =
      amx && mat.xblock == 256
          ? std::clamp<int64_t>((M * mat.K + kAmxRangeBytes - 1) / kAmxRangeBytes, 1, superblocks)
          : 1;
  for (int64_t r = 0; r < ranges; ++r) {
    const int64_t u0 = superblocks * r / ranges, u1 = superblocks * (r + 1) / ranges;
    TaskPool::get().run(n, nthreads, [&](int64_t t) {
      run(mat.P * t / n, mat.P * (t + 1) / n, u0, u1);
    });
  }
  return y;
}

}  // namespace

std::vector<std::string> int8_matrix_types() {
  std::vector<std::string> out;
  for (const Format& f : kFormats) out.emplace_back(f.name);
  return out;
}

double int8_bits_per_weight(const std::string& type) {
  const int f = format_id(type);
  TORCH_CHECK_VALUE(f >= 0, "int8_bits_per_weight: no int8 kernel for GGUF type ", type);
  const int kind = kFormats[f].kind;
  return 8.0 * static_cast<double>(unit_bytes(kind)) / (kPanel * kKinds[kind].unit);
}

bool int8_vnni_available() { return cpu_has_vnni(); }

bool is_int8_matrix(const at::Tensor& weight) {
  return gguf_args::has_magic(weight, kMagic, kHeaderBytes);
}

std::vector<int64_t> int8_matrix_shape(const at::Tensor& weight) {
  const Matrix m = read_matrix(weight, "int8_matrix_shape");
  return {m.N, m.K};
}

at::Tensor int8_matrix_pack(const at::Tensor& base, const at::Tensor& row_offsets,
                            const std::vector<std::string>& types,
                            const std::vector<int64_t>& ends, int64_t K) {
  const int64_t N = gguf_args::check_rows(base, row_offsets, types, ends, "int8_matrix");
  TORCH_CHECK_VALUE(K >= 32 && K <= INT32_MAX && N <= INT32_MAX, "int8_matrix: bad K ", K);
  const at::Tensor off = row_offsets.contiguous();
  const int64_t* o = off.data_ptr<int64_t>();
  const uint8_t* b = base.data_ptr<uint8_t>();
  std::vector<const uint8_t*> rows(N);
  std::vector<PanelInfo> panels;
  std::vector<int> panel_format;
  int64_t start = 0, bytes = kHeaderBytes;
  for (size_t s = 0; s < types.size(); ++s) {
    const int f = format_id(types[s]);
    TORCH_CHECK_VALUE(f >= 0, "int8_matrix: no int8 kernel for GGUF type ", types[s]);
    const Format& fmt = kFormats[f];
    TORCH_CHECK_VALUE(K % fmt.values == 0, "int8_matrix: a ", types[s], " row holds a multiple ",
                      "of ", fmt.values, " weights, not ", K);
    TORCH_CHECK_VALUE(ends[s] > start && ends[s] <= N, "int8_matrix: segment ends must rise");
    const int64_t row_bytes = K / fmt.values * fmt.bytes;
    for (int64_t n = start; n < ends[s]; ++n) {
      TORCH_CHECK_VALUE(o[n] >= 0 && o[n] + row_bytes <= base.numel(), "int8_matrix: row ", n,
                        " at byte ", o[n], " (", row_bytes, " bytes) lies outside base (",
                        base.numel(), " bytes)");
      rows[n] = b + o[n];
    }
    for (int64_t n = start; n < ends[s]; n += kPanel) {
      panels.push_back({fmt.kind, static_cast<int32_t>(n),
                        static_cast<int32_t>(std::min<int64_t>(ends[s], n + kPanel)), fmt.c, 0});
      panel_format.push_back(f);
    }
    start = ends[s];
  }
  const int64_t P = static_cast<int64_t>(panels.size());
  bytes += (P * static_cast<int64_t>(sizeof(PanelInfo)) + 63) / 64 * 64;
  for (PanelInfo& pi : panels) {
    pi.offset = bytes;
    bytes += (K / kKinds[pi.kind].unit * unit_bytes(pi.kind) + 63) / 64 * 64;
  }
  at::Tensor out = at::zeros({bytes}, base.options());
  uint8_t* p = out.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0, "int8_matrix: unaligned allocation");
  int32_t xblock = kXBlock;
  for (const PanelInfo& pi : panels) xblock = std::max(xblock, kKinds[pi.kind].unit);
  const int32_t h[6] = {kMagic, kVersion, static_cast<int32_t>(N), static_cast<int32_t>(K),
                        static_cast<int32_t>(P), xblock};
  std::memcpy(p, h, sizeof h);
  std::memcpy(p + kHeaderBytes, panels.data(), P * sizeof(PanelInfo));
  TaskPool::get().run(P, at::get_num_threads(), [&](int64_t i) {
    const PanelInfo& pi = panels[i];
    fill_panel(kFormats[panel_format[i]], rows.data(), pi.n0, pi.n1, K, p + pi.offset);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_matrix_unpack(
    const at::Tensor& weight) {
  const Matrix mat = read_matrix(weight, "int8_matrix_unpack");
  const int64_t N = mat.N, K = mat.K;
  at::Tensor u = at::empty({N, K}, weight.options());
  at::Tensor a = at::empty({N, K / 16}, weight.options().dtype(at::kFloat));
  at::Tensor b = at::zeros({N, K / 16}, weight.options().dtype(at::kFloat));
  at::Tensor c = at::empty({N}, weight.options().dtype(at::kInt));
  for (int64_t p = 0; p < mat.P; ++p) {
    const PanelInfo& pi = mat.panels[p];
    const KindInfo& ki = kKinds[pi.kind];
    const int G = ki.group;
    for (int64_t un = 0; un < K / ki.unit; ++un) {
      for (int j = 0; j < ki.unit / G; ++j) {
        const GroupRef gr{pi.kind, mat.base + pi.offset + un * unit_bytes(pi.kind), j};
        const int64_t k0 = un * ki.unit + j * G;
        for (int o = 0; o < pi.n1 - pi.n0; ++o) {
          const int64_t n = pi.n0 + o;
          for (int k = 0; k < G; ++k)
            u.data_ptr<uint8_t>()[n * K + k0 + k] = static_cast<uint8_t>(gr.code(o, k));
          float ga, gb;
          gr.scales(o, &ga, &gb);
          for (int i = 0; i < G / 16; ++i) {
            a.data_ptr<float>()[n * (K / 16) + k0 / 16 + i] = ga;
            b.data_ptr<float>()[n * (K / 16) + k0 / 16 + i] = gb;
          }
          c.data_ptr<int32_t>()[n] = pi.c;
        }
      }
    }
  }
  return {u, a, b, c};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> int8_matrix_superblocks(
    const at::Tensor& weight) {
  const Matrix mat = read_matrix(weight, "int8_matrix_superblocks");
  const int64_t N = mat.N, K = mat.K;
  const auto f32 = weight.options().dtype(at::kFloat), i32 = weight.options().dtype(at::kInt);
  at::Tensor d = at::zeros({N, K / 256}, f32), dmin = at::zeros({N, K / 256}, f32);
  at::Tensor sc = at::zeros({N, K / 16}, i32), mn = at::zeros({N, K / 16}, i32);
  for (int64_t p = 0; p < mat.P; ++p) {
    const PanelInfo& pi = mat.panels[p];
    const KindInfo& ki = kKinds[pi.kind];
    if (ki.unit != 256) continue;
    const bool k4 = ki.scales == kK4;
    for (int64_t un = 0; un < K / 256; ++un) {
      const uint8_t* unit = mat.base + pi.offset + un * unit_bytes(pi.kind);
      for (int o = 0; o < pi.n1 - pi.n0; ++o) {
        const int64_t n = pi.n0 + o;
        d.data_ptr<float>()[n * (K / 256) + un] = gb::half_to_float(unit + 2 * o);
        if (k4) dmin.data_ptr<float>()[n * (K / 256) + un] = gb::half_to_float(unit + 32 + 2 * o);
        for (int i = 0; i < 16; ++i) {
          const GroupRef gr{pi.kind, unit, i * 16 / ki.group};
          sc.data_ptr<int32_t>()[n * (K / 16) + un * 16 + i] = gr.sc(o);
          if (k4) mn.data_ptr<int32_t>()[n * (K / 16) + un * 16 + i] = gr.mn(o);
        }
      }
    }
  }
  return {d, dmin, sc, mn};
}

std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(const at::Tensor& x, int64_t block) {
  TORCH_CHECK_VALUE(block == 32 || block == 256, "int8_quantize_rows: block is 32 or 256, not ",
                    block);
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                        x.is_contiguous() && x.size(1) % block == 0,
                    "int8_quantize_rows: x must be a contiguous [M, K] fp32 CPU tensor, K a "
                    "multiple of ", block);
  ActStore s = quantize(x, static_cast<int>(block));
  return {s.q, s.d.narrow(0, 0, x.size(0))};
}

at::Tensor int8_matrix_linear(const at::Tensor& x, const at::Tensor& weight,
                              const c10::optional<at::Tensor>& bias) {
  const Matrix mat = read_matrix(weight, "int8_linear");
  const float* b = gguf_args::check_call(x, mat.K, mat.N, bias, "int8_linear");
  const int64_t M = x.size(0);
  if (M == 0) return at::empty({0, mat.N}, x.options());
  ActStore store = quantize(x, mat.xblock);
  return multiply(store, mat, weight, b, M, x.options());
}

at::Tensor int8_silu_linear(const at::Tensor& gate_up, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias) {
  const Matrix mat = read_matrix(weight, "int8_silu_linear");
  TORCH_CHECK_VALUE(gate_up.device().is_cpu() && gate_up.scalar_type() == at::kFloat &&
                        gate_up.dim() == 2 && (gate_up.stride(1) == 1 || gate_up.size(1) <= 1),
                    "int8_silu_linear: gate_up must be a 2-D fp32 CPU tensor [M, 2K] with "
                    "contiguous rows");
  TORCH_CHECK_VALUE(gate_up.size(1) == 2 * mat.K, "int8_silu_linear: gate_up has ",
                    gate_up.size(1), " columns, the weight has K = ", mat.K, " (2K columns)");
  const float* b = gguf_args::check_bias(bias, mat.N, "int8_silu_linear");
  const int64_t M = gate_up.size(0);
  if (M == 0) return at::empty({0, mat.N}, gate_up.options());
  ActStore store = quantize_silu(gate_up, mat.K, mat.xblock);
  return multiply(store, mat, weight, b, M, gate_up.options());
}

bool int8_amx_available() { return use_vnni() && cpu_has_amx(); }

bool set_int8_amx(bool allowed) { return amx_allowed().exchange(allowed); }

bool int8_avx_vnni_available() { return use_avx2() && cpu_has_avx_vnni(); }

bool set_int8_avx_vnni(bool allowed) { return avx_vnni_allowed().exchange(allowed); }

std::string int8_bound_loop() {
  if (use_amx()) return "tdpbssd (AMX-INT8)";
  if (use_vnni()) return "vpdpbusd (AVX512-VNNI)";
  if (use_avx_vnni()) return "vpdpbusd (AVX-VNNI)";
  return use_avx2() ? "vpmaddubsw+vpaddw (AVX2)" : "";
}

double int8_peak_gops(int64_t iters, int64_t threads) {
  const bool vnni = use_vnni(), avx2 = use_avx2(), amx = use_amx(), avx_vnni = use_avx_vnni();
  TORCH_CHECK_VALUE(vnni || avx2,
                    "int8_peak_gops: the portable int8 loop is in use (no AVX512-VNNI or AVX2)");
#if FT_HAS_ISA_VARIANTS
  const auto t0 = std::chrono::steady_clock::now();
  TaskPool::get().run(threads, static_cast<int>(threads), [&](int64_t) {
    if (amx) amx_chains(iters / 16);
    else if (vnni) vnni_chains(iters);
    else if (avx_vnni) avx_vnni_chains(iters);
    else avx2_int8_chains(iters);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // a thread's (AMX: iters / 16 rounds of 4 tile products of 16 x 16 x 64)
  const double products = amx    ? 4.0 * 16 * 16 * 64 * static_cast<double>(iters / 16)
                          : vnni     ? 64.0 * 12 * static_cast<double>(iters)
                          : avx_vnni ? 32.0 * 12 * static_cast<double>(iters)
                                     : 32.0 * 6 * static_cast<double>(iters);
  return 2.0 * products * threads / s / 1e9;
#else
  return 0;
#endif
}

}  // namespace freetoken
