// Launch template of the sm80 family's backward: the tile configs per head dim, the plan
// (shared memory, dq_accum workspace, deterministic splits) and the three launches (dsum,
// main, dq conversion).
#pragma once

#include <algorithm>

#include "flash/flash.h"
#include "flash/sm80/bwd_kernel.cuh"

namespace transformer_fa {
namespace flash {
namespace sm80 {

// Tile configs per head dim (BwdTile): BwdConfig<T, d>::Traits for calls with dropout or
// ALiBi, PlainTraits for the others. The dK/dV accumulators live in registers for the whole
// CTA. Measured on H100 (bwd TFLOPS, details in docs/flash_kernel_notes.md):
// - A kernel without dropout / ALiBi for calls that use neither (as the forward's): d64
//   +0.5-4%, d128 -0.3..+3%, d256 +2-4.5% (s 1k-16k, A/B best of 3, 2026-11-24). d192 is not
//   measured and keeps one kernel.
// - Grid order (causal key blocks heavy first across head groups, below): causal d64 +1-4%,
//   d128 +2-4%, non-causal d64 -1%, d128 even (A/B); the d256 backward ran 2-5% slower
//   with it (grid runs before and after), so d192 / d256 keep the launch order (2026-11-24).
// - d64: 64 x 128 tiles with 4 warps, so that two CTAs share an SM (97 KB of shared memory
//   each) and one's softmax overlaps the other's GEMMs: +4-5% over FlashAttention-2's
//   128 x 128 with 8 warps non-causal, +7% causal at s 1k, -1..-2% causal at 16k
//   (2026-11-24). S/dP in two column slices (registers). dQ reduced from registers: the
//   bulk dQ tile (which must take the Q / dO buffers here, for two CTAs per SM) cost a
//   barrier, 16 shared stores and a fence per step; without it +3-4% (A/B, 2026-11-24).
//   At d128 the same change cost 5-8%.
// - d128: 128 key rows beat 64 by 15-20% (half the dQ reductions); slicing S/dP costs 8%
//   (Q/dO fragments loaded twice). Zero-filled chunks loaded from their own addresses (no
//   select): +2-6%; the same costs d64 1-3%, d256 even (2026-11-24).
// - d256: without dQ slices beats two slices by 1-3%; the bulk dQ tile (64 KB) does not fit
//   beside the 208 KB of the rest, so it takes the Q / dO buffers (a third barrier per
//   step): +4-8% over reducing from registers (2026-11-24).
struct Bwd64 : BwdTile {
  static constexpr int kHeadDim = 64, kBlockM = 64, kBlockN = 128, kNWarps = 4;
  static constexpr int kWarpsMS = 4, kWarpsNdKV = 4, kWarpsMdQ = 2, kSSlices = 2;
  static constexpr bool kGridOrder = true;
};
struct Bwd128 : BwdTile {
  static constexpr int kHeadDim = 128, kBlockM = 64, kBlockN = 128, kNWarps = 8;
  static constexpr int kWarpsMS = 2, kWarpsNdKV = 4, kWarpsMdQ = 2;
  static constexpr bool kBulkDq = true, kZfillFromBase = false, kGridOrder = true;
};
struct Bwd192 : BwdTile {
  static constexpr int kHeadDim = 192, kBlockM = 64, kBlockN = 64, kNWarps = 8;
  static constexpr int kWarpsMS = 4, kWarpsNdKV = 2, kWarpsMdQ = 2;
  static constexpr bool kBulkDq = true;
};
struct Bwd256 : BwdTile {
  static constexpr int kHeadDim = 256, kBlockM = 64, kBlockN = 64, kNWarps = 8;
  static constexpr int kWarpsMS = 4, kWarpsNdKV = 2, kWarpsMdQ = 2;
  static constexpr bool kBulkDq = true, kDqInStage = true;
};

template <typename T, int kHeadDim>
struct BwdConfig;
template <typename T> struct BwdConfig<T, 64> {
  using Traits = BwdTraits<T, Bwd64>;
  using PlainTraits = BwdTraits<T, WithExtras<Bwd64, false>>;
};
template <typename T> struct BwdConfig<T, 128> {
  using Traits = BwdTraits<T, Bwd128>;
  using PlainTraits = BwdTraits<T, WithExtras<Bwd128, false>>;
};
template <typename T> struct BwdConfig<T, 192> {
  using Traits = BwdTraits<T, Bwd192>;
  using PlainTraits = Traits;
};
template <typename T> struct BwdConfig<T, 256> {
  using Traits = BwdTraits<T, Bwd256>;
  using PlainTraits = BwdTraits<T, WithExtras<Bwd256, false>>;
};

// The backward's sm_90a code (its bulk dQ path, sm90/bulk_copy.cuh) runs on sm90 GPUs only;
// there the main kernel gets the shared memory of that path. The kernel takes the bulk path
// where its code is sm_90a (compile time); they agree whenever the sm_90a code can run
// (sm_80 code on a Hopper GPU just gets unused shared memory).
inline bool runs_sm90a(const Device& device) { return device.arch / 10 == 9; }

// Shared memory, deterministic splits and the dq_accum layout (flash.h, BwdParams).
template <typename T, int kHeadDim>
BwdPlan plan_bwd(BwdParams& p, const Device& device) {
  using Config = BwdConfig<T, kHeadDim>;
  static_assert(Config::PlainTraits::smem_bytes(true) == Config::Traits::smem_bytes(true),
                "the plan sizes both kernels");
  // Deterministic: enough splits to fill the GPU twice over the (kv head, batch) grid.
  const int num_n = (p.seqlen_k + 63) / 64;  // an upper bound of the kernel's key blocks
  int splits = 1;
  if (p.deterministic) {
    const int64_t per_split = std::max<int64_t>(1, int64_t(p.h_k) * p.b);
    splits = static_cast<int>(std::min<int64_t>(std::max<int64_t>(num_n, 1),
                                                (2 * device.sms + per_split - 1) / per_split));
  }
  // dq_accum [splits][b][h][rows rounded up to 8][kHeadDim] (thd: [splits][h][tokens ...]
  // [kHeadDim]), in flash.h's row-group layout. Zeroed by the binding only for thd (rows of
  // tokens past the last sequence); otherwise the dsum kernel zeroes every row as it goes.
  const int64_t rows = p.q_packed ? (p.h > 0 ? p.dq_rows / p.h : 0) : p.seqlen_q;
  const int64_t head_stride = (rows + 7) / 8 * 8 * kHeadDim;
  p.num_splits = splits;
  p.dqa_rows = rows;
  p.dqa_row_stride = kHeadDim;
  p.dqa_head_stride = head_stride;
  p.dqa_batch_stride = p.q_packed ? 0 : int64_t(p.h) * head_stride;
  p.dqa_split_stride = int64_t(p.q_packed ? 1 : p.b) * p.h * head_stride;
  p.dqa_zeroed = p.q_packed;
  return BwdPlan{Config::Traits::smem_bytes(runs_sm90a(device)),
                 int64_t(splits) * p.dqa_split_stride, p.dqa_zeroed};
}

// dsum = rowsum(dO * O) and the zeroing of dq_accum (dot_do_o_kernel); the sm90 backward
// runs it too.
template <typename T, int kHeadDim>
void launch_dot_do_o(const BwdParams& params, cudaStream_t stream) {
  if (params.seqlen_q <= 0) return;
  // Lanes per row: one 8-element chunk each (d 64, 128), or a whole warp.
  constexpr int kLanes = kHeadDim <= 64 ? 8 : kHeadDim <= 128 ? 16 : 32;
  constexpr int kRows = 8 * 32 / kLanes;
  dim3 grid((params.seqlen_q + kRows - 1) / kRows, params.h, params.b);
  dot_do_o_kernel<T, kLanes><<<grid, 256, 0, stream>>>(params);
}

template <typename Tr>
void launch_bwd_traits(const BwdParams& params, const Device& device, cudaStream_t stream) {
  constexpr int kHeadDim = Tr::D;
  using T = typename Tr::Element;
  if (params.b == 0 || params.h == 0) return;
  launch_dot_do_o<T, kHeadDim>(params, stream);
  const int num_n = (params.seqlen_k + Tr::BN - 1) / Tr::BN;
  if (num_n > 0) {
    // Causal-like masks: heavy first in groups of kv heads (bwd_group_heads; causal backward
    // +1-4%, H100).
    const int group_heads =
        Tr::kGridOrder ? bwd_group_heads(params, device, params.h_k, kHeadDim, sizeof(T)) : 1;
    dim3 grid(params.deterministic ? params.num_splits : num_n, params.h_k, params.b);
    const int smem = Tr::smem_bytes(runs_sm90a(device));  // as plan_bwd's
    allow_dynamic_smem<&bwd_kernel<Tr>>(smem);
    bwd_kernel<Tr><<<grid, Tr::kNThreads, smem, stream>>>(params, group_heads);
  }
  const int64_t chunks = params.dq_rows * (params.d / 8);
  if (chunks > 0) {
    convert_dq_kernel<T><<<unsigned((chunks + 255) / 256), 256, 0, stream>>>(params);
  }
}

template <typename T, int kHeadDim>
void launch_bwd(const BwdParams& params, const Device& device, cudaStream_t stream) {
  using Config = BwdConfig<T, kHeadDim>;
  if (uses_extras(params)) {
    launch_bwd_traits<typename Config::Traits>(params, device, stream);
  } else {
    launch_bwd_traits<typename Config::PlainTraits>(params, device, stream);
  }
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
