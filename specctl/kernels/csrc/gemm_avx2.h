// The bf16 GEMM for many rows (prefill chunks, wide verify blocks, large batches) on a CPU with AVX2 and FMA
// alone: the same outputs as skinny_gemm.h's rows_kernel, bit for bit, blocked for reuse.
//
// Every output of the skinny kernels is one dot product in a fixed order: 16 fp32 lanes, lane l = 8h + i of each
// 32-element chunk c taking the pair (c*32 + 16h + 2i, +1), acc_l = fma(x_even, w_even, fma(x_odd, w_odd, acc_l))
// chunk after chunk, then reduce_add's fixed tree over the 16 lanes. The 16 lanes never meet before that tree, so
// the GEMM is 16 independent GEMMs, one a lane, each over its 2 values a chunk (odd, then even: "steps"), and the
// tree adds their 16 results. Each lane's GEMM runs the textbook way (BLIS's outer-product micro-kernel): MR x rows
// broadcast, against NR = 8 NV weight rows held as NV vectors, MR x NV accumulators in ymm registers, every
// vector lane one output's partial sum with the skinny kernel's sequence of FMAs. Then the tree's adds run across
// 8 outputs at once (the same adds in the same order, vertical). No horizontal sum per output, and a weight vector
// serves MR rows, a broadcast NV vectors.
//   - Both operands are packed once in the order the micro-kernel reads them, split into fp32 (an 8 x 8 transpose
//     of bf16 pairs, then the odd and the even halves), zero-padded to whole chunks as load_bf16x32_n pads the tail:
//     x as [lane][group of 8 rows][step][8] (one lane's rows one stream), the weights as [lane][panel][step][NR].
//   - Loops: x rows (MB a block, packed once) outside weight rows (NC, packed once a block of x) outside k blocks
//     (KC) outside lanes outside x rows (MR) outside weight panels: one lane's steps of the NC weight rows stay in
//     L1 while every MR rows meet them. The accumulators start at zero in registers and are parked in memory
//     (exact fp32 stores and loads) between calls; the tree reads them once at the end.
// MR 4, NV 3, MB 128, NC 48, KC 2,048 were among the fastest tried on an AMD EPYC Zen 3 (the micro-kernel alone,
// in L1, runs at one core's FMA peak; in the GEMM the operands' traffic sets the pace). See
// docs/results/2026-12-07-zen3-lane-gemm.md: 0.84-0.95x the time of the earlier form (a 16-lane dot product per
// output, the weights split in pairs of rows, a horizontal sum per output) over a model's linears, 0.79-0.87x alone.
// So a row among any number of rows still equals that row alone, and the switch from the skinny kernel to this
// one at GEMM_M rows changes no bit (tests/kernels/test_skinny_linear.py checks both sides of it).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace specctl::gemm {

#ifndef SPECCTL_GEMM_KC
#define SPECCTL_GEMM_KC 2048
#endif
#ifndef SPECCTL_GEMM_NC
#define SPECCTL_GEMM_NC 48
#endif
#ifndef SPECCTL_GEMM_MB
#define SPECCTL_GEMM_MB 128
#endif
#ifndef SPECCTL_GEMM_MR
#define SPECCTL_GEMM_MR 4
#endif
#ifndef SPECCTL_GEMM_NV
#define SPECCTL_GEMM_NV 3
#endif
constexpr int MR = SPECCTL_GEMM_MR;      // x rows a micro-tile (a divisor of 8)
constexpr int NV = SPECCTL_GEMM_NV;      // vectors of 8 weight rows a micro-tile
constexpr int NR = 8 * NV;               // weight rows a micro-tile
constexpr int LANES = 16;                // the skinny kernel's lanes: one partial sum each
constexpr int64_t KC = SPECCTL_GEMM_KC;  // elements of k a block (a multiple of 32)
constexpr int64_t NC = SPECCTL_GEMM_NC;  // weight rows a block (a multiple of NR)
constexpr int64_t MB = SPECCTL_GEMM_MB;  // x rows a block
static_assert(KC % 32 == 0 && NC % (8 * SPECCTL_GEMM_NV) == 0 && 8 % SPECCTL_GEMM_MR == 0, "whole chunks, panels, groups");

