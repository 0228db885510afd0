// A memory read-bandwidth probe for benchmarks/decode_bandwidth.py: the fastest plain read of a
// buffer this machine does (all threads, 4 streams per thread, software prefetch, 64-byte loads: one zmm on
// AVX-512, two ymm on AVX2, vec16.h). Decode is judged against this figure, so it must not be a weak reader
// (torch's sum reads slower).
#include "torch_ext.h"
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include "vec16.h"

double stream_read(at::Tensor buf) {
  TORCH_CHECK(buf.is_contiguous() && buf.scalar_type() == at::kByte, "a contiguous uint8 buffer");
  const char* p = reinterpret_cast<const char*>(buf.data_ptr());
  const int64_t n = buf.numel() / 1024 * 1024;
  double total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t chunk = n / nt / 256 * 256, sub = chunk / 4;
    const char* b = p + tid * chunk;
    using namespace specctl;
    f32x16 a[4] = {zero16(), zero16(), zero16(), zero16()};
    for (int64_t i = 0; i < sub; i += 128) {
      for (int s = 0; s < 4; ++s) {
        const char* q = b + s * sub + i;
        _mm_prefetch(q + 1024, _MM_HINT_T0);
        _mm_prefetch(q + 1088, _MM_HINT_T0);
        a[s] = add(a[s], loadu(reinterpret_cast<const float*>(q)));
        a[s] = add(a[s], loadu(reinterpret_cast<const float*>(q + 64)));
      }
    }
    total += reduce_add(add(add(a[0], a[1]), add(a[2], a[3])));
  }
  return total;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("stream_read", &stream_read, "read a buffer as fast as possible"); }
