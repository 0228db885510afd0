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
// Three ways to multiply; the first two equal the fp32 reference up to fp32 summation order:
// - fp32 (x fp32, or any x without AVX512-BF16): a weight is decoded to fp32 with gguf-py's operations
//   in gguf-py's order (`dequantize` equals gguf.quants.dequantize bit for bit), then FMA'd with x.
// - bf16 (x bf16 on AVX512-BF16): a block's integers (at most 6 bits) are exact in bf16; vdpbf16ps sums
//   x * q over 32 weights exactly-multiplied in fp32, then one FMA applies the block's scale, and a
//   block's min (Q4_1, Q4_K) multiplies the precomputed sum of x over the block. Half the decode work
//   of fp32 (32 lanes an instruction).
// - int8 (the avx512_vnni build, any x): x rounded to int8 per row and 32 values as llama.cpp's Q8_0
//   (d = max|x| / 127), weights as unsigned byte codes (Q8_0's signed codes + 128: x stays the signed
//   operand of vpdpbusd, and -128 * d_w * sum(x) puts the offset back, as the other types' offsets),
//   exact int32 dot products, fp32 scales once per 4 (or 8) products: equals the reference over the
//   rounded x up to fp32 summation order (see namespace q8). Not exact against fp32 x.
//
// One source, five builds: +AVX512-VNNI, +AVX512-BF16, -mavx512f (16 lanes), -mavx2 (8 lanes), none.
#include "torch_ext.h"
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
#include "gguf_q8.h"
#if defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
using namespace specctl::gguf;

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
  static constexpr int W = 16, MB = 4;  // lanes, x rows in a register tile
  using F = __m512; using I = __m512i;
  static I u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
  static I iota(int b) { return _mm512_add_epi32(_mm512_set1_epi32(b), _mm512_setr_epi32(0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15)); }
  static I seti(int v) { return _mm512_set1_epi32(v); }
  static I band(I a, int m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
  static I bor(I a, I b) { return _mm512_or_si512(a, b); }
  static I shr(I a, int s) { return _mm512_srli_epi32(a, s); }
  static I shrv(I a, I s) { return _mm512_srlv_epi32(a, s); }
  static I shl(I a, int s) { return _mm512_slli_epi32(a, s); }
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
  static constexpr int W = 8, MB = 2;
  using F = __m256; using I = __m256i;
  static I u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
  static I iota(int b) { return _mm256_add_epi32(_mm256_set1_epi32(b), _mm256_setr_epi32(0,1,2,3,4,5,6,7)); }
  static I seti(int v) { return _mm256_set1_epi32(v); }
  static I band(I a, int m) { return _mm256_and_si256(a, _mm256_set1_epi32(m)); }
  static I bor(I a, I b) { return _mm256_or_si256(a, b); }
  static I shr(I a, int s) { return _mm256_srli_epi32(a, s); }
  static I shrv(I a, I s) { return _mm256_srlv_epi32(a, s); }
  static I shl(I a, int s) { return _mm256_slli_epi32(a, s); }
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
  static constexpr int W = 1, MB = 4;
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

#if defined(__AVX512BW__)
// ---- AVX-512 decoders: the same values, fewer instructions. A 4-bit block's 16 possible weights are
// computed once (as gguf-py computes each weight) and looked up with vpermps; Q6_K's 6-bit codes are
// assembled 64 at a time in bytes.
inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
// 16 bytes of nibbles p: lo_out[i] = tlo[p[i] & 15], hi_out[i] = thi[p[i] >> 4]
inline void nibbles(const uint8_t* p, __m512 tlo, __m512 thi, float* lo_out, float* hi_out) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  _mm512_storeu_ps(lo_out, _mm512_permutexvar_ps(v, tlo));  // vpermps reads the index's low 4 bits
  _mm512_storeu_ps(hi_out, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), thi));
}
template <int T>
inline void dec512(const uint8_t* b, float* out) {
  const __m512 i16 = iota16();
  if constexpr (T == Q4_0) {  // (q - 8) * d
    const __m512 t = _mm512_mul_ps(_mm512_sub_ps(i16, _mm512_set1_ps(8)), _mm512_set1_ps(half(b)));
    nibbles(b + 2, t, t, out, out + 16);
  } else if constexpr (T == Q4_1) {  // d * q + m
    const __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(half(b)), i16), _mm512_set1_ps(half(b + 2)));
    nibbles(b + 4, t, t, out, out + 16);
  } else if constexpr (T == Q5_0) {  // d * (q5 - 16): 32 values, the high bit picks the table
    const __m512 d = _mm512_set1_ps(half(b));
    const __m512 t0 = _mm512_mul_ps(d, _mm512_sub_ps(i16, _mm512_set1_ps(16))), t1 = _mm512_mul_ps(d, i16);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b + 6))), s = _mm512_set1_epi32(16);
    const __m512i lo = _mm512_mask_or_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), qh & 0xffff, v, s);
    const __m512i hi = _mm512_mask_or_epi32(_mm512_srli_epi32(v, 4), qh >> 16, _mm512_srli_epi32(v, 4), s);
    _mm512_storeu_ps(out, _mm512_permutex2var_ps(t0, lo, t1));
    _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(t0, hi, t1));
  } else if constexpr (T == Q4_K) {  // (d * sc) * q - (dmin * m)
    uint32_t u[3];
    std::memcpy(u, b + 4, 12);
    const uint32_t sm[4] = {u[0] & 0x3f3f3f3fu, (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u),
                            u[1] & 0x3f3f3f3fu, ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)};
    const __m512 dd = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(half(b)), _mm512_set1_ps(half(b + 2)));
    alignas(64) float sc[16];  // d * scale_j (j < 8), then dmin * min_j
    _mm512_store_ps(sc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)sm)))));
    for (int c = 0; c < 4; ++c, out += 64) {
      const __m512 t1 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(sc[2 * c]), i16), _mm512_set1_ps(sc[8 + 2 * c]));
      const __m512 t2 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(sc[2 * c + 1]), i16), _mm512_set1_ps(sc[9 + 2 * c]));
      nibbles(b + 16 + 32 * c, t1, t2, out, out + 32);
      nibbles(b + 32 + 32 * c, t1, t2, out + 16, out + 48);
    }
  } else if constexpr (T == Q6_K) {  // (d * sc) * (q - 32); weights 16g..16g+15 of a chunk: scale 8c + g
    alignas(64) float sc[16];
    _mm512_store_ps(sc, _mm512_mul_ps(_mm512_set1_ps(half(b + 208)),
                                      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192))))));
    const __m512i lo4 = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3), k32 = _mm512_set1_epi8(32);
    const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh23 = _mm512_add_epi16(sh01, _mm512_set1_epi16(4));
    for (int c = 0; c < 2; ++c, out += 128) {
      const __m512i A = _mm512_loadu_si512(b + 64 * c);  // low 4 bits: weights 0-63, then (>> 4) 64-127
      const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * c)));
      const __m512i h01 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, sh01), two), 4);
      const __m512i h23 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, sh23), two), 4);
      alignas(64) int8_t q[128];  // the 128 codes - 32, in weight order
      _mm512_store_si512(q, _mm512_sub_epi8(_mm512_ternarylogic_epi32(lo4, A, h01, 0xCA), k32));
      _mm512_store_si512(q + 64, _mm512_sub_epi8(_mm512_ternarylogic_epi32(lo4, _mm512_srli_epi16(A, 4), h23, 0xCA), k32));
      for (int g = 0; g < 8; ++g)
        _mm512_storeu_ps(out + 16 * g, _mm512_mul_ps(_mm512_set1_ps(sc[8 * c + g]), _mm512_cvtepi32_ps(
                                                         _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i*)(q + 16 * g))))));
    }
  }
}
#endif

