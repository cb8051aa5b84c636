// Family-free launch helpers: the grid order (heavy tiles first, head groups sized by the L2
// cache) that a family's kernels and launches may use, and the dynamic shared-memory opt-in.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>

#include "flash/flash.h"

namespace transformer_fa {
namespace flash {

// ---------------------------------------------------------------------------------------
// Grid order
// ---------------------------------------------------------------------------------------
// num_tiles x heads x batches CTAs, numbered in the order the GPU starts them (`linear`: a 1-D
// grid's blockIdx.x, or x + X (y + Y z) of a 3-D one). Consecutive (batch, head) pairs form
// groups of `group`; inside a group the CTAs go tile-major (tile 0 of every head of the
// group, then tile 1, ...); groups of one pair give the plain (tile, head, batch) order.
// Callers number the tiles heaviest first: under a causal mask the work per tile varies up to
// num_tiles-fold, and with the light tiles last the GPU's tail is short. The group bounds the
// data that running CTAs share in L2.
struct GridTile {
  int tile, head, batch;
};
__device__ __forceinline__ GridTile grid_tile(int linear, int num_tiles, int heads, int batches,
                                              int group) {
  const int per_group = group * num_tiles;
  const int first = linear / per_group * group;  // first (batch, head) of the group
  const int rest = linear % per_group;
  const int size = min(group, heads * batches - first);  // the last group may be smaller
  const int tile = rest / size;
  const int bh = first + rest % size;
  return {tile, bh % heads, bh / heads};
}

// Whether a tile's work grows with its position along the grid's tile axis: a causal-like mask
// (a right bound, no left one). The launches then order the grid heavy first, in head groups.
inline bool work_grows(const FwdParams& p) { return p.window_right >= 0 && p.window_left < 0; }

// Whether a call uses dropout or ALiBi: the launches then take the kernels built with them
// (Traits), the others those built without (PlainTraits).
inline bool uses_extras(const FwdParams& p) {
  return p.rng_state != nullptr || p.alibi_slopes != nullptr;
}

// (batch, head) pairs per group: as many as keep what the CTAs of one pair share
// (bytes_per_head) within a third of the L2 cache, as whole batches or an equal share of one
// batch's heads. A token's row holds all of its heads, so a group of neighbouring heads reads
// whole or like parts of rows; groups that split rows unevenly ran 5-10% slower, and a
// half-L2 budget also lost to a third (H100, docs/flash_kernel_notes.md).
inline int heads_per_group(int64_t bytes_per_head, int l2_bytes, int heads, int pairs) {
  const int64_t budget = (l2_bytes > 0 ? int64_t(l2_bytes) : int64_t(40) << 20) / 3;
  int64_t group = budget / (bytes_per_head > 0 ? bytes_per_head : 1);
  if (group >= pairs) return pairs;
  if (group >= heads) return int(group / heads * heads);
  while (group > 1 && heads % group != 0) --group;
  return group < 1 ? 1 : int(group);
}

// The backward's group size: under a causal-like mask the first key blocks see the most query
// rows, so the CTAs go heavy first (grid_tile, key block 0 first) in groups of `heads` (the
// heads a CTA is of: query or KV heads) whose Q, dO and float32 dQ accumulator rows fit in
// heads_per_group's share of L2; 1 (the launch order) otherwise and in deterministic mode,
// whose turns rely on the launch order.
inline int bwd_group_heads(const BwdParams& p, const Device& device, int heads, int head_dim,
                           int element_bytes) {
  if (!work_grows(p) || p.deterministic) return 1;
  const int64_t per_head = int64_t(p.seqlen_q) * head_dim * (p.h / heads) *
                           (2 * element_bytes + int(sizeof(float)));
  return heads_per_group(per_head, device.l2_bytes, heads, p.b * heads);
}

// ---------------------------------------------------------------------------------------
// Overlapped launches (programmatic dependent launch, sm_90+)
// ---------------------------------------------------------------------------------------
// A kernel started by launch_overlapped(..., overlap = true) may be scheduled while the kernel
// before it in the stream still runs, once every CTA of that one has called
// let_next_grid_start() (or exited): its launch and its CTAs' start then hide under the other's
// tail instead of following it. It must call wait_for_prior_grid() before it reads anything
// the kernel before it wrote (that returns once that kernel has finished and its writes are
// visible). Both are no-ops where the kernel runs without the overlap, and below sm_90.
__device__ __forceinline__ void let_next_grid_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Whether launches on `device` may overlap: sm_90+, unless TRANSFORMER_FA_OVERLAP_LAUNCHES=0
// (benchmarks: the A/B).
inline bool overlap_launches(const Device& device) {
  const char* forced = std::getenv("TRANSFORMER_FA_OVERLAP_LAUNCHES");
  return device.arch >= 90 && !(forced != nullptr && forced[0] == '0' && forced[1] == '\0');
}

// kernel<<<grid, block, smem, stream>>>(args...), overlapped with the kernel before it in the
// stream when `overlap` (overlap_launches, and only where that kernel is the one whose outputs
// this one waits for: a memset between them would not be waited on).
template <typename... Params, typename... Args>
void launch_overlapped(void (*kernel)(Params...), dim3 grid, dim3 block, int smem,
                       cudaStream_t stream, bool overlap, Args... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = size_t(smem);
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = overlap ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, args...);
}

// Lets kKernel use `smem` bytes of dynamic shared memory (above the 48 KB default), once per
// device and kernel (the attribute is per device and kernel).
template <auto kKernel>
void allow_dynamic_smem(int smem) {
  if (smem < 48 * 1024) return;
  static unsigned long long configured = 0;  // one per kernel (template argument)
  int device = 0;
  cudaGetDevice(&device);
  const unsigned long long bit = 1ull << (device & 63);
  if (!(configured & bit)) {
    cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    configured |= bit;
  }
}

}  // namespace flash
}  // namespace transformer_fa
