// transformer_fa flash attention: the plain parameter struct shared by the binding and the
// kernels. No torch types here: the binding (csrc/flash_api.cpp) fills it from tensors.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace transformer_fa {
namespace flash {

enum class DType : int { kFP16 = 0, kBF16 = 1 };

struct FwdParams {
  // Tensors. Strides are in elements; the last (head-dim) stride is 1 for every tensor.
  const void* __restrict__ q;
  const void* __restrict__ k;
  const void* __restrict__ v;
  void* __restrict__ o;
  float* __restrict__ lse;  // nullptr: not written

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  // lse[b, h, row] = lse + b * lse_batch_stride + h * lse_head_stride + row * lse_row_stride
  // (for packed q, the row is the token index and lse_batch_stride is unused).
  int64_t lse_batch_stride, lse_head_stride, lse_row_stride;

  // Sequence lengths. cu_seqlens_* (int32 [b + 1]) may be nullptr: every sequence then has
  // the full length seqlen_*. *_packed: the tensor is thd (token index = cu_seqlens[b] + row,
  // batch stride unused); otherwise sequence b starts at b * batch_stride and occupies the
  // first len_b rows of its padded seqlen_* rows.
  const int* __restrict__ cu_seqlens_q;
  const int* __restrict__ cu_seqlens_k;
  bool q_packed, k_packed;

  int b;          // batch
  int h, h_k;     // query heads, key/value heads (h % h_k == 0)
  int seqlen_q;   // max (thd) or padded (sbhd/bshd) query length: the grid covers it
  int seqlen_k;
  int d;          // head dim (q, k and v)

  float scale_softmax;       // applied to q.k
  float scale_softmax_log2;  // scale_softmax * log2(e)

  // Mask: key j is kept for query i (per-sequence positions) when
  //   j < len_k, i < len_q, and, with off = bottom_right ? len_k - len_q : 0,
  //   window_left  < 0 or j >= i + off - window_left
  //   window_right < 0 or j <= i + off + window_right     (causal: window_right = 0)
  int window_left, window_right;
  bool bottom_right;

  // Tile shape variant 0..4 (fwd_launch_sm80.cuh lists them; the Python side picks one
  // per head dim).
  int tile_variant;
};

// One definition per (dtype, head dim), each in its own generated .cu file.
template <DType kDType, int kHeadDim>
void run_fwd(FwdParams& params, cudaStream_t stream);

}  // namespace flash
}  // namespace transformer_fa
