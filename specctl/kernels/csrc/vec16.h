// 16 fp32 lanes as the kernels compute with them: one zmm register on AVX-512, two ymm registers on AVX2
// (+ FMA). The kernels (skinny_gemm.h, decode_attention.h, decode_layer.cpp) are written once on f32x16,
// and every operation here gives, lane for lane and bit for bit, what its AVX-512 instruction gives: the
// reductions follow one fixed tree (reduce_add, reduce_max, hsum16's shuffles), scalef is two exact
// power-of-two products, the partial loads zero the lanes they skip. So an AVX2 build computes every output
// exactly as the AVX-512 builds do (tested), and is row-independent in the same way.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace specctl {

#if defined(__AVX512F__)
using f32x16 = __m512;
inline f32x16 zero16() { return _mm512_setzero_ps(); }
inline f32x16 set16(float v) { return _mm512_set1_ps(v); }
inline f32x16 add(f32x16 a, f32x16 b) { return _mm512_add_ps(a, b); }
inline f32x16 sub(f32x16 a, f32x16 b) { return _mm512_sub_ps(a, b); }
inline f32x16 mul(f32x16 a, f32x16 b) { return _mm512_mul_ps(a, b); }
inline f32x16 div(f32x16 a, f32x16 b) { return _mm512_div_ps(a, b); }
inline f32x16 max(f32x16 a, f32x16 b) { return _mm512_max_ps(a, b); }  // b where either is NaN, as maxps
inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(a, b, c); }
inline f32x16 fnmadd(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fnmadd_ps(a, b, c); }
inline f32x16 loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, f32x16 v) { _mm512_storeu_ps(p, v); }
inline __mmask16 mask_n(int n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }
// lanes [0, n) of p, zeros after (n <= 16); and the store of lanes [0, n)
inline f32x16 load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(mask_n(n), p); }
inline void store_n(float* p, f32x16 v, int n) { _mm512_mask_storeu_ps(p, mask_n(n), v); }
inline f32x16 first_n(f32x16 v, int n) { return _mm512_maskz_mov_ps(mask_n(n), v); }
inline float lane0(f32x16 v) { return _mm512_cvtss_f32(v); }
inline f32x16 round_nearest(f32x16 v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n
inline f32x16 scalef(f32x16 p, f32x16 n) { return _mm512_scalef_ps(p, n); }
inline __m256 lo8(f32x16 v) { return _mm512_castps512_ps256(v); }
inline __m256 hi8(f32x16 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
#else
struct f32x16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline f32x16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline f32x16 set16(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline f32x16 add(f32x16 a, f32x16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline f32x16 sub(f32x16 a, f32x16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline f32x16 mul(f32x16 a, f32x16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline f32x16 div(f32x16 a, f32x16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline f32x16 max(f32x16 a, f32x16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline f32x16 fmadd(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline f32x16 fnmadd(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline f32x16 loadu(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void storeu(float* p, f32x16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
// all ones in lanes [first, first + n) of 8
inline __m256i mask8(int first, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n - first), idx);
}
inline f32x16 load_n(const float* p, int n) {
  return {_mm256_maskload_ps(p, mask8(0, n)), _mm256_maskload_ps(p + 8, mask8(8, n))};
}
inline void store_n(float* p, f32x16 v, int n) {
  _mm256_maskstore_ps(p, mask8(0, n), v.lo);
  _mm256_maskstore_ps(p + 8, mask8(8, n), v.hi);
}
inline f32x16 first_n(f32x16 v, int n) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(mask8(0, n))), _mm256_and_ps(v.hi, _mm256_castsi256_ps(mask8(8, n)))};
}
inline float lane0(f32x16 v) { return _mm256_cvtss_f32(v.lo); }
inline f32x16 round_nearest(f32x16 v) {
  return {_mm256_round_ps(v.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(v.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// vscalefps for integral n >= -126 and p in [1/2, 2) (what exp16 gives it): p * 2^min(n, 127) is exact
// unless n < -125 makes it subnormal, where it rounds once, as vscalefps; the second factor 2^(n - 127)
// for n > 127 then rounds or overflows once, as vscalefps does (n past 254 overflows either way).
inline __m256 scalef8(__m256 p, __m256 n) {
  n = _mm256_min_ps(n, _mm256_set1_ps(254.0f));
  const __m256 e1 = _mm256_min_ps(n, _mm256_set1_ps(127.0f)), e2 = _mm256_sub_ps(n, e1);
  auto pow2 = [](__m256 e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
  };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(e1)), pow2(e2));
}
inline f32x16 scalef(f32x16 p, f32x16 n) { return {scalef8(p.lo, n.lo), scalef8(p.hi, n.hi)}; }
inline __m256 lo8(f32x16 v) { return v.lo; }
inline __m256 hi8(f32x16 v) { return v.hi; }
#endif

// The sum of the 16 lanes in one fixed tree (GCC's _mm512_reduce_add_ps): halves, then quarters, then pairs.
inline float reduce_add(f32x16 v) {
  const __m256 t3 = _mm256_add_ps(hi8(v), lo8(v));
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1))));
}
inline float reduce_max(f32x16 v) {
  const __m256 t3 = _mm256_max_ps(hi8(v), lo8(v));
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ss(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(1, 1, 1, 1))));
}

}  // namespace specctl
