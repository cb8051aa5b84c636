// FlashAttention backward for sm90a (csrc/flash/README.md: its measurements and tuning).
//
// One CTA per (key block n, query head, batch): K and V of the block (its KV head's) are
// loaded once by TMA; a producer thread streams the query blocks m that see the key block (Q
// and dO tiles, TMA, a kStages mbarrier pipeline) and a producer warp their LSE and dsum rows
// (shared memory, a pipeline of the same stages); two consumer warpgroups, 64 key rows each,
// compute per block
//   S^T  = K Q^T              (wgmma, both operands in shared memory)
//   dP^T = V dO^T             (wgmma)
//   P^T  = exp(S^T - LSE), masked;  dS^T = P^T * (dP^T - dsum)       (registers)
//   dV  += P^T dO,  dK += dS^T Q   (wgmma, P^T / dS^T from registers; accumulated over m;
//                                  the dV GEMM runs while dS is computed)
//   dQ   = dS K                (wgmma: dS through shared memory by stmatrix, both warpgroups'
//                               keys)
// and add dQ into the float32 dq_accum: written to a shared-memory tile in dq_accum's layout,
// which one thread hands to the bulk-copy engine (cp.reduce.async.bulk, one instruction per
// tile; double-buffered, so that the engine reads a step's tile during the next step). dK,
// dV (dK times the softmax scale) are written at the end (GQA / MQA: added into float32
// accumulators, kv_accum below). Working on S^T (keys as rows) puts P^T and dS^T in the
// register layout of the A operand of the dV / dK GEMMs, as the forward's P is for P V.
//
// dsum = rowsum(dO * O), the zeroing of dq_accum and the conversion of dq_accum into dQ
// (times the softmax scale) are the sm80 family's kernels (sm80/bwd_kernel.cuh): the sm90
// backward uses the same dq_accum layout (flash.h, BwdParams), with one split. GQA's dK / dV
// accumulators are converted by the same kernel.
//
// Shared memory holds each of Q, dO, K and dS once; the GEMMs that need a transposed operand
// (Q^T, dO^T, K^T) read the same bytes through the transposed layout: a K-major 128-byte
// swizzled tile of (rows, d) is, element for element, the MN-major 128-byte swizzled tile of
// (d, rows) with the atoms ordered along the rows (Step<_2, _1>).
#pragma once

#include "flash/sm90/cute_config.h"  // first: before any CuTe header

#include "flash/common/sequence.cuh"
#include "flash/sm80/bwd_kernel.cuh"
#include "flash/sm90/fwd_kernel.cuh"

namespace transformer_fa {
namespace flash {
namespace sm90 {

using namespace cute;

// K-major 128-byte swizzled tiles of (kRows, kCols) (and kStages of them) as TMA writes them,
// and their transposed (MN-major) views of shape (kCols, kRows): a K-major tile of (rows, d)
// is, element for element, the MN-major tile of (d, rows) with the atoms ordered along the
// rows (Step<_2, _1>).
template <class Element, int kRows, int kCols>
using SmemRowsK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                         Shape<Int<kRows>, Int<kCols>>{}));
template <class Element, int kRows, int kCols>
using SmemRowsMN = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                          Shape<Int<kCols>, Int<kRows>>{}, Step<_2, _1>{}));
template <class Element, int kRows, int kCols, int kStages>
using SmemStagedRowsK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                               Shape<Int<kRows>, Int<kCols>, Int<kStages>>{}));
template <class Element, int kRows, int kCols, int kStages>
using SmemStagedRowsMN = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                                Shape<Int<kCols>, Int<kRows>, Int<kStages>>{},
                                                Step<_2, _1, _3>{}));

// The TMA side of a backward config (both sm90 backward kernels): Q / dO tiles of kBlockM
// rows, K / V tiles of kBlockN rows, the kernel's parameters.
template <class Element, int kBlockM, int kBlockN, int kHeadDim>
struct BwdGlobalTiles {
  // Global tensors as (seqlen, head_dim, heads, batch); strides in elements.
  using ShapeRows = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideRows = Stride<int64_t, _1, int64_t, int64_t>;
  using GmemRows = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                        ShapeRows{}, StrideRows{}));
  using SmemTileQ = SmemRowsK<Element, kBlockM, kHeadDim>;  // a Q or dO tile
  using SmemTileK = SmemRowsK<Element, kBlockN, kHeadDim>;  // a K or V tile
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemRows{}, SmemTileQ{},
                                      Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemRows{}, SmemTileK{},
                                      Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));

  struct Params {
    TmaQ tma_q;   // Q and dO
    TmaQ tma_do;
    TmaK tma_k;   // K and V
    TmaK tma_v;
    // (rows, d, heads, batch): rows = seqlen_q / seqlen_k, or for packed (thd) tensors all
    // their tokens with a batch of 1 (a sequence's tiles start at its first token then).
    ShapeRows shape_q;
    ShapeRows shape_k;
    BwdParams args;  // the call: lengths (common/sequence.cuh), LSE, dsum, dq_accum, dK, dV
    bool dq_rotate;  // deterministic mode's rotation (Rotation below; unmasked calls)
    int group_heads;  // grid_tile's group size (bwd_group_heads; 1: the launch order)
  };

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);
};

