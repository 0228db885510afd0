// y = x @ W^T with W kept as raw GGUF blocks (ggml's byte layouts), for decode and verify forwards.
//
//   x: [M, K] bf16 or fp32;  W: one or more parts, each [N_p, K/QK * bytes] uint8 of one ggml type;
//   y: [M, sum N_p] (bf16 or fp32): the parts' outputs side by side (q|k|v, gate|up fused).
//
// Types (ggml's layouts, QK weights a block): Q4_0 (fp16 d, 16 B nibbles), Q4_1 (fp16 d, fp16 m, 16 B
// nibbles), Q5_0 (fp16 d, 4 B high bits, 16 B nibbles), Q8_0 (fp16 d, 32 int8), Q4_K (QK 256: fp16 d,
// fp16 dmin, 12 B of 6-bit scales and mins, 128 B nibbles), Q6_K (QK 256: 128 B low 4 bits, 64 B high
// 2 bits, 16 int8 scales, fp16 d).
//
// Why: decode is memory bound, so a weight row is read once for all M rows of x, decoded 256 weights at
// a time into an L1 buffer from which every x row accumulates. Each output is a fixed set of fp32
// running vector sums over the row, reduced in a fixed order: row m of an M-row call equals the same
// row called alone, bit for bit (batch invariance: verification computes what decoding computes).
//
// Two ways to multiply, both against the fp32 reference up to fp32 summation order:
// - fp32 (x fp32, or any x without AVX512-BF16): a weight is decoded to fp32 with gguf-py's operations
//   in gguf-py's order (`dequantize` equals gguf.quants.dequantize bit for bit), then FMA'd with x.
// - bf16 (x bf16 on AVX512-BF16): a block's integers (at most 6 bits) are exact in bf16; vdpbf16ps sums
//   x * q over 32 weights exactly-multiplied in fp32, then one FMA applies the block's scale, and a
//   block's min (Q4_1, Q4_K) multiplies the precomputed sum of x over the block. Half the decode work
//   of fp32 (32 lanes an instruction). Not int8 VNNI: that needs x rounded to int8, as llama.cpp does.
//
// One source, four builds: +AVX512-BF16, -mavx512f (16 lanes), -mavx2 (8 lanes), none (scalar).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

enum Type : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
constexpr int qk_of(int t) { return t == Q4_K || t == Q6_K ? 256 : 32; }
constexpr int bytes_of(int t) {
  return t == Q4_0 ? 18 : t == Q4_1 ? 20 : t == Q5_0 ? 22 : t == Q8_0 ? 34 : t == Q4_K ? 144 : t == Q6_K ? 210 : 0;
}
template <int T> using Ty = std::integral_constant<int, T>;
template <class Fn> inline void with_type(int t, Fn fn) {  // fn(Ty<t>{}): one instance per type
  switch (t) {
    case Q4_0: return fn(Ty<Q4_0>{});
    case Q4_1: return fn(Ty<Q4_1>{});
    case Q5_0: return fn(Ty<Q5_0>{});
    case Q8_0: return fn(Ty<Q8_0>{});
    case Q4_K: return fn(Ty<Q4_K>{});
    case Q6_K: return fn(Ty<Q6_K>{});
  }
  TORCH_CHECK(false, "quant_linear: unsupported ggml type ", t);
}

inline float half(const uint8_t* p) {  // IEEE fp16 (little endian) -> fp32, exact
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  float f = exp == 0x1f ? (man ? NAN : INFINITY) : exp ? std::ldexp(float(man | 0x400), int(exp) - 25)
                                                       : std::ldexp(float(man), -24);
  return sign ? -f : f;
#endif
}