template <class T>
struct Aligned {  // a std::allocator on 64-byte boundaries
  using value_type = T;
  Aligned() = default;
  template <class U>
  Aligned(const Aligned<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <class U>
  bool operator==(const Aligned<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned<U>&) const { return false; }
};

// r[i] <- column i of the 8 x 8 matrix of 32-bit elements whose rows are r[0..7]
inline void transpose8(__m256i r[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
  r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
  r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
  r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
  r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// Rows [0, n) of a (stride K), chunks [c0, c1), split into fp32 by lane: out[l * ls + s * P + row], step s of 2 (c1 - c0)
// a lane: step 2 (c - c0) the odd element of lane l's pair in chunk c, step 2 (c - c0) + 1 the even one; rows n to P
// (a multiple of 8) and elements past K are zeros (as load_bf16x32_n pads the tail).
inline void pack(const uint16_t* a, int64_t n, int64_t K, int64_t c0, int64_t c1, int64_t P, int64_t ls, float* out) {
  alignas(32) uint16_t pad[8][32];
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t g = 0; g < P; g += 8) {
    const int rn = static_cast<int>(std::clamp<int64_t>(n - g, 0, 8));
    for (int64_t c = c0; c < c1; ++c) {
      const uint16_t* p[8];
      const bool tail = c * 32 + 32 > K;
      for (int r = 0; r < 8; ++r) {
        p[r] = r < rn ? a + (g + r) * K + c * 32 : nullptr;
        if (p[r] && tail) {
          std::memset(pad[r], 0, sizeof pad[r]);
          std::memcpy(pad[r], p[r], (K - c * 32) * 2);
          p[r] = pad[r];
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256i v[8];
        for (int r = 0; r < 8; ++r)
          v[r] = p[r] ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p[r] + h * 16)) : _mm256_setzero_si256();
        transpose8(v);  // v[i]: pair i of the half, rows g .. g + 7
        for (int i = 0; i < 8; ++i) {
          float* o = out + (h * 8 + i) * ls + 2 * (c - c0) * P + g;
          _mm256_store_ps(o, _mm256_castsi256_ps(_mm256_and_si256(v[i], hi)));        // odd
          _mm256_store_ps(o + P, _mm256_castsi256_ps(_mm256_slli_epi32(v[i], 16)));  // even
        }
      }
    }
  }
}

// acc[r * lda + 0..15] (+)= the S steps of one lane for R x rows (x + s * ldx + r, broadcast) against 16 weight
// rows (w + s * 16): each lane's sequence of FMAs is the skinny kernel's.
template <int R>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t S, bool first, float* acc, int64_t lda) {
  __m256 c[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) c[r][v] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + r * lda + v * 8);
  for (int64_t s = 0; s < S; ++s, x += ldx, w += NR) {
    __m256 wv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) wv[v] = _mm256_load_ps(w + v * 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) c[r][v] = _mm256_fmadd_ps(xb, wv[v], c[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) _mm256_store_ps(acc + r * lda + v * 8, c[r][v]);
}

inline void micro_any(int R, const float* x, int64_t ldx, const float* w, int64_t S, bool first, float* acc, int64_t lda) {
  switch (R) {  // R <= MR
    case 1: return micro<1>(x, ldx, w, S, first, acc, lda);
    case 2: if constexpr (MR >= 2) return micro<2>(x, ldx, w, S, first, acc, lda); break;
    case 3: if constexpr (MR >= 3) return micro<3>(x, ldx, w, S, first, acc, lda); break;
    case 4: if constexpr (MR >= 4) return micro<4>(x, ldx, w, S, first, acc, lda); break;
    case 5: if constexpr (MR >= 5) return micro<5>(x, ldx, w, S, first, acc, lda); break;
    case 6: if constexpr (MR >= 6) return micro<6>(x, ldx, w, S, first, acc, lda); break;
    case 7: if constexpr (MR >= 7) return micro<7>(x, ldx, w, S, first, acc, lda); break;
    case 8: if constexpr (MR >= 8) return micro<8>(x, ldx, w, S, first, acc, lda); break;
  }
}