// A named backward tile configuration: kBlockN key rows per CTA (64 per consumer
// warpgroup), kBlockM query rows per step, kStages Q / dO buffers.
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct BwdConfig : BwdGlobalTiles<Element_, kBlockM_, kBlockN_, kHeadDim_> {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static_assert(kBlockN == 64 * kConsumerWarpgroups, "each consumer warpgroup owns 64 key rows");
  static_assert(kHeadDim % 64 == 0 && (kBlockM == 64 || kBlockM == 128));

  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static constexpr bool kDqFromRegisters = false;  // dQ: tiles through the dQ writer

  using TileSdP = Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>;  // S^T = K Q^T, dP^T = V dO^T
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>;   // dV = P^T dO, dK = dS^T Q
  using TileDQ = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;   // dQ = dS K
  using WarpgroupsAlongM = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;
  // dQ: the warpgroups split its kBlockM rows where there are 128, else its columns (a
  // warpgroup's columns must be whole 64-wide swizzle atoms of K^T, hence d128 only).
  static constexpr int kDqWarpgroupsM = kBlockM / 64;
  static constexpr int kDqWarpgroupsN = kConsumerWarpgroups / kDqWarpgroupsM;
  static_assert((kHeadDim / kDqWarpgroupsN) % 64 == 0, "dQ columns per warpgroup");

  using MmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileSdP>(), WarpgroupsAlongM{}));
  // A = P^T / dS^T from registers (K-major), B = dO^T / Q^T (MN-major views).
  using MmaKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileKV, GMMA::Major::K, GMMA::Major::MN>(),
      WarpgroupsAlongM{}));
  // A = dS (K-major), B = K^T (MN-major view of K).
  using MmaDQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kBlockM>, Int<kHeadDim / kDqWarpgroupsN>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<Int<kDqWarpgroupsM>, Int<kDqWarpgroupsN>, _1>>{}));
  // One wgmma spans each GEMM's whole N (cute_config.h).
  static_assert(size<1>(typename MmaSdP::AtomShape_MNK{}) == kBlockM &&
                size<1>(typename MmaKV::AtomShape_MNK{}) == kHeadDim &&
                size<1>(typename MmaDQ::AtomShape_MNK{}) == kHeadDim / kDqWarpgroupsN, "wgmma N");

  template <int kRows, int kCols>
  using RowsK = SmemRowsK<Element, kRows, kCols>;
  template <int kRows, int kCols>
  using RowsMN = SmemRowsMN<Element, kRows, kCols>;
  using SmemLayoutQ = SmemStagedRowsK<Element, kBlockM, kHeadDim, kStages>;
  using SmemLayoutQt = SmemStagedRowsMN<Element, kBlockM, kHeadDim, kStages>;
  using SmemLayoutDo = SmemLayoutQ;                 // dO: Q's stages
  using SmemLayoutK = RowsK<kBlockN, kHeadDim>;     // K and V
  using SmemLayoutKt = RowsMN<kBlockN, kHeadDim>;
  using SmemLayoutDS = RowsK<kBlockM, kBlockN>;      // dS (query rows, keys)
  using SmemLayoutDSt = RowsMN<kBlockM, kBlockN>;    // dS^T, as the consumers write it
  // MHA's dK and dV on their way out (after the key loop), in Q's and dO's buffers.
  using SmemLayoutDKV = SmemLayoutRowsSwizzled<kBlockN, kHeadDim>;
  static_assert(cosize_v<SmemLayoutDKV> <= cosize_v<SmemLayoutQ>, "dK / dV staging in Q / dO");

  // A step's dQ tile: dq_accum's rows of the 8-row groups that its kBlockM query rows touch
  // (a packed sequence may start inside a group), in dq_accum's layout.
  static constexpr int kDqTileRows = kBlockM + 8;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // The LSE and dsum of a query block, stored by one producer warp beside Q and dO's stages.
  using PipelineRows = cutlass::PipelineAsync<kStages>;
  static_assert(std::is_same_v<PipelineState, typename PipelineRows::PipelineState>);
  // A query block's dQ tile, written by the consumers into one of two buffers, added into
  // dq_accum by the dQ writer (one thread of producer warp 2), which frees the buffer once
  // the addition has read it.
  using PipelineDq = cutlass::PipelineAsync<2>;

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> dout;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> v;
    cute::array_aligned<Element, cosize_v<SmemLayoutDS>, 1024> ds;
    cute::array_aligned<float, PipelineDq::Stages * kDqTileRows * kHeadDim, 128> dq;
    cute::array_aligned<float, kStages * kBlockM> lse_log2;  // LSE * log2(e) per stage
    cute::array_aligned<float, kStages * kBlockM> dsum;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;
    alignas(16) typename Pipeline::SharedStorage pipe_q;
    alignas(16) typename Pipeline::SharedStorage pipe_do;
    alignas(16) typename PipelineRows::SharedStorage pipe_rows;
    alignas(16) typename PipelineDq::SharedStorage pipe_dq;
  };
};

// Named barrier ids beside the forward's (6-13); 0 is __syncthreads.
enum : uint32_t {
  // both consumers done with the previous block's dQ GEMM (its reads of dS; d256: the GEMMs
  // reading P and dS), and after the loop with every GEMM
  kBarDsFree = 14,
  // both consumers' dS in shared memory (d256: P and dS)
  kBarDsReady = 15,
  // MHA's dK and dV staged for the global stores (a forward id: the kernels share no CTA)
  kBarDkvStaged = kBarEpilogueWG0,
  // GQA, deterministic: both consumers' dK / dV reductions done (the MHA path's id: the two
  // epilogues never meet in one CTA)
  kBarKvAdded = kBarEpilogueWG0,
};

// GQA / MQA (h_k < h): the h / h_k query heads of a KV head add their dK and dV. Each CTA
// (key block, query head) adds its float32 tiles into two accumulators once, at its end, by
// reductions from registers (red.global.add.v2.f32: a CTA's share is one tile, against the
// dQ tile per query block that it reduces anyway), and the launch's conversion kernel writes
// them into dk / dv with their strides. MHA stores from registers as before. (One CTA per
// KV head walking its group, as the sm80 family does, would need no workspace but leave
// h_k * key blocks * b CTAs: 32 for MQA at b = 1 and s = 4k, on 132 SMs.)
// The accumulators have dq_accum's layout (flash.h) with k-side rows: per (sequence, KV head)
// a block of seqlen_k rows (thd: all kv_tokens, the sequences one after another) rounded up
// to 8, dK's then dV's, in the same allocation as dq_accum, after its splits (plan_bwd adds
// them; the launch zeroes them).
struct KvAccum {
  int64_t offset;  // of dK's accumulator from dq_accum, in floats (dV's: offset + floats)
  int64_t floats;  // each accumulator's size
  int64_t rows, head_stride, batch_stride;
};
__host__ __device__ inline KvAccum kv_accum(const BwdParams& p) {
  KvAccum a;
  a.rows = p.k_packed ? p.kv_tokens : p.seqlen_k;
  a.head_stride = (a.rows + 7) / 8 * 8 * p.dqa_row_stride;
  a.batch_stride = p.k_packed ? 0 : int64_t(p.h_k) * a.head_stride;
  a.floats = int64_t(p.k_packed ? 1 : p.b) * p.h_k * a.head_stride;
  a.offset = int64_t(p.num_splits) * p.dqa_split_stride;
  return a;
}

