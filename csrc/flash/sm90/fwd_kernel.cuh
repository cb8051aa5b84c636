// FlashAttention forward for sm90a: TMA loads into swizzled shared memory,
// mbarrier pipelines, one producer warp and two or three consumer warpgroups (64
// query rows each) that run both GEMMs on wgmma (P stays in registers for P @ V).
// Each consumer overlaps the softmax of block n with the QK^T of block n - 1
// and the PV of block n + 1; the consumers take turns issuing their GEMMs (a
// named-barrier ring) so one's softmax hides under the others' GEMMs.
// With a persistent grid each CTA loops over tiles, so the producer loads the
// next tile's K and Q while the consumers finish the last one; the producer picks
// the tiles (TileScheduler) and hands each to the consumers through shared memory.
//
// The sm90 family's forward kernel; its launch (params -> TMA descriptors, grid) is
// fwd_launch.cuh. No torch headers here (only the binding includes torch).
#pragma once

#include "flash/sm90/cute_config.h"  // first: before any CuTe header

#include <cstdint>
#include <cmath>

#include <cute/tensor.hpp>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/fast_math.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "flash/common/sequence.cuh"
#include "flash/flash.h"

namespace transformer_fa {
namespace flash {
namespace sm90 {

using namespace cute;

// Tile order. Tiles are (m_block, head, batch), numbered by `decode`. Non-causal: m_block
// fastest, so the CTAs running at one time share a head's K/V in L2. Causal: heads are taken in
// groups whose K/V fit in L2 together; inside a group the heaviest query blocks (most keys)
// come first.
// A CTA's first tile is blockIdx.x; its producer warp picks each later one (next_tile) and
// hands every tile, then -1, to the consumer warpgroups through the kernel's tile ring, so
// that both walk the same sequence. The launch (fwd_launch.cuh, FwdScheduler) chooses how:
//  - one CTA per tile (gridDim.x = num_tiles): the hardware hands the CTAs out as SMs free up;
//    round 1 holds no tile.
//  - static persistent (counter == nullptr, a grid of at most one CTA per SM): round r hands
//    tiles [r * gridDim.x, (r + 1) * gridDim.x) to the CTAs, in reverse on odd rounds (a
//    snake: with tiles sorted heavy-first, a plain round-robin would give CTA 0 the heaviest
//    tile of every round).
//  - dynamic persistent (counter: an int zeroed before the launch): every later tile comes
//    from atomicAdd(counter, 1) + gridDim.x, so whichever CTA is free takes the next tile in
//    the heavy-first order (FlashAttention-3's scheduler). Not measured yet (2026-11-28: written
//    and compiled, not run on a GPU), so no call takes it by default.
struct TileScheduler {
  int num_m_blocks, num_heads_batches, heads, heads_per_group, num_tiles;
  int* counter;  // dynamic: tiles claimed after the first round; nullptr: static
  // decode's divisors as multiply-and-shift (every consumer thread decodes every tile: two
  // integer divisions were 3% of the d64 forward's instructions at s = 512, ncu)
  cutlass::FastDivmod by_m_blocks, by_heads, by_group_tiles, by_group_heads;

  // This CTA's tile in round `round` of the static order, or -1 when there is none (then there
  // is none in any later round either). Round 0 is blockIdx.x in every order.
  __device__ __forceinline__ int tile_of_round(int round) const {
    int const lane = (round & 1) ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
    int const tile = round * int(gridDim.x) + lane;
    return tile < num_tiles ? tile : -1;
  }

  // The tile this CTA takes after its tile of round `round`, or -1 when none is left. Dynamic:
  // each call claims one (an atomic), so one thread calls it per tile.
  __device__ __forceinline__ int next_tile(int round) const {
    if (counter == nullptr) { return tile_of_round(round + 1); }
    int const tile = atomicAdd(counter, 1) + int(gridDim.x);
    return tile < num_tiles ? tile : -1;
  }

