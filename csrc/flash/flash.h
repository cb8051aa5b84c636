// transformer_fa flash attention: the plain parameter struct shared by the binding and the
// kernels. No torch types here: the binding (csrc/flash_api.cpp) fills it from tensors.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace transformer_fa {
namespace flash {

// Kernel families, named by the oldest GPU architecture they run on. A family has its own
// folder (sm80/, ...), launch templates and tile configs; csrc/generate.py instantiates each
// (family, dtype, head dim) in its own file, built for the family's nvcc targets.
//   kSm80: mma.sync, ldmatrix, cp.async; runs on every sm80+ GPU (on sm_90a it adds Hopper's
//          bulk dQ reduction in the backward, sm90/bulk_copy.cuh).
//   kSm90: wgmma, TMA, mbarrier pipelines, warp specialization; sm_90a only (H100, H200).
//          The forward for the calls sm90/fwd_support.h accepts, the backward for those
//          sm90/bwd_support.h accepts (both by default where they serve: measured faster).
//          The binding runs the others on kSm80.
enum class Arch : int { kSm80 = 80, kSm90 = 90 };

enum class DType : int { kFP16 = 0, kBF16 = 1 };

// The GPU a call runs on (the binding queries it once per device). Families plan their
// launches, shared memory and workspace from it.
struct Device {
  int arch;        // compute capability, major * 10 + minor (80, 86, 90, ...)
  int sms;         // streaming multiprocessors
  int smem_optin;  // dynamic shared memory a block may opt into, in bytes
  int l2_bytes;    // L2 cache size in bytes (0: unknown)
};

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
  // Thd q / k and v: their tokens (0 otherwise): the sm90 family's TMA extents, where
  // cu_seqlens[b] is on the GPU (the sm80 family does not read them).
  int64_t q_tokens, kv_tokens;

  int b;          // batch
  int h, h_k;     // query heads, key/value heads (h % h_k == 0)
  int seqlen_q;   // max (thd) or padded (sbhd/bshd) query length: the grid covers it
  int seqlen_k;
  int d;          // head dim of q, k and v (a multiple of 8, at most the kernel's: the
                  // columns past d are zero-filled in shared memory and never written)

  float scale_softmax;       // applied to q.k
  float scale_softmax_log2;  // scale_softmax * log2(e)

  // Mask: key j is kept for query i (per-sequence positions) when
  //   j < len_k, i < len_q, and, with off = bottom_right ? len_k - len_q : 0,
  //   window_left  < 0 or j >= i + off - window_left
  //   window_right < 0 or j <= i + off + window_right     (causal: window_right = 0)
  int window_left, window_right;
  bool bottom_right;

  // ALiBi: adds -slope[b, h] * |i + off - j| to softmax_scale * q.k (off as for the mask).
  // nullptr: none. slope = alibi_slopes[b * alibi_batch_stride + h].
  const float* __restrict__ alibi_slopes;
  int64_t alibi_batch_stride;  // 0 for slopes [h]

  // Dropout on the softmax probabilities P (the LSE is of the undropped softmax):
  // O = (P * Z) V with Z = keep / (1 - p). rng_state (device, int64 [2]) = (seed, offset);
  // nullptr: no dropout. The mask is a pure function of (seed, offset, b, h, i, j), so the
  // backward regenerates it and any tile shape gives the same one:
  //   Philox4x32-10 (Random123 constants) with key = (seed & 0xffffffff, seed >> 32) and
  //   counter = (j >> 3, ((i >> 4) << 5) | ((i & 7) << 2) | ((j >> 1) & 3), b * h + head,
  //              offset & 0xffffffff)
  //   gives four words; word ((i >> 3) & 1) * 2 + (j & 1) < dropout_threshold keeps (i, j).
  //   i, j: per-sequence query and key positions; b: sequence index; h: query heads.
  //   dropout_threshold = min(floor((1 - p) * 2^32), 2^32 - 1).
  // (tests/gpu/philox.py computes the same mask in PyTorch.)
  const int64_t* __restrict__ rng_state;
  uint32_t dropout_threshold;
  float dropout_scale;  // 1 / (1 - p)

  // Workspace of the sm90 forward: one int32 on the device, the counter of its dynamic tile
  // scheduler (sm90/fwd_launch.cuh, FwdScheduler), which the launch zeroes on the call's stream
  // when it runs that scheduler. The binding allocates it for every sm90 forward; nullptr: the
  // launch takes the static order instead. No other kernel reads it.
  int* tile_counter;
};

