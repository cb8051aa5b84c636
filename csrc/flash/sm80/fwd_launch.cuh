// Launch template of the sm80 family's forward: the tile configs per head dim and the launch.
#pragma once

#include "flash/flash.h"
#include "flash/sm80/fwd_kernel.cuh"

namespace transformer_fa {
namespace flash {
namespace sm80 {

// Tile configs per head dim (FwdTile): FwdConfig<T, d>::Traits for calls with dropout or
// ALiBi, PlainTraits for the others.
// The lazy rescale (the softmax's reference max moves only when a row max grows by more than
// 2^8) skips most blocks' O rescale; forward against the kernels without it (H100,
// 2026-11-24, best of 3 alternating repeats, s 1k / 4k / 16k): d128 plain kernel
// +9.3 / +8.5 / +7.7% non-causal, +8.7 / +4.7 / +4.9% causal (the split into a plain kernel
// with it; the plain kernel's loop has no local loads with XOR addressing, B two steps
// ahead, zero-fill from the own address); d64 0..+2.4%, d256 -0.3..+2.0%. The kernels with
// dropout / ALiBi keep FA2's rescale at d64 / d128: with it their loops spill more (d128
// -3..-5% for every call when it had one kernel).
// d64's plain kernel: without dropout / ALiBi state ptxas keeps the loop in registers
// (in-loop local loads 14 -> 1 with zero-filled chunks from their own addresses): forward
// +4-9% non-causal, +5-15% causal (s 16k-1k; H100, 2026-11-24, A/B best of 3, two runs).
// At d256 the split moved -4..+2% in A/Bs whose noise is as large, and took the same cycles
// under ncu, so it keeps one kernel (docs/flash_kernel_notes.md).
// d 64 / 128: the fastest of five shapes measured on an H100 (docs/flash_kernel_notes.md): 4 warps
// with 32 query rows each, as FlashAttention-2. d 192 / 256: warps of 16 rows, the O
// accumulators (up to 128 registers) leave no room for more rows per warp; at d256 64 x 64
// tiles with 4 warps and 2 CTAs per SM (FlashAttention-2's choice on H100) beat 128 x 64 with
// 8 warps by 5-10% (H100, 2026-11-23). The S GEMM at d128 (kernel with extras) through
// warp_gemm with B one step ahead: +2-4% over the XOR addressing (the SASS has fewer in-loop
// spills); the same costs 3-4% at d64 (H100, 2026-11-23, three runs each, notes). d256
// loads zero-filled chunks from their own addresses (no select): +1-4%; the same at d128
// costs 2-4%, d64 even (H100, 2026-11-24); d64's plain kernel takes them (above).
struct Fwd64 : FwdTile {
  static constexpr int kHeadDim = 64, kBlockM = 128, kBlockN = 128, kNWarps = 4;
  static constexpr bool kSXorAddressing = true;
};
struct Fwd64Plain : Fwd64 {
  static constexpr bool kZfillFromBase = false, kExtras = false, kLazyRescale = true;
};
struct Fwd128 : FwdTile {
  static constexpr int kHeadDim = 128, kBlockM = 128, kBlockN = 64, kNWarps = 4;
};
struct Fwd128Plain : Fwd128 {
  static constexpr bool kSXorAddressing = true;
  static constexpr int kSAhead = 2;
  static constexpr bool kZfillFromBase = false, kExtras = false, kLazyRescale = true;
};
struct Fwd192 : FwdTile {
  static constexpr int kHeadDim = 192, kBlockM = 128, kBlockN = 64, kNWarps = 8, kMinBlocks = 1;
  static constexpr int kSAhead = 2;
  static constexpr bool kLazyRescale = true;
};
struct Fwd256 : FwdTile {
  static constexpr int kHeadDim = 256, kBlockM = 64, kBlockN = 64, kNWarps = 4;
  static constexpr int kSAhead = 2;
  static constexpr bool kZfillFromBase = false, kLazyRescale = true;
};

template <typename T, int kHeadDim>
struct FwdConfig;
template <typename T> struct FwdConfig<T, 64> {
  using Traits = FwdTraits<T, Fwd64>;
  using PlainTraits = FwdTraits<T, Fwd64Plain>;
};
template <typename T> struct FwdConfig<T, 128> {
  using Traits = FwdTraits<T, Fwd128>;
  using PlainTraits = FwdTraits<T, Fwd128Plain>;
};
template <typename T> struct FwdConfig<T, 192> {
  using Traits = FwdTraits<T, Fwd192>;
  using PlainTraits = Traits;
};
template <typename T> struct FwdConfig<T, 256> {
  using Traits = FwdTraits<T, Fwd256>;
  using PlainTraits = Traits;
};

template <typename Tr>
void launch_fwd_traits(const FwdParams& params, const Device& device, cudaStream_t stream) {
  const int num_m_blocks = (params.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  if (num_m_blocks == 0 || params.b == 0 || params.h == 0) return;
  // Under a causal-like mask (a right bound, no left one) a query tile's work grows with its
  // position: heavy tiles first across a group of heads whose K and V (shared by a GQA
  // group's heads) fit in a third of L2 (causal forward +6% geomean over d 64-256, s 1k-16k,
  // H100). With uniform work, one head after another, so that its tiles read each K / V
  // block at about the same time (any grouping there lost up to 7%; docs/flash_kernel_notes.md).
  const int pairs = params.b * params.h;
  const int64_t kv_bytes_per_head = int64_t(2) * params.seqlen_k * Tr::kHeadDim *
                                    int(sizeof(typename Tr::Element)) * params.h_k / params.h;
  const int group_heads =
      work_grows(params) ? heads_per_group(kv_bytes_per_head, device.l2_bytes, params.h, pairs)
                         : 1;
  // The launch order as a 3-D grid: the kernel reads its tile from blockIdx (no divisions).
  const dim3 grid = group_heads == 1 ? dim3(num_m_blocks, params.h, params.b)
                                     : dim3(num_m_blocks * pairs);
  constexpr int smem = Tr::kSmemBytes;
  allow_dynamic_smem<&fwd_kernel<Tr>>(smem);
  fwd_kernel<Tr><<<grid, Tr::kNThreads, smem, stream>>>(params, group_heads);
}

template <typename T, int kHeadDim>
void launch_fwd(const FwdParams& params, const Device& device, cudaStream_t stream) {
  using Config = FwdConfig<T, kHeadDim>;
  if (uses_extras(params)) {
    launch_fwd_traits<typename Config::Traits>(params, device, stream);
  } else {
    launch_fwd_traits<typename Config::PlainTraits>(params, device, stream);
  }
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