// Deterministic mode (BwdParams::deterministic): the key blocks that see query block m add
// their dQ tiles into it one at a time, last key block first (bit for bit the same sums on
// every run). A count per (sequence, head, query block of kBlockM rows), int32, in the
// workspace after dq_accum (and GQA's accumulators; plan_bwd adds it, the launch zeroes it),
// says how many have added theirs; key block n's dQ writer adds when it reaches n's rank among
// the key blocks that see m. Why the last first: a key block's query blocks start no earlier
// than its predecessor's (every mask), so under a causal or banded mask block n + 1 has added
// to m by the time n gets there; in the order of n, n waited for n - 1, which reached m later,
// and the waits added up along the blocks (H200, 2026-11-28: the causal deterministic
// backward went from 0.31-0.56x of cuDNN to 0.90-1.03x, with the dQ writer warp). Unmasked,
// all would start at m = 0 and the turns form a wavefront of one addition's latency per key
// block (0.80-0.93 of the default backward), so unmasked calls rotate instead (Rotation
// below; dq_rotates, bwd_launch.cuh: 0.94-1.03 of the default, H200, 2026-12-02).
// GQA / MQA adds dK and dV into its accumulators (kv_accum) in turns too: a count per
// (sequence, KV head, key block) after the dQ counts, and the query heads of a group add in
// the order of their index (their CTAs have larger blockIdx.y the later they come: dispatched
// later, so the wait is never on a CTA that has not started).
struct Turns {
  int64_t offset;    // of the dQ counts from dq_accum, in 4-byte words
  int64_t dq_count;  // 0 unless deterministic
  int64_t kv_count;  // 0 unless deterministic GQA; the KV counts follow the dQ counts
  int q_blocks;      // query blocks per (sequence, head)
  int k_blocks;      // key blocks per (sequence, KV head)
};
template <int kBlockM, int kBlockN>
__host__ __device__ inline Turns turns_of(const BwdParams& p) {
  KvAccum const acc = kv_accum(p);
  bool const gqa = p.h != p.h_k;
  Turns t;
  t.offset = acc.offset + (gqa ? 2 * acc.floats : 0);
  t.q_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
  t.k_blocks = (p.seqlen_k + kBlockN - 1) / kBlockN;
  t.dq_count = p.deterministic ? int64_t(p.b) * p.h * t.q_blocks : 0;
  t.kv_count = p.deterministic && gqa ? int64_t(p.b) * p.h_k * t.k_blocks : 0;
  return t;
}

// Deterministic mode's rotation (unmasked calls, dq_rotates) in a sequence of M query blocks
// and N key blocks: key block n visits its query blocks from floor(n M / N) on, wrapping, and
// query block m takes the key blocks in the order they reach it, the larger n first where two
// reach it in the same step: n0, n0 - 1, ..., 0, N - 1, ..., n0 + 1, n0 the last key block that
// starts at or before m. Every wait is on a key block that got there in an earlier step (or in
// the same step, a larger n): no cycle. (32-bit products: N is at most half the SMs.)
struct Rotation {
  int m_blocks, n_blocks;
  __device__ __forceinline__ int first(int n) const { return n * m_blocks / n_blocks; }
  __device__ __forceinline__ int rank(int m, int n) const {
    int const n0 = ((m + 1) * n_blocks + m_blocks - 1) / m_blocks - 1;
    return n0 >= n ? n0 - n : n0 - n + n_blocks;
  }
};

// Deterministic mode: this thread's bulk reductions have completed (bulk_wait_all); their
// writes are made visible, then the count is raised (release).
__device__ __forceinline__ void pass_dq_turn(int* turn) {
  sm90::fence_proxy_async_global();  // async-proxy writes before the generic release
  sm90::release_flag_inc(turn);
}

// This CTA's (key block, head, batch) of the (key blocks, heads, batch) grid: in grid_tile's
// order where the launch groups heads (causal-like masks: key block 0, which sees the most
// query blocks, first; an unmasked grid's CTAs all have the same work), else the launch order;
// deterministic mode, the last key blocks first (turns_of).
__device__ __forceinline__ GridTile bwd_grid_tile(BwdParams const& args, int group_heads) {
  GridTile gt{int(blockIdx.x), int(blockIdx.y), int(blockIdx.z)};
  if (group_heads > 1) {
    gt = grid_tile(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), gridDim.x,
                   args.h, args.b, group_heads);
  }
  if (args.deterministic) { gt.tile = int(gridDim.x) - 1 - gt.tile; }
  return gt;
}

// The query blocks [begin, end) that a key block visits, in the order begin + first, ...,
// end - 1, begin, ..., begin + first - 1 where kRotates (deterministic mode's rotation, see
// Rotation; the unmasked kernels), else in order. Every loop over them (the loads, the
// LSE / dsum rows, the consumers, the dQ writer) walks them by start() and next(). (Kernels
// without the rotation keep no more values live than a plain loop: the producer thread has 24
// registers.)
template <bool kRotates>
struct QueryBlocks {
  int begin, end;
  int first;  // read where kRotates
  __device__ __forceinline__ int count() const { return end - begin; }
  __device__ __forceinline__ int start() const { return kRotates ? begin + first : begin; }
  __device__ __forceinline__ int next(int m) const {
    if constexpr (kRotates) {
      return m + 1 == end ? begin : m + 1;
    } else {
      return m + 1;
    }
  }
};

// Query blocks of a sequence with some row that sees a key of block n_block (none past the
// sequence's keys): from the band (common/sequence.cuh) where the kernel's mask case has one
// (kBand), else every block of the sequence; visited from the first.
template <class Cfg, bool kBand>
__device__ __forceinline__ QueryBlocks<false> query_blocks(SeqInfo const& si, Band const& band,
                                                           int n_block) {
  constexpr int kBlockM = Cfg::kBlockM;
  int const key0 = n_block * Cfg::kBlockN;
  RowRange rows{0, si.len_q};
  if constexpr (kBand) { rows = band_queries(band, si.len_q, key0, key0 + Cfg::kBlockN - 1); }
  QueryBlocks<false> qb;
  qb.end = key0 < si.len_k && rows.hi > rows.lo ? (rows.hi + kBlockM - 1) / kBlockM : 0;
  qb.begin = min(rows.lo / kBlockM, qb.end);
  qb.first = 0;
  return qb;
}

