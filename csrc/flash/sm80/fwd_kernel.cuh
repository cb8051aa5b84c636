// FlashAttention-2-style forward for sm80+ (Ampere and Hopper alike): mma.sync m16n8k16
// tensor-core instructions, ldmatrix, cp.async, online softmax. One CTA per
// (q tile, head, batch); each warp owns 16 * kMFrags query rows of the tile.
//
// Pipeline per key/value block (as in FlashAttention-2): K and V each have one shared
// buffer. V[n] is loaded while S = Q K[n]^T runs; K[n-1] is loaded while O += P V[n] runs.
// Blocks are visited from the last to the first, so the masked blocks come first.
#pragma once

#include "flash/sm80/common.cuh"

namespace transformer_fa {
namespace flash {
namespace sm80 {

// A forward tile config: a struct that derives from FwdTile, sets kHeadDim, kBlockM (query
// rows), kBlockN (key rows) and kNWarps, and overrides the defaults it changes
// (sm80/fwd_launch.cuh names one per head dim, with the measurements behind them).
struct FwdTile {
  static constexpr int kMinBlocks = 2;            // CTAs per SM (__launch_bounds__ hint)
  static constexpr bool kSXorAddressing = false;  // S GEMM through XOR base addresses
  static constexpr int kSAhead = 1;               // S GEMM B fragments loaded this far ahead
  static constexpr bool kZfillFromBase = true;    // zero-filled loads from the tile base
  static constexpr bool kExtras = true;           // dropout and ALiBi compiled in
  static constexpr bool kLazyRescale = false;     // the lazy O rescale (below)
};

template <typename T, typename Tile>
struct FwdTraits {
  static constexpr int kMinBlocks = Tile::kMinBlocks;  // __launch_bounds__ occupancy hint
  // Dropout and ALiBi are compiled in only where a call uses them: their state, live across
  // the key-block loop, made ptxas spill in the loop of the kernel without them (d64).
  static constexpr bool kExtras = Tile::kExtras;
  // The softmax's reference max moves only when a row max grows by more than
  // 2^kRescaleLog2 (below); off, with every key block, as in FlashAttention-2 (the kernels
  // whose loop it would make spill: sm80/fwd_launch.cuh).
  static constexpr bool kLazyRescale = Tile::kLazyRescale;
  using Element = T;
  static constexpr int kHeadDim = Tile::kHeadDim;
  static constexpr int kBlockM = Tile::kBlockM;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kNWarps = Tile::kNWarps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kMFrags = kBlockM / (16 * kNWarps);  // 16-row MMA tiles per warp
  // S = Q K^T: Q / K fragment addresses as one XOR-swizzled base per lane and operand
  // (kSXorAddressing, power-of-two head dims) or through warp_gemm's LaneTiles; B fragments
  // loaded kSAhead MMA steps ahead (mma_pipeline). Measured per head dim (sm80/fwd_launch.cuh).
  static constexpr bool kSXorAddressing = Tile::kSXorAddressing;
  static constexpr int kSAhead = Tile::kSAhead;
  static_assert(!kSXorAddressing || (kHeadDim & (kHeadDim - 1)) == 0,
                "the XOR step needs a power-of-two row length");
  static constexpr int kChunks = kHeadDim / 8;              // 16-byte chunks per row
  static constexpr int kSmemQ = kBlockM * kHeadDim;         // elements
  static constexpr int kSmemKV = kBlockN * kHeadDim;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kSmemKV) * int(sizeof(T));
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row MMA tiles");
  static_assert(kHeadDim % 64 == 0, "head dims are multiples of 64 (swizzle over 8 chunks)");
  template <int kRows>
  static __device__ __forceinline__ void load(Element* smem, const Element* gmem,
                                              int64_t row_stride, int valid_rows, int d,
                                              int tid) {
    load_tile<Element, kHeadDim, kRows, kNThreads, Tile::kZfillFromBase>(smem, gmem, row_stride,
                                                                          valid_rows, d, tid);
  }
  static_assert(kBlockN % 16 == 0, "key blocks are multiples of 16");
};

// ---------------------------------------------------------------------------------------
// The kernel
// ---------------------------------------------------------------------------------------
// kLazyRescale's threshold (log2 units): P stays <= 256, well inside fp16 / bf16 and the
// fp32 sums.
constexpr float kRescaleLog2 = 8.f;

// group_heads: grid_tile's group size (1: the 3-D launch order), planned by the launch.
template <typename Tr>
__global__ void __launch_bounds__(Tr::kNThreads, Tr::kMinBlocks)
    fwd_kernel(const FwdParams p, const int group_heads) {
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

  // Heavier (later, under causal masks) query tiles first. The launch order comes as a 3-D
  // grid (tile, head, batch) read straight from blockIdx: grid_tile's divisions would sit in
  // front of every CTA's first load (non-causal d128 s 1k: 4% slower with them). Head groups
  // come as a 1-D grid (for one head and one sequence either reading gives the same tile).
  const int num_m_blocks = (p.seqlen_q + BM - 1) / BM;
  const GridTile gt = gridDim.y * gridDim.z > 1
                          ? GridTile{int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)}
                          : grid_tile(blockIdx.x, num_m_blocks, p.h, p.b, group_heads);
  const int m_block = num_m_blocks - 1 - gt.tile;
  const int bidh = gt.head;
  const int bidb = gt.batch;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // row within an MMA tile (and +8)
  const int t = lane % 4;  // column pair within an n8 tile

