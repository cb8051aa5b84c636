// What the sm90 family's forward serves: plain C++ (no CUDA device code, no CuTe), so that the
// binding can choose a family per call and the Python backend can log the choice with the
// same rule.
#pragma once

#include "flash/flash.h"

namespace transformer_fa {
namespace flash {
namespace sm90 {

// The forward's query and key tile (fwd_launch.cuh's FwdConfig).
constexpr int kFwdBlock = 128;

// Why the sm90 forward cannot run `p` on a device of compute capability `arch` (major * 10 +
// minor), or nullptr when it can. The binding has checked the tensors already (dtypes,
// 16-byte aligned pointers, strides in multiples of 8 elements: what TMA needs too).
// Everything declined here runs on the sm80 family.
inline const char* fwd_declines(const FwdParams& p, int arch) {
  if (arch != 90) return "it runs on sm_90 GPUs only (sm_90a code)";
  // (other head dims would need their columns past d masked in the epilogue)
  if (p.d != 64 && p.d != 128 && p.d != 256) return "it has head dim 64, 128 and 256 kernels only";
  if (p.cu_seqlens_q != nullptr || p.cu_seqlens_k != nullptr)
    return "it does not take varlen (cu_seqlens) calls yet";
  if (p.seqlen_k == 0) return "it needs at least one key";
  const bool no_mask = p.window_left < 0 && p.window_right < 0;
  const bool causal = p.window_left < 0 && p.window_right == 0;
  if (!no_mask && !causal) return "it does not take sliding windows yet";
  // (query rows before the diagonal's start have no key; the kernel has no empty tiles)
  if (causal && p.bottom_right && p.seqlen_q > p.seqlen_k)
    return "it does not take bottom-right causal masks with seqlen_q > seqlen_kv";
  if (p.alibi_slopes != nullptr) return "it does not take ALiBi";
  if (p.rng_state != nullptr) return "it does not take dropout";
  return nullptr;
}

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
