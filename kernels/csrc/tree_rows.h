// The rows of a forward as a draft tree (decode_attention.cpp and decode_layer.cpp): the optional
// [T, T] bool mask becomes each node's ancestors-and-itself list (see specctl::attn::tree_rows).
#pragma once
#include <torch/extension.h>
#include "decode_attention.h"

namespace specctl::attn {

// Returns whether the rows are a tree (a mask was given); fills anc/cnt, or fails on a bad mask.
inline bool read_tree(const c10::optional<torch::Tensor>& tree, int64_t T, std::vector<int32_t>& anc,
                      std::vector<int64_t>& cnt) {
  if (!tree.has_value() || !tree->defined()) return false;
  auto tm = tree->to(at::kBool).contiguous();
  TORCH_CHECK(tm.dim() == 2 && tm.size(0) == T && tm.size(1) == T, "tree mask [T, T]");
  TORCH_CHECK(tree_rows(tm.data_ptr<bool>(), T, anc, cnt), "tree mask: each node sees itself and earlier nodes only");
  return true;
}

}  // namespace specctl::attn
