// One whole transformer block (Llama / Qwen2 / Mistral) for decode and verification forwards, bf16.
//
//   x [M, H] (M = batch x rows <= 64; a draft tree's rows with `tree`) -> x + attn(norm1(x)) -> h + mlp(norm2(h)), writing the new
//   keys and values into the caches at [start, start + T). With `emb` (EAGLE-3's draft layer) the
//   attention reads cat(emb_norm(emb), norm1(x)) [M, 2H] instead of norm1(x); x stays the residual.
//
// Why: at batch 1 a decode step of a small model is mostly overhead. A block is ~25 torch ops and
// 5 kernel launches, each a Python dispatch and (for the parallel ones) a wake-up of the thread
// pool; for SmolLM2-135M that overhead was larger than reading the weights. Here a block is one
// call and one parallel region: its phases (norm, qkv projection, rotary + cache write, attention,
// output projection + residual, norm, gate|up projection, SiLU x up, down projection + residual)
// are separated by a spinning barrier instead of fork/join. Every phase computes a row the same way
// whatever M is (AMX tiles per row, per-row attention, per-row norms), so verification rows equal
// decode rows bit for bit, as in amx_gemm.h and decode_attention.h.
#include <torch/extension.h>
#include <omp.h>
#include <atomic>
#include <thread>
#include "amx_gemm.h"
#include "tree_rows.h"

namespace {

using specctl::from_bf16;
using specctl::load_bf16x16;
using specctl::to_bf16;

// A sense-reversing barrier for the threads of one parallel region: they are all running, so a
// short spin is cheaper than a futex sleep and wake per phase; past that it yields the core.
struct SpinBarrier {
  alignas(64) std::atomic<int> count{0};
  alignas(64) std::atomic<int> sense{0};
  void wait(int nt, int& local_sense) {
    local_sense ^= 1;
    if (count.fetch_add(1, std::memory_order_acq_rel) == nt - 1) {
      count.store(0, std::memory_order_relaxed);
      sense.store(local_sense, std::memory_order_release);
    } else {
      // spin briefly, then yield: on a shared machine the other thread may have lost its core
      for (int spins = 0; sense.load(std::memory_order_acquire) != local_sense; ++spins) {
        if (spins < 1000) _mm_pause();
        else std::this_thread::yield();
      }
    }
  }
};

// y = w * bf16(x * rsqrt(mean(x^2) + eps)) in bf16, as specctl.runtime.model.RMSNorm; one row.
inline void rmsnorm_row(const uint16_t* x, const uint16_t* w, float eps, int64_t H, uint16_t* y) {
  __m512 ss = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m512 v = load_bf16x16(x + i);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  float sum = _mm512_reduce_add_ps(ss);
  for (; i < H; ++i) sum += from_bf16(x[i]) * from_bf16(x[i]);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (i = 0; i + 16 <= H; i += 16) {
    const __m256bh n = _mm512_cvtneps_pbh(_mm512_mul_ps(load_bf16x16(x + i), rv));
    const __m512 o = _mm512_mul_ps(load_bf16x16(w + i), load_bf16x16(reinterpret_cast<const uint16_t*>(&n)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), (__m256i)_mm512_cvtneps_pbh(o));
  }
  for (; i < H; ++i) y[i] = to_bf16(from_bf16(w[i]) * from_bf16(to_bf16(from_bf16(x[i]) * r)));
}

// v' = v cos + rotate_half(v) sin over one head (hd values), in fp32 with one rounding.
inline void rope_head(const uint16_t* v, const uint16_t* cos, const uint16_t* sin, int hd, uint16_t* out) {
  const int half = hd / 2;
  for (int d = 0; d < hd; ++d) {
    const float rot = d < half ? -from_bf16(v[d + half]) : from_bf16(v[d - half]);
    out[d] = to_bf16(from_bf16(v[d]) * from_bf16(cos[d]) + rot * from_bf16(sin[d]));
  }
}

// Output groups handed out in chunks from a shared counter: on a busy machine a thread that lost
// its core leaves its share to the others instead of holding everyone at the next barrier. (Who
// computes a group changes nothing in its result.)
inline void gemm_dynamic(std::atomic<int64_t>& next, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                         int64_t NB, const uint16_t* b, uint16_t* y, const uint16_t* r, int64_t ldy, int& configured) {
  const int64_t total = specctl::amx::num_groups(NB), chunk = 2;
  for (int64_t g0 = next.fetch_add(chunk); g0 < total; g0 = next.fetch_add(chunk))
    specctl::amx::groups(x, M, K, w, NB, b, y, r, ldy, g0, std::min(total, g0 + chunk), configured);
}

inline void share(int64_t n, int tid, int nt, int64_t& a, int64_t& b) {
  a = n * tid / nt;
  b = n * (tid + 1) / nt;
}

}  // namespace

