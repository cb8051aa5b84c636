// Launch template of the sm90 family's forward: FwdParams -> TMA descriptors, the tile order
// and the grid. The binding runs it only for calls that fwd_declines (fwd_support.h) accepts.
#pragma once

#include "flash/sm90/cute_config.h"  // first: before any CuTe header

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cutlass/numeric_types.h>

#include "flash/common/launch.cuh"
#include "flash/flash.h"
#include "flash/sm90/fwd_kernel.cuh"
#include "flash/sm90/fwd_support.h"

namespace transformer_fa {
namespace flash {
namespace sm90 {

// CUDA's 16-bit types (the generated instantiations' names) -> CuTe's.
template <class T> struct CuteElement;
template <> struct CuteElement<__half> { using type = cutlass::half_t; };
template <> struct CuteElement<__nv_bfloat16> { using type = cutlass::bfloat16_t; };

// The kernel's mask cases (fwd_kernel's kCausal / kLocal): none, a right bound alone (causal
// is right = 0), a left bound (with or without a right one).
enum class FwdMask { kNone, kRight, kLocal };

// Tile configs per head dim and mask case. d128: 128 x 128 tiles (two consumer warpgroups of
// 64 query rows), two K/V stages; unmasked 128 x 176 (FlashAttention-3's tile: fewer softmax
// rounds per GEMM FLOP), whose Q, K and V take 208 KB. (Every config stores O from registers:
// FwdConfig.)
// (A 128 x 160 try on 2026-11-24 ran 5-15% slower, but its S = Q K^T was issued as five
// 64x32x16 wgmmas per k-slice: CuTe's extended shapes were off, cute_config.h.)
template <class Element, int kHeadDim, FwdMask kMask> struct FwdTile {
  using Config = FwdConfig<Element, kHeadDim, 128, 128, 2>;
};
template <class Element> struct FwdTile<Element, 128, FwdMask::kNone> {
  using Config = FwdConfig<Element, 128, 128, 176, 2>;
};
// d64: 192 x 128 tiles (FlashAttention-3's d64 causal tile; its non-causal 192 x 192 needs P in
// shared memory): three consumer warpgroups, so that two warpgroups' GEMMs cover each one's
// softmax, which at d64 takes as long as its two GEMMs. With a left window bound the mask's
// values do not fit three warpgroups' 160 registers (ptxas: 164 B of spills, reloads in the
// key loop), so windows take 128 x 128 (two warpgroups, 240 registers each).
template <class Element, FwdMask kMask> struct FwdTile<Element, 64, kMask> {
  using Config = FwdConfig<Element, 64, 192, 128, 2>;
};
template <class Element> struct FwdTile<Element, 64, FwdMask::kLocal> {
  using Config = FwdConfig<Element, 64, 128, 128, 2>;
};
// d256: 128 x 80 tiles (FlashAttention-3's choice): Q, two stages of K and V take 224 KB.
// Windows: 128 x 64 (FlashAttention-3's local tile: a smaller S beside the mask's values).
template <class Element, FwdMask kMask> struct FwdTile<Element, 256, kMask> {
  using Config = FwdConfig<Element, 256, 128, 80, 2>;
};
template <class Element> struct FwdTile<Element, 256, FwdMask::kLocal> {
  using Config = FwdConfig<Element, 256, 128, 64, 2>;
};

// Tiles for short rows, where a tile's few key blocks leave its prologue (Q and the first K)
// and epilogue (O) exposed, or where a tile's last query or key block is mostly empty: d128
// unmasked on 128 x 128 (re-measured on 2026-12-01 with both tiles persistent: ahead up to
// 1k, within 2% from 2k to 8k); d64 causal on 64 x 128 (below); d256 on 128 x 64 (s = 512 in
// 8 key blocks, not 7 of 80 with the last 48 keys empty; causal: less of the diagonal
// masked). Other cases keep their tile (FwdShortTile = FwdTile). Tried and not kept (H200,
// bf16, batch * s = 16k, forward TFLOPS, short tile / the other): d64 unmasked on 128 x 128
// ran 0.87-0.94x its 192 x 128 at every length (2026-11-28), and on the one-consumer 64 x 128
// below 336 / 343 at s = 512, 378 / 387 at 1k (2026-12-01); d128 causal on a one-consumer
// 64 x 64 (two CTAs an SM) 284 / 313 at 512, 375 / 422 at 1k, behind at every length
// (2026-12-01).
template <class Element, int kHeadDim, FwdMask kMask> struct FwdShortTile
    : FwdTile<Element, kHeadDim, kMask> {};
template <class Element> struct FwdShortTile<Element, 128, FwdMask::kNone> {
  using Config = FwdConfig<Element, 128, 128, 128, 2>;
};
// d64 causal: 64 x 128 (cuDNN's tile there: 64 x 128 x 64, four warps), one consumer
// warpgroup, two CTAs an SM (81 KB of shared memory each): a 192-row tile leaves a third of
// the last query block empty at s = 512 and 1k, and its three warpgroups wait on each other.
// Measured (H200, 2026-12-01, TFLOPS 64 x 128 / 192 x 128): 214 / 194 at s = 512, 300 / 262 at
// 1k, 360 / 367 at 2k.
template <class Element> struct FwdShortTile<Element, 64, FwdMask::kRight> {
  using Config = FwdConfig<Element, 64, 64, 128, 2>;
};
template <class Element, FwdMask kMask> struct FwdShortTile<Element, 256, kMask> {
  using Config = FwdConfig<Element, 256, 128, 64, 2>;
};

// The longest rows that take the short-row tile: keys of an unmasked call, queries of a causal
// one (the padded or longest length of the call). Measured side by side (H200, bf16,
// batch * s = 16k, 2026-11-28, TFLOPS short / other tile): d128 unmasked 479 / 357 at
// s = 512, 585 / 481 at 1k, 633 / 570 at 2k, 638 / 616 at 4k, 654 / 648 at 8k, 16k about even
// (645-668 on 128 x 176); d64 causal 204 / 187 at 512, 237 / 227 at 1k, then 315 / 343 at 2k
// and behind from there. d256 re-measured on 2026-12-01 (H200), after O was stored from
// registers and 128 x 80 ran the persistent grid: unmasked 490-492 / 488-493 at s = 512,
// 558-563 / 553-580 at 1k, 579-603 / 594-630 at 2k; causal 314-318 / 309 at 512, 424-425 /
// 427-435 at 1k, 491-498 / 500-518 at 2k (cuDNN 518 / 593 / 638 and 339 / 446 / 523). So
// 128 x 64 only up to 512 (before: unmasked 1k, causal 2k). d128 and d64 re-measured the same
// day: the limits below still pick the faster tile (d128 unmasked 2k-8k within 2%).
inline int short_rows_limit(int head_dim, bool causal) {
  switch (head_dim) {
    case 64: return causal ? 1024 : 0;
    case 128: return causal ? 0 : 8192;
    default: return 512;
  }
}
// Whether the call takes the short-row tile; TRANSFORMER_FA_SM90_SHORT_TILES=0 / 1 (tests and
// benchmarks) sets it never / always.
inline bool short_rows(int head_dim, bool causal, const FwdParams& p) {
  const char* forced = std::getenv("TRANSFORMER_FA_SM90_SHORT_TILES");
  if (forced != nullptr && (forced[0] == '0' || forced[0] == '1') && forced[1] == '\0')
    return forced[0] == '1';
  return (causal ? p.seqlen_q : p.seqlen_k) <= short_rows_limit(head_dim, causal);
}

// How the CTAs get their tiles (TileScheduler, fwd_kernel.cuh): one CTA per tile, a persistent
// grid (one CTA per SM at most) in the static snake order, or a persistent grid whose CTAs
// claim the next tile from a counter as they free up (dynamic); "one CTA per SM" is kCtasPerSm
// CTAs an SM for the configs sized for two. Unmasked rows take the static
// order (the persistent grid won over one CTA per tile on the H100 at short rows and tied at
// long ones). Causal rows take the dynamic one: their tiles differ in length, which the static
// order balances badly and one CTA per tile pays for with a launch per tile. Measured (H200,
// bf16, batch * s = 16k, 2026-11-28; forward TFLOPS, dynamic vs the old default of static up to
// 512 (1k at d128) and one CTA per tile above): d64 causal 1k 287 vs 231, 2k 375 vs 335, 4k 428
// vs 404; d128 causal 2k 521 vs 466, 4k 567 vs 532; even at d256 and on unmasked rows.
// TRANSFORMER_FA_SM90_SCHEDULER=grid / static / dynamic forces one (tests and benchmarks;
// anything else: the default). Until 2026-12-01 the d256 configs and d128's 128 x 176 staged
// O in Q's buffer and ran one CTA per tile (the next Q could load only after the epilogue: a
// persistent grid ran 0.94-1.01x); with O stored from registers (H200, d256, s = 512 forward
// TFLOPS, 4-byte stores then): persistent 427 vs one CTA per tile 385 unmasked, 263 vs 234
// causal.
enum class FwdScheduler { kGrid, kStatic, kDynamic };
inline FwdScheduler fwd_scheduler(bool causal) {
  const char* forced = std::getenv("TRANSFORMER_FA_SM90_SCHEDULER");
  if (forced != nullptr) {
    if (std::strcmp(forced, "grid") == 0) return FwdScheduler::kGrid;
    if (std::strcmp(forced, "static") == 0) return FwdScheduler::kStatic;
    if (std::strcmp(forced, "dynamic") == 0) return FwdScheduler::kDynamic;
  }
  return causal ? FwdScheduler::kDynamic : FwdScheduler::kStatic;
}

// Causal tiles go in groups of heads whose K and V (row_bytes per row each) fit in about half
// of the L2 cache together (24 MB of the H100's 50 MB measured best for this kernel).
// counter: the dynamic order's (zeroed before the launch), or nullptr for the static one.
inline TileScheduler make_scheduler(const FwdParams& p, const Device& device, int block_m,
                                    int row_bytes, int* counter) {
  const int64_t l2_budget = (device.l2_bytes > 0 ? int64_t(device.l2_bytes) : int64_t(48) << 20) / 2;
  const int64_t kv_bytes_per_head = 2 * int64_t(p.seqlen_k) * row_bytes;
  const int heads_batches = p.h * p.b;
  const int per_group = int(std::max<int64_t>(
      1, std::min<int64_t>(heads_batches, l2_budget / kv_bytes_per_head)));
  const int num_m_blocks = (p.seqlen_q + block_m - 1) / block_m;
  // (no tile when num_m_blocks is 0: a divisor of 1 then, as FastDivmod cannot take 0)
  return TileScheduler{num_m_blocks, heads_batches, p.h, per_group, num_m_blocks * heads_batches,
                       counter,
                       cutlass::FastDivmod(std::max(1, num_m_blocks)),
                       cutlass::FastDivmod(std::max(1, p.h)),
                       cutlass::FastDivmod(std::max(1, per_group * num_m_blocks)),
                       cutlass::FastDivmod(per_group)};
}

// A call's tensor as the TMA descriptors see it, (rows, d, heads, batch) (V^T: (d, rows, heads,
// batch)): packed (thd) tensors as all their tokens with a batch of one, so that a sequence's
// tiles start at its first token (the stride of that single batch is unused; TMA wants a
// valid one). The forward's and the backward's launches share it.
struct TmaRows {
  int rows, batches;
  int64_t batch_stride;
};
inline TmaRows tma_rows(bool packed, int64_t tokens, int seqlen, int batch, int64_t row_stride,
                        int64_t batch_stride) {
  return packed ? TmaRows{int(tokens), 1, tokens * row_stride} : TmaRows{seqlen, batch, batch_stride};
}

// kCausal, kLocal: the kernel's mask cases (fwd_kernel).
template <class Cfg, bool kCausal, bool kLocal>
void launch(const FwdParams& a, const Device& device, cudaStream_t stream) {
  using Element = typename Cfg::Element;
  using Params = typename Cfg::Params;
  TmaRows const q = tma_rows(a.q_packed, a.q_tokens, a.seqlen_q, a.b, a.q_row_stride,
                            a.q_batch_stride);
  TmaRows const k = tma_rows(a.k_packed, a.kv_tokens, a.seqlen_k, a.b, a.k_row_stride,
                            a.k_batch_stride);
  TmaRows const v = tma_rows(a.k_packed, a.kv_tokens, a.seqlen_k, a.b, a.v_row_stride,
                            a.v_batch_stride);
  // The head dim a.d (at most the kernel's): TMA zero-fills the tiles' columns past it.
  typename Cfg::ShapeQKV shape_q = make_shape(q.rows, a.d, a.h, q.batches);
  typename Cfg::ShapeQKV shape_k = make_shape(k.rows, a.d, a.h_k, k.batches);
  typename Cfg::ShapeQKV shape_vt = make_shape(a.d, v.rows, a.h_k, v.batches);
  // Without the binding's counter (FwdParams::tile_counter) the dynamic order falls back to
  // the static one.
  FwdScheduler order = fwd_scheduler(kCausal);
  if (order == FwdScheduler::kDynamic && a.tile_counter == nullptr) order = FwdScheduler::kStatic;
  int* const counter = order == FwdScheduler::kDynamic ? a.tile_counter : nullptr;
  auto mQ = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.q)), shape_q,
                        make_stride(a.q_row_stride, _1{}, a.q_head_stride, q.batch_stride));
  auto mK = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.k)), shape_k,
                        make_stride(a.k_row_stride, _1{}, a.k_head_stride, k.batch_stride));
  auto mVt = make_tensor(make_gmem_ptr(static_cast<Element const*>(a.v)), shape_vt,
                         make_stride(_1{}, a.v_row_stride, a.v_head_stride, v.batch_stride));
  Params p{make_tma_copy(SM90_TMA_LOAD{}, mQ, typename Cfg::SmemLayoutQ{},
                         select<0, 2>(typename Cfg::TileQK{}), _1{}),
           make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename Cfg::SmemLayoutK{}),
                         select<1, 2>(typename Cfg::TileQK{}), _1{}),
           make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename Cfg::SmemLayoutVt{}),
                         select<1, 2>(typename Cfg::TilePV{}), _1{}),
           shape_q, shape_k, shape_vt, a.h / a.h_k,
           make_scheduler(a, device, Cfg::kBlockM, Cfg::kHeadDim * int(sizeof(Element)), counter),
           a};

  constexpr auto kernel = fwd_kernel<Cfg, kCausal, kLocal>;
  static_assert(sizeof(typename Cfg::SharedStorage) <= 227 * 1024, "over sm90's shared memory");
  const int smem_bytes = int(sizeof(typename Cfg::SharedStorage));
  allow_dynamic_smem<kernel>(smem_bytes);
  const int num_tiles = p.scheduler.num_tiles;
  if (num_tiles == 0) return;  // thd with every sequence empty (max_seqlen_q = 0)
  // (the counter is this call's own, zeroed on its stream: ordered before the kernel)
  if (counter != nullptr) cudaMemsetAsync(counter, 0, sizeof(int), stream);
  const int grid = order == FwdScheduler::kGrid
                       ? num_tiles
                       : std::min(num_tiles, device.sms * Cfg::kCtasPerSm);
  kernel<<<grid, Cfg::kThreads, smem_bytes, stream>>>(p);
}

