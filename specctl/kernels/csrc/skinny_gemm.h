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
// On AVX-512 a tile of a multiple of 4 rows reduces its 4 x 4 passes' 16 dot products transposed, as one
// vector (reduce16: the same adds on the same operands as reduce_add's tree), and rounds, adds the bias and
// the residual as vectors: the same bits as the scalar finish, ~17 % less time for [2048, 1536] weights and
// 2-5 % for [17920, 1536] at 16-2048 rows (an AMD EPYC Zen 4, AVX512-BF16, 2 threads, 458 GFLOP/s of
// vdpbf16ps: 330 -> 400 and 375 -> 393 GFLOP/s).
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
#if !defined(__AVX512F__)
#include "gemm_avx2.h"
#endif
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
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
// The next group's rows are prefetched into L2 (T1), not L1 (T0): on an AMD EPYC Zen 4 (2 threads, every linear
// of Qwen2.5-Coder-1.5B, 3.09 GB a pass, the two builds alternated in one process: benchmarks/skinny_builds_ab.py,
// the same bits) T1 took 0.96x T0's time at 1 row (only the 4-row path of K >= ROW_STREAM_K prefetches), 0.83x
// at 2 rows, 0.70x at 5, 0.81x at 8, 0.73x at 9, 0.88x at 16: prefetches into L1 hold its few fill buffers
// while the arithmetic runs, and the stream stalls behind them. Not measured on the Intel Xeon (the same script).
// Tried and not kept (the same script, -DSPECCTL_... builds): 8 or more rows as passes of 8 x rows against 2
// weight rows, prefetching 16 KiB on: 0.91x at 8 rows, 1.00x at 9, but 1.6x the time at 12 and 16 (x no longer
// fits L1 and is read from L2 once per 2 weight rows instead of per 4).
#ifndef SPECCTL_PF_HINT
#define SPECCTL_PF_HINT _MM_HINT_T1
#endif
// A single row of x reads weight rows shorter than this one at a time (rows_kernel<1>; 0: never, for A/B runs).
#ifndef SPECCTL_ROW_STREAM_K
#define SPECCTL_ROW_STREAM_K 4096
#endif
constexpr int64_t ROW_STREAM_K = SPECCTL_ROW_STREAM_K;
// Up to this many x rows take the single stream too, in one pass against each weight row (MB = M accumulators:
// 8 zmm registers on AVX-512; AVX2's 16 ymm would spill them, so it streams one row only). 1: one row only, for
// A/B runs (benchmarks/skinny_builds_ab.py --a=-DSPECCTL_STREAM_M=1). On an AMD EPYC Zen 4 (1.5B, every linear, 2
// threads) 8 rows took 0.85-0.87x the groups' time; 12 and 16 rows streamed so took 1.74x and 1.85x it (16 rows
// of x no longer fit L1): not kept.
#ifndef SPECCTL_STREAM_M
#define SPECCTL_STREAM_M 8
#endif
// How far ahead (weight elements) a stream of several x rows prefetches, one line a load: the hardware prefetcher
// alone, with the M rows of x read beside the weights, left 8 rows at 2.3x one row's time.
#ifndef SPECCTL_STREAM_PF
#define SPECCTL_STREAM_PF 3072
#endif
constexpr int64_t STREAM_PF = SPECCTL_STREAM_PF;
// From STREAM_NB_M x rows on, the stream computes STREAM_NB consecutive weight rows side by side (sblock: at most 16
// accumulators), so that each 32 k of x loaded from L1 serves two weight rows: one pass of 8 rows against one
// weight row loads 9 vectors for 8 vdpbf16ps and is bound by the loads, against two 10 for 16. The 16 outputs
// are reduced transposed and finished as one vector (reduce16). On an AMD EPYC Zen 4 (1.5B, every linear, 2
// threads, benchmarks/skinny_builds_ab.py --a=-DSPECCTL_STREAM_NB_M=99, 7 rounds, the machine reading 58 GB/s):
// 5, 6, 7 and 8 rows took 0.97, 0.94, 0.91 and 0.83x the time of one weight row at a time (8 rows 1.77x -> 1.56x
// one row); 2 and 4 rows took 1.10x and 1.08x it (memory-bound, where the second row is a second stream): so
// below 5 rows, one weight row at a time. In cache the 8-row pass runs at 399 GFLOP/s (87 % of the 458 of the
// registers-only roof), so 8 rows cannot cost less than ~1.2x one row when the machine reads 58 GB/s.
#ifndef SPECCTL_STREAM_NB
#define SPECCTL_STREAM_NB 2
#endif
#if defined(__AVX512F__)
constexpr int STREAM_M = SPECCTL_STREAM_M;
#else
constexpr int STREAM_M = 1;
#endif
// From this many rows of x on, an AVX2 build takes gemm_avx2.h's blocked GEMM (the same outputs).
#ifndef SPECCTL_GEMM_M
#define SPECCTL_GEMM_M 20
#endif
constexpr int64_t GEMM_M = SPECCTL_GEMM_M;
#ifndef SPECCTL_STREAM_NB_M
#define SPECCTL_STREAM_NB_M 5
#endif
constexpr int stream_nb(int M) {
  return M < SPECCTL_STREAM_NB_M ? 1 : M * SPECCTL_STREAM_NB <= 16 ? SPECCTL_STREAM_NB : (16 / M > 0 ? 16 / M : 1);
}

