// bf16 linear on Intel AMX tiles, for every row count, with weights packed once at load.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]);  x: [M, K] bf16, y: [M, N] bf16
//   wp: w packed as [N/16, K/32, 16 (k pairs), 16 (n), 2] bf16: one 1 KiB AMX B tile per
//       (16 outputs x 32 inputs) block, in the VNNI layout tdpbf16ps reads.
//
// Why: decode and verification are weight-bandwidth bound. One tdpbf16ps costs the same for 1 or
// 16 rows, so AMX keeps a k+1-row verification at the price of a one-row decode; and each output
// is one tile accumulation over k blocks in a fixed order, so a row's result does not depend on
// how many rows share the call: verifying k+1 tokens gives each row bit for bit what decoding it
// alone gives (lossless greedy in bf16).
//
// Speed (what makes it reach the memory bandwidth where a plain loop does not):
//   * G = 4 output blocks at once: 4 independent C tiles (tdpbf16ps has a long latency; one
//     accumulator chain would stall on it) and 4 weight streams in flight;
//   * software prefetch of the weight tiles PF k-blocks ahead (the hardware prefetcher stops at
//     every 4 KiB page; the weights should also sit on huge pages, see kernels/amx_linear.py);
//   * output blocks split over ATen's threads; for prefill (M > 16) the 4 blocks' tiles are read
//     from memory once and from L2 for the other row chunks.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr long ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr long XFEATURE_XTILEDATA = 18;
constexpr int G = 4;     // output blocks (C tiles) per group
constexpr int PF = 8;    // prefetch distance in k blocks

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0..3: C (rows x 16 fp32), tile 4: A (rows x 32 bf16), tiles 5..7: B (16 k-pairs x 16 n x 2)
inline void configure(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) { cfg.rows[t] = rows; cfg.colsb[t] = 64; }
  cfg.rows[4] = rows; cfg.colsb[4] = 64;
  for (int t = 5; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}

inline void prefetch_tile(const uint16_t* p) {
  const char* c = reinterpret_cast<const char*>(p);
#pragma GCC unroll 16
  for (int l = 0; l < 16; ++l) _mm_prefetch(c + 64 * l, _MM_HINT_T2);
}

inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// C tiles 0..g-1 accumulate x[m0:m0+mt] against output blocks nb..nb+g-1 (g <= 4).
template <int g>
inline void tiles(const uint16_t* xrow, int64_t K, const uint16_t* w, int64_t KB, int64_t nb, bool prefetch) {
  const uint16_t* blk[G];
  for (int j = 0; j < g; ++j) blk[j] = w + (nb + j) * KB * 512;
  if constexpr (g > 0) _tile_zero(0);
  if constexpr (g > 1) _tile_zero(1);
  if constexpr (g > 2) _tile_zero(2);
  if constexpr (g > 3) _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    if (prefetch && kb + PF < KB)
      for (int j = 0; j < g; ++j) prefetch_tile(blk[j] + (kb + PF) * 512);
    _tile_loadd(4, xrow + kb * 32, K * 2);
    if constexpr (g > 0) { _tile_loadd(5, blk[0] + kb * 512, 64); _tile_dpbf16ps(0, 4, 5); }
    if constexpr (g > 1) { _tile_loadd(6, blk[1] + kb * 512, 64); _tile_dpbf16ps(1, 4, 6); }
    if constexpr (g > 2) { _tile_loadd(7, blk[2] + kb * 512, 64); _tile_dpbf16ps(2, 4, 7); }
    if constexpr (g > 3) { _tile_loadd(5, blk[3] + kb * 512, 64); _tile_dpbf16ps(3, 4, 5); }
  }
}

template <int g>
inline void store(float* cbuf) {
  if constexpr (g > 0) _tile_stored(0, cbuf, 64);
  if constexpr (g > 1) _tile_stored(1, cbuf + 256, 64);
  if constexpr (g > 2) _tile_stored(2, cbuf + 512, 64);
  if constexpr (g > 3) _tile_stored(3, cbuf + 768, 64);
}

template <int g>
void group(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* w, int64_t KB, int64_t N, int64_t nb,
           const uint16_t* bp, uint16_t* yp, float* cbuf, int& configured) {
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int mt = static_cast<int>(std::min<int64_t>(16, M - m0));
    if (mt != configured) {
      configure(mt);
      configured = mt;
    }
    tiles<g>(xp + m0 * K, K, w, KB, nb, m0 == 0);  // later row chunks find the tiles in cache
    store<g>(cbuf);
    for (int j = 0; j < g; ++j) {  // + bias, one rounding to bf16 (nearest even, as torch)
      const int64_t n0 = (nb + j) * 16;
      const __m512 bias = bp ? load_bf16x16(bp + n0) : _mm512_setzero_ps();
      for (int m = 0; m < mt; ++m) {
        const __m512 c = _mm512_add_ps(_mm512_load_ps(cbuf + j * 256 + m * 16), bias);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + (m0 + m) * N + n0), (__m256i)_mm512_cvtneps_pbh(c));
      }
    }
  }
}

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
  const int64_t groups = (NB + G - 1) / G;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float cbuf[G * 256];
    int configured = -1;
    for (int64_t gi = g0; gi < g1; ++gi) {
      const int64_t nb = gi * G;
      switch (std::min<int64_t>(G, NB - nb)) {
        case 4: group<4>(xp, M, K, w, KB, N, nb, bp, yp, cbuf, configured); break;
        case 3: group<3>(xp, M, K, w, KB, N, nb, bp, yp, cbuf, configured); break;
        case 2: group<2>(xp, M, K, w, KB, N, nb, bp, yp, cbuf, configured); break;
        default: group<1>(xp, M, K, w, KB, N, nb, bp, yp, cbuf, configured); break;
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
