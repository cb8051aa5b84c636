// C entry point of the sm90a forward for the test harness (ctypes); the
// lead's binding will call run_fwd<> directly instead.
#include <cstdint>

#include <cutlass/numeric_types.h>

#include "fwd_launch_sm90.cuh"

namespace {

using flash_sm90::FwdArgs;
using flash_sm90::FwdConfig;

template <class Element>
int dispatch_causal(FwdArgs const& a, bool causal, cudaStream_t stream) {
  using Cfg = FwdConfig<Element, 128, 128, 128, 2>;
  cudaError_t err = causal ? flash_sm90::run_fwd<Cfg, true>(a, stream)
                           : flash_sm90::run_fwd<Cfg, false>(a, stream);
  return int(err);
}

}  // namespace

// Returns 0 on success, a cudaError_t value on a CUDA error, and -1 for a
// shape this kernel does not serve (the caller checks first; this is a guard).
// strides: 15 element strides, (batch, row, head) for q, k, v, o, lse in that order
// (lse is [batch, heads, seqlen_q] float32; nullptr skips it).
// persistent: 1 = one CTA per SM looping over tiles, 0 = one CTA per tile,
// -1 = the measured default (default_persistent); max_ctas > 0 caps a
// persistent grid (so that small tests loop over several tiles per CTA).
extern "C" int sm90_fwd_hdim128(void const* q, void const* k, void const* v, void* o, float* lse,
                                int batch, int seqlen_q, int seqlen_k, int heads, int heads_kv,
                                int64_t const* strides, float softmax_scale, int causal,
                                int is_bf16, int persistent, int max_ctas, void* stream) {
  if (seqlen_q != seqlen_k || seqlen_q <= 0 || seqlen_q % 128 != 0 || heads_kv <= 0 ||
      heads % heads_kv != 0 || batch <= 0) {
    return -1;
  }
  FwdArgs a{q, k, v, o, lse, strides[12], strides[14], strides[13],
            batch, seqlen_q, seqlen_k, heads, heads_kv,
            strides[0], strides[1], strides[2], strides[3], strides[4], strides[5],
            strides[6], strides[7], strides[8], strides[9], strides[10], strides[11],
            softmax_scale,
            persistent < 0 ? flash_sm90::default_persistent(causal != 0, seqlen_q) : persistent != 0,
            max_ctas};
  auto s = static_cast<cudaStream_t>(stream);
  return is_bf16 ? dispatch_causal<cutlass::bfloat16_t>(a, causal != 0, s)
                 : dispatch_causal<cutlass::half_t>(a, causal != 0, s);
}