  template <bool kCausal>
  __device__ __forceinline__ void decode(int tile, int& m_block, int& head, int& batch) const {
    int head_batch;
    if constexpr (kCausal) {
      int within;
      int const group = by_group_tiles.divmod(within, tile);
      int const first = group * heads_per_group;
      int const in_group = min(heads_per_group, num_heads_batches - first);
      int block_from_last, in_pair;
      if (in_group == heads_per_group) {
        block_from_last = by_group_heads.divmod(in_pair, within);
      } else {  // the last group, smaller
        block_from_last = within / in_group;
        in_pair = within - block_from_last * in_group;
      }
      m_block = num_m_blocks - 1 - block_from_last;
      head_batch = first + in_pair;
    } else {
      head_batch = by_m_blocks.divmod(m_block, tile);
    }
    batch = by_heads.divmod(head, head_batch);
  }
};

// A (kRows, kCols) row-major staging tile in shared memory whose 16-byte chunks are XOR-ed by
// the row's low 3 bits (kCols 64, 128 or 256): the accumulators' row pairs land in different
// banks without padding, and 16-byte chunks stay whole for the global stores. (The XOR takes
// the 3 row bits just above a row's own: log2(kCols) - 3 bits of chunk and element index
// below them.) The backward stages dK and dV in it.
template <int kRows, int kCols>
using SmemLayoutRowsSwizzled = decltype(composition(
    Swizzle<3, 3, kCols == 64 ? 3 : kCols == 128 ? 4 : 5>{},
    Layout<Shape<Int<kRows>, Int<kCols>>, Stride<Int<kCols>, _1>>{}));

// Four 32-bit words per thread of a quad, transposed across the quad's four lanes: lane q
// ends with word q of every lane, lane 0's first (two butterfly rounds of shuffles).
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int quad_lane) {
  bool const hi = quad_lane & 2;
  uint32_t const a0 = __shfl_xor_sync(0xffffffff, hi ? w[0] : w[2], 2);
  uint32_t const a1 = __shfl_xor_sync(0xffffffff, hi ? w[1] : w[3], 2);
  // words of groups (quad_lane & 2) + 0 / 1 from the lanes of bit 1 = 0 (x0, x1) and 1 (x2, x3)
  uint32_t const x0 = hi ? a0 : w[0], x1 = hi ? a1 : w[1];
  uint32_t const x2 = hi ? w[2] : a0, x3 = hi ? w[3] : a1;
  bool const lo = quad_lane & 1;
  uint32_t const b0 = __shfl_xor_sync(0xffffffff, lo ? x0 : x1, 1);
  uint32_t const b1 = __shfl_xor_sync(0xffffffff, lo ? x2 : x3, 1);
  w[0] = lo ? b0 : x0;
  w[1] = lo ? x1 : b0;
  w[2] = lo ? b1 : x2;
  w[3] = lo ? x3 : b1;
}

// A consumer thread's accumulator rows (`out`: the rowcol view of O in Element, `coords`: its
// (row, col) in the tile) to global memory in 16-byte stores, no shared memory: a wgmma
// accumulator gives each lane of a quad two adjacent columns of every 8-column group, so four
// groups transposed across the quad give each lane one whole group. Rows below valid_rows,
// columns below valid_cols (a multiple of 8). Every lane runs the shuffles.
template <class TensorO, class TensorC, class Element>
__device__ __forceinline__ void store_accumulator_rows(TensorO const& out, TensorC const& coords,
                                                       Element* gmem, int64_t row_stride,
                                                       int valid_rows, int valid_cols,
                                                       int quad_lane) {
  constexpr int kGroups = decltype(size<1>(out))::value / 2;  // 8-column groups in a row
  static_assert(kGroups % 4 == 0 && sizeof(Element) == 2);
  CUTE_UNROLL
  for (int r = 0; r < decltype(size<0>(out))::value; ++r) {
    int const row = get<0>(coords(r, 0));
    Element* const g_row = gmem + int64_t(row) * row_stride;
    CUTE_UNROLL
    for (int g0 = 0; g0 < kGroups; g0 += 4) {
      uint32_t w[4];
      CUTE_UNROLL
      for (int i = 0; i < 4; ++i) {
        w[i] = uint32_t(reinterpret_cast<uint16_t const&>(out(r, 2 * (g0 + i)))) |
               uint32_t(reinterpret_cast<uint16_t const&>(out(r, 2 * (g0 + i) + 1))) << 16;
      }
      quad_transpose(w, quad_lane);
      // this lane's group: g0 + quad_lane, whose first column is 8 past the previous group's
      int const col = (get<1>(coords(r, 2 * g0)) & ~7) + 8 * quad_lane;
      if (row < valid_rows && col < valid_cols) {
        *reinterpret_cast<uint4*>(g_row + col) = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }
}

// 64 rows of a staged tile `s` (rows row0.. of it; written by other threads, synchronized) to
// global memory at `gmem` (its rows row_stride elements apart) in 16-byte stores by one
// warpgroup (tid: 0-127): rows below valid_rows, columns below valid_cols (a head dim under
// the kernel's: the columns past it are zeros). Each thread keeps one 16-byte column chunk
// and steps down the rows (the addresses differ by constants, so that no per-chunk offset
// stays live across a tile loop).
template <int kCols, class Element, class TensorS>
__device__ __forceinline__ void store_staged_rows(Element* gmem, int64_t row_stride,
                                                  TensorS const& s, int row0, int valid_rows,
                                                  int valid_cols, int tid) {
  constexpr int kChunksPerRow = kCols / 8;
  static_assert(128 % kChunksPerRow == 0);
  constexpr int kRowStep = 128 / kChunksPerRow;
  int const col = (tid % kChunksPerRow) * 8;
  int const rows = col < valid_cols ? valid_rows : 0;
  CUTE_UNROLL
  for (int row = tid / kChunksPerRow; row < 64; row += kRowStep) {
    if (row < rows) {
      *reinterpret_cast<uint4*>(gmem + int64_t(row) * row_stride + col) =
          *reinterpret_cast<uint4 const*>(&s(row0 + row, col));
    }
  }
}

// A named tile configuration: kBlockM / 64 consumer warpgroups (1, 2 or 3) of 64 rows each;
// the producer is the first warpgroup (only its warp 0 works). Two or three consumers take
// turns at the tensor cores (one's softmax under another's GEMMs); a lone consumer has no
// partner, so its CTA is sized for two on an SM (kCtasPerSm), whose CTAs overlap instead.
// The epilogue stores O from the accumulators straight to global memory (16-byte stores after
// a transpose across each quad, store_accumulator_rows): no staging tile in shared memory
// (measured against one on 2026-12-01, H200: 0.99-1.04x of it at d64 / d128).
template <class Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_>
struct FwdConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kConsumerWarpgroups = kBlockM / 64;
  static constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static_assert(kBlockM % 64 == 0 && kConsumerWarpgroups >= 1 && kConsumerWarpgroups <= 3,
                "the turn-taking ring and the register split are for one to three consumers");
  static constexpr int kCtasPerSm = kConsumerWarpgroups == 1 ? 2 : 1;
  // kBlockN: the N of S = Q K^T (a multiple of 8) and the K of O = P V (of 16); 16 keeps the
  // softmax's four column chains even.
  static_assert(kHeadDim % 64 == 0 && kBlockN % 16 == 0);

  // Register split after setmaxnreg (FlashAttention-3's): 24 for the producer and 240 per
  // consumer thread with two consumers (24 * 128 + 240 * 256 <= 65536), 32 and 160 with three
  // (32 * 128 + 160 * 384 = 65536); with one, two CTAs an SM: 24 and 232 (24 * 128 + 232 * 128
  // = 65536 / 2, the 128 a thread that __launch_bounds__ leaves each CTA).
  static constexpr int kProducerRegs = kConsumerWarpgroups == 3 ? 32 : 24;
  static constexpr int kConsumerRegs =
      kConsumerWarpgroups == 1 ? 232 : kConsumerWarpgroups == 2 ? 240 : 160;

  using TileQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;   // M, N, K of S = Q K^T
  using TilePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;   // M, N, K of O = P V
  using WarpgroupsAlongM = Layout<Shape<Int<kConsumerWarpgroups>, _1, _1>>;

  using MmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileQK>(), WarpgroupsAlongM{}));
  // A = P from registers (K-major), B = V^T read from V's rows (MN-major).
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TilePV, GMMA::Major::K, GMMA::Major::MN>(),
      WarpgroupsAlongM{}));
  // One wgmma spans the whole tile's N (cute_config.h), not a fraction of it issued N times.
  static_assert(size<1>(typename MmaQK::AtomShape_MNK{}) == kBlockN &&
                size<1>(typename MmaPV::AtomShape_MNK{}) == kHeadDim, "wgmma N");

  // Q and K: rows of head_dim, 128-byte swizzle (K-major for the GEMM).
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                             Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V is read as V^T (head_dim x kBlockN) with head_dim contiguous: MN-major.
  using SmemLayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                              Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{},
                                              Step<_2, _1, _3>{}));

  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename Pipeline::PipelineState;
  // The tile ring (TileScheduler): two slots, so that the producer may hand over the next tile
  // while the consumers have yet to take the current one.
  using TilePipeline = cutlass::PipelineAsync<2>;

  struct SharedStorage {
    cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cosize_v<SmemLayoutVt>, 1024> v;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;
    alignas(16) typename Pipeline::SharedStorage pipe_k;
    alignas(16) typename Pipeline::SharedStorage pipe_v;
    alignas(16) typename TilePipeline::SharedStorage pipe_tile;
    int tiles[TilePipeline::Stages];  // the tile ring's slots: tile indices, -1 at the end
  };

  // Global tensors as (seqlen, head_dim, heads, batch) for Q/K and
  // (head_dim, seqlen, heads, batch) for V^T; strides in elements.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideVt = Stride<_1, int64_t, int64_t, int64_t>;

  using TmaQ = decltype(make_tma_copy(
      SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      SmemLayoutQ{}, select<0, 2>(TileQK{}), _1{}));
  using TmaK = decltype(make_tma_copy(
      SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideQKV{}),
      take<0, 2>(SmemLayoutK{}), select<1, 2>(TileQK{}), _1{}));
  using TmaV = decltype(make_tma_copy(
      SM90_TMA_LOAD{},
      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeQKV{}, StrideVt{}),
      take<0, 2>(SmemLayoutVt{}), select<1, 2>(TilePV{}), _1{}));

  struct Params {
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
    // (rows, d, heads, batch) of Q and K, (d, rows, heads, batch) of V^T: rows = seqlen_q /
    // seqlen_k, or for packed (thd) tensors all their tokens with a batch of one (a
    // sequence's tiles start at its first token then).
    ShapeQKV shape_q;
    ShapeQKV shape_k;
    ShapeQKV shape_vt;
    int heads_per_kv;
    TileScheduler scheduler;
    FwdParams args;  // the call: lengths and mask (common/sequence.cuh), O, LSE, scales
  };
};

