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
#include "vec16.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace specctl::attn {


inline f32x16 exp16(f32x16 x) {
  // e^x = 2^n * e^r, r = x - n ln2 in [-ln2/2, ln2/2]; degree-6 polynomial for e^r (~1 ulp)
  x = max(x, set16(-87.0f));
  const f32x16 n = round_nearest(mul(x, set16(1.44269504088896341f)));
  f32x16 r = fnmadd(n, set16(0.693359375f), x);
  r = fnmadd(n, set16(-2.12194440e-4f), r);
  f32x16 p = set16(1.0f / 720);
  p = fmadd(p, r, set16(1.0f / 120));
  p = fmadd(p, r, set16(1.0f / 24));
  p = fmadd(p, r, set16(1.0f / 6));
  p = fmadd(p, r, set16(0.5f));
  p = fmadd(p, r, set16(1.0f));
  p = fmadd(p, r, set16(1.0f));
  return scalef(p, n);
}

using namespace specctl;  // f32x16 and its operations (vec16.h), the bf16 loads and dot (bf16.h)

constexpr int MAX_G = 16;    // query heads per kv head
constexpr int MAX_HD = 256;  // head dim

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

// GB (row, head) pairs x CW chunks: out_g[16 (c0 + c) ...] = inv[g] * sum_{t < L[g]} p_g[t] v[t][16 (c0 + c) ...]
// Every pair accumulates over t in order from 0, as a pair alone would; the pairs share each V row's
// load (rows of a chain see L, L + 1, ...: the keys all see are summed together, the few more one by one).
template <int GB, int CW, class Row>
inline void pv(const float* const* p, const int64_t* L, const uint16_t* vc, int hd, int c0, const float* inv,
               uint16_t* const* out, Row row) {
  f32x16 acc[GB][CW];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < CW; ++c) acc[g][c] = zero16();
  int64_t lo = L[0], hi = L[0];
  for (int g = 1; g < GB; ++g) { lo = L[g] < lo ? L[g] : lo; hi = L[g] > hi ? L[g] : hi; }
  for (int64_t t = 0; t < hi; ++t) {
    f32x16 v[CW];
    const uint16_t* vt = vc + row(t) * hd;
    for (int c = 0; c < CW; ++c) v[c] = load_bf16x16(vt + 16 * (c0 + c));
    for (int g = 0; g < GB; ++g) {
      if (t >= lo && t >= L[g]) continue;
      const f32x16 pt = set16(p[g][t]);
      for (int c = 0; c < CW; ++c) acc[g][c] = fmadd(pt, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g) {
    const f32x16 iv = set16(inv[g]);
    for (int c = 0; c < CW; c += 2) store_bf16x32(out[g] + 16 * (c0 + c), mul(acc[g][c + 1], iv), mul(acc[g][c], iv));
  }
}

template <int CW, class Row>
inline void pv_dispatch(int gb, const float* const* p, const int64_t* L, const uint16_t* vc, int hd, int c0,
                        const float* inv, uint16_t* const* out, Row row) {
  switch (gb) {
    case 1: pv<1, CW>(p, L, vc, hd, c0, inv, out, row); break;
    case 2: pv<2, CW>(p, L, vc, hd, c0, inv, out, row); break;
    case 3: pv<3, CW>(p, L, vc, hd, c0, inv, out, row); break;
    case 4: pv<4, CW>(p, L, vc, hd, c0, inv, out, row); break;
    case 5: pv<5, CW>(p, L, vc, hd, c0, inv, out, row); break;
    default: pv<6, CW>(p, L, vc, hd, c0, inv, out, row); break;
  }
}

// The 16 horizontal sums of a[0..15], in key order: r[t] = sum of a[t]'s lanes. Halving with block
// and lane shuffles (25 shuffles and 15 adds for 16 sums, where 16 separate reductions cost ~8x more).
// Each key's 16 products are summed in one fixed tree, whichever of the 16 places it takes: a key's
// score does not depend on L, T, its neighbours or the batch.
#if defined(__AVX512F__)
inline f32x16 hsum16(const f32x16* a) {
  __m512 s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i)  // blocks 0-1: key 2i's 8 partial sums, blocks 2-3: key 2i+1's
    s8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // block b: key 4i + b's 4 partial sums
    s4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s8[2 * i], s8[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block b: keys 8i + b and 8i + 4 + b, 2 partial sums each, interleaved
    s2[i] = _mm512_add_ps(_mm512_unpacklo_ps(s4[2 * i], s4[2 * i + 1]), _mm512_unpackhi_ps(s4[2 * i], s4[2 * i + 1]));
  const __m512 r = _mm512_add_ps(  // lane 4b + e: key b + 4e
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s2[0]), _mm512_castps_pd(s2[1]))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s2[0]), _mm512_castps_pd(s2[1]))));
  const __m512i key_order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(key_order, r);
}
#else
// The same tree on two ymm halves (blocks 0-1 and 2-3 of the zmm form): every sum adds the same two
// partial sums as the AVX-512 form, so each key's score is the same to the bit.
inline f32x16 hsum16(const f32x16* a) {
  f32x16 s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) s8[i] = {_mm256_add_ps(a[2 * i].lo, a[2 * i].hi), _mm256_add_ps(a[2 * i + 1].lo, a[2 * i + 1].hi)};
  for (int i = 0; i < 4; ++i) {
    const f32x16 c = s8[2 * i], d = s8[2 * i + 1];
    s4[i] = {_mm256_add_ps(_mm256_permute2f128_ps(c.lo, c.hi, 0x20), _mm256_permute2f128_ps(c.lo, c.hi, 0x31)),
             _mm256_add_ps(_mm256_permute2f128_ps(d.lo, d.hi, 0x20), _mm256_permute2f128_ps(d.lo, d.hi, 0x31))};
  }
  for (int i = 0; i < 2; ++i) {
    const f32x16 e = s4[2 * i], f = s4[2 * i + 1];
    s2[i] = {_mm256_add_ps(_mm256_unpacklo_ps(e.lo, f.lo), _mm256_unpackhi_ps(e.lo, f.lo)),
             _mm256_add_ps(_mm256_unpacklo_ps(e.hi, f.hi), _mm256_unpackhi_ps(e.hi, f.hi))};
  }
  auto pairs = [](__m256 x, __m256 y) {
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(x), _mm256_castps_pd(y))));
  };
  const __m256 rlo = pairs(s2[0].lo, s2[1].lo), rhi = pairs(s2[0].hi, s2[1].hi);  // r lanes 0-7, 8-15
  // lane t of the result is r[(t % 4) * 4 + t / 4]: lanes 0-7 take r 0 4 8 12 1 5 9 13, lanes 8-15 r 2 6 10 14 3 7 11 15
  const __m256i first = _mm256_setr_epi32(0, 4, 0, 4, 1, 5, 1, 5), second = _mm256_setr_epi32(2, 6, 2, 6, 3, 7, 3, 7);
  return {_mm256_blend_ps(_mm256_permutevar8x32_ps(rlo, first), _mm256_permutevar8x32_ps(rhi, first), 0xCC),
          _mm256_blend_ps(_mm256_permutevar8x32_ps(rlo, second), _mm256_permutevar8x32_ps(rhi, second), 0xCC)};
}
#endif