inline float from_bf16(uint16_t h) { uint32_t u = uint32_t(h) << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline uint16_t to_bf16(float f) {  // round to nearest even, as torch
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ---- W-lane vector operations: the decoders and the dot are written once over these.
#if defined(__AVX512F__)
struct V {
  static constexpr int W = 16, NACC = 4, MT = 4;  // lanes, running sums per row, x rows per register tile
  using F = __m512; using I = __m512i;
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I iota(int b) { return _mm512_add_epi32(_mm512_set1_epi32(b), _mm512_setr_epi32(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15)); }
  static I seti(int v) { return _mm512_set1_epi32(v); }
  static I band(I a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
  static I bor(I a, I b) { return _mm512_or_si512(a, b); }
  static I shr(I a, int s) { return _mm512_srlv_epi32(a, _mm512_set1_epi32(s)); }
  static I shrv(I a, I s) { return _mm512_srlv_epi32(a, s); }
  static I shl(I a, int s) { return _mm512_sllv_epi32(a, _mm512_set1_epi32(s)); }
  static I subi(I a, int b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F set(float v) { return _mm512_set1_ps(v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static const char* name() { return "avx512"; }
};
#elif defined(__AVX2__)
struct V {
  static constexpr int W = 8, NACC = 4, MT = 2;
  using F = __m256; using I = __m256i;
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I iota(int b) { return _mm256_add_epi32(_mm256_set1_epi32(b), _mm256_setr_epi32(0,1,2,3,4,5,6,7)); }
  static I seti(int v) { return _mm256_set1_epi32(v); }
  static I band(I a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
  static I bor(I a, I b) { return _mm256_or_si256(a, b); }
  static I shr(I a, int s) { return _mm256_srlv_epi32(a, _mm256_set1_epi32(s)); }
  static I shrv(I a, I s) { return _mm256_srlv_epi32(a, s); }
  static I shl(I a, int s) { return _mm256_sllv_epi32(a, _mm256_set1_epi32(s)); }
  static I subi(I a, int b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F set(float v) { return _mm256_set1_ps(v); }
  static F zero() { return _mm256_setzero_ps(); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static float sum(F v) {  // fixed order: halves, then pairs
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
  static const char* name() { return "avx2"; }
};
#else
struct V {
  static constexpr int W = 1, NACC = 4, MT = 4;
  using F = float; using I = int32_t;
  static I u8(const uint8_t* p) { return *p; }
  static I i8(const uint8_t* p) { return static_cast<int8_t>(*p); }
  static I iota(int b) { return b; }
  static I seti(int v) { return v; }
  static I band(I a, int m) { return a & m; }
  static I bor(I a, I b) { return a | b; }
  static I shr(I a, int s) { return int32_t(uint32_t(a) >> s); }
  static I shrv(I a, I s) { return int32_t(uint32_t(a) >> s); }
  static I shl(I a, int s) { return a << s; }
  static I subi(I a, int b) { return a - b; }
  static F cvt(I a) { return static_cast<float>(a); }
  static F set(float v) { return v; }
  static F zero() { return 0.0f; }
  static F mul(F a, F b) { return a * b; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F load(const float* p) { return *p; }
  static void store(float* p, F v) { *p = v; }
  static float sum(F v) { return v; }
  static const char* name() { return "scalar"; }
};
#endif
constexpr int W = V::W;
constexpr int UNIT = 1024;  // weights decoded per step (32 blocks of 32, or 4 super-blocks)

inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {  // ggml's get_scale_min_k4
  if (j < 4) { sc = s[j] & 63; m = s[j + 4] & 63; }
  else { sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}

// ---- fp32 path: one block at b -> out[QK] fp32, the arithmetic of gguf-py's dequantize_blocks.
template <int T>
inline void dec(const uint8_t* b, float* out) {
  if constexpr (T == Q8_0) {  // d * q
    const V::F d = V::set(half(b));
    for (int i = 0; i < 32; i += W) V::store(out + i, V::mul(d, V::cvt(V::i8(b + 2 + i))));
  } else if constexpr (T == Q4_0 || T == Q4_1 || T == Q5_0) {  // (q - 8) * d; d * q + m; d * (q5 - 16)
    const V::F d = V::set(half(b)), m = V::set(T == Q4_1 ? half(b + 2) : 0.0f);
    uint32_t qh = 0;
    if constexpr (T == Q5_0) std::memcpy(&qh, b + 2, 4);
    const uint8_t* qs = b + (T == Q4_0 ? 2 : T == Q4_1 ? 4 : 6);
    for (int j = 0; j < 16; j += W) {
      V::I lo = V::band(V::u8(qs + j), 15), hi = V::shr(V::u8(qs + j), 4);
      if constexpr (T == Q4_1) {
        V::store(out + j, V::add(V::mul(d, V::cvt(lo)), m));
        V::store(out + 16 + j, V::add(V::mul(d, V::cvt(hi)), m));
      } else if constexpr (T == Q4_0) {
        V::store(out + j, V::mul(V::cvt(V::subi(lo, 8)), d));
        V::store(out + 16 + j, V::mul(V::cvt(V::subi(hi, 8)), d));
      } else {
        const V::I h = V::seti(static_cast<int32_t>(qh));
        lo = V::bor(lo, V::shl(V::band(V::shrv(h, V::iota(j)), 1), 4));
        hi = V::bor(hi, V::shl(V::band(V::shrv(h, V::iota(j + 16)), 1), 4));
        V::store(out + j, V::mul(d, V::cvt(V::subi(lo, 16))));
        V::store(out + 16 + j, V::mul(d, V::cvt(V::subi(hi, 16))));
      }
    }
  } else if constexpr (T == Q4_K) {  // (d * sc) * q - (dmin * m), sub-blocks of 32
    const float d = half(b), dmin = half(b + 2);
    const uint8_t* q = b + 16;
    for (int c = 0; c < 4; ++c, q += 32, out += 64) {  // 64 weights: low nibbles, then high nibbles
      int s1, m1, s2, m2;
      scale_min_k4(2 * c, b + 4, s1, m1);
      scale_min_k4(2 * c + 1, b + 4, s2, m2);
      const V::F d1 = V::set(d * float(s1)), n1 = V::set(dmin * float(m1));
      const V::F d2 = V::set(d * float(s2)), n2 = V::set(dmin * float(m2));
      for (int l = 0; l < 32; l += W) {
        const V::I v = V::u8(q + l);
        V::store(out + l, V::sub(V::mul(d1, V::cvt(V::band(v, 15))), n1));
        V::store(out + 32 + l, V::sub(V::mul(d2, V::cvt(V::shr(v, 4))), n2));
      }
    }
  } else {  // Q6_K: (d * sc) * (q - 32), sub-blocks of 16
    const float d = half(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const uint8_t *ql = b, *qh = b + 128;
    for (int c = 0; c < 2; ++c, ql += 64, qh += 32, sc += 8, out += 128) {
      for (int l = 0; l < 32; l += W) {
        const int is = l / 16;
        const V::I a = V::u8(ql + l), a2 = V::u8(ql + 32 + l), h = V::u8(qh + l);
        const V::I q[4] = {V::bor(V::band(a, 15), V::shl(V::band(h, 3), 4)),
                           V::bor(V::band(a2, 15), V::shl(V::band(V::shr(h, 2), 3), 4)),
                           V::bor(V::shr(a, 4), V::shl(V::band(V::shr(h, 4), 3), 4)),
                           V::bor(V::shr(a2, 4), V::shl(V::shr(h, 6), 4))};
        for (int k = 0; k < 4; ++k) V::store(out + 32 * k + l, V::mul(V::set(d * float(sc[is + 2 * k])), V::cvt(V::subi(q[k], 32))));
      }
    }
  }
}

// Weights [e0, e0 + n) of a row of type T (e0 a multiple of UNIT) -> out[n] fp32.
template <int T>
inline void dec_unit(const uint8_t* row, int64_t e0, int n, float* out) {
  const uint8_t* b = row + e0 / qk_of(T) * bytes_of(T);
  for (int i = 0; i < n; i += qk_of(T), b += bytes_of(T)) dec<T>(b, out + i);
}

// MT_ rows of x (fp32, row stride Kp) against n decoded weights (n a multiple of GROUP: the buffer and
// x are zero-padded); acc: the rows' NACC running sums [MT_][NACC][W], carried across units. Weight
// vector v feeds sum v % NACC.
constexpr int GROUP = V::NACC * W;
template <int MT_>
void dot_tile(const float* w, int n, const float* x, int64_t Kp, float* acc) {
  V::F a[MT_][V::NACC];
  for (int m = 0; m < MT_; ++m)
    for (int s = 0; s < V::NACC; ++s) a[m][s] = V::load(acc + (m * V::NACC + s) * W);
  for (int v = 0; v < n; v += GROUP) {
#pragma GCC unroll 4
    for (int s = 0; s < V::NACC; ++s) {
      const V::F wv = V::load(w + v + s * W);
#pragma GCC unroll 8
      for (int m = 0; m < MT_; ++m) a[m][s] = V::fma(V::load(x + m * Kp + v + s * W), wv, a[m][s]);
    }
  }
  for (int m = 0; m < MT_; ++m)
    for (int s = 0; s < V::NACC; ++s) V::store(acc + (m * V::NACC + s) * W, a[m][s]);
}
template <int... Ms>
constexpr auto f32_tiles(std::integer_sequence<int, Ms...>) {
  return std::array<void (*)(const float*, int, const float*, int64_t, float*), sizeof...(Ms)>{&dot_tile<Ms + 1>...};
}
const auto TILE = f32_tiles(std::make_integer_sequence<int, V::MT>{});

struct Part { const uint8_t* w; int type; int64_t n, row_bytes; };

// Weight rows [g0, g1) of the parts side by side: fn(global row g, its part, its blocks).
template <class Fn>
inline void for_rows(const std::vector<Part>& parts, int64_t g0, int64_t g1, Fn fn) {
  size_t pi = 0;
  int64_t base = 0;  // first global row of part pi
  for (int64_t g = g0; g < g1; ++g) {
    while (g >= base + parts[pi].n) base += parts[pi++].n;
    fn(g, parts[pi], parts[pi].w + (g - base) * parts[pi].row_bytes);
  }
}

struct Out {  // y [M, N] (bf16 or fp32) and an optional bias [N] (bf16 or fp32)
  void* y; bool y_bf16; const void* bias; bool b_bf16; int64_t N;
  void put(int64_t m, int64_t g, float v) const {
    if (bias) v += b_bf16 ? from_bf16(static_cast<const uint16_t*>(bias)[g]) : static_cast<const float*>(bias)[g];
    if (y_bf16) static_cast<uint16_t*>(y)[m * N + g] = to_bf16(v);
    else static_cast<float*>(y)[m * N + g] = v;
  }
};

// fp32 path. x: [M, Kp] fp32, zero-padded past K to Kp (a multiple of GROUP).
void run_f32(const float* x, int64_t M, int64_t K, int64_t Kp, const std::vector<Part>& parts, const Out& out) {
  at::parallel_for(0, out.N, 8, [&](int64_t g0, int64_t g1) {
    alignas(64) float buf[UNIT];
    std::vector<float> acc(M * V::NACC * W);
    for_rows(parts, g0, g1, [&](int64_t g, const Part& P, const uint8_t* row) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      with_type(P.type, [&](auto T) {
        for (int64_t e0 = 0; e0 < K; e0 += UNIT) {
          const int n = static_cast<int>(std::min<int64_t>(UNIT, K - e0)), np = (n + GROUP - 1) / GROUP * GROUP;
          dec_unit<T()>(row, e0, n, buf);
          std::fill(buf + n, buf + np, 0.0f);
          for (int64_t m0 = 0; m0 < M; m0 += V::MT)
            TILE[std::min<int64_t>(V::MT, M - m0) - 1](buf, np, x + m0 * Kp + e0, Kp, acc.data() + m0 * V::NACC * W);
        }
      });
      for (int64_t m = 0; m < M; ++m) {
        const float* a = acc.data() + m * V::NACC * W;
        V::F s = V::load(a);
        for (int k = 1; k < V::NACC; ++k) s = V::add(s, V::load(a + k * W));
        out.put(m, g, V::sum(s));
      }
    });
  });
}

#if defined(__AVX512BF16__)
// ---- bf16 path. A unit of 256 weights decodes to q: the blocks' integers as bf16 (exact); one scale
// vector per group of 32 weights (lanes 0-7 scale weights 0-15, lanes 8-15 weights 16-31: vdpbf16ps
// pairs neighbours); mn: the coefficient of the group's x sum (-dmin * m for Q4_K, m for Q4_1).
namespace bf {
struct Unit { alignas(64) uint16_t q[UNIT]; alignas(64) float sv[UNIT / 32][16]; alignas(32) float mn[UNIT / 32]; };
inline __m512i lut(int base) {  // bf16 of base, base+1, ..., base+31
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = to_bf16(static_cast<float>(base + i));
  return _mm512_load_si512(t);
}
inline void scale(float* sv, float a, float b) { _mm512_store_ps(sv, _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1)); }
inline void put(Unit& u, int g, __m512i q, float s, float mn) { _mm512_store_si512(u.q + 32 * g, q); scale(u.sv[g], s, s); u.mn[g] = mn; }
inline __m512i nib16(const uint8_t* p) {  // 16 bytes -> 32 lanes: low nibbles, then high nibbles
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p)));
  const __m512i sh = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(v, sh), _mm512_set1_epi16(15));
}
inline __m512i u8x32(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
inline __m512i sel(__m512i lo4, __m512i hi) { return _mm512_ternarylogic_epi32(_mm512_set1_epi16(15), lo4, hi, 0xCA); }

template <int T>
inline void block(const uint8_t* b, Unit& u, int g) {
  static const __m512i U = lut(0), M8 = lut(-8), M16 = lut(-16), M32 = lut(-32);  // bf16 of q (- offset)
  if constexpr (T == Q4_0) put(u, g, _mm512_permutexvar_epi16(nib16(b + 2), M8), half(b), 0.0f);
  if constexpr (T == Q4_1) put(u, g, _mm512_permutexvar_epi16(nib16(b + 4), U), half(b), half(b + 2));
  if constexpr (T == Q5_0) {  // the high bits: a mask over the 32 lanes
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m512i n = nib16(b + 6);
    put(u, g, _mm512_permutexvar_epi16(_mm512_mask_add_epi16(n, qh, n, _mm512_set1_epi16(16)), M16), half(b), 0.0f);
  }
  if constexpr (T == Q8_0) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 2))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 18))));
    put(u, g, (__m512i)_mm512_cvtne2ps_pbh(hi, lo), half(b), 0.0f);
  }
  if constexpr (T == Q4_K) {
    const float d = half(b), dmin = half(b + 2);
    for (int c = 0; c < 4; ++c) {
      const __m512i v = u8x32(b + 16 + 32 * c);
      int s1, m1, s2, m2;
      scale_min_k4(2 * c, b + 4, s1, m1);
      scale_min_k4(2 * c + 1, b + 4, s2, m2);
      put(u, g + 2 * c, _mm512_permutexvar_epi16(_mm512_and_si512(v, _mm512_set1_epi16(15)), U), d * float(s1),
          -(dmin * float(m1)));
      put(u, g + 2 * c + 1, _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), U), d * float(s2), -(dmin * float(m2)));
    }
  }
  if constexpr (T == Q6_K) {  // 6-bit index: low 4 bits from ql, bits 4-5 from qh (vpermt2w reads 6 bits)
    const float d = half(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int c = 0; c < 2; ++c) {
      const __m512i A = u8x32(b + 64 * c), B = u8x32(b + 64 * c + 32), H = u8x32(b + 128 + 32 * c);
      const __m512i idx[4] = {sel(A, _mm512_slli_epi16(H, 4)), sel(B, _mm512_slli_epi16(H, 2)),
                              sel(_mm512_srli_epi16(A, 4), H), sel(_mm512_srli_epi16(B, 4), _mm512_srli_epi16(H, 2))};
      for (int k = 0; k < 4; ++k) {
        const int gi = g + 4 * c + k;
        _mm512_store_si512(u.q + 32 * gi, _mm512_permutex2var_epi16(M32, idx[k], U));
        scale(u.sv[gi], d * float(sc[8 * c + 2 * k]), d * float(sc[8 * c + 2 * k + 1]));
        u.mn[gi] = 0.0f;
      }
    }
  }
}

