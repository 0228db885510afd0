"""Greedy speculative output == plain greedy output in bf16, on every CPU bf16 path.

In bf16 a row's result normally depends on how many rows share its matmul (kernel blocking), so
verification of k+1 rows can round differently from decoding one and flip a near-tie. On the AMX
and AVX512-BF16 paths specctl computes every row independently (AMX tiles or the skinny kernel for
every linear, per-row attention), so a row is bit for bit the same alone, in a verify block, in a
draft tree or among other requests' rows, whatever their number: these tests hold it to that. On a
CPU with neither (the "torch" path: AVX2 only), ``enable_exact_bf16`` says False and the documented
guarantee is weaker: rows agree to bf16 rounding, and greedy outputs differ only at near-ties.

Each test runs once per path this CPU can take (the ``bf16_path`` fixture hides AMX, then
AVX512-BF16, to take the paths of CPUs without them).
"""

from __future__ import annotations

import pytest
import torch

from specctl.config import SpecConfig
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.modeling import KVCache, enable_exact_bf16, load_transformer
from specctl.runtime.proposers import build_proposer
from specctl.runtime.runner import TargetRunner

# torch path: the largest top-1 minus top-2 score gap at which a bf16 greedy choice may flip
# between a verified row and the same row decoded alone (a few bf16 ulps of the logits, ~0.4 here)
NEAR_TIE = 2 ** -5


def _load(tiny_model_factory, bf16_path):
    # a model whose logits are close together (near-ties are frequent: without row independence
    # about half the greedy outputs differ)
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    model = load_transformer(folder, torch.bfloat16)
    assert enable_exact_bf16(model) == (bf16_path != "torch")
    return model


def _same_rows(bf16_path, got: torch.Tensor, want: torch.Tensor, what) -> None:
    """Bit for bit on the row-independent paths; to bf16 rounding on torch's."""
    if bf16_path == "torch":
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -5, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want), what


def test_greedy_ngram_equals_plain_in_bf16(tiny_model_factory, bf16_path):
    # the prompts loop, so ngram drafts get accepted
    model = _load(tiny_model_factory, bf16_path)
    runner = TargetRunner(model, 512)
    cfg = SpecConfig(method="ngram", num_speculative_tokens=6, prompt_lookup_min=1).validated()
    plain, spec = SpecDecoder(runner), SpecDecoder(runner, build_proposer(cfg, 512), 6)
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(24):
        base = torch.randint(0, 128, (8,), generator=g).tolist()
        prompt = (base * 3)[:20]
        want = plain.generate(prompt, SamplingParams(max_new_tokens=48, record_margins=True))
        got = spec.generate(prompt, SamplingParams(max_new_tokens=48))
        if bf16_path == "torch" and got.token_ids != want.token_ids:
            i = next(i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b)
            assert want.margins[i] <= NEAR_TIE, f"diverged at token {i}, where plain's margin is {want.margins[i]}"
        else:
            assert got.token_ids == want.token_ids
        accepted += got.stats.num_accepted_tokens
    assert accepted > 100


def test_verify_rows_equal_decode_rows_in_bf16(tiny_model_factory, bf16_path):
    model = _load(tiny_model_factory, bf16_path)
    runner = TargetRunner(model, 256)
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(3))

    def run(chunks):
        runner.reset()
        runner.forward(ids[:, :20])
        pos, outs = 20, []
        for c in chunks:
            outs.append(runner.forward(ids[:, pos:pos + c]))
            pos += c
        return torch.cat(outs, 1)

    one_by_one = run([1] * 130)
    for chunks in ([2] * 65, [7] * 18 + [4], [11] * 11 + [9], [16, 16, 8, 17, 33, 40], [64, 64, 2]):
        _same_rows(bf16_path, run(chunks), one_by_one, chunks)


def _random_tree(n: int, g: torch.Generator) -> list[int]:
    """parents of an n-node tree (node 0 the root), each node's parent an earlier node."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]


def _path_logits(runner, prompt, tokens, parents, i):
    path, j = [], i
    while j >= 0:
        path.insert(0, j)
        j = parents[j]
    runner.reset()
    runner.forward(prompt)
    for t in path:
        last = runner.forward(tokens[:, t:t + 1])
    return last[:, 0]


@pytest.mark.parametrize("parents", [[-1, 0, 0, 1, 1, 3, 2], [-1] + [0] * 6 + list(range(1, 7)) + [7, 13, 14, 15, 16]])
def test_tree_rows_equal_their_paths_decoded_in_bf16(tiny_model_factory, bf16_path, parents):
    # a draft tree's logits at each node equal those of its path decoded token by token, bit for bit
    # (so tree speculation is lossless in bf16 too); the second tree has more than 16 nodes
    model = _load(tiny_model_factory, bf16_path)
    runner = TargetRunner(model, 256)
    g = torch.Generator().manual_seed(len(parents))
    prompt = torch.randint(0, 128, (1, 30), generator=g)
    tokens = torch.randint(0, 128, (1, len(parents)), generator=g)
    runner.reset()
    runner.forward(prompt)
    tree_logits = runner.forward_tree(tokens, parents)
    for i in range(len(parents)):
        _same_rows(bf16_path, tree_logits[:, i], _path_logits(runner, prompt, tokens, parents, i), i)


@pytest.mark.parametrize("n", [8, 17, 33, 64])
def test_a_row_is_the_same_alone_and_among_n_rows(tiny_model_factory, bf16_path, n):
    """A row's bf16 logits do not depend on how many rows share its forward: in a chain of n rows, a
    draft tree of n nodes, and n requests' decode rows in one batch (each with its own cache)."""
    model = _load(tiny_model_factory, bf16_path)
    g = torch.Generator().manual_seed(n)
    runner = TargetRunner(model, 256)
    prompt = torch.randint(0, 128, (1, 24), generator=g)

    # chain: n rows in one forward against the same rows one at a time
    chain = torch.randint(0, 128, (1, n), generator=g)
    runner.reset()
    runner.forward(prompt)
    together = runner.forward(chain)
    runner.reset()
    runner.forward(prompt)
    alone = torch.cat([runner.forward(chain[:, i:i + 1]) for i in range(n)], 1)
    _same_rows(bf16_path, together, alone, f"chain of {n}")

    # tree: n nodes in one forward against each node's path decoded alone
    parents = _random_tree(n, g)
    tokens = torch.randint(0, 128, (1, n), generator=g)
    runner.reset()
    runner.forward(prompt)
    tree_logits = runner.forward_tree(tokens, parents)
    for i in range(0, n, max(1, n // 8)):
        _same_rows(bf16_path, tree_logits[:, i], _path_logits(runner, prompt, tokens, parents, i), f"tree node {i}/{n}")

    # independent rows: n requests (own prompts, own caches) decode one token each, in one forward
    a = model.args
    prompts = torch.randint(0, 128, (n, 24), generator=g)
    nxt = torch.randint(0, 128, (n, 1), generator=g)
    batch = KVCache(a, n, 32, torch.bfloat16, "cpu")
    alone = []
    with torch.inference_mode():
        for b in range(n):
            one = KVCache(a, 1, 32, torch.bfloat16, "cpu")
            causal = torch.ones(24, 24, dtype=torch.bool).tril()
            model(prompts[b:b + 1], 0, one, causal)
            batch.k[:, b], batch.v[:, b] = one.k[:, 0], one.v[:, 0]
            alone.append(model(nxt[b:b + 1], 24, one, None)[0])
        together = model(nxt, 24, batch, None)[0]
    _same_rows(bf16_path, together, torch.cat(alone), f"{n} requests")
