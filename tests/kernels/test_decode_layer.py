"""The fused decode block (specctl/kernels/decode_layer), each build (AMX; AVX512-BF16 without AMX, as on an AMD
EPYC; AVX-512 without BF16, as on an Intel Ice Lake; AVX2 alone, as on an AMD Zen 3; GGUF quantized weights on AVX512-VNNI): the same block as the per-op path to bf16 rounding, the same
keys and values in the cache, and rows independent of how many share the call."""

from __future__ import annotations

import pytest
import torch

from specctl.kernels import cpu, decode_layer, select
from specctl.modeling import KVCache, load_transformer
from specctl.runtime.runner import tree_attention_mask, tree_depths

# the fused block's builds -> (CPU features each needs, features hidden so that the CPU selects it)
# (gguf: the quantized build on the int8 path, "gguf_amx" on the AMX-INT8 panels)
BUILDS = {"amx": (cpu.AMX, ()), "avx512_bf16": (cpu.AVX512_BF16, ("amx_bf16", "amx_tile")),
          "avx512": (cpu.AVX512, ("amx_bf16", "amx_tile", "avx512_bf16")),
          "avx2": (cpu.AVX2, ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f")),
          "gguf": (("avx512_bf16", "avx512_vnni", "avx512bw"), ()),
          "gguf_amx": (("avx512_bf16", "avx512_vnni", "avx512bw", "amx_tile", "amx_int8"), ())}


@pytest.fixture(scope="module", params=list(BUILDS))
def model(request, tiny_model_factory, tmp_path_factory):
    needs, hide = BUILDS[request.param]
    if request.param.startswith("gguf"):  # Q4_K | Q8_0 blocks (conftest's write_quant_gguf), run as stored
        pytest.importorskip("gguf")
        from specctl.runtime.quant import load_gguf_transformer
        from tests.conftest import TINY_QUANT_SHAPE, write_quant_gguf

        qpath = "amx_int8" if request.param == "gguf_amx" else "avx512_vnni"
        if cpu.why_not(needs) or decode_layer.load_quant(qpath) is None:
            pytest.skip(f"the quantized build of the fused block needs {', '.join(needs)} and a C++ compiler")
        folder = tiny_model_factory("qwen2", initializer_range=0.05, **TINY_QUANT_SHAPE)
        path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
        write_quant_gguf(folder, path)
        m = load_gguf_transformer(path, torch.bfloat16, quant_path=qpath)
        assert m.cpu_kernels == f"gguf-{qpath}" and all(b.fused for b in m.layers)
        yield m
        return
    if cpu.why_not(needs):
        pytest.skip(f"the {request.param} build {cpu.why_not(needs)}")
    with select.hidden(*hide):
        if decode_layer.kind() != request.param:
            pytest.skip(f"the {request.param} build of the fused block did not build here (no C++ compiler?)")
        folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
        m = load_transformer(folder, torch.bfloat16)  # exact bf16 is the default on CPU
        assert m.cpu_kernels == request.param and all(b.fused for b in m.layers)
        yield m


@pytest.mark.parametrize("start,T", [(0, 1), (5, 3), (60, 1), (60, 16)])
def test_fused_block_matches_per_op_block(model, start, T):
    a, blk = model.args, model.layers[0]
    g = torch.Generator().manual_seed(start + T)
    x = (torch.randn(1, T, a.hidden_size, generator=g) * 0.5).bfloat16()
    cos, sin = model.rope(start, T, torch.bfloat16)
    caches = []
    outs = []
    for fused in (False, True):
        c = KVCache(a, 1, 128, torch.bfloat16, "cpu")
        c.k.normal_(generator=torch.Generator().manual_seed(1))
        c.v.normal_(generator=torch.Generator().manual_seed(2))
        blk.fused = fused
        mask = torch.ones(T, start + T, dtype=torch.bool).tril(start) if T > 1 else None
        outs.append(blk(x, cos, sin, c.k[0], c.v[0], start, mask).float())
        caches.append(c)
    blk.fused = True
    torch.testing.assert_close(outs[1], outs[0], atol=0.1, rtol=0.02)
    torch.testing.assert_close(caches[1].k.float(), caches[0].k.float(), atol=0.05, rtol=0.02)
    assert torch.equal(caches[1].v, caches[0].v)


@pytest.mark.parametrize("T", [9, 24])  # 24: the AVX2 build's blocked GEMM (from 20 rows), residual adds included
def test_rows_equal_rows_alone(model, T):
    a, blk = model.args, model.layers[1]
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(1, T, a.hidden_size, generator=g) * 0.5).bfloat16()
    c = KVCache(a, 1, 64, torch.bfloat16, "cpu")
    c.k.normal_(generator=g)
    c.v.normal_(generator=g)
    cos, sin = model.rope(20, T, torch.bfloat16)
    full = blk(x, cos, sin, c.k[1], c.v[1], 20, None)
    alone = torch.cat([blk(x[:, i:i + 1], cos[i:i + 1].contiguous(), sin[i:i + 1].contiguous(), c.k[1], c.v[1], 20 + i, None)
                       for i in range(T)], 1)
    assert torch.equal(full, alone)


