// pybind11 binding of transformer_fa's flash kernels: torch tensors -> FwdParams -> launch.
// The only translation unit that sees torch; the kernels (csrc/flash/) see the params struct.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <pybind11/stl.h>

#include <cmath>
#include <iterator>
#include <string>

#include "flash/dispatch.h"
#include "flash/flash.h"
#include "flash/sm90/bwd_support.h"
#include "flash/sm90/fwd_support.h"
#ifdef TRANSFORMER_FA_FP8_CAST
#include "fp8/cast_transpose.h"
#endif

namespace tf = transformer_fa::flash;

namespace {

enum Format : int64_t { kBSHD = 0, kSBHD = 1, kTHD = 2 };

// Numbers, shapes and devices in the error messages are strings before they reach
// TORCH_CHECK: with some toolchains (that of the lent H100's image) c10::str crashes the
// process when it formats an integer itself, so a bad input would segfault, not raise.
std::string num(int64_t x) { return std::to_string(x); }
std::string dims(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

struct Strides {
  int64_t batch, row, head;
};

Strides strides_of(const at::Tensor& t, int64_t fmt) {
  if (fmt == kTHD) return {0, t.stride(0), t.stride(1)};
  if (fmt == kSBHD) return {t.stride(1), t.stride(0), t.stride(2)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

void check_layout(const at::Tensor& t, const char* name, int64_t fmt) {
  TORCH_CHECK(t.is_cuda(), "flash_attn: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == (fmt == kTHD ? 3 : 4), "flash_attn: ", name, " must be ",
              fmt == kTHD ? "[t, h, d]" : "4-D (sbhd or bshd)", ", got ", dims(t.sizes()));
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn: ", name, " must have a unit stride in d");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "flash_attn: ", name, " must be 16-byte aligned");
}

// (q, k and v: after their head dim's check, since a head dim of 0 gives strides that are no
// multiple of 8, and the error should name the head dim)
void check_strides(const at::Tensor& t, const char* name) {
  for (int i = 0; i < t.dim() - 1; ++i) {
    TORCH_CHECK(t.size(i) == 1 || t.stride(i) % 8 == 0, "flash_attn: ", name,
                " strides must be multiples of 8 elements (16 bytes), got ", dims(t.strides()));
  }
}

void check_tensor(const at::Tensor& t, const char* name, int64_t fmt) {
  check_layout(t, name, fmt);
  check_strides(t, name);
}

void check_cu(const c10::optional<at::Tensor>& cu, const char* name, int64_t b,
              const at::Tensor& q) {
  if (!cu.has_value()) return;
  TORCH_CHECK(cu->is_cuda() && cu->device() == q.device(), "flash_attn: ", name,
              " must be on ", q.device().str());
  TORCH_CHECK(cu->scalar_type() == at::kInt, "flash_attn: ", name, " must be int32");
  TORCH_CHECK(cu->dim() == 1 && cu->is_contiguous() && cu->numel() == b + 1,
              "flash_attn: ", name, " must be contiguous [b + 1] with b = ", num(b));
}

// Device attributes, cached per device (queried on every call otherwise).
const tf::Device& device_info(int device) {
  static tf::Device cached[64];
  static tf::Device other;
  tf::Device& info = device >= 0 && device < 64 ? cached[device] : other;
  if (info.arch == 0) {
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.smem_optin,
                                          cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&info.l2_bytes, cudaDevAttrL2CacheSize, device));
    info.arch = major * 10 + minor;
  }
  return info;
}

// Which family a forward asks for: 0 the fastest that serves the call, else an Arch value
// (TRANSFORMER_FA_FLASH_FAMILY, for tests and benchmarks).
constexpr int kAnyFamily = 0;

// The family that runs a forward on a GPU of compute capability `arch`: sm90 where this build
// has its kernel and it serves the call (where it is the faster family: fwd_support.h), else
// sm80, which serves every
// call. `why_not_sm90` says why sm90 was not taken, when it was not.
tf::Arch fwd_family(const tf::FwdParams& p, int arch, bool bf16, int requested,
                    std::string& why_not_sm90) {
  const char* declined = tf::sm90::fwd_declines(p, arch);
  if (requested == static_cast<int>(tf::Arch::kSm80)) {
    why_not_sm90 = "the sm80 family was requested";
  } else if (declined != nullptr) {
    why_not_sm90 = declined;
  } else if (!tf::has_fwd(tf::Arch::kSm90, bf16, tf::family_head_dim(tf::Arch::kSm90, p.d))) {
    why_not_sm90 = "this build has no sm90 kernel for this dtype and head dim";
  } else {
    return tf::Arch::kSm90;
  }
  return tf::Arch::kSm80;
}

// The family that runs a backward: sm90 where this build has its kernel and bwd_declines
// accepts the call (measured faster than sm80 at every grid row it serves: H100, 2026-11-25,
// d64 / d128, s 512-16k, causal or not; H200, 2026-11-28, d256), unless sm80 is requested;
// sm80 otherwise. Either family reads the LSE that either family's forward writes (float32,
// natural log, same layout). `why_not_sm90` says why sm90 was not taken, when it was not.
tf::Arch bwd_family(const tf::BwdParams& p, int arch, bool bf16, int requested,
                    std::string& why_not_sm90) {
  const char* declined = tf::sm90::bwd_declines(p, arch);
  if (requested == static_cast<int>(tf::Arch::kSm80)) {
    why_not_sm90 = "the sm80 family was requested";
  } else if (declined != nullptr) {
    why_not_sm90 = declined;
  } else if (!tf::has_bwd(tf::Arch::kSm90, bf16, tf::family_head_dim(tf::Arch::kSm90, p.d))) {
    why_not_sm90 = "this build has no sm90 backward kernel for this dtype and head dim";
  } else {
    return tf::Arch::kSm90;
  }
  return tf::Arch::kSm80;
}

// A family argument's check (fwd, bwd: `op` names the call).
void check_family(const char* op, int64_t family) {
  TORCH_CHECK(family == kAnyFamily || family == static_cast<int>(tf::Arch::kSm80) ||
                  family == static_cast<int>(tf::Arch::kSm90),
              op, ": family must be 0 (any), 80 or 90, got ", num(family));
}

// Checks q, k, v, the lengths and the mask arguments, and fills the parameters the forward
// and the backward share. Returns the batch size. kv_paged: k and v are page pools (bshd,
// one page per batch row), not the sequences' rows; max_seqlen_k bounds the keys.
int64_t fill_common(tf::FwdParams& p, const char* op, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const c10::optional<at::Tensor>& cu_seqlens_q,
                    const c10::optional<at::Tensor>& cu_seqlens_k, int64_t q_format,
                    int64_t kv_format, int64_t max_seqlen_q, int64_t max_seqlen_k,
                    double softmax_scale, int64_t window_left, int64_t window_right,
                    bool bottom_right, double dropout_p,
                    const c10::optional<at::Tensor>& rng_state,
                    const c10::optional<at::Tensor>& alibi_slopes, bool kv_paged = false) {
  TORCH_CHECK(q_format >= 0 && q_format <= 2 && kv_format >= 0 && kv_format <= 2, op,
              ": formats are 0 (bshd), 1 (sbhd), 2 (thd)");
  check_layout(q, "q", q_format);
  check_layout(k, "k", kv_format);
  check_layout(v, "v", kv_format);
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), op,
              ": q, k, v must be on one device");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": only float16 and bfloat16 are supported");
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, op,
              ": q, k, v must have one dtype");
  const int64_t d = q.size(-1);
  // The head dims of the sm80 family, which serves every call the binding takes (the bound
  // first: it keeps the narrowing to int exact; d = 0 would reach the kernels as an empty tile).
  constexpr int kMaxHeadDim = tf::kKernelHeadDims[std::size(tf::kKernelHeadDims) - 1];
  TORCH_CHECK(d > 0 && d % 8 == 0 && d <= kMaxHeadDim &&
                  tf::family_head_dim(tf::Arch::kSm80, static_cast<int>(d)) > 0,
              op, ": head dim ", num(d),
              " must be a positive multiple of 8, at most 256");
  TORCH_CHECK(k.size(-1) == d && v.size(-1) == d, op, ": q, k and v must have one head dim");
  check_strides(q, "q");
  check_strides(k, "k");
  check_strides(v, "v");
  const int64_t h = q.size(-2), h_k = k.size(-2);
  TORCH_CHECK(v.size(-2) == h_k && h_k > 0 && h % h_k == 0, op, ": heads of q (", num(h),
              ") must be a multiple of those of k/v (", num(h_k), ")");
  TORCH_CHECK(k.sizes().slice(0, k.dim() - 1) == v.sizes().slice(0, v.dim() - 1), op,
              ": k and v must have the same shape up to d");

  const bool q_thd = q_format == kTHD, k_thd = kv_format == kTHD;
  TORCH_CHECK(!q_thd || cu_seqlens_q.has_value(), op, ": thd q needs cu_seqlens_q");
  TORCH_CHECK(!k_thd || cu_seqlens_k.has_value(), op, ": thd k/v needs cu_seqlens_k");
  TORCH_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(), op,
              ": give both cu_seqlens or neither");
  const int64_t b = cu_seqlens_q.has_value() ? cu_seqlens_q->numel() - 1
                                             : (q_format == kSBHD ? q.size(1) : q.size(0));
  TORCH_CHECK(b <= tf::kMaxGridYZ && h <= tf::kMaxGridYZ, op, ": at most ",
              num(tf::kMaxGridYZ), " sequences and heads per call, got batch ", num(b), " and ",
              num(h), " heads");
  check_cu(cu_seqlens_q, "cu_seqlens_q", b, q);
  check_cu(cu_seqlens_k, "cu_seqlens_k", b, q);
  if (!q_thd) TORCH_CHECK((q_format == kSBHD ? q.size(1) : q.size(0)) == b, op, ": batch mismatch");
  if (!k_thd && !kv_paged) {
    TORCH_CHECK((kv_format == kSBHD ? k.size(1) : k.size(0)) == b, op, ": batch mismatch");
  }
  const int64_t seqlen_q = q_thd ? max_seqlen_q : (q_format == kSBHD ? q.size(0) : q.size(1));
  const int64_t seqlen_k = k_thd || kv_paged ? max_seqlen_k
                                             : (kv_format == kSBHD ? k.size(0) : k.size(1));
  TORCH_CHECK(seqlen_q >= 0 && seqlen_k >= 0, op, ": negative max_seqlen");
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, op, ": dropout_p must be in [0, 1)");
  if (dropout_p > 0.0) {
    TORCH_CHECK(rng_state.has_value() && rng_state->is_cuda() &&
                    rng_state->device() == q.device() && rng_state->scalar_type() == at::kLong &&
                    rng_state->numel() == 2 && rng_state->is_contiguous(),
                op, ": dropout needs rng_state, a contiguous int64 [2] (seed, offset) on ",
                q.device().str());
  }
  if (alibi_slopes.has_value()) {
    const auto& a = *alibi_slopes;
    TORCH_CHECK(a.is_cuda() && a.device() == q.device() && a.scalar_type() == at::kFloat &&
                    a.is_contiguous() &&
                    ((a.dim() == 1 && a.size(0) == h) ||
                     (a.dim() == 2 && a.size(0) == b && a.size(1) == h)),
                op, ": alibi_slopes must be contiguous float32 [h] or [b, h] on ",
                q.device().str());
  }
  TORCH_CHECK(device_info(q.get_device()).arch >= 80, op, ": needs an sm80 or newer GPU");

  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  const Strides sq_ = strides_of(q, q_format), sk = strides_of(k, kv_format),
                sv = strides_of(v, kv_format);
  p.q_batch_stride = sq_.batch; p.q_row_stride = sq_.row; p.q_head_stride = sq_.head;
  p.k_batch_stride = sk.batch;  p.k_row_stride = sk.row;  p.k_head_stride = sk.head;
  p.v_batch_stride = sv.batch;  p.v_row_stride = sv.row;  p.v_head_stride = sv.head;
  // lse (and the backward's dsum): [h, t] for thd q, else [b, h, sq].
  if (q_thd) {
    p.lse_batch_stride = 0; p.lse_head_stride = q.size(0); p.lse_row_stride = 1;
  } else {
    p.lse_batch_stride = h * seqlen_q; p.lse_head_stride = seqlen_q; p.lse_row_stride = 1;
  }
  p.cu_seqlens_q = cu_seqlens_q.has_value() ? cu_seqlens_q->data_ptr<int>() : nullptr;
  p.cu_seqlens_k = cu_seqlens_k.has_value() ? cu_seqlens_k->data_ptr<int>() : nullptr;
  p.q_packed = q_thd;
  p.k_packed = k_thd;
  p.q_tokens = q_thd ? q.size(0) : 0;
  p.kv_tokens = k_thd ? k.size(0) : 0;
  p.b = static_cast<int>(b);
  p.h = static_cast<int>(h);
  p.h_k = static_cast<int>(h_k);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.d = static_cast<int>(d);
  p.scale_softmax = static_cast<float>(softmax_scale);
  p.scale_softmax_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  p.window_left = static_cast<int>(window_left < 0 ? -1 : window_left);
  p.window_right = static_cast<int>(window_right < 0 ? -1 : window_right);
  p.bottom_right = bottom_right;
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.alibi_batch_stride = alibi_slopes.has_value() && alibi_slopes->dim() == 2 ? h : 0;
  p.rng_state = dropout_p > 0.0 ? rng_state->data_ptr<int64_t>() : nullptr;
  const double keep = std::floor((1.0 - dropout_p) * 4294967296.0);
  p.dropout_threshold = static_cast<uint32_t>(std::min(keep, 4294967295.0));
  p.dropout_scale = static_cast<float>(1.0 / (1.0 - dropout_p));
  return b;
}

