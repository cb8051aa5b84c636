// Split-KV decode forward (Flash-Decoding) for sm80+: a few query tokens against a long K/V
// (a KV cache, contiguous or paged). mma.sync m16n8k16, ldmatrix, cp.async, online softmax.
//
// Work partition. A CTA serves one (sequence, KV head, 16-row tile, split): its rows are the
// (token, query head) pairs of the KV head's GQA group, row = token * group + head in group, so
// one read of a K/V row serves every query head of the group. Its split is a contiguous run of
// 16-key chunks of the sequence's key range; inside it, warp w takes chunks w, w + 4, ...
// through its own cp.async pipeline of kStages chunks in its own shared memory (no CTA barrier
// in the main loop), with its own running max, sum and O accumulator. At the end, with one
// split, the warps' partials are merged in shared memory and the CTA writes O; with more,
// each warp writes its normalized partial and LSE to a float32 workspace (num_partials per
// row) and decode_combine_kernel merges them. (The warps' merge in the CTA, three barriers
// and 32 KB of float32 through shared memory, cost 1-2% of the split rows: H200, 2026-12-01,
// b = 8 4k 0.98x of cuDNN with it, 1.00x without; b = 1 4k 1.04x -> 1.07-1.09x. Without a
// split, the combine kernel it would need costs more than the merge: b = 16 4k 0.96x
// against 0.99x. Past kMaxDecodeSplits / 4 splits, the CTAs merge their warps too.)
#pragma once

#include "flash/sm80/common.cuh"

