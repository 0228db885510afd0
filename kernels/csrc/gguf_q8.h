// GGUF blocks (ggml's byte layouts) and the int8 (AVX512-VNNI) dot products over them: the core shared by
// quant_linear.cpp (every quantized linear) and decode_layer.cpp's quantized build (the fused block over
// GGUF weights), so that both compute every output the same way, bit for bit.
//
// Types (ggml's layouts, QK weights a block): Q4_0 (fp16 d, 16 B nibbles), Q4_1 (fp16 d, fp16 m, 16 B
// nibbles), Q5_0 (fp16 d, 4 B high bits, 16 B nibbles), Q8_0 (fp16 d, 32 int8), Q4_K (QK 256: fp16 d,
// fp16 dmin, 12 B of 6-bit scales and mins, 128 B nibbles), Q6_K (QK 256: 128 B low 4 bits, 64 B high
// 2 bits, 16 int8 scales, fp16 d).
//
// The int8 path (namespace q8, AVX512-VNNI builds): x rounded to int8 per row and 32 values as llama.cpp's
// Q8_0 (d = max|x| / 127), weights as unsigned byte codes (Q8_0's signed codes + 128: x stays the signed
// operand of vpdpbusd, and -128 * d_w * sum(x) puts the offset back, as the other types' offsets), exact
// int32 dot products, fp32 scales once per 4 (or 8) products. Each output is one running vector sum over
// the row's chunks in order, reduced in a fixed order: the same whatever other rows share the call.
#pragma once
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace specctl::gguf {

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

struct Part { const uint8_t* w; int type; int64_t n, row_bytes; };  // one weight of the parts side by side

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ---- The int8 path (quant_linear's "avx512_vnni" build, decode_layer's SPECCTL_QUANT build). x is quantized
// per row, per 32 values (llama.cpp's Q8_0):
// d = max|x| / 127, q = round-half-even(x * (127 / max|x|)) in [-127, 127]. A weight row is decoded 256
// weights (a chunk) at a time into 4 zmm of unsigned byte codes (0..15, 0..31, 0..63; Q8_0's signed
// codes + 128, i.e. the x-as-signed / w-as-unsigned trick) plus the fp32 scale of each weight group (8
// of 32, or Q6_K's 16 of 16). vpdpbusd (u8 w x s8 x -> s32, exact) sums 4 products a lane; a lane's int32
// is converted (exact) and multiplied by (weight scale * x scale) of its group, one FMA per lane a zmm
// (the chunk's products in one multiply per x row, spread over the lanes by a permute). A type's offset
// (Q4_0's -8, Q5_0's -16, Q8_0's -128, Q6_K's -32, Q4_1's m, Q4_K's -dmin*m) is one coefficient per
// x group times that group's x sum (d * sum q over 32 values, over 16 for Q6_K), one FMA a chunk.
// The x codes are laid out in the order the weight codes come out of their blocks ("layouts"): L32 (Q4_0,
// Q4_1, Q5_0, Q8_0, and Q4_K with its sub-blocks of 32 as blocks): a zmm holds codes 0-15 (or 16-31) of
// 4 blocks, so both zmm of 4 blocks share their lanes' scales and their two vpdpbusd sum in int32 first
// (Q4_K's nibbles are moved into that order by 2 vpermt2q per 64 bytes: 6 fewer ops per x row a chunk);
// NAT (Q6_K, scales per 16): natural order. Per (x row, weight row) one zmm
// running sum over the chunks in order: row-independent like the other paths.
namespace q8 {
enum Layout { L32 = 0, NAT = 2 };
constexpr int layout_of(int t) { return t == Q6_K ? NAT : L32; }
constexpr int chunk_bytes(int t) { return qk_of(t) == 256 ? bytes_of(t) : 8 * bytes_of(t); }
inline int piece_src(int L, int i) {  // offset in its chunk of the x values of the layout's 16-byte piece i
  const int z = i / 4, p = i % 4;
  if (L == L32) return 32 * (4 * (z / 2) + p) + 16 * (z % 2);
  return 16 * i;
}

struct X {  // M rows of x quantized; Kp = K rounded up to a chunk (zeros past K)
  int64_t M = 0, Kp = 0;
  std::vector<int8_t> nat;           // [M][Kp] codes, natural order (what quantize_x returns)
  std::vector<float> d;              // [M][Kp / 32] scales
  // What the kernel reads, chunk-major (chunk c of every row, then chunk c + 1): a weight row's chunk
  // meets its MB x rows at constant offsets from one pointer, so 8 x rows do not take 24 registers
  // for their addresses (row-major, GCC spilled them at 8 rows)
  std::vector<int8_t> qb[3];         // [Kp / 256][M][256] codes in layout L
  std::vector<float> d8;             // [Kp / 256][M][8] the scales of the chunk's 8 groups of 32 (0 past K)
  std::vector<float> xs32, xs16;     // [Kp / 256][M][16]: lanes 8-15 sums of the 32-groups (0-7 zero); 16-groups
  const int8_t* q(int L) const { return qb[L].data(); }
};

inline __m512 load_x(const void* x, bool bf16, int64_t i) {  // 16 values of x from i, as fp32
  if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(x) + i))), 16));
  return _mm512_loadu_ps(static_cast<const float*>(x) + i);
}

