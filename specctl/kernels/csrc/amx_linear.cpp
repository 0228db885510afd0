// Python entry point of the AMX bf16 linear (see amx_gemm.h for the kernel and why).
#include "torch_ext.h"
#include <sys/syscall.h>
#include <unistd.h>
#include "amx_gemm.h"

using namespace specctl::amx;

bool amx_init() {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}
at::Tensor amx_linear(at::Tensor x, at::Tensor wp, c10::optional<at::Tensor> b) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 5 && wp.size(2) == 16 && wp.size(3) == 16 && wp.size(4) == 2,
              "x [M, K], wp [N/16, K/32, 16, 16, 2]");
  TORCH_CHECK(wp.is_contiguous(), "packed weight must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0), KB = wp.size(1), N = NB * 16;
  TORCH_CHECK(K == KB * 32, "K mismatch");
  auto y = at::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const uint16_t* bp = nullptr;
  at::Tensor bc;
  if (b.has_value() && b->defined()) {
    bc = b->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kBFloat16 && bc.numel() == N, "bias [N] bf16");
    bp = reinterpret_cast<const uint16_t*>(bc.data_ptr());
  }
  at::parallel_for(0, num_groups(NB), 1, [&](int64_t g0, int64_t g1) {
    int configured = -1;
    groups(xp, M, K, w, NB, bp, yp, nullptr, N, g0, g1, configured, g1);
    _tile_release();
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_init", &amx_init, "ask the kernel for AMX tile state");
  m.def("amx_linear", &amx_linear, "bf16 linear on AMX with packed weights");
}
