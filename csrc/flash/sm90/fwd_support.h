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

// Where it serves a call, the sm90 forward is the faster family at every measured length
// (bf16, batch * s = 16k, causal or not, s = 512-16k), so the binding takes it there: 1.2-1.6x
// sm80 at d64 / d128 (H100, 2026-11-24); since its QK^T runs as one wgmma per k-slice
// (cute_config.h), 1.0-1.5x at d256 and 1.03-1.9x at d192 on the d256 kernel against sm80's
// d192 one (H200, 2026-11-28, benchmarks/results/NVIDIA-H200-2026-11-28-*).

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