// A key block's query blocks as the kernels walk them: in order, or (deterministic mode's
// rotation, unmasked kernels: !kBand) from Rotation::first on, wrapping; with the rotation of
// the sequence (M of its query blocks, N key blocks) and whether it applies.
template <bool kBand>
struct KeyBlockQueries {
  QueryBlocks<!kBand> qb;
  Rotation rotation;
  bool rotates;
};
template <class Cfg, bool kBand>
__device__ __forceinline__ KeyBlockQueries<kBand> key_block_queries(SeqInfo const& si,
                                                                     Band const& band,
                                                                     int n_block,
                                                                     bool dq_rotate) {
  KeyBlockQueries<kBand> kq;
  QueryBlocks<false> const blocks = query_blocks<Cfg, kBand>(si, band, n_block);
  kq.qb.begin = blocks.begin;
  kq.qb.end = blocks.end;
  // (unmasked: qb.begin = 0; a key block with query blocks has n_block < n_blocks)
  kq.rotation = Rotation{kq.qb.count(), (si.len_k + Cfg::kBlockN - 1) / Cfg::kBlockN};
  kq.rotates = !kBand && dq_rotate && kq.qb.count() > 0;
  kq.qb.first = kq.rotates ? kq.rotation.first(n_block) : 0;
  return kq;
}

// Deterministic mode (turns_of): key block n_block's rank among the key blocks that add into
// query block m, whose count must equal it before n_block adds. The key blocks that see m are
// a run [first, last] of n (the band's keys of m's rows that are in the sequence), added last
// first (rank last - n), or in the rotation's order. Last first, a CTA waits only on CTAs of
// the same (head, batch) with a larger n, whose smaller blockIdx.x the hardware dispatched
// earlier (bwd_grid_tile) and which wait on none of their successors: no deadlock, even with
// fewer SMs than CTAs (the rotation's condition: dq_rotates, bwd_launch.cuh).
template <int kBlockM, int kBlockN, bool kBand>
__device__ __forceinline__ int dq_rank(KeyBlockQueries<kBand> const& kq, Band const& band,
                                       SeqInfo const& si, int m, int n_block) {
  if (kq.rotates) { return kq.rotation.rank(m, n_block); }
  int const last_query = min(m * kBlockM + kBlockM - 1, si.len_q - 1);
  return (band_keys(band, m * kBlockM, last_query).hi - 1) / kBlockN - n_block;
}

// Deterministic mode's counts (turns_of) of a CTA: its (batch, head)'s dQ counts, one per query
// block, and GQA's count of its (batch, KV head, key block).
struct TurnCounts {
  int* dq;
  int* kv;
};
template <int kBlockM, int kBlockN>
__device__ __forceinline__ TurnCounts turn_counts_of(BwdParams const& args, int batch, int head,
                                                     int kv_head, int n_block) {
  Turns const turns = turns_of<kBlockM, kBlockN>(args);
  int* const counts = reinterpret_cast<int*>(args.dq_accum + turns.offset);
  return {counts + (int64_t(batch) * args.h + head) * turns.q_blocks,
          counts + turns.dq_count + (int64_t(batch) * args.h_k + kv_head) * turns.k_blocks +
              n_block};
}

// GQA / MQA's dK / dV additions of a key block (every consumer thread calls both, the
// additions between them): deterministic mode waits for this query head's turn among its
// group's (its index in the group), waited for by each warp as a whole (a lane asleep alone
// could be left behind at a convergence point: csrc/flash/README.md), and passes it on once
// every thread's reductions are complete and visible (fence, then the consumers' barrier).
__device__ __forceinline__ void wait_kv_turn(BwdParams const& args, TurnCounts const& counts,
                                             int head, int kv_head) {
  if (args.deterministic) {
    sm90::wait_flag_eq<true>(counts.kv, head - kv_head * (args.h / args.h_k));
  }
}
template <int kConsumerThreads>
__device__ __forceinline__ void pass_kv_turn(BwdParams const& args, TurnCounts const& counts,
                                             int tidx) {
  if (args.deterministic) {
    __threadfence();
    named_barrier_sync(kConsumerThreads, kBarKvAdded);
    if (tidx == 0) { sm90::release_flag_inc(counts.kv); }
  }
}

// The band as mask case (kCausal, kLocal) sees it: the sides it lacks as the constants they
// are, and its diagonal moved onto its left bound (kLocal) or its right one (kCausal), that
// bound now 0 (the bounds are j >= i + off - left, j <= i + off + right), so that the main loop
// keeps fewer values (the causal one: off alone, as before windows).
template <bool kCausal, bool kLocal>
__device__ __forceinline__ Band kernel_band(BwdParams const& args, SeqInfo const& si) {
  static_assert(!(kCausal && kLocal), "kLocal covers a right bound too");
  Band band = band_of(args, si);
  if constexpr (kLocal) {
    band.off -= band.left;
    if (band.right >= 0) { band.right += band.left; }
    band.left = 0;
  } else {
    band.left = -1;
  }
  if constexpr (kCausal) {
    band.off += band.right;
    band.right = 0;
  }
  if constexpr (!kCausal && !kLocal) { band.right = -1; }
  return band;
}

// Whether key `key` gets P = 0 for query `query`, asked only in tiles that the band cuts
// (`masked && key_out(...)` at the call: with `masked` inside, the d64 windows kernel spilled
// one more value): keys past the sequence (zero-filled by TMA, or the next packed sequence's)
// and keys outside the band. (Query rows past the sequence, or without any key, have
// LSE = +inf: P = 0 too.)
__device__ __forceinline__ bool key_out(Band const& band, int len_k, int query, int key) {
  return key >= len_k || (band.right >= 0 && key > query + band.off + band.right) ||
         (band.left >= 0 && key < query + band.off - band.left);
}

// The first thread, before the pipelines: the TMA descriptors prefetched, K / V's barrier set.
template <class Params, class Shared>
__device__ __forceinline__ void prefetch_and_init(Params const& params, Shared& shared) {
  cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
  cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
  cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
  cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  shared.barrier_kv.init(1);
}

// The backward's pipelines' parameters: warpgroup 0 produces the Q / dO tiles (its first
// thread) and the LSE / dsum rows (warp 1); the consumer warpgroups consume them.
template <class Pipeline>
__device__ __forceinline__ typename Pipeline::Params tma_pipe_params(int warpgroup_idx,
                                                                     uint32_t bytes,
                                                                     int consumer_threads) {
  typename Pipeline::Params p;
  p.transaction_bytes = bytes;
  p.role = warpgroup_idx == 0 ? Pipeline::ThreadCategory::Producer
                              : Pipeline::ThreadCategory::Consumer;
  p.is_leader = threadIdx.x == 0;
  p.num_consumers = consumer_threads;
  return p;
}
template <class PipelineRows>
__device__ __forceinline__ typename PipelineRows::Params rows_pipe_params(int warpgroup_idx,
                                                                          int consumer_threads) {
  typename PipelineRows::Params p;
  p.role = warpgroup_idx == 0 ? PipelineRows::ThreadCategory::Producer
                              : PipelineRows::ThreadCategory::Consumer;
  p.producer_arv_count = 32;  // producer warp 1
  p.consumer_arv_count = consumer_threads;
  return p;
}

