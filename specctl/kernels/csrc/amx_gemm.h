// bf16 linear on Intel AMX tiles (the shared core: amx_linear.cpp and decode_layer.cpp use it), for every row count, with weights packed once at load.
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
//     every 4 KiB page; the weights should also sit on huge pages, see specctl/kernels/amx_linear.py);
//   * output blocks split over ATen's threads; for prefill (M > 16) the 4 blocks' tiles are read
//     from memory once and from L2 for the other row chunks.
#pragma once
#include <immintrin.h>
#include "bf16.h"
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace specctl::amx {


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

using specctl::load_bf16x16;

// C tiles 0..g-1 accumulate x[m0:m0+mt] against output blocks nb..nb+g-1 (g <= 4).
template <int g>
inline void tiles(const uint16_t* xrow, int64_t K, const uint16_t* w, int64_t KB, int64_t nb, bool prefetch,
                  int64_t nb_end) {
  const uint16_t* blk[G];
  for (int j = 0; j < g; ++j) blk[j] = w + (nb + j) * KB * 512;
  if constexpr (g > 0) _tile_zero(0);
  if constexpr (g > 1) _tile_zero(1);
  if constexpr (g > 2) _tile_zero(2);
  if constexpr (g > 3) _tile_zero(3);
  for (int64_t kb = 0; kb < KB; ++kb) {
    if (prefetch) {  // PF k blocks ahead; past this group's end, the next group's first tiles
      if (kb + PF < KB) {
        for (int j = 0; j < g; ++j) prefetch_tile(blk[j] + (kb + PF) * 512);
      } else {
        for (int j = 0; j < G && nb + g + j < nb_end; ++j) prefetch_tile(w + ((nb + g + j) * KB + kb + PF - KB) * 512);
      }
    }
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

// y[m, n] = bf16(acc + b[n]), or with a residual r: bf16(r[m, n] + bf16(acc + b[n])) (as x + linear(x)
// rounds in torch). y and r have row stride ldy.
template <int g>
inline void group(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* w, int64_t KB, int64_t ldy, int64_t nb,
           const uint16_t* bp, uint16_t* yp, const uint16_t* rp, float* cbuf, int& configured, int64_t nb_end) {
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int mt = static_cast<int>(std::min<int64_t>(16, M - m0));
    if (mt != configured) {
      configure(mt);
      configured = mt;
    }
    tiles<g>(xp + m0 * K, K, w, KB, nb, m0 == 0, nb_end);  // later row chunks find the tiles in cache
    store<g>(cbuf);
    for (int j = 0; j < g; ++j) {  // + bias, one rounding to bf16 (nearest even, as torch)
      const int64_t n0 = (nb + j) * 16;
      const __m512 bias = bp ? load_bf16x16(bp + n0) : _mm512_setzero_ps();
      for (int m = 0; m < mt; ++m) {
        const __m512 c = _mm512_add_ps(_mm512_load_ps(cbuf + j * 256 + m * 16), bias);
        __m256bh out = _mm512_cvtneps_pbh(c);
        if (rp) out = _mm512_cvtneps_pbh(_mm512_add_ps(load_bf16x16(rp + (m0 + m) * ldy + n0),
                                                       load_bf16x16(reinterpret_cast<const uint16_t*>(&out))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(yp + (m0 + m) * ldy + n0), (__m256i)out);
      }
    }
  }
}


// Output groups [g0, g1) (G blocks of 16 outputs each) of y = x wp^T (+ b) (+ r): one thread's share, part
// of a stream of groups that it reads on to pf_end (>= g1), prefetched ahead across calls.
inline void groups(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* w, int64_t NB, const uint16_t* bp,
                   uint16_t* yp, const uint16_t* rp, int64_t ldy, int64_t g0, int64_t g1, int& configured,
                   int64_t pf_end) {
  alignas(64) float cbuf[G * 256];
  const int64_t KB = K / 32, nb_end = std::min(NB, pf_end * G);  // prefetch within the stream
  for (int64_t gi = g0; gi < g1; ++gi) {
    const int64_t nb = gi * G;
    switch (std::min<int64_t>(G, NB - nb)) {
      case 4: group<4>(xp, M, K, w, KB, ldy, nb, bp, yp, rp, cbuf, configured, nb_end); break;
      case 3: group<3>(xp, M, K, w, KB, ldy, nb, bp, yp, rp, cbuf, configured, nb_end); break;
      case 2: group<2>(xp, M, K, w, KB, ldy, nb, bp, yp, rp, cbuf, configured, nb_end); break;
      default: group<1>(xp, M, K, w, KB, ldy, nb, bp, yp, rp, cbuf, configured, nb_end); break;
    }
  }
}

inline int64_t num_groups(int64_t NB) { return (NB + G - 1) / G; }

}  // namespace specctl::amx
