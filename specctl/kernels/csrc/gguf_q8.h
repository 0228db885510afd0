// GGUF blocks (ggml's byte layouts) and the int8 dot products over them: the core shared by quant_linear.cpp
// (every quantized linear) and decode_layer.cpp's quantized builds (the fused block over GGUF weights), so
// that both compute every output the same way, bit for bit. Two ways: namespace q8 (AVX512-VNNI on the GGUF
// rows as stored) and namespace amx8 (AMX-INT8 tiles on the rows repacked once into 16-row panels).
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
#include <ATen/core/Tensor.h>
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

// one weight of the parts side by side; `packed`: in the AMX-INT8 path's panels (namespace amx8), not GGUF rows
struct Part { const uint8_t* w; int type; int64_t n, row_bytes; bool packed = false; };

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
  // The AMX path's x for few rows (M * gpk <= 16, need bit 4 + e): [Kp / 64][M * gpk][64], gpk = 2 << e groups
  // a 64-code span: row m * gpk + j holds x row m's codes of group j of the span, zeros elsewhere
  std::vector<int8_t> xe[2];
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
  X_.nat.assign((M + 15) / 16 * 16 * Kp, 0);  // rows past M zero: the AMX path loads x 16 rows a tile
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
  for (int e = 0; e < 2; ++e) {
    const int gpk = 2 << e, R = static_cast<int>(M) * gpk, w = 64 / gpk;
    if (!(need >> (4 + e) & 1) || R > 16 || M == 1) continue;  // one row takes vpdpbusd on nat
    X_.xe[e].assign(Kp * R, 0);
    for (int64_t sp = 0; sp < Kp / 64; ++sp)
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < gpk; ++j)
          std::memcpy(X_.xe[e].data() + (sp * R + m * gpk + j) * 64 + j * w, X_.nat.data() + m * Kp + 64 * sp + j * w, w);
  }
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

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// ---- The AMX-INT8 path (quant_linear's "amx_int8" build, decode_layer's SPECCTL_QUANT_AMX build): the same
// int8 x as the int8 path (q8::quantize), weights repacked once at load into panels of 16 weight rows, so
// that one tdpbsud (x signed as the A tile, weight codes unsigned as the B tile) gives the exact int32 dot
// products of a group (32 weights; Q6_K: 16) for 16 weight rows and up to 16 x rows at once. Then per x row
// and group one convert and two FMAs over the 16 weight rows: acc += float(dot) * (w scale * x scale) +
// w offset coefficient * x group sum, in group order. The int8 path spends ~13 vector ops per x row and 256
// weights of a row; here a 16-row panel's 256 weights cost ~11 ops a row to unpack, whatever the x rows, and
// ~2 a row per x row: verify rows and prefill cost little more than the weights' read.
//
// Each output (x row m, weight row n) is one fp32 sum in a fixed order (chunks, then groups) of terms that
// depend on row m of x only: a row alone equals the row among any others, bit for bit, at any row count (1
// row included: AMX CPUs take this path for decode too, so verification equals decoding). The sums differ
// from the int8 path's in fp32 order only (the int8 path sums 4 lanes of partial dots per group).
//
// Panel layout: a part [N, K] (N a multiple of 16) -> [N / 16][Kp / 256][rec_bytes(T)]: per panel and chunk
// of 256 weights, the codes, then the scale fields. The 4096 codes of a panel chunk, unpacked (U), are the
// B tiles of its groups in order: U[512 g + 64 r + 4 n + i] = code of weight row n, input 32 g + 4 r + i
// (Q6_K's group of 16 h: the 256 bytes from 256 h). Stored: Q8_0 U itself (codes + 128); 4-bit types
// byte j = U[j] | U[j + 2048] << 4 (2048 B); Q5_0 those and 512 B of fifth bits (bit b of byte j: U[j + 512 b]);
// Q6_K those and 1024 B of top 2 bits (byte j: U[j] at bits 4-5, U[j + 1024] 6-7, U[j + 2048] 0-1, U[j + 3072]
// 2-3, so each comes out with one shift and one mask). Scales as GGUF stores them, transposed to [group][16
// rows]: fp16 d (Q4_0, Q5_0, Q8_0), d and m (Q4_1); Q4_K: fp16 d[16], dmin[16], 6-bit scales and mins as
// bytes [8][16] each; Q6_K: fp16 d[16], int8 scales [16][16]. The packing is lossless (unpack gives the GGUF
// rows back).
namespace amx8 {
using q8::X;
using q8::u32at;
constexpr int rec_codes(int t) { return t == Q8_0 ? 4096 : t == Q5_0 ? 2048 + 512 : t == Q6_K ? 2048 + 1024 : 2048; }
constexpr int rec_scales(int t) { return t == Q4_1 ? 512 : t == Q4_K ? 320 : t == Q6_K ? 288 : 256; }
constexpr int rec_bytes(int t) { return (rec_codes(t) + rec_scales(t) + 63) / 64 * 64; }
constexpr int64_t chunks(int64_t K) { return (K + 255) / 256; }
constexpr int64_t PACKED = 256;  // a ggml type id + PACKED: the part is in panels (specctl/kernels/quant_linear.py pack)

// A packed part as the kernels take it (type id + PACKED), checked: [N / 16, chunks * rec_bytes] uint8
inline Part packed_part(const at::Tensor& w, int64_t id, int64_t K, const char* what) {
  const int t = static_cast<int>(id - PACKED);
  TORCH_CHECK(bytes_of(t) > 0 && K % qk_of(t) == 0, what, ": unsupported ggml type ", t, " for ", K, " inputs");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && !w.is_cuda() &&
              w.size(1) == chunks(K) * rec_bytes(t),
              what, ": packed weights are contiguous uint8 [N / 16, chunks * record bytes] (from pack)");
  return {w.data_ptr<uint8_t>(), t, w.size(0) * 16, w.size(1), true};
}

inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {  // ggml's get_scale_min_k4
  if (j < 4) { sc = s[j] & 63; m = s[j + 4] & 63; }
  else { sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
}
inline int uidx(int n, int k) { return 512 * (k / 32) + 64 * (k % 32 / 4) + 4 * n + k % 4; }

// Weight row `row` (GGUF, K inputs), chunk c -> its codes into U (column n) and its scale fields into sc.
inline void pack_row(const uint8_t* row, int t, int64_t c, int64_t K, int n, uint8_t* U, uint8_t* sc) {
  uint8_t q[256] = {};
  if (qk_of(t) == 32) {
    const int by = bytes_of(t);
    for (int g = 0; g < 8 && (c * 8 + g) * 32 < K; ++g) {
      const uint8_t* b = row + (c * 8 + g) * by;
      std::memcpy(sc + 2 * (16 * g + n), b, 2);
      if (t == Q4_1) std::memcpy(sc + 256 + 2 * (16 * g + n), b + 2, 2);
      const uint8_t* qs = b + (t == Q4_1 ? 4 : t == Q5_0 ? 6 : 2);
      const uint32_t qh = t == Q5_0 ? u32at(b + 2) : 0;
      for (int k = 0; k < 32; ++k)
        q[32 * g + k] = t == Q8_0 ? static_cast<uint8_t>(qs[k] ^ 0x80)
                                  : static_cast<uint8_t>((k < 16 ? qs[k] & 15 : qs[k - 16] >> 4) | ((qh >> k) & 1) << 4);
    }
  } else if (t == Q4_K) {
    const uint8_t* b = row + c * 144;
    std::memcpy(sc + 2 * n, b, 2);
    std::memcpy(sc + 32 + 2 * n, b + 2, 2);
    for (int j = 0; j < 8; ++j) {
      int s, m;
      scale_min_k4(j, b + 4, s, m);
      sc[64 + 16 * j + n] = static_cast<uint8_t>(s);
      sc[192 + 16 * j + n] = static_cast<uint8_t>(m);
    }
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) {
        q[64 * i + l] = b[16 + 32 * i + l] & 15;
        q[64 * i + 32 + l] = b[16 + 32 * i + l] >> 4;
      }
  } else {  // Q6_K: ql[128], qh[64], int8 scales[16], fp16 d; weight k's scale is k / 16
    const uint8_t* b = row + c * 210;
    std::memcpy(sc + 2 * n, b + 208, 2);
    for (int j = 0; j < 16; ++j) sc[32 + 16 * j + n] = b[192 + j];
    for (int k = 0; k < 256; ++k) {
      const int h = k / 128, qu = k % 128 / 32, l = k % 32;
      q[k] = static_cast<uint8_t>(((b[64 * h + l + 32 * (qu & 1)] >> (4 * (qu >> 1))) & 15) |
                                  ((b[128 + 32 * h + l] >> (2 * qu)) & 3) << 4);
    }
  }
  for (int k = 0; k < 256; ++k) U[uidx(n, k)] = q[k];
}

