// FP8 cast + transpose (+ GELU / dgelu, amax, column sums) of a 16-bit 2-D tensor: see
// cast_transpose.h. One CTA of 128 threads casts a 64 x 128 tile:
// - thread (rg, cg) = (t / 16, t % 16) loads rows rg*8 .. rg*8+7 of columns cg*8 .. cg*8+7
//   (eight 16-byte loads; a half-warp reads 256 contiguous bytes of a row);
// - the row-major output: 8 bytes per row and thread;
// - the transposed output: for each of its 8 columns the thread holds 8 consecutive rows,
//   packed into 8 bytes and stored to a shared [column][64 bytes] tile (16-byte chunks
//   swizzled so that a warp's stores spread over all banks); after a barrier, thread c copies
//   column c's 64 bytes to out_t with 16-byte stores.
// The scale math is IEEE whatever the build's fast-math flags (fp8.py's PyTorch path: the
// same product, the same inverse scale, subnormals kept); satfinite conversion = clamping to
// the format's largest value (the binding checks fp8_max is it), NaN kept.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>

#include "fp8/cast_transpose.h"

namespace transformer_fa {
namespace fp8 {
namespace {

constexpr int kThreads = 128;
constexpr int kVec = 8;                                   // 16-bit elements in 16 bytes
constexpr int kColGroups = kCastTileCols / kVec;          // 16 threads across a tile row
constexpr int kRowGroups = kThreads / kColGroups;         // 8
constexpr int kRowsPerThread = kCastTileRows / kRowGroups;  // 8
constexpr int kChunks = kCastTileRows / 16;               // 16-byte chunks of a column
static_assert(kRowsPerThread == 8 && kVec == 8, "a thread packs 8 rows of 8 columns");

// torch's tanh GELU in the exp2 form of kernels/bias_grad.py: exp(-2y) = 2^(x (c + ck x^2))
constexpr float kExp2C = -2.302208198144325f;
constexpr float kExp2CK = -0.1029432395800235f;
constexpr float kTwoBeta = 1.5957691216057308f;
constexpr float kSixBetaKappa = 0.21406444881780076f;

__device__ __forceinline__ float div_rn(float a, float b) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float mul_rn(float a, float b) {
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float exp_minus_2y(float x) {
  return exp2f(x * fmaf(x * x, kExp2CK, kExp2C));
}

__device__ __forceinline__ float gelu(float x) { return x / (1.0f + exp_minus_2y(x)); }

// dy * gelu'(h): gelu'(h) = s + h s (1 - s) (2 beta + 6 beta kappa h^2), 1 - s = e s
__device__ __forceinline__ float dgelu(float dy, float h) {
  const float e = exp_minus_2y(h);
  const float s = 1.0f / (1.0f + e);
  const float one_minus_s = e < INFINITY ? e * s : 1.0f;
  return dy * (s + h * s * one_minus_s * fmaf(h * h, kSixBetaKappa, kTwoBeta));
}

template <bool kBf16>
__device__ __forceinline__ void unpack(const uint4& raw, float (&v)[kVec]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint16_t lo = w[k] & 0xFFFF, hi = w[k] >> 16;
    if constexpr (kBf16) {
      v[2 * k] = __uint_as_float(uint32_t(lo) << 16);
      v[2 * k + 1] = __uint_as_float(uint32_t(hi) << 16);
    } else {
      v[2 * k] = __half2float(__ushort_as_half(lo));
      v[2 * k + 1] = __half2float(__ushort_as_half(hi));
    }
  }
}

// two floats -> two FP8 bytes (a in the low byte), round to nearest even, saturating
template <bool kE5M2>
__device__ __forceinline__ uint32_t fp8x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE,
                                  kE5M2 ? __NV_E5M2 : __NV_E4M3);
}

// fp8.compute_scale(amax, 1, fp8_max): fp8_max / amax where amax is positive and finite
// (else 1), float32's max where that overflows
__device__ __forceinline__ float scale_from_amax(float amax, float fp8_max) {
  float s = div_rn(fp8_max, amax);
  if (!(amax > 0.0f && amax < INFINITY)) s = 1.0f;
  return fabsf(s) == INFINITY ? FLT_MAX : s;
}

// The thread's 8 rows x 8 columns of y = x, gelu(x) or dgelu(x, h) in float32, from the tile
// at (row0, col0): loads first, all in flight, then the math. Lanes past the tensor are 0
// (gelu(0) = dgelu(0, h) = 0).
template <bool kBf16, Activation kAct>
__device__ __forceinline__ void load_y(const CastParams& p, int64_t row0, int64_t col, int rg,
                                       float (&y)[kRowsPerThread][kVec]) {
  const bool col_in = col < p.cols;  // cols % 8 == 0: a vector is all in or all out
  uint4 raw[kRowsPerThread], raw_h[kAct == Activation::kDgelu ? kRowsPerThread : 1];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    const int64_t row = row0 + rg * kRowsPerThread + i;
    const bool in = col_in && row < p.rows;
    raw[i] = in ? __ldg(reinterpret_cast<const uint4*>(
                      static_cast<const uint16_t*>(p.x) + row * p.x_row_stride + col))
                : make_uint4(0, 0, 0, 0);
    if constexpr (kAct == Activation::kDgelu) {
      raw_h[i] = in ? __ldg(reinterpret_cast<const uint4*>(
                          static_cast<const uint16_t*>(p.h) + row * p.h_row_stride + col))
                    : make_uint4(0, 0, 0, 0);
    }
  }
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    unpack<kBf16>(raw[i], y[i]);
    if constexpr (kAct == Activation::kGelu) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[i][j] = gelu(y[i][j]);
    } else if constexpr (kAct == Activation::kDgelu) {
      float h[kVec];
      unpack<kBf16>(raw_h[i], h);
#pragma unroll
      for (int j = 0; j < kVec; ++j) y[i][j] = dgelu(y[i][j], h[j]);
    }
  }
}