// One output rounded: bf16(acc + b[n]), then bf16(r[n] + that) where r is given.
inline uint16_t finish(float acc, const uint16_t* b, int64_t n, const uint16_t* r) {
  const uint16_t y = to_bf16(acc + (b ? from_bf16(b[n]) : 0.0f));
  return r ? to_bf16(from_bf16(r[n]) + from_bf16(y)) : y;
}

#if !defined(__AVX512F__)
// to_bf16 of 8 lanes (the same integer steps: round to nearest even, NaN to 0x7fc0), each in its lane's low half
inline __m256i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
inline __m256 from_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// finish of outputs n .. n + count - 1 of one row (y, r at that row), from their 8 sums: 8 at once as finish does
// each (the same float adds and roundings), fewer one by one
inline void finish8(__m256 acc, int count, const uint16_t* b, int64_t n, const uint16_t* r, uint16_t* y) {
  if (count < 8) {
    alignas(32) float a[8];
    _mm256_store_ps(a, acc);
    for (int i = 0; i < count; ++i) y[n + i] = finish(a[i], b, n + i, r);
    return;
  }
  __m256i h = to_bf16x8(_mm256_add_ps(acc, b ? from_bf16x8(b + n) : _mm256_setzero_ps()));
  if (r) h = to_bf16x8(_mm256_add_ps(from_bf16x8(r + n), _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(y + n), _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
#endif

// One pass: x rows [M0, M0 + MB) against NB weight rows, into acc[j][m] (weight row j, x row m); prefetches rows
// [J0, J1) of pf (the next rows of the stream) at the same k, one line a load, where pf is given.
template <int MB, int NB, int J0 = 0, int J1 = NB>
inline void accumulate(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t kfull, int tail, const uint16_t* pf,
                       f32x16 (&acc)[NB][MB]) {
#pragma GCC unroll 16
  for (int j = 0; j < NB; ++j)
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) acc[j][m] = zero16();
  for (int64_t k = 0; k < kfull; k += 32) {
    bf16x32 wv[NB];
#pragma GCC unroll 16
    for (int j = 0; j < NB; ++j) wv[j] = load_bf16x32(wr + j * K + k);
    if (pf) {
#pragma GCC unroll 16
      for (int j = J0; j < J1; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * K + k), SPECCTL_PF_HINT);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; ++m) {
      const bf16x32 xv = load_bf16x32(x + m * K + k);
#pragma GCC unroll 16
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
}

// accumulate, each output's lanes summed (out[j * ostride + m])
template <int MB, int NB, int J0 = 0, int J1 = NB>
inline void block(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t kfull, int tail, float* out,
                  int ostride, const uint16_t* pf) {
  f32x16 acc[NB][MB];
  accumulate<MB, NB, J0, J1>(x, wr, K, kfull, tail, pf, acc);
  for (int j = 0; j < NB; ++j)
    for (int m = 0; m < MB; ++m) out[j * ostride + m] = reduce_add(acc[j][m]);
}

#if defined(__AVX512F__)
// The 16 lane sums of v[0..15] in one vector: lane i = reduce_add(v[i]), bit for bit (every add takes the
// same two operands as reduce_add's tree: halves, quarters, then pairs; only the lanes are transposed).
inline __m512 reduce16(const __m512* v) {
  __m512 s1[8], s2[4], s3[2];
  for (int p = 0; p < 8; ++p)  // lanes 0-7: v[2p]'s halves summed, 8-15: v[2p+1]'s
    s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int q = 0; q < 4; ++q)  // quarter c: v[4q + c]'s quarters summed
    s2[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * q], s1[2 * q + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s1[2 * q], s1[2 * q + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int r = 0; r < 2; ++r)  // in quarter l: pairs of v[8r + l] (lanes 0, 1), of v[8r + 4 + l] (2, 3)
    s3[r] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * r], s2[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * r], s2[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4l + c: v[4c + l]'s sum; permuted to lane 4c + l
  const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
}

// to_bf16 of 16 lanes (round to nearest even, subnormals kept, NaN -> 0x7fc0), as 16 uint16
inline __m256i to_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}
inline __m512 from_bf16x16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
#endif

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

#if defined(__AVX512F__)
// One 4 x 4 pass (x rows [M0, M0 + 4) against weight rows [n, n + 4)), its 16 outputs reduced and finished
// (bias, bf16, residual) as one vector: the same bits as block<4, 4> and finish.
template <int J0, int J1>
inline void vblock(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t kfull, int tail, const uint16_t* b,
                   int64_t n, uint16_t* y, const uint16_t* r, int64_t ldy, const uint16_t* pf) {
  __m512 acc[16];  // acc[4m + j]: x row m, weight row j
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = zero16();
  for (int64_t k = 0; k < kfull; k += 32) {
    bf16x32 wv[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) wv[j] = load_bf16x32(wr + j * K + k);
    if (pf) {
#pragma GCC unroll 4
      for (int j = J0; j < J1; ++j) _mm_prefetch(reinterpret_cast<const char*>(pf + j * K + k), SPECCTL_PF_HINT);
    }
#pragma GCC unroll 4
    for (int m = 0; m < 4; ++m) {
      const bf16x32 xv = load_bf16x32(x + m * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[4 * m + j] = dot_bf16(acc[4 * m + j], xv, wv[j]);
    }
  }
  if (tail) {
    bf16x32 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = load_bf16x32_n(wr + j * K + kfull, tail);
    for (int m = 0; m < 4; ++m) {
      const bf16x32 xv = load_bf16x32_n(x + m * K + kfull, tail);
      for (int j = 0; j < 4; ++j) acc[4 * m + j] = dot_bf16(acc[4 * m + j], xv, wv[j]);
    }
  }
  __m512 s = reduce16(acc);
  if (b) s = _mm512_add_ps(s, from_bf16x16(_mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + n)))));
  __m256i h = to_bf16x16(s);
  if (r) {
    const __m256i rv = _mm256_setr_epi64x(*reinterpret_cast<const int64_t*>(r + n), *reinterpret_cast<const int64_t*>(r + ldy + n),
                                          *reinterpret_cast<const int64_t*>(r + 2 * ldy + n), *reinterpret_cast<const int64_t*>(r + 3 * ldy + n));
    h = to_bf16x16(_mm512_add_ps(from_bf16x16(rv), from_bf16x16(h)));
  }
  alignas(32) int64_t rows4[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(rows4), h);
  for (int m = 0; m < 4; ++m) std::memcpy(y + m * ldy + n, &rows4[m], 8);
}