// The inverse: column n of U and sc -> weight row `row`'s chunk c as GGUF stores it.
inline void unpack_row(const uint8_t* U, const uint8_t* sc, int t, int64_t c, int64_t K, int n, uint8_t* row) {
  uint8_t q[256];
  for (int k = 0; k < 256; ++k) q[k] = U[uidx(n, k)];
  if (qk_of(t) == 32) {
    const int by = bytes_of(t);
    for (int g = 0; g < 8 && (c * 8 + g) * 32 < K; ++g) {
      uint8_t* b = row + (c * 8 + g) * by;
      std::memcpy(b, sc + 2 * (16 * g + n), 2);
      if (t == Q4_1) std::memcpy(b + 2, sc + 256 + 2 * (16 * g + n), 2);
      uint8_t* qs = b + (t == Q4_1 ? 4 : t == Q5_0 ? 6 : 2);
      uint32_t qh = 0;
      for (int k = 0; k < 32; ++k) {
        const uint8_t v = q[32 * g + k];
        if (t == Q8_0) { qs[k] = v ^ 0x80; continue; }
        if (k < 16) qs[k] = v & 15; else qs[k - 16] |= (v & 15) << 4;
        qh |= uint32_t(v >> 4 & 1) << k;
      }
      if (t == Q5_0) std::memcpy(b + 2, &qh, 4);
    }
  } else if (t == Q4_K) {
    uint8_t* b = row + c * 144;
    std::memcpy(b, sc + 2 * n, 2);
    std::memcpy(b + 2, sc + 32 + 2 * n, 2);
    uint8_t* s = b + 4;
    std::memset(s, 0, 12);
    for (int j = 0; j < 8; ++j) {
      const int scv = sc[64 + 16 * j + n], mv = sc[192 + 16 * j + n];
      if (j < 4) { s[j] |= scv; s[j + 4] |= mv; }
      else { s[j + 4] = (scv & 15) | (mv & 15) << 4; s[j - 4] |= (scv >> 4) << 6; s[j] |= (mv >> 4) << 6; }
    }
    for (int i = 0; i < 4; ++i)
      for (int l = 0; l < 32; ++l) b[16 + 32 * i + l] = q[64 * i + l] | q[64 * i + 32 + l] << 4;
  } else {
    uint8_t* b = row + c * 210;
    std::memset(b, 0, 192);
    std::memcpy(b + 208, sc + 2 * n, 2);
    for (int j = 0; j < 16; ++j) b[192 + j] = sc[32 + 16 * j + n];
    for (int k = 0; k < 256; ++k) {
      const int h = k / 128, qu = k % 128 / 32, l = k % 32;
      b[64 * h + l + 32 * (qu & 1)] |= (q[k] & 15) << (4 * (qu >> 1));
      b[128 + 32 * h + l] |= (q[k] >> 4) << (2 * qu);
    }
  }
}