// max |y| of the CTA into *amax_bits: |y| as integer bits (for non-negative floats the
// integer order is the float order, NaN above inf: it propagates, as in torch.amax), one
// atomicMax per CTA. Every thread calls it; it ends with a barrier.
__device__ __forceinline__ void fold_block_amax(const float (&y)[kRowsPerThread][kVec],
                                                int* amax_bits) {
  __shared__ int warp_amax[kThreads / 32];
  int m = 0;
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i)
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = max(m, __float_as_int(y[i][j]) & 0x7FFFFFFF);
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {  // (m is warp 0's already)
#pragma unroll
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, warp_amax[w]);
    atomicMax(amax_bits, m);
  }
}

// The amax pass of current scaling (fold_amax): max |y| over the tensor, nothing written.
template <bool kBf16, Activation kAct>
__global__ void __launch_bounds__(kThreads) amax_kernel(const CastParams p) {
  const int t = threadIdx.x, cg = t % kColGroups, rg = t / kColGroups;
  float y[kRowsPerThread][kVec];
  load_y<kBf16, kAct>(p, int64_t(blockIdx.x) * kCastTileRows,
                      int64_t(blockIdx.y) * kCastTileCols + cg * kVec, rg, y);
  fold_block_amax(y, p.amax_bits);
}

template <bool kBf16, bool kE5M2, Activation kAct, bool kDbias>
__global__ void __launch_bounds__(kThreads) cast_transpose_kernel(const CastParams p) {
  // column c's 64 bytes (rows of the tile) as 4 chunks, chunk k stored at k ^ swizzle(c)
  __shared__ uint4 tile_t[kCastTileCols][kChunks];
  __shared__ float partial_sums[kDbias ? kRowGroups : 1][kCastTileCols];

  const int t = threadIdx.x, cg = t % kColGroups, rg = t / kColGroups;
  const int64_t row0 = int64_t(blockIdx.x) * kCastTileRows;
  const int64_t col0 = int64_t(blockIdx.y) * kCastTileCols;
  const int64_t col = col0 + cg * kVec;
  const bool col_in = col < p.cols;
  float y[kRowsPerThread][kVec];
  load_y<kBf16, kAct>(p, row0, col, rg, y);

  if (p.amax_bits != nullptr) fold_block_amax(y, p.amax_bits);  // (uniform branch)
  if constexpr (kDbias) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      float s = 0.0f;
#pragma unroll
      for (int i = 0; i < kRowsPerThread; ++i) s += y[i][j];
      partial_sums[rg][cg * kVec + j] = s;
    }
  }

  float scale = *p.scale;
  if (p.scale_from_amax) scale = scale_from_amax(scale, p.fp8_max);
  if (p.scale_inv != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && t == 0) {
    *p.scale_inv = div_rn(1.0f, scale);
  }

  // quantize: q[i] holds row i's 8 bytes (column j in byte j)
  uint2 q[kRowsPerThread];