  const SeqInfo si = seq_info(p, bidb);
  const int m0 = m_block * BM;
  if (m0 >= si.rows_q) return;  // past this (packed) sequence: nothing to write
  const int bidh_k = bidh / (p.h / p.h_k);

  // Key range of this tile: [n_lo, n_hi) clipped by the band.
  const Band band = band_of(p, si);
  const int off = band.off;
  int n_hi = si.len_k;
  if (p.window_right >= 0) n_hi = min(n_hi, m0 + BM - 1 + off + p.window_right + 1);
  int n_lo = 0;
  if (p.window_left >= 0) n_lo = max(0, m0 + off - p.window_left);
  const float alibi_coef =
      !Tr::kExtras || p.alibi_slopes == nullptr
          ? 0.f
          : -p.alibi_slopes[bidb * p.alibi_batch_stride + bidh] / p.scale_softmax;
  Dropout drop{};
  if (Tr::kExtras && p.rng_state != nullptr) drop = dropout_of(p, bidb, bidh);
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
    const T* q_base = reinterpret_cast<const T*>(p.q) + si.q_off(p.q_batch_stride, p.q_row_stride) +
                      int64_t(bidh) * p.q_head_stride + int64_t(m0) * p.q_row_stride;
    // K / V of this sequence and head (from si.in_loop_k() inside the loop: not kept live).
    auto k_base = [&](const SeqInfo& at) {
      return reinterpret_cast<const T*>(p.k) + at.k_off(p.k_batch_stride, p.k_row_stride) +
             int64_t(bidh_k) * p.k_head_stride;
    };
    auto v_base = [&](const SeqInfo& at) {
      return reinterpret_cast<const T*>(p.v) + at.k_off(p.v_batch_stride, p.v_row_stride) +
             int64_t(bidh_k) * p.v_head_stride;
    };

