// What the sm90 family's forward serves: plain C++ (no CUDA device code, no CuTe), so that the
// binding can choose a family per call and the Python backend can log the choice with the
// same rule.
#pragma once

#include "flash/flash.h"

namespace transformer_fa {
namespace flash {
namespace sm90 {

// Why the sm90 forward cannot run `p` on a device of compute capability `arch` (major * 10 +
// minor), or nullptr when it can. The binding has checked the tensors already (dtypes,
// 16-byte aligned pointers, strides in multiples of 8 elements: what TMA needs too).
// Everything declined here runs on the sm80 family. Served: no mask, causal of either diagonal
// (any seqlen_q / seqlen_kv: rows without a key get O = 0, LSE = +inf), sliding windows, GQA /
// MQA, bshd / sbhd strides and varlen (cu_seqlens: thd, or padded bshd / sbhd), head dims
// that are multiples of 8 up to 256.
inline const char* fwd_declines(const FwdParams& p, int arch) {
  if (arch != 90) return "it runs on sm_90 GPUs only (sm_90a code)";
  // (every head dim the binding takes, multiples of 8 up to 256, runs on the 64, 128 or 256
  // kernel: TMA zero-fills the columns past d, the epilogue stores none of them)
  // (a TMA descriptor needs a tensor of at least one row)
  if (p.seqlen_k == 0 || (p.k_packed && p.kv_tokens == 0)) return "it needs at least one key";
  if (p.alibi_slopes != nullptr) return "it does not take ALiBi";
  if (p.rng_state != nullptr) return "it does not take dropout";
  return nullptr;
}

// Why the sm80 family is the faster choice for a call that the sm90 forward serves, or nullptr.
// Head dims between 128 and 192 run on sm80's d192 kernel and on sm90's d256 one (a third more
// columns): not measured against each other, so sm80 keeps them. Elsewhere sm90 leads at every
// length: below 128 both families pad to the same kernel head dim (64 or 128), where the sm90
// kernels ran 1.2-1.6x sm80's (H100, 2026-11-24); at d256, since its QK^T runs as one wgmma
// per k-slice (cute_config.h), 1.02-1.50x sm80's from s = 512 on, causal or not (H200, bf16,
// batch * s = 16k, 2026-11-28: benchmarks/results/NVIDIA-H200-2026-11-28-trial-*).
inline const char* fwd_slower_than_sm80(const FwdParams& p) {
  if (p.d > 128 && p.d <= 192)
    return "its d256 kernel is not measured against the sm80 d192 kernel for 128 < head dim <= 192";
  return nullptr;
}

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