#pragma unroll
  for (int i = 0; i < kRowsPerThread; ++i) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = fp8x2<kE5M2>(mul_rn(y[i][2 * k], scale), mul_rn(y[i][2 * k + 1], scale));
    }
    q[i] = make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
  }
  if (p.out != nullptr && col_in) {
#pragma unroll
    for (int i = 0; i < kRowsPerThread; ++i) {
      const int64_t row = row0 + rg * kRowsPerThread + i;
      if (row < p.rows) {
        *reinterpret_cast<uint2*>(static_cast<uint8_t*>(p.out) + row * p.cols + col) = q[i];
      }
    }
  }

  // the transpose: column j's 8 bytes (rows 0..7 of this thread) into one uint2, stored at
  // its column's chunk rg / 2, half rg % 2. The columns go in the order j ^ (cg & 1) and the
  // chunk index is XORed with (cg >> 1) & 3: a warp's 32 stores of 8 bytes then fill all 32
  // banks twice (the fewest wavefronts for 256 bytes)
#pragma unroll
  for (int jj = 0; jj < kVec; ++jj) {
    const int j = jj ^ (cg & 1);
    const int shift = 8 * (j % 4);
    const bool high = j >= 4;
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      lo |= (((high ? q[i].y : q[i].x) >> shift) & 0xFF) << (8 * i);
      hi |= (((high ? q[i + 4].y : q[i + 4].x) >> shift) & 0xFF) << (8 * i);
    }
    const int c = cg * kVec + j;
    const int chunk = (rg / 2) ^ ((c >> 4) & 3);
    reinterpret_cast<uint2*>(&tile_t[c][chunk])[rg % 2] = make_uint2(lo, hi);
  }
  __syncthreads();  // the transposed tile and the partial sums are complete

  // thread t: column col0 + t of out_t, rows row0 .. row0 + 63 (rows % 16 == 0: whole chunks)
  const int64_t c_out = col0 + t;
  if (c_out < p.cols) {
    uint8_t* dst = static_cast<uint8_t*>(p.out_t) + c_out * p.rows + row0;
#pragma unroll
    for (int k = 0; k < kChunks; ++k) {
      if (row0 + 16 * k < p.rows) {
        reinterpret_cast<uint4*>(dst)[k] = tile_t[t][k ^ ((t >> 4) & 3)];
      }
    }
    if constexpr (kDbias) {
      float s = 0.0f;  // the row groups in order: the same sums on every run
#pragma unroll
      for (int r = 0; r < kRowGroups; ++r) s += partial_sums[r][t];
      p.col_sums[int64_t(blockIdx.x) * p.cols + c_out] = s;
    }
  }
}

template <bool kBf16, bool kE5M2, Activation kAct, bool kDbias>
void launch(const CastParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.rows + kCastTileRows - 1) / kCastTileRows),
                  static_cast<unsigned>((p.cols + kCastTileCols - 1) / kCastTileCols));
  cast_transpose_kernel<kBf16, kE5M2, kAct, kDbias><<<grid, kThreads, 0, stream>>>(p);
}

template <bool kBf16, bool kE5M2>
void launch_activation(const CastParams& p, cudaStream_t stream) {
  const bool dbias = p.col_sums != nullptr;
  switch (p.activation) {
    case Activation::kGelu:  // an activation's cast: no column sums (binding)
      launch<kBf16, kE5M2, Activation::kGelu, false>(p, stream);
      break;
    case Activation::kDgelu:
      dbias ? launch<kBf16, kE5M2, Activation::kDgelu, true>(p, stream)
            : launch<kBf16, kE5M2, Activation::kDgelu, false>(p, stream);
      break;
    default:
      dbias ? launch<kBf16, kE5M2, Activation::kNone, true>(p, stream)
            : launch<kBf16, kE5M2, Activation::kNone, false>(p, stream);
  }
}

template <bool kBf16>
void launch_amax(const CastParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((p.rows + kCastTileRows - 1) / kCastTileRows),
                  static_cast<unsigned>((p.cols + kCastTileCols - 1) / kCastTileCols));
  switch (p.activation) {
    case Activation::kGelu:
      amax_kernel<kBf16, Activation::kGelu><<<grid, kThreads, 0, stream>>>(p);
      break;
    case Activation::kDgelu:
      amax_kernel<kBf16, Activation::kDgelu><<<grid, kThreads, 0, stream>>>(p);
      break;
    default:
      amax_kernel<kBf16, Activation::kNone><<<grid, kThreads, 0, stream>>>(p);
  }
}

}  // namespace

void run_amax(const CastParams& p, cudaStream_t stream) {
  p.bf16 ? launch_amax<true>(p, stream) : launch_amax<false>(p, stream);
}

void run_cast_transpose(const CastParams& p, cudaStream_t stream) {
  if (p.bf16) {
    p.e5m2 ? launch_activation<true, true>(p, stream) : launch_activation<true, false>(p, stream);
  } else {
    p.e5m2 ? launch_activation<false, true>(p, stream)
           : launch_activation<false, false>(p, stream);
  }
}

}  // namespace fp8
}  // namespace transformer_fa