// x [M, K] (bf16 or fp32) -> X with the layouts `need` (bit L); for_rows(M, f) calls f over ranges of rows
// (in parallel, or serially inside a caller's own parallel region).
template <class For>
inline void quantize(const void* x, bool bf16, int64_t M, int64_t K, int need, X& X_, For for_rows) {
  const int64_t Kp = (K + 255) / 256 * 256, G = Kp / 32, C = Kp / 256;
  X_.M = M, X_.Kp = Kp;
  X_.nat.assign(M * Kp, 0);
  X_.d.assign(M * G, 0.0f);
  X_.xs32.assign(M * C * 16, 0.0f);
  X_.xs16.assign(M * C * 16, 0.0f);
  X_.d8.assign(M * C * 8, 0.0f);
  for_rows(M, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < K / 32; ++g) {
        const int64_t i = m * K + 32 * g;
        const __m512 a = load_x(x, bf16, i), b = load_x(x, bf16, i + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));  // MXCSR: nearest even
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
        int8_t* q = X_.nat.data() + m * Kp + 32 * g;
        _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(qb));
        X_.d[m * G + g] = d;
        X_.d8[(g / 8 * M + m) * 8 + g % 8] = d;
        const int sa = _mm512_reduce_add_epi32(qa), sb = _mm512_reduce_add_epi32(qb);
        float* s = X_.xs32.data() + (g / 8 * M + m) * 16;
        s[8 + g % 8] = d * static_cast<float>(sa + sb);
        s = X_.xs16.data() + (g / 8 * M + m) * 16 + 2 * (g % 8);
        s[0] = d * static_cast<float>(sa);
        s[1] = d * static_cast<float>(sb);
      }
  });
  for (int L = 0; L < 3; ++L) {
    if (!(need >> L & 1)) continue;
    X_.qb[L].resize(M * Kp);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < Kp; c += 256)
        for (int i = 0; i < 16; ++i) {
          const int64_t src = m * Kp + c + piece_src(L, i), dst = (c / 256 * M + m) * 256 + 16 * i;
          std::memcpy(X_.qb[L].data() + dst, X_.nat.data() + src, 16);
        }
  }
}

inline __m512i splat_idx(int a, int b, int c, int d, int w) {  // lane index pattern: each of a..d w times (4 or 8)
  return w == 4 ? _mm512_setr_epi32(a, a, a, a, b, b, b, b, c, c, c, c, d, d, d, d)
                : _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
}
inline uint16_t u16at(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return h; }
inline uint32_t u32at(const uint8_t* p) { uint32_t h; std::memcpy(&h, p, 4); return h; }

// fp16 at offset `off` of 8 consecutive blocks of BY bytes -> 8 floats
template <int BY>
inline __m256 halves8(const uint8_t* b, int off) {
  return _mm256_cvtph_ps(_mm_setr_epi16(u16at(b + off), u16at(b + BY + off), u16at(b + 2 * BY + off), u16at(b + 3 * BY + off),
                                        u16at(b + 4 * BY + off), u16at(b + 5 * BY + off), u16at(b + 6 * BY + off),
                                        u16at(b + 7 * BY + off)));
}
// 16 bytes at offset QO of 4 consecutive blocks of BY bytes
template <int BY, int QO>
inline __m512i gather4(const uint8_t* b) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(b + QO)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(b + BY + QO)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(b + 2 * BY + QO)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(b + 3 * BY + QO)), 3);
}