// ---- fp32 path: one block at b -> out[QK] fp32, the arithmetic of gguf-py's dequantize_blocks.
template <int T>
inline void dec(const uint8_t* b, float* out) {
#if defined(__AVX512BW__)
  if constexpr (T != Q8_0) return dec512<T>(b, out);
#endif
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
    uint32_t u[3];  // ggml's get_scale_min_k4 for the 8 sub-blocks at once: 6-bit scales, then mins
    std::memcpy(u, b + 4, 12);
    const uint32_t sm[4] = {u[0] & 0x3f3f3f3fu, (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u),
                            u[1] & 0x3f3f3f3fu, ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u)};
    const float d = half(b), dmin = half(b + 2);
    alignas(64) float sc[16];  // d * scale_j (j < 8), then dmin * min_j
    for (int j = 0; j < 16; ++j) sc[j] = (j < 8 ? d : dmin) * float(reinterpret_cast<const uint8_t*>(sm)[j]);
    const uint8_t* q = b + 16;
    for (int c = 0; c < 4; ++c, q += 32, out += 64) {  // 64 weights: low nibbles, then high nibbles
      const V::F d1 = V::set(sc[2 * c]), n1 = V::set(sc[8 + 2 * c]), d2 = V::set(sc[2 * c + 1]), n2 = V::set(sc[9 + 2 * c]);
      for (int l = 0; l < 32; l += W) {
        const V::I v = V::u8(q + l);
        V::store(out + l, V::sub(V::mul(d1, V::cvt(V::band(v, 15))), n1));
        V::store(out + 32 + l, V::sub(V::mul(d2, V::cvt(V::shr(v, 4))), n2));
      }
    }
  } else {  // Q6_K: (d * sc) * (q - 32), sub-blocks of 16
    const float d = half(b + 208);
    alignas(64) float sc[16];
    for (int j = 0; j < 16; ++j) sc[j] = d * float(reinterpret_cast<const int8_t*>(b + 192)[j]);
    const uint8_t *ql = b, *qh = b + 128;
    for (int c = 0; c < 2; ++c, ql += 64, qh += 32, out += 128) {
      for (int l = 0; l < 32; l += W) {
        const V::I a = V::u8(ql + l), a2 = V::u8(ql + 32 + l), h = V::u8(qh + l);
        const V::I q[4] = {V::bor(V::band(a, 15), V::shl(V::band(h, 3), 4)),
                           V::bor(V::band(a2, 15), V::shl(V::band(V::shr(h, 2), 3), 4)),
                           V::bor(V::shr(a, 4), V::shl(V::band(V::shr(h, 4), 3), 4)),
                           V::bor(V::shr(a2, 4), V::shl(V::shr(h, 6), 4))};
        for (int k = 0; k < 4; ++k) V::store(out + 32 * k + l, V::mul(V::set(sc[8 * c + l / 16 + 2 * k]), V::cvt(V::subi(q[k], 32))));
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

// ---- The register tile, both paths: MB_ rows of x against NB_ weight rows, one vector running sum
// per (x row, weight row): lane l sums the products of weights k = l (mod lanes) in k order, so an
// output's sum does not depend on which rows share its tile. Weights and x are loaded once a tile.
constexpr int NB = 4;  // weight rows decoded together (4 independent sums even at M = 1)
using Acc = V::F;      // one running sum; acc arrays are [M][NB]

// fp32 path: w [NB_][UNIT] decoded weights, x [MB_] rows (stride Kp) at the unit's offset, n weights.
template <int MB_, int NB_>
void tile(const float* w, int n, const float* x, int64_t Kp, Acc* acc) {
  V::F a[MB_][NB_];
  for (int m = 0; m < MB_; ++m)
    for (int j = 0; j < NB_; ++j) a[m][j] = acc[m * NB + j];
  for (int v = 0; v < n; v += W) {
    V::F wv[NB_];
#pragma GCC unroll 4
    for (int j = 0; j < NB_; ++j) wv[j] = V::load(w + j * UNIT + v);
#pragma GCC unroll 4
    for (int m = 0; m < MB_; ++m) {
      const V::F xv = V::load(x + m * Kp + v);
#pragma GCC unroll 4
      for (int j = 0; j < NB_; ++j) a[m][j] = V::fma(xv, wv[j], a[m][j]);
    }
  }
  for (int m = 0; m < MB_; ++m)
    for (int j = 0; j < NB_; ++j) acc[m * NB + j] = a[m][j];
}

// f<MB_, NB_>(args...) for runtime mb in [1, MB], nb in [1, NB].
#define TILE_DISPATCH(f, mb, nb, ...)                                                               \
  [&] {                                                                                             \
    auto go = [&](auto M_) {                                                                        \
      switch (nb) {                                                                                 \
        case 1: return f<decltype(M_)::value, 1>(__VA_ARGS__);                                      \
        case 2: return f<decltype(M_)::value, 2>(__VA_ARGS__);                                      \
        case 3: return f<decltype(M_)::value, 3>(__VA_ARGS__);                                      \
        default: return f<decltype(M_)::value, 4>(__VA_ARGS__);                                     \
      }                                                                                             \
    };                                                                                              \
    if (V::MB >= 4 && mb >= 4) return go(std::integral_constant<int, (V::MB >= 4 ? 4 : 1)>{});     \
    if (V::MB >= 3 && mb == 3) return go(std::integral_constant<int, (V::MB >= 3 ? 3 : 1)>{});     \
    if (mb >= 2) return go(std::integral_constant<int, 2>{});                                       \
    return go(std::integral_constant<int, 1>{});                                                    \
  }()

struct Rows {  // up to NB consecutive output rows of the parts side by side: their types and blocks
  int nb = 0, type[NB];
  const uint8_t* row[NB];
  Rows(const std::vector<Part>& parts, int64_t g0, int64_t g1) {
    int64_t base = 0;
    size_t pi = 0;
    for (int64_t g = g0; g < g1; ++g, ++nb) {
      while (g >= base + parts[pi].n) base += parts[pi++].n;
      type[nb] = parts[pi].type;
      row[nb] = parts[pi].w + (g - base) * parts[pi].row_bytes;
    }
  }
};

struct Out {  // y [M, N] (bf16 or fp32) and an optional bias [N] (bf16 or fp32)
  void* y; bool y_bf16; const void* bias; bool b_bf16; int64_t N;
  void put(int64_t m, int64_t g, float v) const {
    if (bias) v += b_bf16 ? from_bf16(static_cast<const uint16_t*>(bias)[g]) : static_cast<const float*>(bias)[g];
    if (y_bf16) static_cast<uint16_t*>(y)[m * N + g] = to_bf16(v);
    else static_cast<float*>(y)[m * N + g] = v;
  }
};

// Output rows in groups of NB over ATen's threads: body(first row, Rows, acc [M][NB]).
template <class Body>
void for_groups(const std::vector<Part>& parts, int64_t M, const Out& out, Body body) {
  at::parallel_for(0, (out.N + NB - 1) / NB, 2, [&](int64_t q0, int64_t q1) {
    std::vector<Acc> acc(M * NB);
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t g0 = q * NB;
      const Rows rows(parts, g0, std::min(out.N, g0 + NB));
      std::fill(acc.begin(), acc.end(), V::zero());
      body(g0, rows, acc.data());
    }
  });
}

// fp32 path. x: [M, K] fp32.
void run_f32(const float* x, int64_t M, int64_t K, const std::vector<Part>& parts, const Out& out) {
  for_groups(parts, M, out, [&](int64_t g0, const Rows& r, Acc* acc) {
    alignas(64) float buf[NB * UNIT];
    for (int64_t e0 = 0; e0 < K; e0 += UNIT) {
      const int n = static_cast<int>(std::min<int64_t>(UNIT, K - e0));
      for (int j = 0; j < r.nb; ++j) with_type(r.type[j], [&](auto T) { dec_unit<T()>(r.row[j], e0, n, buf + j * UNIT); });
      for (int64_t m0 = 0; m0 < M; m0 += V::MB)
        TILE_DISPATCH(tile, M - m0, r.nb, buf, n, x + m0 * K + e0, K, acc + m0 * NB);
    }
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < r.nb; ++j) out.put(m, g0 + j, V::sum(acc[m * NB + j]));
  });
}

#if defined(__AVX512BF16__)
// ---- bf16 path. A unit of weights decodes to q: the blocks' integers as bf16 (exact); one scale
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

// bf16 tile: u [NB_] decoded units, x [MB_] bf16 rows (stride Kp) at the unit's offset, ngp groups.
template <int MB_, int NB_>
void tile(const Unit* u, int ngp, const uint16_t* x, int64_t Kp, Acc* acc) {
  __m512 a[MB_][NB_];
  for (int m = 0; m < MB_; ++m)
    for (int j = 0; j < NB_; ++j) a[m][j] = acc[m * NB + j];
  for (int g = 0; g < ngp; ++g) {
    __m512bh q[NB_];
#pragma GCC unroll 4
    for (int j = 0; j < NB_; ++j) q[j] = (__m512bh)_mm512_load_si512(u[j].q + 32 * g);
#pragma GCC unroll 4
    for (int m = 0; m < MB_; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * Kp + 32 * g);
#pragma GCC unroll 4
      for (int j = 0; j < NB_; ++j)
        a[m][j] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), xv, q[j]), _mm512_load_ps(u[j].sv[g]), a[m][j]);
    }
  }
  for (int m = 0; m < MB_; ++m)
    for (int j = 0; j < NB_; ++j) acc[m * NB + j] = a[m][j];
}

