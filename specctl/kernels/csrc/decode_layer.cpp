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
//
// Two builds: AMX (weights packed in tiles, amx_gemm.h) and, with SPECCTL_SKINNY, CPUs without AMX (an AMD
// EPYC with AVX512-BF16; AVX-512 or AVX2 alone through bf16.h / vec16.h's FMA form, bit for bit the same:
// row-major weights through skinny_gemm.h, the skinny linear's own core). On such a
// CPU the per-op path pays a thread-pool wake-up per linear, 4-5 per block (under OMP_WAIT_POLICY=PASSIVE
// in a VM: a 1.5B decode step took 110-143 ms per-op, 77-84 ms fused).
//
// A third build, SPECCTL_QUANT, takes GGUF quantized weights as stored (the int8 AVX512-VNNI core of
// gguf_q8.h, the one quant_linear.cpp runs): each projection's x is rounded to int8 by every thread for
// itself (a few microseconds; no extra barrier), then the weight rows are shared out as above. A
// projection's outputs equal quant_linear's bit for bit; the block spares the per-op path's ~100 torch ops
// and 4 thread-pool wake-ups per block.
#include "torch_ext.h"
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>
#if defined(SPECCTL_QUANT)
#include "bf16.h"
#include "gguf_q8.h"
#elif defined(SPECCTL_SKINNY)
#include "skinny_gemm.h"
#else
#include "amx_gemm.h"
#endif
#include "tree_rows.h"