namespace transformer_fa {
namespace flash {
namespace sm80 {

constexpr int kMaxDecodeSplits = 128;  // the combine kernel holds one partial per thread

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

template <typename T, int kHeadDim_, int kStages_>
struct DecodeTraits {
  using Element = T;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kStages = kStages_;  // chunks in flight per warp (cp.async groups)
  static constexpr int kNWarps = 4;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kRows = 16;   // (token, head) rows per CTA: one MMA row tile
  static constexpr int kChunk = 16;  // keys per warp step (a page holds whole chunks)
  static constexpr int kChunkElems = kChunk * kHeadDim;
  static constexpr int kWarpElems = kStages * 2 * kChunkElems;  // K and V of every stage
  static constexpr int kSmemQBytes = kRows * kHeadDim * int(sizeof(T));
  static constexpr int kSmemStageBytes = kNWarps * kWarpElems * int(sizeof(T));
  static constexpr int kSmemStatBytes = 2 * kNWarps * kRows * int(sizeof(float));
  static constexpr int kSmemBytes = kSmemQBytes + kSmemStageBytes + kSmemStatBytes;
  static_assert(kStages >= 2, "the pipeline loads one chunk while it computes another");
  static_assert(kHeadDim % 64 == 0, "rows of whole 8-chunk swizzle groups");
  static_assert(kNWarps * kRows * kHeadDim * 4 <= kSmemStageBytes,
                "the warps' float32 O partials fit where their stages were");
};

// The 16-key chunks of rows [t_lo, t_hi] of a sequence: chunk c holds keys
// [first + 16 c, first + 16 c + 16); first is a multiple of 16 (pages hold whole chunks).
struct ChunkRange {
  int first, count;
};

__device__ __forceinline__ ChunkRange chunk_range(const FwdParams& p, const Band& band, int t_lo,
                                                  int t_hi) {
  int n_hi = band.len_k;
  if (p.window_right >= 0) n_hi = min(n_hi, t_hi + band.off + p.window_right + 1);
  int n_lo = 0;
  if (p.window_left >= 0) n_lo = max(0, t_lo + band.off - p.window_left);
  n_lo = n_lo / 16 * 16;
  return {n_lo, n_hi > n_lo ? (n_hi - n_lo + 15) / 16 : 0};
}

template <typename Tr>
__global__ void __launch_bounds__(Tr::kNThreads) decode_kernel(const DecodeParams p) {
  using T = typename Tr::Element;
  constexpr int D = Tr::kHeadDim;
  constexpr int NW = Tr::kNWarps;
  constexpr int ROWS = Tr::kRows;
  constexpr int CH = Tr::kChunk;
  constexpr int S = Tr::kStages;
  constexpr int NF_O = D / 8;  // O n-tiles
  constexpr int KF = D / 16;   // k-steps of Q K^T

  // (the merge kernel, launched overlapped, may take free CTA slots from now on: it waits
  // for this grid to finish before it reads the partials)
  let_next_grid_start();

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sStages = sQ + ROWS * D;
  float* sMax = reinterpret_cast<float*>(smem_raw + Tr::kSmemQBytes + Tr::kSmemStageBytes);
  float* sSum = sMax + NW * ROWS;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, tq = lane % 4;
  const int group = p.h / p.h_k;
  const int m_tiles = (p.seqlen_q * group + ROWS - 1) / ROWS;
  const int split = blockIdx.x;
  const int kvh = blockIdx.y / m_tiles;
  const int r0 = (blockIdx.y % m_tiles) * ROWS;
  const int bidb = blockIdx.z;

  SeqInfo si = seq_info(p, bidb);
  if (p.seqlens_k != nullptr) {  // FlashAttention's cache_seqlens, kept inside the K/V rows
    si.len_k = max(0, min(p.seqlens_k[bidb], p.seqlen_k));
  }
  if (r0 >= si.rows_q * group) return;  // rows of no token of this sequence
  const Band band = band_of(p, si);
  const int live_rows = min(ROWS, si.len_q * group - r0);  // <= 0: padding tokens only
  const int t_lo = r0 / group, t_hi = (r0 + max(live_rows, 1) - 1) / group;
  const ChunkRange range = live_rows > 0 ? chunk_range(p, band, t_lo, t_hi) : ChunkRange{0, 0};
  const int per_split = (range.count + p.num_splits - 1) / p.num_splits;
  const int c_begin = split * per_split;
  const int c_end = min(range.count, c_begin + per_split);
  const int mine = c_end - c_begin > warp ? (c_end - c_begin - warp + NW - 1) / NW : 0;

  // Q rows: row r is token (r0 + r) / group, query head kvh * group + (r0 + r) % group.
  {
    const T* q_seq = reinterpret_cast<const T*>(p.q) + si.q_off(p.q_batch_stride, p.q_row_stride);
    for (int i = tid; i < ROWS * (D / 8); i += Tr::kNThreads) {
      const int r = i / (D / 8), col = (i % (D / 8)) * 8;
      const int row = r0 + r;
      const bool ok = r < live_rows && col < p.d;
      const T* src = q_seq + int64_t(row / group) * p.q_row_stride +
                     int64_t(kvh * group + row % group) * p.q_head_stride + col;
      cp_async_16(smem_u32(sQ + swz<D>(r, col)), ok ? src : q_seq, ok);
    }
    cp_async_commit();
  }

  // K and V of one chunk into a stage of this warp; rows past the keys are zero-filled (P is
  // 0 there, and 0 * garbage could be NaN). kLanesPerRow lanes share a row (kColsPerLane
  // 16-byte columns each, interleaved so that a warp's loads stay coalesced) and a pass covers
  // kRowsPerPass rows; a lane's addresses are its chunk's first row plus offsets fixed for
  // the loop, so a load costs a 64-bit add (the per-row index arithmetic was most of the
  // loop's instructions).
  constexpr int kColChunks = D / 8;
  constexpr int kLanesPerRow = kColChunks % 32 == 0 ? 32 : kColChunks % 16 == 0 ? 16 : 8;
  constexpr int kColsPerLane = kColChunks / kLanesPerRow;
  constexpr int kRowsPerPass = 32 / kLanesPerRow;
  static_assert(CH % kRowsPerPass == 0, "whole passes per chunk");
  const int lane_row = lane / kLanesPerRow, lane_col = (lane % kLanesPerRow) * 8;
  const bool paged = p.block_table != nullptr;
  // Head kvh's rows: of key 0 of this sequence (contiguous cache), or of page 0's row 0.
  const T* const k_head = reinterpret_cast<const T*>(p.k) + int64_t(kvh) * p.k_head_stride +
                          (paged ? 0 : si.k_off(p.k_batch_stride, p.k_row_stride)) +
                          int64_t(lane_row) * p.k_row_stride + lane_col;
  const T* const v_head = reinterpret_cast<const T*>(p.v) + int64_t(kvh) * p.v_head_stride +
                          (paged ? 0 : si.k_off(p.v_batch_stride, p.v_row_stride)) +
                          int64_t(lane_row) * p.v_row_stride + lane_col;
  const int64_t k_pass = int64_t(kRowsPerPass) * p.k_row_stride;
  const int64_t v_pass = int64_t(kRowsPerPass) * p.v_row_stride;
  const int* const pages =
      paged ? p.block_table + int64_t(bidb) * p.block_table_batch_stride : nullptr;
  T* const sWarp = sStages + warp * Tr::kWarpElems;
  auto chunk_key = [&](int i) { return range.first + (c_begin + warp + i * NW) * CH; };
  // The page of chunk i (paged caches): read an iteration before its loads need it, so that
  // the block table's latency is not in the loop's critical path.
  const int page_shift = p.page_shift;
  auto page_of = [&](int i) {
    const int j = chunk_key(i);
    return i < mine ? pages[page_shift >= 0 ? j >> page_shift : j / p.page_size] : 0;
  };
  auto load_chunk = [&](int i, int page) {
    const int j0 = chunk_key(i);
    T* sK = sWarp + (i % S) * 2 * Tr::kChunkElems;
    T* sV = sK + Tr::kChunkElems;
    // the chunk's first row in its rows
    const int row0 = !paged ? j0 : page_shift >= 0 ? j0 & (p.page_size - 1) : j0 % p.page_size;
    const T* k_rows = k_head + (paged ? int64_t(page) * p.k_batch_stride : 0) +
                      int64_t(row0) * p.k_row_stride;
    const T* v_rows = v_head + (paged ? int64_t(page) * p.v_batch_stride : 0) +
                      int64_t(row0) * p.v_row_stride;
    const int rows_left = band.len_k - j0 - lane_row;  // this lane's rows that hold keys
#pragma unroll
    for (int pass = 0; pass < CH / kRowsPerPass; ++pass) {
      const int r = lane_row + pass * kRowsPerPass;
#pragma unroll
      for (int c = 0; c < kColsPerLane; ++c) {
        const int col = c * kLanesPerRow * 8;  // from lane_col
        const bool ok = pass * kRowsPerPass < rows_left && lane_col + col < p.d;
        cp_async_16(smem_u32(sK + swz<D>(r, lane_col + col)), k_rows + col, ok);
        cp_async_16(smem_u32(sV + swz<D>(r, lane_col + col)), v_rows + col, ok);
      }
      k_rows += k_pass;
      v_rows += v_pass;
    }
  };

#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < mine) load_chunk(i, paged ? page_of(i) : 0);
    cp_async_commit();  // empty groups keep the count that cp_async_wait relies on
  }
  int next_page = paged ? page_of(S - 1) : 0;  // chunk S - 1's, loaded in iteration 0
  cp_async_wait<S - 1>();  // this thread's Q chunks have landed
  __syncthreads();         // and every thread's