// MT_ rows of x (bf16, row stride Kp) against a unit's ngp groups; acc [MT_][4]: the rows' running
// sums (group g feeds sum g % 4).
template <int MT_>
void dot_tile(const Unit& u, int ngp, const uint16_t* x, int64_t Kp, __m512* acc) {
  __m512 a[MT_][4];
  for (int m = 0; m < MT_; ++m)
    for (int s = 0; s < 4; ++s) a[m][s] = acc[m * 4 + s];
  for (int g = 0; g < ngp; g += 4) {
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const __m512bh q = (__m512bh)_mm512_load_si512(u.q + 32 * (g + s));
      const __m512 sv = _mm512_load_ps(u.sv[g + s]);
#pragma GCC unroll 8
      for (int m = 0; m < MT_; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * Kp + 32 * (g + s));
        a[m][s] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv, q), sv, a[m][s]);
      }
    }
  }
  for (int m = 0; m < MT_; ++m)
    for (int s = 0; s < 4; ++s) acc[m * 4 + s] = a[m][s];
}
constexpr int MT = 4;
template <int... Ms>
constexpr auto bf_tiles(std::integer_sequence<int, Ms...>) {
  return std::array<void (*)(const Unit&, int, const uint16_t*, int64_t, __m512*), sizeof...(Ms)>{&dot_tile<Ms + 1>...};
}
const auto TILE = bf_tiles(std::make_integer_sequence<int, MT>{});