namespace {

using specctl::from_bf16;
using specctl::load_bf16x16;
using specctl::cvt_bf16x16;
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

// y = w * bf16(x * rsqrt(mean(x^2) + eps)) in bf16, as specctl.modeling.RMSNorm; one row.
inline void rmsnorm_row(const uint16_t* x, const uint16_t* w, float eps, int64_t H, uint16_t* y) {
  using namespace specctl;
  f32x16 ss = zero16();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const f32x16 v = load_bf16x16(x + i);
    ss = fmadd(v, v, ss);
  }
  float sum = reduce_add(ss);
  for (; i < H; ++i) sum += from_bf16(x[i]) * from_bf16(x[i]);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  const f32x16 rv = set16(r);
  for (i = 0; i + 16 <= H; i += 16) {
    const __m256i n = cvt_bf16x16(mul(load_bf16x16(x + i), rv));
    const f32x16 o = mul(load_bf16x16(w + i), load_bf16x16(reinterpret_cast<const uint16_t*>(&n)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), cvt_bf16x16(o));
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

// Each thread streams its own contiguous share of a projection's weights front to back, a fetch at a
// time, and a thread done with its share helps the others from the front of what they have left: on a
// busy machine a thread that lost its core leaves its share to the others instead of holding everyone at
// the next barrier (who computes an output changes nothing in its result). One long stream a thread
// reads faster than chunks taken in turn by all (the threads' streams interleave), and the prefetch runs
// on to the end of the share. Items: weight rows (the skinny and quantized builds; shares in whole
// panels of 16) or AMX groups of G blocks of 16 outputs.
struct Rows {
#if defined(SPECCTL_SKINNY) || defined(SPECCTL_QUANT)
  static int64_t items(int64_t n) { return n; }
  static constexpr int64_t ALIGN = 16;
#else
  static int64_t items(int64_t n) { return specctl::amx::num_groups(n / 16); }
  static constexpr int64_t ALIGN = 1;
#endif
  int64_t N;
  std::vector<std::atomic<int64_t>> front;  // share t: items [edge(t), edge(t + 1)), the next one at front[t]
  Rows(int64_t n, int shares) : N(items(n)), front(shares) {
    for (int t = 0; t < shares; ++t) front[t].store(edge(t), std::memory_order_relaxed);
  }
  int64_t edge(int t) const {
    const int64_t nt = static_cast<int64_t>(front.size());
    return t >= nt ? N : N * t / nt / ALIGN * ALIGN;
  }
  // f(i0, i1, end) over fetches of `chunk` items (a multiple of ALIGN): this thread's share first, then
  // the others' (end: the end of the share the fetch is from)
  template <class F>
  void each(int64_t chunk, F f) {
    const int shares = static_cast<int>(front.size());
    for (int i = 0; i < shares; ++i) {
      const int t = (omp_get_thread_num() + i) % shares;
      const int64_t end = edge(t + 1);
      for (int64_t i0 = front[t].fetch_add(chunk); i0 < end; i0 = front[t].fetch_add(chunk))
        f(i0, std::min(end, i0 + chunk), end);
    }
  }
};
#if defined(SPECCTL_QUANT)
namespace gg = specctl::gguf;
struct Lin {  // a projection as GGUF blocks: its parts side by side (q|k|v of different types)
  std::vector<gg::Part> parts;
  int need = 0;  // the x layouts its types read
};
struct Ctx { gg::q8::X x; };  // per thread: the projection's x as int8
inline void gemm_dynamic(Rows& rows, const uint16_t* x, int64_t M, int64_t K, const Lin& w,
                         int64_t N, const uint16_t* b, uint16_t* y, const uint16_t* r, int64_t ldy, Ctx& ctx) {
  gg::q8::quantize(x, true, M, K, w.need, ctx.x, [](int64_t n, auto f) { f(0, n); });
  // a quarter of a thread's share a fetch, whole panels (fetches of 32 rows made a 1.5B Q4_K_M step 4 %
  // slower on an AMX Xeon: each fetch pays amx8::range's set-up)
  const int64_t chunk = (std::max<int64_t>(16, N / (4 * omp_get_num_threads())) + 15) / 16 * 16;
  auto put = [&](int64_t m, int64_t g, float v) {
    if (b) v += from_bf16(b[g]);  // as quant_linear's output, then (x + linear(x)) as torch rounds it
    const uint16_t o = to_bf16(v);
    y[m * ldy + g] = r ? to_bf16(from_bf16(r[m * ldy + g]) + from_bf16(o)) : o;
  };
  rows.each(chunk, [&](int64_t n0, int64_t n1, int64_t) {
#if defined(__AMX_INT8__)
    if (w.parts[0].packed) { gg::amx8::range(ctx.x, K, w.parts, n0, n1, put); return; }
#endif
    gg::q8::range(ctx.x, K, w.parts, n0, n1, put);
  });
}
inline void tiles_done() {}
#else
using Lin = const uint16_t*;
struct Ctx { int configured = -1; };
#ifdef SPECCTL_SKINNY
inline void gemm_dynamic(Rows& rows, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                         int64_t N, const uint16_t* b, uint16_t* y, const uint16_t* r, int64_t ldy, Ctx&) {
  int64_t chunk = 32;  // weight rows a fetch (8 groups of 4; 96 KiB at K = 1536)
#if !defined(__AVX512F__)
  // the GEMM (gemm_avx2.h) packs x for each fetch and takes its weight rows in panels of 24: fetches of 192
  if (M >= specctl::skinny::GEMM_M) chunk = 192;
#endif
  rows.each(chunk, [&](int64_t n0, int64_t n1, int64_t end) {
    specctl::skinny::rows(x, M, K, w, b, y, r, ldy, n0, n1, end);
  });
}
inline void tiles_done() {}
#else
inline void gemm_dynamic(Rows& rows, const uint16_t* x, int64_t M, int64_t K, const uint16_t* w,
                         int64_t N, const uint16_t* b, uint16_t* y, const uint16_t* r, int64_t ldy, Ctx& ctx) {
  rows.each(2, [&](int64_t g0, int64_t g1, int64_t end) {  // 2 groups a fetch
    specctl::amx::groups(x, M, K, w, N / 16, b, y, r, ldy, g0, g1, ctx.configured, end);
  });
}
inline void tiles_done() { _tile_release(); }
#endif

#endif

inline void share(int64_t n, int tid, int nt, int64_t& a, int64_t& b) {
  a = n * tid / nt;
  b = n * (tid + 1) / nt;
}
// One request's rows in a (ragged) call: its caches, where its rows go, and its draft tree.
struct Seg {
  uint16_t* kc;
  uint16_t* vc;  // [nkv, S, hd] of this request
  int64_t S, start, T, crow;  // cache length, first slot, rows, first row of cos/sin
  int64_t W, P0;  // tree mask width (0: a chain) and the prefix it sees
  std::vector<int32_t> anc;
  std::vector<int64_t> cnt;
  float* w = nullptr;  // [2, nkv, S]: the attention weights of the first and last row (a chain's), or none
};

struct AttItem {
  int32_t seg, i0, rows, head0, g;  // rows i0 .. i0 + rows - 1 of segment seg, heads head0 .. head0 + g - 1
};

struct Weights {
  const uint16_t *n1, *n2;
  Lin wq;
  const uint16_t* bq;
  Lin wo;
  const uint16_t* bo;
  Lin wgu, wd;
  const uint16_t* ne;
  float eps;
  int64_t H, Hin, Nqkv, I, I2, nh, nkv, hd;
};

// The block over M rows (x, emb: [M, H]; cos/sin: [rows, hd]) of the segments, in one parallel
// region; rows are the segments' rows in order.
void run_block(const Weights& w, std::vector<Seg>& segs, const uint16_t* xp, const uint16_t* ep, const uint16_t* cp,
               const uint16_t* sp, int64_t M, uint16_t* op, const at::TensorOptions& opt) {
  const int64_t H = w.H, Hin = w.Hin, Nqkv = w.Nqkv, I = w.I, I2 = w.I2, nh = w.nh, nkv = w.nkv, hd = w.hd;
  const bool eagle3 = ep != nullptr;
  auto xn = at::empty({M, Hin}, opt), qkv = at::empty({M, Nqkv}, opt), att = at::empty({M, nh * hd}, opt);
  auto h = at::empty({M, H}, opt), gu = at::empty({M, I2}, opt), act = at::empty({M, I}, opt);
  using u16 = uint16_t;
  auto P = [](const at::Tensor& t) { return reinterpret_cast<u16*>(t.data_ptr()); };
  u16 *xnp = P(xn), *qp = P(qkv), *ap = P(att), *hp = P(h), *gup = P(gu), *actp = P(act);
  std::vector<int32_t> seg_of(M), row_of(M);
  for (int64_t s = 0, m = 0; s < static_cast<int64_t>(segs.size()); ++s)
    for (int64_t i = 0; i < segs[s].T; ++i, ++m) { seg_of[m] = static_cast<int32_t>(s); row_of[m] = static_cast<int32_t>(i); }
  const int G = static_cast<int>(nh / nkv);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int want = std::max(1, at::get_num_threads());
  // attention work items: a chain's rows together (keys and values read once for all of them) for the
  // G heads of a kv head; or single heads, when that balances the threads better and the keys are
  // short enough that the G heads of a kv head re-read them from cache; a draft tree's rows one by one
  std::vector<int64_t> first_row(segs.size() + 1, 0);
  int64_t longest = 0;
  for (size_t s = 0; s < segs.size(); ++s) {
    first_row[s + 1] = first_row[s] + segs[s].T;
    longest = std::max(longest, segs[s].start + segs[s].T);
  }
  std::vector<AttItem> att_items;
  auto list_items = [&](int g) {
    att_items.clear();
    const int64_t per = std::max(1, specctl::attn::MAX_Q / g);
    for (size_t s = 0; s < segs.size(); ++s) {
      const int64_t T = segs[s].T, step = segs[s].W ? 1 : per;
      for (int64_t i0 = 0; i0 < T; i0 += step)
        for (int64_t h0 = 0; h0 < nh; h0 += g)
          att_items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(i0),
                               static_cast<int32_t>(std::min(step, T - i0)), static_cast<int32_t>(h0), g});
    }
  };
  list_items(G);
  const int64_t grouped = static_cast<int64_t>(att_items.size());
  const bool short_keys = longest * hd * 4 <= (512 << 10);  // a kv head's keys and values fit in L2
  bool weights_out = false;  // the attention weights are written per kv head: grouped items only
  for (const Seg& sg : segs) weights_out = weights_out || sg.w != nullptr;
  if (!weights_out && (grouped < want || (grouped < 2 * want && short_keys))) list_items(1);
  SpinBarrier bar;
  std::atomic<int64_t> next_att{0};
  Rows next_qkv(Nqkv, want), next_o(H, want), next_gu(I2, want), next_down(H, want);
#pragma omp parallel num_threads(want)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    int sense = 0;
    Ctx ctx;
    int64_t a, b;
    std::vector<float> scores;
    // 1. norm (EAGLE-3: [normed emb | normed x])
    for (int64_t m = tid; m < M; m += nt) {
      if (eagle3) rmsnorm_row(ep + m * H, w.ne, w.eps, H, xnp + m * Hin);
      rmsnorm_row(xp + m * H, w.n1, w.eps, H, xnp + m * Hin + Hin - H);
    }
    bar.wait(nt, sense);
    // 2. q|k|v
    gemm_dynamic(next_qkv, xnp, M, Hin, w.wq, Nqkv, w.bq, qp, nullptr, Nqkv, ctx);
    bar.wait(nt, sense);
    // 3. rotary on q (in place, via a copy of the head) and k; k and v into each request's caches
    const int64_t heads = nh + 2 * nkv;
    for (int64_t it = tid; it < M * heads; it += nt) {
      const int64_t m = it / heads, hh = it % heads, i = row_of[m];
      const Seg& sg = segs[seg_of[m]];
      u16* src = qp + m * Nqkv + hh * hd;
      const u16 *c = cp + (sg.crow + i) * hd, *s = sp + (sg.crow + i) * hd;
      u16 tmp[256];
      if (hh < nh) {
        rope_head(src, c, s, static_cast<int>(hd), tmp);
        std::memcpy(src, tmp, hd * 2);
      } else if (hh < nh + nkv) {
        rope_head(src, c, s, static_cast<int>(hd), sg.kc + ((hh - nh) * sg.S + sg.start + i) * hd);
      } else {
        std::memcpy(sg.vc + ((hh - nh - nkv) * sg.S + sg.start + i) * hd, src, hd * 2);
      }
    }
    bar.wait(nt, sense);
    // 4. attention (the items are listed before the region)
    for (int64_t it = next_att.fetch_add(1); it < static_cast<int64_t>(att_items.size()); it = next_att.fetch_add(1)) {
      const AttItem& a = att_items[it];
      const Seg& sg = segs[a.seg];
      const int64_t m = first_row[a.seg] + a.i0, cache_off = (a.head0 / G) * sg.S * hd;
      const u16* q0 = qp + m * Nqkv + a.head0 * hd;
      u16* o0 = ap + m * nh * hd + a.head0 * hd;
      if (sg.W)
        specctl::attn::item(q0, hd, sg.kc + cache_off, sg.vc + cache_off, sg.P0 + sg.cnt[a.i0], static_cast<int>(hd),
                            a.g, scale, o0, scores, specctl::attn::TreeRows{sg.P0, sg.anc.data() + a.i0 * sg.W});
      else {
        float *wf = nullptr, *wl = nullptr;
        int i_first = -1, i_last = -1;
        if (sg.w != nullptr) {
          const int64_t kvh = a.head0 / G, last = sg.T - 1 - a.i0;
          if (a.i0 == 0) { i_first = 0; wf = sg.w + kvh * sg.S; }
          if (last < a.rows) { i_last = static_cast<int>(last); wl = sg.w + (nkv + kvh) * sg.S; }
        }
        specctl::attn::item(q0, hd, sg.kc + cache_off, sg.vc + cache_off, sg.start + a.i0 + 1, static_cast<int>(hd),
                            a.g, scale, o0, scores, specctl::attn::Contiguous(), a.rows, Nqkv, nh * hd, wf, i_first,
                            wl, i_last);
      }
    }
    bar.wait(nt, sense);
    // 5. output projection + residual
    gemm_dynamic(next_o, ap, M, nh * hd, w.wo, H, w.bo, hp, xp, H, ctx);
    bar.wait(nt, sense);
    // 6. norm
    for (int64_t m = tid; m < M; m += nt) rmsnorm_row(hp + m * H, w.n2, w.eps, H, xnp + m * H);
    bar.wait(nt, sense);
    // 7. gate|up
    gemm_dynamic(next_gu, xnp, M, H, w.wgu, I2, nullptr, gup, nullptr, I2, ctx);
    bar.wait(nt, sense);
    // 8. SiLU(gate) x up, rounded as torch: bf16(bf16(silu(g)) * u)
    share(M * (I / 16), tid, nt, a, b);
    for (int64_t c = a; c < b; ++c) {
      const int64_t m = c / (I / 16), j = (c % (I / 16)) * 16;
      using namespace specctl;
      const f32x16 g = load_bf16x16(gup + m * I2 + j), u = load_bf16x16(gup + m * I2 + I + j);
      const f32x16 sg = div(g, add(set16(1.0f), attn::exp16(sub(zero16(), g))));
      const __m256i sgb = cvt_bf16x16(sg);
      const f32x16 prod = mul(load_bf16x16(reinterpret_cast<const u16*>(&sgb)), u);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(actp + m * I + j), cvt_bf16x16(prod));
    }
    bar.wait(nt, sense);
    // 9. down projection + residual
    gemm_dynamic(next_down, actp, M, I, w.wd, H, nullptr, op, hp, H, ctx);
    tiles_done();
  }
}

