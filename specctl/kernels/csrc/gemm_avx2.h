// The bf16 GEMM for many rows (prefill chunks, wide verify blocks, large batches) on a CPU with AVX2 and FMA
// alone: the same outputs as skinny_gemm.h's rows_kernel, bit for bit, blocked for reuse.
//
// Every output of the skinny kernels is one dot product in a fixed order: 16 fp32 lanes, lane l of each
// 32-element chunk c taking the pair (c*32 + 2l', c*32 + 2l' + 1) of its half (lanes 0-7 the chunk's first 16
// elements, 8-15 its last 16), acc = fma(x_even, w_even, fma(x_odd, w_odd, acc)) chunk after chunk, then
// reduce_add's fixed lane tree. Here the same per-lane sequence is computed, only scheduled differently:
//   - x is split once per call into fp32 (odd, even) vectors, zero-padded to whole chunks as load_bf16x32_n
//     pads the tail (xsplit), so a pass reads x with plain loads and splits only the weights;
//   - a micro-kernel keeps MR x rows by NR weight rows of accumulators in ymm registers, one half of the
//     lanes at a time (AVX2's 16 registers hold 8 accumulators of 8 lanes, not the skinny kernel's 4 x 4 of
//     16 lanes, which spill), over a block of KC elements of k;
//   - the loops run x rows (MB, their split copy in L3) outside weight rows (NC) outside k blocks (KC: the NC
//     weight rows' block stays in L2 while MR rows of split x, in L1, meet each of them), the accumulators
//     parked in memory between k blocks (fp32 stores and loads are exact: the per-lane sequence is unchanged).
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

// x [M, K] bf16 -> xs [M, KP] fp32, KP = K rounded up to 32: each row the chunks' first halves (elements 0-15
// of each 32), then their second halves, each half as its 8 odd elements then its 8 even ones in fp32 (zeros
// past K): a pass over one half of the lanes reads x contiguously.
inline void xsplit(const uint16_t* x, int64_t M, int64_t K, int64_t KP, float* xs) {
  alignas(32) uint16_t pad[32];
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xr = x + m * K;
    float* o = xs + m * KP;
    for (int64_t k = 0; k < KP; k += 16) {
      const uint16_t* p = xr + k;
      if (k + 16 > K) {
        std::memset(pad, 0, sizeof pad);
        if (k < K) std::memcpy(pad, p, (K - k) * 2);
        p = pad;
      }
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      float* d = o + (k / 16 % 2) * (KP / 2) + k / 32 * 16;
      _mm256_storeu_ps(d, odd_bf16x8(v));
      _mm256_storeu_ps(d + 8, even_bf16x8(v));
    }
  }
}

// acc[m * NC16 + j * 16 + half * 8 + lane] += rows [0, R) of xs (stride KP) against weight rows [0, C) of wr
// (stride ldw; the chunks [c0, c1) of k, those at and past cfull read from wpad, the zero-padded tail rows).
template <int R, int C>
inline void micro(const float* xs, int64_t KP, const uint16_t* wr, int64_t ldw, const uint16_t* wpad,
                  int64_t c0, int64_t c1, int64_t cfull, float* acc, int64_t NC16) {
  for (int h = 0; h < 2; ++h) {
    __m256 a[R][C];
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) a[m][j] = _mm256_loadu_ps(acc + m * NC16 + j * 16 + h * 8);
    for (int64_t c = c0; c < c1; ++c) {
      __m256 wo[C], we[C];
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) {
        const uint16_t* p = c < cfull ? wr + j * ldw + c * 32 + h * 16 : wpad + j * 32 + h * 16;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        wo[j] = odd_bf16x8(v);
        we[j] = even_bf16x8(v);
      }
      const float* xc = xs + h * (KP / 2) + c * 16;
#pragma GCC unroll 8
      for (int m = 0; m < R; ++m) {
        __m256 xo = _mm256_loadu_ps(xc + m * KP);
        asm("" : "+x"(xo));  // one load into a register for the NR products, not one folded into each
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) a[m][j] = _mm256_fmadd_ps(xo, wo[j], a[m][j]);
        __m256 xe = _mm256_loadu_ps(xc + m * KP + 8);
        asm("" : "+x"(xe));
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) a[m][j] = _mm256_fmadd_ps(xe, we[j], a[m][j]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m)
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) _mm256_storeu_ps(acc + m * NC16 + j * 16 + h * 8, a[m][j]);
  }
}

