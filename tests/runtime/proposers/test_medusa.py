"""MedusaProposer on a tiny llama (fp32): with heads overfit on the model's own greedy output, greedy
decoding with Medusa drafts (chains and trees through the decode loop) equals
plain greedy decoding on >= 20 prompts while accepting many drafts; the tree mask is right on
hand-built trees; sampled drafts come with q = the heads' processed softmax; both layouts draft alike."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specctl.config import SpecConfig
from specctl.drafts.medusa import MedusaHeads, load_medusa, save_fasterdecoding
from specctl.errors import ConfigError, ModelError
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.proposers import DraftRequest, build_proposer
from specctl.runtime.proposers.medusa import MedusaProposer, auto_tree, parse_token_tree, tree_from_choices, tree_tokens
from specctl.runtime.rejection import greedy_tree_verify
from specctl.runtime.loading import load_model
from specctl.runtime.runner import TargetRunner, tree_attention_mask
from specctl.testing import record_draft_sizes
from tests.conftest import MEDUSA_NEW as NEW


def cfg(path: str, k: int = 3, **extra) -> SpecConfig:
    return SpecConfig.from_dict({"method": "medusa", "model": str(path), "num_speculative_tokens": k, **extra})


def greedy_acceptance(dec: SpecDecoder, cases) -> float:
    """Every case's speculative greedy output equals its plain one; returns the mean acceptance length."""
    accepted = drafts = 0
    for p, out in cases:
        res = dec.generate(p, SamplingParams(max_new_tokens=NEW))
        assert res.token_ids == out
        accepted += res.stats.num_accepted_tokens
        drafts += res.stats.num_drafts
    return 1 + accepted / drafts  # the heads memorised these outputs: most drafts are accepted


@pytest.fixture(scope="module")
def trained(trained_medusa):
    """A loopy tiny llama, its plain greedy outputs to 20+ prompts, and heads overfit on them (conftest)."""
    return trained_medusa


def test_chain_greedy_equals_plain_and_accepts(trained):
    lm, cases, heads_dir = trained
    prop = build_proposer(cfg(heads_dir), 128, target=lm)
    assert isinstance(prop, MedusaProposer) and prop.needs_hidden_states and prop.num_heads == 3
    assert greedy_acceptance(SpecDecoder(TargetRunner(lm.model, 128), prop, 3), cases) > 2.5


def test_tree_greedy_equals_plain_and_accepts(trained):
    lm, cases, heads_dir = trained
    c = SpecConfig.from_json(json.dumps({"method": "medusa", "model": str(heads_dir), "num_speculative_tokens": 3,
                                         "speculative_token_tree": "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"}))
    prop = build_proposer(c, 160, target=lm)
    prop.start_request(0, np.zeros(4, dtype=np.int32))
    d = prop.propose([DraftRequest(0, np.zeros(4, dtype=np.int32), 4, torch.randn(1, lm.model.args.hidden_size))], [2])
    assert d[0].parents == [-1, -1, 0, 0, 1] and int(d.num_tokens[0]) == 5  # cut to depth 2: (0,0,0) dropped
    assert greedy_acceptance(SpecDecoder(TargetRunner(lm.model, 160), prop, 3), cases) > 2.5


