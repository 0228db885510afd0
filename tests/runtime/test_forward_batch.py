"""The ragged batched forward: many requests (own caches, own lengths) in one target forward.

Each request's logits, hidden states and cache equal those of its own forward: bit for bit on the
row-independent bf16 paths (AMX, AVX512-BF16), to fp32 rounding in fp32 (torch's GEMM over more
rows sums in another order: a few ulps of the value, 1e-5 relative, plus 1e-5 for values near 0; seen
on an AMD EPYC: 1.04e-5 on a logit of 1.67), to bf16 rounding on torch's bf16 path.
"""

from __future__ import annotations

import torch

from specctl.modeling import load_transformer
from specctl.runtime.runner import TargetRunner, forward_batch


def _same(path, got, want, what):
    if path == "bf16-torch":
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -5, msg=lambda m: f"{what}: {m}")
    elif path == "fp32":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), what


def _check(model, path):
    g = torch.Generator().manual_seed(5)
    lens = [3, 17, 30, 9, 1, 44, 70]  # prompt lengths (70: prefill, forwarded on its own)
    prompts = [torch.randint(0, 128, (1, n), generator=g) for n in lens]
    # this step's work per request: decode rows, verify blocks (one over 16 rows), a draft tree, a prompt
    steps = [torch.randint(0, 128, (1, t), generator=g) for t in (1, 5, 1, 17, 4, 7, 2)]
    parents = [None, None, None, None, None, [-1, 0, 0, 1, 1, 2, 5], None]
    alone = []
    for i in range(len(lens)):
        r = TargetRunner(model, 128)
        r.forward(prompts[i])
        o = r.run(steps[i], parents=parents[i], aux_layers=(0, 1))
        alone.append((o.logits, o.hidden, o.aux, r.length, r.cache.k[:, :, :, :r.length].clone()))
    runners = [TargetRunner(model, 128) for _ in lens]
    first = forward_batch(runners, prompts, last_only=[True] * len(lens))  # every prompt in one forward
    for i, r in enumerate(runners):
        want = TargetRunner(model, 128)
        _same(path, first[i].logits, want.forward(prompts[i], logits="last"), f"prompt {i}")
    out = forward_batch(runners, steps, parents, aux_layers=(0, 1))
    for i, r in enumerate(runners):
        lg, hid, aux, length, k = alone[i]
        assert r.length == length and out[i].logits.shape == lg.shape
        _same(path, out[i].logits, lg, f"request {i} logits")
        _same(path, out[i].hidden, hid, f"request {i} hidden")
        _same(path, out[i].aux, aux, f"request {i} aux layers")
        _same(path, r.cache.k[:, :, :, :length], k, f"request {i} keys")


def test_forward_batch_equals_each_request_alone_fp32(tiny_model_factory):
    model = load_transformer(tiny_model_factory("qwen2"), torch.float32)
    _check(model, "fp32")


def test_forward_batch_equals_each_request_alone_bf16(tiny_model_factory, bf16_path):
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    model = load_transformer(folder, torch.bfloat16)
    _check(model, "bf16-torch" if bf16_path == "torch" else "bf16")