  float acc_o[NF_O][4];
#pragma unroll
  for (int nf = 0; nf < NF_O; ++nf)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[nf][e] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const float sl2 = p.scale_softmax_log2;
  const uint32_t sQ_u32 = smem_u32(sQ);
  // Q's A fragments: up to d128 held in registers for the whole loop (32 registers; above, the
  // loop's registers would spill), else read from shared memory in each chunk's QK^T.
  constexpr bool kQInRegs = D <= 128;
  uint32_t q_frag[kQInRegs ? KF : 1][4];
  if constexpr (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < KF; ++kk) {
      ldmatrix_x4(q_frag[kk], sQ_u32 + 2 * swz<D>(lane % 16, kk * 16 + (lane / 16) * 8));
    }
  }
  // Rows 8-15 of the tile (each thread's second row) hold no (token, head) pair when the
  // sequence's rows here are 8 or fewer (one token of a GQA group up to 8): their softmax is
  // skipped (their O rows come out of the MMAs unused; rows are independent there).
  const bool upper_rows_live = live_rows > 8;

  for (int i = 0; i < mine; ++i) {
    cp_async_wait<S - 2>();  // chunk i has landed (this lane's part)
    __syncwarp();            // every lane's part, and every lane is done with chunk i - 1
    if (i + S - 1 < mine) load_chunk(i + S - 1, next_page);  // into chunk i - 1's stage
    cp_async_commit();
    if (paged) next_page = page_of(i + S);

    const int j0 = chunk_key(i);
    const T* sK = sWarp + (i % S) * 2 * Tr::kChunkElems;
    const T* sV = sK + Tr::kChunkElems;
    const uint32_t sK_u32 = smem_u32(sK), sV_u32 = smem_u32(sV);

    // S = Q K^T for 16 rows x 16 keys.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < KF; ++kk) {
      uint32_t a[4], b[4];
      if constexpr (kQInRegs) {
#pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = q_frag[kk][e];
      } else {
        ldmatrix_x4(a, sQ_u32 + 2 * swz<D>(lane % 16, kk * 16 + (lane / 16) * 8));
      }
      ldmatrix_x4(b, sK_u32 + 2 * swz<D>((lane & 7) + ((lane >> 4) << 3),
                                         kk * 16 + ((lane >> 3) & 1) * 8));
      mma_16816<T>(s[0], a, b[0], b[1]);
      mma_16816<T>(s[1], a, b[2], b[3]);
    }

