// What a kernel's Python binding needs from torch: tensors, at::empty / at::zeros, ATen's thread pool, and
// pybind11 with torch's tensor caster. Not <torch/extension.h>: that parses the whole C++ frontend
// (autograd, nn, optim), 27 s of a kernel build here against 10 s for these, on each of the ~16 builds a
// fresh checkout compiles on first use (CI on every run).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