std::string kernel_name(at::ScalarType dtype, int hd) {
  return std::string(dtype == at::kBFloat16 ? "bf16" : "fp16") + "_hdim" + std::to_string(hd);
}

}  // namespace

// Forward. Formats: 0 = bshd, 1 = sbhd, 2 = thd (packed; needs cu_seqlens).
// cu_seqlens for a bshd/sbhd side: sequence i occupies the first len_i rows of batch row i.
// Returns (out in q's format, contiguous; lse float32: [h, t] for thd q, else [b, h, sq]; an
// empty tensor unless return_lse). Output rows with no key to attend (padding rows, fully
// masked rows) are zero and their lse is +inf. Dropout and ALiBi: see flash/flash.h.
std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& cu_seqlens_q,
                            const c10::optional<at::Tensor>& cu_seqlens_k, int64_t q_format,
                            int64_t kv_format, int64_t max_seqlen_q, int64_t max_seqlen_k,
                            double softmax_scale, int64_t window_left, int64_t window_right,
                            bool bottom_right, bool return_lse, double dropout_p,
                            const c10::optional<at::Tensor>& rng_state,
                            const c10::optional<at::Tensor>& alibi_slopes, int64_t family) {
  c10::cuda::CUDAGuard guard(q.device());
  tf::FwdParams p{};
  const int64_t b = fill_common(p, "flash_attn_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k,
                                q_format, kv_format, max_seqlen_q, max_seqlen_k, softmax_scale,
                                window_left, window_right, bottom_right, dropout_p, rng_state,
                                alibi_slopes);
  const bool q_thd = q_format == kTHD;
  // thd: tokens past cu_seqlens_q[-1] belong to no sequence and must read as zeros.
  at::Tensor out = q_thd ? at::zeros(q.sizes(), q.options()) : at::empty(q.sizes(), q.options());
  at::Tensor lse;
  if (return_lse) {
    lse = q_thd ? at::full({p.h, q.size(0)}, INFINITY, q.options().dtype(at::kFloat))
                : at::empty({b, p.h, p.seqlen_q}, q.options().dtype(at::kFloat));
  } else {
    lse = at::empty({0}, q.options().dtype(at::kFloat));
  }
  if (out.numel() == 0) return {out, lse};

  p.o = out.data_ptr();
  p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  const Strides so = strides_of(out, q_format);
  p.o_batch_stride = so.batch; p.o_row_stride = so.row; p.o_head_stride = so.head;

  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const tf::Device& dev = device_info(q.get_device());
  check_family("flash_attn_fwd", family);
  std::string why_not_sm90;
  const tf::Arch arch = fwd_family(p, dev.arch, bf16, static_cast<int>(family), why_not_sm90);
  const int hd = tf::family_head_dim(arch, p.d);
  TORCH_CHECK(family != static_cast<int>(tf::Arch::kSm90) || arch == tf::Arch::kSm90,
              "flash_attn_fwd: the sm90 family was requested, but ", why_not_sm90);
  // The sm90 forward's tile counter (flash.h): its launch zeroes it where it runs the dynamic
  // scheduler. (Freed at return: the caching allocator reuses it only after this stream's work.)
  at::Tensor tile_counter;
  if (arch == tf::Arch::kSm90) {
    tile_counter = at::empty({1}, q.options().dtype(at::kInt));
    p.tile_counter = tile_counter.data_ptr<int>();
  }
  TORCH_CHECK(tf::dispatch_fwd(arch, bf16, hd, p, dev,
                               c10::cuda::getCurrentCUDAStream().stream()),
              "flash_attn_fwd: this build has no ", kernel_name(q.scalar_type(), hd),
              " kernel (see TRANSFORMER_FA_FLASH_KERNELS in setup.py)");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

// Backward of fwd (same arguments; out and lse are fwd's). Returns (dq, dk, dv), contiguous
// with the shapes of q, k, v, or the given grads (dq, dk, dv: buffers with q, k, v's shapes and
// dtype, any strides the kernels read, e.g. views of one packed buffer); thd tokens past
// cu_seqlens[-1] get zeros. deterministic: the
// same inputs give bitwise the same gradients (dQ through per-CTA splits summed in order).
// family: 0 (bwd_family's choice) or an Arch value (TRANSFORMER_FA_FLASH_BWD_FAMILY, for tests
// and benchmarks); a requested sm90 that cannot serve the call is an error naming the reason.
std::vector<at::Tensor> bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                            const c10::optional<at::Tensor>& cu_seqlens_q,
                            const c10::optional<at::Tensor>& cu_seqlens_k, int64_t q_format,
                            int64_t kv_format, int64_t max_seqlen_q, int64_t max_seqlen_k,
                            double softmax_scale, int64_t window_left, int64_t window_right,
                            bool bottom_right, double dropout_p,
                            const c10::optional<at::Tensor>& rng_state,
                            const c10::optional<at::Tensor>& alibi_slopes, bool deterministic,
                            const c10::optional<std::vector<at::Tensor>>& grads, int64_t family) {
  c10::cuda::CUDAGuard guard(q.device());
  tf::BwdParams p{};
  const int64_t b = fill_common(p, "flash_attn_bwd", q, k, v, cu_seqlens_q, cu_seqlens_k,
                                q_format, kv_format, max_seqlen_q, max_seqlen_k, softmax_scale,
                                window_left, window_right, bottom_right, dropout_p, rng_state,
                                alibi_slopes);
  check_tensor(dout, "dout", q_format);
  check_tensor(out, "out", q_format);
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() &&
                  dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "flash_attn_bwd: dout and out must have q's shape and dtype");
  const bool q_thd = q_format == kTHD, k_thd = kv_format == kTHD;
  const std::vector<int64_t> lse_shape =
      q_thd ? std::vector<int64_t>{p.h, q.size(0)} : std::vector<int64_t>{b, p.h, p.seqlen_q};
  TORCH_CHECK(lse.is_cuda() && lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.sizes() == at::IntArrayRef(lse_shape),
              "flash_attn_bwd: lse must be the forward's float32 ", dims(lse_shape));

  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const tf::Device& dev = device_info(q.get_device());
  check_family("flash_attn_bwd", family);
  p.deterministic = deterministic;
  std::string why_not_sm90;
  const tf::Arch arch = bwd_family(p, dev.arch, bf16, static_cast<int>(family), why_not_sm90);
  const int hd = tf::family_head_dim(arch, p.d);
  TORCH_CHECK(family != static_cast<int>(tf::Arch::kSm90) || arch == tf::Arch::kSm90,
              "flash_attn_bwd: the sm90 family was requested, but ", why_not_sm90);

  at::Tensor dq, dk, dv;
  if (grads.has_value()) {
    TORCH_CHECK(grads->size() == 3, "flash_attn_bwd: grads must be (dq, dk, dv)");
    dq = (*grads)[0]; dk = (*grads)[1]; dv = (*grads)[2];
    const char* names[3] = {"dq", "dk", "dv"};
    const at::Tensor* likes[3] = {&q, &k, &v};
    for (int i = 0; i < 3; ++i) {
      const at::Tensor& g = (*grads)[i];
      check_tensor(g, names[i], i == 0 ? q_format : kv_format);
      TORCH_CHECK(g.sizes() == likes[i]->sizes() && g.scalar_type() == q.scalar_type() &&
                      g.device() == q.device(),
                  "flash_attn_bwd: ", names[i], " must have the shape and dtype of its input");
    }
    if (k_thd) { dk.zero_(); dv.zero_(); }
  } else {
    dq = at::empty(q.sizes(), q.options());  // every row written (from dq_accum)
    dk = k_thd ? at::zeros(k.sizes(), k.options()) : at::empty(k.sizes(), k.options());
    dv = k_thd ? at::zeros(v.sizes(), v.options()) : at::empty(v.sizes(), v.options());
  }
  p.dq_rows = q.numel() / p.d;
  // The family plans its shared memory and workspace (the dq_accum layout, the splits).
  tf::BwdPlan plan{};
  TORCH_CHECK(tf::dispatch_plan_bwd(arch, bf16, hd, p, dev, plan),
              "flash_attn_bwd: this build has no ", kernel_name(q.scalar_type(), hd),
              " kernel (see TRANSFORMER_FA_FLASH_KERNELS in setup.py)");
  TORCH_CHECK(plan.smem_bytes <= dev.smem_optin, "flash_attn_bwd: head dim ", num(p.d),
              " needs ", num(plan.smem_bytes), " bytes of shared memory per block; this GPU has ",
              num(dev.smem_optin));
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    if (!k_thd) { dk.zero_(); dv.zero_(); }
    return {dq, dk, dv};
  }

  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq_accum = plan.dq_accum_zeroed ? at::zeros({plan.dq_accum_floats}, f32)
                                             : at::empty({plan.dq_accum_floats}, f32);
  at::Tensor dsum = at::empty(lse_shape, f32);

  p.o = const_cast<void*>(out.data_ptr());
  const Strides so = strides_of(out, q_format), sd = strides_of(dout, q_format),
                sdk = strides_of(dk, kv_format), sdv = strides_of(dv, kv_format);
  p.o_batch_stride = so.batch; p.o_row_stride = so.row; p.o_head_stride = so.head;
  p.lse = lse.data_ptr<float>();
  p.dout = dout.data_ptr();
  p.do_batch_stride = sd.batch; p.do_row_stride = sd.row; p.do_head_stride = sd.head;
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dk_batch_stride = sdk.batch; p.dk_row_stride = sdk.row; p.dk_head_stride = sdk.head;
  p.dv_batch_stride = sdv.batch; p.dv_row_stride = sdv.row; p.dv_head_stride = sdv.head;
  p.dq_accum = dq_accum.data_ptr<float>();
  const Strides sdq = strides_of(dq, q_format);
  p.dq = dq.data_ptr();
  p.dq_batch_stride = sdq.batch; p.dq_row_stride = sdq.row; p.dq_head_stride = sdq.head;
  p.dsum = dsum.data_ptr<float>();

  TORCH_CHECK(tf::dispatch_bwd(arch, bf16, hd, p, dev,
                               c10::cuda::getCurrentCUDAStream().stream()),
              "flash_attn_bwd: this build has no ", kernel_name(q.scalar_type(), hd), " kernel");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dq, dk, dv};
}