    // The mask, on chunks that reach past the keys or cross the band.
    if (band_cuts(band, t_lo, t_hi, j0, j0 + CH - 1)) {
#pragma unroll
      for (int nf = 0; nf < 2; ++nf)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = (r0 + g + 8 * (e >> 1)) / group;
          const int j = j0 + nf * 8 + 2 * tq + (e & 1);
          const bool keep = j < band.len_k &&
                            (band.right < 0 || j <= t + band.off + band.right) &&
                            (band.left < 0 || j >= t + band.off - band.left);
          if (!keep) s[nf][e] = -INFINITY;
        }
    }

    // Online softmax (rows g and g + 8). A row with no key so far keeps max -inf. O is
    // rescaled only where some row of the warp saw its max grow (corr is exactly 1 where it
    // did not: the same result; after the first chunks most chunks skip the multiplies).
    float corr[2] = {1.f, 1.f};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (r == 1 && !upper_rows_live) break;  // (uniform over the CTA)
      float mx = row_max[r];
#pragma unroll
      for (int nf = 0; nf < 2; ++nf) mx = fmaxf(mx, fmaxf(s[nf][2 * r], s[nf][2 * r + 1]));
      mx = quad_max(mx);
      const float mx_scaled = mx == -INFINITY ? 0.f : mx * sl2;
      corr[r] = exp2f(row_max[r] * sl2 - mx_scaled);
      row_max[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int nf = 0; nf < 2; ++nf)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2f(fmaf(s[nf][2 * r + e], sl2, -mx_scaled));
          s[nf][2 * r + e] = pe;
          sum += pe;
        }
      row_sum[r] = row_sum[r] * corr[r] + sum;
    }
    if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
      for (int nf = 0; nf < NF_O; ++nf) {
        acc_o[nf][0] *= corr[0];
        acc_o[nf][1] *= corr[0];
        acc_o[nf][2] *= corr[1];
        acc_o[nf][3] *= corr[1];
      }
    }

    // O += P V (P from registers: the S accumulator layout is the A-operand layout).
    uint32_t a[4];
    a[0] = pack2<T>(s[0][0], s[0][1]);
    a[1] = pack2<T>(s[0][2], s[0][3]);
    a[2] = pack2<T>(s[1][0], s[1][1]);
    a[3] = pack2<T>(s[1][2], s[1][3]);
