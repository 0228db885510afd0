// bf16 linear on Intel AMX tiles, for every row count, with weights packed once at load.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]);  x: [M, K] bf16, y: [M, N] bf16
//   wp: w packed as [N/16, K/32, 16 (k pairs), 16 (n), 2] bf16: one 1 KiB AMX B tile per
//       (16 outputs x 32 inputs) block, in the VNNI layout tdpbf16ps reads.
//
// Why: decode and verification are weight-bandwidth bound; AMX keeps them there for any number of
// rows, and each output element is one tile dot product accumulated over k blocks in a fixed
// order, so a row's result does not depend on how many rows share the call: verifying k+1 tokens
// gives each row bit-for-bit what decoding it alone gives (lossless greedy in bf16).
// Loop order: output blocks of 16 split over ATen's threads; for each, all row chunks of 16, so a
// weight block is read from memory once and from cache for the other chunks (prefill).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "bf16.h"
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstring>

namespace {

constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr long XFEATURE_XTILEDATA = 18;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tile 0: C (rows x 16 fp32), tile 1: A (rows x 32 bf16), tile 2: B (16 k-pairs x 16 n x 2)
inline void configure(int rows) {
  TileConfig cfg;
  cfg.rows[0] = rows; cfg.colsb[0] = 64;
  cfg.rows[1] = rows; cfg.colsb[1] = 64;
  cfg.rows[2] = 16;   cfg.colsb[2] = 64;
  _tile_loadconfig(&cfg);
}

using specctl::from_bf16;
using specctl::to_bf16;

}  // namespace

bool amx_init() {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor wp, c10::optional<torch::Tensor> b) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && wp.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 5 && wp.size(2) == 16 && wp.size(3) == 16 && wp.size(4) == 2,
              "x [M, K], wp [N/16, K/32, 16, 16, 2]");
  TORCH_CHECK(wp.is_contiguous(), "packed weight must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = wp.size(0), KB = wp.size(1), N = NB * 16;
  TORCH_CHECK(K == KB * 32, "K mismatch");
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wp.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const uint16_t* bp = nullptr;
  torch::Tensor bc;
  if (b.has_value() && b->defined()) {
    bc = b->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kBFloat16 && bc.numel() == N, "bias [N] bf16");
    bp = reinterpret_cast<const uint16_t*>(bc.data_ptr());
  }
  at::parallel_for(0, NB, 4, [&](int64_t nb0, int64_t nb1) {
    alignas(64) float cbuf[16 * 16];
    int configured = -1;
    for (int64_t nb = nb0; nb < nb1; ++nb) {
      const uint16_t* wblk = w + nb * KB * 512;
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int mt = static_cast<int>(std::min<int64_t>(16, M - m0));
        if (mt != configured) {
          configure(mt);
          configured = mt;
        }
        _tile_zero(0);
        const uint16_t* xrow = xp + m0 * K;
        for (int64_t kb = 0; kb < KB; ++kb) {
          _tile_loadd(1, xrow + kb * 32, K * 2);
          _tile_loadd(2, wblk + kb * 512, 64);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, cbuf, 64);
        for (int m = 0; m < mt; ++m) {
          uint16_t* yrow = yp + (m0 + m) * N + nb * 16;
          for (int n = 0; n < 16; ++n) {
            const float bias = bp ? from_bf16(bp[nb * 16 + n]) : 0.0f;
            yrow[n] = to_bf16(cbuf[m * 16 + n] + bias);
          }
        }
      }
    }
    _tile_release();
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_init", &amx_init, "ask the kernel for AMX tile state");
  m.def("amx_linear", &amx_linear, "bf16 linear on AMX with packed weights");
}