// x: [M, Kp] bf16 zero-padded (Kp a multiple of 256); xs: [M, Kp / 32] fp32, each group's x sum.
void run(const uint16_t* x, const float* xs, int64_t M, int64_t K, int64_t Kp, const std::vector<Part>& parts,
         const Out& out) {
  for_groups(parts, M, out, [&](int64_t g0, const Rows& r, Acc* acc) {
    Unit u[NB];
    std::vector<__m256> accm(M * NB, _mm256_setzero_ps());  // [M][NB] the min terms' running sums
    bool mins = false;
    for (int64_t e0 = 0; e0 < K; e0 += UNIT) {
      const int n = static_cast<int>(std::min<int64_t>(UNIT, K - e0)), ng = n / 32, ngp = (ng + 7) / 8 * 8;
      for (int j = 0; j < r.nb; ++j) {
        with_type(r.type[j], [&](auto T) {
          const uint8_t* b = r.row[j] + e0 / qk_of(T()) * bytes_of(T());
          for (int i = 0; i < n; i += qk_of(T()), b += bytes_of(T())) block<T()>(b, u[j], i / 32);
          mins |= T() == Q4_1 || T() == Q4_K;
        });
        for (int i = ng; i < ngp; ++i) {  // past the row's end: zeros
          _mm512_store_si512(u[j].q + 32 * i, _mm512_setzero_si512());
          scale(u[j].sv[i], 0.0f, 0.0f);
          u[j].mn[i] = 0.0f;
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += V::MB)
        TILE_DISPATCH(tile, M - m0, r.nb, u, ngp, x + m0 * Kp + e0, Kp, acc + m0 * NB);
      if (mins)
        for (int64_t m = 0; m < M; ++m)
          for (int j = 0; j < r.nb; ++j)
            for (int i = 0; i < ngp; i += 8)
              accm[m * NB + j] = _mm256_fmadd_ps(_mm256_load_ps(u[j].mn + i),
                                                 _mm256_loadu_ps(xs + m * (Kp / 32) + e0 / 32 + i), accm[m * NB + j]);
    }
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < r.nb; ++j)
        out.put(m, g0 + j, _mm512_reduce_add_ps(acc[m * NB + j]) +
                               _mm512_reduce_add_ps(_mm512_zextps256_ps512(accm[m * NB + j])));
  });
}
}  // namespace bf
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ---- int8 path (the "avx512_vnni" build): csrc/gguf_q8.h's q8 core over ATen's threads.
namespace int8 {  // the quantized linear over specctl::gguf::q8
using namespace specctl::gguf::q8;
void run(const void* xp, bool bf16, int64_t M, int64_t K, const std::vector<Part>& parts, const Out& out) {
  int need = 0;
  for (const auto& p : parts) {
#if defined(__AMX_INT8__)
    if (p.packed) { need |= specctl::gguf::amx8::need_of(p.type); continue; }
#endif
    need |= 1 << layout_of(p.type);
  }
  X x;
  quantize(xp, bf16, M, K, need, x, [](int64_t n, auto f) { at::parallel_for(0, n, 1, f); });
#if defined(__AMX_INT8__)
  if (parts[0].packed) {  // AMX-INT8 panels (parts_of: all packed or none)
    at::parallel_for(0, out.N / 16, 1, [&](int64_t p0, int64_t p1) {
      specctl::gguf::amx8::range(x, K, parts, 16 * p0, 16 * p1, [&](int64_t m, int64_t g, float v) { out.put(m, g, v); });
    });
    return;
  }
#endif
  at::parallel_for(0, out.N, 8, [&](int64_t g0, int64_t g1) {
    range(x, K, parts, g0, g1, [&](int64_t m, int64_t g, float v) { out.put(m, g, v); });
  });
}

// x [M, K] -> (codes [M, K] int8, scales [M, K / 32] fp32): what the int8 path multiplies (for tests).
std::vector<at::Tensor> quantize_x(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 32 == 0 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quantize_x: x is [M, K] fp32 or bf16, K a multiple of 32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  X X_;
  quantize(xc.data_ptr(), x.scalar_type() == at::kBFloat16, M, K, 0, X_, [](int64_t n, auto f) { f(0, n); });
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto d = at::empty({M, K / 32}, x.options().dtype(at::kFloat));
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(q.data_ptr<int8_t>() + m * K, X_.nat.data() + m * X_.Kp, K);
    std::memcpy(d.data_ptr<float>() + m * (K / 32), X_.d.data() + m * (X_.Kp / 32), K / 32 * 4);
  }
  return {q, d};
}
}  // namespace int8
#endif