// The 16 lanes' partial sums of 8 outputs (p[l], 8 outputs each) added in reduce_add's tree, as 8 sums.
inline __m256 tree(const float* p, int64_t ld) {
  __m256 t3[8];
  for (int i = 0; i < 8; ++i) t3[i] = _mm256_add_ps(_mm256_load_ps(p + (i + 8) * ld), _mm256_load_ps(p + i * ld));
  __m256 t6[4];
  for (int j = 0; j < 4; ++j) t6[j] = _mm256_add_ps(t3[j + 4], t3[j]);
  return _mm256_add_ps(_mm256_add_ps(t6[0], t6[2]), _mm256_add_ps(t6[1], t6[3]));
}

// y = x w^T (+ b) (+ r) for x [M, K] and weight rows [n0, n1), as skinny::rows computes it: finish(m, n, sums, count)
// takes the sums of outputs n .. n + count - 1 (count <= 8) of row m.
template <class Finish>
inline void rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, Finish finish) {
  const int64_t chunks = (K + 31) / 32;
  thread_local std::vector<float, Aligned<float>> xs_buf, ws_buf, acc_buf;
  const int64_t mbp_max = (std::min(M, MB) + 7) / 8 * 8;
  if (static_cast<int64_t>(xs_buf.size()) < mbp_max * chunks * 32) xs_buf.resize(mbp_max * chunks * 32);
  if (static_cast<int64_t>(ws_buf.size()) < NC * KC) ws_buf.resize(NC * KC);
  if (static_cast<int64_t>(acc_buf.size()) < mbp_max * NC * LANES) acc_buf.resize(mbp_max * NC * LANES);
  // plain pointers: in a shared object (-fPIC) every use of a thread_local is a call to __tls_get_addr
  float* const xs = xs_buf.data();
  float* const ws = ws_buf.data();
  float* const acc = acc_buf.data();
  constexpr int64_t T = NR * LANES;  // floats of a tile's partial sums: acc[(m * np + p) * T + l * NR + 0..NR)
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min(MB, M - m0), groups = (mb + 7) / 8;
    for (int64_t c0 = 0; c0 < chunks; c0 += KC / 32) {  // [k block][lane][group of 8 rows][step][8]
      const int64_t c1 = std::min(chunks, c0 + KC / 32), S = 2 * (c1 - c0);
      for (int64_t g = 0; g < groups; ++g)
        pack(x + (m0 + g * 8) * K, std::min<int64_t>(8, mb - g * 8), K, c0, c1, 8, groups * S * 8,
             xs + c0 * 32 * groups * 8 + g * S * 8);
    }
    for (int64_t nc = n0; nc < n1; nc += NC) {
      const int64_t nb = std::min(NC, n1 - nc), np = (nb + NR - 1) / NR, lda = np * T;
      for (int64_t c0 = 0; c0 < chunks; c0 += KC / 32) {
        const int64_t c1 = std::min(chunks, c0 + KC / 32), S = 2 * (c1 - c0);
        for (int64_t p = 0; p < np; ++p)  // [lane][panel][step][NR]
          pack(w + (nc + p * NR) * K, std::min<int64_t>(NR, nb - p * NR), K, c0, c1, NR, np * S * NR, ws + p * S * NR);
        const float* xb = xs + c0 * 32 * groups * 8;
        for (int l = 0; l < LANES; ++l) {  // one lane's steps of the NC weight rows stay in L1 ...
          const float* xl = xb + l * groups * S * 8;
          const float* wl = ws + l * np * S * NR;
          for (int64_t m = 0; m < mb; m += MR) {  // ... while each MR rows' meet them, x read as one stream
            const int R = static_cast<int>(std::min<int64_t>(MR, mb - m));
            for (int64_t p = 0; p < np; ++p)
              micro_any(R, xl + (m / 8) * S * 8 + m % 8, 8, wl + p * S * NR, S, c0 == 0, acc + m * lda + p * T + l * NR, lda);
          }
        }
      }
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t p = 0; p < np; ++p)
          for (int v = 0; v < NV; ++v) {
            const int64_t n = p * NR + v * 8;
            if (n < nb) finish(m0 + m, nc + n, tree(acc + m * lda + p * T + v * 8, NR), static_cast<int>(std::min<int64_t>(8, nb - n)));
          }
    }
  }
}

}  // namespace specctl::gemm