// Producer warp 1: each query block's LSE (log2 units) and dsum into shared memory, stage by
// stage of pipe_rows: rows past the sequence get LSE = +inf (P = 0) and dsum = 0, so their dS
// is 0 too. lse_offset: the LSE (and dsum) of this sequence's query row 0 and head.
template <int kBlockM, class PipelineRows, class QueryBlocksT>
__device__ __forceinline__ void store_query_rows(PipelineRows& pipe_rows, float* lse_log2_smem,
                                                 float* dsum_smem, BwdParams const& args,
                                                 SeqInfo const& si, int64_t lse_offset,
                                                 QueryBlocksT const& qb) {
  int const lane = threadIdx.x % 32;
  auto write = cutlass::make_producer_start_state<PipelineRows>();
  int m_block = qb.start();
  for (int i = 0; i < qb.count(); ++i, m_block = qb.next(m_block)) {
    pipe_rows.producer_acquire(write);
    float* lse_log2 = lse_log2_smem + write.index() * kBlockM;
    float* dsum = dsum_smem + write.index() * kBlockM;
    for (int r = lane; r < kBlockM; r += 32) {
      int const query = m_block * kBlockM + r;
      int64_t const at = lse_offset + int64_t(query) * args.lse_row_stride;
      bool const in = query < si.len_q;
      lse_log2[r] = in ? args.lse[at] * float(M_LOG2E) : INFINITY;
      dsum[r] = in ? args.dsum[at] : 0.f;
    }
    pipe_rows.producer_commit(write);
    ++write;
  }
}

// a if kFirst, else b (a reference to either: a constexpr choice between two variables).
template <bool kFirst, class A, class B>
__device__ __forceinline__ auto& first_if(A& a, B& b) {
  if constexpr (kFirst) {
    return a;
  } else {
    return b;
  }
}

// The producer thread: K and V of key block n_block (barrier_kv), then the Q and dO tiles of
// query blocks of qb, in its order, through their pipelines (each with its own stages).
template <class Cfg, class PipeQ, class PipeDo, class Shared, class QueryBlocksT>
__device__ __forceinline__ void load_tiles(typename Cfg::Params const& params, Shared& shared,
                                           PipeQ& pipe_q, PipeDo& pipe_do, SeqInfo const& si,
                                           int head, int kv_head, int batch, int n_block,
                                           QueryBlocksT const& qb) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kHeadDim = Cfg::kHeadDim;
  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutDo{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutK{});
  Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q);
  Tensor mdO = params.tma_do.get_tma_tensor(params.shape_q);
  Tensor mK = params.tma_k.get_tma_tensor(params.shape_k);
  Tensor mV = params.tma_v.get_tma_tensor(params.shape_k);
  auto tile_q = Shape<Int<kBlockM>, Int<kHeadDim>>{};
  auto tile_k = Shape<Int<kBlockN>, Int<kHeadDim>>{};
  // This sequence's rows: packed tensors from its first token (its tiles may reach into
  // the next sequence's rows: those are masked like rows past a padded length).
  auto rows_q = [&](auto& m) {
    return domain_offset(make_coord(si.q_packed ? si.start_q : 0, _0{}),
                         m(_, _, head, si.q_packed ? 0 : batch));
  };
  auto rows_k = [&](auto& m) {
    return domain_offset(make_coord(si.k_packed ? si.start_k : 0, _0{}),
                         m(_, _, kv_head, si.k_packed ? 0 : batch));
  };
  Tensor gQ = local_tile(rows_q(mQ), tile_q, make_coord(_, _0{}));      // (M, D, m)
  Tensor gdO = local_tile(rows_q(mdO), tile_q, make_coord(_, _0{}));    // (M, D, m)
  Tensor gK = local_tile(rows_k(mK), tile_k, make_coord(n_block, _0{}));  // (N, D)
  Tensor gV = local_tile(rows_k(mV), tile_k, make_coord(n_block, _0{}));  // (N, D)
  auto q_parts = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                               group_modes<0, 2>(gQ));
  auto do_parts = tma_partition(params.tma_do, _0{}, Layout<_1>{}, group_modes<0, 2>(sdO),
                                group_modes<0, 2>(gdO));
  auto k_parts = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK),
                               group_modes<0, 2>(gK));
  auto v_parts = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV),
                               group_modes<0, 2>(gV));
  shared.barrier_kv.arrive_and_expect_tx(2 * Cfg::kBytesKV);
  auto& kv_barrier = reinterpret_cast<uint64_t&>(shared.barrier_kv);
  copy(params.tma_k.with(kv_barrier), get<0>(k_parts), get<1>(k_parts));
  copy(params.tma_v.with(kv_barrier), get<0>(v_parts), get<1>(v_parts));
  // dO's pipeline state: Q's own where both have the same stages (this thread has 24
  // registers; a second state spilled).
  constexpr bool kOneState = std::is_same_v<PipeQ, PipeDo>;
  auto write_q = cutlass::make_producer_start_state<PipeQ>();
  [[maybe_unused]] auto write_do_own = cutlass::make_producer_start_state<PipeDo>();
  auto& write_do = first_if<kOneState>(write_q, write_do_own);
  int m_block = qb.start();
  for (int i = 0; i < qb.count(); ++i, m_block = qb.next(m_block)) {
    pipe_q.producer_acquire(write_q);
    copy(params.tma_q.with(*pipe_q.producer_get_barrier(write_q)), get<0>(q_parts)(_, m_block),
         get<1>(q_parts)(_, write_q.index()));
    pipe_do.producer_acquire(write_do);
    copy(params.tma_do.with(*pipe_do.producer_get_barrier(write_do)),
         get<0>(do_parts)(_, m_block), get<1>(do_parts)(_, write_do.index()));
    ++write_q;
    if constexpr (!kOneState) { ++write_do; }
  }
  pipe_q.producer_tail(write_q);
  pipe_do.producer_tail(write_do);
}

