// Launch template of the sm90 family's backward: the tile configs, the plan (the sm80
// family's dq_accum layout with one split, GQA's dK / dV accumulators after it, deterministic
// mode's counts after those, this kernel's shared memory) and the launches (dsum and dq_accum
// zeroing, main, dQ conversion; GQA: the accumulators' zeroing and their conversion;
// deterministic: the counts' zeroing; the conversions are the sm80 family's kernel). The binding runs it only for calls that bwd_declines (bwd_support.h) accepts.
#pragma once

#include "flash/sm90/cute_config.h"  // first: before any CuTe header

#include "flash/common/launch.cuh"
#include "flash/flash.h"
#include "flash/sm80/bwd_launch.cuh"
#include "flash/sm90/bwd_kernel.cuh"
#include "flash/sm90/bwd_kernel_d256.cuh"
#include "flash/sm90/bwd_support.h"
#include "flash/sm90/fwd_launch.cuh"  // CuteElement, tma_rows

namespace transformer_fa {
namespace flash {
namespace sm90 {

// Tile configs per head dim: 128 key rows per CTA (two consumer warpgroups of 64), two Q / dO
// stages. d128: 64 query rows per step (FlashAttention-3's tile; dQ's columns split between
// the warpgroups). d64: 128 query rows per step (dQ's rows split between the warpgroups: 32
// columns each would cut K^T's 64-wide swizzle atoms). Three Q / dO stages in the shared
// memory of one of the two dQ buffers measured even at d128 and 1-2% slower at d64 (H200,
// 2026-12-01).
template <class Element, int kHeadDim> struct BwdTile;
template <class Element> struct BwdTile<Element, 64> {
  using Config = BwdConfig<Element, 64, 128, 128, 2>;
};
template <class Element> struct BwdTile<Element, 128> {
  using Config = BwdConfig<Element, 128, 64, 128, 2>;
};
// d256: FlashAttention-3's 64 query x 80 key tile, its own kernel (bwd_kernel_d256.cuh).
template <class Element> struct BwdTile<Element, 256> {
  using Config = BwdConfigD256<Element>;
};

template <class T, int kHeadDim>
using BwdConfigOf = typename BwdTile<typename CuteElement<T>::type, kHeadDim>::Config;

// The dq_accum layout and its zeroing are the sm80 family's (its dsum and dQ conversion
// kernels run here too), with one split also in deterministic mode, which orders the
// additions itself (turns_of). GQA: dK's and dV's accumulators (kv_accum) follow in the same
// allocation, then deterministic mode's counts.
template <class T, int kHeadDim>
BwdPlan plan_bwd(BwdParams& p, const Device& device) {
  using Cfg = BwdConfigOf<T, kHeadDim>;
  BwdPlan plan = sm80::plan_bwd<T, kHeadDim>(p, device);
  p.num_splits = 1;
  Turns const turns = turns_of<Cfg::kBlockM, Cfg::kBlockN>(p);
  plan.dq_accum_floats = turns.offset + turns.dq_count + turns.kv_count;
  plan.smem_bytes = int(sizeof(typename Cfg::SharedStorage));
  return plan;
}

// GQA: params as the dQ conversion (sm80::convert_dq_kernel) reads them, describing dK's
// (dv = false) or dV's accumulator and output instead: one split, h_k heads, k-side rows.
inline BwdParams kv_conversion(const BwdParams& p, bool dv) {
  KvAccum const acc = kv_accum(p);
  BwdParams c = p;
  c.dq_accum = p.dq_accum + acc.offset + (dv ? acc.floats : 0);
  c.num_splits = 1;
  c.h = p.h_k;
  c.dqa_rows = acc.rows;
  c.dqa_head_stride = acc.head_stride;
  c.dqa_batch_stride = acc.batch_stride;
  c.dq_rows = int64_t(p.k_packed ? 1 : p.b) * p.h_k * acc.rows;
  c.dq = dv ? p.dv : p.dk;
  c.dq_batch_stride = dv ? p.dv_batch_stride : p.dk_batch_stride;
  c.dq_row_stride = dv ? p.dv_row_stride : p.dk_row_stride;
  c.dq_head_stride = dv ? p.dv_head_stride : p.dk_head_stride;
  c.scale_softmax = dv ? 1.f : p.scale_softmax;  // dK's scale (the kernel adds it unscaled)
  return c;
}

// dq = dq_accum * scale (the sm80 family's kernel, one thread per 8 elements).
template <class T>
void convert(const BwdParams& p, cudaStream_t stream) {
  const int64_t chunks = p.dq_rows * (p.d / 8);
  if (chunks > 0) {
    sm80::convert_dq_kernel<T><<<unsigned((chunks + 255) / 256), 256, 0, stream>>>(p);
  }
}

// Deterministic mode's rotation (bwd_kernel's Params, Rotation): unmasked, every key block of a
// sequence sees every query block; in order, all N would start at query block 0 and each wait
// there for the one before it (a wavefront of one addition's latency per key block: 0.80-0.84
// of the default backward at d64 512-4k, H200, 2026-11-28; 0.94-0.99 rotated, 2026-12-02).
// Rotated, key block n starts at query block n * M / N (M query blocks) and waits only on
// blocks that reached its query block before it. Those may have been launched after it, so the
// N key blocks of a sequence and head must be resident together: taken where N (the most of a
// sequence: seqlen_k is the bound) is at most half the SMs (one CTA an SM), else the order
// of turns_of.
inline bool dq_rotates(const BwdParams& a, int block_n, const Device& device) {
  int const n = (a.seqlen_k + block_n - 1) / block_n;
  return a.deterministic && a.window_left < 0 && a.window_right < 0 && n > 1 &&
         2 * n <= device.sms;
}

// kCausal, kLocal: the kernel's mask cases (bwd_kernel).
template <class Cfg, bool kCausal, bool kLocal>
void launch_main(const BwdParams& a, const Device& device, cudaStream_t stream) {
  using Element = typename Cfg::Element;
  // (rows, d, heads, batch) tensors (tma_rows, fwd_launch.cuh); d at most the kernel's head
  // dim: TMA zero-fills the tiles' columns past it
  auto rows = [&](const void* ptr, bool packed, int64_t tokens, int seqlen, int heads,
                  int64_t row_stride, int64_t head_stride, int64_t batch_stride) {
    TmaRows const r = tma_rows(packed, tokens, seqlen, a.b, row_stride, batch_stride);
    return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)),
                       make_shape(r.rows, a.d, heads, r.batches),
                       make_stride(row_stride, _1{}, head_stride, r.batch_stride));
  };
  auto mQ = rows(a.q, a.q_packed, a.q_tokens, a.seqlen_q, a.h, a.q_row_stride, a.q_head_stride,
                 a.q_batch_stride);
  auto mdO = rows(a.dout, a.q_packed, a.q_tokens, a.seqlen_q, a.h, a.do_row_stride,
                  a.do_head_stride, a.do_batch_stride);
  auto mK = rows(a.k, a.k_packed, a.kv_tokens, a.seqlen_k, a.h_k, a.k_row_stride,
                 a.k_head_stride, a.k_batch_stride);
  auto mV = rows(a.v, a.k_packed, a.kv_tokens, a.seqlen_k, a.h_k, a.v_row_stride,
                 a.v_head_stride, a.v_batch_stride);
  auto tile_q = Shape<Int<Cfg::kBlockM>, Int<Cfg::kHeadDim>>{};
  auto tile_k = Shape<Int<Cfg::kBlockN>, Int<Cfg::kHeadDim>>{};
  auto smem_q = typename Cfg::SmemTileQ{};
  auto smem_k = typename Cfg::SmemTileK{};
  typename Cfg::Params p{make_tma_copy(SM90_TMA_LOAD{}, mQ, smem_q, tile_q, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mdO, smem_q, tile_q, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mK, smem_k, tile_k, _1{}),
                         make_tma_copy(SM90_TMA_LOAD{}, mV, smem_k, tile_k, _1{}),
                         mQ.shape(), mK.shape(), a,
                         dq_rotates(a, Cfg::kBlockN, device),
                         bwd_group_heads(a, device, a.h, Cfg::kHeadDim, sizeof(Element))};