// x: [M, Kp] bf16 zero-padded (Kp a multiple of 256); xs: [M, Kp / 32] fp32, each group's x sum.
void run(const uint16_t* x, const float* xs, int64_t M, int64_t K, int64_t Kp, const std::vector<Part>& parts,
         const Out& out) {
  at::parallel_for(0, out.N, 8, [&](int64_t g0, int64_t g1) {
    Unit u;
    std::vector<__m512> acc(M * 4);
    std::vector<__m256> accm(M);
    for_rows(parts, g0, g1, [&](int64_t g, const Part& P, const uint8_t* row) {
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      std::fill(accm.begin(), accm.end(), _mm256_setzero_ps());
      with_type(P.type, [&](auto T) {
        constexpr int QK = qk_of(T()), BY = bytes_of(T());
        const uint8_t* b = row;
        for (int64_t e0 = 0; e0 < K; e0 += UNIT) {
          const int n = static_cast<int>(std::min<int64_t>(UNIT, K - e0)), ng = n / 32, ngp = (ng + 7) / 8 * 8;
          for (int i = 0; i < n; i += QK, b += BY) block<T()>(b, u, i / 32);
          for (int i = ng; i < ngp; ++i) {  // past the row's end: zeros
            _mm512_store_si512(u.q + 32 * i, _mm512_setzero_si512());
            scale(u.sv[i], 0.0f, 0.0f);
            u.mn[i] = 0.0f;
          }
          for (int64_t m0 = 0; m0 < M; m0 += MT)
            TILE[std::min<int64_t>(MT, M - m0) - 1](u, ngp, x + m0 * Kp + e0, Kp, &acc[m0 * 4]);
          if constexpr (T() == Q4_1 || T() == Q4_K)
            for (int64_t m = 0; m < M; ++m)
              for (int i = 0; i < ngp; i += 8)
                accm[m] = _mm256_fmadd_ps(_mm256_load_ps(u.mn + i), _mm256_loadu_ps(xs + m * (Kp / 32) + e0 / 32 + i), accm[m]);
        }
      });
      for (int64_t m = 0; m < M; ++m) {
        const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[m * 4], acc[m * 4 + 1]), _mm512_add_ps(acc[m * 4 + 2], acc[m * 4 + 3]));
        out.put(m, g, _mm512_reduce_add_ps(s) + _mm512_reduce_add_ps(_mm512_zextps256_ps512(accm[m])));
      }
    });
  });
}
}  // namespace bf
#endif

