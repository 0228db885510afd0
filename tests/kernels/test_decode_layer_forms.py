"""The fused decode block's FMA-form builds (specctl/kernels/decode_layer: "avx512" for AVX-512 without BF16, "avx2" for
AVX2 alone) against its AVX512-BF16 build. Apart from test_decode_layer.py, whose module-wide model fixture
keeps CPU features hidden while its builds are under test."""

from __future__ import annotations

import pytest
import torch

from specctl.kernels import cpu, decode_layer, select
from specctl.modeling import KVCache, load_transformer
from specctl.runtime.runner import tree_attention_mask


@pytest.mark.parametrize("path", ["avx512", "avx2"])
def test_fma_form_builds_equal_the_avx512_bf16_block_bit_for_bit(path, tiny_model_factory):
    """The fused block built for AVX-512 without BF16 and for AVX2 alone (vdpbf16ps as FMAs; zmm operations
    as ymm pairs: norms, SiLU's exp, attention, projections) writes what the AVX512-BF16 build writes, to the
    bit: the output rows and the keys and values, for decode rows, a verify block and a draft tree."""
    from tests.conftest import fma_form

    if cpu.why_not(cpu.AVX512_BF16):
        pytest.skip(f"comparing with the avx512_bf16 build {cpu.why_not(cpu.AVX512_BF16)}")
    with select.hidden("amx_bf16", "amx_tile"):
        ref = decode_layer.load()
        if decode_layer.kind() != "avx512_bf16":
            pytest.skip("the avx512_bf16 build of the fused block did not build here (no C++ compiler?)")
        folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
        m = load_transformer(folder, torch.bfloat16)
    other = fma_form(decode_layer, path)
    a, blk = m.args, m.layers[0]
    tree = tree_attention_mask([-1, 0, 0, 1, 2, 2, 4])

    def run(ext, start, T, tree):
        x = (torch.randn(1, T, a.hidden_size, generator=torch.Generator().manual_seed(start + T)) * 0.5).bfloat16()
        cos, sin = m.rope(start, T, torch.bfloat16)
        c = KVCache(a, 1, 128, torch.bfloat16, "cpu")
        c.k.normal_(generator=torch.Generator().manual_seed(1))
        c.v.normal_(generator=torch.Generator().manual_seed(2))
        out = ext.decode_layer(x, blk.input_norm.weight, blk.post_norm.weight, a.rms_norm_eps, blk.qkv.weight,
                               blk.qkv.bias, blk.o.weight, blk.o.bias, blk.gate_up.weight, blk.down.weight, cos, sin,
                               c.k[0], c.v[0], start, a.num_heads, a.num_kv_heads, tree)
        return out, c.k, c.v

    torch.set_flush_denormal(True)  # as specctl's runtime runs them (the forms part only on subnormals)
    try:
        for start, T, t in ((0, 1, None), (37, 1, None), (60, 16, None), (50, 7, tree)):
            for want, got in zip(run(ref, start, T, t), run(other, start, T, t)):
                assert torch.equal(got, want), (path, start, T)
    finally:
        torch.set_flush_denormal(False)