// Rows of sequence `si`'s head `head` in a (rows, d, heads, batch) TMA tensor (kRowMode = 0)
// or a (d, rows, heads, batch) one (kRowMode = 1): packed tensors from the sequence's first
// token (a tile may reach into the next sequence's rows; the kernels mask those as rows past
// the sequence), padded ones from row 0 of its batch.
template <int kRowMode, class TensorT>
__device__ __forceinline__ auto sequence_rows(TensorT const& m, bool packed, int start, int head,
                                              int batch) {
  auto rows = m(_, _, head, packed ? 0 : batch);
  int const first = packed ? start : 0;
  if constexpr (kRowMode == 0) {
    return domain_offset(make_coord(first, _0{}), rows);
  } else {
    return domain_offset(make_coord(_0{}, first), rows);
  }
}

// The key blocks [n_min, n_max) of query tile m_block (empty where n_max <= n_min: no key,
// or no query row of the sequence in the tile).
template <int kBlockM, int kBlockN>
__device__ __forceinline__ void tile_key_blocks(SeqInfo const& si, Band const& band, int m_block,
                                                int& n_min, int& n_max) {
  int const m0 = m_block * kBlockM;
  KeyRange const keys = band_keys(band, m0, m0 + kBlockM - 1);
  n_min = keys.lo / kBlockN;
  n_max = m0 < si.len_q && keys.hi > 0 ? ceil_div(keys.hi, kBlockN) : 0;
}