// GQA / MQA: this (sequence, KV head)'s dK accumulator (kv_accum; dV's is `floats` after it),
// from its key row 0.
__device__ __forceinline__ float* kv_accum_block(BwdParams const& args, SeqInfo const& si,
                                                 int batch, int kv_head) {
  KvAccum const acc = kv_accum(args);
  return args.dq_accum + acc.offset + (si.k_packed ? 0 : int64_t(batch) * acc.batch_stride) +
         int64_t(kv_head) * acc.head_stride;
}

// MHA: rows [row0, row0 + 64) of the staged dK and dV tiles (16-bit, written by other threads,
// synchronized), the sequence's key rows first_key.., stored by one warpgroup (tid 0-127):
// the rows below `rows` only.
template <int kHeadDim, class Element, class TensorS>
__device__ __forceinline__ void store_dkv_rows(BwdParams const& args, SeqInfo const& si, int head,
                                               TensorS const& sdK, TensorS const& sdV, int row0,
                                               int64_t first_key, int rows, int tid) {
  store_staged_rows<kHeadDim>(static_cast<Element*>(args.dk) +
                                  si.k_off(args.dk_batch_stride, args.dk_row_stride) +
                                  int64_t(head) * args.dk_head_stride +
                                  first_key * args.dk_row_stride,
                              args.dk_row_stride, sdK, row0, rows, args.d, tid);
  store_staged_rows<kHeadDim>(static_cast<Element*>(args.dv) +
                                  si.k_off(args.dv_batch_stride, args.dv_row_stride) +
                                  int64_t(head) * args.dv_head_stride +
                                  first_key * args.dv_row_stride,
                              args.dv_row_stride, sdV, row0, rows, args.d, tid);
}

