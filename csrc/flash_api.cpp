// pybind11 binding of transformer_fa's flash kernels: torch tensors -> FwdParams -> launch.
// The only translation unit that sees torch; the kernels (csrc/flash/) see the params struct.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/extension.h>

#include <cmath>

#include "flash/flash.h"

namespace tf = transformer_fa::flash;

namespace {

enum Format : int64_t { kBSHD = 0, kSBHD = 1, kTHD = 2 };

struct Strides {
  int64_t batch, row, head;
};

Strides strides_of(const at::Tensor& t, int64_t fmt) {
  if (fmt == kTHD) return {0, t.stride(0), t.stride(1)};
  if (fmt == kSBHD) return {t.stride(1), t.stride(0), t.stride(2)};
  return {t.stride(0), t.stride(1), t.stride(2)};
}

void check_tensor(const at::Tensor& t, const char* name, int64_t fmt) {
  TORCH_CHECK(t.is_cuda(), "flash_attn_fwd: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.dim() == (fmt == kTHD ? 3 : 4), "flash_attn_fwd: ", name, " must be ",
              fmt == kTHD ? "[t, h, d]" : "4-D (sbhd or bshd)", ", got ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1, "flash_attn_fwd: ", name, " must have a unit stride in d");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              "flash_attn_fwd: ", name, " must be 16-byte aligned");
  for (int i = 0; i < t.dim() - 1; ++i) {
    TORCH_CHECK(t.size(i) == 1 || t.stride(i) % 8 == 0, "flash_attn_fwd: ", name,
                " strides must be multiples of 8 elements (16 bytes), got ", t.strides());
  }
}

void check_cu(const c10::optional<at::Tensor>& cu, const char* name, int64_t b,
              const at::Tensor& q) {
  if (!cu.has_value()) return;
  TORCH_CHECK(cu->is_cuda() && cu->device() == q.device(), "flash_attn_fwd: ", name,
              " must be on ", q.device());
  TORCH_CHECK(cu->scalar_type() == at::kInt, "flash_attn_fwd: ", name, " must be int32");
  TORCH_CHECK(cu->dim() == 1 && cu->is_contiguous() && cu->numel() == b + 1,
              "flash_attn_fwd: ", name, " must be contiguous [b + 1] with b = ", b);
}

int compute_capability_major(int device) {
  static int cached[64] = {0};
  auto query = [](int dev) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    return major;
  };
  if (device < 0 || device >= 64) return query(device);
  if (cached[device] == 0) cached[device] = query(device);
  return cached[device];
}

}  // namespace