// The short-row tile where `use_short` says so and the mask case has one, else the tile.
template <class Tile, class ShortTile, bool kCausal, bool kLocal>
void launch_tile(bool use_short, const FwdParams& params, const Device& device, cudaStream_t stream) {
  if constexpr (!std::is_same_v<typename Tile::Config, typename ShortTile::Config>) {
    if (use_short) return launch<typename ShortTile::Config, kCausal, kLocal>(params, device, stream);
  }
  launch<typename Tile::Config, kCausal, kLocal>(params, device, stream);
}

template <class T, int kHeadDim>
void launch_fwd(const FwdParams& params, const Device& device, cudaStream_t stream) {
  using Element = typename CuteElement<T>::type;
  // A left window bound (with or without a right one), a right bound alone (causal: 0), none.
  if (params.window_left >= 0) {
    using Cfg = typename FwdTile<Element, kHeadDim, FwdMask::kLocal>::Config;
    launch<Cfg, false, true>(params, device, stream);
  } else if (params.window_right >= 0) {
    launch_tile<FwdTile<Element, kHeadDim, FwdMask::kRight>,
                FwdShortTile<Element, kHeadDim, FwdMask::kRight>, true, false>(
        short_rows(kHeadDim, true, params), params, device, stream);
  } else {
    launch_tile<FwdTile<Element, kHeadDim, FwdMask::kNone>,
                FwdShortTile<Element, kHeadDim, FwdMask::kNone>, false, false>(
        short_rows(kHeadDim, false, params), params, device, stream);
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