const uint16_t* ptr_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? reinterpret_cast<const uint16_t*>(t->data_ptr()) : nullptr;
}

#if defined(SPECCTL_QUANT)
// A projection's parts as Python gives them: (blocks [N_p, row_bytes] uint8 per part, ggml type ids).
using WArg = std::tuple<std::vector<at::Tensor>, std::vector<int64_t>>;

Lin lin_of(const WArg& a, int64_t K, int64_t N, const char* what) {
  const auto& [ws, types] = a;
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), what, ": one ggml type per part");
  Lin l;
  int64_t n = 0;
  for (size_t i = 0; i < ws.size(); ++i) {
#if defined(__AMX_INT8__)
    if (types[i] >= gg::amx8::PACKED) {  // AMX-INT8 panels (specctl/kernels/quant_linear.py pack)
      TORCH_CHECK(i == 0 || l.parts[0].packed, what, ": parts are all packed or none");
      l.parts.push_back(gg::amx8::packed_part(ws[i], types[i], K, what));
      l.need |= gg::amx8::need_of(l.parts.back().type);
      n += l.parts.back().n;
      continue;
    }
#endif
    const int t = static_cast<int>(types[i]), by = gg::bytes_of(t), qk = gg::qk_of(t);
    TORCH_CHECK(by > 0 && K % qk == 0, what, ": unsupported ggml type ", t, " for ", K, " inputs");
    TORCH_CHECK(ws[i].scalar_type() == at::kByte && ws[i].dim() == 2 && ws[i].is_contiguous() &&
                ws[i].size(1) == K / qk * by, what, ": parts are contiguous uint8 [N, row_bytes]");
    l.parts.push_back({ws[i].data_ptr<uint8_t>(), t, ws[i].size(0), ws[i].size(1)});
    l.need |= 1 << gg::q8::layout_of(t);
    n += ws[i].size(0);
  }
  TORCH_CHECK(N < 0 || n == N, what, ": ", n, " output rows, expected ", N);
  return l;
}

