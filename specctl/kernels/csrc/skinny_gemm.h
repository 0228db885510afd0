// The skinny GEMM core: y[m, n] = bf16(sum_k x[m, k] w[n, k] + b[n]) for weight rows [n0, n1), w row-major
// [N, K] bf16, optionally + a residual: bf16(r[m, n] + bf16(...)) (as x + linear(x) rounds in torch). Shared
// by skinny_linear.cpp (every bf16 linear on a CPU without AMX) and decode_layer.cpp's build for such CPUs
// (the fused block); built for AVX512-BF16, for AVX-512 alone and for AVX2 (bf16.h, vec16.h: the same
// arithmetic in each, so the same outputs).
//
// Every output is one fp32 dot product accumulated in a fixed order (32 lanes of vdpbf16ps over k, then a
// fixed lane reduction), rounded to bf16 once. The order depends neither on M nor on how the weight rows
// are split among threads, so a row computed among any number of rows equals that row computed alone.
// x is taken in tiles of at most 16 rows (one kernel per tile size, registers blocked 4 x rows by 4 weight
// rows), and every tile sweeps a chunk of weight rows while it is in L1/L2: the weights stream from
// memory once whatever M is.
//
// While a group of 4 weight rows is computed, the next group's rows are prefetched line by line, spread
// over the group's ceil(M / 4) passes over x, up to the end of the caller's stream (pf_end). Without it
// the stream stalls while x's later passes compute from L1 and the two never overlap: a forward over
// 8 rows cost the time of one row plus the time of the arithmetic. Measured on an Intel Xeon with
// AVX512-BF16 as a CPU without AMX runs it (1 GiB of [N, 1536] weights, 2 threads): 1 row 39.4 ->
// 34.9 ms, 8 rows 82.5 -> 48.9 ms, 16 rows 133 -> 90 ms.
#pragma once
#include <immintrin.h>
#include "bf16.h"
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

namespace specctl::skinny {

constexpr int MAX_M = 16;
// x rows a pass takes against 4 weight rows: 4 x 4 accumulators fill half of AVX-512's 32 zmm registers. On
// AVX2 (each accumulator two of its 16 ymm) they spill, and still beat 4 x 1 and 4 x 2 (an AVX2 build on an
// Intel Xeon, 192 MiB of weights, 2 threads: 8 rows 41.8 ms at 4 x 1, 33.8 at 4 x 2, 29.4 at 4 x 4; 1 row
// 9.3-10.3 ms in all three).
constexpr int MB_MAX = 4;
// Weight rows per chunk that every row tile sweeps before the next chunk (64 rows of K <= 8960 bf16:
// at most 1.1 MiB, in L2).
constexpr int64_t N_CHUNK = 64;

// One pass: x rows [M0, M0 + MB) against NB weight rows; prefetches rows [J0, J1) of pf (the next group)
// at the same k, one line a load, where pf is given.
template <int MB, int NB, int J0 = 0, int J1 = NB>
inline void block(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t kfull, int tail, float* out,
                  int ostride, const uint16_t* pf) {
  f32x16 acc[NB][MB];
#pragma GCC unroll 4
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) acc[j][m] = zero16();
  for (int64_t k = 0; k < kfull; k += 32) {
    bf16x32 wv[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) wv[j] = load_bf16x32(wr + j * K + k);
    if (pf) {
#pragma GCC unroll 4
      for (int j = J0; j < J1; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * K + k), _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) {
      const bf16x32 xv = load_bf16x32(x + m * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[j][m] = dot_bf16(acc[j][m], xv, wv[j]);
    }
  }
  if (tail) {
    bf16x32 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load_bf16x32_n(wr + j * K + kfull, tail);
    for (int m = 0; m < MB; ++m) {
      const bf16x32 xv = load_bf16x32_n(x + m * K + kfull, tail);
      for (int j = 0; j < NB; ++j) acc[j][m] = dot_bf16(acc[j][m], xv, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[j * ostride + m] = reduce_add(acc[j][m]);
}

template <int M, int NB, int M0>
inline void group(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t kfull, int tail, float out[][M],
                  const uint16_t* pf) {
  if constexpr (M0 < M) {
    constexpr int MB = (M - M0) < MB_MAX ? (M - M0) : MB_MAX;
    // the next group's rows are prefetched a share a pass, spread over all ceil(M / MB_MAX) passes
    constexpr int P = (M + MB_MAX - 1) / MB_MAX, I = M0 / MB_MAX;
    block<MB, NB, I * NB / P, (I + 1) * NB / P>(x + M0 * K, wr, K, kfull, tail, &out[0][M0], M, pf);
    group<M, NB, M0 + MB>(x, wr, K, kfull, tail, out, pf);
  }
}

inline uint16_t finish(float acc, const uint16_t* b, int64_t n, const uint16_t* r) {
  const uint16_t y = to_bf16(acc + (b ? from_bf16(b[n]) : 0.0f));
  return r ? to_bf16(from_bf16(r[n]) + from_bf16(y)) : y;
}

// M rows of x (row stride K) against weight rows [n0, n1): y row m at y + m * ldy (r likewise); the
// rows after n1 up to pf_end are the caller's next (prefetched as the stream runs on).
template <int M>
void rows_kernel(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, const uint16_t* r,
                 int64_t ldy, int64_t K, int64_t n0, int64_t n1, int64_t pf_end) {
  constexpr int NB = 4;
  const int64_t kfull = K / 32 * 32;
  const int tail = static_cast<int>(K - kfull);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    float out[NB][M];
    group<M, NB, 0>(x, w + n * K, K, kfull, tail, out, n + 2 * NB <= pf_end ? w + (n + NB) * K : nullptr);
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < M; ++m) y[m * ldy + n + j] = finish(out[j][m], b, n + j, r ? r + m * ldy : nullptr);
  }
  for (; n < n1; ++n) {
    float out[1][M];
    group<M, 1, 0>(x, w + n * K, K, kfull, tail, out, nullptr);
    for (int m = 0; m < M; ++m) y[m * ldy + n] = finish(out[0][m], b, n, r ? r + m * ldy : nullptr);
  }
}

using Fn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, const uint16_t*, int64_t, int64_t,
                    int64_t, int64_t, int64_t);
template <int... Ms>
constexpr auto make_table(std::integer_sequence<int, Ms...>) {
  return std::array<Fn, sizeof...(Ms)>{&rows_kernel<Ms + 1>...};
}
inline const auto TABLE = make_table(std::make_integer_sequence<int, MAX_M>{});

// y = x w^T (+ b) (+ r) for x [M, K] and weight rows [n0, n1): one thread's share, part of a stream of
// rows that it reads on to pf_end (>= n1; prefetched ahead across calls).
inline void rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* b, uint16_t* y,
                 const uint16_t* r, int64_t ldy, int64_t n0, int64_t n1, int64_t pf_end) {
  for (int64_t c0 = n0; c0 < n1; c0 += N_CHUNK) {
    const int64_t c1 = std::min(c0 + N_CHUNK, n1);
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
      const int64_t mt = std::min<int64_t>(MAX_M, M - m0);
      TABLE[mt - 1](x + m0 * K, w, b, y + m0 * ldy, r ? r + m0 * ldy : nullptr, ldy, K, c0, c1, m0 == 0 ? pf_end : 0);
    }
  }
}

}  // namespace specctl::skinny