std::vector<Part> parts_of(const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& types, int64_t K) {
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "quant_linear: one type per weight part");
  std::vector<Part> parts;
  for (size_t i = 0; i < ws.size(); ++i) {
    const auto& w = ws[i];
    const int t = static_cast<int>(types[i]), qk = qk_of(t), by = bytes_of(t);
    TORCH_CHECK(by > 0, "quant_linear: unsupported ggml type ", t);
    TORCH_CHECK(K % qk == 0, "quant_linear: in_features ", K, " is not a multiple of the block size ", qk);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && !w.is_cuda(),
                "quant_linear: weights are contiguous uint8 [N, row_bytes] on the CPU");
    TORCH_CHECK(w.size(1) == K / qk * by, "quant_linear: a row of K=", K, " holds ", K / qk * by,
                " bytes of this type, the weight has ", w.size(1));
    parts.push_back({w.data_ptr<uint8_t>(), t, w.size(0), w.size(1)});
  }
  return parts;
}

}  // namespace

torch::Tensor quant_linear(torch::Tensor x, std::vector<torch::Tensor> ws, std::vector<int64_t> types, int64_t K,
                           c10::optional<torch::Tensor> bias, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "quant_linear: x is [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "quant_linear: x is bf16 or fp32");
  const auto parts = parts_of(ws, types, K);
  int64_t N = 0;
  for (const auto& p : parts) N += p.n;
  const int64_t M = x.size(0);
  torch::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == N && (bc.scalar_type() == at::kFloat || bc.scalar_type() == at::kBFloat16),
                "quant_linear: bias is [N] fp32 or bf16");
  }
  const bool y_bf16 = !out_fp32 && x.scalar_type() == at::kBFloat16;
  auto y = torch::empty({M, N}, x.options().dtype(y_bf16 ? at::kBFloat16 : at::kFloat));
  if (M == 0) return y;
  const Out out{y.data_ptr(), y_bf16, bc.defined() ? bc.data_ptr() : nullptr,
                bc.defined() && bc.scalar_type() == at::kBFloat16, N};
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    const int64_t Kp = (K + 255) / 256 * 256;
    torch::Tensor xb = torch::zeros({M, Kp}, x.options());
    xb.narrow(1, 0, K).copy_(x);
    const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
    torch::Tensor xs = torch::empty({M, Kp / 32}, x.options().dtype(at::kFloat));  // x . 1 over each group
    for (int64_t i = 0; i < M * Kp / 32; ++i)
      xs.data_ptr<float>()[i] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(
          _mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(xp + 32 * i), (__m512bh)_mm512_set1_epi16(0x3f80)));
    bf::run(xp, xs.data_ptr<float>(), M, K, Kp, parts, out);
    return y;
  }