Weights weights(const at::Tensor& in_norm, const at::Tensor& post_norm, double eps, const WArg& qkv_w,
                const c10::optional<at::Tensor>& qkv_b, const WArg& o_w,
                const c10::optional<at::Tensor>& o_b, const WArg& gate_up_w, const WArg& down_w,
                int64_t H, int64_t hd, int64_t nh, int64_t nkv, bool eagle3,
                const c10::optional<at::Tensor>& emb_norm) {
  TORCH_CHECK(!eagle3, "the quantized block has no EAGLE-3 input");
  auto P = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  const int64_t Nqkv = (nh + 2 * nkv) * hd;
  Lin gu = lin_of(gate_up_w, H, -1, "gate_up");
  int64_t I2 = 0;
  for (const auto& p : gu.parts) I2 += p.n;
  TORCH_CHECK(I2 % 32 == 0, "gate_up rows: 2 x a multiple of 16");
  for (const auto* b : {&qkv_b, &o_b})
    TORCH_CHECK(!b->has_value() || !(*b)->defined() || ((*b)->scalar_type() == at::kBFloat16 && (*b)->is_contiguous()),
                "biases contiguous bf16");
  TORCH_CHECK(hd % 32 == 0 && hd <= 256 && nh % nkv == 0, "head dim / heads");
  return Weights{P(in_norm), P(post_norm), lin_of(qkv_w, H, Nqkv, "qkv"), ptr_or_null(qkv_b),
                 lin_of(o_w, nh * hd, H, "o"), ptr_or_null(o_b), std::move(gu), lin_of(down_w, I2 / 2, H, "down"),
                 nullptr, static_cast<float>(eps), H, H, Nqkv, I2 / 2, I2, nh, nkv, hd};
}
#else
using WArg = at::Tensor;