// codes; weight scales (L32: lanes 0-7, one per group of 32; NAT: 16, one per 16); offset coefficients
struct Dec { __m512i c[4]; __m512 w; __m512 coef; };

// One chunk (8 blocks of 32, or 1 super-block) at b -> Dec.
template <int T>
__attribute__((always_inline)) inline void dec(const uint8_t* b, Dec& D) {
  const __m512i n4 = _mm512_set1_epi8(15);
  if constexpr (T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q8_0) {
    constexpr int BY = bytes_of(T);
    const __m256 d = halves8<BY>(b, 0);
    D.w = _mm512_zextps256_ps512(d);
    const __m256 co = T == Q4_1 ? halves8<BY>(b, 2) : _mm256_mul_ps(d, _mm256_set1_ps(T == Q4_0 ? -8.0f : T == Q5_0 ? -16.0f : -128.0f));
    D.coef = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_setzero_pd(), _mm256_castps_pd(co), 1));
    for (int h = 0; h < 2; ++h) {
      const uint8_t* bh = b + 4 * BY * h;
      if constexpr (T == Q8_0) {
        const __m512i k80 = _mm512_set1_epi8(static_cast<char>(0x80));
        D.c[2 * h] = _mm512_xor_si512(gather4<BY, 2>(bh), k80);
        D.c[2 * h + 1] = _mm512_xor_si512(gather4<BY, 18>(bh), k80);
      } else {
        const __m512i v = gather4<BY, T == Q4_0 ? 2 : T == Q4_1 ? 4 : 6>(bh);
        __m512i lo = _mm512_and_si512(v, n4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), n4);
        if constexpr (T == Q5_0) {
          uint64_t klo = 0, khi = 0;
          for (int i = 0; i < 4; ++i) {
            const uint64_t qh = u32at(bh + BY * i + 2);
            klo |= (qh & 0xffffu) << (16 * i);
            khi |= (qh >> 16) << (16 * i);
          }
          const __m512i k16 = _mm512_set1_epi8(16);
          lo = _mm512_mask_add_epi8(lo, klo, lo, k16);
          hi = _mm512_mask_add_epi8(hi, khi, hi, k16);
        }
        D.c[2 * h] = lo, D.c[2 * h + 1] = hi;
      }
    }
  } else if constexpr (T == Q4_K) {
    // ggml's get_scale_min_k4 for the 8 sub-blocks at once, in one xmm (u0..u2: the 12 scale bytes as
    // 32-bit words): [u0 & 3f.., (u2 & 0f..) | ((u0 >> 2) & 30..), u1 & 3f.., ((u2 >> 4) & 0f..) | ((u1 >> 2) & 30..)]
    // = 6-bit scales, then mins (scalar code went through the stack: a store-forwarding stall a chunk)
    const __m128i u = _mm_loadu_si128((const __m128i*)(b + 4));  // 12 scale bytes and 4 of the codes
    const __m128i A = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0)), B = _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0));
    const __m128i sm = _mm_or_si128(
        _mm_and_si128(_mm_srlv_epi32(A, _mm_setr_epi32(0, 0, 0, 4)), _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f)),
        _mm_and_si128(_mm_srli_epi32(B, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
    // d (lanes 0-7) and dmin (8-15): both fp16s converted at once
    const __m512 dd = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                            _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32at(b))))));
    const __m512 sc = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm)));
    D.w = sc;  // as L32: sub-blocks in place of blocks (lanes 8-15, dmin * m_j, unused there)
    D.coef = _mm512_maskz_sub_ps(0xff00, _mm512_setzero_ps(), sc);  // -(dmin * m_j) in lanes 8-15
    // 64 bytes: 16-byte lanes (sub-block 4h | 4h+1 codes 0-15 | 16-31, then 4h+2 | 4h+3) -> zmm 2h: codes
    // 0-15 of sub-blocks 4h..4h+3 (low nibbles of lane 0, high of lane 0, low of lane 2, high of lane 2),
    // zmm 2h+1: their codes 16-31 (lanes 1 and 3)
    const __m512i pa = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), pb = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(b + 16 + 64 * h);
      const __m512i lo = _mm512_and_si512(v, n4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), n4);
      D.c[2 * h] = _mm512_permutex2var_epi64(lo, pa, hi);
      D.c[2 * h + 1] = _mm512_permutex2var_epi64(lo, pb, hi);
    }
  } else if constexpr (T == Q6_K) {
    const __m512 sc = _mm512_mul_ps(_mm512_set1_ps(half(b + 208)),
                                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b + 192)))));
    D.w = sc;
    D.coef = _mm512_mul_ps(sc, _mm512_set1_ps(-32.0f));
    const __m512i three = _mm512_set1_epi8(3);
    const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh23 = _mm512_add_epi16(sh01, _mm512_set1_epi16(4));
    for (int h = 0; h < 2; ++h) {
      const __m512i A = _mm512_loadu_si512(b + 64 * h);
      const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h)));
      const __m512i h01 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, sh01), three), 4);
      const __m512i h23 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(H, sh23), three), 4);
      D.c[2 * h] = _mm512_ternarylogic_epi32(n4, A, h01, 0xCA);
      D.c[2 * h + 1] = _mm512_ternarylogic_epi32(n4, _mm512_srli_epi16(A, 4), h23, 0xCA);
    }
  }
}

