// FlashAttention-2-style backward for sm80+ (Ampere and Hopper alike).
//
// Three kernels:
//   1. dot_do_o: dsum[i] = rowsum(dO[i] * O[i]) (float32, laid out as the LSE); zeroes
//      dq_accum's rows.
//   2. bwd_kernel: one CTA per (key block, kv head, batch). K and V of the block stay in
//      shared memory; the CTA walks every query head of its GQA group and every query block
//      that sees the key block, recomputes P = exp(S - LSE), and accumulates dK and dV in
//      registers (so the GQA sum over the group needs no atomics and no expanded buffer).
//      dQ of each (query block, key block) pair is added into a float32 accumulator.
//   3. convert_dq: dq = dq_accum (summed over splits, in order) * softmax_scale, as T.
//
// Per query block of the main loop (S = Q K^T, rows = queries, columns = keys):
//   S, dP = dO V^T   warps tile [BM x BN] (kWarpsMS x rest)
//   P  = exp(S - LSE) (dropped: P * Z), dS = P * (dP * Z - dsum)   -> shared memory
//   dV += P^T dO, dK += dS^T Q   warps tile [BN x D] (kWarpsNdKV x rest)
//   dQ  = dS K                   warps tile [BM x D] (kWarpsMdQ x rest) -> dq_accum
// Q and dO are double-buffered: block i+1 loads while block i computes.
// dQ goes into dq_accum with float reductions: per element from registers (sm80, and d64),
// or on sm90 (kBulkDq) as a tile in shared memory that one thread hands to the bulk-copy
// engine (one reduction instruction per tile instead of one per two elements per thread, and
// no registers held by reductions in flight). Where the tile does not fit beside the rest
// (d256), it takes the step's own Q / dO buffers once the dV and dK GEMMs are done with them
// (kDqInStage), and the next step's loads wait for the middle barrier.
#pragma once

#include "flash/sm80/common.cuh"
#include "flash/sm90/bulk_copy.cuh"