// A weight's shape per output row and input column: AMX packs 16 outputs x 32 inputs a tile row.
#ifdef SPECCTL_SKINNY
constexpr int64_t ROWS = 1, COLS = 1;
#else
constexpr int64_t ROWS = 16, COLS = 32;
#endif

Weights weights(const at::Tensor& in_norm, const at::Tensor& post_norm, double eps, const at::Tensor& qkv_w,
                const c10::optional<at::Tensor>& qkv_b, const at::Tensor& o_w,
                const c10::optional<at::Tensor>& o_b, const at::Tensor& gate_up_w, const at::Tensor& down_w,
                int64_t H, int64_t hd, int64_t nh, int64_t nkv, bool eagle3,
                const c10::optional<at::Tensor>& emb_norm) {
  auto P = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  Weights w{P(in_norm), P(post_norm), P(qkv_w), ptr_or_null(qkv_b), P(o_w), ptr_or_null(o_b), P(gate_up_w),
            P(down_w), eagle3 ? P(*emb_norm) : nullptr, static_cast<float>(eps),
            H, eagle3 ? 2 * H : H, (nh + 2 * nkv) * hd, gate_up_w.size(0) * ROWS / 2, gate_up_w.size(0) * ROWS, nh, nkv, hd};
  TORCH_CHECK(qkv_w.size(0) * ROWS == w.Nqkv && qkv_w.size(1) * COLS == w.Hin, "qkv weight shape");
  TORCH_CHECK(o_w.size(0) * ROWS == H && o_w.size(1) * COLS == nh * hd, "o weight shape");
  TORCH_CHECK(down_w.size(0) * ROWS == H && down_w.size(1) * COLS == w.I, "down weight shape");
  for (const at::Tensor* t : {&qkv_w, &o_w, &gate_up_w, &down_w})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kBFloat16, "weights contiguous bf16");
  TORCH_CHECK(hd % 32 == 0 && hd <= 256 && nh % nkv == 0, "head dim / heads");
  return w;
}

