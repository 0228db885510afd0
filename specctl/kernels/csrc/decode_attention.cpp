// Python entry point of the row-independent decode/verify attention (see decode_attention.h).
#include "torch_ext.h"
#include "tree_rows.h"

using namespace specctl::attn;

at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, int64_t start,
                               double scale, c10::optional<at::Tensor> tree) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, "q [B, nh, T, hd], caches [B, nkv, S, hd]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t B = q.size(0), nh = q.size(1), T = q.size(2), hd = q.size(3);
  const int64_t nkv = k_cache.size(1), S = k_cache.size(2);
  TORCH_CHECK(nh % nkv == 0 && nh / nkv <= MAX_G, "query heads per kv head: at most 16");
  TORCH_CHECK(hd % 32 == 0 && hd <= MAX_HD && k_cache.size(3) == hd, "head dim: a multiple of 32, at most 256");
  TORCH_CHECK(start + T <= S, "cache too short");
  const int G = static_cast<int>(nh / nkv);
  // tree [T, W] bool: the rows are a draft tree (row i sees the prefix, its ancestors and itself)
  std::vector<int32_t> anc;
  std::vector<int64_t> cnt;
  const int64_t W = specctl::attn::read_tree(tree, T, start, anc, cnt), P = start + T - W;
  // the query rows of one (b, kv head, row) item must sit hd apart... or any fixed stride: use strides
  auto qc = q.transpose(1, 2).contiguous();  // [B, T, nh, hd]: one item's G heads are contiguous
  auto out = at::empty({B, T, nh * hd}, q.options());
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  // items: (batch row, kv head, a run of rows): a chain's rows share one read of the keys and values
  const int64_t per = W ? 1 : std::max<int64_t>(1, MAX_Q / G), runs = (T + per - 1) / per;
  const int64_t items = B * nkv * runs;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> s;
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t b = it / (nkv * runs), kvh = (it / runs) % nkv, i = (it % runs) * per;
      const int64_t rows = std::min(per, T - i);
      const int64_t cache_off = (b * nkv + kvh) * S * hd;
      const int64_t row_off = ((b * T + i) * nh + kvh * G) * hd;
      if (W)
        item(qp + row_off, hd, kp + cache_off, vp + cache_off, P + cnt[i], static_cast<int>(hd), G,
             static_cast<float>(scale), op + row_off, s, TreeRows{P, anc.data() + i * W});
      else
        item(qp + row_off, hd, kp + cache_off, vp + cache_off, start + i + 1, static_cast<int>(hd), G,
             static_cast<float>(scale), op + row_off, s, Contiguous(), static_cast<int>(rows), nh * hd, nh * hd);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "row-independent bf16 attention over a KV cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("scale"),
        py::arg("tree") = py::none());
}
