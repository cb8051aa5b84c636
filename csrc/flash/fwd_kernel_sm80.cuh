// FlashAttention-2-style forward for sm80+ (Ampere and Hopper alike): mma.sync m16n8k16
// tensor-core instructions, ldmatrix, cp.async, online softmax. One CTA per
// (q tile, head, batch); each warp owns 16 * kMFrags query rows of the tile.
//
// Pipeline per key/value block (as in FlashAttention-2): K and V each have one shared
// buffer. V[n] is loaded while S = Q K[n]^T runs; K[n-1] is loaded while O += P V[n] runs.
// Blocks are visited from the last to the first, so the masked blocks come first.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "flash.h"

namespace transformer_fa {
namespace flash {
namespace sm80 {

template <typename T, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMinBlocks_ = 1>
struct FwdTraits {
  static constexpr int kMinBlocks = kMinBlocks_;  // __launch_bounds__ occupancy hint
  using Element = T;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kMFrags = kBlockM / (16 * kNWarps);  // 16-row MMA tiles per warp
  // With one 16-row tile per warp, its Q fragments stay in registers for the whole loop
  // (4 * head_dim / 16 registers) instead of being re-read from shared memory per key block.
  static constexpr bool kQInRegs = kMFrags == 1;
  static constexpr int kChunks = kHeadDim / 8;              // 16-byte chunks per row
  static constexpr int kSmemQ = kBlockM * kHeadDim;         // elements
  static constexpr int kSmemKV = kBlockN * kHeadDim;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kSmemKV) * int(sizeof(T));
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row MMA tiles");
  static_assert(kHeadDim % 64 == 0, "head dims are multiples of 64 (swizzle over 8 chunks)");
  static_assert(kBlockN % 16 == 0, "key blocks are multiples of 16");
};

// ---------------------------------------------------------------------------------------
// PTX wrappers
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; src_bytes = 0 fills the destination with zeros (no read).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
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

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

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

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Element offset of (row, col) in a [rows][kHeadDim] shared tile whose 16-byte chunks are
// XOR-swizzled by row % 8 (conflict-free ldmatrix and cp.async). col is a multiple of 8 for
// 16-byte accesses; any col works for the epilogue's 4-byte writes.
template <int kHeadDim>
__device__ __forceinline__ int swz(int row, int col) {
  return row * kHeadDim + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Copies rows [0, kRows) of a tile into swizzled shared memory; rows >= valid_rows are zero.
// Thread tid copies chunk tid % kChunks of rows tid / kChunks + i * kRowStep: one running
// pointer (the per-chunk addresses are not kept in registers across the main loop).
template <typename Tr, int kRows>
__device__ __forceinline__ void load_tile(typename Tr::Element* smem,
                                          const typename Tr::Element* gmem, int64_t row_stride,
                                          int valid_rows, int tid) {
  constexpr int kRowStep = Tr::kNThreads / Tr::kChunks;
  static_assert(Tr::kNThreads % Tr::kChunks == 0 && kRows % kRowStep == 0,
                "tile chunks divide over the threads");
  static_assert(kRowStep % 8 == 0, "rows of one thread share the swizzle (row % 8)");
  const int row0 = tid / Tr::kChunks;
  const int col = (tid % Tr::kChunks) * 8;
  const typename Tr::Element* src = gmem + row0 * row_stride + col;
  const int64_t step = kRowStep * row_stride;
  const uint32_t dst0 = smem_u32(smem + swz<Tr::kHeadDim>(row0, col));
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const int row = row0 + i * kRowStep;
    // kRowStep is a multiple of 8, so every row of this thread has the same swizzle.
    cp_async_16(dst0 + i * kRowStep * Tr::kHeadDim * int(sizeof(typename Tr::Element)),
                row < valid_rows ? src : gmem, row < valid_rows);
    src += step;
  }
}

struct SeqInfo {
  int len_q, len_k;      // actual lengths
  int rows_q;            // rows of the output this sequence owns (len_q, or padded length)
  int64_t q_off, k_off, v_off, o_off, lse_off;  // element offsets of row 0 (head 0)
};

__device__ __forceinline__ SeqInfo seq_info(const FwdParams& p, int bidb) {
  SeqInfo s;
  int start_q = 0, start_k = 0;
  if (p.cu_seqlens_q != nullptr) {
    start_q = p.cu_seqlens_q[bidb];
    s.len_q = p.cu_seqlens_q[bidb + 1] - start_q;
  } else {
    s.len_q = p.seqlen_q;
  }
  if (p.cu_seqlens_k != nullptr) {
    start_k = p.cu_seqlens_k[bidb];
    s.len_k = p.cu_seqlens_k[bidb + 1] - start_k;
  } else {
    s.len_k = p.seqlen_k;
  }
  s.rows_q = p.q_packed ? s.len_q : p.seqlen_q;
  s.q_off = p.q_packed ? int64_t(start_q) * p.q_row_stride : int64_t(bidb) * p.q_batch_stride;
  s.o_off = p.q_packed ? int64_t(start_q) * p.o_row_stride : int64_t(bidb) * p.o_batch_stride;
  s.lse_off = p.q_packed ? int64_t(start_q) * p.lse_row_stride
                         : int64_t(bidb) * p.lse_batch_stride;
  s.k_off = p.k_packed ? int64_t(start_k) * p.k_row_stride : int64_t(bidb) * p.k_batch_stride;
  s.v_off = p.k_packed ? int64_t(start_k) * p.v_row_stride : int64_t(bidb) * p.v_batch_stride;
  return s;
}

// ---------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------
template <typename Tr>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocks) fwd_kernel(const FwdParams p) {
  using T = typename Tr::Element;
  constexpr int D = Tr::kHeadDim;
  constexpr int BM = Tr::kBlockM;
  constexpr int BN = Tr::kBlockN;
  constexpr int MF = Tr::kMFrags;
  constexpr int NF_S = BN / 8;   // S n-tiles per row group
  constexpr int NF_O = D / 8;    // O n-tiles
  constexpr int KF_QK = D / 16;  // k-steps of Q K^T
  constexpr int KF_PV = BN / 16; // k-steps of P V

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Tr::kSmemQ;
  T* sV = sK + Tr::kSmemKV;

  // Heavier (later, under causal masks) query tiles first.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int bidh = blockIdx.y;
  const int bidb = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // row within an MMA tile (and +8)
  const int t = lane % 4;  // column pair within an n8 tile

  const SeqInfo si = seq_info(p, bidb);
  const int m0 = m_block * BM;
  if (m0 >= si.rows_q) return;  // past this (packed) sequence: nothing to write
  const int bidh_k = bidh / (p.h / p.h_k);

  T* o_base = reinterpret_cast<T*>(p.o) + si.o_off + int64_t(bidh) * p.o_head_stride;
  float* lse_base = p.lse == nullptr ? nullptr
                                     : p.lse + si.lse_off + int64_t(bidh) * p.lse_head_stride;

  // Key range of this tile: [n_lo, n_hi) clipped by the band.
  const int off = p.bottom_right ? si.len_k - si.len_q : 0;
  int n_hi = si.len_k;
  if (p.window_right >= 0) n_hi = min(n_hi, m0 + BM - 1 + off + p.window_right + 1);
  int n_lo = 0;
  if (p.window_left >= 0) n_lo = max(0, m0 + off - p.window_left);
  const int n_block_min = n_lo / BN;
  const int n_block_max = n_hi > 0 ? (n_hi + BN - 1) / BN : 0;
  const int valid_q = min(BM, si.len_q - m0);  // may be <= 0 (padded rows only)

  // Per-thread state: rows (warp, mf, g + 8 r).
  float acc_o[MF][NF_O][4];
  float row_max[MF][2], row_sum[MF][2];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      row_max[mf][r] = -INFINITY;
      row_sum[mf][r] = 0.f;
    }
#pragma unroll
    for (int nf = 0; nf < NF_O; ++nf)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mf][nf][e] = 0.f;
  }

  const bool any_work = valid_q > 0 && n_block_max > n_block_min;
  if (any_work) {
    const T* q_base = reinterpret_cast<const T*>(p.q) + si.q_off +
                      int64_t(bidh) * p.q_head_stride + int64_t(m0) * p.q_row_stride;
    const T* k_base = reinterpret_cast<const T*>(p.k) + si.k_off +
                      int64_t(bidh_k) * p.k_head_stride;
    const T* v_base = reinterpret_cast<const T*>(p.v) + si.v_off +
                      int64_t(bidh_k) * p.v_head_stride;

    load_tile<Tr, BM>(sQ, q_base, p.q_row_stride, valid_q, tid);
    {
      const int n = n_block_max - 1;
      load_tile<Tr, BN>(sK, k_base + int64_t(n) * BN * p.k_row_stride, p.k_row_stride,
                        si.len_k - n * BN, tid);
    }
    cp_async_commit();

    const int warp_row0 = warp * 16 * MF;
    // ldmatrix lane addressing (see the fragment layouts of mma.m16n8k16).
    const int a_row = lane % 16, a_col = (lane / 16) * 8;                          // Q
    const int b_row = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) * 8;  // K
    const int v_row = (lane & 7) + (((lane >> 3) & 1) << 3), v_col = (lane >> 4) * 8;  // V

    // Byte offsets of this lane's ldmatrix rows at k = 0 (XOR-swizzled; see swz).
    const uint32_t sQ_u32 = smem_u32(sQ), sK_u32 = smem_u32(sK), sV_u32 = smem_u32(sV);
    const uint32_t q_off0 = swz<D>(warp_row0 + a_row, a_col) * int(sizeof(T));
    const uint32_t k_off0 = swz<D>(b_row, b_col) * int(sizeof(T));
    const uint32_t v_off0 = swz<D>(v_row, v_col) * int(sizeof(T));
    constexpr int QR = Tr::kQInRegs ? KF_QK : 1;
    uint32_t q_frag[QR][MF][4];
    if constexpr (Tr::kQInRegs) {
      cp_async_wait_all();
      __syncthreads();  // Q visible
#pragma unroll
      for (int kk = 0; kk < KF_QK; ++kk)
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
          ldmatrix_x4(q_frag[kk][mf],
                      smem_u32(sQ + swz<D>(warp_row0 + mf * 16 + a_row, kk * 16 + a_col)));
    }

    for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
      const int n0 = n_block * BN;
      cp_async_wait_all();
      __syncthreads();  // K[n] (and Q) visible; every warp is done with V[n+1]
      load_tile<Tr, BN>(sV, v_base + int64_t(n0) * p.v_row_stride, p.v_row_stride,
                        si.len_k - n0, tid);
      cp_async_commit();

      // S = Q K^T
      float acc_s[MF][NF_S][4];
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int nf = 0; nf < NF_S; ++nf)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[mf][nf][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KF_QK; ++kk) {
        uint32_t a[MF][4];
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          if constexpr (Tr::kQInRegs) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[mf][e] = q_frag[kk][mf][e];
          } else {
            ldmatrix_x4(a[mf], sQ_u32 + ((q_off0 ^ (kk * 32)) + mf * 16 * D * int(sizeof(T))));
          }
        }
