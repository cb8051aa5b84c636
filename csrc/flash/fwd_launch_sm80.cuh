// Launch template of the sm80-class forward: the tile shapes per head dim.
#pragma once

#include "flash.h"
#include "fwd_kernel_sm80.cuh"

namespace transformer_fa {
namespace flash {
namespace sm80 {

// FwdTraits<T, head dim, query rows, key rows, warps, min CTAs per SM>.
// Variants 0..4 (params.tile_variant); transformer_fa/attention/backends/flash.py picks
// one per head dim (TILE_VARIANT), from benchmarks/bench_flash.py.
template <typename T, int kHeadDim, int kVariant>
struct FwdConfig;
template <typename T> struct FwdConfig<T, 64, 0> { using Traits = FwdTraits<T, 64, 128, 64, 8>; };
template <typename T> struct FwdConfig<T, 64, 1> { using Traits = FwdTraits<T, 64, 128, 128, 8>; };
template <typename T> struct FwdConfig<T, 64, 2> { using Traits = FwdTraits<T, 64, 64, 128, 4, 2>; };
template <typename T> struct FwdConfig<T, 64, 3> { using Traits = FwdTraits<T, 64, 128, 128, 4, 2>; };
template <typename T> struct FwdConfig<T, 64, 4> { using Traits = FwdTraits<T, 64, 128, 64, 8, 2>; };
template <typename T> struct FwdConfig<T, 128, 0> { using Traits = FwdTraits<T, 128, 128, 64, 8>; };
template <typename T> struct FwdConfig<T, 128, 1> { using Traits = FwdTraits<T, 128, 64, 64, 4, 2>; };
template <typename T> struct FwdConfig<T, 128, 2> { using Traits = FwdTraits<T, 128, 128, 64, 4, 2>; };
template <typename T> struct FwdConfig<T, 128, 3> { using Traits = FwdTraits<T, 128, 128, 32, 4, 2>; };
template <typename T> struct FwdConfig<T, 128, 4> { using Traits = FwdTraits<T, 128, 128, 128, 8, 1>; };

template <typename Tr>
void launch_fwd_traits(FwdParams& params, cudaStream_t stream) {
  const int num_m_blocks = (params.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  if (num_m_blocks == 0 || params.b == 0 || params.h == 0) return;
  dim3 grid(num_m_blocks, params.h, params.b);
  auto kernel = &fwd_kernel<Tr>;
  constexpr int smem = Tr::kSmemBytes;
  if (smem >= 48 * 1024) {
    // Once per device (the attribute is per device and kernel).
    static unsigned long long configured = 0;
    int device = 0;
    cudaGetDevice(&device);
    const unsigned long long bit = 1ull << (device & 63);
    if (!(configured & bit)) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      configured |= bit;
    }
  }
  kernel<<<grid, Tr::kNThreads, smem, stream>>>(params);
}

template <typename T, int kHeadDim>
void launch_fwd(FwdParams& params, cudaStream_t stream) {
  switch (params.tile_variant) {
    case 1: launch_fwd_traits<typename FwdConfig<T, kHeadDim, 1>::Traits>(params, stream); break;
    case 2: launch_fwd_traits<typename FwdConfig<T, kHeadDim, 2>::Traits>(params, stream); break;
    case 3: launch_fwd_traits<typename FwdConfig<T, kHeadDim, 3>::Traits>(params, stream); break;
    case 4: launch_fwd_traits<typename FwdConfig<T, kHeadDim, 4>::Traits>(params, stream); break;
    default: launch_fwd_traits<typename FwdConfig<T, kHeadDim, 0>::Traits>(params, stream);
  }
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