@pytest.mark.parametrize("threads", [1, 3, 5])
def test_block_does_not_depend_on_how_many_threads_share_it(model, threads):
    # the weight rows are split into per-thread shares (skinny build) or handed out in chunks: every
    # row computed once, the same way, whatever the split (5 threads on 2 cores: shares taken over)
    a, blk = model.args, model.layers[0]
    x = (torch.randn(1, 5, a.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5).bfloat16()
    cos, sin = model.rope(12, 5, torch.bfloat16)
    mask = torch.ones(5, 17, dtype=torch.bool).tril(12)

    def run():
        c = KVCache(a, 1, 64, torch.bfloat16, "cpu")
        c.k.normal_(generator=torch.Generator().manual_seed(1))
        c.v.normal_(generator=torch.Generator().manual_seed(2))
        return blk(x, cos, sin, c.k[0], c.v[0], 12, mask), c

    before = torch.get_num_threads()
    ref, ref_cache = run()
    try:
        torch.set_num_threads(threads)
        out, cache = run()
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out, ref) and torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)


def test_ragged_rows_equal_each_request_alone(model):
    """Two requests' rows (a verify block and a decode row, each in its own cache) in one ragged call:
    each equals its own call, bit for bit, and so do the keys and values written."""
    from specctl.modeling import Segment

    a, blk = model.args, model.layers[0]
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(1, 5, a.hidden_size, generator=g) * 0.5).bfloat16()
    caches = [KVCache(a, 1, 64, torch.bfloat16, "cpu") for _ in range(4)]
    for c in caches:
        c.k.normal_(generator=torch.Generator().manual_seed(3))
        c.v.normal_(generator=torch.Generator().manual_seed(4))
    starts = (20, 7)
    cos1, sin1 = model.rope(starts[0], 4, torch.bfloat16)
    cos2, sin2 = model.rope(starts[1], 1, torch.bfloat16)
    segs = [Segment(caches[0], starts[0], 4, None), Segment(caches[1], starts[1], 1, None)]
    both = blk.forward_ragged(x, torch.cat([cos1, cos2]), torch.cat([sin1, sin2]), 0, segs)
    one = blk(x[:, :4], cos1, sin1, caches[2].k[0], caches[2].v[0], starts[0], None)
    two = blk(x[:, 4:], cos2, sin2, caches[3].k[0], caches[3].v[0], starts[1], None)
    assert torch.equal(both, torch.cat([one, two], 1))
    assert torch.equal(caches[0].k, caches[2].k) and torch.equal(caches[1].v, caches[3].v)


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 2, 2, 4], [-1] + [0] * 8 + list(range(1, 9)) + [9, 17, 18]])
def test_tree_rows_equal_their_paths_decoded_as_chains(model, parents):
    # a draft tree through the fused block (over 16 rows in the second case): each node's output and
    # key/value equal those of the same tokens decoded as a chain along its path, bit for bit
    a, blk = model.args, model.layers[0]
    T, start = len(parents), 11
    g = torch.Generator().manual_seed(T)
    x = (torch.randn(1, T, a.hidden_size, generator=g) * 0.5).bfloat16()
    depth, tree = tree_depths(parents), tree_attention_mask(parents)
    c = KVCache(a, 1, 64, torch.bfloat16, "cpu")
    c.k.normal_(generator=g)
    c.v.normal_(generator=g)
    base_k, base_v = c.k.clone(), c.v.clone()
    cos, sin = model.rope(start, T, torch.bfloat16, start + torch.tensor(depth))
    out = decode_layer.layer(blk, x, cos, sin, c.k[0], c.v[0], start, tree)
    for i in range(T):
        path = [j for j in range(T) if tree[i, j]]
        ck, cv = base_k.clone(), base_v.clone()
        pc, ps = model.rope(start, len(path), torch.bfloat16)
        chain = decode_layer.layer(blk, x[:, path].contiguous(), pc, ps, ck[0], cv[0], start)
        assert torch.equal(out[:, i], chain[:, -1]), i
        assert torch.equal(c.k[0, :, :, start + i], ck[0, :, :, start + len(path) - 1])
        assert torch.equal(c.v[0, :, :, start + i], cv[0, :, :, start + len(path) - 1])

