"""Greedy speculative output == plain greedy output in bf16, bit for bit, where the CPU kernel runs.

In bf16 a row's result normally depends on how many rows share its matmul (kernel blocking), so
verification of k+1 rows can round differently from decoding one and flip a near-tie. specctl's
decode/verify forwards (<= VERIFY_ROWS tokens) compute every row independently (the skinny bf16
kernel, per-row attention), which this test holds it to.
"""

from __future__ import annotations

import pytest
import torch

from kernels import amx_linear, skinny_linear
from specctl.config import SpecConfig
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.model import enable_exact_bf16, load_transformer
from specctl.runtime.proposers import build_proposer
from specctl.runtime.runner import TargetRunner

pytestmark = pytest.mark.skipif(not (amx_linear.available() or skinny_linear.available()),
                                reason="needs the AMX or avx512_bf16 kernel")


def test_greedy_ngram_equals_plain_in_bf16(tiny_model_factory):
    # a model whose greedy output loops (so ngram drafts get accepted), and whose logits are close
    # together (near-ties are frequent: without row independence about half the outputs differ)
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    model = load_transformer(folder, torch.bfloat16)
    assert enable_exact_bf16(model)
    runner = TargetRunner(model, 512)
    cfg = SpecConfig(method="ngram", num_speculative_tokens=6, prompt_lookup_min=1).validated()
    plain, spec = SpecDecoder(runner), SpecDecoder(runner, build_proposer(cfg, 512), 6)
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(24):
        base = torch.randint(0, 128, (8,), generator=g).tolist()
        prompt = (base * 3)[:20]
        want = plain.generate(prompt, SamplingParams(max_new_tokens=48)).token_ids
        got = spec.generate(prompt, SamplingParams(max_new_tokens=48))
        assert got.token_ids == want
        accepted += got.stats.num_accepted_tokens
    assert accepted > 100


def test_verify_rows_equal_decode_rows_in_bf16(tiny_model_factory):
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    model = load_transformer(folder, torch.bfloat16)
    assert enable_exact_bf16(model)
    runner = TargetRunner(model, 256)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(3))

    def run(chunks):
        runner.reset()
        runner.forward(ids[:, :20])
        pos, outs = 20, []
        for c in chunks:
            outs.append(runner.forward(ids[:, pos:pos + c]))
            pos += c
        return torch.cat(outs, 1)

    one_by_one = run([1] * 40)
    for chunks in ([2] * 20, [7] * 5 + [5], [11] * 3 + [7], [16, 16, 8]):
        assert torch.equal(run(chunks), one_by_one)


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 1, 3, 2], [-1] + [0] * 6 + list(range(1, 7)) + [7, 13, 14, 15, 16]])
def test_tree_rows_equal_their_paths_decoded_in_bf16(tiny_model_factory, parents):
    # a draft tree's logits at each node equal those of its path decoded token by token, bit for bit
    # (so tree speculation is lossless in bf16 too); the second tree has more than 16 nodes
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    model = load_transformer(folder, torch.bfloat16)
    assert enable_exact_bf16(model)
    runner = TargetRunner(model, 256)
    g = torch.Generator().manual_seed(len(parents))
    prompt = torch.randint(0, 128, (1, 30), generator=g)
    tokens = torch.randint(0, 128, (1, len(parents)), generator=g)
    runner.reset()
    runner.forward(prompt)
    tree_logits = runner.forward_tree(tokens, parents)
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.insert(0, j)
            j = parents[j]
        runner.reset()
        runner.forward(prompt)
        for t in path:
            last = runner.forward(tokens[:, t:t + 1])
        assert torch.equal(tree_logits[:, i], last[:, 0]), i
