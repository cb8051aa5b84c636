// What the sm90 family's backward serves: plain C++ (no CUDA device code, no CuTe), so that the
// binding can choose the backward's family per call and the Python backend can log the choice
// and explain a refusal with the same rule.
#pragma once

#include "flash/flash.h"

namespace transformer_fa {
namespace flash {
namespace sm90 {

// Why the sm90 backward cannot run `p` on a device of compute capability `arch` (major * 10 +
// minor), or nullptr when it can. The binding has checked the tensors already (dtypes,
// 16-byte aligned pointers, strides in multiples of 8 elements: what TMA needs too).
// Everything declined here runs on the sm80 family. GQA / MQA (h_k < h) is served: dK and dV
// are summed over a group by float reductions (bwd_kernel.cuh, kv_accum). Deterministic mode
// is served with and without GQA, at every head dim: dQ's additions, and GQA's dK / dV
// additions, in a fixed order (bwd_kernel.cuh, turns_of; the d256 kernel's consumers add dQ
// in turns from registers).
inline const char* bwd_declines(const BwdParams& p, int arch) {
  if (arch != 90) return "it runs on sm_90 GPUs only (sm_90a code)";
  // (head dims up to 128 run on the d64 or d128 kernel, 129-256 on the d256 one, columns past
  // d zero-filled by TMA and not stored)
  if (p.d > 256) return "its backward has kernels for head dims up to 256 only";
  if (p.alibi_slopes != nullptr) return "its backward does not take ALiBi";
  if (p.rng_state != nullptr) return "its backward does not take dropout";
  return nullptr;
}

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