// Decode forward: a few query tokens per sequence against a long K/V (a KV cache), the keys
// split over several CTAs (sm80 family, every sm80+ GPU). The arguments mean what fwd's do;
// block_table (int32 [b, pages per sequence]) makes k and v page pools [pages, page_size,
// h_k, d] (bshd, page_size a multiple of 16) read through it, and then cu_seqlens_k gives the
// cached lengths and max_seqlen_k their bound. num_splits: 0 chooses. No dropout, ALiBi or
// LSE (inference). Returns out in q's format, contiguous, as fwd's.
at::Tensor fwd_kvcache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& cu_seqlens_q,
                       const c10::optional<at::Tensor>& cu_seqlens_k,
                       const c10::optional<at::Tensor>& block_table, int64_t q_format,
                       int64_t kv_format, int64_t max_seqlen_q, int64_t max_seqlen_k,
                       double softmax_scale, int64_t window_left, int64_t window_right,
                       bool bottom_right, int64_t num_splits,
                       const c10::optional<at::Tensor>& seqlens_k) {
  c10::cuda::CUDAGuard guard(q.device());
  const char* op = "flash_attn_fwd_kvcache";
  tf::DecodeParams p{};
  const bool paged = block_table.has_value();
  TORCH_CHECK(!paged || (kv_format == kBSHD && (cu_seqlens_k.has_value() ||
                                                 seqlens_k.has_value())),
              op, ": a block_table needs bshd page pools and the cached lengths (cu_seqlens_k "
              "or seqlens_k)");
  TORCH_CHECK(!seqlens_k.has_value() || kv_format != kTHD, op,
              ": seqlens_k is for a bshd/sbhd cache");
  const int64_t b = fill_common(p, op, q, k, v, cu_seqlens_q, cu_seqlens_k, q_format,
                                kv_format, max_seqlen_q, max_seqlen_k, softmax_scale,
                                window_left, window_right, bottom_right, 0.0, c10::optional<at::Tensor>(),
                                c10::optional<at::Tensor>(), paged);
  TORCH_CHECK(num_splits >= 0, op, ": num_splits must be >= 0 (0: chosen), got ",
              num(num_splits));
  if (paged) {
    const auto& bt = *block_table;
    TORCH_CHECK(bt.is_cuda() && bt.device() == q.device() && bt.scalar_type() == at::kInt &&
                    bt.dim() == 2 && bt.size(0) == b && bt.stride(1) == 1,
                op, ": block_table must be int32 [b, pages] with unit stride in pages on ",
                q.device().str(), ", got ", dims(bt.sizes()));
    const int64_t page_size = k.size(1);
    TORCH_CHECK(page_size % 16 == 0, op, ": page_size must be a multiple of 16, got ",
                num(page_size));
    TORCH_CHECK(max_seqlen_k <= bt.size(1) * page_size, op, ": max_seqlen_k ", num(max_seqlen_k),
                " is more than the block table's ", num(bt.size(1) * page_size), " keys");
    p.block_table = bt.data_ptr<int>();
    p.block_table_batch_stride = bt.stride(0);
    p.page_size = static_cast<int>(page_size);
  }
  if (seqlens_k.has_value()) {
    const auto& lens = *seqlens_k;
    TORCH_CHECK(lens.is_cuda() && lens.device() == q.device() && lens.scalar_type() == at::kInt &&
                    lens.dim() == 1 && lens.is_contiguous() && lens.numel() == b,
                op, ": seqlens_k must be contiguous int32 [b] with b = ", num(b), " on ",
                q.device().str());
    p.seqlens_k = seqlens_k->data_ptr<int>();
  }
  const bool q_thd = q_format == kTHD;
  at::Tensor out = q_thd ? at::zeros(q.sizes(), q.options()) : at::empty(q.sizes(), q.options());
  if (out.numel() == 0) return out;
  TORCH_CHECK(int64_t(p.h_k) * ((p.seqlen_q * (p.h / p.h_k) + 15) / 16) <= tf::kMaxGridYZ, op,
              ": too many KV heads x query rows for one launch");
  p.o = out.data_ptr();
  const Strides so = strides_of(out, q_format);
  p.o_batch_stride = so.batch; p.o_row_stride = so.row; p.o_head_stride = so.head;
  p.accum_rows = (q_thd ? q.size(0) : b * p.seqlen_q) * p.h;
  p.num_splits = static_cast<int>(num_splits);

  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const int hd = tf::family_head_dim(tf::Arch::kSm80, p.d);
  const tf::Device& dev = device_info(q.get_device());
  tf::DecodePlan plan{};
  TORCH_CHECK(tf::dispatch_plan_decode(tf::Arch::kSm80, bf16, hd, p, dev, plan), op,
              ": this build has no ", kernel_name(q.scalar_type(), hd), " kernel");
  TORCH_CHECK(plan.smem_bytes <= dev.smem_optin, op, ": head dim ", num(p.d), " needs ",
              num(plan.smem_bytes), " bytes of shared memory per block; this GPU has ",
              num(dev.smem_optin));
  at::Tensor o_accum, lse_accum;
  if (plan.accum_floats > 0) {
    const auto f32 = q.options().dtype(at::kFloat);
    o_accum = at::empty({plan.accum_floats}, f32);
    lse_accum = at::empty({plan.lse_floats}, f32);
    p.o_accum = o_accum.data_ptr<float>();
    p.lse_accum = lse_accum.data_ptr<float>();
  }
  TORCH_CHECK(tf::dispatch_decode(tf::Arch::kSm80, bf16, hd, p, dev,
                                  c10::cuda::getCurrentCUDAStream().stream()),
              op, ": this build has no ", kernel_name(q.scalar_type(), hd), " kernel");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Fills the fields of p that the family rules read from a call's shape.
void fill_shape(tf::FwdParams& p, int64_t d, int64_t seqlen_q, int64_t seqlen_k, bool varlen,
                int64_t window_left, int64_t window_right, bool bottom_right, bool alibi,
                bool dropout) {
  static const int kSomeSequences = 1;  // a non-null cu_seqlens stands for "varlen"
  p.d = static_cast<int>(d);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.seqlen_k = static_cast<int>(seqlen_k);
  p.cu_seqlens_q = p.cu_seqlens_k = varlen ? &kSomeSequences : nullptr;
  p.window_left = static_cast<int>(window_left < 0 ? -1 : window_left);
  p.window_right = static_cast<int>(window_right < 0 ? -1 : window_right);
  p.bottom_right = bottom_right;
  static const float kSomeSlope = 0.f;
  static const int64_t kSomeState = 0;
  p.alibi_slopes = alibi ? &kSomeSlope : nullptr;
  p.rng_state = dropout ? &kSomeState : nullptr;
}

// The family fwd would run a call on (its name, and why not sm90 when it is not), from the
// call's shape alone: the Python backend logs it. arch: the GPU's compute capability.
// bwd_family_of: the same for bwd, which also depends on GQA and determinism.
std::vector<std::string> fwd_family_of(int64_t arch, bool bf16, int64_t d, int64_t seqlen_q,
                                       int64_t seqlen_k, bool varlen, int64_t window_left,
                                       int64_t window_right, bool bottom_right, bool alibi,
                                       bool dropout, int64_t family) {
  tf::FwdParams p{};
  fill_shape(p, d, seqlen_q, seqlen_k, varlen, window_left, window_right, bottom_right, alibi,
             dropout);
  std::string why_not_sm90;
  const tf::Arch arch_run = fwd_family(p, static_cast<int>(arch), bf16, static_cast<int>(family),
                                       why_not_sm90);
  return {arch_run == tf::Arch::kSm90 ? "sm90" : "sm80", why_not_sm90};
}

std::vector<std::string> bwd_family_of(int64_t arch, bool bf16, int64_t d, int64_t seqlen_q,
                                       int64_t seqlen_k, bool varlen, int64_t window_left,
                                       int64_t window_right, bool bottom_right, bool alibi,
                                       bool dropout, bool gqa, bool deterministic,
                                       int64_t family) {
  tf::BwdParams p{};
  fill_shape(p, d, seqlen_q, seqlen_k, varlen, window_left, window_right, bottom_right, alibi,
             dropout);
  p.h = gqa ? 2 : 1;  // only h != h_k matters
  p.h_k = 1;
  p.deterministic = deterministic;
  std::string why_not_sm90;
  const tf::Arch arch_run = bwd_family(p, static_cast<int>(arch), bf16, static_cast<int>(family),
                                       why_not_sm90);
  return {arch_run == tf::Arch::kSm90 ? "sm90" : "sm80", why_not_sm90};
}

#ifdef TRANSFORMER_FA_FP8_CAST
namespace fp8 = transformer_fa::fp8;

// transformer_fa/kernels/fp8_cast.py calls these where the kernels serve the call (it checks
// first and raises ValueErrors); these checks only guard the kernels' assumptions.

bool fp8_f32_scalar(const at::Tensor& t, const at::Tensor& x) {
  return t.is_cuda() && t.scalar_type() == at::kFloat && t.numel() == 1 &&
         t.device() == x.device();
}

// The input side of CastParams: x (and dgelu's h), the activation.
fp8::CastParams fp8_input_params(const char* fn, const at::Tensor& x,
                                 const c10::optional<at::Tensor>& h, bool gelu) {
  const auto aligned = [](const at::Tensor& t) {
    return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && (x.scalar_type() == at::kBFloat16 ||
              x.scalar_type() == at::kHalf), fn, ": x must be a 2-D bfloat16 or float16 CUDA "
              "tensor");
  TORCH_CHECK(x.size(0) % 16 == 0 && x.size(1) % 8 == 0 &&
              x.size(1) / fp8::kCastTileCols < 65535,
              fn, ": rows must be a multiple of 16 and cols of 8, got ", dims(x.sizes()));
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && aligned(x),
              fn, ": x needs a unit column stride and 16-byte aligned rows");
  if (h) {
    TORCH_CHECK(h->sizes() == x.sizes() && h->scalar_type() == x.scalar_type() &&
                h->device() == x.device() && h->stride(1) == 1 && h->stride(0) % 8 == 0 &&
                aligned(*h) && !gelu, fn, ": h must be like x (and not with gelu)");
  }
  fp8::CastParams p{};
  p.x = x.data_ptr();
  p.x_row_stride = x.stride(0);
  p.h = h ? h->data_ptr() : nullptr;
  p.h_row_stride = h ? h->stride(0) : 0;
  p.rows = x.size(0);
  p.cols = x.size(1);
  p.bf16 = x.scalar_type() == at::kBFloat16;
  p.activation = gelu ? fp8::Activation::kGelu
                      : h ? fp8::Activation::kDgelu : fp8::Activation::kNone;
  return p;
}