// Backward: the forward's tensors and mask, plus the gradients.
struct BwdParams : FwdParams {
  // o (from FwdParams) is the forward output, read here; lse is the forward's LSE.
  const void* __restrict__ dout;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  // dK, dV: k/v-side layouts (strides in elements).
  void* __restrict__ dk;
  void* __restrict__ dv;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  // Workspace: the family's planner (plan_bwd) sets the layout fields below and num_splits;
  // the binding allocates what the plan asks for and sets the pointers.
  // dQ: float32 accumulator, per (split, sequence, head) a block of dqa_rows rows
  // (seqlen_q; thd: all tokens, the sequences one after another) rounded up to 8, of
  // D = dqa_row_stride floats each (the kernel head dim). Inside a block, groups of 8 rows in
  // mma accumulator order: (row, col) at (row & ~7) * D + (col / 8) * 64 + (row % 8) * 8 +
  // col % 8 (sm80/bwd_kernel.cuh, dqa_offset). dq (the T output, q's format) is written from
  // it at the end with its own strides; dq_rows = b * h * dqa_rows (thd: h * dqa_rows).
  // dqa_zeroed: the caller zeroed it (thd, where tokens past the last sequence have rows);
  // otherwise the dsum kernel zeroes every block, row group by row group, before the main
  // kernel adds into it.
  float* __restrict__ dq_accum;
  int64_t dqa_batch_stride, dqa_row_stride, dqa_head_stride, dqa_split_stride, dqa_rows;
  bool dqa_zeroed;
  void* __restrict__ dq;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dq_rows;
  // rowsum(dO * O) per query row, float32, laid out as lse (written by the backward).
  float* __restrict__ dsum;
  // Deterministic: the sm80 family runs num_splits CTAs per (kv head, batch), each owning a
  // dq_accum split that it adds into in program order; the splits are summed in order. The
  // sm90 family keeps one split and adds the key blocks' dQ tiles in a fixed order (flags in
  // its workspace, sm90/bwd_kernel.cuh dq_turns). Otherwise num_splits = 1 and every key block
  // adds into split 0 with atomics or bulk reductions (sm90 hardware) in any order.
  bool deterministic;
  int num_splits;
};

// Decode (a few query tokens against a long K/V cache): the forward's tensors and mask, read
// through a block table where the cache is paged, with the keys split over several CTAs.
// No dropout, ALiBi or LSE output (FwdParams's rng_state, alibi_slopes and lse are null).
struct DecodeParams : FwdParams {
  // Paged K/V: null, or k and v are page pools [pages, page_size, h_k, d] (k_batch_stride,
  // v_batch_stride: one page) and key j of sequence b is row j % page_size of page
  // block_table[b * block_table_batch_stride + j / page_size]; page_size is a multiple of 16.
  const int* __restrict__ block_table;
  int64_t block_table_batch_stride;
  int page_size;
  // log2(page_size) where it is a power of two, else -1 (set by the planner): the page of a
  // key and its row in the page by shifts instead of two integer divisions a chunk.
  int page_shift;
  // Keys per sequence (int32 [b]), FlashAttention's cache_seqlens: null, or it overrides the
  // lengths of cu_seqlens_k / seqlen_k (the K/V rows stay where FwdParams puts them), clamped
  // to [0, seqlen_k] so that a bad length cannot read past the cache.
  const int* __restrict__ seqlens_k;
  // Split-KV: num_splits CTAs share the keys of each (sequence, KV head, row tile) (0: the
  // planner chooses). With more than one, each writes normalized partial O to o_accum
  // (float32 [num_partials, accum_rows, kernel head dim]) and their LSE in log2 units to
  // lse_accum ([num_partials, accum_rows]); row = token * h + head, token = the packed index
  // (thd q) or b * seqlen_q + t. A second kernel merges them into o.
  int num_splits;
  // Partials per row in o_accum (set by the planner): num_splits times the CTA's warps where
  // each warp of a split writes its own, else num_splits (one per CTA; 1: o written directly).
  int num_partials;
  float* __restrict__ o_accum;
  float* __restrict__ lse_accum;
  int64_t accum_rows;  // tokens * h
};

// What the decode planner decided beside DecodeParams::num_splits: the binding checks the
// shared memory and allocates the workspace.
struct DecodePlan {
  int smem_bytes;
  int64_t accum_floats;  // o_accum (0: one split, no workspace)
  int64_t lse_floats;    // lse_accum
};

// The launches put heads and sequences in their grids' y and z dimensions (CUDA allows up to
// 65535 there); the binding rejects calls with more.
constexpr int kMaxGridYZ = 65535;

// What a family's backward needs beside the params, from its planner: the binding checks
// the shared memory against the device and allocates the workspace.
struct BwdPlan {
  int smem_bytes;           // dynamic shared memory per CTA of the main kernel
  int64_t dq_accum_floats;  // size of dq_accum (float32), with any workspace the family
                            // keeps after it (sm90 GQA: dK / dV accumulators)
  bool dq_accum_zeroed;     // the binding zero-fills dq_accum (BwdParams::dqa_zeroed)
};

// One definition per (family, dtype, head dim), each in its own generated .cu file
// (csrc/flash/instantiations/; the generated dispatch.h calls them).
template <Arch kArch, DType kDType, int kHeadDim>
void run_fwd(const FwdParams& params, const Device& device, cudaStream_t stream);
// Sets the workspace layout fields of params (see BwdParams) and says what to allocate.
template <Arch kArch, DType kDType, int kHeadDim>
BwdPlan plan_bwd(BwdParams& params, const Device& device);
template <Arch kArch, DType kDType, int kHeadDim>
void run_bwd(const BwdParams& params, const Device& device, cudaStream_t stream);
// Chooses params.num_splits (where 0) and says what to allocate.
template <Arch kArch, DType kDType, int kHeadDim>
DecodePlan plan_decode(DecodeParams& params, const Device& device);
template <Arch kArch, DType kDType, int kHeadDim>
void run_decode(const DecodeParams& params, const Device& device, cudaStream_t stream);

}  // namespace flash
}  // namespace transformer_fa
