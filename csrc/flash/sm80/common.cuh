// Building blocks shared by the sm80 family's forward and backward kernels: PTX wrappers
// (mma.sync, ldmatrix, cp.async), the swizzled shared-memory tile, tile loads with zero-fill,
// the mask / ALiBi / dropout of one S tile in mma layout, and a warp-level GEMM over
// shared-memory operands. (Sequences, the mask band and Philox: common/sequence.cuh.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#include "flash/flash.h"
#include "flash/common/launch.cuh"
#include "flash/common/sequence.cuh"

namespace transformer_fa {
namespace flash {
namespace sm80 {

// ---------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; valid = false fills the destination with zeros (no read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
// 4-byte global -> shared copy (zero-filled when not valid), for per-row floats.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// acc += A B for one m16n8k16 tile (fp16 or bf16 inputs, float accumulators). Inline asm
// needs the PTX type as a literal, hence the macro that writes the instruction once.
#define TFA_MMA_16816(TYPE)                                                                  \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                       \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"     \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                             \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "fp16 or bf16");
  if constexpr (std::is_same_v<T, __half>) {
    TFA_MMA_16816("f16");
  } else {
    TFA_MMA_16816("bf16");
  }
}
#undef TFA_MMA_16816

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Element to float without the implicit conversions torch's build disables
// (__CUDA_NO_HALF_CONVERSIONS__, __CUDA_NO_BFLOAT16_CONVERSIONS__).
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Adds (a, b) to two adjacent floats in global memory (8-byte aligned). Hopper has a vector
// reduction; older GPUs take two.
__device__ __forceinline__ void atomic_add2(float* ptr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(ptr), "f"(a), "f"(b)
               : "memory");
#else
  atomicAdd(ptr, a);
  atomicAdd(ptr + 1, b);
#endif
}

// ---------------------------------------------------------------------------------------
// Shared-memory tiles
// ---------------------------------------------------------------------------------------
// Element offset of (row, col) in a [rows][kRowLen] shared tile whose 16-byte chunks are
// XOR-swizzled by row % 8 (conflict-free ldmatrix, cp.async and 4-byte stores). kRowLen is a
// multiple of 64; col is a multiple of 8 for 16-byte accesses.
template <int kRowLen>
__device__ __forceinline__ int swz(int row, int col) {
  static_assert(kRowLen % 64 == 0, "the swizzle permutes 8 chunks of 8 elements");
  return row * kRowLen + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

template <int kLd>
constexpr bool kPow2 = (kLd & (kLd - 1)) == 0;


// ldmatrix addresses of one lane in a swizzled [rows][kLd] shared tile: the lane's own
// position (row, col), then fragments at (row + dr, col + dc), dr and dc multiples of 8.
// swz() XORs only the low 3 chunk bits, so when dc's low chunk bits are clear in col (kSplit),
// a fragment's address is one of a few per-lane values (by dc % 64) plus a constant. The
// lane values are made opaque so that the main loops recompute them per GEMM instead of
// hoisting one register per fragment (which spills).
template <int kLd, bool kSplit>
struct LaneTile {
  uint32_t base;
  int row, col, row_off, chunk;
  __device__ __forceinline__ LaneTile(const void* tile, int row_, int col_)
      : base(smem_u32(tile)), row(row_), col(col_) {
    if constexpr (kSplit) {
      row_off = opaque(row * kLd + (col & ~63) + (col & 7));
      chunk = opaque(((col >> 3) & 7) ^ (row & 7));
    }
  }
  __device__ __forceinline__ uint32_t at(int dr, int dc) const {
    if constexpr (kSplit) {
      return base + 2 * (row_off + dr * kLd + (dc & ~63) + ((chunk ^ ((dc >> 3) & 7)) << 3));
    } else {
      return base + 2 * swz<kLd>(row + dr, col + dc);
    }
  }
};

// Copies rows [0, kRows) x columns [0, kRowLen) of a global tile into swizzled shared memory;
// rows >= valid_rows and columns >= valid_cols (a multiple of 8) are zero-filled.
// A zero-filled chunk's cp.async reads no bytes (src-size 0), so its source operand may be its
// own address, past the tensor's end (memcheck-clean on ragged tails), or, with kZfillFromBase,
// the tile's base, at the cost of a 64-bit select per chunk. Which one the kernels run faster
// with depends on how ptxas then schedules their loops (measured per kernel, in the traits).
template <typename T, int kRowLen, int kRows, int kThreads, bool kZfillFromBase = true>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t row_stride,
                                          int valid_rows, int valid_cols, int tid) {
  constexpr int kChunks = kRowLen / 8;
  constexpr int kRowStep = kThreads / kChunks;
  if constexpr (kThreads % kChunks == 0 && kRows % kRowStep == 0 &&
                (kRowStep % 8 == 0 || 8 % kRowStep == 0)) {
    // Thread tid copies chunk tid % kChunks of rows tid / kChunks + i * kRowStep: one running
    // pointer (per-chunk addresses are not kept in registers across a main loop). The swizzle
    // of those rows repeats every 8 rows: one shared address per row phase.
    constexpr int kPhases = kRowStep % 8 == 0 ? 1 : 8 / kRowStep;
    const int row0 = tid / kChunks;
    const int col = (tid % kChunks) * 8;
    const bool col_ok = col < valid_cols;
    const T* src = gmem + row0 * row_stride + col;
    const int64_t step = kRowStep * row_stride;
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const bool ok = col_ok && row0 + i * kRowStep < valid_rows;
      const int phase = i % kPhases;
      const uint32_t dst = smem_u32(smem + swz<kRowLen>(row0 + phase * kRowStep, col)) +
                           (i - phase) * kRowStep * kRowLen * int(sizeof(T));
      cp_async_16(dst, kZfillFromBase && !ok ? gmem : src, ok);
      src += step;
    }
  } else {  // rows whose chunks do not divide over the threads (d = 192)
    static_assert(kRows * kChunks % kThreads == 0, "tile chunks divide over the threads");
#pragma unroll
    for (int i = 0; i < kRows * kChunks / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      const int row = idx / kChunks, col = (idx % kChunks) * 8;
      const bool ok = row < valid_rows && col < valid_cols;
      cp_async_16(smem_u32(smem + swz<kRowLen>(row, col)),
                  kZfillFromBase && !ok ? gmem : gmem + row * row_stride + col, ok);
    }
  }
}