#pragma unroll
        for (int nn = 0; nn < NF_S / 2; ++nn) {
          uint32_t b[4];
          // swz(row, 16 kk + c) = swz(row, c) ^ (2 kk chunks): one base offset per thread.
          ldmatrix_x4(b, sK_u32 + ((k_off0 ^ (kk * 32)) + nn * 16 * D * int(sizeof(T))));
#pragma unroll
          for (int mf = 0; mf < MF; ++mf) {
            mma_16816<T>(acc_s[mf][2 * nn], a[mf], b[0], b[1]);
            mma_16816<T>(acc_s[mf][2 * nn + 1], a[mf], b[2], b[3]);
          }
        }
      }

      // Mask (only blocks that reach past the keys or cross the band).
      const bool need_mask =
          n0 + BN > si.len_k ||
          (p.window_right >= 0 && n0 + BN - 1 > m0 + off + p.window_right) ||
          (p.window_left >= 0 && n0 < m0 + BM - 1 + off - p.window_left);
      if (need_mask) {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int i = m0 + warp_row0 + mf * 16 + g + 8 * r;
            const int diag = i + off;
            int j_hi = si.len_k - 1;
            if (p.window_right >= 0) j_hi = min(j_hi, diag + p.window_right);
            const int j_lo = p.window_left >= 0 ? diag - p.window_left : INT32_MIN;
#pragma unroll
            for (int nf = 0; nf < NF_S; ++nf)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int j = n0 + nf * 8 + 2 * t + e;
                if (j > j_hi || j < j_lo) acc_s[mf][nf][2 * r + e] = -INFINITY;
              }
          }
      }

      cp_async_wait_all();
      __syncthreads();  // V[n] visible; every warp is done with K[n]
      if (n_block > n_block_min) {
        const int n = n_block - 1;
        load_tile<Tr, BN>(sK, k_base + int64_t(n) * BN * p.k_row_stride, p.k_row_stride,
                          si.len_k - n * BN, tid);
        cp_async_commit();
      }

      // Online softmax: new running max, rescale O and the running sum, P = exp(S - max).
      const float sl2 = p.scale_softmax_log2;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = row_max[mf][r];