// Named barrier ids (5-13); 0 is __syncthreads.
enum : uint32_t {
  kBarVTail = 5,          // consumers zeroed a varlen sequence's V rows past its keys
  kBarQueryEmpty = 6,     // consumers done with Q -> producer may load the next
  kBarSchedulerWG0 = 8,   // 8 + w: consumer warpgroup w's turn to issue GEMMs (w < 3)
  kBarEpilogueWG0 = 11,   // 11 + w: consumer warpgroup w's epilogue (the backward's)
};

__device__ __forceinline__ void named_barrier_sync(uint32_t threads, uint32_t id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(uint32_t threads, uint32_t id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x + __shfl_xor_sync(0xffffffff, x, 1);
}

// wgmma accumulator layout ((2, 2, N/8), MMA_M, MMA_N) viewed as
// (rows = (2, MMA_M), cols = (2, N/8, MMA_N)).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout l) {
  static_assert(decltype(rank<0>(l))::value == 3);
  return make_layout(make_layout(layout<0, 1>(l), layout<1>(l)),
                     make_layout(layout<0, 0>(l), layout<0, 2>(l), layout<2>(l)));
}

// The same accumulator registers as the A operand of a 16-bit register-A
// wgmma: ((2, 2, 2), MMA_M, (N/16, MMA_N)). Two column groups of 8 form one
// k-slice of 16.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_operand_a(Layout l) {
  static_assert(decltype(size<0, 0>(l))::value == 2 && decltype(size<0, 1>(l))::value == 2);
  constexpr int kGroups = decltype(size<0, 2>(l))::value;
  static_assert(kGroups % 2 == 0);
  auto group_stride = stride<0, 2>(l);
  auto k_mode = make_layout(make_shape(Int<kGroups / 2>{}, shape<2>(l)),
                            make_stride(group_stride * _2{}, stride<2>(l)));
  return make_layout(make_layout(layout<0, 0>(l), layout<0, 1>(l), make_layout(_2{}, group_stride)),
                     layout<1>(l), k_mode);
}

// Issue one warpgroup GEMM (all k-slices) and commit it; the caller waits.
template <bool kZeroInit, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wg_gemm(Mma& mma, TA const& a, TB const& b, TC& c) {
  constexpr bool kARegs = !is_same_v<typename TA::iterator, GMMA::DescriptorIterator>;
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TA&>(a)); }
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kARegs) { warpgroup_fence_operand(const_cast<TA&>(a)); }
}

template <class Element, class TSrc, class TDst>
__device__ __forceinline__ void convert_fragment(TSrc const& src, TDst& dst) {
  constexpr int kN = decltype(size(src))::value;
  static_assert(kN == decltype(size(dst))::value);
  cutlass::NumericArrayConverter<Element, float, kN> convert;
  auto out = convert(*reinterpret_cast<cutlass::Array<float, kN> const*>(raw_pointer_cast(src.data())));
  *reinterpret_cast<cutlass::Array<Element, kN>*>(raw_pointer_cast(dst.data())) = out;
}

// Online softmax over the rows this thread holds (2 per consumer thread).
template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];
  float scale_log2;

  // Returns the factor by which O must be scaled (exp2 of the max's change)
  // and turns the scores into unnormalized probabilities in place.
  template <bool kFirst, bool kCheckInf, class TS>
  __device__ __forceinline__ void step(TS& s, float (&o_scale)[kRows]) {
    // Four partial maxima and sums per row: short dependency chains (this runs
    // on the critical path that the other warpgroup's GEMMs must cover).
    constexpr int kCols = decltype(size<1>(s))::value;
    constexpr int kParts = 4;
    static_assert(kCols % kParts == 0);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float part[kParts];
      CUTE_UNROLL
      for (int j = 0; j < kParts; ++j) { part[j] = s(r, j); }
      CUTE_UNROLL
      for (int c = kParts; c < kCols; c += kParts) {
        CUTE_UNROLL
        for (int j = 0; j < kParts; ++j) { part[j] = fmaxf(part[j], s(r, c + j)); }
      }
      float m = quad_max(fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3])));
      float new_max = kFirst ? m : fmaxf(row_max[r], m);
      // A row with no key so far has max -inf: exponentiate against 0 then.
      float max_scaled = (kCheckInf && new_max == -INFINITY) ? 0.f : new_max * scale_log2;
      o_scale[r] = kFirst ? 1.f : fast_exp2(row_max[r] * scale_log2 - max_scaled);
      row_max[r] = new_max;
      CUTE_UNROLL
      for (int j = 0; j < kParts; ++j) { part[j] = 0.f; }
      CUTE_UNROLL
      for (int c = 0; c < kCols; c += kParts) {
        CUTE_UNROLL
        for (int j = 0; j < kParts; ++j) {
          s(r, c + j) = fast_exp2(s(r, c + j) * scale_log2 - max_scaled);
          part[j] += s(r, c + j);
        }
      }
      float const sum = (part[0] + part[1]) + (part[2] + part[3]);
      // Sums stay per thread until the end; the quad shares one max.
      row_sum[r] = kFirst ? sum : row_sum[r] * o_scale[r] + sum;
    }
  }

  // 1 / row sum for O, and the natural-log LSE (+inf for a row with no key,
  // so that a backward pass gets exp(s - lse) = 0).
  __device__ __forceinline__ void finalize(float softmax_scale, float (&o_scale)[kRows],
                                           float (&lse)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float sum = quad_sum(row_sum[r]);
      bool empty = sum == 0.f || sum != sum;
      o_scale[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? INFINITY : row_max[r] * softmax_scale + logf(sum);
    }
  }
};

