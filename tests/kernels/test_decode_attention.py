"""Row-independent decode/verify attention: matches fp32 SDPA to bf16 rounding; a row computed among
T rows equals the same row computed alone, bit for bit; GQA groups and head dims 32..128."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specctl.kernels import cpu, decode_attention
from specctl.runtime.runner import tree_attention_mask

EXT = decode_attention.load()  # this CPU's build (None: the module is skipped)
pytestmark = pytest.mark.skipif(EXT is None, reason=cpu.why_not(cpu.AVX512, built=False))


@pytest.mark.parametrize("nh,nkv,hd", [(4, 2, 32), (9, 3, 64), (12, 2, 128), (6, 6, 96)])
def test_matches_reference_and_rows_are_independent(nh, nkv, hd):
    g = torch.Generator().manual_seed(nh * hd)
    S, start, T = 96, 37, 7
    kc = torch.randn(2, nkv, S, hd, generator=g).bfloat16()
    vc = torch.randn(2, nkv, S, hd, generator=g).bfloat16()
    q = torch.randn(2, nh, T, hd, generator=g).bfloat16()
    out = decode_attention.attention(EXT, q, kc, vc, start)  # [B, T, nh * hd]
    ref = torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1].float(), kc[:, :, :start + i + 1].float(),
                                                    vc[:, :, :start + i + 1].float(), enable_gqa=True)
                     for i in range(T)], 2).transpose(1, 2).reshape(2, T, nh * hd)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    alone = torch.cat([decode_attention.attention(EXT, q[:, :, i:i + 1], kc, vc, start + i) for i in range(T)], 1)
    assert torch.equal(out, alone)


def test_supports_only_what_the_kernel_covers():
    q = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    assert decode_attention.supports(q, 2)
    assert not decode_attention.supports(q.float(), 2)  # fp32: SDPA
    assert not decode_attention.supports(torch.zeros(1, 8, 1, 48, dtype=torch.bfloat16), 2)  # head dim


@pytest.mark.parametrize("nh,nkv,hd", [(4, 2, 32), (12, 2, 128)])
def test_tree_rows_equal_their_paths_decoded_alone(nh, nkv, hd):
    # node i sees the prefix, then its ancestors and itself: bit for bit the one-row decode of its path
    parents = [-1, 0, 0, 1, 1, 2, 3, 6, 0]
    T, S, start = len(parents), 96, 29
    g = torch.Generator().manual_seed(hd)
    kc = torch.randn(1, nkv, S, hd, generator=g).bfloat16()
    vc = torch.randn(1, nkv, S, hd, generator=g).bfloat16()
    q = torch.randn(1, nh, T, hd, generator=g).bfloat16()
    tree = tree_attention_mask(parents)
    out = decode_attention.attention(EXT, q, kc, vc, start, tree=tree)
    for i in range(T):
        path = [j for j in range(T) if tree[i, j]]
        k2, v2 = kc.clone(), vc.clone()
        k2[:, :, start:start + len(path)] = kc[:, :, [start + j for j in path]]
        v2[:, :, start:start + len(path)] = vc[:, :, [start + j for j in path]]
        alone = decode_attention.attention(EXT, q[:, :, i:i + 1], k2, v2, start + len(path) - 1)
        assert torch.equal(out[:, i:i + 1], alone), i
    # a chain is the tree whose node i's parent is i-1
    chain = decode_attention.attention(EXT, q, kc, vc, start, tree=tree_attention_mask(list(range(-1, T - 1))))
    assert torch.equal(chain, decode_attention.attention(EXT, q, kc, vc, start))


def test_a_wide_mask_reaches_tree_nodes_already_in_the_cache():
    # [T, W] with W > T: the rows are a tree level whose ancestors sit in earlier slots (an EAGLE
    # draft tree forwarded level by level); each row equals the one-row decode of its path
    nh, nkv, hd, S, P = 4, 2, 64, 96, 23  # slots [0, P) are the prefix, [P, P + 6) two earlier levels
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(1, nkv, S, hd, generator=g).bfloat16()
    vc = torch.randn(1, nkv, S, hd, generator=g).bfloat16()
    ancestors = [[0, 3], [1], [0, 4], []]  # per row: earlier slots P + j it sees (then itself)
    T, start = len(ancestors), P + 6
    q = torch.randn(1, nh, T, hd, generator=g).bfloat16()
    W = start + T - P
    tree = torch.zeros(T, W, dtype=torch.bool)
    for i, anc in enumerate(ancestors):
        tree[i, anc] = True
        tree[i, start - P + i] = True
    out = decode_attention.attention(EXT, q, kc, vc, start, tree=tree)
    for i, anc in enumerate(ancestors):
        slots = [P + j for j in anc] + [start + i]
        k2, v2 = kc.clone(), vc.clone()
        k2[:, :, P:P + len(slots)] = kc[:, :, slots]
        v2[:, :, P:P + len(slots)] = vc[:, :, slots]
        alone = decode_attention.attention(EXT, q[:, :, i:i + 1], k2, v2, P + len(slots) - 1)
        assert torch.equal(out[:, i:i + 1], alone), i
    # the prefix columns may be given too: a [T, start + T] mask whose first P columns are all True
    full = torch.cat([torch.ones(T, P, dtype=torch.bool), tree], 1)
    assert torch.equal(decode_attention.attention(EXT, q, kc, vc, start, tree=full), out)


def test_a_tree_mask_with_a_later_ancestor_is_refused():
    q = torch.zeros(1, 4, 3, 32, dtype=torch.bfloat16)
    kc = torch.zeros(1, 2, 16, 32, dtype=torch.bfloat16)
    bad = torch.eye(3, dtype=torch.bool)
    bad[0, 2] = True
    with pytest.raises(RuntimeError, match="earlier nodes"):
        decode_attention.attention(EXT, q, kc, kc, 4, tree=bad)


@pytest.mark.parametrize("nh,nkv,hd,T", [(14, 2, 64, 5), (14, 2, 64, 20), (16, 1, 128, 33), (4, 4, 32, 64)])
def test_rows_sharing_a_read_of_the_keys_equal_rows_alone(nh, nkv, hd, T):
    """A chain's rows share one read of the keys and values (several runs of rows where rows x heads
    per kv head exceed the kernel's 64 queries); each still equals its one-row call bit for bit, with
    keys on both sides of 16-key block boundaries."""
    g = torch.Generator().manual_seed(T)
    S, start = 200, 45
    kc = torch.randn(1, nkv, S, hd, generator=g).bfloat16()
    vc = torch.randn(1, nkv, S, hd, generator=g).bfloat16()
    q = torch.randn(1, nh, T, hd, generator=g).bfloat16()
    out = decode_attention.attention(EXT, q, kc, vc, start)
    alone = torch.cat([decode_attention.attention(EXT, q[:, :, i:i + 1], kc, vc, start + i) for i in range(T)], 1)
    assert torch.equal(out, alone)
    ref = torch.cat([F.scaled_dot_product_attention(q[:, :, i:i + 1].float(), kc[:, :, :start + i + 1].float(),
                                                    vc[:, :, :start + i + 1].float(), enable_gqa=True)
                     for i in range(T)], 2).transpose(1, 2).reshape(1, T, nh * hd)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("path", ["avx512", "avx2"])
@pytest.mark.parametrize("nh,nkv,hd,T", [(14, 2, 64, 5), (4, 4, 128, 20)])
def test_fma_form_equals_avx512_bf16_bit_for_bit(nh, nkv, hd, T, path):
    """The builds for AVX-512 without BF16 (scores by FMAs, csrc/bf16.h) and for AVX2 (the same on two ymm
    halves, csrc/vec16.h: hsum16's tree, exp16's scalef, the partial loads) equal the AVX512-BF16 build."""
    from tests.conftest import fma_form

    fma = fma_form(decode_attention, path)
    g = torch.Generator().manual_seed(T)
    S, start = 120, 41
    kc = torch.randn(1, nkv, S, hd, generator=g).bfloat16()
    vc = torch.randn(1, nkv, S, hd, generator=g).bfloat16()
    q = torch.randn(1, nh, T, hd, generator=g).bfloat16()
    for st in (0, start):
        assert torch.equal(fma.decode_attention(q, kc, vc, st, 0.125, None),
                           decode_attention.attention(EXT, q, kc, vc, st, 0.125))