constexpr int64_t PACKED = 256;  // = specctl::gguf::amx8::PACKED (a type id + PACKED: the part is in panels)

std::vector<Part> parts_of(const std::vector<at::Tensor>& ws, const std::vector<int64_t>& types, int64_t K) {
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "quant_linear: one type per weight part");
  std::vector<Part> parts;
  for (size_t i = 0; i < ws.size(); ++i) {
    const auto& w = ws[i];
    if (types[i] >= PACKED) {
#if defined(__AMX_INT8__)
      static_assert(PACKED == specctl::gguf::amx8::PACKED);
      TORCH_CHECK(i == 0 || parts[0].packed, "quant_linear: parts are all packed or none");
      parts.push_back(specctl::gguf::amx8::packed_part(w, types[i], K, "quant_linear"));
      continue;
#else
      TORCH_CHECK(false, "quant_linear: packed (AMX-INT8) weights need the amx_int8 build");
#endif
    }
    TORCH_CHECK(parts.empty() || !parts[0].packed, "quant_linear: parts are all packed or none");
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

at::Tensor quant_linear(at::Tensor x, std::vector<at::Tensor> ws, std::vector<int64_t> types, int64_t K,
                           c10::optional<at::Tensor> bias, bool out_fp32) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "quant_linear: x is [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "quant_linear: x is bf16 or fp32");
  const auto parts = parts_of(ws, types, K);
  int64_t N = 0;
  for (const auto& p : parts) N += p.n;
  const int64_t M = x.size(0);
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.numel() == N && (bc.scalar_type() == at::kFloat || bc.scalar_type() == at::kBFloat16),
                "quant_linear: bias is [N] fp32 or bf16");
  }
  const bool y_bf16 = !out_fp32 && x.scalar_type() == at::kBFloat16;
  auto y = at::empty({M, N}, x.options().dtype(y_bf16 ? at::kBFloat16 : at::kFloat));
  if (M == 0) return y;
  const Out out{y.data_ptr(), y_bf16, bc.defined() ? bc.data_ptr() : nullptr,
                bc.defined() && bc.scalar_type() == at::kBFloat16, N};
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  {
    const at::Tensor xc = x.contiguous();
    int8::run(xc.data_ptr(), x.scalar_type() == at::kBFloat16, M, K, parts, out);
    return y;
  }