// Stores an accumulator tile (mma C layout, rows row0 + 16 mf + g (+8), columns
// col0 + 8 nf + 2t) into a swizzled shared tile as T. row0 / col0 are multiples of the tile.
template <typename T, int kRowLen, int MF, int NF>
__device__ __forceinline__ void store_acc(T* smem, const float (&acc)[MF][NF][4], int row0,
                                          int col0, int lane, float scale = 1.f) {
  const int g = lane / 4, t = lane % 4;
  const LaneTile<kRowLen, kPow2<NF * 8>> tile(smem, row0 + g, col0 + 2 * t);
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t addr = tile.at(mf * 16 + 8 * r, nf * 8);
        const uint32_t v = pack2<T>(acc[mf][nf][2 * r] * scale, acc[mf][nf][2 * r + 1] * scale);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
      }
}

// Copies rows [0, min(kRows, valid_rows)) x columns [0, valid_cols) of a swizzled shared
// tile to global memory (16-byte chunks). The caller has synchronized after writing it.
template <typename T, int kRowLen, int kRows, int kThreads>
__device__ __forceinline__ void store_tile(T* gmem, int64_t row_stride, const T* smem,
                                           int valid_rows, int valid_cols, int tid) {
  constexpr int kChunks = kRowLen / 8;
  constexpr int kTotal = kRows * kChunks;
  static_assert(kTotal % kThreads == 0, "tile chunks divide over the threads");
#pragma unroll
  for (int i = 0; i < kTotal / kThreads; ++i) {
    const int idx = tid + i * kThreads;
    const int row = idx / kChunks;
    const int col = (idx % kChunks) * 8;
    if (row < valid_rows && col < valid_cols) {
      *reinterpret_cast<uint4*>(gmem + int64_t(row) * row_stride + col) =
          *reinterpret_cast<const uint4*>(smem + swz<kRowLen>(row, col));
    }
  }
}