    Tr::template load<BM>(sQ, q_base, p.q_row_stride, valid_q, p.d, tid);
    {
      const int n = n_block_max - 1;
      Tr::template load<BN>(sK, k_base(si) + int64_t(n) * BN * p.k_row_stride, p.k_row_stride,
                            si.len_k - n * BN, p.d, tid);
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
    // The XOR step above needs a power-of-two row length (bytes of the row index clear of
    // the chunk bits); V at d = 192 goes through the general per-lane tile addresses (only
    // built then: LaneTile's opaque lane values would otherwise cost registers).
    const LaneTile<D, !kPow2<D>> tv(sV, v_row, v_col);

    for (int n_block = n_block_max - 1; n_block >= n_block_min; --n_block) {
      const int n0 = n_block * BN;
      cp_async_wait_all();
      __syncthreads();  // K[n] (and Q) visible; every warp is done with V[n+1]
      Tr::template load<BN>(sV, v_base(si.in_loop_k()) + int64_t(n0) * p.v_row_stride,
                            p.v_row_stride,
                            si.len_k - n0, p.d, tid);
      cp_async_commit();

      // S = Q K^T
      float acc_s[MF][NF_S][4];
      zero(acc_s);
      if constexpr (Tr::kSXorAddressing) {
        // swz(row, 16 kk + c) = swz(row, c) ^ (2 kk chunks): one base offset per operand.
        mma_pipeline<T, MF, NF_S, KF_QK, Tr::kSAhead>(
            acc_s,
            [&](int kk, int mf, uint32_t(&a)[4]) {
              ldmatrix_x4(a, sQ_u32 + ((q_off0 ^ (kk * 32)) + mf * 16 * D * int(sizeof(T))));
            },
            [&](int kk, int nn, uint32_t(&b)[4]) {
              ldmatrix_x4(b, sK_u32 + ((k_off0 ^ (kk * 32)) + nn * 16 * D * int(sizeof(T))));
            });
      } else {
        warp_gemm<T, MF, NF_S, KF_QK, false, false, D, D, Tr::kSAhead>(acc_s, sQ, warp_row0, sK,
                                                                        0, lane);
      }

      // ALiBi, and the mask on blocks that reach past the keys or cross the band.
      const bool need_mask = band_cuts(band, m0, m0 + BM - 1, n0, n0 + BN - 1);
      if (need_mask || alibi_coef != 0.f) {
        bias_and_mask(acc_s, m0 + warp_row0, n0, lane, band, need_mask, alibi_coef);
      }

      cp_async_wait_all();
      __syncthreads();  // V[n] visible; every warp is done with K[n]
      if (n_block > n_block_min) {
        const int n = n_block - 1;
        Tr::template load<BN>(sK, k_base(si.in_loop_k()) + int64_t(n) * BN * p.k_row_stride,
                              p.k_row_stride,
                              si.len_k - n * BN, p.d, tid);
        cp_async_commit();
      }

      // Online softmax. row_max is the reference that O and the running sum are scaled to.
      // With kLazyRescale it moves (and O and the sum are rescaled) only when some row's max
      // grows by more than 2^kRescaleLog2: the result is exact for any reference both share,
      // P = exp(S - reference) stays <= 2^kRescaleLog2, and most key blocks skip the O
      // rescale (FlashAttention-4's conditional rescaling). Warp-wide: no divergence. The
      // running sum is of the undropped P.
      const float sl2 = p.scale_softmax_log2;
      auto block_max = [&](int mf, int r) {  // max of the row's running max and this block
        float mx = row_max[mf][r];
#pragma unroll
        for (int nf = 0; nf < NF_S; ++nf)
          mx = fmaxf(mx, fmaxf(acc_s[mf][nf][2 * r], acc_s[mf][nf][2 * r + 1]));
        return quad_max(mx);
      };
      // A row with no key so far keeps max -inf: 0 in its place gives exp 0, not NaN.
      auto scaled = [&](float mx) { return mx == -INFINITY ? 0.f : mx * sl2; };
      auto rescale_o = [&](int mf, int r, float corr) {
#pragma unroll
        for (int nf = 0; nf < NF_O; ++nf) {
          acc_o[mf][nf][2 * r] *= corr;
          acc_o[mf][nf][2 * r + 1] *= corr;
        }
      };
      auto exp_row = [&](int mf, int r, float ref_scaled) {  // P = exp(S - ref), its sum
        float sum = 0.f;
#pragma unroll
        for (int nf = 0; nf < NF_S; ++nf)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = exp2f(fmaf(acc_s[mf][nf][2 * r + e], sl2, -ref_scaled));
            acc_s[mf][nf][2 * r + e] = pe;
            sum += pe;
          }
        return sum;
      };
      if constexpr (Tr::kLazyRescale) {
        float mx[MF][2];
        bool grows = false;
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            mx[mf][r] = block_max(mf, r);
            // -inf -> finite gives +inf (a rescale); -inf -> -inf gives NaN (none needed).
            grows |= (mx[mf][r] - row_max[mf][r]) * sl2 > kRescaleLog2;
          }
        if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
          for (int mf = 0; mf < MF; ++mf)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const float corr = exp2f(row_max[mf][r] * sl2 - scaled(mx[mf][r]));
              row_max[mf][r] = mx[mf][r];
              row_sum[mf][r] *= corr;
              rescale_o(mf, r, corr);
            }
        }
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int r = 0; r < 2; ++r) row_sum[mf][r] += exp_row(mf, r, scaled(row_max[mf][r]));
      } else {
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const float mx = block_max(mf, r);
            const float mx_scaled = scaled(mx);
            const float corr = exp2f(row_max[mf][r] * sl2 - mx_scaled);
            row_max[mf][r] = mx;
            const float sum = exp_row(mf, r, mx_scaled);
            row_sum[mf][r] = row_sum[mf][r] * corr + sum;
            rescale_o(mf, r, corr);
          }
      }

      if (Tr::kExtras && p.rng_state != nullptr) {  // P * Z for the P V product
#pragma unroll
        for (int mf = 0; mf < MF; ++mf)
#pragma unroll
          for (int nf = 0; nf < NF_S; ++nf) {
            const uint32_t keep = dropout_bits(drop, m0 + warp_row0 + mf * 16, n0 + nf * 8, lane);
#pragma unroll
            for (int e = 0; e < 4; ++e)
              acc_s[mf][nf][e] = (keep >> e) & 1 ? acc_s[mf][nf][e] * drop.scale : 0.f;
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
          ldmatrix_x4_trans(b, kPow2<D> ? sV_u32 + ((v_off0 ^ (nn * 32)) +
                                                    kk * 16 * D * int(sizeof(T)))
                                        : tv.at(kk * 16, nn * 16));
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
  T* o_base = reinterpret_cast<T*>(p.o) + si.q_off(p.o_batch_stride, p.o_row_stride) +
              int64_t(bidh) * p.o_head_stride;
  float* lse_base = p.lse == nullptr ? nullptr
                                     : p.lse + si.q_off(p.lse_batch_stride, p.lse_row_stride) +
                                           int64_t(bidh) * p.lse_head_stride;
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

  // sQ becomes the O staging tile with no barrier: a warp reads and writes only its own rows
  // of it, and no load into it is in flight.
  store_acc<T, D>(sQ, acc_o, warp_row0, 0, lane);
  __syncthreads();  // the shared -> global copy reads rows other threads wrote
  store_tile<T, D, BM, Tr::kNThreads>(o_base + int64_t(m0) * p.o_row_stride, p.o_row_stride, sQ,
                                      si.rows_q - m0, p.d, tid);
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