inline __m512 dot(__m512i w, const int8_t* x) {  // 16 lanes: the sum of 4 products u8 w * s8 x, as fp32
  return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(x)));
}

constexpr int PF = 2048;  // software prefetch distance in bytes: rows stream from DRAM (measured: 153 -> 95 ms a 1.5B step)
// One weight row of type T (K weights) against MB_ rows of x from m0: out[m] = the dot products.
template <int T, int MB_>
void row(const uint8_t* w, int64_t K, const X& x, int64_t m0, float* out) {
  constexpr int L = layout_of(T);
  const int64_t C = x.Kp / 256, full = K / 256;
  const int64_t M = x.M;  // chunk c of x row m: codes at (c M + m) 256, group scales (c M + m) 8, sums (c M + m) 16
  const int8_t* xq = x.q(L) + m0 * 256;
  const float* xd = x.d8.data() + m0 * 8;
  const float* xs = (T == Q6_K ? x.xs16 : x.xs32).data() + m0 * 16;
  alignas(64) uint8_t tail[8 * 34];  // the last chunk of a row that ends inside one: its blocks, then zero blocks
  __m512 acc[MB_];
#pragma GCC unroll 8
  for (int m = 0; m < MB_; ++m) acc[m] = _mm512_setzero_ps();
  // a lane's scale is (weight scale) x (x scale) of the group its 4 codes belong to: the products of a
  // chunk's groups (8 or 16) in one multiply, spread over the lanes by permutes (the x scales stay 32
  // bytes a row and chunk: per lane they were 256, and at 8 rows of K = 8960 no longer fit in L1/L2)
  const __m512i g0 = splat_idx(0, 1, 2, 3, 4), g1 = splat_idx(4, 5, 6, 7, 4);
  const __m512i pair = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);  // NAT: 16-group -> 32-group
  for (int64_t c = 0; c < C; ++c, xq += 256 * M, xd += 8 * M, xs += 16 * M) {
    const uint8_t* b = w + c * chunk_bytes(T);
    if (c == full) {
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, b, (K % 256) / 32 * bytes_of(T));
      b = tail;
    }
    for (int o = 0; o < chunk_bytes(T); o += 64) _mm_prefetch((const char*)b + PF + o, _MM_HINT_T0);  // past the end: harmless
    Dec D;
    dec<T>(b, D);