// ---------------------------------------------------------------------------------------
// Warp GEMM: acc[MF][NF] (a 16 MF x 8 NF tile) += A[m0.., k0..] * B[k0.., n0..] over
// kSteps steps of 16, operands in swizzled shared tiles.
//   A is m-major ([m][k], kATrans = false) or k-major ([k][m], kATrans = true);
//   B is n-major ([n][k], kBTrans = false) or k-major ([k][n], kBTrans = true).
// mma_pipeline orders the fragment loads and MMAs; WarpMma holds one warp's operand
// addressing and loads one fragment.
// ---------------------------------------------------------------------------------------

// acc[MF][NF] += A B as kSteps * NF / 2 steps of one B fragment (n8 tiles 2 nn and 2 nn + 1 of
// k step kk) each. B is loaded kAhead steps before its MMAs and A one k step before, so that
// the MMAs in between cover the ldmatrix latency while only kAhead + 1 B fragments and two sets
// of A fragments are live. load_a(kk, mf, frag) and load_b(kk, nn, frag) issue one ldmatrix.
template <typename T, int MF, int NF, int kSteps, int kAhead, typename LoadA, typename LoadB>
__device__ __forceinline__ void mma_pipeline(float (&acc)[MF][NF][4], const LoadA& load_a,
                                             const LoadB& load_b) {
  static_assert(NF % 2 == 0 && kAhead >= 1, "B fragments come in pairs of n8 tiles");
  constexpr int kPairs = NF / 2;
  constexpr int kTotal = kSteps * kPairs;
  uint32_t a[2][MF][4];
  uint32_t b[kAhead + 1][4];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) load_a(0, mf, a[0][mf]);
#pragma unroll
  for (int s = 0; s < kAhead && s < kTotal; ++s) load_b(s / kPairs, s % kPairs, b[s]);
#pragma unroll
  for (int s = 0; s < kTotal; ++s) {
    const int kk = s / kPairs, nn = s % kPairs;
    if (nn == 0 && kk + 1 < kSteps) {
#pragma unroll
      for (int mf = 0; mf < MF; ++mf) load_a(kk + 1, mf, a[(kk + 1) & 1][mf]);
    }
    if (s + kAhead < kTotal) {
      const int sn = s + kAhead;
      load_b(sn / kPairs, sn % kPairs, b[sn % (kAhead + 1)]);
    }
    const uint32_t(&bs)[4] = b[s % (kAhead + 1)];
#pragma unroll
    for (int mf = 0; mf < MF; ++mf) {
      mma_16816<T>(acc[mf][2 * nn], a[kk & 1][mf], bs[0], bs[1]);
      mma_16816<T>(acc[mf][2 * nn + 1], a[kk & 1][mf], bs[2], bs[3]);
    }
  }
}

template <typename T, int MF, int NF, bool kATrans, bool kBTrans, int kLdA, int kLdB>
struct WarpMma {
  static_assert(sizeof(T) == 2, "16-bit elements");
  // The fragment steps along a row are k (from 0: clear of the lane's chunk bit) or, for a
  // transposed operand, m / n inside the warp tile: clear of the warp offset's bits when the
  // warp tile width is a power of two.
  static constexpr bool kSplitA = !kATrans || kPow2<MF * 16>;
  static constexpr bool kSplitB = !kBTrans || kPow2<NF * 8>;
  LaneTile<kLdA, kSplitA> ta;
  LaneTile<kLdB, kSplitB> tb;

  // ldmatrix lane addressing (mma.m16n8k16 fragment layouts).
  static __device__ __forceinline__ int a_row(int lane) {  // k | m
    return kATrans ? (lane & 7) + ((lane >> 4) << 3) : (lane & 15);
  }
  static __device__ __forceinline__ int a_col(int lane) {  // m | k
    return kATrans ? ((lane >> 3) & 1) << 3 : (lane >> 4) << 3;
  }
  static __device__ __forceinline__ int b_row(int lane) {  // k | n
    return kBTrans ? (lane & 7) + (((lane >> 3) & 1) << 3) : (lane & 7) + ((lane >> 4) << 3);
  }
  static __device__ __forceinline__ int b_col(int lane) {  // n | k
    return kBTrans ? (lane >> 4) << 3 : ((lane >> 3) & 1) << 3;
  }
  __device__ __forceinline__ WarpMma(const T* sA, int m0, const T* sB, int n0, int lane)
      : ta(sA, kATrans ? a_row(lane) : m0 + a_row(lane), kATrans ? m0 + a_col(lane) : a_col(lane)),
        tb(sB, kBTrans ? b_row(lane) : n0 + b_row(lane), kBTrans ? n0 + b_col(lane) : b_col(lane)) {}

