// Launch template of the sm80-class forward: picks the tile shape per head dim.
#pragma once

#include <cstdio>
#include <cstdlib>

#include "flash.h"
#include "fwd_kernel_sm80.cuh"

namespace transformer_fa {
namespace flash {
namespace sm80 {

// Tile shapes (as FlashAttention-2 on A100/H100 without dropout): 4 warps, 128 query rows.
template <typename T, int kHeadDim>
struct FwdConfig;
template <typename T>
struct FwdConfig<T, 64> { using Traits = FwdTraits<T, 64, 128, 128, 4>; };
template <typename T>
struct FwdConfig<T, 128> { using Traits = FwdTraits<T, 128, 128, 64, 4>; };

template <typename T, int kHeadDim>
void launch_fwd(FwdParams& params, cudaStream_t stream) {
  using Tr = typename FwdConfig<T, kHeadDim>::Traits;
  const int num_m_blocks = (params.seqlen_q + Tr::kBlockM - 1) / Tr::kBlockM;
  if (num_m_blocks == 0 || params.b == 0 || params.h == 0) return;
  dim3 grid(num_m_blocks, params.h, params.b);
  auto kernel = &fwd_kernel<Tr>;
  constexpr int smem = Tr::kSmemBytes;
  if (smem >= 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }
  kernel<<<grid, Tr::kNThreads, smem, stream>>>(params);
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
