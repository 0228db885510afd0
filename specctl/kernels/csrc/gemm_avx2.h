// The bf16 GEMM for many rows (prefill chunks, wide verify blocks, large batches) on a CPU with AVX2 and FMA
// alone: the same outputs as skinny_gemm.h's rows_kernel, bit for bit, blocked for reuse.
//
// Every output of the skinny kernels is one dot product in a fixed order: 16 fp32 lanes, lane l of each
// 32-element chunk c taking the pair (c*32 + 2l', c*32 + 2l' + 1) of its half (lanes 0-7 the chunk's first 16
// elements, 8-15 its last 16), acc = fma(x_even, w_even, fma(x_odd, w_odd, acc)) chunk after chunk, then
// reduce_add's fixed lane tree. Here the same per-lane sequence is computed, only scheduled differently:
//   - both operands are packed once (GotoBLAS's packing): x per block of MB rows, the weights per block of NC
//     rows by KC elements, split into fp32 (odd, even) vectors in the order the micro-kernel reads them and
//     zero-padded to whole chunks as load_bf16x32_n pads the tail, so its loop reads two contiguous streams
//     with plain loads and splits nothing (splitting the weights in the loop, or packing them as bf16 to
//     halve their L2 traffic, was 1.0-1.1x the time of fp32 packing on an AMD EPYC Zen 3);
//   - a micro-kernel keeps MR x rows by NR weight rows of accumulators in ymm registers, one half of the
//     lanes at a time (AVX2's 16 registers hold 8 accumulators of 8 lanes, not the skinny kernel's 4 x 4 of
//     16 lanes, which spill), over a block of KC elements of k;
//   - the loops run x rows (MB, packed in L3) outside weight rows (NC) outside k blocks (KC: the NC packed
//     weight rows' block stays in L2 while MR packed rows of x, in L1, meet each of them), the accumulators
//     starting at zero in registers and parked in memory between k blocks (fp32 stores and loads are exact:
//     the per-lane sequence is unchanged).
// Packing the weights is a pass of its own, which 16-19 rows do not repay (skinny_gemm.h's GEMM_M).
// So a row among any number of rows still equals that row alone, and the switch from the skinny kernel to this
// one at GEMM_M rows changes no bit (tests/kernels/test_skinny_linear.py checks both sides of it).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>
#include "bf16.h"

namespace specctl::gemm {

#ifndef SPECCTL_GEMM_MR
#define SPECCTL_GEMM_MR 4
#endif
#ifndef SPECCTL_GEMM_NR
#define SPECCTL_GEMM_NR 2
#endif
#ifndef SPECCTL_GEMM_KC
#define SPECCTL_GEMM_KC 1024
#endif
#ifndef SPECCTL_GEMM_NC
#define SPECCTL_GEMM_NC 48
#endif
constexpr int MR = SPECCTL_GEMM_MR, NR = SPECCTL_GEMM_NR;
constexpr int64_t KC = SPECCTL_GEMM_KC;  // elements of k a block (a multiple of 32)
constexpr int64_t NC = SPECCTL_GEMM_NC;  // weight rows a block
#ifndef SPECCTL_GEMM_MB
#define SPECCTL_GEMM_MB 256
#endif
constexpr int64_t MB = SPECCTL_GEMM_MB;  // x rows a block
static_assert(KC % 32 == 0, "whole chunks");

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

// Operands are packed once, split into fp32 in the order the micro-kernel reads them, so that a pass over k
// reads two contiguous streams with plain loads (GotoBLAS's packing): rows [0, n) of a (stride K), chunks
// [c0, c1), in groups of G rows, group g at out + g * kc * 32 laid out [half][chunk][row][odd 8 | even 8]
// (zeros past K, as load_bf16x32_n pads the tail).
inline void pack(const uint16_t* a, int64_t n, int64_t K, int64_t c0, int64_t c1, int G, float* out) {
  const int64_t kc = c1 - c0;
  alignas(32) uint16_t pad[32];
  for (int64_t g = 0; g < n; g += G) {
    const int rn = static_cast<int>(std::min<int64_t>(G, n - g));
    for (int r = 0; r < rn; ++r)
      for (int64_t c = c0; c < c1; ++c) {
        const uint16_t* p = a + (g + r) * K + c * 32;
        if (c * 32 + 32 > K) {
          std::memset(pad, 0, sizeof pad);
          std::memcpy(pad, p, (K - c * 32) * 2);
          p = pad;
        }
        float* o = out + g * kc * 32 + ((c - c0) * rn + r) * 16;
        for (int h = 0; h < 2; ++h, o += kc * rn * 16) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + h * 16));
          _mm256_store_ps(o, odd_bf16x8(v));
          _mm256_store_ps(o + 8, even_bf16x8(v));
        }
      }
  }
}