namespace transformer_fa {
namespace flash {
namespace sm80 {

// A backward tile config: a struct that derives from BwdTile, sets kHeadDim, kBlockM (query
// rows), kBlockN (key rows), kNWarps and the warp tilings kWarpsMS (warps along M of S / dP),
// kWarpsNdKV (along N of dK / dV), kWarpsMdQ (along M of dQ), and overrides the defaults it
// changes (sm80/bwd_launch.cuh names one per head dim, with the measurements behind them).
struct BwdTile {
  static constexpr int kSSlices = 1;             // S / dP column slices
  static constexpr int kQSlices = 1;             // dQ column slices
  static constexpr bool kBulkDq = false;         // dQ through sm90's bulk-copy reduction
  static constexpr bool kDqInStage = false;      // the bulk dQ tile in the step's Q / dO buffers
  static constexpr bool kZfillFromBase = true;   // zero-filled loads from the tile base
  static constexpr bool kGridOrder = false;      // CTAs in grid_tile's order
  static constexpr bool kExtras = true;          // dropout and ALiBi compiled in
};
// Tile with dropout and ALiBi compiled in or not.
template <typename Tile, bool kWith>
struct WithExtras : Tile {
  static constexpr bool kExtras = kWith;
};

template <typename T, typename Tile>
struct BwdTraits {
  using Element = T;
  // Dropout and ALiBi compiled in (as FwdTraits::kExtras).
  static constexpr bool kExtras = Tile::kExtras;
  static constexpr int kWarpsMS = Tile::kWarpsMS, kWarpsNdKV = Tile::kWarpsNdKV,
                       kWarpsMdQ = Tile::kWarpsMdQ;
  static constexpr int D = Tile::kHeadDim;
  static constexpr int BM = Tile::kBlockM;
  static constexpr int BN = Tile::kBlockN;
  static constexpr int kNWarps = Tile::kNWarps;
  static constexpr int kNThreads = kNWarps * 32;
  // S / dP warp tile
  static constexpr int S_M = BM / kWarpsMS, S_N = BN / (kNWarps / kWarpsMS);
  static constexpr int S_MF = S_M / 16, S_NF = S_N / 8;
  // S / dP are computed in this many column slices of the warp tile (register pressure)
  static constexpr int kSSlices = Tile::kSSlices;
  static_assert(S_NF % (2 * kSSlices) == 0, "slices of whole n16 fragment pairs");
  // dK / dV warp tile
  static constexpr int KV_M = BN / kWarpsNdKV, KV_N = D / (kNWarps / kWarpsNdKV);
  static constexpr int KV_MF = KV_M / 16, KV_NF = KV_N / 8;
  // dQ warp tile
  static constexpr int Q_M = BM / kWarpsMdQ, Q_N = D / (kNWarps / kWarpsMdQ);
  static constexpr int Q_MF = Q_M / 16, Q_NF = Q_N / 8;
  static constexpr int kQSlices = Tile::kQSlices;  // dQ column slices, as kSSlices
  static_assert(Q_NF % (2 * kQSlices) == 0, "slices of whole n16 fragment pairs");
  static_assert(S_M % 16 == 0 && S_N % 16 == 0 && KV_M % 16 == 0 && KV_N % 16 == 0 &&
                    Q_M % 16 == 0 && Q_N % 16 == 0,
                "warp tiles are whole 16 x 16 MMA tiles");
  static_assert(D % 64 == 0 && BN % 64 == 0, "tile rows are multiples of 64 (swizzle)");
  static constexpr bool kBulkDq = Tile::kBulkDq;
  // The bulk dQ tile takes the Q / dO buffers of the step that computed it (free once its
  // dK GEMM is done) instead of its own shared memory: for head dims where (BM + 8) x D
  // floats do not fit beside the rest. Costs a barrier per step, the next step's Q / dO load
  // issued at the middle barrier instead of the top, and tiles of rows that start inside an
  // 8-row group of dq_accum (packed sequences) go out from registers.
  static constexpr bool kDqInStage = Tile::kDqInStage;
  static_assert(!kDqInStage || (kBulkDq && kQSlices == 1), "an alias of the whole bulk dQ tile");
  static constexpr bool kZfillFromBase = Tile::kZfillFromBase;  // load_tile's choice
  // The CTAs take their (key block, kv head, batch) in grid_tile's order (so that the launch
  // can run causal key blocks heavy first across head groups), or straight from blockIdx.
  static constexpr bool kGridOrder = Tile::kGridOrder;
  // Shared memory (elements): Q and dO double-buffered, K, V, P and dS; then the LSE and dsum
  // of the query block, double-buffered with Q (float).
  static constexpr int kSmemQ = BM * D, kSmemKV = BN * D, kSmemP = BM * BN;
  static constexpr int kSmemBase =
      (4 * kSmemQ + 2 * kSmemKV + 2 * kSmemP) * int(sizeof(T)) + 4 * BM * int(sizeof(float));
  // Plus the float32 dQ tile on sm90 with kBulkDq: BM rows and up to 8 more, as the whole
  // 8-row groups of dq_accum's layout that it covers.
  static constexpr int smem_bytes(bool sm90) {
    return kSmemBase + (kBulkDq && !kDqInStage && sm90 ? (BM + 8) * D * int(sizeof(float)) : 0);
  }
  static_assert(2 * BM <= kNThreads, "one thread per LSE / dsum row");
};

// Offset of (row, col) in one (split, sequence, head) block of dq_accum (flash.h): groups of
// 8 rows, each in mma accumulator order ([col / 8][row % 8][col % 8]), so that a warp's
// accumulator tile is 256 contiguous bytes (coalesced reductions, conflict-free shared
// stores) and a tile of rows is one block of memory. ld: the row length (kernel head dim).
__device__ __forceinline__ int64_t dqa_offset(int row, int col, int ld) {
  return int64_t(row & ~7) * ld + ((col >> 3) << 6) + ((row & 7) << 3) + (col & 7);
}

// dq_accum of (split, sequence, head), and its row of the sequence's query row `row`.
__device__ __forceinline__ float* dqa_block(const BwdParams& p, const SeqInfo& si, int split,
                                            int bidh) {
  return p.dq_accum + int64_t(split) * p.dqa_split_stride +
         (si.q_packed ? 0 : int64_t(si.bidb) * p.dqa_batch_stride) +
         int64_t(bidh) * p.dqa_head_stride;
}
__device__ __forceinline__ int dqa_row(const SeqInfo& si, int row) {
  return (si.q_packed ? si.start_q : 0) + row;
}

// ---------------------------------------------------------------------------------------
// 1. dsum = rowsum(dO * O): kLanes lanes per (query row, head), over 8-element chunks (32 / kLanes
//    rows per warp: every lane loads at d64 and d128). Unless the caller did (dqa_zeroed), it
//    also zeroes its rows of dq_accum in every split, so that no separate pass writes it.
// ---------------------------------------------------------------------------------------
template <typename T, int kLanes>
__global__ void __launch_bounds__(256) dot_do_o_kernel(const BwdParams p) {
  static_assert(kLanes == 8 || kLanes == 16 || kLanes == 32, "lanes per row");
  constexpr int kRowsPerCta = 8 * 32 / kLanes;
  const int lane = threadIdx.x % 32, sub = lane % kLanes;
  const int bidh = blockIdx.y, bidb = blockIdx.z;
  const SeqInfo si = seq_info(p, bidb);
  const int row = blockIdx.x * kRowsPerCta + threadIdx.x / kLanes;
  float acc = 0.f;
  if (row < si.len_q) {
    const T* o = reinterpret_cast<const T*>(p.o) + si.q_off(p.o_batch_stride, p.o_row_stride) +
                 int64_t(row) * p.o_row_stride + int64_t(bidh) * p.o_head_stride;
    const T* dout = reinterpret_cast<const T*>(p.dout) +
                    si.q_off(p.do_batch_stride, p.do_row_stride) +
                    int64_t(row) * p.do_row_stride + int64_t(bidh) * p.do_head_stride;
    for (int c = sub * 8; c < p.d; c += kLanes * 8) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + c);
      const uint4 dv = *reinterpret_cast<const uint4*>(dout + c);
      const T* oe = reinterpret_cast<const T*>(&ov);
      const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc = fmaf(to_float(oe[e]), to_float(de[e]), acc);
    }
  }
#pragma unroll
  for (int s = kLanes / 2; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
  if (!p.dqa_zeroed) {
    // bshd / sbhd: dq_accum row = query row, so the CTA's rows are whole 8-row groups of its
    // block, one contiguous range (up to the rows rounded up to 8: the allocation).
    const int row0 = blockIdx.x * kRowsPerCta;
    const int rows = min(kRowsPerCta, ((si.rows_q + 7) & ~7) - row0);
    const int n4 = rows * int(p.dqa_row_stride) / 4;
    for (int split = 0; split < p.num_splits; ++split) {
      float4* dst = reinterpret_cast<float4*>(dqa_block(p, si, split, bidh) +
                                              int64_t(row0) * p.dqa_row_stride);
      for (int i = threadIdx.x; i < n4; i += blockDim.x) dst[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  if (row < si.rows_q && sub == 0) {
    p.dsum[si.q_off(p.lse_batch_stride, p.lse_row_stride) + int64_t(row) * p.lse_row_stride +
           int64_t(bidh) * p.lse_head_stride] = acc;
  }
}

// ---------------------------------------------------------------------------------------
// 3. dq = sum over splits of dq_accum, times softmax_scale. One thread per 8 elements, in
//    dq_accum's order ([batch][head][row]; thd: [head][token]).
// ---------------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(256) convert_dq_kernel(const BwdParams p) {
  const int chunks = p.d / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= p.dq_rows * chunks) return;
  const int64_t acc_row = idx / chunks;
  const int col = int(idx % chunks) * 8;
  const int row = int(acc_row % p.dqa_rows);
  const int64_t bh = acc_row / p.dqa_rows;
  const int head = int(bh % p.h);
  const int64_t batch = bh / p.h;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const float* src = p.dq_accum + batch * p.dqa_batch_stride + head * p.dqa_head_stride +
                     dqa_offset(row, col, int(p.dqa_row_stride));
  for (int s = 0; s < p.num_splits; ++s) {
    const float4 a = *reinterpret_cast<const float4*>(src);
    const float4 b = *reinterpret_cast<const float4*>(src + 4);
    acc[0] += a.x; acc[1] += a.y; acc[2] += a.z; acc[3] += a.w;
    acc[4] += b.x; acc[5] += b.y; acc[6] += b.z; acc[7] += b.w;
    src += p.dqa_split_stride;
  }
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int e = 0; e < 4; ++e)
    o[e] = pack2<T>(acc[2 * e] * p.scale_softmax, acc[2 * e + 1] * p.scale_softmax);
  *reinterpret_cast<uint4*>(reinterpret_cast<T*>(p.dq) + batch * p.dq_batch_stride +
                            int64_t(row) * p.dq_row_stride + int64_t(head) * p.dq_head_stride +
                            col) = out;
}

// ---------------------------------------------------------------------------------------
// 2. The main kernel
// ---------------------------------------------------------------------------------------
template <typename Tr>
__device__ __forceinline__ void bwd_key_block(const BwdParams& p, const SeqInfo& si,
                                              int n_block, int bidh_k, int split,
                                              unsigned char* smem_raw) {
  using T = typename Tr::Element;
  constexpr int D = Tr::D, BM = Tr::BM, BN = Tr::BN, NT = Tr::kNThreads;
  // Q and dO, double-buffered: [Q 0][Q 1][dO 0][dO 1], or with kDqInStage [dO 0][Q 0][Q 1]
  // [dO 1], so that a stage's pair is one block (the dQ tile).
  T* sQdO = reinterpret_cast<T*>(smem_raw);  // 4 x [BM][D]
  auto sQ_of = [&](int stage) {
    return sQdO + (Tr::kDqInStage ? 1 + stage : stage) * Tr::kSmemQ;
  };
  auto sdO_of = [&](int stage) {
    return sQdO + (Tr::kDqInStage ? 3 * stage : 2 + stage) * Tr::kSmemQ;
  };
  T* sK = sQdO + 4 * Tr::kSmemQ;             // [BN][D]
  T* sV = sK + Tr::kSmemKV;                // [BN][D]
  T* sP = sV + Tr::kSmemKV;                // [BM][BN]
  T* sdS = sP + Tr::kSmemP;                // [BM][BN]
  float* sLse = reinterpret_cast<float*>(sdS + Tr::kSmemP);  // [2][BM]
  float* sDsum = sLse + 2 * BM;                              // [2][BM]
  // The bulk dQ tile of a step: its own [BM + 8][D] floats, or the step's Q / dO pair.
  float* sdQ_own = sDsum + 2 * BM;
  auto sdQ_of = [&](int stage) {
    return Tr::kDqInStage ? reinterpret_cast<float*>(sQdO + 2 * stage * Tr::kSmemQ) : sdQ_own;
  };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr bool kBulk = Tr::kBulkDq;
#else
  constexpr bool kBulk = false;
#endif
  constexpr bool kInStage = kBulk && Tr::kDqInStage;  // the dQ tile in the Q / dO buffers

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  // Warp positions in the three warp tilings.
  const int s_m = (warp % (BM / Tr::S_M)) * Tr::S_M, s_n = (warp / (BM / Tr::S_M)) * Tr::S_N;
  const int kv_m = (warp % (BN / Tr::KV_M)) * Tr::KV_M,
            kv_n = (warp / (BN / Tr::KV_M)) * Tr::KV_N;
  const int q_m = (warp % (BM / Tr::Q_M)) * Tr::Q_M, q_n = (warp / (BM / Tr::Q_M)) * Tr::Q_N;

  const int n0 = n_block * BN;
  const int valid_k = min(BN, si.len_k - n0);
  const Band band = band_of(p, si);
  // Query rows that see a key of this block.
  const RowRange seen = band_queries(band, si.len_q, n0, n0 + BN - 1);
  const int m_block_min = seen.lo / BM;
  const int num_m = valid_k > 0 && seen.hi > seen.lo ? (seen.hi + BM - 1) / BM - m_block_min : 0;
  const int group = p.h / p.h_k;
  const int total = num_m * group;  // (query head, query block) steps

  float acc_dk[Tr::KV_MF][Tr::KV_NF][4], acc_dv[Tr::KV_MF][Tr::KV_NF][4];
  zero(acc_dk);
  zero(acc_dv);

  __syncthreads();  // a previous key block of this CTA (deterministic mode) is done with smem
  if (total > 0) {
    const T* k_base = reinterpret_cast<const T*>(p.k) +
                      si.k_off(p.k_batch_stride, p.k_row_stride) +
                      int64_t(bidh_k) * p.k_head_stride + int64_t(n0) * p.k_row_stride;
    const T* v_base = reinterpret_cast<const T*>(p.v) +
                      si.k_off(p.v_batch_stride, p.v_row_stride) +
                      int64_t(bidh_k) * p.v_head_stride + int64_t(n0) * p.v_row_stride;
    load_tile<T, D, BN, NT, Tr::kZfillFromBase>(sK, k_base, p.k_row_stride, valid_k, p.d, tid);
    load_tile<T, D, BN, NT, Tr::kZfillFromBase>(sV, v_base, p.v_row_stride, valid_k, p.d, tid);
    if constexpr (kBulk && !kInStage) {
      // The dQ tiles write rows [(start_q & 7), + BM) of sdQ; the rows around them are
      // copied too (whole 8-row groups) and must add zeros.
      for (int i = tid * 4; i < (BM + 8) * D; i += NT * 4) {
        *reinterpret_cast<float4*>(sdQ_own + i) = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }

    // Issues the loads of the step (query head head_i of the group, query block m_i) into
    // buffer `stage`.
    auto load_q_do = [&](int head_i, int m_i, int stage) {
      const int bidh = bidh_k * group + head_i;
      const int m0 = (m_block_min + m_i) * BM;
      const int valid_q = min(BM, si.len_q - m0);
      const SeqInfo at = si.in_loop_q();
      load_tile<T, D, BM, NT, Tr::kZfillFromBase>(
          sQ_of(stage),
          reinterpret_cast<const T*>(p.q) + at.q_off(p.q_batch_stride, p.q_row_stride) +
              int64_t(bidh) * p.q_head_stride + int64_t(m0) * p.q_row_stride,
          p.q_row_stride, valid_q, p.d, tid);
      load_tile<T, D, BM, NT, Tr::kZfillFromBase>(
          sdO_of(stage),
          reinterpret_cast<const T*>(p.dout) + at.q_off(p.do_batch_stride, p.do_row_stride) +
              int64_t(bidh) * p.do_head_stride + int64_t(m0) * p.do_row_stride,
          p.do_row_stride, valid_q, p.d, tid);
      // LSE and dsum rows (threads [0, BM) and [BM, 2 BM)); rows past len_q are zero here
      // and masked where they are read.
      if (tid < 2 * BM) {
        const int r = tid % BM;
        const float* src = (tid < BM ? p.lse : p.dsum) +
                           at.q_off(p.lse_batch_stride, p.lse_row_stride) +
                           int64_t(bidh) * p.lse_head_stride + int64_t(m0 + r) * p.lse_row_stride;
        float* dst = (tid < BM ? sLse : sDsum) + stage * BM + r;
        cp_async_4(smem_u32(dst), r < valid_q ? src : p.lse, r < valid_q);
      }
    };
    load_q_do(0, 0, 0);
    cp_async_commit();
    // kBulk: the dQ tile of a step waits in shared memory for the next barrier (the top of
    // the next step, or after the loop); then thread 0 hands it to the bulk-copy engine. Its
    // source and destination wait in shared memory (thread 0's own), not in registers across
    // the loop. With kDqInStage, a tile that starts inside an 8-row group of dq_accum (a
    // packed sequence's start) does not fit the Q / dO pair: that CTA reduces from registers.
    const bool bulk = kBulk && (!kInStage || (dqa_row(si, 0) & 7) == 0);
    __shared__ float* dq_pending;
    __shared__ uint32_t dq_pending_src, dq_pending_bytes;
    if (kBulk && tid == 0) dq_pending = nullptr;
    auto issue_dq = [&]() {
      if (bulk && tid == 0 && dq_pending != nullptr) {
        sm90::bulk_reduce_add_f32(dq_pending, dq_pending_src, dq_pending_bytes);
      }
    };

    const float sl2 = p.scale_softmax_log2;
    // Step it = head_i * num_m + m_i, counted along (no divisions in the loop).
    int head_i = 0, m_i = 0;
    for (int it = 0; it < total; ++it) {
      const int stage = it & 1;
      const int bidh = bidh_k * group + head_i;
      const int m0 = (m_block_min + m_i) * BM;
      const bool last_m = m_i + 1 == num_m;
      const int next_head = last_m ? head_i + 1 : head_i, next_m = last_m ? 0 : m_i + 1;
      const T* sQs = sQ_of(stage);
      const T* sdOs = sdO_of(stage);

      cp_async_wait_all();
      __syncthreads();  // Q/dO[it] (and K, V) visible; every warp is done with step it - 1
      // The next step's loads: now, or (kDqInStage) once its buffers' previous dQ tile has
      // been read, after the middle barrier.
      if (!kInStage && it + 1 < total) {
        load_q_do(next_head, next_m, stage ^ 1);
        cp_async_commit();
      }
      issue_dq();

      // S and dP in column slices of the warp tile: fewer live accumulators (no spills) for
      // a second load of the Q / dO fragments.
      constexpr int NFS = Tr::S_NF / Tr::kSSlices, kSliceCols = Tr::S_N / Tr::kSSlices;
#pragma unroll
      for (int slice = 0; slice < Tr::kSSlices; ++slice) {
        const int col0 = s_n + slice * kSliceCols;
        float acc_s[Tr::S_MF][NFS][4], acc_dp[Tr::S_MF][NFS][4];
        zero(acc_s);
        zero(acc_dp);
        warp_gemm<T, Tr::S_MF, NFS, D / 16, false, false, D, D>(acc_s, sQs, s_m, sK, col0, lane);
        warp_gemm<T, Tr::S_MF, NFS, D / 16, false, false, D, D>(acc_dp, sdOs, s_m, sV, col0,
                                                               lane);
        // LSE (log2 units) and dsum of this thread's S rows (rows past len_q get P = 0), read
        // after the GEMMs so that they take no registers during them.
        float lse2[Tr::S_MF][2], dsum[Tr::S_MF][2];
#pragma unroll
        for (int mf = 0; mf < Tr::S_MF; ++mf)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = s_m + mf * 16 + g + 8 * r;
            lse2[mf][r] = m0 + row < si.len_q ? sLse[stage * BM + row] * float(M_LOG2E) : INFINITY;
            dsum[mf][r] = sDsum[stage * BM + row];
          }

        const float alibi_coef =
            !Tr::kExtras || p.alibi_slopes == nullptr
                ? 0.f
                : -p.alibi_slopes[si.bidb * p.alibi_batch_stride + bidh] / p.scale_softmax;
        const bool need_mask = band_cuts(band, m0 + s_m, m0 + s_m + Tr::S_M - 1, n0 + col0,
                                         n0 + col0 + kSliceCols - 1);
        if (need_mask || alibi_coef != 0.f) {
          bias_and_mask(acc_s, m0 + s_m, n0 + col0, lane, band, need_mask, alibi_coef);
        }
        // P (dropped, for dV) and dS = P * (dP * Z - dsum), as T in shared memory. keep_of(mf,
        // nf) gives the dropout bits of one 16 x 8 tile; without dropout the constant mask and
        // scale 1 fold away (a uniform branch, so no selects and no mask registers then).
        auto p_and_ds = [&](auto keep_of, float keep_scale) {
#pragma unroll
          for (int mf = 0; mf < Tr::S_MF; ++mf)
#pragma unroll
            for (int nf = 0; nf < NFS; ++nf) {
              const uint32_t keep = keep_of(mf, nf);
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int r = e / 2;
                const float pe = exp2f(fmaf(acc_s[mf][nf][e], sl2, -lse2[mf][r]));
                const float z = (keep >> e) & 1 ? keep_scale : 0.f;
                acc_s[mf][nf][e] = pe * z;
                acc_dp[mf][nf][e] = pe * fmaf(acc_dp[mf][nf][e], z, -dsum[mf][r]);
              }
            }
        };
        if (Tr::kExtras && p.rng_state != nullptr) {
          const Dropout drop = dropout_of(p, si.bidb, bidh);
          p_and_ds(
              [&](int mf, int nf) {
                return dropout_bits(drop, m0 + s_m + mf * 16, n0 + col0 + nf * 8, lane);
              },
              drop.scale);
        } else {
          p_and_ds([](int, int) { return 0xfu; }, 1.f);
        }
        store_acc<T, BN>(sP, acc_s, s_m, col0, lane);
        store_acc<T, BN>(sdS, acc_dp, s_m, col0, lane);
      }
      // the dQ tile's buffer is free after the barrier
      if (bulk && tid == 0) sm90::bulk_wait_read();
      __syncthreads();  // P and dS visible
      if (kInStage && it + 1 < total) {
        load_q_do(next_head, next_m, stage ^ 1);
        cp_async_commit();
      }

      // dV += P^T dO, dK += dS^T Q (A = P^T / dS^T: k-major in shared memory).
      warp_gemm<T, Tr::KV_MF, Tr::KV_NF, BM / 16, true, true, BN, D>(acc_dv, sP, kv_m, sdOs,
                                                                    kv_n, lane);
      warp_gemm<T, Tr::KV_MF, Tr::KV_NF, BM / 16, true, true, BN, D>(acc_dk, sdS, kv_m, sQs,
                                                                    kv_n, lane);
      // dQ (this key block's part) = dS K, added into dq_accum; in column slices of the warp
      // tile where the accumulator would not fit beside dK / dV.
      constexpr int NFQ = Tr::Q_NF / Tr::kQSlices, kQSliceCols = Tr::Q_N / Tr::kQSlices;
      const SeqInfo at = si.in_loop_q();
      const int acc_row0 = dqa_row(at, m0);  // dq_accum row of query m0
      float* dqa = dqa_block(p, at, split, bidh);
#pragma unroll
      for (int slice = 0; slice < Tr::kQSlices; ++slice) {
        const int col0 = q_n + slice * kQSliceCols;
        float acc_dq[Tr::Q_MF][NFQ][4];
        zero(acc_dq);
        warp_gemm<T, Tr::Q_MF, NFQ, BN / 16, false, true, BN, D>(acc_dq, sdS, q_m, sK, col0,
                                                                 lane);
        // Rows 16 mf + 8 r and columns 8 nf further are constant offsets in dq_accum's layout.
        if (bulk) {
          // kDqInStage: every warp is done with this step's Q / dO (dV and dK GEMMs).
          if (kInStage) __syncthreads();
          // The tile holds dq_accum's rows from (acc_row0 & ~7) on, in its layout.
          float* dst = sdQ_of(stage) + dqa_offset((acc_row0 & 7) + q_m + g, col0 + 2 * t, D);
#pragma unroll
          for (int mf = 0; mf < Tr::Q_MF; ++mf)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
              for (int nf = 0; nf < NFQ; ++nf) {
                *reinterpret_cast<float2*>(dst + (16 * mf + 8 * r) * D + 64 * nf) =
                    make_float2(acc_dq[mf][nf][2 * r], acc_dq[mf][nf][2 * r + 1]);
              }
        } else {
          float* dst = dqa + dqa_offset(acc_row0 + q_m + g, col0 + 2 * t, D);
#pragma unroll
          for (int mf = 0; mf < Tr::Q_MF; ++mf)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              if (m0 + q_m + mf * 16 + g + 8 * r >= si.len_q) continue;
#pragma unroll
              for (int nf = 0; nf < NFQ; ++nf) {
                atomic_add2(dst + (16 * mf + 8 * r) * D + 64 * nf, acc_dq[mf][nf][2 * r],
                            acc_dq[mf][nf][2 * r + 1]);
              }
            }
        }
      }
      if (bulk) {
        sm90::fence_proxy_async_smem();  // the bulk copy (async proxy) reads what it wrote
        // Whole 8-row groups: the rows around this tile's (past len_q, or another sequence's
        // in a packed batch) get exact zeros added.
        if (tid == 0) {
          dq_pending = dqa + int64_t(acc_row0 & ~7) * D;
          dq_pending_src = smem_u32(sdQ_of(stage));
          dq_pending_bytes =
              uint32_t((((acc_row0 & 7) + min(BM, si.len_q - m0) + 7) & ~7) * D * 4);
        }
      }
      head_i = next_head;
      m_i = next_m;
    }
    if constexpr (kBulk) {
      __syncthreads();  // the last step's dQ tile is visible
      issue_dq();
      if (tid == 0) sm90::bulk_wait_all();  // complete before sdQ is reused or the CTA exits
    }
  }