  constexpr auto kernel = [] {
    if constexpr (Cfg::kDqFromRegisters) {
      return bwd_kernel_d256<Cfg, kCausal, kLocal>;
    } else {
      return bwd_kernel<Cfg, kCausal, kLocal>;
    }
  }();
  static_assert(sizeof(typename Cfg::SharedStorage) <= 227 * 1024, "over sm90's shared memory");
  const int smem_bytes = int(sizeof(typename Cfg::SharedStorage));
  allow_dynamic_smem<kernel>(smem_bytes);
  dim3 grid((a.seqlen_k + Cfg::kBlockN - 1) / Cfg::kBlockN, a.h, a.b);
  kernel<<<grid, Cfg::kThreads, smem_bytes, stream>>>(p);
}

template <class T, int kHeadDim>
void launch_bwd(const BwdParams& params, const Device& device, cudaStream_t stream) {
  using Cfg = BwdConfigOf<T, kHeadDim>;
  if (params.b == 0 || params.h == 0) return;
  sm80::launch_dot_do_o<T, kHeadDim>(params, stream);  // dsum, the zeroed dq_accum
  const bool gqa = params.h != params.h_k;
  if (gqa) {
    KvAccum const acc = kv_accum(params);
    cudaMemsetAsync(params.dq_accum + acc.offset, 0, 2 * acc.floats * sizeof(float), stream);
  }
  Turns const turns = turns_of<Cfg::kBlockM, Cfg::kBlockN>(params);
  if (turns.dq_count + turns.kv_count > 0) {
    cudaMemsetAsync(params.dq_accum + turns.offset, 0,
                    (turns.dq_count + turns.kv_count) * sizeof(int), stream);
  }
  if (params.seqlen_k > 0) {
    // A left window bound (with or without a right one), a right bound alone (causal: 0), none.
    if (params.window_left >= 0) {
      launch_main<Cfg, false, true>(params, device, stream);
    } else if (params.window_right >= 0) {
      launch_main<Cfg, true, false>(params, device, stream);
    } else {
      launch_main<Cfg, false, false>(params, device, stream);
    }
  }
  convert<T>(params, stream);
  if (gqa) {
    convert<T>(kv_conversion(params, false), stream);
    convert<T>(kv_conversion(params, true), stream);
  }
}

}  // namespace sm90
}  // namespace flash
}  // namespace transformer_fa
