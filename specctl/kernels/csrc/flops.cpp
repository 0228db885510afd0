// A compute-roof probe for benchmarks/prefill_roof.py: the most bf16 dot products per second this machine
// does with the arithmetic the bf16 kernels use (bf16.h's dot_bf16: vdpbf16ps on AVX512-BF16, two fp32 FMAs
// per bf16 pair on AVX-512 or AVX2), on registers alone (CHAINS independent accumulators per thread, all
// threads). Prefill is judged against this figure, as decode is against membw.cpp's read.
//
// AVX2 has 16 ymm registers and an accumulator of 16 lanes takes two: 16 of them spilled to memory, and the
// probe measured 117 GFLOP/s on an AMD EPYC Zen 3 (2 threads) where plain FMAs on registers give ~177. With
// the two operands' odd and even halves (8 ymm), 4 accumulators (8 ymm: 8 chains of two dependent FMAs a
// round, as many as the FMA latency times its two pipes needs) stay in registers.
#include "torch_ext.h"
#include <omp.h>
#include "bf16.h"

namespace {

#if defined(__AVX512F__)
constexpr int CHAINS = 16;
#else
constexpr int CHAINS = 4;
#endif

__attribute__((noinline)) float chains(int64_t iters, const uint16_t* seed) {
  using namespace specctl;
  f32x16 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = zero16();
  for (int64_t it = 0; it < iters; ++it) {
    asm volatile("" : "+r"(seed));  // the operands are loaded again (two loads a round, from L1): not folded
    const bf16x32 a = load_bf16x32(seed), b = load_bf16x32(seed + 32);
#pragma GCC unroll 16
    for (int i = 0; i < CHAINS; ++i) acc[i] = dot_bf16(acc[i], a, b);
  }
  f32x16 s = acc[0];
  for (int i = 1; i < CHAINS; ++i) s = add(s, acc[i]);
  return reduce_add(s);
}

}  // namespace

// GFLOP/s over all threads (a dot product of 32 bf16 pairs into 16 lanes: 64 FLOP), each thread running
// ``iters`` rounds of CHAINS independent dot products.
double dot_peak(int64_t iters) {
  uint16_t seed[64];
  for (int i = 0; i < 64; ++i) seed[i] = 0x3f80;  // 1.0
  double t0 = 0, t1 = 0;
  int threads = 1;
  volatile float sink = 0;
#pragma omp parallel
  {
#pragma omp single
    threads = omp_get_num_threads();
#pragma omp barrier
#pragma omp master
    t0 = omp_get_wtime();
    const float r = chains(iters, seed);
#pragma omp barrier
#pragma omp master
    t1 = omp_get_wtime();
#pragma omp critical
    sink = sink + r;
  }
  return threads * static_cast<double>(iters) * CHAINS * 64 / (t1 - t0) / 1e9;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("dot_peak", &dot_peak, "bf16 dot-product GFLOP/s of all threads"); }