#endif
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    const int64_t Kp = (K + 255) / 256 * 256;
    at::Tensor xb = at::zeros({M, Kp}, x.options());
    xb.narrow(1, 0, K).copy_(x);
    const auto* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr());
    at::Tensor xs = at::empty({M, Kp / 32}, x.options().dtype(at::kFloat));  // x . 1 over each group
    for (int64_t i = 0; i < M * Kp / 32; ++i)
      xs.data_ptr<float>()[i] = _mm512_reduce_add_ps(_mm512_dpbf16_ps(
          _mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(xp + 32 * i), (__m512bh)_mm512_set1_epi16(0x3f80)));
    bf::run(xp, xs.data_ptr<float>(), M, K, Kp, parts, out);
    return y;
  }
#endif
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // exact for bf16
  run_f32(xf.data_ptr<float>(), M, K, parts, out);
  return y;
}

// The weights [N, K] of one part, decoded as the fp32 path does (gguf-py's dequantize bit for bit),
// written as `dtype` (float32 or bfloat16).
at::Tensor dequantize(at::Tensor w, int64_t type, int64_t K, at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize: dtype is float32 or bfloat16");
  const Part P = parts_of({w}, {type}, K)[0];
  auto out = at::empty({P.n, K}, w.options().dtype(dtype));
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

#if defined(__AMX_INT8__)
// A part's GGUF rows [N, row_bytes] (N a multiple of 16) -> its AMX-INT8 panels, written into `out`
// [N / 16, chunks * rec_bytes] uint8 (the caller's: on huge pages, for weights streamed every step)
void pack(at::Tensor w, int64_t type, int64_t K, at::Tensor out) {
  namespace A = specctl::gguf::amx8;
  const Part P = parts_of({w}, {type}, K)[0];
  TORCH_CHECK(P.n % 16 == 0, "pack: the AMX-INT8 panels take 16 rows at a time; this part has ", P.n);
  const int t = P.type, S = A::rec_bytes(t);
  const int64_t C = A::chunks(K);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 2 && out.size(0) == P.n / 16 &&
              out.size(1) == C * S, "pack: out is contiguous uint8 [", P.n / 16, ", ", C * S, "]");
  at::parallel_for(0, P.n / 16, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) uint8_t U[4096];
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < C; ++c) {
        uint8_t* r = out.data_ptr<uint8_t>() + (p * C + c) * S;
        std::memset(U, 0, sizeof(U));
        std::memset(r, 0, S);
        for (int n = 0; n < 16; ++n) A::pack_row(P.w + (16 * p + n) * P.row_bytes, t, c, K, n, U, r + A::rec_codes(t));
        A::store_codes(U, t, r);
      }
  });
}