#endif

Seg make_seg(at::Tensor& k_cache, at::Tensor& v_cache, int64_t b, int64_t start, int64_t T, int64_t crow,
             const c10::optional<at::Tensor>& tree) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              k_cache.dim() == 4, "caches [B, nkv, S, hd] contiguous");
  const int64_t nkv = k_cache.size(1), S = k_cache.size(2), hd = k_cache.size(3);
  TORCH_CHECK(start >= 0 && start + T <= S, "cache too short");
  auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr()) + b * nkv * S * hd;
  auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr()) + b * nkv * S * hd;
  Seg s{kc, vc, S, start, T, crow, 0, 0, {}, {}};
  s.W = specctl::attn::read_tree(tree, T, start, s.anc, s.cnt);
  s.P0 = start + T - s.W;
  return s;
}

}  // namespace

at::Tensor decode_layer(at::Tensor x, at::Tensor in_norm, at::Tensor post_norm, double eps,
                           WArg qkv_w, c10::optional<at::Tensor> qkv_b, WArg o_w,
                           c10::optional<at::Tensor> o_b, WArg gate_up_w, WArg down_w,
                           at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                           int64_t start, int64_t num_heads, int64_t num_kv_heads, c10::optional<at::Tensor> tree,
                           c10::optional<at::Tensor> emb, c10::optional<at::Tensor> emb_norm) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.is_contiguous(), "x [B, T, H] bf16 contiguous");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T;
  TORCH_CHECK(M <= 64, "at most 64 rows");
  TORCH_CHECK(k_cache.size(0) == B, "caches [B, nkv, S, hd]");
  // EAGLE-3's draft layer: the attention reads cat(emb_norm(emb), in_norm(x)) [M, 2H]; x stays the residual
  const bool eagle3 = emb.has_value() && emb->defined();
  if (eagle3)
    TORCH_CHECK(emb->scalar_type() == at::kBFloat16 && emb->is_contiguous() && emb->numel() == M * H &&
                emb_norm.has_value() && emb_norm->defined(), "emb [B, T, H] bf16 contiguous, with emb_norm");
  const Weights w = weights(in_norm, post_norm, eps, qkv_w, qkv_b, o_w, o_b, gate_up_w, down_w, H, k_cache.size(3),
                            num_heads, num_kv_heads, eagle3, emb_norm);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T && cos.size(1) == w.hd, "cos/sin [T, hd]");
  std::vector<Seg> segs;
  for (int64_t b = 0; b < B; ++b) segs.push_back(make_seg(k_cache, v_cache, b, start, T, 0, tree));
  auto out = at::empty({B, T, H}, x.options());
  auto P = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  run_block(w, segs, P(x), eagle3 ? P(*emb) : nullptr, P(cos), P(sin), M, reinterpret_cast<uint16_t*>(out.data_ptr()),
            x.options());
  return out;
}