template <class TS, int kRows>
__device__ __forceinline__ void scale_rows(TS& t, float const (&scale)[kRows]) {
  CUTE_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(t); ++c) { t(r, c) *= scale[r]; }
  }
}

// The mask, as compile-time cases: kCausal, a right bound alone (window_right >= 0,
// window_left < 0; causal is window_right = 0); kLocal, a left bound (window_left >= 0) with or
// without a right one; neither: only the keys' end. Each query tile's key blocks come from the
// band (common/sequence.cuh), and only the blocks that the band cuts are masked.
template <class Cfg, bool kCausal, bool kLocal>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kCtasPerSm)
fwd_kernel(__grid_constant__ const typename Cfg::Params params) {
  using Element = typename Cfg::Element;
  using Pipeline = typename Cfg::Pipeline;
  using PipelineState = typename Cfg::PipelineState;
  constexpr int kBlockM = Cfg::kBlockM;
  constexpr int kBlockN = Cfg::kBlockN;
  constexpr int kHeadDim = Cfg::kHeadDim;
  static_assert(!(kCausal && kLocal), "kLocal covers a right bound too");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& shared = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);

  int const warp_idx = cutlass::canonical_warp_idx_sync();
  int const warpgroup_idx = cutlass::canonical_warp_group_idx();
  TileScheduler const& scheduler = params.scheduler;
  FwdParams const& args = params.args;
  // Lengths need not be tile multiples: TMA zero-fills rows past the tensors, key columns past
  // a sequence's length are masked, and query rows past it are not stored (padding rows of a
  // padded layout get O = 0 and LSE = +inf). A tile with no key block (an empty sequence, or
  // rows that the band leaves no key) loads nothing: its consumers write those values.

  if (warp_idx == 0 && threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    shared.barrier_q.init(1);
  }

  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Cfg::kBytesKV;
  pipe_params.role = warpgroup_idx == 0 ? Pipeline::ThreadCategory::Producer
                                        : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Cfg::kConsumerThreads;
  Pipeline pipe_k(shared.pipe_k, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipe_v(shared.pipe_v, pipe_params, Shape<_1, _1, _1>{});
  using TilePipeline = typename Cfg::TilePipeline;
  typename TilePipeline::Params tile_params;
  tile_params.role = warpgroup_idx == 0 ? TilePipeline::ThreadCategory::Producer
                                        : TilePipeline::ThreadCategory::Consumer;
  tile_params.producer_arv_count = 1;  // the producer's first thread
  tile_params.consumer_arv_count = Cfg::kConsumerThreads;
  TilePipeline pipe_tile(shared.pipe_tile, tile_params);
  __syncthreads();  // barrier inits visible to all before any use

  Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Cfg::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Cfg::SmemLayoutVt{});

  // The tile ring's slot accesses sit between its mbarrier operations, whose asm has no memory
  // clobber: this keeps the compiler from moving them across.
  auto compiler_fence = [] { asm volatile("" ::: "memory"); };

  // Q loads and their hand-backs: the consumers free Q after every tile that loaded one, and the
  // producer waits for that before every Q load but its first, and once at the end (so that the
  // named barrier's arrivals and waits stay matched whatever tiles are empty: both sides walk
  // the same tiles, handed over through the tile ring).
  if (warpgroup_idx == 0) {
    // ---------------- producer: warp 0; its first thread issues every TMA load ----------------
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (warp_idx != 0) { return; }
    bool const leader = threadIdx.x == 0;
    Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q);
    Tensor mK = params.tma_k.get_tma_tensor(params.shape_k);
    Tensor mVt = params.tma_v.get_tma_tensor(params.shape_vt);
    PipelineState write_k = cutlass::make_producer_start_state<Pipeline>();
    PipelineState write_v = cutlass::make_producer_start_state<Pipeline>();
    auto write_tile = cutlass::make_producer_start_state<TilePipeline>();
    int q_loads = 0;
    // The whole warp walks the tiles (the named barrier below counts it); the first thread
    // claims each next tile, and the warp takes it from that thread at the top of the loop.
    int claimed = scheduler.tile_of_round(0);
    for (int round = 0;; ++round) {
      int const tile = __shfl_sync(0xffffffff, claimed, 0);
      pipe_tile.producer_acquire(write_tile);
      if (leader) {
        compiler_fence();
        shared.tiles[write_tile.index()] = tile;
        compiler_fence();
        pipe_tile.producer_commit(write_tile);  // (mbarrier.arrive releases the store)
      }
      ++write_tile;
      if (tile < 0) { break; }
      int m_block, head, batch;
      scheduler.template decode<kCausal>(tile, m_block, head, batch);
      SeqInfo const si = seq_info(args, batch);
      int n_min, n_max;
      tile_key_blocks<kBlockM, kBlockN>(si, band_of(args, si), m_block, n_min, n_max);
      if (n_max <= n_min) {
        if (leader) { claimed = scheduler.next_tile(round); }
        continue;
      }
      int const head_kv = head / params.heads_per_kv;
      Tensor gQ = local_tile(sequence_rows<0>(mQ, si.q_packed, si.start_q, head, batch),
                             select<0, 2>(typename Cfg::TileQK{}), make_coord(m_block, _0{}));  // (M, D)
      Tensor gK = local_tile(sequence_rows<0>(mK, si.k_packed, si.start_k, head_kv, batch),
                             select<1, 2>(typename Cfg::TileQK{}), make_coord(_, _0{}));  // (N, D, n)
      Tensor gVt = local_tile(sequence_rows<1>(mVt, si.k_packed, si.start_k, head_kv, batch),
                              select<1, 2>(typename Cfg::TilePV{}), make_coord(_0{}, _));  // (D, N, n)
      auto q_parts = tma_partition(params.tma_q, _0{}, Layout<_1>{},
                                   group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto k_parts = tma_partition(params.tma_k, _0{}, Layout<_1>{},
                                   group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts = tma_partition(params.tma_v, _0{}, Layout<_1>{},
                                   group_modes<0, 2>(sVt), group_modes<0, 2>(gVt));
      auto load_k = [&](int n_block) {
        pipe_k.producer_acquire(write_k);
        copy(params.tma_k.with(*pipe_k.producer_get_barrier(write_k)), get<0>(k_parts)(_, n_block),
             get<1>(k_parts)(_, write_k.index()));
        ++write_k;
      };
      auto load_v = [&](int n_block) {
        pipe_v.producer_acquire(write_v);
        copy(params.tma_v.with(*pipe_v.producer_get_barrier(write_v)), get<0>(v_parts)(_, n_block),
             get<1>(v_parts)(_, write_v.index()));
        ++write_v;
      };
      int n_block = n_max - 1;
      // The first K block may go before the consumers free Q; K runs one
      // block ahead of V since consumers need K(n - 1) before V(n).
      if (leader) { load_k(n_block); }
      if (q_loads++ > 0) { named_barrier_sync(Cfg::kConsumerThreads + 32, kBarQueryEmpty); }
      if (leader) {
        shared.barrier_q.arrive_and_expect_tx(Cfg::kBytesQ);
        copy(params.tma_q.with(reinterpret_cast<uint64_t&>(shared.barrier_q)), get<0>(q_parts),
             get<1>(q_parts));
        for (; n_block > n_min; --n_block) {
          load_k(n_block - 1);
          load_v(n_block);
        }
        // The next tile is claimed here, when the consumers are a few key blocks from this
        // tile's end (dynamic: a CTA holds no tile long while others may be free), and the
        // atomic's latency hides under the wait for the last V stage.
        claimed = scheduler.next_tile(round);
        load_v(n_min);
      }
      __syncwarp();
    }
    if (q_loads > 0) { named_barrier_sync(Cfg::kConsumerThreads + 32, kBarQueryEmpty); }
    if (leader) {
      pipe_k.producer_tail(write_k);
      pipe_v.producer_tail(write_v);
    }
    return;
  }

  // ---------------- consumers: kConsumerWarpgroups warpgroups, 64 query rows each ----------------
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  int const tidx = threadIdx.x - 128;
  int const consumer_wg = tidx / 128;

  typename Cfg::MmaQK mma_qk;
  typename Cfg::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tidx);
  auto thr_pv = mma_pv.get_thread_slice(tidx);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);     // smem descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);
  Tensor tOrO = partition_fragment_C(mma_pv, select<0, 1>(typename Cfg::TilePV{}));
  Tensor tOrO_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));

  using FragS = decltype(partition_fragment_C(mma_qk, select<0, 1>(typename Cfg::TileQK{})));
  using LayoutP = decltype(acc_as_operand_a(FragS{}.layout()));
  Tensor tOrP = make_tensor<Element>(LayoutP{});
  constexpr int kRows = decltype(size<0>(acc_rowcol(FragS{}.layout())))::value;

  OnlineSoftmax<kRows> softmax;
  softmax.scale_log2 = args.scale_softmax_log2;
  float o_scale[kRows];

  Tensor cS = make_identity_tensor(select<0, 1>(typename Cfg::TileQK{}));
  Tensor tScS = thr_qk.partition_C(cS);
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor cO = make_identity_tensor(select<0, 1>(typename Cfg::TilePV{}));
  Tensor tOcO = thr_pv.partition_C(cO);
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));

  // Turns in a ring (ping-pong with two): a warpgroup waits for its turn before issuing GEMMs
  // and hands the turn to the next after. Every warpgroup takes one turn per key block after
  // the first, the same count for all (they share the tile), so the ring never skips one.
  // Each turn barrier counts the waiting warpgroup and the one handing over: 2 * 128 threads.
  // Warpgroup 0 gives itself the first turn. A lone consumer has no turns to take.
  constexpr bool kTurns = Cfg::kConsumerWarpgroups > 1;
  auto scheduler_sync = [&] {
    if constexpr (kTurns) { named_barrier_sync(2 * 128, kBarSchedulerWG0 + consumer_wg); }
  };
  auto scheduler_hand_over = [&] {
    if constexpr (kTurns) {
      int const next = consumer_wg + 1 == Cfg::kConsumerWarpgroups ? 0 : consumer_wg + 1;
      named_barrier_arrive(2 * 128, kBarSchedulerWG0 + next);
    }
  };
  if (kTurns && consumer_wg == 0) { named_barrier_arrive(2 * 128, kBarSchedulerWG0); }

  PipelineState read_k;   // consumer state starts at stage 0, phase 0
  int q_loads = 0;
  // Tiles taken from the ring: one counter across the key loop (a PipelineState's stage and
  // phase took one register more, and the three-consumer tiles spilled it).
  for (int taken = 0;; ++taken) {
    typename TilePipeline::PipelineState const slot(taken % TilePipeline::Stages,
                                                    (taken / TilePipeline::Stages) % 2, taken);
    pipe_tile.consumer_wait(slot);
    compiler_fence();
    int const tile = shared.tiles[slot.index()];
    compiler_fence();
    pipe_tile.consumer_release(slot);
    if (tile < 0) { break; }
    int m_block, head, batch;
    scheduler.template decode<kCausal>(tile, m_block, head, batch);
    SeqInfo const si = seq_info(args, batch);
    Band const band = band_of(args, si);
    int const m0 = m_block * kBlockM;
    if (m0 >= si.rows_q) { continue; }  // past this (packed) sequence: no row to write
    int n_min, n_max;
    tile_key_blocks<kBlockM, kBlockN>(si, band, m_block, n_min, n_max);

    float lse[kRows];
    if (n_max > n_min) {
      // Mask of one S tile: key columns past the sequence's keys, and those outside the query
      // row's band, are out.
      auto apply_mask = [&](auto& tSrS, int n_block) {
        Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
        int const n0 = n_block * kBlockN;
        int const key_limit = si.len_k - 1 - n0;  // last key, local
        int const diag = m0 + band.off - n0;      // local column of row r's diagonal - r
        CUTE_UNROLL
        for (int r = 0; r < size<0>(s); ++r) {
          int const row = get<0>(tScS_rc(r, 0));
          int col_hi = key_limit;                 // last allowed local column
          if constexpr (kCausal) { col_hi = min(col_hi, row + diag + band.right); }
          if constexpr (kLocal) {
            if (band.right >= 0) { col_hi = min(col_hi, row + diag + band.right); }
          }
          int const col_lo = kLocal ? row + diag - band.left : 0;  // first allowed
          CUTE_UNROLL
          for (int c = 0; c < size<1>(s); ++c) {
            int const col = get<1>(tScS_rc(r, c));
            if (col > col_hi || (kLocal && col < col_lo)) { s(r, c) = -INFINITY; }
          }
        }
      };

      shared.barrier_q.wait(q_loads % 2);
      int n_block = n_max - 1;
      {
        Tensor tSrS = partition_fragment_C(mma_qk, select<0, 1>(typename Cfg::TileQK{}));
        pipe_k.consumer_wait(read_k);
        wg_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        warpgroup_wait<0>();
        pipe_k.consumer_release(read_k);
        // The first block is the only one that can hold the key tail.
        int const n0 = n_block * kBlockN;
        if (band_cuts(band, m0, m0 + kBlockM - 1, n0, n0 + kBlockN - 1)) {
          apply_mask(tSrS, n_block);
        }
        Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
        // (a mask may leave a row no key in this block: its max is -inf then)
        softmax.template step<true, kCausal || kLocal>(s, o_scale);
        convert_fragment<Element>(tSrS, tOrP);
      }
      // Varlen: V rows past the sequence's keys hold the next sequence's tokens or padding,
      // which need not be finite, and P = 0 does not cancel NaN or inf in P V: zero them (in
      // the first block only; TMA zero-fills rows past a dense tensor).
      if (args.cu_seqlens_k != nullptr && n_max * kBlockN > si.len_k) {
        int const first_row = si.len_k - n_block * kBlockN;
        constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks, whole in the swizzle
        pipe_v.consumer_wait(read_k);
        for (int i = tidx; i < (kBlockN - first_row) * kChunksPerRow; i += Cfg::kConsumerThreads) {
          *reinterpret_cast<uint4*>(&sVt((i % kChunksPerRow) * 8, first_row + i / kChunksPerRow,
                                         read_k.index())) = make_uint4(0, 0, 0, 0);
        }
        cutlass::arch::fence_view_async_shared();  // generic-proxy writes -> wgmma reads
        named_barrier_sync(Cfg::kConsumerThreads, kBarVTail);
      }
      clear(tOrO);

      // Each step: S(n) = Q K(n)^T and O += P(n + 1) V(n + 1) in flight together,
      // then softmax of S(n) while the PV GEMM finishes.
      auto step = [&](int n_block, auto masked) {
        constexpr bool kMasked = decltype(masked)::value;
        PipelineState read_v = read_k;
        ++read_k;
        Tensor tSrS = partition_fragment_C(mma_qk, select<0, 1>(typename Cfg::TileQK{}));
        pipe_k.consumer_wait(read_k);
        scheduler_sync();
        wg_gemm<true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
        pipe_v.consumer_wait(read_v);
        wg_gemm<false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
        scheduler_hand_over();
        warpgroup_wait<1>();
        pipe_k.consumer_release(read_k);
        if constexpr (kMasked) { apply_mask(tSrS, n_block); }
        Tensor s = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
        softmax.template step<false, kMasked>(s, o_scale);
        warpgroup_wait<0>();
        pipe_v.consumer_release(read_v);
        convert_fragment<Element>(tSrS, tOrP);
        scale_rows(tOrO_rc, o_scale);
      };
      // A step of a warpgroup whose 64 rows (WarpgroupsAlongM) hold no query of the sequence
      // (the last tile of a sequence that ends inside it: s = 2k and 4k end 128 and 64 rows
      // into d64's 192-row tiles; ragged varlen tails): no GEMM and no softmax, only its
      // place in the pipelines and the turns, so that the others run the tile alone. Its rows
      // get O = 0 and LSE = +inf from the epilogue's select. Three-warpgroup tiles only: in
      // the two-warpgroup ones (d128, d256) this loop raised ptxas's spills from 8-88 to
      // 20-136 bytes (nvcc 13.0), for ragged tails alone.
      auto idle_step = [&] {
        PipelineState read_v = read_k;
        ++read_k;
        pipe_k.consumer_wait(read_k);
        scheduler_sync();
        pipe_v.consumer_wait(read_v);
        scheduler_hand_over();
        pipe_k.consumer_release(read_k);
        pipe_v.consumer_release(read_v);
      };
      --n_block;
      bool const idle = Cfg::kConsumerWarpgroups > 2 && m0 + consumer_wg * 64 >= si.len_q;
      if (idle) {
        for (; n_block >= n_min; --n_block) { idle_step(); }
      }
      // Blocks from n_right_cut on hold keys right of the first row's band; those before
      // n_left_cut keys left of the last row's.
      if constexpr (kCausal || kLocal) {
        int const n_right_cut =
            band.right >= 0 ? max(m0 + band.off + band.right + 1, 0) / kBlockN : n_max;
        for (; n_block >= n_min && n_block >= n_right_cut; --n_block) { step(n_block, true_type{}); }
      }
      if constexpr (kLocal) {
        int const left_end = m0 + kBlockM - 1 + band.off - band.left;
        int const n_left_cut = left_end > 0 ? ceil_div(left_end, kBlockN) : 0;
        for (; n_block >= n_min && n_block >= n_left_cut; --n_block) { step(n_block, false_type{}); }
        for (; n_block >= n_min; --n_block) { step(n_block, true_type{}); }
      } else {
        for (; n_block >= n_min; --n_block) { step(n_block, false_type{}); }
      }

      // Every QK^T of this tile is done: the producer may load the next Q.
      named_barrier_arrive(Cfg::kConsumerThreads + 32, kBarQueryEmpty);
      ++q_loads;

      // Last PV, then normalize.
      pipe_v.consumer_wait(read_k);
      wg_gemm<false>(mma_pv, tOrP, tOrV(_, _, _, read_k.index()), tOrO);
      softmax.finalize(args.scale_softmax, o_scale, lse);
      warpgroup_wait<0>();
      pipe_v.consumer_release(read_k);
      ++read_k;
    } else {
      clear(tOrO);
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        o_scale[r] = 0.f;
        lse[r] = INFINITY;
      }
    }

    // ---------------- epilogue ----------------
    // Rows past the sequence's queries (a padded layout's padding, which the tile read as
    // queries) get O = 0 and LSE = +inf, as from the sm80 family; a select, not a scale, so
    // that padding that is not finite leaves no NaN.
    int const valid_rows = si.len_q - m0;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      bool const keep = get<0>(tOcO_rc(r, 0)) < valid_rows;
      if (!keep) { lse[r] = INFINITY; }
      CUTE_UNROLL
      for (int c = 0; c < size<1>(tOrO_rc); ++c) {
        tOrO_rc(r, c) = keep ? tOrO_rc(r, c) * o_scale[r] : 0.f;
      }
    }

    // LSE: the first thread of each quad owns its two rows (rows the sequence does not own:
    // none).
    int const rows_in_tile = si.rows_q - m0;
    if (args.lse != nullptr && tidx % 4 == 0) {
      float* lse_out = args.lse + si.q_off(args.lse_batch_stride, args.lse_row_stride) +
                       int64_t(head) * args.lse_head_stride + int64_t(m0) * args.lse_row_stride;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        int const row = get<0>(tOcO_rc(r, 0));
        if (row < rows_in_tile) { lse_out[row * args.lse_row_stride] = lse[r]; }
      }
    }

    Tensor tOrO_out = make_tensor<Element>(tOrO.layout());
    convert_fragment<Element>(tOrO, tOrO_out);
    Element* o_tile = static_cast<Element*>(args.o) +
                      si.q_off(args.o_batch_stride, args.o_row_stride) +
                      int64_t(head) * args.o_head_stride + int64_t(m0) * args.o_row_stride;
    // Rows the sequence owns, columns below d; nothing in shared memory, so no barrier.
    store_accumulator_rows(make_tensor(tOrO_out.data(), acc_rowcol(tOrO_out.layout())),
                           tOcO_rc, o_tile, args.o_row_stride, rows_in_tile, args.d, tidx % 4);
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