def test_a_priced_tree_keeps_its_likeliest_nodes_and_verified_trees_calibrate(trained):
    """With a row's price (DraftRequest.row_price) the tree keeps the nodes worth their rows by their
    heads' probabilities, closed under parents; every verified tree's nodes go into the calibration, its
    accepted ones exactly the tokens the steps accepted; outputs stay plain greedy's."""
    from specctl.runtime.tree_budget import worth

    lm, cases, heads_dir = trained
    c = SpecConfig.from_dict({"method": "medusa", "model": str(heads_dir), "num_speculative_tokens": 3,
                              "speculative_token_tree": "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"})
    prop = build_proposer(c, 160, target=lm)
    prop.start_request(0, np.zeros(4, dtype=np.int32))
    r = DraftRequest(0, np.zeros(4, dtype=np.int32), 4, torch.randn(1, lm.model.args.hidden_size))
    full = prop.propose([r], [3])[0]
    paths = prop.tree[0]
    probs = tree_tokens(prop.head_logits(r.hidden)[0], paths, prop.heads, with_probs=True)[1]
    assert len(full) == 7 and all(0 < p <= 1 for p in probs)
    assert all(probs[i] <= probs[full.parents[i]] for i in range(7) if full.parents[i] >= 0)  # a child no likelier
    for price in (0.01, 0.2):
        r.row_price = price
        d = prop.propose([r], [3])[0]
        n = worth(sorted((prop.calibration(p) for p in probs), reverse=True), price)
        assert len(d) >= n and len(d) <= 7 and all(p < i for i, p in enumerate(d.parents or []))
        kept = sorted(range(7), key=lambda i: -probs[i])[:n]  # its likeliest n nodes, as tokens on their paths
        assert {full.ids[i] for i in kept} <= set(d.ids)
    r.row_price = 5.0
    assert len(prop.propose([r], [3])[0]) == 0

    sizes = record_draft_sizes(prop)
    prop.calibration.__init__()
    dec = SpecDecoder(TargetRunner(lm.model, 160), prop, 3)
    plain = SpecDecoder(TargetRunner(lm.model, 160))
    accepted = 0
    for p, _ in cases[:6]:
        got = dec.generate(p, SamplingParams(max_new_tokens=NEW))
        assert got.token_ids == plain.generate(p, SamplingParams(max_new_tokens=NEW)).token_ids
        accepted += got.stats.num_accepted_tokens
    assert sum(prop.calibration.accepted) == accepted > 0 and sum(prop.calibration.tried) == sum(sizes)


