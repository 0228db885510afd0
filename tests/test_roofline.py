"""The roofline model of a decoding step (specctl/roofline.py): bytes and FLOPs from the shapes, times
from a machine's rates, and sparse_attn's predicted speedup."""

from __future__ import annotations

import pytest

from specctl.roofline import Machine, Shapes, budget, forward_seconds, sparse_attn_estimate

QWEN_05B = {"num_hidden_layers": 24, "hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2,
            "intermediate_size": 4864, "vocab_size": 151936}
BYTES_ONLY = Machine(1e10, float("inf"), float("inf"))


def test_shapes_of_a_qwen_05b():
    s = Shapes.from_config(QWEN_05B)
    assert s.head_dim == 64
    assert s.kv_bytes_per_position == 24 * 2 * 2 * 64 * 2  # layers x (k, v) x kv heads x head_dim x bf16
    per_layer = 896 * (896 + 2 * 128) + 896 * 896 + 3 * 896 * 4864
    assert s.weight_bytes == 2 * (24 * per_layer + 151936 * 896)
    assert s.attention_flops_per_position == 24 * 4 * 14 * 64
    assert s.kv_share(16384) == pytest.approx(16384 * s.kv_bytes_per_position / s.weight_bytes)


def test_forward_time_is_the_slower_of_bytes_and_flops():
    s = Shapes.from_config(QWEN_05B)
    m = Machine(2e10, 1e12, 1e10)
    t1 = forward_seconds(s, m, [(1, 0)])
    assert t1 == pytest.approx(s.weight_bytes / 2e10)  # one row: memory-bound
    big = forward_seconds(s, m, [(1000, 0)])
    assert big == pytest.approx(1000 * s.linear_flops_per_row / 1e12)  # many rows: compute-bound
    att = forward_seconds(s, m, [(5, 4096)]) - forward_seconds(s, m, [(5, 0)])
    assert att == pytest.approx(max(4096 * s.kv_bytes_per_position / 2e10, 5 * 4096 * s.attention_flops_per_position / 1e10))
    assert forward_seconds(s, m, [(1, 0)], layer_share=0.5) == pytest.approx(t1 / 2)


def test_sparse_attn_pays_only_where_the_kv_read_is_large():
    s = Shapes.from_config(QWEN_05B)
    kw = dict(k=4, tau=4.0)
    short = sparse_attn_estimate(s, BYTES_ONLY, context=1024, batch=1, **kw)
    long = sparse_attn_estimate(s, BYTES_ONLY, context=32768, batch=16, **kw)
    assert short.speedup < 1 < long.speedup
    assert long.draft_positions == budget(32768, 0.05, 256) == 1639
    # by hand, bytes only: 4 drafts over the budget, one verify over the context, tau tokens per step
    W, kv = s.weight_bytes, s.kv_bytes_per_position
    plain = W + 16 * 32768 * kv
    step = sum(W + 16 * (1639 + j) * kv for j in range(4)) + plain
    assert long.speedup == pytest.approx(4.0 * plain / step)
    # skipping half the layers in the draft makes it cheaper
    assert sparse_attn_estimate(s, BYTES_ONLY, context=32768, batch=16, layer_share=0.5, **kw).speedup > long.speedup