// acc[m * ld + j * 16 + half * 8 + lane] += R packed x rows against C packed weight rows over kc chunks: the odd
// products of a chunk into every accumulator, then the even ones (each lane's sequence is the skinny kernel's).
template <int R, int C>
inline void micro(const float* xp, const float* wp, int64_t kc, bool first, float* acc, int64_t ld) {
  for (int h = 0; h < 2; ++h) {
    __m256 a[R][C];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) a[m][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + m * ld + j * 16 + h * 8);
    const float* x = xp + h * kc * R * 16;
    const float* w = wp + h * kc * C * 16;
    for (int64_t c = 0; c < kc; ++c, x += R * 16, w += C * 16) {
#pragma GCC unroll 2
      for (int e = 0; e < 16; e += 8) {  // odd, then even
        __m256 wv[C];
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) {
          wv[j] = _mm256_load_ps(w + j * 16 + e);
          asm("" : "+x"(wv[j]));  // loaded once into a register, not folded into each of the R products
        }
#pragma GCC unroll 8
        for (int m = 0; m < R; ++m) {
          __m256 xv = _mm256_load_ps(x + m * 16 + e);
          asm("" : "+x"(xv));
#pragma GCC unroll 8
          for (int j = 0; j < C; ++j) a[m][j] = _mm256_fmadd_ps(xv, wv[j], a[m][j]);
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) _mm256_storeu_ps(acc + m * ld + j * 16 + h * 8, a[m][j]);
  }
}

template <int R>
inline void micro_rows(int C, const float* xp, const float* wp, int64_t kc, bool first, float* acc, int64_t ld) {
  if constexpr (NR >= 3) {
    if (C == 3) return micro<R, 3>(xp, wp, kc, first, acc, ld);
  }
  if constexpr (NR >= 2) {
    if (C == 2) return micro<R, 2>(xp, wp, kc, first, acc, ld);
  }
  micro<R, 1>(xp, wp, kc, first, acc, ld);
}

inline void micro_any(int R, int C, const float* xp, const float* wp, int64_t kc, bool first, float* acc, int64_t ld) {
  switch (R) {
    case 1: return micro_rows<1>(C, xp, wp, kc, first, acc, ld);
    case 2: if constexpr (MR >= 2) return micro_rows<2>(C, xp, wp, kc, first, acc, ld); break;
    case 3: if constexpr (MR >= 3) return micro_rows<3>(C, xp, wp, kc, first, acc, ld); break;
    case 4: if constexpr (MR >= 4) return micro_rows<4>(C, xp, wp, kc, first, acc, ld); break;
    case 5: if constexpr (MR >= 5) return micro_rows<5>(C, xp, wp, kc, first, acc, ld); break;
    case 6: if constexpr (MR >= 6) return micro_rows<6>(C, xp, wp, kc, first, acc, ld); break;
  }
}

// y = x w^T (+ b) (+ r) for x [M, K] and weight rows [n0, n1), as skinny::rows computes it: finish(m, n, sum).
template <class Finish>
inline void rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, Finish finish) {
  const int64_t chunks = (K + 31) / 32;
  // 64-byte aligned, so that no 32-byte load straddles two cache lines
  thread_local std::vector<float, Aligned<float>> xs_buf, ws_buf, acc_buf;
  const int64_t mb_max = std::min(M, MB);
  if (static_cast<int64_t>(xs_buf.size()) < mb_max * chunks * 32) xs_buf.resize(mb_max * chunks * 32);
  if (static_cast<int64_t>(ws_buf.size()) < NC * KC) ws_buf.resize(NC * KC);
  if (static_cast<int64_t>(acc_buf.size()) < mb_max * NC * 16) acc_buf.resize(mb_max * NC * 16);
  // plain pointers: in a shared object (-fPIC) every use of a thread_local is a call to __tls_get_addr
  float* const xs = xs_buf.data();
  float* const ws = ws_buf.data();
  float* const acc = acc_buf.data();
  for (int64_t m0 = 0; m0 < M; m0 += MB) {  // MB x rows at a time, their packed copy in L3 (for 2048-row prompts)
    const int64_t mb = std::min(MB, M - m0);
    for (int64_t c0 = 0; c0 < chunks; c0 += KC / 32)
      pack(x + m0 * K, mb, K, c0, std::min(chunks, c0 + KC / 32), MR, xs + c0 * 32 * mb);
    for (int64_t nc = n0; nc < n1; nc += NC) {
      const int64_t nb = std::min(NC, n1 - nc);
      for (int64_t c0 = 0; c0 < chunks; c0 += KC / 32) {  // nb packed weight rows' KC elements stay in L2 ...
        const int64_t c1 = std::min(chunks, c0 + KC / 32), kc = c1 - c0;
        pack(w + nc * K, nb, K, c0, c1, NR, ws);
        const float* xb = xs + c0 * 32 * mb;
        for (int64_t m = 0; m < mb; m += MR) {  // ... while MR x rows' KC elements in L1 meet each of them
          const int R = static_cast<int>(std::min<int64_t>(MR, mb - m));
          for (int64_t j = 0; j < nb; j += NR) {
            const int C = static_cast<int>(std::min<int64_t>(NR, nb - j));
            micro_any(R, C, xb + m * kc * 32, ws + j * kc * 32, kc, c0 == 0, acc + m * nb * 16 + j * 16, nb * 16);
          }
        }
      }
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t j = 0; j < nb; ++j) {
          const float* a = acc + m * nb * 16 + j * 16;
          finish(m0 + m, nc + j, reduce_add(f32x16{_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8)}));
        }
    }
  }
}

}  // namespace specctl::gemm