#pragma unroll
          for (int nf = 0; nf < NF_S; ++nf)
            mx = fmaxf(mx, fmaxf(acc_s[mf][nf][2 * r], acc_s[mf][nf][2 * r + 1]));
          mx = quad_max(mx);
          // A row with no key so far keeps max -inf: use 0 so that exp gives 0, not NaN.
          const float mx_scaled = mx == -INFINITY ? 0.f : mx * sl2;
          const float corr = exp2f(row_max[mf][r] * sl2 - mx_scaled);
          row_max[mf][r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int nf = 0; nf < NF_S; ++nf)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pe = exp2f(fmaf(acc_s[mf][nf][2 * r + e], sl2, -mx_scaled));
              acc_s[mf][nf][2 * r + e] = pe;
              sum += pe;
            }
          row_sum[mf][r] = row_sum[mf][r] * corr + sum;
#pragma unroll
          for (int nf = 0; nf < NF_O; ++nf) {
            acc_o[mf][nf][2 * r] *= corr;
            acc_o[mf][nf][2 * r + 1] *= corr;
          }
        }

      // O += P V (P from registers: the S accumulator layout is the A-operand layout).
#pragma unroll
      for (int kk = 0; kk < KF_PV; ++kk) {
        uint32_t a[MF][4];
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          a[mf][0] = pack2<T>(acc_s[mf][2 * kk][0], acc_s[mf][2 * kk][1]);
          a[mf][1] = pack2<T>(acc_s[mf][2 * kk][2], acc_s[mf][2 * kk][3]);
          a[mf][2] = pack2<T>(acc_s[mf][2 * kk + 1][0], acc_s[mf][2 * kk + 1][1]);
          a[mf][3] = pack2<T>(acc_s[mf][2 * kk + 1][2], acc_s[mf][2 * kk + 1][3]);
        }