// A stream of M x rows against NB consecutive weight rows [n, n + NB), all in one pass over k (accumulate: one
// stream, pf STREAM_PF elements ahead), then finished. M * NB == 16: the 16 outputs reduced and finished (bias,
// bf16, residual) as one vector, lane j * M + m for y[m, n + j]; else one output at a time. The same bits as
// block<M, 1> row by row.
template <int M, int NB>
inline void sblock(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t kfull, int tail, const uint16_t* b,
                   int64_t n, uint16_t* y, const uint16_t* r, int64_t ldy, const uint16_t* pf) {
  f32x16 acc[NB][M];
  accumulate<M, NB>(x, wr, K, kfull, tail, pf, acc);
  if constexpr (M * NB == 16) {
    __m512 s = reduce16(&acc[0][0]);
    alignas(32) uint16_t v[16];
    if (b) {
      for (int j = 0; j < NB; ++j)
        for (int m = 0; m < M; ++m) v[j * M + m] = b[n + j];
      s = _mm512_add_ps(s, from_bf16x16(_mm256_load_si256(reinterpret_cast<const __m256i*>(v))));
    }
    __m256i h = to_bf16x16(s);
    if (r) {
      for (int j = 0; j < NB; ++j)
        for (int m = 0; m < M; ++m) v[j * M + m] = r[m * ldy + n + j];
      h = to_bf16x16(_mm512_add_ps(from_bf16x16(_mm256_load_si256(reinterpret_cast<const __m256i*>(v))), from_bf16x16(h)));
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(v), h);
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < M; ++m) y[m * ldy + n + j] = v[j * M + m];
  } else {
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < M; ++m) y[m * ldy + n + j] = finish(reduce_add(acc[j][m]), b, n + j, r ? r + m * ldy : nullptr);
  }
}