template <int R>
inline void micro_rows(int C, const float* xs, int64_t KP, const uint16_t* wr, int64_t ldw, const uint16_t* wpad,
                       int64_t c0, int64_t c1, int64_t cfull, float* acc, int64_t NC16) {
  if constexpr (NR >= 3) {
    if (C == 3) return micro<R, 3>(xs, KP, wr, ldw, wpad, c0, c1, cfull, acc, NC16);
  }
  if constexpr (NR >= 2) {
    if (C == 2) return micro<R, 2>(xs, KP, wr, ldw, wpad, c0, c1, cfull, acc, NC16);
  }
  micro<R, 1>(xs, KP, wr, ldw, wpad, c0, c1, cfull, acc, NC16);
}

inline void micro_any(int R, int C, const float* xs, int64_t KP, const uint16_t* wr, int64_t ldw, const uint16_t* wpad,
                      int64_t c0, int64_t c1, int64_t cfull, float* acc, int64_t NC16) {
  switch (R) {
    case 1: return micro_rows<1>(C, xs, KP, wr, ldw, wpad, c0, c1, cfull, acc, NC16);
    case 2: if constexpr (MR >= 2) return micro_rows<2>(C, xs, KP, wr, ldw, wpad, c0, c1, cfull, acc, NC16); break;
    case 3: if constexpr (MR >= 3) return micro_rows<3>(C, xs, KP, wr, ldw, wpad, c0, c1, cfull, acc, NC16); break;
    case 4: if constexpr (MR >= 4) return micro_rows<4>(C, xs, KP, wr, ldw, wpad, c0, c1, cfull, acc, NC16); break;
    case 5: if constexpr (MR >= 5) return micro_rows<5>(C, xs, KP, wr, ldw, wpad, c0, c1, cfull, acc, NC16); break;
    case 6: if constexpr (MR >= 6) return micro_rows<6>(C, xs, KP, wr, ldw, wpad, c0, c1, cfull, acc, NC16); break;
  }
}

// y = x w^T (+ b) (+ r) for x [M, K] and weight rows [n0, n1), as skinny::rows computes it: finish(m, n, sum).
template <class Finish>
inline void rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t n0, int64_t n1, Finish finish) {
  const int64_t KP = (K + 31) / 32 * 32, chunks = KP / 32, cfull = K / 32;
  // 64-byte aligned, so that no 32-byte load straddles two cache lines
  thread_local std::vector<float, Aligned<float>> xs, acc;
  thread_local std::vector<uint16_t, Aligned<uint16_t>> wpad;
  const int64_t mb_max = std::min(M, MB);
  if (static_cast<int64_t>(xs.size()) < mb_max * KP) xs.resize(mb_max * KP);
  if (static_cast<int64_t>(acc.size()) < mb_max * NC * 16) acc.resize(mb_max * NC * 16);
  if (static_cast<int64_t>(wpad.size()) < NC * 32) wpad.resize(NC * 32);
  for (int64_t m0 = 0; m0 < M; m0 += MB) {  // MB x rows at a time, their split copy in L3 (for 2048-row prompts)
    const int64_t mb = std::min(MB, M - m0);
    xsplit(x + m0 * K, mb, K, KP, xs.data());
    for (int64_t nc = n0; nc < n1; nc += NC) {
      const int64_t nb = std::min(NC, n1 - nc);
      if (cfull < chunks) {  // the weight rows' last partial chunk, zero-padded as load_bf16x32_n pads it
        std::fill(wpad.begin(), wpad.begin() + nb * 32, 0);
        for (int64_t j = 0; j < nb; ++j) std::memcpy(&wpad[j * 32], w + (nc + j) * K + cfull * 32, (K - cfull * 32) * 2);
      }
      std::fill(acc.begin(), acc.begin() + mb * nb * 16, 0.0f);
      for (int64_t c0 = 0; c0 < chunks; c0 += KC / 32) {  // nb weight rows' KC elements stay in L2 ...
        const int64_t c1 = std::min(chunks, c0 + KC / 32);
        for (int64_t m = 0; m < mb; m += MR) {  // ... while MR x rows' KC elements in L1 meet each of them
          const int R = static_cast<int>(std::min<int64_t>(MR, mb - m));
          for (int64_t j = 0; j < nb; j += NR) {
            const int C = static_cast<int>(std::min<int64_t>(NR, nb - j));
            micro_any(R, C, xs.data() + m * KP, KP, w + (nc + j) * K, K, wpad.data() + j * 32, c0, c1, cfull,
                      acc.data() + m * nb * 16 + j * 16, nb * 16);
          }
        }
      }
      for (int64_t m = 0; m < mb; ++m)
        for (int64_t j = 0; j < nb; ++j) {
          const float* a = acc.data() + m * nb * 16 + j * 16;
          finish(m0 + m, nc + j, reduce_add(f32x16{_mm256_loadu_ps(a), _mm256_loadu_ps(a + 8)}));
        }
    }
  }
}

}  // namespace specctl::gemm