// U (4096 codes) -> the record's code bytes, and back
inline void store_codes(const uint8_t* U, int t, uint8_t* r) {
  if (t == Q8_0) { std::memcpy(r, U, 4096); return; }
  for (int j = 0; j < 2048; ++j) r[j] = (U[j] & 15) | (U[j + 2048] & 15) << 4;
  if (t == Q5_0)
    for (int j = 0; j < 512; ++j) {
      uint8_t v = 0;
      for (int b = 0; b < 8; ++b) v |= (U[j + 512 * b] >> 4 & 1) << b;
      r[2048 + j] = v;
    }
  if (t == Q6_K)
    for (int j = 0; j < 1024; ++j)
      r[2048 + j] = static_cast<uint8_t>((U[j] >> 4 & 3) << 4 | (U[j + 1024] >> 4 & 3) << 6 | (U[j + 2048] >> 4 & 3) |
                                         (U[j + 3072] >> 4 & 3) << 2);
}

// The panel chunk's scales: ws[g], co[g] over the 16 weight rows, the factor of the group's int32 dot and the
// coefficient of the x group's sum (as dec: d * sc, -(dmin * m), d * -8, ...).
template <int T>
__attribute__((always_inline)) inline void scales(const uint8_t* r, __m512* ws, __m512* co) {
  const uint8_t* s = r + rec_codes(T);
  auto h16 = [](const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); };
  if constexpr (T == Q4_K) {
    const __m512 d = h16(s), dm = h16(s + 32);
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      ws[g] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(s + 64 + 16 * g)))));
      co[g] = _mm512_sub_ps(_mm512_setzero_ps(),
                            _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(s + 192 + 16 * g))))));
    }
  } else if constexpr (T == Q6_K) {
    const __m512 d = h16(s);
#pragma GCC unroll 16
    for (int h = 0; h < 16; ++h) {
      ws[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(s + 32 + 16 * h)))));
      co[h] = _mm512_mul_ps(ws[h], _mm512_set1_ps(-32.0f));
    }
  } else {
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      ws[g] = h16(s + 32 * g);
      co[g] = T == Q4_1 ? h16(s + 256 + 32 * g)
                        : _mm512_mul_ps(ws[g], _mm512_set1_ps(T == Q4_0 ? -8.0f : T == Q5_0 ? -16.0f : -128.0f));
    }
  }
}

using q8::PF;  // prefetch distance in bytes, the int8 path's
// A line (two past 4 KiB of codes) of the record PF bytes ahead per vector of codes read: spread over the chunk,
// the prefetches keep up with the reads (issued at once, 37-68 a chunk, they made a 191 MB Q6_K LM head stream
// 8 % slower than one spread this way, on an AMX Xeon)
template <int T>
__attribute__((always_inline)) inline void prefetch_at(const uint8_t* r, int j) {
  constexpr int S = rec_bytes(T), H = T == Q8_0 ? 4096 : 2048;
  _mm_prefetch((const char*)r + PF + j, _MM_HINT_T0);
  if (H + j < S) _mm_prefetch((const char*)r + PF + H + j, _MM_HINT_T0);
}