#pragma unroll
    for (int nn = 0; nn < NF_O / 2; ++nn) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sV_u32 + 2 * swz<D>((lane & 7) + ((lane >> 3) & 1) * 8,
                                               nn * 16 + (lane >> 4) * 8));
      mma_16816<T>(acc_o[2 * nn], a, b[0], b[1]);
      mma_16816<T>(acc_o[2 * nn + 1], a, b[2], b[3]);
    }
  }

  cp_async_wait<0>();
  // The workspace row of partial `partial` for the tile's row `row` (split rows): token *
  // h + head, token the packed index (thd q) or b * seqlen_q + t.
  auto accum_row = [&](int partial, int row) {
    const int t = row / group, head = kvh * group + row % group;
    const int64_t token = p.q_packed ? int64_t(si.start_q) + t : int64_t(bidb) * p.seqlen_q + t;
    return int64_t(partial) * p.accum_rows + token * p.h + head;
  };
  if (p.num_partials > p.num_splits) {
    // Each warp writes its own normalized partial and LSE (partial split * NW + warp). Rows of
    // the tile past the sequence's (token, head) pairs, or that saw no key, get zeros and
    // LSE -inf: every partial of a row in a sequence is written.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int rr = g + 8 * r;
      const int row = r0 + rr;
      const float sum = quad_sum(row_sum[r]);
      if (row >= si.rows_q * group) continue;  // the next sequence's (packed q)
      const bool live = rr < live_rows && sum > 0.f;
      const float inv = live ? 1.f / sum : 0.f;
      const int64_t acc_row = accum_row(split * NW + warp, row);
      float* const dst = p.o_accum + acc_row * D + 2 * tq;
#pragma unroll
      for (int nf = 0; nf < NF_O; ++nf) {
        *reinterpret_cast<float2*>(dst + nf * 8) =
            make_float2(acc_o[nf][2 * r] * inv, acc_o[nf][2 * r + 1] * inv);
      }
      if (tq == 0) p.lse_accum[acc_row] = live ? row_max[r] * sl2 + __log2f(sum) : -INFINITY;
    }
    return;
  }

  // Merge the warps. Their stages become float32 O partials [warp][row][D].
  __syncthreads();  // every warp is done with its stages
  float* sO = reinterpret_cast<float*>(sStages);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    const float sum = quad_sum(row_sum[r]);
    if (tq == 0) {
      sMax[warp * ROWS + row] = row_max[r] == -INFINITY ? -INFINITY : row_max[r] * sl2;
      sSum[warp * ROWS + row] = sum;
    }
#pragma unroll
    for (int nf = 0; nf < NF_O; ++nf) {
      *reinterpret_cast<float2*>(sO + (warp * ROWS + row) * D + nf * 8 + 2 * tq) =
          make_float2(acc_o[nf][2 * r], acc_o[nf][2 * r + 1]);
    }
  }
  __syncthreads();  // the merge below reads other warps' partials

  T* o_seq = reinterpret_cast<T*>(p.o) + si.q_off(p.o_batch_stride, p.o_row_stride);
  for (int i = tid; i < ROWS * (D / 4); i += Tr::kNThreads) {
    const int r = i / (D / 4), col = (i % (D / 4)) * 4;
    const int row = r0 + r;
    if (row >= si.rows_q * group) continue;  // the next sequence's (packed q)
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) m = fmaxf(m, sMax[w * ROWS + r]);
    float l = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < live_rows && m != -INFINITY) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float mw = sMax[w * ROWS + r];
        if (mw == -INFINITY) continue;
        const float f = exp2f(mw - m);
        l += f * sSum[w * ROWS + r];
        const float4 ow = *reinterpret_cast<const float4*>(sO + (w * ROWS + r) * D + col);
        o.x += f * ow.x; o.y += f * ow.y; o.z += f * ow.z; o.w += f * ow.w;
      }
    }
    const bool live = l > 0.f;  // false for padding tokens and rows with no key
    const float inv = live ? 1.f / l : 0.f;
    o.x *= inv; o.y *= inv; o.z *= inv; o.w *= inv;
    if (p.num_splits == 1) {
      const int t = row / group, head = kvh * group + row % group;
      if (col < p.d) {
        *reinterpret_cast<uint2*>(o_seq + int64_t(t) * p.o_row_stride +
                                  int64_t(head) * p.o_head_stride + col) =
            make_uint2(pack2<T>(o.x, o.y), pack2<T>(o.z, o.w));
      }
    } else {
      const int64_t acc_row = accum_row(split, row);
      *reinterpret_cast<float4*>(p.o_accum + acc_row * D + col) = o;
      if (col == 0) p.lse_accum[acc_row] = live ? m + __log2f(l) : -INFINITY;
    }
  }
}

