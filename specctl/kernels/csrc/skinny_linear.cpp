// Skinny bf16 linear for decode and verification on x86 CPUs with AVX512-BF16.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]),   x: [M, K] bf16, w: [N, K] bf16, y: [M, N] bf16
//
// Why: torch's bf16 GEMV on CPU runs well below the memory bandwidth, and decode is a GEMV.
// Every output is one fp32 dot product accumulated in a fixed order (32 lanes of vdpbf16ps,
// then a fixed lane reduction), rounded to bf16 once. The order does not depend on M, so a row
// verified among k+1 rows (or batched among other requests' rows) equals the same row decoded
// alone, bit for bit: greedy speculative output equals plain greedy output in bf16 too.
// Weight rows are split over ATen's thread pool; the core (skinny_gemm.h) is shared with the fused
// decode block.
#include "torch_ext.h"
#include <immintrin.h>
#include "skinny_gemm.h"

namespace {

void run(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 96, [&](int64_t n0, int64_t n1) {
    specctl::skinny::rows(x, M, K, w, b, y, nullptr, N, n0, n1, n1);
  });
}

}  // namespace

at::Tensor skinny_linear(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> b) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.size(0) >= 1, "x needs at least one row");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  const uint16_t* bp = nullptr;
  at::Tensor bc;
  if (b.has_value() && b->defined()) {
    bc = b->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kBFloat16 && bc.numel() == N, "bias [N] bf16");
    bp = reinterpret_cast<const uint16_t*>(bc.data_ptr());
  }
  run(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<const uint16_t*>(w.data_ptr()), bp,
      reinterpret_cast<uint16_t*>(y.data_ptr()), M, N, K);
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("skinny_linear", &skinny_linear, "skinny bf16 linear"); }