  // A fragment mf and B fragment nn (n8 tiles 2 nn, 2 nn + 1) of k step kk.
  __device__ __forceinline__ void load_a(int kk, int mf, uint32_t (&a)[4]) const {
    if constexpr (kATrans) {
      ldmatrix_x4_trans(a, ta.at(kk * 16, mf * 16));
    } else {
      ldmatrix_x4(a, ta.at(mf * 16, kk * 16));
    }
  }
  __device__ __forceinline__ void load_b(int kk, int nn, uint32_t (&b)[4]) const {
    if constexpr (kBTrans) {
      ldmatrix_x4_trans(b, tb.at(kk * 16, nn * 16));
    } else {
      ldmatrix_x4(b, tb.at(nn * 16, kk * 16));
    }
  }
};

template <typename T, int MF, int NF, int kSteps, bool kATrans, bool kBTrans, int kLdA, int kLdB,
          int kAhead = 2>
__device__ __forceinline__ void warp_gemm(float (&acc)[MF][NF][4], const T* sA, int m0,
                                          const T* sB, int n0, int lane) {
  const WarpMma<T, MF, NF, kATrans, kBTrans, kLdA, kLdB> g(sA, m0, sB, n0, lane);
  mma_pipeline<T, MF, NF, kSteps, kAhead>(
      acc, [&](int kk, int mf, uint32_t(&a)[4]) { g.load_a(kk, mf, a); },
      [&](int kk, int nn, uint32_t(&b)[4]) { g.load_b(kk, nn, b); });
}

template <int MF, int NF>
__device__ __forceinline__ void zero(float (&acc)[MF][NF][4]) {
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mf][nf][e] = 0.f;
}

// ---------------------------------------------------------------------------------------
// ALiBi, the mask and dropout of one S tile (mma C layout: element e of acc[mf][nf] is
// row i0 + 16 mf + g + 8 (e / 2), column j0 + 8 nf + 2 t + e % 2; i0 is a multiple of 16
// and j0 of 8, both per-sequence positions).
// ---------------------------------------------------------------------------------------
// ALiBi (when alibi_coef != 0: -slope / softmax_scale, added to the raw q.k) and the band
// mask (-inf), on the raw scores.
template <int MF, int NF>
__device__ __forceinline__ void bias_and_mask(float (&acc)[MF][NF][4], int i0, int j0, int lane,
                                              const Band& b, bool need_mask, float alibi_coef) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int diag = i0 + mf * 16 + g + 8 * r + b.off;
      int j_hi = b.len_k - 1;
      if (b.right >= 0) j_hi = min(j_hi, diag + b.right);
      const int j_lo = b.left >= 0 ? diag - b.left : INT32_MIN;
#pragma unroll
      for (int nf = 0; nf < NF; ++nf)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = j0 + nf * 8 + 2 * t + e;
          float& s = acc[mf][nf][2 * r + e];
          if (alibi_coef != 0.f) s = fmaf(alibi_coef, float(abs(diag - j)), s);
          if (need_mask && (j > j_hi || j < j_lo)) s = -INFINITY;
        }
    }
}

// Bit e: element e of the mma C tile at rows i0 + g (+8), columns j0 + 2t (+1) is kept
// (flash.h defines the mask). One 16 x 8 tile per call, so that callers apply it at once
// instead of holding the bits of a whole warp tile in registers.
__device__ __forceinline__ uint32_t dropout_bits(const Dropout& d, int i0, int j0, int lane) {
  const int g = lane / 4, t = lane % 4;
  const uint32_t i = i0, j = j0;
  const uint4 w =
      philox(d.k0, d.k1, make_uint4(j >> 3, ((i >> 4) << 5) | (g << 2) | t, d.bh, d.offset));
  return uint32_t(w.x < d.threshold) | (uint32_t(w.y < d.threshold) << 1) |
         (uint32_t(w.z < d.threshold) << 2) | (uint32_t(w.w < d.threshold) << 3);
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