// Merges the partials of decode_kernel (num_partials: a split's, or a split's warp's): one CTA
// per (token, head) row of the workspace. Thread s holds partial s's LSE; the partials are
// summed kGroups at a time (each group of threads reads one partial's row with float4 loads),
// so a row's loads are all in flight at once: with one warp per row, looping over the splits,
// the merge took 10 us at 33 splits on an H100. Tokens of no sequence (packed q past
// cu_seqlens_q[b]) and rows whose partials all saw no key get zeros. Every partial of a row in
// a sequence was written (zeros, LSE -inf when it saw no key).
template <typename T, int kD>
__global__ void __launch_bounds__(kMaxDecodeSplits) decode_combine_kernel(const DecodeParams p) {
  constexpr int kThreads = kMaxDecodeSplits;
  constexpr int kColThreads = kD / 4;               // float4 columns of a row
  constexpr int kGroups = kThreads / kColThreads;   // splits summed at once
  static_assert(kGroups >= 1, "a row fits the CTA");
  __shared__ float s_weight[kThreads];
  __shared__ float s_red[kThreads / 32];
  __shared__ float4 s_part[kGroups][kColThreads];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t row = blockIdx.x;
  wait_for_prior_grid();  // decode_kernel's partials (launched overlapped on sm_90+)
  const int64_t token = row / p.h;
  const int head = int(row % p.h);
  T* out;
  bool in_sequence = true;
  if (p.q_packed) {
    in_sequence = token < p.cu_seqlens_q[p.b];
    out = reinterpret_cast<T*>(p.o) + token * p.o_row_stride;
  } else {
    out = reinterpret_cast<T*>(p.o) + (token / p.seqlen_q) * p.o_batch_stride +
          (token % p.seqlen_q) * p.o_row_stride;
  }
  out += int64_t(head) * p.o_head_stride;

  // This thread's partials (group g sums partials g, g + kGroups, ...): the first kAhead of them
  // are loaded before the LSEs' reduction, so that both reads are in flight at once (one
  // round trip to L2 for up to 64 partials instead of three); the rest in the loop below.
  constexpr int kAhead = (64 + kGroups - 1) / kGroups;
  const int group = tid / kColThreads, col = tid % kColThreads;
  const float* part = p.o_accum + row * kD + col * 4;
  const int64_t split_stride = int64_t(p.accum_rows) * kD;
  float4 ahead[kAhead];
#pragma unroll
  for (int i = 0; i < kAhead; ++i) {
    const int s = group + i * kGroups;
    ahead[i] = in_sequence && group < kGroups && s < p.num_partials
                   ? *reinterpret_cast<const float4*>(part + s * split_stride)
                   : make_float4(0.f, 0.f, 0.f, 0.f);
  }

  // The weights exp2(lse - max) of the partials, and their sum.
  const float lse = in_sequence && tid < p.num_partials
                        ? p.lse_accum[int64_t(tid) * p.accum_rows + row] : -INFINITY;
  float m = lse;
#pragma unroll
  for (int x = 16; x > 0; x /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
  if (lane == 0) s_red[warp] = m;
  __syncthreads();
  m = s_red[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = fmaxf(m, s_red[w]);
  const float weight = m == -INFINITY || lse == -INFINITY ? 0.f : exp2f(lse - m);
  s_weight[tid] = weight;
  float l = weight;
#pragma unroll
  for (int x = 16; x > 0; x /= 2) l += __shfl_xor_sync(0xffffffffu, l, x);
  __syncthreads();  // every warp has read s_red's maxima
  if (lane == 0) s_red[warp] = l;
  __syncthreads();  // s_weight and the sums are written
  l = 0.f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) l += s_red[w];

  if (group < kGroups) {
    // (in the order of s, as before the loads went ahead: the same sums)
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    auto add = [&](int s, float4 x) {
      const float w = s_weight[s];
      acc.x += w * x.x; acc.y += w * x.y; acc.z += w * x.z; acc.w += w * x.w;
    };
    if (l > 0.f) {
#pragma unroll
      for (int i = 0; i < kAhead; ++i) {
        if (group + i * kGroups < p.num_partials) add(group + i * kGroups, ahead[i]);
      }
#pragma unroll 4
      for (int s = group + kAhead * kGroups; s < p.num_partials; s += kGroups) {
        add(s, *reinterpret_cast<const float4*>(part + s * split_stride));
      }
    }
    s_part[group][col] = acc;
  }
  __syncthreads();  // the groups' sums are written
  if (tid < kColThreads && tid * 4 < p.d) {
    float4 o = s_part[0][tid];
#pragma unroll
    for (int g = 1; g < kGroups; ++g) {
      o.x += s_part[g][tid].x; o.y += s_part[g][tid].y;
      o.z += s_part[g][tid].z; o.w += s_part[g][tid].w;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    *reinterpret_cast<uint2*>(out + tid * 4) =
        make_uint2(pack2<T>(o.x * inv, o.y * inv), pack2<T>(o.z * inv, o.w * inv));
  }
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