// Many requests' rows in one call: x [1, M, H] (segment after segment), cos/sin [M, hd]; segment s
// has lens[s] rows written at starts[s] of its own caches k_caches[s] / v_caches[s] ([1, nkv, S, hd]),
// and optionally a draft tree trees[s] [T, T]. Each row is computed exactly as the one-request call.
at::Tensor decode_layer_ragged(at::Tensor x, at::Tensor in_norm, at::Tensor post_norm, double eps,
                                  WArg qkv_w, c10::optional<at::Tensor> qkv_b, WArg o_w,
                                  c10::optional<at::Tensor> o_b, WArg gate_up_w, WArg down_w,
                                  at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_caches,
                                  std::vector<at::Tensor> v_caches, std::vector<int64_t> starts,
                                  std::vector<int64_t> lens, std::vector<c10::optional<at::Tensor>> trees,
                                  int64_t num_heads, int64_t num_kv_heads,
                                  std::vector<c10::optional<at::Tensor>> weights_out) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.size(0) == 1 && x.is_contiguous(),
              "x [1, M, H] bf16 contiguous");
  const int64_t M = x.size(1), H = x.size(2), n = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(n >= 1 && static_cast<int64_t>(v_caches.size()) == n && static_cast<int64_t>(starts.size()) == n &&
              static_cast<int64_t>(lens.size()) == n && static_cast<int64_t>(trees.size()) == n,
              "one cache pair, start, length and tree per segment");
  const Weights w = weights(in_norm, post_norm, eps, qkv_w, qkv_b, o_w, o_b, gate_up_w, down_w, H,
                            k_caches[0].size(3), num_heads, num_kv_heads, false, c10::nullopt);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == M && cos.size(1) == w.hd, "cos/sin [M, hd]");
  std::vector<Seg> segs;
  int64_t rows = 0;
  for (int64_t s = 0; s < n; ++s) {
    TORCH_CHECK(k_caches[s].size(0) == 1 && k_caches[s].size(1) == num_kv_heads && k_caches[s].size(3) == w.hd,
                "each cache [1, nkv, S, hd]");
    segs.push_back(make_seg(k_caches[s], v_caches[s], 0, starts[s], lens[s], rows, trees[s]));
    if (s < static_cast<int64_t>(weights_out.size()) && weights_out[s].has_value() && weights_out[s]->defined()) {
      const at::Tensor& wo = *weights_out[s];  // [2, nkv, S] fp32: the segment's rows' attention weights
      TORCH_CHECK(wo.scalar_type() == at::kFloat && wo.is_contiguous() && wo.dim() == 3 && wo.size(0) == 2 &&
                  wo.size(1) == num_kv_heads && wo.size(2) == segs.back().S && segs.back().W == 0,
                  "weights_out [2, nkv, S] fp32 contiguous, for a chain");
      segs.back().w = wo.data_ptr<float>();
    }
    rows += lens[s];
  }
  TORCH_CHECK(rows == M, "the segments' lengths must add up to x's rows");
  auto out = at::empty({1, M, H}, x.options());
  auto P = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  run_block(w, segs, P(x), nullptr, P(cos), P(sin), M, reinterpret_cast<uint16_t*>(out.data_ptr()), x.options());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layer", &decode_layer, "one transformer block for decode/verify rows (bf16, AMX)",
        py::arg("x"), py::arg("in_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv_w"), py::arg("qkv_b"),
        py::arg("o_w"), py::arg("o_b"), py::arg("gate_up_w"), py::arg("down_w"), py::arg("cos"), py::arg("sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("start"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("tree") = py::none(), py::arg("emb") = py::none(), py::arg("emb_norm") = py::none());
  m.def("decode_layer_ragged", &decode_layer_ragged, "one transformer block over many requests' rows (bf16, AMX)",
        py::arg("x"), py::arg("in_norm"), py::arg("post_norm"), py::arg("eps"), py::arg("qkv_w"), py::arg("qkv_b"),
        py::arg("o_w"), py::arg("o_b"), py::arg("gate_up_w"), py::arg("down_w"), py::arg("cos"), py::arg("sin"),
        py::arg("k_caches"), py::arg("v_caches"), py::arg("starts"), py::arg("lens"), py::arg("trees"),
        py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("weights_out") = std::vector<c10::optional<at::Tensor>>());
}
