// Launch template of the sm80 family's split-KV decode forward: the stage counts per head dim,
// the choice of the number of splits, and the launches (decode_kernel, decode_combine_kernel).
#pragma once

#include <algorithm>
#include <cmath>

#include "flash/flash.h"
#include "flash/sm80/decode_kernel.cuh"

namespace transformer_fa {
namespace flash {
namespace sm80 {

// Chunks in flight per warp: about 96 KB of stages per CTA, so that two CTAs can share an SM
// (d256: one) where the grid has more CTAs than SMs; one CTA alone keeps enough K/V reads in
// flight to stream at about full speed (choose_decode_splits). The count hardly matters past
// that: at d128, 2 / 3 / 4 stages (three, two and one CTA per SM) ran b=1 sk=32k in
// 50.0 / 50.1 / 48.6 us and b=8 sk=32k in 355 / 351 / 354 us (kernel times, H100, 2026-11-24);
// on the H200 (2026-12-01) 4 / 5 / 6 stages read 0-2% slower than 3 at every split row (b = 1,
// 8, 16: one CTA an SM, where more reads in flight could have helped).
template <typename T, int kHeadDim>
struct DecodeConfig;
template <typename T> struct DecodeConfig<T, 64> { using Traits = DecodeTraits<T, 64, 6>; };
template <typename T> struct DecodeConfig<T, 128> { using Traits = DecodeTraits<T, 128, 3>; };
template <typename T> struct DecodeConfig<T, 192> { using Traits = DecodeTraits<T, 192, 2>; };
template <typename T> struct DecodeConfig<T, 256> { using Traits = DecodeTraits<T, 256, 2>; };

// CTAs of the main kernel per (sequence, KV head) before splitting: one per 16-row tile.
inline int decode_row_tiles(const FwdParams& p) {
  return (p.seqlen_q * (p.h / p.h_k) + 15) / 16;
}

// The number of splits: the one that makes the last wave of CTAs over the GPU's SMs the
// fullest, counted as the time of the busiest SM (waves / splits), among splits that leave
// every warp at least 4 chunks of the longest sequence (fewer and the pipeline never fills).
// Ties (within 5%) go to fewer splits: each adds a partial to write and merge. The SM, not the
// CTA slot, is the unit: an SM with one CTA streams K/V about as fast as with two, so a
// second CTA an SM only adds splits (H200, 2026-12-01: 2 splits of b = 8 beat 4 by 1-2.4%,
// 16 of b = 1 beat 33 by up to 5% from 8k keys).
inline int choose_decode_splits(int units, int sms, int seqlen_k, int warps) {
  const int chunks = (seqlen_k + 15) / 16;
  const int most = std::max(1, std::min(kMaxDecodeSplits, chunks / (4 * warps)));
  int best = 1;
  double best_time = 1e30;
  for (int s = 1; s <= most; ++s) {
    const double waves = std::ceil(double(units) * s / std::max(1, sms));
    const double time = waves / s;
    if (time < best_time * 0.95) {
      best = s;
      best_time = time;
    }
  }
  return best;
}

template <typename T, int kHeadDim>
DecodePlan plan_decode(DecodeParams& p, const Device& device) {
  using Tr = typename DecodeConfig<T, kHeadDim>::Traits;
  constexpr int smem = Tr::kSmemBytes;
  allow_dynamic_smem<&decode_kernel<Tr>>(smem);
  int shift = 0;  // page_shift: log2(page_size) where it is a power of two
  while (shift < 30 && (1 << shift) < p.page_size) ++shift;
  p.page_shift = (1 << shift) == p.page_size ? shift : -1;
  const int units = p.b * p.h_k * decode_row_tiles(p);
  if (p.num_splits <= 0) {
    p.num_splits = choose_decode_splits(units, device.sms, p.seqlen_k, Tr::kNWarps);
  }
  p.num_splits = std::min(p.num_splits, kMaxDecodeSplits);
  // Split rows: each warp writes its own partial (decode_kernel), where the combine kernel
  // has a thread for each.
  const bool per_warp = p.num_splits > 1 && p.num_splits * Tr::kNWarps <= kMaxDecodeSplits;
  p.num_partials = per_warp ? p.num_splits * Tr::kNWarps : p.num_splits;
  DecodePlan plan{};
  plan.smem_bytes = smem;
  plan.accum_floats = p.num_partials > 1 ? int64_t(p.num_partials) * p.accum_rows * kHeadDim : 0;
  plan.lse_floats = p.num_partials > 1 ? int64_t(p.num_partials) * p.accum_rows : 0;
  return plan;
}

template <typename T, int kHeadDim>
void launch_decode(const DecodeParams& p, const Device& device, cudaStream_t stream) {
  using Tr = typename DecodeConfig<T, kHeadDim>::Traits;
  if (p.b == 0 || p.h == 0 || p.seqlen_q == 0) return;
  constexpr int smem = Tr::kSmemBytes;
  allow_dynamic_smem<&decode_kernel<Tr>>(smem);
  const dim3 grid(p.num_splits, p.h_k * decode_row_tiles(p), p.b);
  decode_kernel<Tr><<<grid, Tr::kNThreads, smem, stream>>>(p);
  if (p.num_partials > 1) {
    // Overlapped on sm_90+: the merge's launch and start hide under the decode kernel's tail
    // (as its own launch after it, it cost 2.5-3.5 us of a 50 us call at b = 1, 32k keys).
    launch_overlapped(decode_combine_kernel<T, kHeadDim>, dim3(unsigned(p.accum_rows)),
                      dim3(kMaxDecodeSplits), 0, stream, overlap_launches(device), p);
  }
}

}  // namespace sm80
}  // namespace flash
}  // namespace transformer_fa