// The panel chunk's 4096 codes, 64 at a time: f(j, v) with v = U[j, j + 64) (one B-tile row: dword n = 4 codes
// of weight row n), for j = 0, 64, ..., 4032 (in the order the bytes come out: j and j + 2048 together).
template <int T, class F>
__attribute__((always_inline)) inline void codes(const uint8_t* r, F f) {
  if constexpr (T == Q8_0) {
#pragma GCC unroll 64
    for (int j = 0; j < 4096; j += 64) {
      f(j, _mm512_loadu_si512(r + j));
      prefetch_at<T>(r, j);
    }
    return;
  }
  const __m512i n4 = _mm512_set1_epi8(15), k30 = _mm512_set1_epi8(0x30);
#pragma GCC unroll 32
  for (int j = 0; j < 2048; j += 64) {  // unrolled: j constant, so f's register indices and the branches fold
    const __m512i v = _mm512_loadu_si512(r + j);
    __m512i lo = _mm512_and_si512(v, n4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), n4);
    if constexpr (T == Q5_0) {
      const __m512i p = _mm512_loadu_si512(r + 2048 + j % 512), k16 = _mm512_set1_epi8(16);
      const int b = j / 512;
      lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(p, _mm512_set1_epi8(static_cast<char>(1 << b))), lo, k16);
      hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(p, _mm512_set1_epi8(static_cast<char>(1 << (b + 4)))), hi, k16);
    } else if constexpr (T == Q6_K) {
      const __m512i p = _mm512_loadu_si512(r + 2048 + j % 1024);
      const __m512i a = j < 1024 ? p : _mm512_srli_epi16(p, 2);                            // U[j] or U[j + 1024]
      const __m512i b = j < 1024 ? _mm512_slli_epi16(p, 4) : _mm512_slli_epi16(p, 2);      // + 2048
      lo = _mm512_ternarylogic_epi32(lo, a, k30, 0xF8);  // lo | (a & 0x30)
      hi = _mm512_ternarylogic_epi32(hi, b, k30, 0xF8);
    }
    f(j, lo);
    prefetch_at<T>(r, j);
    f(j + 2048, hi);
  }
}

// The panel chunk's codes unpacked into U (Q8_0: the record itself) and its scales.
template <int T>
__attribute__((always_inline)) inline const uint8_t* unpack(const uint8_t* r, uint8_t* U, __m512* ws, __m512* co) {
  scales<T>(r, ws, co);
  if constexpr (T == Q8_0) return r;
  codes<T>(r, [&](int j, __m512i v) { _mm512_store_si512(U + j, v); });
  return U;
}

