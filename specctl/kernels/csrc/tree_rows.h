// The rows of a forward as a draft tree (decode_attention.cpp and decode_layer.cpp): the optional
// [T, W] bool mask (W >= T: the call's rows and the W - T tree slots just before them) becomes each
// node's visible-slots list (see specctl::attn::tree_rows).
#pragma once
#include "torch_ext.h"
#include "decode_attention.h"

namespace specctl::attn {

// Returns the mask's width W (0: no mask, the rows are a chain); fills anc/cnt, or fails on a bad mask.
// Row i then attends to slots [0, start + T - W) and start + T - W + anc[i * W + j] for j < cnt[i].
inline int64_t read_tree(const c10::optional<at::Tensor>& tree, int64_t T, int64_t start,
                         std::vector<int32_t>& anc, std::vector<int64_t>& cnt) {
  if (!tree.has_value() || !tree->defined()) return 0;
  auto tm = tree->to(at::kBool).contiguous();
  TORCH_CHECK(tm.dim() == 2 && tm.size(0) == T && tm.size(1) >= T && tm.size(1) <= start + T,
              "tree mask [T, W] with T <= W <= start + T");
  const int64_t W = tm.size(1);
  TORCH_CHECK(tree_rows(tm.data_ptr<bool>(), T, W, anc, cnt), "tree mask: each node sees itself and earlier nodes only");
  return W;
}

}  // namespace specctl::attn