template <int M, int M0>
inline void vgroup(const uint16_t* x, const uint16_t* wr, int64_t K, int64_t kfull, int tail, const uint16_t* b,
                   int64_t n, uint16_t* y, const uint16_t* r, int64_t ldy, const uint16_t* pf) {
  if constexpr (M0 < M) {
    constexpr int P = M / 4, I = M0 / 4;
    vblock<I * 4 / P, (I + 1) * 4 / P>(x + M0 * K, wr, K, kfull, tail, b, n, y + M0 * ldy, r ? r + M0 * ldy : nullptr, ldy, pf);
    vgroup<M, M0 + 4>(x, wr, K, kfull, tail, b, n, y, r, ldy, pf);
  }
}
#endif

// M rows of x (row stride K) against weight rows [n0, n1): y row m at y + m * ldy (r likewise); the
// rows after n1 up to pf_end are the caller's next (prefetched as the stream runs on).
template <int M>
void rows_kernel(const uint16_t* x, const uint16_t* w, const uint16_t* b, uint16_t* y, const uint16_t* r,
                 int64_t ldy, int64_t K, int64_t n0, int64_t n1, int64_t pf_end) {
  constexpr int NB = 4;
  const int64_t kfull = K / 32 * 32;
  const int tail = static_cast<int>(K - kfull);
  int64_t n = n0;
  // One row (a decode step) against rows of fewer than ROW_STREAM_K inputs: the weight rows one after the
  // other, so the thread reads one sequential stream. Four rows side by side are four streams of K * 2
  // bytes each, too short for the hardware prefetcher to train on before they end: on an AMD EPYC Zen 4 (2
  // threads, [N, 1536] bf16 weights, 1.5 GiB) they read 29-30 GB/s where the single stream read 37-64 GB/s
  // (the machine's read rate of the moment). Each output's dot product is the same (one accumulator over k
  // in order, the same lane reduction), so the bits are the same; at K = 8960 the four streams read
  // 5-10 % faster, and keep them.
  // (one_stream: the groups are skipped and the one-row loop below takes every row).
  // Up to STREAM_M rows (a verification of a short draft, a few requests' decode steps) stream the same way,
  // all M rows in one pass over each weight row: four rows side by side left 2-8 rows at 1.5-2.3x one row's time.
  const bool one_stream = M <= STREAM_M && K < ROW_STREAM_K;
  for (; !one_stream && n + NB <= n1; n += NB) {
#if defined(__AVX512F__)
    if constexpr (M % 4 == 0) {
      vgroup<M, 0>(x, w + n * K, K, kfull, tail, b, n, y, r, ldy, n + 2 * NB <= pf_end ? w + (n + NB) * K : nullptr);
      continue;
    }
#endif
    float out[NB][M];
    group<M, NB, 0>(x, w + n * K, K, kfull, tail, out, n + 2 * NB <= pf_end ? w + (n + NB) * K : nullptr);
    for (int j = 0; j < NB; ++j)
      for (int m = 0; m < M; ++m) y[m * ldy + n + j] = finish(out[j][m], b, n + j, r ? r + m * ldy : nullptr);
  }
#if defined(__AVX512F__)
  if constexpr (M > 1 && M <= STREAM_M && stream_nb(M) > 1) {
    constexpr int SB = stream_nb(M);
    for (; one_stream && n + SB <= n1; n += SB)
      sblock<M, SB>(x, w + n * K, K, kfull, tail, b, n, y, r, ldy,
                    STREAM_PF > 0 && (n + SB) * K + STREAM_PF <= pf_end * K ? w + n * K + STREAM_PF : nullptr);
  }
#endif
  for (; n < n1; ++n) {
    float out[1][M];
    if constexpr (M <= STREAM_M)
      block<M, 1>(x, w + n * K, K, kfull, tail, &out[0][0], M,  // the weight row read once, in one pass
                  M > 1 && STREAM_PF > 0 && (n + 1) * K + STREAM_PF <= pf_end * K ? w + n * K + STREAM_PF : nullptr);
    else
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
#if !defined(__AVX512F__)
  if (M >= GEMM_M) {  // the same bits, blocked for reuse (gemm_avx2.h)
    gemm::rows(x, M, K, w, n0, n1, [&](int64_t m, int64_t n, __m256 v, int count) {
      finish8(v, count, b, n, r ? r + m * ldy : nullptr, y + m * ldy);
    });
    return;
  }
#endif
  for (int64_t c0 = n0; c0 < n1; c0 += N_CHUNK) {
    const int64_t c1 = std::min(c0 + N_CHUNK, n1);
    for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
      const int64_t mt = std::min<int64_t>(MAX_M, M - m0);
      TABLE[mt - 1](x + m0 * K, w, b, y + m0 * ldy, r ? r + m0 * ldy : nullptr, ldy, K, c0, c1, m0 == 0 ? pf_end : 0);
    }
  }
}

}  // namespace specctl::skinny