constexpr int MAX_Q = 64;  // query vectors (rows x heads) of one item

// One kv head's G query heads for T rows of a chain: row i (its heads at q + i q_rstride + g q_hstride)
// attends to keys [0, L + i) and writes out + i out_rstride + g hd. Keys and values are read once for
// all T x G queries (T * G <= MAX_Q); each row's scores, softmax and weighted sum are computed exactly
// as for that row alone (T = 1), bit for bit. A draft tree's rows (``row`` a TreeRows) go one at a time.
// By-product, for sparse-attention drafting (Vegas): with ``w_first``/``w_last``, the softmax weights of
// local rows ``i_first``/``i_last`` summed over the G heads, written for every key that row sees.
template <class Row = Contiguous>
inline void item(const uint16_t* q, int64_t q_hstride, const uint16_t* kc, const uint16_t* vc, int64_t L, int hd,
          int G, float scale, uint16_t* out, std::vector<float>& s, Row row = Row(), int T = 1,
          int64_t q_rstride = 0, int64_t out_rstride = 0, float* w_first = nullptr, int i_first = -1,
          float* w_last = nullptr, int i_last = -1) {
  const int n = T * G;
  const int64_t Lmax = L + T - 1;
  s.resize(static_cast<size_t>(n) * Lmax);
  const int chunks = hd / 32;
  bf16x32 qv[MAX_Q][MAX_HD / 32];
  int64_t len[MAX_Q];
  for (int i = 0; i < T; ++i)
    for (int g = 0; g < G; ++g) {
      len[i * G + g] = L + i;
      for (int c = 0; c < chunks; ++c)
        qv[i * G + g][c] = load_bf16x32(q + i * q_rstride + g * q_hstride + 32 * c);
    }
  float mx[MAX_Q];
  for (int u = 0; u < n; ++u) mx[u] = -INFINITY;
  int64_t j0 = 0;
  if (chunks <= 4) {  // keys 16 at a time (those every row sees): 16 accumulators per query, one reduction
    f32x16 mxv[MAX_Q];
    for (int u = 0; u < n; ++u) mxv[u] = set16(-INFINITY);
    const f32x16 sc = set16(scale);
    for (; j0 + 16 <= L; j0 += 16) {
      const uint16_t* kj[16];
      for (int t = 0; t < 16; ++t) kj[t] = kc + row(j0 + t) * hd;
      for (int u = 0; u < n; ++u) {
        f32x16 acc[16];
        for (int t = 0; t < 16; ++t) {
          f32x16 a = zero16();
          for (int c = 0; c < chunks; ++c) a = dot_bf16(a, qv[u][c], load_bf16x32(kj[t] + 32 * c));
          acc[t] = a;
        }
        const f32x16 v = mul(hsum16(acc), sc);
        storeu(s.data() + u * Lmax + j0, v);
        mxv[u] = max(mxv[u], v);
      }
    }
    for (int u = 0; u < n; ++u) mx[u] = reduce_max(mxv[u]);
  }
  for (int64_t j = j0; j < Lmax; ++j) {  // the rest, key by key, in the same summation tree
    bf16x32 kv[MAX_HD / 32];
    const uint16_t* kj = kc + row(j) * hd;
    for (int c = 0; c < chunks; ++c) kv[c] = load_bf16x32(kj + 32 * c);
    for (int u = 0; u < n; ++u) {
      if (j >= len[u]) continue;
      f32x16 one[16];
      one[0] = zero16();
      for (int c = 0; c < chunks; ++c) one[0] = dot_bf16(one[0], qv[u][c], kv[c]);
      for (int t = 1; t < 16; ++t) one[t] = zero16();
      const float v = lane0(hsum16(one)) * scale;
      s[u * Lmax + j] = v;
      mx[u] = v > mx[u] ? v : mx[u];
    }
  }
  float inv[MAX_Q];
  for (int u = 0; u < n; ++u) {
    float* sg = s.data() + u * Lmax;
    const int64_t Lu = len[u];
    const f32x16 m = set16(mx[u]);
    f32x16 sum = zero16();
    int64_t j = 0;
    for (; j + 16 <= Lu; j += 16) {
      const f32x16 e = exp16(sub(loadu(sg + j), m));
      storeu(sg + j, e);
      sum = add(sum, e);
    }
    if (j < Lu) {
      const int r = static_cast<int>(Lu - j);
      const f32x16 e = exp16(sub(load_n(sg + j, r), m));
      store_n(sg + j, e, r);
      sum = add(sum, first_n(e, r));
    }
    inv[u] = 1.0f / reduce_add(sum);
  }
  for (int pass = 0; pass < 2; ++pass) {  // the attention weights of the rows asked for
    float* dst = pass ? w_last : w_first;
    const int i = pass ? i_last : i_first;
    if (dst == nullptr || i < 0 || i >= T) continue;
    const int64_t Li = L + i;
    for (int64_t j = 0; j < Li; j += 16) {
      const int r = static_cast<int>(std::min<int64_t>(16, Li - j));
      f32x16 acc = zero16();
      for (int g = 0; g < G; ++g) acc = fmadd(load_n(s.data() + (i * G + g) * Lmax + j, r), set16(inv[i * G + g]), acc);
      store_n(dst + j, acc, r);
    }
  }
  // out = P V: (row, head) pairs in groups of at most 6, head dim in passes of CW 16-float chunks, so
  // the 6 x CW accumulators stay in registers and each V row is converted once per group and pass.
  const int cw = hd % 64 == 0 ? 4 : 2;
  const float* pp[MAX_Q];
  uint16_t* op[MAX_Q];
  for (int i = 0; i < T; ++i)
    for (int g = 0; g < G; ++g) {
      pp[i * G + g] = s.data() + (i * G + g) * Lmax;
      op[i * G + g] = out + i * out_rstride + g * hd;
    }
  for (int u0 = 0; u0 < n; u0 += 6) {
    const int gb = n - u0 < 6 ? n - u0 : 6;
    for (int c0 = 0; c0 < hd / 16; c0 += cw) {
      if (cw == 4) pv_dispatch<4>(gb, pp + u0, len + u0, vc, hd, c0, inv + u0, op + u0, row);
      else pv_dispatch<2>(gb, pp + u0, len + u0, vc, hd, c0, inv + u0, op + u0, row);
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
