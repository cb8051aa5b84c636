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
// is served with and without GQA: dQ's additions, and GQA's dK / dV additions, in a fixed
// order (bwd_kernel.cuh, turns_of); at head dims 129-256 (the d256 kernel, which adds dQ
// from registers) it is not.
inline const char* bwd_declines(const BwdParams& p, int arch) {
  if (arch != 90) return "it runs on sm_90 GPUs only (sm_90a code)";
  // (head dims up to 128 run on the d64 or d128 kernel, 129-256 on the d256 one, columns past
  // d zero-filled by TMA and not stored)
  if (p.d > 256) return "its backward has kernels for head dims up to 256 only";
  if (p.alibi_slopes != nullptr) return "its backward does not take ALiBi";
  if (p.rng_state != nullptr) return "its backward does not take dropout";
  if (p.deterministic && p.d > 128) {
    return "its d256 backward is not deterministic (dQ is added by float reductions from "
           "registers in any order: no shared memory is left for the dQ writer's tiles)";
  }
  return nullptr;
}

// Calls that the sm90 backward serves (bwd_declines accepts them) but that the binding's
// automatic choice still leaves on sm80: they run on sm90 only when that family is requested
// (the `family` argument of bwd: TRANSFORMER_FA_FLASH_BWD_FAMILY=sm90 in Python), so that tests
// and benchmarks can reach them. nullptr: `auto` may take sm90.
// - head dims over 128 (the d256 kernel, bwd_kernel_d256.cuh): a draft, compile-checked on
//   2026-11-28 and not yet run on a GPU; drop this rule once tests/gpu/test_flash_sm90_bwd.py
//   passes at d256 and the benchmark shows it faster than sm80.
inline const char* bwd_auto_declines(const BwdParams& p) {
  if (p.d > 128) {
    return "its d256 backward is a draft not yet tested on a GPU (it runs only when the sm90 "
           "family is requested: TRANSFORMER_FA_FLASH_BWD_FAMILY=sm90)";
  }
  return nullptr;
}

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
