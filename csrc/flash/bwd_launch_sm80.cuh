// Launch template of the sm80-class backward: the tile shapes per head dim and the three
// launches (dsum, main, dq conversion).
#pragma once

#include "bwd_kernel_sm80.cuh"
#include "flash.h"

namespace transformer_fa {
namespace flash {
namespace sm80 {

// BwdTraits<T, head dim, query rows, key rows, warps, warps along M of S, warps along N of
// dK/dV, warps along M of dQ, S/dP column slices, dQ column slices, dQ through the sm90
// bulk-copy reduction, the bulk dQ tile in the step's Q / dO buffers, zero-filled loads from
// the tile base, CTAs in grid_tile's order, dropout and ALiBi compiled in>: Traits for calls
// with dropout or ALiBi, PlainTraits for the others. The dK/dV accumulators live in registers
// for the whole CTA. Measured on H100 (bwd TFLOPS, details in csrc/flash/NOTES.md):
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
template <typename T, int kHeadDim>
struct BwdConfig;
template <typename T> struct BwdConfig<T, 64> {
  using Traits = BwdTraits<T, 64, 64, 128, 4, 4, 4, 2, 2, 1, false, false, true, true>;
  using PlainTraits = typename Traits::template WithExtras<false>;
};
template <typename T> struct BwdConfig<T, 128> {
  using Traits = BwdTraits<T, 128, 64, 128, 8, 2, 4, 2, 1, 1, true, false, false, true>;
  using PlainTraits = typename Traits::template WithExtras<false>;
};
template <typename T> struct BwdConfig<T, 192> {
  using Traits = BwdTraits<T, 192, 64, 64, 8, 4, 2, 2, 1, 1, true>;
  using PlainTraits = Traits;
};
template <typename T> struct BwdConfig<T, 256> {
  using Traits = BwdTraits<T, 256, 64, 64, 8, 4, 2, 2, 1, 1, true, true>;
  using PlainTraits = typename Traits::template WithExtras<false>;
};

template <typename T, int kHeadDim>
constexpr int bwd_smem(bool sm90) {
  return BwdConfig<T, kHeadDim>::Traits::smem_bytes(sm90);
}

template <typename Tr>
void launch_bwd_traits(BwdParams& params, cudaStream_t stream) {
  constexpr int kHeadDim = Tr::D;
  using T = typename Tr::Element;
  if (params.b == 0 || params.h == 0) return;
  if (params.seqlen_q > 0) {
    // Lanes per row: one 8-element chunk each (d 64, 128), or a whole warp.
    constexpr int kLanes = kHeadDim <= 64 ? 8 : kHeadDim <= 128 ? 16 : 32;
    constexpr int kRows = 8 * 32 / kLanes;
    dim3 grid((params.seqlen_q + kRows - 1) / kRows, params.h, params.b);
    dot_do_o_kernel<T, kLanes><<<grid, 256, 0, stream>>>(params);
  }
  const int num_n = (params.seqlen_k + Tr::BN - 1) / Tr::BN;
  if (num_n > 0) {
    // Under a causal-like mask the first key blocks see the most query rows: heavy first
    // across groups of kv heads whose Q, dO and dQ rows fit in a third of L2.
    // (causal backward +1-4%, H100; the deterministic splits keep the launch order.)
    const int pairs = params.b * params.h_k;
    const int64_t per_head = int64_t(params.seqlen_q) * kHeadDim * (params.h / params.h_k) *
                             (2 * int(sizeof(T)) + int(sizeof(float)));
    params.group_heads = Tr::kGridOrder && work_grows(params) && !params.deterministic
                             ? heads_per_group(per_head, params.l2_bytes, params.h_k, pairs)
                             : 1;
    dim3 grid(params.deterministic ? params.num_splits : num_n, params.h_k, params.b);
    // The kernel takes the bulk path where its code is sm_90a (compile time); the host sizes
    // shared memory by the GPU. They agree whenever the sm_90a code can run (sm_80 code on a
    // Hopper GPU just gets unused shared memory).
    const int smem = Tr::smem_bytes(params.sm90);
    allow_dynamic_smem<&bwd_kernel<Tr>>(smem);
    bwd_kernel<Tr><<<grid, Tr::kNThreads, smem, stream>>>(params);
  }
  const int64_t chunks = params.dq_rows * (params.d / 8);
  if (chunks > 0) {
    convert_dq_kernel<T><<<unsigned((chunks + 255) / 256), 256, 0, stream>>>(params);
  }
}

template <typename T, int kHeadDim>
void launch_bwd(BwdParams& params, cudaStream_t stream) {
  using Config = BwdConfig<T, kHeadDim>;
  static_assert(Config::PlainTraits::smem_bytes(true) == Config::Traits::smem_bytes(true),
                "bwd_smem sizes both kernels");
  if (uses_extras(params)) {
    launch_bwd_traits<typename Config::Traits>(params, stream);
  } else {
    launch_bwd_traits<typename Config::PlainTraits>(params, stream);
  }
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