void fp8_cast_transpose(const at::Tensor& x, const c10::optional<at::Tensor>& h,
                        const c10::optional<at::Tensor>& out, const at::Tensor& out_t,
                        const at::Tensor& scale, bool scale_from_amax, double fp8_max,
                        const c10::optional<at::Tensor>& scale_inv,
                        const c10::optional<at::Tensor>& amax,
                        const c10::optional<at::Tensor>& col_sums, bool gelu) {
  c10::cuda::CUDAGuard guard(x.device());
  fp8::CastParams p = fp8_input_params("fp8_cast_transpose", x, h, gelu);
  const int64_t rows = p.rows, cols = p.cols;
  const bool e5m2 = out_t.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(e5m2 || out_t.scalar_type() == at::kFloat8_e4m3fn,
              "fp8_cast_transpose: out_t must be float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(fp8_max == (e5m2 ? 57344.0 : 448.0),
              "fp8_cast_transpose: fp8_max must be the format's largest value");
  TORCH_CHECK(out_t.is_contiguous() && out_t.size(0) == cols && out_t.size(1) == rows &&
              out_t.device() == x.device(),
              "fp8_cast_transpose: out_t must be a contiguous [cols, rows] tensor");
  if (out) {
    TORCH_CHECK(out->is_contiguous() && out->sizes() == x.sizes() &&
                out->scalar_type() == out_t.scalar_type() && out->device() == x.device(),
                "fp8_cast_transpose: out must be contiguous, x's shape, out_t's dtype");
  }
  TORCH_CHECK(fp8_f32_scalar(scale, x), "fp8_cast_transpose: scale must be one float32 on "
              "x's device");
  TORCH_CHECK(!scale_inv || fp8_f32_scalar(*scale_inv, x), "fp8_cast_transpose: bad scale_inv");
  TORCH_CHECK(!amax || fp8_f32_scalar(*amax, x), "fp8_cast_transpose: bad amax");
  const int64_t row_tiles = (rows + fp8::kCastTileRows - 1) / fp8::kCastTileRows;
  TORCH_CHECK(!col_sums || (col_sums->is_cuda() && col_sums->scalar_type() == at::kFloat &&
              col_sums->numel() == row_tiles * cols && col_sums->is_contiguous() && !gelu),
              "fp8_cast_transpose: col_sums must be a contiguous float32 [", num(row_tiles),
              ", ", num(cols), "] (and not with gelu)");
  p.out = out ? out->data_ptr() : nullptr;
  p.out_t = out_t.data_ptr();
  p.scale = scale.data_ptr<float>();
  p.scale_from_amax = scale_from_amax;
  p.fp8_max = static_cast<float>(fp8_max);
  p.scale_inv = scale_inv ? scale_inv->data_ptr<float>() : nullptr;
  p.amax_bits = amax ? static_cast<int*>(amax->data_ptr()) : nullptr;
  p.col_sums = col_sums ? col_sums->data_ptr<float>() : nullptr;
  p.e5m2 = e5m2;
  fp8::run_cast_transpose(p, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void fp8_amax(const at::Tensor& x, const c10::optional<at::Tensor>& h, const at::Tensor& amax,
              bool gelu) {
  c10::cuda::CUDAGuard guard(x.device());
  fp8::CastParams p = fp8_input_params("fp8_amax", x, h, gelu);
  TORCH_CHECK(fp8_f32_scalar(amax, x), "fp8_amax: amax must be one float32 on x's device");
  p.amax_bits = static_cast<int*>(amax.data_ptr());
  fp8::run_amax(p, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "transformer_fa flash attention kernels (forward and backward; families: flash/)";
  m.def("fwd", &fwd, "Flash attention forward", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("q_format"),
        py::arg("kv_format"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
        py::arg("softmax_scale"), py::arg("window_left"), py::arg("window_right"),
        py::arg("bottom_right"), py::arg("return_lse"), py::arg("dropout_p") = 0.0,
        py::arg("rng_state") = py::none(), py::arg("alibi_slopes") = py::none(),
        py::arg("family") = kAnyFamily);
  m.def("fwd_kvcache", &fwd_kvcache, "Split-KV decode forward (contiguous or paged K/V)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("block_table"), py::arg("q_format"),
        py::arg("kv_format"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
        py::arg("softmax_scale"), py::arg("window_left"), py::arg("window_right"),
        py::arg("bottom_right"), py::arg("num_splits") = 0, py::arg("seqlens_k") = py::none());
  m.def("fwd_family", &fwd_family_of,
        "(family name, why not sm90) of the forward of a call with this shape",
        py::arg("arch"), py::arg("bf16"), py::arg("d"), py::arg("seqlen_q"), py::arg("seqlen_k"),
        py::arg("varlen"), py::arg("window_left"), py::arg("window_right"),
        py::arg("bottom_right"), py::arg("alibi"), py::arg("dropout"),
        py::arg("family") = kAnyFamily);
  m.def("bwd", &bwd, "Flash attention backward", py::arg("dout"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::arg("q_format"), py::arg("kv_format"),
        py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("softmax_scale"),
        py::arg("window_left"), py::arg("window_right"), py::arg("bottom_right"),
        py::arg("dropout_p") = 0.0, py::arg("rng_state") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("deterministic") = false,
        py::arg("grads") = py::none(), py::arg("family") = kAnyFamily);
  m.def("bwd_family", &bwd_family_of,
        "(family name, why not sm90) of the backward of a call with this shape",
        py::arg("arch"), py::arg("bf16"), py::arg("d"), py::arg("seqlen_q"), py::arg("seqlen_k"),
        py::arg("varlen"), py::arg("window_left"), py::arg("window_right"),
        py::arg("bottom_right"), py::arg("alibi"), py::arg("dropout"), py::arg("gqa"),
        py::arg("deterministic"), py::arg("family") = kAnyFamily);
  std::vector<int> dims(std::begin(tf::kKernelHeadDims), std::end(tf::kKernelHeadDims));
  m.attr("HEAD_DIMS") = py::cast(dims);
  m.attr("INSTANTIATIONS") = tf::built_instantiations();
#ifdef TRANSFORMER_FA_FP8_CAST
  m.def("fp8_cast_transpose", &fp8_cast_transpose,
        "FP8 cast of a 16-bit 2-D tensor into both orientations (csrc/fp8/)", py::arg("x"),
        py::arg("h"), py::arg("out"), py::arg("out_t"), py::arg("scale"),
        py::arg("scale_from_amax"), py::arg("fp8_max"), py::arg("scale_inv"), py::arg("amax"),
        py::arg("col_sums"), py::arg("gelu"));
  m.def("fp8_amax", &fp8_amax, "max(amax, max|x|) of a 16-bit 2-D tensor (with GELU or its "
        "backward applied) in place (csrc/fp8/)", py::arg("x"), py::arg("h"), py::arg("amax"),
        py::arg("gelu"));
  m.attr("FP8_CAST_ARCHS") = std::vector<int>{TRANSFORMER_FA_FP8_CAST_ARCHS};
#endif
}