#pragma unroll
        for (int nn = 0; nn < NF_O / 2; ++nn) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, sV_u32 + ((v_off0 ^ (nn * 32)) + kk * 16 * D * int(sizeof(T))));
#pragma unroll
          for (int mf = 0; mf < MF; ++mf) {
            mma_16816<T>(acc_o[mf][2 * nn], a[mf], b[0], b[1]);
            mma_16816<T>(acc_o[mf][2 * nn + 1], a[mf], b[2], b[3]);
          }
        }
      }
    }
  }

  // Epilogue: O / sum (rows past len_q or with no key: 0), LSE (+inf for those rows).
  const int warp_row0 = warp * 16 * MF;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(row_sum[mf][r]);
      const int row = warp_row0 + mf * 16 + g + 8 * r;  // within the tile
      const bool alive = row < valid_q && sum > 0.f;
      const float inv = alive ? 1.f / sum : 0.f;
#pragma unroll
      for (int nf = 0; nf < NF_O; ++nf) {
        acc_o[mf][nf][2 * r] *= inv;
        acc_o[mf][nf][2 * r + 1] *= inv;
      }
      if (lse_base != nullptr && t == 0 && m0 + row < si.rows_q) {
        lse_base[int64_t(m0 + row) * p.lse_row_stride] =
            alive ? row_max[mf][r] * p.scale_softmax + __logf(sum) : INFINITY;
      }
    }

  __syncthreads();  // every warp is done reading sQ / sK / sV: sQ becomes the O staging tile
  T* sO = sQ;
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int nf = 0; nf < NF_O; ++nf)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp_row0 + mf * 16 + g + 8 * r;
        const int col = nf * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(sO + swz<D>(row, col)) =
            pack2<T>(acc_o[mf][nf][2 * r], acc_o[mf][nf][2 * r + 1]);
      }
  __syncthreads();  // the shared -> global copy reads rows other threads wrote

  const int rows_out = min(BM, si.rows_q - m0);
  constexpr int kTotal = BM * Tr::kChunks;
#pragma unroll
  for (int i = 0; i < kTotal / Tr::kNThreads; ++i) {
    const int idx = tid + i * Tr::kNThreads;
    const int row = idx / Tr::kChunks;
    const int col = (idx % Tr::kChunks) * 8;
    if (row < rows_out) {
      const uint4 val = *reinterpret_cast<const uint4*>(sO + swz<D>(row, col));
      *reinterpret_cast<uint4*>(o_base + int64_t(m0 + row) * p.o_row_stride + col) = val;
    }
  }
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