def test_tree_mask_on_hand_built_trees():
    paths, parents, depths = tree_from_choices([(0, 0), (0,), (1,)])  # the module docstring's tree
    assert paths == [(), (0,), (1,), (0, 0)] and parents == [-1, 0, 0, 1] and depths == [0, 1, 1, 2]
    assert tree_attention_mask(parents).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    # deeper: root -> a(0) -> c(0,0) -> e(0,0,0); root -> b(1) -> d(1,0)
    paths, parents, depths = tree_from_choices([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    assert parents == [-1, 0, 0, 1, 2, 3] and depths == [0, 1, 1, 2, 2, 3]
    m = tree_attention_mask(parents)
    assert m[5].nonzero().flatten().tolist() == [0, 1, 3, 5]  # e sees root, a, c, itself
    assert m[4].nonzero().flatten().tolist() == [0, 2, 4]  # d sees root, b, itself
    assert not m[3, 2] and not m[1, 2] and bool(m.diagonal().all())
    with pytest.raises(ConfigError, match="no parent"):
        tree_from_choices([(0, 1)])
    assert len(tree_from_choices([(0,), (0, 0), (0, 0, 0)], num_heads=2)[0]) == 3  # deeper than the heads: cut


def test_tree_tokens_and_greedy_verify():
    heads = MedusaHeads(4, 10, 2)
    logits = torch.tensor([[0, 9, 8, 0, 0, 0, 0, 0, 0, 7.0], [5, 0, 0, 6, 0, 0, 0, 0, 0, 0.0]])  # [K=2, V]
    paths, parents, _ = tree_from_choices([(0,), (1,), (0, 0), (0, 1)])
    # nodes: (0,) head0 top1=1, (1,) head0 top2=2, (0,0) head1 top1=3, (0,1) head1 top2=0
    assert tree_tokens(logits, paths, heads).tolist() == [1, 2, 3, 0]
    tokens = [7, 1, 2, 3, 0]
    path, emitted = greedy_tree_verify(tokens, parents, [1, 0, 9, 9, 9])  # target: after root 1, after node1 0
    assert path == [0, 1, 4] and emitted == [1, 0, 9]
    path, emitted = greedy_tree_verify(tokens, parents, [2, 5, 6, 9, 9])  # second branch, then no match
    assert path == [0, 2] and emitted == [2, 6]
    assert greedy_tree_verify(tokens, parents, [4, 0, 0, 0, 0]) == ([0], [4])


def test_sampled_drafts_carry_their_distribution(trained):
    lm, cases, heads_dir = trained
    prop = build_proposer(cfg(heads_dir, k=3), 128, target=lm)
    prop.set_sampling(0, SamplingParams(temperature=0.7, top_k=20), torch.Generator().manual_seed(0))
    hidden = torch.randn(1, 64)
    d = prop.propose([DraftRequest(0, np.zeros(8, np.int32), 4, hidden)], [3])
    assert d.probs.shape == (1, 3, 128)
    want = torch.softmax(prop.head_logits(hidden) / 0.7, -1)
    kth = want.topk(20, -1).values[..., -1:]
    want = torch.where(want >= kth, want, torch.zeros_like(want))
    torch.testing.assert_close(d.probs, want / want.sum(-1, keepdim=True))
    for i in range(int(d.num_tokens[0])):
        assert float(d.probs[0, i, d.token_ids[0, i]]) > 0
    # a whole sampled decode runs, seeded and reproducible
    dec = SpecDecoder(TargetRunner(lm.model, 128), prop, 3)
    p = cases[0][0]
    a = dec.generate(p, SamplingParams(max_new_tokens=20, temperature=0.8), torch.Generator().manual_seed(3))
    b = dec.generate(p, SamplingParams(max_new_tokens=20, temperature=0.8), torch.Generator().manual_seed(3))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20


def test_both_layouts_draft_alike_and_k_is_capped(trained, tmp_path):
    lm, cases, heads_dir = trained
    save_fasterdecoding(load_medusa(heads_dir), tmp_path / "fd")
    hidden = torch.randn(2, 64)
    ids = np.zeros((2, 8), np.int32)
    a = build_proposer(cfg(heads_dir, k=5), 128, target=lm)
    b = build_proposer(cfg(tmp_path / "fd", k=5), 128, target=lm)
    reqs = [DraftRequest(b, ids[b], 4, hidden[b:b + 1]) for b in range(2)]
    for p in (a, b):
        for r in reqs:
            p.start_request(r.slot, r.tokens)
    da, db = a.propose(reqs, [5, 5]), b.propose(reqs, [5, 5])
    assert len(da) == 2 and int(da.num_tokens.max()) <= 3  # 3 heads: at most 3 drafts
    assert torch.equal(da.token_ids, db.token_ids) and da.probs is None


def test_k_defaults_to_the_heads_and_more_than_them_is_said(trained, caplog):
    """As vLLM: k left unset drafts one token a head; a k above the heads drafts as many as there are
    heads, said once, and the config (a bench row's k) holds what runs."""
    import logging

    lm, _, heads_dir = trained
    c = SpecConfig.from_dict({"method": "medusa", "model": str(heads_dir)}).validated()
    assert build_proposer(c, 128, target=lm).k == 3 and c.num_speculative_tokens == 3
    c = cfg(heads_dir, k=5)
    with caplog.at_level(logging.WARNING, logger="specctl"):
        assert build_proposer(c, 128, target=lm).k == 3
    assert "num_speculative_tokens (5) > the 3 Medusa heads" in caplog.text and c.num_speculative_tokens == 3


def test_errors_name_the_fix(trained, tiny_model_dir, tmp_path):
    lm, _, heads_dir = trained
    with pytest.raises(ModelError, match="no Medusa heads"):
        build_proposer(cfg(tmp_path), 128, target=lm)
    wrong = MedusaHeads(32, 128, 2)
    with pytest.raises(ModelError, match="hidden size 32"):
        MedusaProposer(cfg(heads_dir), target=lm, max_model_len=128, heads=wrong)
    with pytest.raises(ConfigError, match="no parent"):
        build_proposer(cfg(heads_dir, speculative_token_tree="[(0, 1)]"), 128, target=lm)


def test_auto_tree_takes_the_likeliest_paths():
    acc = [[0.6, 0.25, 0.1], [0.5, 0.1, 0.0], [0.4, 0.0, 0.0]]  # head k's rank-r accuracy
    # path probabilities: (0,) .6, (0,0) .3, (1,) .25, (1,0) .125, (0,0,0) .12, (2,) .1, (0,1) .06 ...
    assert auto_tree(acc, 5, 3) == [(0,), (0, 0), (1,), (1, 0), (0, 0, 0)]
    assert auto_tree(acc, 5, 1) == [(0,), (1,), (2,)]  # depth 1: only head 0's ranks (zero-accuracy ranks never)
    big = auto_tree(acc, 40, 3)
    assert len(big) == len(set(big)) and all(p[:-1] in big or len(p) == 1 for p in big)  # a connected tree
    assert all(acc[d][r] > 0 for p in big for d, r in enumerate(p))
    tree_from_choices(big, 3)  # a valid Medusa tree


def test_auto_tree_from_the_heads_calibration(trained, tmp_path):
    lm, cases, heads_dir = trained
    import shutil

    cal = tmp_path / "heads"
    shutil.copytree(heads_dir, cal)
    c = json.loads((cal / "config.json").read_text())
    with pytest.raises(ConfigError, match="rank accuracies"):  # heads trained without a held-out split
        build_proposer(cfg(cal, speculative_token_tree="auto"), 128, target=lm)
    c["specctl"]["rank_accuracy"] = [[0.7, 0.2, 0.05], [0.6, 0.2, 0.05], [0.5, 0.2, 0.05]]
    (cal / "config.json").write_text(json.dumps(c))
    prop = build_proposer(cfg(cal, speculative_token_tree="auto", speculative_num_draft_tokens=7), 160, target=lm)
    assert set(prop.tree[0][1:]) == set(auto_tree(c["specctl"]["rank_accuracy"], 7, 3))  # sorted by level there
    assert greedy_acceptance(SpecDecoder(TargetRunner(lm.model, 160), prop, 3), cases) > 2.5
    with pytest.raises(ConfigError, match="EAGLE tree options"):  # the node count alone is not a Medusa option
        SpecConfig.from_dict({"method": "medusa", "model": "x", "speculative_num_draft_tokens": 8})


def test_token_tree_parsing():
    assert parse_token_tree("[(0,), (1,), (0, 0)]") == [(0,), (1,), (0, 0)]
    assert parse_token_tree([[0], [0, 1]]) == [(0,), (0, 1)]
    assert len(parse_token_tree("default")) == 10
    for bad in ("[(0,), oops]", "[]", [[-1]], "3"):
        with pytest.raises(ConfigError, match="speculative_token_tree"):
            parse_token_tree(bad)


@pytest.mark.parametrize("tree", [None, "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"])
def test_batched_greedy_equals_plain(trained, run_batched, tree):
    """Requests decoding together (chains or draft trees in one ragged forward) give their plain output."""
    lm, cases, heads_dir = trained
    extra = {} if tree is None else {"speculative_token_tree": tree}
    dec = SpecDecoder(TargetRunner(lm.model, 160), build_proposer(cfg(heads_dir, **extra), 160, target=lm), 3)
    got = run_batched(dec, [p for p, _ in cases[:10]], [SamplingParams(max_new_tokens=NEW)] * 10)
    assert [r.token_ids for r in got] == [o for _, o in cases[:10]]
    assert sum(r.stats.num_accepted_tokens for r in got) > 10


@pytest.mark.parametrize("tree", [None, "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"])
def test_a_batch_runs_the_heads_once_and_each_draft_is_its_own(trained, run_batched, tree):
    lm, cases, heads_dir = trained
    extra = {} if tree is None else {"speculative_token_tree": tree}
    prop = build_proposer(cfg(heads_dir, **extra), 160, target=lm)
    calls = []
    orig = prop.propose

    def checked(requests, ks):
        out = orig(requests, ks)
        calls.append(([DraftRequest(r.slot, r.tokens.copy(), r.n, r.hidden) for r in requests], ks, out))
        return out

    prop.propose = checked
    run_batched(SpecDecoder(TargetRunner(lm.model, 160), prop, 3), [p for p, _ in cases[:8]],
                [SamplingParams(max_new_tokens=NEW)] * 8)
    assert calls and max(len(reqs) for reqs, *_ in calls) > 1
    for reqs, ks, out in calls:
        for r, k, d in zip(reqs, ks, out.drafts):
            prop.start_request(r.slot, r.tokens)
            alone = orig([r], [k])[0]
            assert d.ids == alone.ids and d.parents == alone.parents