// The mask, as compile-time cases (the forward's): kCausal, a right bound alone
// (window_right >= 0, window_left < 0; causal is window_right = 0); kLocal, a left bound
// (window_left >= 0) with or without a right one; neither: only the keys' end. A key block's
// query blocks come from the band, and only the steps whose tile the band cuts are masked.
template <class Cfg, bool kCausal, bool kLocal>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
bwd_kernel(__grid_constant__ const typename Cfg::Params params) {
  using Element = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = typename Cfg::PipelineState;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kHeadDim = Cfg::kHeadDim;
  static_assert(!(kCausal && kLocal), "kLocal covers a right bound too");
  constexpr bool kBand = kCausal || kLocal;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  int const warp_idx = cutlass::canonical_warp_idx_sync();
  int const warpgroup_idx = cutlass::canonical_warp_group_idx();
  BwdParams const& args = params.args;
  GridTile const gt = bwd_grid_tile(args, params.group_heads);
  int const n_block = gt.tile, head = gt.head, batch = gt.batch;
  int const kv_head = head / (args.h / args.h_k);
  SeqInfo const si = seq_info(args, batch);
  Band const band = kernel_band<kCausal, kLocal>(args, si);
  int const key0 = n_block * kBlockN;
  if (key0 >= si.rows_k) { return; }  // past this (packed) sequence: the whole CTA leaves
  KeyBlockQueries<kBand> const kq =
      key_block_queries<Cfg, kBand>(si, band, n_block, params.dq_rotate);
  QueryBlocks<!kBand> const& qb = kq.qb;

  if (threadIdx.x == 0) { prefetch_and_init(params, shared); }

  auto const pipe_params = tma_pipe_params<Pipeline>(warpgroup_idx, Cfg::kBytesQ,
                                                     Cfg::kConsumerThreads);
  Pipeline pipe_q(shared.pipe_q, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipe_do(shared.pipe_do, pipe_params, Shape<_1, _1, _1>{});  // (dO tiles: Q's size)
  typename Cfg::PipelineRows pipe_rows(
      shared.pipe_rows,
      rows_pipe_params<typename Cfg::PipelineRows>(warpgroup_idx, Cfg::kConsumerThreads));
  using PipelineDq = typename Cfg::PipelineDq;
  typename PipelineDq::Params dq_params;
  dq_params.role = warpgroup_idx == 0 ? PipelineDq::ThreadCategory::Consumer
                                      : PipelineDq::ThreadCategory::Producer;
  dq_params.producer_arv_count = Cfg::kConsumerThreads;
  dq_params.consumer_arv_count = 1;  // the dQ writer
  PipelineDq pipe_dq(shared.pipe_dq, dq_params);
  __syncthreads();  // barrier inits visible to all before any use

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutK{});

  // The LSE (and dsum) of query row 0 of this sequence and head.
  int64_t const lse_offset = si.q_off(args.lse_batch_stride, args.lse_row_stride) +
                             int64_t(head) * args.lse_head_stride;

  // ---------------- dQ: tiles into dq_accum, in order in deterministic mode ----------------
  float* const dq_accum = sm80::dqa_block(args, si, 0, head);
  // dQ tiles: a step's rows from dq_accum's row (lead + query0) on, where lead = the 8-row
  // group offset of the sequence's first row (packed) or 0; rows before and after (another
  // sequence's, or past ours) stay zero and add zeros.
  int const lead = sm80::dqa_row(si, 0) & 7;
  float* const sdQ = shared.dq.data();
  auto dq_buffer = [&](int index) { return sdQ + index * Cfg::kDqTileRows * kHeadDim; };
  // Deterministic mode (turns_of, dq_rank). The 8-row group that the tiles of two query blocks
  // (or sequences) share gets zeros from the one it is not of: exact in any order.
  TurnCounts const counts =
      turn_counts_of<kBlockM, kBlockN>(args, batch, head, kv_head, n_block);

  if (warpgroup_idx == 0) {
    // ---------------- producer: its first thread issues every TMA load ----------------
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (warp_idx == 1) {
      // Warp 1: each query block's LSE and dsum rows into shared memory.
      store_query_rows<kBlockM>(pipe_rows, shared.lse_log2.data(), shared.dsum.data(), args, si,
                                lse_offset, qb);
      return;
    }
    if (warp_idx == 2) {
      // The dQ writer: one thread adds each query block's tile in whole 8-row groups (bulk
      // copies are per thread) and frees its buffer once read. It waits for its turn
      // (deterministic) apart from the consumers, which go on to the next block meanwhile, and
      // passes the turn on as soon as its addition has completed (its writes done, not only its
      // source read).
      if (cute::elect_one_sync()) {
        typename PipelineDq::PipelineState read;
        int m = qb.start();
        for (int i = 0; i < qb.count(); ++i, m = qb.next(m)) {
          pipe_dq.consumer_wait(read);
          if (args.deterministic) {
            sm90::wait_flag_eq(counts.dq + m, dq_rank<kBlockM, kBlockN>(kq, band, si, m, n_block));
            sm90::fence_proxy_async_global();  // the acquire before the reduction (async proxy)
          }
          int const query = m * kBlockM;
          int const rows = (lead + min(kBlockM, si.len_q - query) + 7) & ~7;
          sm90::bulk_reduce_add_f32(dq_accum + int64_t(sm80::dqa_row(si, query) & ~7) * kHeadDim,
                                    cast_smem_ptr_to_uint(dq_buffer(read.index())),
                                    uint32_t(rows * kHeadDim * sizeof(float)));
          sm90::bulk_wait_read<0>();
          pipe_dq.consumer_release(read);
          ++read;
          if (args.deterministic) {
            sm90::bulk_wait_all();
            pass_dq_turn(counts.dq + m);
          }
        }
        sm90::bulk_wait_all();
      }
      return;
    }
    if (threadIdx.x != 0) { return; }
    load_tiles<Cfg>(params, shared, pipe_q, pipe_do, si, head, kv_head, batch, n_block, qb);
    return;
  }

  // ---------------- consumers: two warpgroups, 64 key rows each ----------------
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  int const tidx = threadIdx.x - 128;

  Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutQt{});
  Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutKt{});
  Tensor sdS = make_tensor(make_smem_ptr(shared.ds.data()), typename Cfg::SmemLayoutDS{});
  Tensor sdSt = make_tensor(make_smem_ptr(shared.ds.data()), typename Cfg::SmemLayoutDSt{});

  typename Cfg::MmaSdP mma_sdp;
  typename Cfg::MmaKV mma_kv;
  typename Cfg::MmaDQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_kv = mma_kv.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(tidx);
  // Shared-memory descriptors of every GEMM operand.
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);      // (..., stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);   // (..., stage)
  Tensor tdVrdOt = thr_kv.partition_fragment_B(sdOt);  // (..., stage)
  Tensor tdKrQt = thr_kv.partition_fragment_B(sQt);    // (..., stage)
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
  // dS^T from the accumulator layout to shared memory by stmatrix (transposing: 8 keys of a
  // query, contiguous in dS's K-major rows, per matrix row).
  auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma_sdp);
  auto thr_r2s_ds = r2s_ds.get_thread_slice(tidx);
  Tensor tdSsdS = thr_r2s_ds.partition_D(sdSt);

  Tensor tdVrdV = partition_fragment_C(mma_kv, select<0, 1>(typename Cfg::TileKV{}));
  Tensor tdKrdK = partition_fragment_C(mma_kv, select<0, 1>(typename Cfg::TileKV{}));
  clear(tdVrdV);
  clear(tdKrdK);

  // (rows of a tile that no step writes stay zero: see lead)
  constexpr int kDqFloats = PipelineDq::Stages * Cfg::kDqTileRows * kHeadDim;
  for (int i = tidx * 4; i < kDqFloats; i += Cfg::kConsumerThreads * 4) {
    *reinterpret_cast<float4*>(sdQ + i) = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  typename PipelineDq::PipelineState dq_write = cutlass::make_producer_start_state<PipelineDq>();

  using LayoutS = decltype(
      partition_fragment_C(mma_sdp, select<0, 1>(typename Cfg::TileSdP{})).layout());
  Tensor cS = make_identity_tensor(select<0, 1>(typename Cfg::TileSdP{}));  // (key, query)
  Tensor tScS = thr_sdp.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor cdQ = make_identity_tensor(select<0, 1>(typename Cfg::TileDQ{}));  // (query, column)
  Tensor tdQcdQ = thr_dq.partition_C(cdQ);

  // Keys past the sequence (zero-filled by TMA, or the next packed sequence's) and keys outside
  // a query's band get P = 0 (query rows past the sequence, or without any key: LSE = +inf,
  // whence P = 0 too).
  float const scale_log2 = args.scale_softmax_log2;

  shared.barrier_kv.wait(0);
  PipelineState read;  // Q and dO stages advance together
  int m_block = qb.start();
  for (int i = 0; i < qb.count(); ++i, m_block = qb.next(m_block)) {
    int const query0 = m_block * kBlockM;
    Tensor tSrS = partition_fragment_C(mma_sdp, select<0, 1>(typename Cfg::TileSdP{}));
    Tensor tdPrdP = partition_fragment_C(mma_sdp, select<0, 1>(typename Cfg::TileSdP{}));
    pipe_q.consumer_wait(read);
    wg_gemm<true>(mma_sdp, tSrK, tSrQ(_, _, _, read.index()), tSrS);
    pipe_do.consumer_wait(read);
    wg_gemm<true>(mma_sdp, tdPrV, tdPrdO(_, _, _, read.index()), tdPrdP);

    Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    Tensor dp = make_tensor(tdPrdP.data(), acc_rowcol(tdPrdP.layout()));
    // The LSE and dsum of this thread's query columns are read from shared memory where
    // used, a column at a time (held for all columns across the GEMMs, they spilled).
    bool const masked = band_cuts(band, query0, query0 + kBlockM - 1, key0, key0 + kBlockN - 1);
    pipe_rows.consumer_wait(read);
    float const* lse_log2_of = shared.lse_log2.data() + read.index() * kBlockM;
    float const* dsum_of = shared.dsum.data() + read.index() * kBlockM;
    warpgroup_wait<1>();  // S^T
    warpgroup_fence_operand(tSrS);
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      int const query = query0 + get<1>(tScS_rc(0, c));
      float const lse_log2 = lse_log2_of[get<1>(tScS_rc(0, c))];
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s); ++r) {
        int const key = key0 + get<0>(tScS_rc(r, c));
        bool const out = masked && key_out(band, si.len_k, query, key);
        // The mask in the exponent (exp2(-inf) = 0), not a select of 0 after exp2: that form
        // let ptxas predicate the FFMA and MUFU and, short of registers, reload the scale from
        // the constant bank for each element (32-64 LDCs a warp per step; the ADU pipe 16.75%
        // busy against cuDNN's 4.4% in ncu). Same speed on the H200 (2026-12-03), fewer
        // instructions. (The d256 kernel's step does the same.)
        s(r, c) = fast_exp2(out ? -INFINITY : s(r, c) * scale_log2 - lse_log2);
      }
    }
    // P^T and dS^T as 16-bit A operands (the accumulator registers in operand order). The dV
    // GEMM runs while dS is computed.
    Tensor tPrP = make_tensor<Element>(LayoutS{});
    convert_fragment<Element>(tSrS, tPrP);
    Tensor tPrP_a = make_tensor(tPrP.data(), acc_as_operand_a(tPrP.layout()));
    wg_gemm<false>(mma_kv, tPrP_a, tdVrdOt(_, _, _, read.index()), tdVrdV);
    warpgroup_wait<1>();  // dP^T (committed before dV)
    warpgroup_fence_operand(tdPrdP);
    CUTE_UNROLL
    for (int c = 0; c < size<1>(s); ++c) {
      float const dsum = dsum_of[get<1>(tScS_rc(0, c))];
      CUTE_UNROLL
      for (int r = 0; r < size<0>(s); ++r) { dp(r, c) = s(r, c) * (dp(r, c) - dsum); }
    }
    pipe_rows.consumer_release(read);
    Tensor tdSrdS = make_tensor<Element>(LayoutS{});
    convert_fragment<Element>(tdPrdP, tdSrdS);
    Tensor tdSrdS_a = make_tensor(tdSrdS.data(), acc_as_operand_a(tdSrdS.layout()));
    wg_gemm<false>(mma_kv, tdSrdS_a, tdKrQt(_, _, _, read.index()), tdKrdK);

    // dS to shared memory for dQ, which needs both warpgroups' keys.
    named_barrier_sync(Cfg::kConsumerThreads, kBarDsFree);
    copy(r2s_ds, thr_r2s_ds.retile_S(tdSrdS), tdSsdS);
    cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma reads
    named_barrier_sync(Cfg::kConsumerThreads, kBarDsReady);
    Tensor tdQrdQ = partition_fragment_C(mma_dq, select<0, 1>(typename Cfg::TileDQ{}));
    wg_gemm<true>(mma_dq, tdQrdS, tdQrKt, tdQrdQ);
    warpgroup_wait<0>();
    pipe_q.consumer_release(read);
    pipe_do.consumer_release(read);
    ++read;

    // dQ partial -> this block's tile, once the writer has freed its buffer; rows past the
    // sequence (another sequence's, or padding) get zeros. The accumulator's elements 2i,
    // 2i + 1 are adjacent columns; its rows and columns are constant offsets (multiples of 8)
    // from its first element's, so the dq_accum layout's offsets are too.
    int const row0 = get<0>(tdQcdQ(0)), col0 = get<1>(tdQcdQ(0));
    int const valid_rows = si.len_q - query0;
    pipe_dq.producer_acquire(dq_write);
    float* const dst = dq_buffer(dq_write.index()) + sm80::dqa_offset(lead + row0, col0, kHeadDim);
    CUTE_UNROLL
    for (int i = 0; i < size(tdQrdQ); i += 2) {
      int const row = get<0>(tdQcdQ(i)), col = get<1>(tdQcdQ(i));
      bool const in = row < valid_rows;
      *reinterpret_cast<float2*>(dst + (row - row0) * kHeadDim + (col - col0) * 8) =
          make_float2(in ? tdQrdQ(i) : 0.f, in ? tdQrdQ(i + 1) : 0.f);
    }
    sm90::fence_proxy_async_smem();  // generic-proxy writes -> the bulk copy's reads
    pipe_dq.producer_commit(dq_write);
    ++dq_write;
  }
  if (qb.count() > 0) {
    // both warpgroups past their last GEMM: Q's and dO's buffers take dK and dV (MHA)
    named_barrier_sync(Cfg::kConsumerThreads, kBarDsFree);
  }

  // ---------------- epilogue: dV and dK (times the softmax scale) ----------------
  Tensor cKV = make_identity_tensor(select<0, 1>(typename Cfg::TileKV{}));  // (key, column)
  Tensor tKVcKV = thr_kv.partition_C(cKV);
  if (args.h != args.h_k) {
    // GQA: into the accumulators (kv_accum), the keys of the sequence only (the conversion
    // writes the rest as zeros). Elements 2i, 2i + 1 are adjacent columns, an even one first:
    // adjacent in the accumulators' layout too. dK's softmax scale: in the conversion.
    float* const dk_acc = kv_accum_block(args, si, batch, kv_head);
    float* const dv_acc = dk_acc + kv_accum(args).floats;
    int const row0 = si.k_packed ? si.start_k : 0;
    wait_kv_turn(args, counts, head, kv_head);
    CUTE_UNROLL
    for (int i = 0; i < size(tdVrdV); i += 2) {
      int const key = key0 + get<0>(tKVcKV(i));
      if (key < si.len_k) {
        int64_t const at = sm80::dqa_offset(row0 + key, get<1>(tKVcKV(i)), kHeadDim);
        sm80::atomic_add2(dk_acc + at, tdKrdK(i), tdKrdK(i + 1));
        sm80::atomic_add2(dv_acc + at, tdVrdV(i), tdVrdV(i + 1));
      }
    }
    pass_kv_turn<Cfg::kConsumerThreads>(args, counts, tidx);
    return;
  }
  // MHA: every row the sequence owns (padding rows past its length get zeros, as from sm80),
  // through shared memory for 16-byte stores: dK and dV staged in Q's and dO's buffers, free
  // once both warpgroups are past their last GEMM (the barrier after the loop; without query
  // blocks no GEMM read them), then each warpgroup stores 64 key rows.
  CUTE_UNROLL
  for (int i = 0; i < size(tdKrdK); ++i) { tdKrdK(i) *= args.scale_softmax; }
  Tensor sdK = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutDKV{});
  Tensor sdV = make_tensor(make_smem_ptr(shared.dout.data()), typename Cfg::SmemLayoutDKV{});
  Tensor tdKrdK_out = make_tensor<Element>(tdKrdK.layout());
  Tensor tdVrdV_out = make_tensor<Element>(tdVrdV.layout());
  convert_fragment<Element>(tdKrdK, tdKrdK_out);
  convert_fragment<Element>(tdVrdV, tdVrdV_out);
  copy(tdKrdK_out, thr_kv.partition_C(sdK));
  copy(tdVrdV_out, thr_kv.partition_C(sdV));
  // (the stores below read rows that the other warpgroup may have written)
  named_barrier_sync(Cfg::kConsumerThreads, kBarDkvStaged);
  int const wg = tidx / 128;
  int const rows = si.rows_k - key0 - wg * 64;
  int64_t const first = key0 + wg * 64;
  store_dkv_rows<kHeadDim, Element>(args, si, head, sdK, sdV, wg * 64, first, rows,
                                    tidx % 128);
}

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
