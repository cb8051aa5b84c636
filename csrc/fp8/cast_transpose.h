// The FP8 cast of a 16-bit 2-D tensor into both orientations in one read (TE's
// cast_transpose): y = x, gelu(x) or dgelu(x, h), then fp8(y * scale) row-major (optional) and
// transposed, with y's amax and column sums on the way. The Triton kernel
// (transformer_fa/kernels/fp8_cast.py) does the same; Triton converts the transposed tile as
// FP8 bytes through shared memory, this kernel packs eight rows' bytes of a column into one
// 8-byte word before the exchange. No torch types here: the binding fills CastParams.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace transformer_fa {
namespace fp8 {

enum class Activation : int { kNone = 0, kGelu = 1, kDgelu = 2 };

struct CastParams {
  const void* x;           // [rows, cols], unit column stride, 16-byte aligned rows
  int64_t x_row_stride;    // in elements
  const void* h;           // kDgelu: GELU's input h, x's shape; else unused
  int64_t h_row_stride;
  void* out;               // FP8 [rows, cols] row-major, or null
  void* out_t;             // FP8 [cols, rows]
  const float* scale;      // the scale; with scale_from_amax, y's amax to compute it from
  bool scale_from_amax;    // scale = fp8_max / amax (fp8.compute_scale, no margin)
  float fp8_max;           // the FP8 format's largest finite value
  float* scale_inv;        // 1 / scale, written once, or null
  int* amax_bits;          // max(amax, max|y|) as float bits (atomicMax), or null
  float* col_sums;         // [row tiles, cols]: y's float32 column sums per tile, or null
  int64_t rows, cols;      // rows % 16 == 0, cols % 8 == 0
  bool bf16;               // x (and h) bfloat16, else float16
  bool e5m2;               // FP8 E5M2, else E4M3
  Activation activation;
};

// The tile one CTA casts; col_sums has a row per kCastTileRows rows.
constexpr int kCastTileRows = 64;
constexpr int kCastTileCols = 128;

void run_cast_transpose(const CastParams& p, cudaStream_t stream);

// The amax pass of current scaling: *amax_bits = max(*amax_bits, max|y| bits) over the tensor,
// nothing else written (reads x, h, rows, cols, bf16, activation and amax_bits).
void run_amax(const CastParams& p, cudaStream_t stream);

}  // namespace fp8
}  // namespace transformer_fa
