"""Kernel sets: resolved once per model from the CPU's features and --kernels, held by the model, and never
changed under it by another model or a later view of the CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specctl.kernels import cpu, select, skinny_linear
from specctl.modeling import AmxLinear, DenseLinear, load_transformer


def _shape(model):
    return {type(layer) for block in model.layers for layer in block.projections}


def test_a_torch_model_loaded_beside_an_exact_one_stays_on_torch(tiny_model_factory):
    """Each model computes with its own set: loading an exact-bf16 model does not move a --kernels torch model
    (loaded before or after it) onto the C++ kernels."""
    from specctl.modeling import KVCache

    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    x = torch.randint(0, 100, (1, 5))

    def logits(m):
        return m(x, 0, KVCache(m.args, 1, 16, torch.bfloat16, "cpu"), None)[0]

    before = load_transformer(folder, torch.bfloat16, kernels="torch")
    ref = logits(before)
    exact = load_transformer(folder, torch.bfloat16)
    after = load_transformer(folder, torch.bfloat16, kernels="torch")
    for m in (before, after):
        assert m.kernels is select.TORCH and m.cpu_kernels is None and _shape(m) == {nn.Linear}
        assert not any(b.fused or b.exact_attention for b in m.layers)
    if not exact.kernels.exact:
        pytest.skip("this CPU runs no row-independent kernel set (no AVX2, or no compiler)")
    assert _shape(exact) == ({AmxLinear} if exact.kernels.path == "amx" else {DenseLinear})
    assert all(b.kernels is exact.kernels for b in exact.layers)
    # the torch models still compute what the first did before any exact model loaded (torch's F.linear)
    assert torch.equal(logits(before), ref) and torch.equal(logits(after), ref)


def test_a_model_resolved_with_features_hidden_keeps_that_set(tiny_model_factory):
    """A model loaded while the CPU looks like one without AVX512-BF16 (and AMX) runs the AVX-512 FMA form, and
    still does after the view is restored, beside a model on this CPU's own set."""
    if cpu.why_not(cpu.AVX512_BF16) or skinny_linear.load() is None:
        pytest.skip("needs an AVX512-BF16 CPU (and a compiler), to compare with its FMA form")
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    with select.hidden("amx_bf16", "amx_tile", "avx512_bf16"):
        fma = load_transformer(folder, torch.bfloat16)
        assert select.resolve().path == fma.kernels.path == "avx512"
    own = load_transformer(folder, torch.bfloat16)
    assert fma.kernels.path == "avx512" and own.kernels.path == select.resolve().path != "avx512"
    assert {layer.kernels.linear.__name__ for b in fma.layers for layer in b.projections} == {"specctl_skinny_linear_avx512f"}
    assert {b.fused_ext for b in fma.layers} == {fma.kernels.block} and fma.kernels.block is not own.kernels.block
