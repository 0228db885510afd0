// bf16 <-> fp32 conversions shared by the CPU kernels (round to nearest even, as torch).
#pragma once
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include "vec16.h"

namespace specctl {

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 16 bf16 values -> 16 floats (exact: a bf16 is the top half of an fp32).
inline f32x16 load_bf16x16(const uint16_t* p) {
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  auto half = [](const uint16_t* q) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), 16));
  };
  return {half(p), half(p + 8)};
#endif
}

// vdpbf16ps and the bf16 conversions as the kernels use them, on a CPU with AVX512-BF16 (one instruction
// each) or with AVX-512F or AVX2 alone (the same arithmetic in fp32 FMAs and integer ops, bit for bit under
// the flush-to-zero / denormals-are-zero mode specctl's runtime sets; without it they part only where a
// product or a sum is subnormal). A build without -mavx512bf16 takes the second: the "avx512" and "avx2"
// paths of specctl.kernels.cpu.
#if defined(__AVX512BF16__)
using bf16x32 = __m512bh;  // 32 bf16 values, as vdpbf16ps reads them
inline bf16x32 load_bf16x32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
// the first n (< 32) of p, zeros after
inline bf16x32 load_bf16x32_n(const uint16_t* p, int n) {
  return (__m512bh)_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << n) - 1), p);
}
// acc[i] + a[2i+1] b[2i+1] + a[2i] b[2i] (the products exact in fp32, each sum rounded to nearest even)
inline __m512 dot_bf16(__m512 acc, bf16x32 a, bf16x32 b) { return _mm512_dpbf16_ps(acc, a, b); }
// 16 floats -> 16 bf16, rounded to nearest even (subnormals to signed zero, NaNs quieted)
inline __m256i cvt_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
// 32 floats -> 32 bf16 at p: lo first
inline void store_bf16x32(uint16_t* p, __m512 hi, __m512 lo) { _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)); }
#else
// The odd and the even bf16 of each pair as fp32 (a bf16 is the top half of an fp32): vdpbf16ps's two
// products become two FMAs, odd first as it sums them (each product is exact, so an FMA rounds the sum once).
struct bf16x32 {
  f32x16 odd, even;
};
#if defined(__AVX512F__)
inline bf16x32 as_bf16x32(__m512i v) {
  return {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))),
          _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
}
inline bf16x32 load_bf16x32(const uint16_t* p) { return as_bf16x32(_mm512_loadu_si512(p)); }
inline bf16x32 load_bf16x32_n(const uint16_t* p, int n) {
  return as_bf16x32(_mm512_maskz_loadu_epi16(static_cast<__mmask32>((1u << n) - 1), p));
}
// one integer lane of 16 as fp32 -> its bf16 (in the low half), with vcvtneps2bf16's rules
inline __m512i round_bf16(__m512i u) {
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 tiny = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(0x00800000));  // zero or subnormal
  return _mm512_mask_mov_epi32(r, tiny, _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u))), 16));
}
inline __m256i cvt_bf16x16(__m512 v) { return _mm512_cvtepi32_epi16(round_bf16(_mm512_castps_si512(v))); }
#else
// 16 bf16 (8 pairs) -> the odd ones, and the even ones, as 8 fp32
inline __m256 odd_bf16x8(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u)))); }
inline __m256 even_bf16x8(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline bf16x32 as_bf16x32(__m256i a, __m256i b) {  // bf16 0-15, 16-31
  return {{odd_bf16x8(a), odd_bf16x8(b)}, {even_bf16x8(a), even_bf16x8(b)}};
}
inline bf16x32 load_bf16x32(const uint16_t* p) {
  return as_bf16x32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
}
inline bf16x32 load_bf16x32_n(const uint16_t* p, int n) {
  alignas(32) uint16_t buf[32] = {};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return load_bf16x32(buf);
}
inline __m256i round_bf16(__m256i u) {  // as the AVX-512 form above, 8 lanes
  const __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7f800000));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
  const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), mag);  // zero or subnormal
  return _mm256_blendv_epi8(r, _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0x80000000u))), 16), tiny);
}
inline __m256i cvt_bf16x16(f32x16 v) {
  auto half = [](__m256 h) {
    const __m256i r = round_bf16(_mm256_castps_si256(h));  // 8 values < 2^16: packus keeps them
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  };
  return _mm256_set_m128i(half(v.hi), half(v.lo));
}
#endif
inline f32x16 dot_bf16(f32x16 acc, const bf16x32& a, const bf16x32& b) {
  return fmadd(a.even, b.even, fmadd(a.odd, b.odd, acc));
}
inline void store_bf16x32(uint16_t* p, f32x16 hi, f32x16 lo) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), cvt_bf16x16(lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16), cvt_bf16x16(hi));
}
#endif

}  // namespace specctl