struct alignas(64) Cfg { uint8_t palette = 1, start = 0, r0[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
inline int gpk_of(int t) { return t == Q6_K ? 4 : 2; }  // groups in a 64-code span
inline int need_of(int t) { return 1 << (4 + (t == Q6_K)); }  // the quantize `need` bit of its few-rows x
// Two ways to lay the tiles, the same int32 dots (exact), so the same outputs bit for bit:
// - few rows (M * gpk <= 16, "spans"): one tdpbsud per 64 codes, the A tile's rows (x row, group of the
//   span) each holding one group's codes (X.xe): 4 a chunk. A tdpbsud costs the same for 1 row as for 16
//   (measured: ~16 cycles each at 1 row), so at decode this is 2x (Q6_K: 4x) fewer than one per group.
// - more rows ("groups"): one tdpbsud per group for up to 16 x rows: A x rows x 32 (16) codes.
// Tiles: spans 0 A (M * gpk x 64), 1 B (16 x 64), 2 C (M * gpk x 16 int32); groups 0, 3 A (mb x 32), 1, 4 B
// (8 x 64), 2, 5 C (mb x 16), 6 Q6_K's A (mb x 16), 7 its B (4 x 64).
inline void configure(int mode, int mb) {  // mode 0: groups (mb x rows); else spans of `mode` rows
  Cfg c;
  if (mode) {
    c.rows[0] = mode, c.colsb[0] = 64;
    c.rows[1] = 16, c.colsb[1] = 64;
    c.rows[2] = mode, c.colsb[2] = 64;
  } else {
    for (int t : {0, 3}) c.rows[t] = mb, c.colsb[t] = 32;
    for (int t : {1, 4}) c.rows[t] = 8, c.colsb[t] = 64;
    for (int t : {2, 5}) c.rows[t] = mb, c.colsb[t] = 64;
    c.rows[6] = mb, c.colsb[6] = 16;
    c.rows[7] = 4, c.colsb[7] = 64;
  }
  _tile_loadconfig(&c);
}

// One panel (16 weight rows, C chunks of records from rec) against every row of x: out [M][16] (fp32).
// cb: 16 KiB for the int32 dots of a chunk; acc: M * 64 floats.
// Every output is the same fp32 arithmetic whichever way its dots were made: four running sums, group g of
// every chunk into sum g % 4 (a += float(dot) * (ws * xd); a += co * xs), then (s0 + s1) + (s2 + s3). Four
// chains, not one: one sum took 2 dependent FMAs a group, 64 (Q6_K 128) cycles of latency a chunk.
#define SPECCTL_AMX8_TERM(A, g, DOT, XD, XS)                                       \
  {                                                                               \
    const __m512 p_ = _mm512_mul_ps(ws[g], _mm512_set1_ps(XD));                   \
    A[(g) % 4] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(DOT), p_, A[(g) % 4]);        \
    A[(g) % 4] = _mm512_fmadd_ps(co[g], _mm512_set1_ps(XS), A[(g) % 4]);          \
  }
template <int T>
void panel(const uint8_t* rec, int64_t C, const X& x, int mb, float* out, float* acc, int32_t* cb) {
  constexpr int S = rec_bytes(T), NG = T == Q6_K ? 16 : 8, GPK = T == Q6_K ? 4 : 2;
  const int64_t M = x.M, Kp = x.Kp, G = Kp / 32;
  const int R = static_cast<int>(M) * GPK;
  const bool spans = R <= 16;
  const int8_t* xe = spans ? x.xe[GPK == 4].data() : nullptr;
  alignas(64) uint8_t U[4096];
  __m512 ws[NG], co[NG];
  if (M == 1) {  // one row: vpdpbusd against x's dwords broadcast, the same exact dots, the same sums
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t* r = rec + c * S;
      scales<T>(r, ws, co);
      const int32_t* xw = reinterpret_cast<const int32_t*>(x.nat.data() + 256 * c);  // dword k / 4 of the chunk
      __m512i dot[NG];
#pragma GCC unroll 16
      for (int g = 0; g < NG; ++g) dot[g] = _mm512_setzero_si512();
      codes<T>(r, [&](int j, __m512i v) {  // j: group j / 512, its dword row j % 512 / 64
        const int g = j / 512, row = j % 512 / 64, k = NG == 16 ? 2 * g + row / 4 : g;
        dot[k] = _mm512_dpbusd_epi32(dot[k], v, _mm512_set1_epi32(xw[8 * g + row]));
      });
      const float* xd = x.d.data() + 8 * c;
      const float* xsm = (T == Q6_K ? x.xs16 : x.xs32).data() + c * 16 + (T == Q6_K ? 0 : 8);
#pragma GCC unroll 16
      for (int g = 0; g < NG; ++g) SPECCTL_AMX8_TERM(a, g, dot[g], xd[T == Q6_K ? g / 2 : g], xsm[g])
    }
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
    return;
  }
  std::fill(acc, acc + M * 64, 0.0f);
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* r = rec + c * S;
    const uint8_t* u = unpack<T>(r, U, ws, co);
    const float* xs = (T == Q6_K ? x.xs16 : x.xs32).data() + c * M * 16 + (T == Q6_K ? 0 : 8);
    for (int64_t x0 = 0; x0 < M; x0 += mb) {
      if (spans) {  // C row (m, j) of span sp: group GPK sp + j; cb [4][R][16]
#pragma GCC unroll 4
        for (int sp = 0; sp < 4; ++sp) {
          _tile_loadd(0, xe + ((4 * c + sp) * R) * 64, 64);
          _tile_loadd(1, u + 1024 * sp, 64);
          _tile_zero(2);
          _tile_dpbsud(2, 0, 1);
          _tile_stored(2, cb + sp * R * 16, 64);
        }
      } else {
        const int8_t* xa = x.nat.data() + x0 * Kp + 256 * c;
        if constexpr (T == Q6_K) {
#pragma GCC unroll 16
          for (int h = 0; h < 16; ++h) {
            _tile_loadd(6, xa + 16 * h, Kp);
            _tile_loadd(7, u + 256 * h, 64);
            if (h & 1) { _tile_zero(5); _tile_dpbsud(5, 6, 7); _tile_stored(5, cb + 256 * h, 64); }
            else { _tile_zero(2); _tile_dpbsud(2, 6, 7); _tile_stored(2, cb + 256 * h, 64); }
          }
        } else {
#pragma GCC unroll 8
          for (int g = 0; g < 8; ++g) {
            if (g & 1) {
              _tile_loadd(3, xa + 32 * g, Kp); _tile_loadd(4, u + 512 * g, 64);
              _tile_zero(5); _tile_dpbsud(5, 3, 4); _tile_stored(5, cb + 256 * g, 64);
            } else {
              _tile_loadd(0, xa + 32 * g, Kp); _tile_loadd(1, u + 512 * g, 64);
              _tile_zero(2); _tile_dpbsud(2, 0, 1); _tile_stored(2, cb + 256 * g, 64);
            }
          }
        }
      }
      const int64_t mr = std::min<int64_t>(mb, M - x0);
      for (int64_t i = 0; i < mr; ++i) {
        const int64_t m = x0 + i;
        const float* xd = x.d.data() + m * G + 8 * c;
        const float* xsm = xs + m * 16;
        float* am = acc + m * 64;
        __m512 a[4] = {_mm512_loadu_ps(am), _mm512_loadu_ps(am + 16), _mm512_loadu_ps(am + 32), _mm512_loadu_ps(am + 48)};
#pragma GCC unroll 16
        for (int g = 0; g < NG; ++g) {
          const int32_t* dot = spans ? cb + ((g / GPK) * R + m * GPK + g % GPK) * 16 : cb + 256 * g + 16 * i;
          SPECCTL_AMX8_TERM(a, g, _mm512_loadu_si512(dot), xd[T == Q6_K ? g / 2 : g], xsm[g])
        }
        for (int q = 0; q < 4; ++q) _mm512_storeu_ps(am + 16 * q, a[q]);
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* am = acc + m * 64;
    _mm512_storeu_ps(out + m * 16, _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(am), _mm512_loadu_ps(am + 16)),
                                                 _mm512_add_ps(_mm512_loadu_ps(am + 32), _mm512_loadu_ps(am + 48))));
  }
}
#undef SPECCTL_AMX8_TERM

