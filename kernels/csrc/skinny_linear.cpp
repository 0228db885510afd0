// Skinny bf16 linear for decode and verification on x86 CPUs with AVX512-BF16.
//
//   y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]),   x: [M, K] bf16, w: [N, K] bf16, y: [M, N] bf16
//
// Why: torch's bf16 GEMV on CPU runs well below the memory bandwidth, and decode is a GEMV.
// Every output is one fp32 dot product accumulated in a fixed order (32 lanes of vdpbf16ps,
// then a fixed lane reduction), rounded to bf16 once. The order does not depend on M, so a row
// verified among k+1 rows (or batched among other requests' rows) equals the same row decoded
// alone, bit for bit: greedy speculative output equals plain greedy output in bf16 too.
// Weight rows are split over ATen's thread pool; x is taken in tiles of at most 16 rows (one
// kernel per tile size, registers blocked 4x4), and every tile sweeps a chunk of weight rows while
// it is in L1/L2, so the weights stream from memory once whatever M is.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include "bf16.h"
#include <algorithm>
#include <array>
#include <cstdint>

namespace {

constexpr int MAX_M = 16;

inline float reduce(__m512 v) { return _mm512_reduce_add_ps(v); }

using specctl::from_bf16;
using specctl::to_bf16;

// One group: x rows [M0, M0 + MB) against NB weight rows; recurses over the groups at compile time.
template <int MB, int NB>
inline void block(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t kfull, __mmask32 tail, float* out,
                  int ostride) {
  __m512 acc[NB][MB];
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kfull; k += 32) {
    __m512bh wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wr + j * K + k);
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xv, wv[j]);
    }
  }
  if (tail) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + j * K + kfull);
    for (int m = 0; m < MB; ++m) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + kfull);
      for (int j = 0; j < NB; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xv, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[j * ostride + m] = reduce(acc[j][m]);
}

template <int M, int NB, int M0>
inline void group(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t kfull, __mmask32 tail,
                  float out[][M]) {
  if constexpr (M0 < M) {
    constexpr int MB = (M - M0) < 4 ? (M - M0) : 4;
    block<MB, NB>(x + M0 * K, wr, K, kfull, tail, &out[0][M0], M);
    group<M, NB, M0 + MB>(x, wr, K, kfull, tail, out);
  }
}

// Rows of x in groups of at most 4 (MB), weight rows in blocks of 4 (NB): 16 accumulators in
// registers, each weight block read from memory once and from L1 for the other row groups.
template <int M>
void rows_kernel(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y,
                 int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int NB = 4;
  const int64_t kfull = K / 32 * 32;
  const __mmask32 tail = (K - kfull) ? ((__mmask32)((1ull << (K - kfull)) - 1)) : 0;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    const uint16_t* wr = w + n * K;
    float out[NB][M];
    // groups of 4 rows, then the remainder
    group<M, NB, 0>(x, wr, K, kfull, tail, out);
    for (int j = 0; j < NB; ++j) {
      const float bias = b ? from_bf16(b[n + j]) : 0.0f;
      for (int m = 0; m < M; ++m) y[m * N + n + j] = to_bf16(out[j][m] + bias);
    }
  }
  for (; n < n1; ++n) {
    float out[1][M];
    group<M, 1, 0>(x, w + n * K, K, kfull, tail, out);
    const float bias = b ? from_bf16(b[n]) : 0.0f;
    for (int m = 0; m < M; ++m) y[m * N + n] = to_bf16(out[0][m] + bias);
  }
}

using Fn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                    int64_t);
template <int... Ms>
constexpr auto make_table(std::integer_sequence<int, Ms...>) {
  return std::array<Fn, sizeof...(Ms)>{&rows_kernel<Ms + 1>...};
}
const auto TABLE = make_table(std::make_integer_sequence<int, MAX_M>{});

// Weight rows per chunk that every row tile sweeps before the next chunk (64 rows of K <= 8960
// bf16: at most 1.1 MiB, in L2).
constexpr int64_t N_CHUNK = 64;

void run(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 96, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += N_CHUNK) {
      const int64_t c1 = std::min(c0 + N_CHUNK, n1);
      for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
        const int64_t mt = std::min<int64_t>(MAX_M, M - m0);
        TABLE[mt - 1](x + m0 * K, w, b, y + m0 * N, N, K, c0, c1);
      }
    }
  });
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.size(0) >= 1, "x needs at least one row");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* bp = nullptr;
  torch::Tensor bc;
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