#endif
  const int64_t Kp = (K + GROUP - 1) / GROUP * GROUP;
  torch::Tensor xf = torch::zeros({M, Kp}, x.options().dtype(at::kFloat));
  xf.narrow(1, 0, K).copy_(x);  // exact for bf16
  run_f32(xf.data_ptr<float>(), M, K, Kp, parts, out);
  return y;
}

// The weights [N, K] of one part, decoded as the fp32 path does (gguf-py's dequantize bit for bit),
// written as `dtype` (float32 or bfloat16).
torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize: dtype is float32 or bfloat16");
  const Part P = parts_of({w}, {type}, K)[0];
  auto out = torch::empty({P.n, K}, w.options().dtype(dtype));
  at::parallel_for(0, P.n, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(K);
    for (int64_t r = r0; r < r1; ++r) {
      with_type(P.type, [&](auto T) {
        for (int64_t e0 = 0; e0 < K; e0 += UNIT)
          dec_unit<T()>(P.w + r * P.row_bytes, e0, static_cast<int>(std::min<int64_t>(UNIT, K - e0)), row.data() + e0);
      });
      if (dtype == at::kFloat) std::memcpy(out.data_ptr<float>() + r * K, row.data(), K * 4);
      else for (int64_t k = 0; k < K; ++k) reinterpret_cast<uint16_t*>(out.data_ptr())[r * K + k] = to_bf16(row[k]);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x @ W^T with W as GGUF blocks");
  m.def("dequantize", &dequantize, "GGUF blocks -> dense weights");
#if defined(__AVX512BF16__)
  m.def("isa", []() { return std::string("avx512_bf16"); });
#else
  m.def("isa", []() { return std::string(V::name()); });
#endif
}