// The inverse: panels -> GGUF rows [N, row_bytes], bit for bit the rows pack was given.
at::Tensor unpack(at::Tensor wp, int64_t type, int64_t K) {
  namespace A = specctl::gguf::amx8;
  const Part P = parts_of({wp}, {type + PACKED}, K)[0];
  const int t = P.type, S = A::rec_bytes(t);
  const int64_t C = A::chunks(K), rb = K / qk_of(t) * bytes_of(t);
  auto out = at::zeros({P.n, rb}, wp.options());
  at::parallel_for(0, P.n / 16, 1, [&](int64_t p0, int64_t p1) {
    alignas(64) uint8_t U[4096];
    __m512 ws[16], co[16];
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < C; ++c) {
        const uint8_t* r = P.w + (p * C + c) * S;
        const uint8_t* u = nullptr;
        with_type(t, [&](auto T) { u = A::unpack<T()>(r, U, ws, co); });
        for (int n = 0; n < 16; ++n) A::unpack_row(u, r + A::rec_codes(t), t, c, K, n, out.data_ptr<uint8_t>() + (16 * p + n) * rb);
      }
  });
  return out;
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear", &quant_linear, "y = x @ W^T with W as GGUF blocks");
  m.def("dequantize", &dequantize, "GGUF blocks -> dense weights");
#if defined(__AMX_INT8__)
  m.def("quantize_x", &int8::quantize_x, "x -> its int8 codes and per-32 scales (the int8 path's x)");
  m.def("pack", &pack, "GGUF rows -> AMX-INT8 panels (into out)");
  m.def("unpack", &unpack, "AMX-INT8 panels -> GGUF rows");
  m.def("rec_bytes", [](int64_t type) { return specctl::gguf::amx8::rec_bytes(static_cast<int>(type)); },
        "bytes of a panel chunk (16 rows x 256 weights) of a ggml type");
  // the OS gives a process AMX tile state only when asked (Linux 5.16+): asked once, at import
  m.def("isa", []() { return std::string("amx_int8"); });
  m.attr("amx_ready") = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
  m.def("quantize_x", &int8::quantize_x, "x -> its int8 codes and per-32 scales (the int8 path's x)");
  m.def("isa", []() { return std::string("avx512_vnni"); });
#elif defined(__AVX512BF16__)
  m.def("isa", []() { return std::string("avx512_bf16"); });
#else
  m.def("isa", []() { return std::string(V::name()); });
#endif
}