// Outputs [g0, g1) of the packed parts side by side (each part's n a multiple of 16; g0, g1 multiples of 16
// or the end) against every row of x (quantized with need_of each part's type): put(m, g, v). Configures this
// thread's tiles.
template <class Put>
void range(const X& x, int64_t K, const std::vector<Part>& parts, int64_t g0, int64_t g1, Put put) {
  const int mb = static_cast<int>(std::min<int64_t>(16, x.M));
  std::vector<float> out(x.M * 16), acc(x.M * 64);
  alignas(64) int32_t cb[16 * 256];
  const int64_t C = chunks(K);
  int64_t base = 0;
  size_t pi = 0;
  int mode = -1;
  for (int64_t g = g0 / 16 * 16; g < g1; g += 16) {
    while (g >= base + parts[pi].n) base += parts[pi++].n;
    const Part& P = parts[pi];
    const int R = static_cast<int>(x.M) * gpk_of(P.type), want = R <= 16 ? R : 0;
    if (x.M > 1 && want != mode) configure(mode = want, mb);  // one row takes no tiles
    with_type(P.type, [&](auto T) {
      panel<T()>(P.w + (g - base) / 16 * C * rec_bytes(T()), C, x, mb, out.data(), acc.data(), cb);
    });
    for (int64_t m = 0; m < x.M; ++m)
      for (int n = 0; n < 16; ++n)
        if (g + n >= g0 && g + n < g1) put(m, g + n, out[m * 16 + n]);
  }
}
}  // namespace amx8
#endif

}  // namespace specctl::gguf
