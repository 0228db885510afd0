// Attention for decode and verification forwards (a few query rows over a long KV cache), bf16.
//
//   out[b, i, h, :] = softmax(scale * q[b, h, i] . K[b, h/G, 0:start+i+1]) V[b, h/G, 0:start+i+1]
//   q: [B, nh, T, hd] bf16, caches: [B, nkv, max_len, hd] bf16, out: [B, T, nh * hd] bf16
//
// Why: query row i of a verification forward sees exactly the keys a one-token decode at position
// start+i sees, and this kernel computes it the same way whatever T is (no mask, no tiling over
// rows): scores in fp32 by vdpbf16ps, softmax in fp32 (a fixed-order sum), the weighted sum of V in
// fp32, one rounding to bf16. So verifying k+1 tokens gives each row bit for bit what decoding it
// alone gives, and it runs as one parallel loop instead of T calls to SDPA per layer.
// Work items: (batch, kv head, query row), each covering the G = nh/nkv query heads that share the
// kv head, so keys and values are read from memory once per item.
#pragma once
#include <immintrin.h>
#include "bf16.h"
#include <cmath>
#include <cstdint>
#include <vector>

namespace specctl::attn {


inline __m512 exp512(__m512 x) {
  // e^x = 2^n * e^r, r = x - n ln2 in [-ln2/2, ln2/2]; degree-6 polynomial for e^r (~1 ulp)
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

using specctl::load_bf16x16;

constexpr int MAX_G = 16;    // query heads per kv head
constexpr int MAX_HD = 256;  // head dim

// GB heads x CW chunks: out[g][16 (c0 + c) ...] = inv[g] * sum_t p[g][t] v[t][16 (c0 + c) ...]
// Which cache row holds key/value j of an item: j itself (a chain: the prefix and the rows before),
// or, for a draft tree, the prefix [0, P) and then the node's ancestors and itself (tail[j - P] slots
// after P). Either way the keys are visited in the order a one-row decode of that path visits them.
struct Contiguous {
  inline int64_t operator()(int64_t j) const { return j; }
};
struct TreeRows {
  int64_t P;
  const int32_t* tail;
  inline int64_t operator()(int64_t j) const { return j < P ? j : P + tail[j - P]; }
};

template <int GB, int CW, class Row>
inline void pv(const float* p, int64_t L, const uint16_t* vc, int hd, int c0, const float* inv, uint16_t* out,
               Row row) {
  __m512 acc[GB][CW];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < CW; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    __m512 v[CW];
    const uint16_t* vt = vc + row(t) * hd;
    for (int c = 0; c < CW; ++c) v[c] = load_bf16x16(vt + 16 * (c0 + c));
    for (int g = 0; g < GB; ++g) {
      const __m512 pt = _mm512_set1_ps(p[g * L + t]);
      for (int c = 0; c < CW; ++c) acc[g][c] = _mm512_fmadd_ps(pt, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const __m512 iv = _mm512_set1_ps(inv[g]);
    for (int c = 0; c < CW; c += 2) {
      const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_mul_ps(acc[g][c + 1], iv), _mm512_mul_ps(acc[g][c], iv));
      _mm512_storeu_si512(out + g * hd + 16 * (c0 + c), (__m512i)pair);
    }
  }
}

template <int CW, class Row>
inline void pv_dispatch(int gb, const float* p, int64_t L, const uint16_t* vc, int hd, int c0, const float* inv,
                 uint16_t* out, Row row) {
  switch (gb) {
    case 1: pv<1, CW>(p, L, vc, hd, c0, inv, out, row); break;
    case 2: pv<2, CW>(p, L, vc, hd, c0, inv, out, row); break;
    case 3: pv<3, CW>(p, L, vc, hd, c0, inv, out, row); break;
    case 4: pv<4, CW>(p, L, vc, hd, c0, inv, out, row); break;
    case 5: pv<5, CW>(p, L, vc, hd, c0, inv, out, row); break;
    default: pv<6, CW>(p, L, vc, hd, c0, inv, out, row); break;
  }
}

template <class Row = Contiguous>
inline void item(const uint16_t* q, int64_t q_hstride, const uint16_t* kc, const uint16_t* vc, int64_t L, int hd,
          int G, float scale, uint16_t* out, std::vector<float>& s, Row row = Row()) {
  // q: G query rows (stride q_hstride); kc/vc: [L, hd]; out: G rows of hd (contiguous heads)
  s.resize(static_cast<size_t>(G) * L);
  const int chunks = hd / 32;
  __m512bh qv[MAX_G][MAX_HD / 32];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < chunks; ++c)
      qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * q_hstride + 32 * c);
  float mx[MAX_G];
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
  for (int64_t j = 0; j < L; ++j) {
    __m512bh kv[MAX_HD / 32];
    const uint16_t* kj = kc + row(j) * hd;
    for (int c = 0; c < chunks; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kj + 32 * c);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < chunks; ++c) acc = _mm512_dpbf16_ps(acc, qv[g][c], kv[c]);
      const float v = _mm512_reduce_add_ps(acc) * scale;
      s[g * L + j] = v;
      mx[g] = v > mx[g] ? v : mx[g];
    }
  }
  float inv[MAX_G];
  for (int g = 0; g < G; ++g) {
    float* sg = s.data() + g * L;
    const __m512 m = _mm512_set1_ps(mx[g]);
    __m512 sum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + j), m));
      _mm512_storeu_ps(sg + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (j < L) {
      const __mmask16 mk = static_cast<__mmask16>((1u << (L - j)) - 1);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + j), m));
      _mm512_mask_storeu_ps(sg + j, mk, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mk, e));
    }
    inv[g] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  // out = P V: heads in groups of at most 6, head dim in passes of CW 16-float chunks, so the
  // 6 x CW accumulators stay in registers and each V row is converted once per group and pass.
  const int cw = hd % 64 == 0 ? 4 : 2;
  for (int g0 = 0; g0 < G; g0 += 6) {
    const int gb = G - g0 < 6 ? G - g0 : 6;
    for (int c0 = 0; c0 < hd / 16; c0 += cw) {
      if (cw == 4) pv_dispatch<4>(gb, s.data() + g0 * L, L, vc, hd, c0, inv + g0, out + g0 * hd, row);
      else pv_dispatch<2>(gb, s.data() + g0 * L, L, vc, hd, c0, inv + g0, out + g0 * hd, row);
    }
  }
}


// A draft tree's rows: from its [T, W] attention mask (W >= T; column c is cache slot
// start + T - W + c, so the last T columns are the call's own rows and the W - T before them earlier
// tree nodes already in the cache; mask[i][c]: slot c is node i or one of its ancestors, parents
// before children), each node's visible slots in order (W entries per node in anc, column indices),
// how many in cnt. Returns false when a node does not see itself or sees a later slot.
inline bool tree_rows(const bool* mask, int64_t T, int64_t W, std::vector<int32_t>& anc, std::vector<int64_t>& cnt) {
  anc.assign(static_cast<size_t>(T * W), 0);
  cnt.assign(static_cast<size_t>(T), 0);
  for (int64_t i = 0; i < T; ++i) {
    const int64_t self = W - T + i;
    if (!mask[i * W + self]) return false;
    for (int64_t j = 0; j < W; ++j) {
      if (!mask[i * W + j]) continue;
      if (j > self) return false;
      anc[i * W + cnt[i]++] = static_cast<int32_t>(j);
    }
  }
  return true;
}

}  // namespace specctl::attn