  // Epilogue: dK * softmax_scale and dV through shared memory (sK / sV) to global.
  const int rows_out = min(BN, si.rows_k - n0);
  if (rows_out <= 0) return;
  __syncthreads();  // every warp is done reading sK / sV
  store_acc<T, D>(sK, acc_dk, kv_m, kv_n, lane, p.scale_softmax);
  store_acc<T, D>(sV, acc_dv, kv_m, kv_n, lane);
  __syncthreads();  // the shared -> global copy reads rows other threads wrote
  T* dk = reinterpret_cast<T*>(p.dk) + si.k_off(p.dk_batch_stride, p.dk_row_stride) +
          int64_t(bidh_k) * p.dk_head_stride + int64_t(n0) * p.dk_row_stride;
  T* dv = reinterpret_cast<T*>(p.dv) + si.k_off(p.dv_batch_stride, p.dv_row_stride) +
          int64_t(bidh_k) * p.dv_head_stride + int64_t(n0) * p.dv_row_stride;
  store_tile<T, D, BN, NT>(dk, p.dk_row_stride, sK, rows_out, p.d, tid);
  store_tile<T, D, BN, NT>(dv, p.dv_row_stride, sV, rows_out, p.d, tid);
}

// Grid (key blocks, or num_splits in deterministic mode; kv heads; batch), its blocks taken in
// grid_tile's order with kGridOrder. Under a causal mask the first key blocks see the most
// queries. Each CTA walks key blocks tile, tile + gridDim.x, ... (one unless deterministic).
// group_heads: grid_tile's group size, planned by the launch.
template <typename Tr>
__global__ void __launch_bounds__(Tr::kNThreads, 1)
    bwd_kernel(const BwdParams p, const int group_heads) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  GridTile gt{int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  if constexpr (Tr::kGridOrder) {
    gt = grid_tile(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), gridDim.x,
                   p.h_k, p.b, group_heads);
  }
  const SeqInfo si = seq_info(p, gt.batch);
  const int num_n = (p.seqlen_k + Tr::BN - 1) / Tr::BN;
  const int split = p.deterministic ? gt.tile : 0;
  for (int n_block = gt.tile; n_block < num_n; n_block += gridDim.x) {
    if (n_block * Tr::BN >= si.rows_k) break;  // past this (packed) sequence
    bwd_key_block<Tr>(p, si, n_block, gt.head, split, smem_raw);
  }
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