// Forward. Formats: 0 = bshd, 1 = sbhd, 2 = thd (packed; needs cu_seqlens).
// cu_seqlens for a bshd/sbhd side: sequence i occupies the first len_i rows of batch row i.
// Returns (out in q's format with head dim of v, contiguous; lse float32: [h, t] for thd q,
// else [b, h, sq]; an empty tensor unless return_lse). Output rows with no key to attend
// (padding rows, fully masked rows) are zero and their lse is +inf.
std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& cu_seqlens_q,
                            const c10::optional<at::Tensor>& cu_seqlens_k, int64_t q_format,
                            int64_t kv_format, int64_t max_seqlen_q, int64_t max_seqlen_k,
                            double softmax_scale, int64_t window_left, int64_t window_right,
                            bool bottom_right, bool return_lse, int64_t tile_variant) {
  TORCH_CHECK(q_format >= 0 && q_format <= 2 && kv_format >= 0 && kv_format <= 2,
              "flash_attn_fwd: formats are 0 (bshd), 1 (sbhd), 2 (thd)");
  check_tensor(q, "q", q_format);
  check_tensor(k, "k", kv_format);
  check_tensor(v, "v", kv_format);
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(),
              "flash_attn_fwd: q, k, v must be on one device");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "flash_attn_fwd: only float16 and bfloat16 are supported");
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype,
              "flash_attn_fwd: q, k, v must have one dtype");
  const int64_t d = q.size(-1);
  TORCH_CHECK(d == 64 || d == 128, "flash_attn_fwd: head dim ", d, " is not built (64, 128)");
  TORCH_CHECK(k.size(-1) == d && v.size(-1) == d,
              "flash_attn_fwd: q, k and v must have one head dim");
  const int64_t h = q.size(-2), h_k = k.size(-2);
  TORCH_CHECK(v.size(-2) == h_k && h_k > 0 && h % h_k == 0,
              "flash_attn_fwd: heads of q (", h, ") must be a multiple of those of k/v (", h_k,
              ")");
  TORCH_CHECK(k.sizes().slice(0, k.dim() - 1) == v.sizes().slice(0, v.dim() - 1),
              "flash_attn_fwd: k and v must have the same shape up to d");

  const bool q_thd = q_format == kTHD, k_thd = kv_format == kTHD;
  TORCH_CHECK(!q_thd || cu_seqlens_q.has_value(), "flash_attn_fwd: thd q needs cu_seqlens_q");
  TORCH_CHECK(!k_thd || cu_seqlens_k.has_value(), "flash_attn_fwd: thd k/v needs cu_seqlens_k");
  int64_t b;
  if (cu_seqlens_q.has_value()) {
    b = cu_seqlens_q->numel() - 1;
  } else {
    b = q_format == kSBHD ? q.size(1) : q.size(0);
  }
  check_cu(cu_seqlens_q, "cu_seqlens_q", b, q);
  check_cu(cu_seqlens_k, "cu_seqlens_k", b, q);
  TORCH_CHECK(cu_seqlens_q.has_value() == cu_seqlens_k.has_value(),
              "flash_attn_fwd: give both cu_seqlens or neither");
  if (!q_thd) TORCH_CHECK((q_format == kSBHD ? q.size(1) : q.size(0)) == b, "batch mismatch");
  if (!k_thd) TORCH_CHECK((kv_format == kSBHD ? k.size(1) : k.size(0)) == b, "batch mismatch");
  const int64_t seqlen_q = q_thd ? max_seqlen_q : (q_format == kSBHD ? q.size(0) : q.size(1));
  const int64_t seqlen_k = k_thd ? max_seqlen_k : (kv_format == kSBHD ? k.size(0) : k.size(1));
  TORCH_CHECK(seqlen_q >= 0 && seqlen_k >= 0, "flash_attn_fwd: negative max_seqlen");

  c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(compute_capability_major(q.get_device()) >= 8,
              "flash_attn_fwd: needs an sm80 or newer GPU");

  // thd: tokens past cu_seqlens_q[-1] belong to no sequence and must read as zeros.
  at::Tensor out = q_thd ? at::zeros(q.sizes(), q.options()) : at::empty(q.sizes(), q.options());
  at::Tensor lse;
  if (return_lse) {
    lse = q_thd ? at::full({h, q.size(0)}, INFINITY, q.options().dtype(at::kFloat))
                : at::empty({b, h, seqlen_q}, q.options().dtype(at::kFloat));
  } else {
    lse = at::empty({0}, q.options().dtype(at::kFloat));
  }
  if (out.numel() == 0) return {out, lse};

  tf::FwdParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.lse = return_lse ? lse.data_ptr<float>() : nullptr;
  const Strides sq_ = strides_of(q, q_format), sk = strides_of(k, kv_format),
                sv = strides_of(v, kv_format), so = strides_of(out, q_format);
  p.q_batch_stride = sq_.batch; p.q_row_stride = sq_.row; p.q_head_stride = sq_.head;
  p.k_batch_stride = sk.batch;  p.k_row_stride = sk.row;  p.k_head_stride = sk.head;
  p.v_batch_stride = sv.batch;  p.v_row_stride = sv.row;  p.v_head_stride = sv.head;
  p.o_batch_stride = so.batch;  p.o_row_stride = so.row;  p.o_head_stride = so.head;
  if (q_thd) {
    p.lse_batch_stride = 0; p.lse_head_stride = q.size(0); p.lse_row_stride = 1;
  } else {
    p.lse_batch_stride = h * seqlen_q; p.lse_head_stride = seqlen_q; p.lse_row_stride = 1;
  }
  p.cu_seqlens_q = cu_seqlens_q.has_value() ? cu_seqlens_q->data_ptr<int>() : nullptr;
  p.cu_seqlens_k = cu_seqlens_k.has_value() ? cu_seqlens_k->data_ptr<int>() : nullptr;
  p.q_packed = q_thd;
  p.k_packed = k_thd;
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
  p.tile_variant = static_cast<int>(tile_variant);

  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const bool bf16 = dtype == at::kBFloat16;
  if (d == 64) {
    bf16 ? tf::run_fwd<tf::DType::kBF16, 64>(p, stream) : tf::run_fwd<tf::DType::kFP16, 64>(p, stream);
  } else {
    bf16 ? tf::run_fwd<tf::DType::kBF16, 128>(p, stream)
         : tf::run_fwd<tf::DType::kFP16, 128>(p, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "transformer_fa flash attention kernels (sm80-class forward)";
  m.def("fwd", &fwd, "Flash attention forward", py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("q_format"),
        py::arg("kv_format"), py::arg("max_seqlen_q"), py::arg("max_seqlen_k"),
        py::arg("softmax_scale"), py::arg("window_left"), py::arg("window_right"),
        py::arg("bottom_right"), py::arg("return_lse"), py::arg("tile_variant") = 0);
  m.attr("HEAD_DIMS") = py::make_tuple(64, 128);
}