torch::Tensor decode_layer(torch::Tensor x, torch::Tensor in_norm, torch::Tensor post_norm, double eps,
                           torch::Tensor qkv_w, c10::optional<torch::Tensor> qkv_b, torch::Tensor o_w,
                           c10::optional<torch::Tensor> o_b, torch::Tensor gate_up_w, torch::Tensor down_w,
                           torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
                           int64_t start, int64_t num_heads, int64_t num_kv_heads, c10::optional<torch::Tensor> tree,
                           c10::optional<torch::Tensor> emb, c10::optional<torch::Tensor> emb_norm) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.is_contiguous(), "x [B, T, H] bf16 contiguous");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T;
  TORCH_CHECK(M <= 64, "at most 64 rows");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == B, "caches [B, nkv, S, hd]");
  const int64_t S = k_cache.size(2), hd = k_cache.size(3), nh = num_heads, nkv = num_kv_heads;
  const int64_t Nqkv = (nh + 2 * nkv) * hd, I2 = gate_up_w.size(0) * 16, I = I2 / 2;
  // EAGLE-3's draft layer: the attention reads cat(emb_norm(emb), in_norm(x)) [M, 2H]; x stays the residual
  const bool eagle3 = emb.has_value() && emb->defined();
  const int64_t Hin = eagle3 ? 2 * H : H;
  if (eagle3)
    TORCH_CHECK(emb->scalar_type() == at::kBFloat16 && emb->is_contiguous() && emb->numel() == M * H &&
                emb_norm.has_value() && emb_norm->defined(), "emb [B, T, H] bf16 contiguous, with emb_norm");
  TORCH_CHECK(qkv_w.size(0) * 16 == Nqkv && qkv_w.size(1) * 32 == Hin, "qkv weight shape");
  TORCH_CHECK(o_w.size(0) * 16 == H && o_w.size(1) * 32 == nh * hd, "o weight shape");
  TORCH_CHECK(down_w.size(0) * 16 == H && down_w.size(1) * 32 == I, "down weight shape");
  TORCH_CHECK(start + T <= S && hd % 32 == 0 && nh % nkv == 0, "cache length / head dim / heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T && cos.size(1) == hd, "cos/sin [T, hd]");
  auto opt = x.options();
  auto xn = torch::empty({M, Hin}, opt), qkv = torch::empty({M, Nqkv}, opt), att = torch::empty({M, nh * hd}, opt);
  auto h = torch::empty({M, H}, opt), gu = torch::empty({M, I2}, opt), act = torch::empty({M, I}, opt);
  auto out = torch::empty({B, T, H}, opt);
  using u16 = uint16_t;
  auto P = [](const torch::Tensor& t) { return reinterpret_cast<u16*>(t.data_ptr()); };
  auto PO = [](const c10::optional<torch::Tensor>& t) -> const u16* {
    return t.has_value() && t->defined() ? reinterpret_cast<const u16*>(t->data_ptr()) : nullptr;
  };
  const u16 *xp = P(x), *n1 = P(in_norm), *n2 = P(post_norm), *wq = P(qkv_w), *bq = PO(qkv_b), *wo = P(o_w),
            *bo = PO(o_b), *wgu = P(gate_up_w), *wd = P(down_w), *cp = P(cos), *sp = P(sin);
  const u16 *ep = eagle3 ? P(*emb) : nullptr, *ne = eagle3 ? P(*emb_norm) : nullptr;
  u16 *xnp = P(xn), *qp = P(qkv), *ap = P(att), *hp = P(h), *gup = P(gu), *actp = P(act), *op = P(out);
  u16 *kc = P(k_cache), *vc = P(v_cache);
  const int G = static_cast<int>(nh / nkv);
  // tree [T, W] bool: the rows are a draft tree (row i sees the prefix, its ancestors and itself)
  std::vector<int32_t> anc;
  std::vector<int64_t> cnt;
  const int64_t W = specctl::attn::read_tree(tree, T, start, anc, cnt), P0 = start + T - W;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float feps = static_cast<float>(eps);
  SpinBarrier bar;
  std::atomic<int64_t> next_qkv{0}, next_att{0}, next_o{0}, next_gu{0}, next_down{0};
  const int want = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(want)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    int sense = 0, configured = -1;
    int64_t a, b;
    std::vector<float> scores;
    // 1. norm (EAGLE-3: [normed emb | normed x])
    for (int64_t m = tid; m < M; m += nt) {
      if (eagle3) rmsnorm_row(ep + m * H, ne, feps, H, xnp + m * Hin);
      rmsnorm_row(xp + m * H, n1, feps, H, xnp + m * Hin + Hin - H);
    }
    bar.wait(nt, sense);
    // 2. q|k|v
    gemm_dynamic(next_qkv, xnp, M, Hin, wq, Nqkv / 16, bq, qp, nullptr, Nqkv, configured);
    bar.wait(nt, sense);
    // 3. rotary on q (in place, via a copy of the head) and k; k and v into the caches
    const int64_t heads = nh + 2 * nkv;
    for (int64_t it = tid; it < M * heads; it += nt) {
      const int64_t m = it / heads, hh = it % heads, bi = m / T, i = m % T;
      u16* src = qp + m * Nqkv + hh * hd;
      const u16 *c = cp + i * hd, *s = sp + i * hd;
      u16 tmp[256];
      if (hh < nh) {
        rope_head(src, c, s, static_cast<int>(hd), tmp);
        std::memcpy(src, tmp, hd * 2);
      } else if (hh < nh + nkv) {
        rope_head(src, c, s, static_cast<int>(hd), kc + ((bi * nkv + (hh - nh)) * S + start + i) * hd);
      } else {
        std::memcpy(vc + ((bi * nkv + (hh - nh - nkv)) * S + start + i) * hd, src, hd * 2);
      }
    }
    bar.wait(nt, sense);
    // 4. attention: items of G heads sharing a kv head, or single heads when that balances better
    const bool per_head = B * nkv * T < 2 * nt;
    const int64_t items = per_head ? M * nh : B * nkv * T;
    for (int64_t it = next_att.fetch_add(1); it < items; it = next_att.fetch_add(1)) {
      int64_t m, head0;
      int g;
      if (per_head) { m = it / nh; head0 = it % nh; g = 1; }
      else { m = it / nkv; head0 = (it % nkv) * G; g = G; }
      const int64_t bi = m / T, i = m % T, kvh = head0 / G;
      const int64_t cache_off = (bi * nkv + kvh) * S * hd;
      if (W)
        specctl::attn::item(qp + m * Nqkv + head0 * hd, hd, kc + cache_off, vc + cache_off, P0 + cnt[i],
                            static_cast<int>(hd), g, scale, ap + m * nh * hd + head0 * hd, scores,
                            specctl::attn::TreeRows{P0, anc.data() + i * W});
      else
        specctl::attn::item(qp + m * Nqkv + head0 * hd, hd, kc + cache_off, vc + cache_off, start + i + 1,
                            static_cast<int>(hd), g, scale, ap + m * nh * hd + head0 * hd, scores);
    }
    bar.wait(nt, sense);
    // 5. output projection + residual
    gemm_dynamic(next_o, ap, M, nh * hd, wo, H / 16, bo, hp, xp, H, configured);
    bar.wait(nt, sense);
    // 6. norm
    for (int64_t m = tid; m < M; m += nt) rmsnorm_row(hp + m * H, n2, feps, H, xnp + m * H);
    bar.wait(nt, sense);
    // 7. gate|up
    gemm_dynamic(next_gu, xnp, M, H, wgu, I2 / 16, nullptr, gup, nullptr, I2, configured);
    bar.wait(nt, sense);
    // 8. SiLU(gate) x up, rounded as torch: bf16(bf16(silu(g)) * u)
    share(M * (I / 16), tid, nt, a, b);
    for (int64_t c = a; c < b; ++c) {
      const int64_t m = c / (I / 16), j = (c % (I / 16)) * 16;
      const __m512 g = load_bf16x16(gup + m * I2 + j), u = load_bf16x16(gup + m * I2 + I + j);
      const __m512 sg = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                      specctl::attn::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      const __m256bh sgb = _mm512_cvtneps_pbh(sg);
      const __m512 prod = _mm512_mul_ps(load_bf16x16(reinterpret_cast<const u16*>(&sgb)), u);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(actp + m * I + j), (__m256i)_mm512_cvtneps_pbh(prod));
    }
    bar.wait(nt, sense);
    // 9. down projection + residual
    gemm_dynamic(next_down, actp, M, I, wd, H / 16, nullptr, op, hp, H, configured);
    _tile_release();
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layer", &decode_layer, "one transformer block for decode/verify rows (bf16, AMX)",
        py::arg("x"), py::arg("in_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv_w"), py::arg("qkv_b"),
        py::arg("o_w"), py::arg("o_b"), py::arg("gate_up_w"), py::arg("down_w"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("tree") = py::none(), py::arg("emb") = py::none(), py::arg("emb_norm") = py::none());
}