#pragma GCC unroll 8
    for (int m = 0; m < MB_; ++m) {
      const int8_t* q = xq + 256 * m;
      const __m512 xs8 = _mm512_zextps256_ps512(_mm256_loadu_ps(xd + 8 * m));
      __m512 t;
      if constexpr (L == L32) {  // both zmm of 4 blocks share their lanes' scales: sum in int32 first
        const __m512i i0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), D.c[0], _mm512_loadu_si512(q)),
                                               D.c[1], _mm512_loadu_si512(q + 64));
        const __m512i i1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), D.c[2], _mm512_loadu_si512(q + 128)),
                                               D.c[3], _mm512_loadu_si512(q + 192));
        const __m512 p = _mm512_mul_ps(D.w, xs8);
        t = _mm512_mul_ps(_mm512_cvtepi32_ps(i0), _mm512_permutexvar_ps(g0, p));
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_permutexvar_ps(g1, p), t);
      } else {
        const __m512 p = _mm512_mul_ps(D.w, _mm512_permutexvar_ps(pair, xs8));
        t = _mm512_mul_ps(dot(D.c[0], q), _mm512_permutexvar_ps(g0, p));
#pragma GCC unroll 3
        for (int z = 1; z < 4; ++z)
          t = _mm512_fmadd_ps(dot(D.c[z], q + 64 * z), _mm512_permutexvar_ps(splat_idx(4 * z, 4 * z + 1, 4 * z + 2, 4 * z + 3, 4), p), t);
      }
      t = _mm512_fmadd_ps(D.coef, _mm512_loadu_ps(xs + 16 * m), t);
      acc[m] = _mm512_add_ps(acc[m], t);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB_; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

constexpr int MB = 8;  // x rows a weight row is decoded for

template <int T>
void row_any(const uint8_t* w, int64_t K, const X& x, int64_t m0, int mb, float* out) {
  switch (mb) {
    case 1: return row<T, 1>(w, K, x, m0, out);
    case 2: return row<T, 2>(w, K, x, m0, out);
    case 3: return row<T, 3>(w, K, x, m0, out);
    case 4: return row<T, 4>(w, K, x, m0, out);
    case 5: return row<T, 5>(w, K, x, m0, out);
    case 6: return row<T, 6>(w, K, x, m0, out);
    case 7: return row<T, 7>(w, K, x, m0, out);
    default: return row<T, 8>(w, K, x, m0, out);
  }
}

// Outputs [g0, g1) of the parts side by side against every row of x: put(m, g, v) for each. Up to XB rows
// of x (decode, verify), each weight row meets them all in turn. Past that (a prefill's hundreds of rows),
// x is taken XB rows at a time under a group of GB weight rows, so that the x rows in use stay in cache while
// the group passes over them: one weight row over all of a 512-row prefill's x read 4.6 MB at K = 8960, from
// L3 or memory, for every weight row (a Q6_K [1536, 8960] linear over 512 rows 2.35x faster blocked, on an
// AMX Xeon; 16 rows measured no worse than 8, 32 or 64). Which rows share a call changes nothing in an
// output (see row).
constexpr int64_t XB = 16, GB = 16;
template <class Put>
void range(const X& x, int64_t K, const std::vector<Part>& parts, int64_t g0, int64_t g1, Put put) {
  float v[MB];
  const int64_t xb = x.M <= XB ? x.M : XB, gb = x.M <= XB ? g1 - g0 : GB;
  int64_t base = 0;
  size_t pi = 0;
  for (int64_t h0 = g0; h0 < g1; h0 += gb) {
    const int64_t h1 = std::min(g1, h0 + gb);
    while (h0 >= base + parts[pi].n) base += parts[pi++].n;
    for (int64_t x0 = 0; x0 < x.M; x0 += xb) {
      const int64_t x1 = std::min(x.M, x0 + xb);
      int64_t b = base;
      size_t i = pi;
      for (int64_t g = h0; g < h1; ++g) {
        while (g >= b + parts[i].n) b += parts[i++].n;
        const Part& P = parts[i];
        const uint8_t* w = P.w + (g - b) * P.row_bytes;
        for (int64_t m0 = x0; m0 < x1; m0 += MB) {
          const int mb = static_cast<int>(std::min<int64_t>(MB, x1 - m0));
          with_type(P.type, [&](auto T) { row_any<T()>(w, K, x, m0, mb, v); });
          for (int m = 0; m < mb; ++m) put(m0 + m, g, v[m]);
        }
      }
    }
  }
}
}  // namespace q8
#endif

}  // namespace specctl::gguf
