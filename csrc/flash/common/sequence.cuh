// Family-free device code: a sequence's rows and offsets (SeqInfo), the mask band, and
// the dropout random numbers (Philox). Every kernel family reads the params through these,
// so that the mask and the dropout mask (flash.h) mean the same in each.
#pragma once

#include <cstdint>

#include "flash/flash.h"

namespace transformer_fa {
namespace flash {

// A value the compiler must not hoist out of the loop it is computed in.
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// ---------------------------------------------------------------------------------------
// Sequences
// ---------------------------------------------------------------------------------------
struct SeqInfo {
  int bidb;
  int len_q, len_k;      // actual lengths
  int rows_q, rows_k;    // rows of the tensors this sequence owns (len, or padded length)
  int start_q, start_k;  // first token of a packed (thd) sequence
  bool q_packed, k_packed;
  // Element offset of row 0 (head 0) of this sequence in a q-side / k-side tensor.
  __device__ __forceinline__ int64_t q_off(int64_t batch_stride, int64_t row_stride) const {
    return q_packed ? int64_t(start_q) * row_stride : int64_t(bidb) * batch_stride;
  }
  __device__ __forceinline__ int64_t k_off(int64_t batch_stride, int64_t row_stride) const {
    return k_packed ? int64_t(start_k) * row_stride : int64_t(bidb) * batch_stride;
  }
  // Copies whose q-side / k-side position is opaque to the compiler: offsets taken from them
  // inside a main loop are recomputed there (a few integer ops) instead of being hoisted out
  // as 64-bit values that stay live, and spill, across the loop.
  __device__ __forceinline__ SeqInfo in_loop_q() const {
    SeqInfo s = *this;
    s.bidb = opaque(bidb);
    s.start_q = opaque(start_q);
    return s;
  }
  __device__ __forceinline__ SeqInfo in_loop_k() const {
    SeqInfo s = *this;
    s.bidb = opaque(bidb);
    s.start_k = opaque(start_k);
    return s;
  }
};

__device__ __forceinline__ SeqInfo seq_info(const FwdParams& p, int bidb) {
  SeqInfo s;
  s.bidb = bidb;
  s.start_q = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[bidb] : 0;
  s.start_k = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[bidb] : 0;
  s.len_q = p.cu_seqlens_q != nullptr ? p.cu_seqlens_q[bidb + 1] - s.start_q : p.seqlen_q;
  s.len_k = p.cu_seqlens_k != nullptr ? p.cu_seqlens_k[bidb + 1] - s.start_k : p.seqlen_k;
  s.q_packed = p.q_packed;
  s.k_packed = p.k_packed;
  s.rows_q = p.q_packed ? s.len_q : p.seqlen_q;
  s.rows_k = p.k_packed ? s.len_k : p.seqlen_k;
  return s;
}


// ---------------------------------------------------------------------------------------
// The mask band of one sequence (flash.h: FwdParams's mask)
// ---------------------------------------------------------------------------------------
struct Band {
  int len_k;       // keys j >= len_k are masked
  int off;         // diagonal offset: len_k - len_q (bottom-right) or 0
  int left, right; // window (-1: unbounded)
};

__device__ __forceinline__ Band band_of(const FwdParams& p, const SeqInfo& si) {
  return Band{si.len_k, p.bottom_right ? si.len_k - si.len_q : 0, p.window_left,
              p.window_right};
}

// Keys [lo, hi) outside which rows [i_lo, i_hi] keep none (hi <= lo: none at all).
struct KeyRange {
  int lo, hi;
};
__device__ __forceinline__ KeyRange band_keys(const Band& b, int i_lo, int i_hi) {
  KeyRange r{0, b.len_k};
  if (b.right >= 0) r.hi = min(r.hi, i_hi + b.off + b.right + 1);
  if (b.left >= 0) r.lo = max(0, i_lo + b.off - b.left);
  return r;
}

// Query rows [lo, hi) outside which no row keeps a key of [j_lo, j_hi] (hi <= lo: none;
// len_q: the sequence's rows). The backwards walk a key block's query rows with it.
struct RowRange {
  int lo, hi;
};
__device__ __forceinline__ RowRange band_queries(const Band& b, int len_q, int j_lo, int j_hi) {
  RowRange r{0, len_q};
  if (b.right >= 0) r.lo = max(0, j_lo - b.off - b.right);
  if (b.left >= 0) r.hi = min(r.hi, j_hi - b.off + b.left + 1);
  return r;
}

// True if some element of rows [i_lo, i_hi] x columns [j_lo, j_hi] is masked.
__device__ __forceinline__ bool band_cuts(const Band& b, int i_lo, int i_hi, int j_lo, int j_hi) {
  return j_hi >= b.len_k || (b.right >= 0 && j_hi > i_lo + b.off + b.right) ||
         (b.left >= 0 && j_lo < i_hi + b.off - b.left);
}

// ---------------------------------------------------------------------------------------
// Dropout: the Philox words of flash.h's mask
// ---------------------------------------------------------------------------------------
// Philox4x32-10 (Salmon et al., Random123 constants).
__device__ __forceinline__ uint4 philox(uint32_t k0, uint32_t k1, uint4 c) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const uint32_t lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

struct Dropout {
  uint32_t k0, k1, offset, bh, threshold;
  float scale;  // 1 / (1 - p)
};

__device__ __forceinline__ Dropout dropout_of(const FwdParams& p, int bidb, int bidh) {
  Dropout d;
  const uint64_t seed = static_cast<uint64_t>(p.rng_state[0]);
  d.k0 = static_cast<uint32_t>(seed);
  d.k1 = static_cast<uint32_t>(seed >> 32);
  d.offset = static_cast<uint32_t>(p.rng_state[1]);
  d.bh = static_cast<uint32_t>(bidb * p.h + bidh);
  d.threshold = p.dropout_threshold;
  d.scale = p.dropout_scale;
  return d;
}

}  // namespace flash
}  // namespace transformer_fa
