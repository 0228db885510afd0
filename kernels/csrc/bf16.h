// bf16 <-> fp32 conversions shared by the CPU kernels (round to nearest even, as torch).
#pragma once
#include <cstdint>
#include <cstring>
#include <immintrin.h>

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
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// vdpbf16ps and the bf16 conversions as the kernels use them, on a CPU with AVX512-BF16 (one instruction
// each) or with AVX-512F alone (the same arithmetic in fp32 FMAs and integer ops, bit for bit under the
// flush-to-zero / denormals-are-zero mode specctl's runtime sets; without it they part only where a product
// or a sum is subnormal). A build without -mavx512bf16 takes the second: the "avx512" path of kernels.cpu.
#if defined(__AVX512BF16__)
using bf16x32 = __m512bh;  // 32 bf16 values, as vdpbf16ps reads them
inline bf16x32 as_bf16x32(__m512i v) { return (__m512bh)v; }
inline bf16x32 load_bf16x32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
// acc[i] + a[2i+1] b[2i+1] + a[2i] b[2i] (the products exact in fp32, each sum rounded to nearest even)
inline __m512 dot_bf16(__m512 acc, bf16x32 a, bf16x32 b) { return _mm512_dpbf16_ps(acc, a, b); }
// 16 floats -> 16 bf16, rounded to nearest even (subnormals to signed zero, NaNs quieted)
inline __m256i cvt_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
// 32 floats -> 32 bf16: lo in the low half
inline __m512i cvt_bf16x32(__m512 hi, __m512 lo) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }
#elif defined(__AVX512F__)
// The odd and the even bf16 of each pair as fp32 (a bf16 is the top half of an fp32): vdpbf16ps's two
// products become two FMAs, odd first as it sums them (each product is exact, so an FMA rounds the sum once).
struct bf16x32 {
  __m512 odd, even;
};
inline bf16x32 as_bf16x32(__m512i v) {
  return {_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))),
          _mm512_castsi512_ps(_mm512_slli_epi32(v, 16))};
}
inline bf16x32 load_bf16x32(const uint16_t* p) { return as_bf16x32(_mm512_loadu_si512(p)); }
inline __m512 dot_bf16(__m512 acc, const bf16x32& a, const bf16x32& b) {
  return _mm512_fmadd_ps(a.even, b.even, _mm512_fmadd_ps(a.odd, b.odd, acc));
}
inline __m256i cvt_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 tiny = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(0x00800000));  // zero or subnormal
  r = _mm512_mask_mov_epi32(r, tiny, _mm512_srli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0x80000000u))), 16));
  return _mm512_cvtepi32_epi16(r);
}
inline __m512i cvt_bf16x32(__m512 hi, __m512 lo) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(cvt_bf16x16(lo)), cvt_bf16x16(hi), 1);
}
#endif

}  // namespace specctl
