"""specctl/training/replay.py: greedy decoding replayed from the target's states gives what the decoder
measures (drafting steps and accepted tokens) for a chain and for EAGLE-2's tree."""

from __future__ import annotations

import pytest
import torch

from specctl.chat import template_ids
from specctl.config import SpecConfig
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.loading import load_model
from specctl.runtime.proposers import build_proposer
from specctl.runtime.runner import TargetRunner
from specctl.training import data as D
from specctl.training.replay import accepted_length, replay_acceptance, replay_records
from specctl.training.eagle_states import target_states


def test_accepted_length_walks_a_chain_and_a_tree():
    assert accepted_length([5, 6, 7], None, [5, 6, 9, 1]) == 2
    assert accepted_length([5, 6, 7], None, [5, 6]) == 2  # the answer ends
    assert accepted_length([4], None, [5]) == 0
    # root -> 1 (-> 3, -> 4), root -> 2 (-> 5): the path 2, 5 is taken where the answer goes 2, 5
    ids, parents = [10, 20, 30, 40, 50], [-1, -1, 0, 0, 1]
    assert accepted_length(ids, parents, [20, 50, 7]) == 2
    assert accepted_length(ids, parents, [10, 40]) == 2
    assert accepted_length(ids, parents, [10, 50]) == 1  # 50 is 20's child, not 10's
    assert accepted_length(ids, parents, [30]) == 0


@pytest.mark.parametrize("tree", [None, {"speculative_eagle_topk": 3, "speculative_num_draft_tokens": 12}])
def test_replay_counts_what_the_decoder_counts(trained_eagle, tiny_model_dir, tree):
    eagle3 = trained_eagle[3]
    loaded = load_model(tiny_model_dir, dtype="float32")
    conf = {"method": "eagle3", "model": eagle3["export"], "num_speculative_tokens": 4, **(tree or {})}
    aux = tuple(eagle3["aux_layers"])
    params = SamplingParams(max_new_tokens=20)
    plain = SpecDecoder(TargetRunner(loaded.model, 256))
    dec = SpecDecoder(TargetRunner(loaded.model, 256), build_proposer(SpecConfig.from_dict(conf), 256, target=loaded), 4)
    seqs, drafts, accepted = [], 0, 0
    for text in trained_eagle["prompts"][:12]:
        ids = template_ids(loaded.tokenizer, [{"role": "user", "content": text}], True)
        answer = plain.generate(ids, params).token_ids
        got = dec.generate(ids, params)
        assert got.token_ids == answer
        drafts, accepted = drafts + got.stats.num_drafts, accepted + got.stats.num_accepted_tokens
        tokens = list(ids) + list(answer)
        st = target_states(loaded.model, torch.tensor([tokens]), aux)
        seqs.append((tokens, len(ids), st["hidden"][0], st["aux"][0]))
    assert accepted > 0  # the draft was trained on these answers: a test that could not tell a walk from nothing fails
    prop = build_proposer(SpecConfig.from_dict(conf), 256, target=loaded)
    r = replay_acceptance(prop, seqs, 4, max_new_tokens=20)
    assert (r["steps"], r["accepted_tokens"]) == (drafts, accepted)
    assert r["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    # the same from records as self_distill writes them (the recipe's held-out file), the states computed there
    records = [D.parse_record({"messages": [{"role": "user", "content": "-"}, {"role": "assistant", "content": "-"}],
                               "prompt_ids": t[:s], "response_ids": t[s:]}, "x") for t, s, _, _ in seqs]
    assert replay_records(build_proposer(SpecConfig.from_dict(conf), 256, target=loaded), loaded, records, 4,
                          max_new_tokens=20) == r


@pytest.mark.parametrize("tree", [None, "[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"])
def test_medusa_replay_counts_what_the_decoder_counts(trained_medusa, tree):
    """Medusa reads the state that emitted the last token (DraftRequest.hidden): the replay hands it over."""
    from tests.conftest import MEDUSA_NEW

    lm, cases, heads = trained_medusa
    conf = {"method": "medusa", "model": str(heads), "num_speculative_tokens": 3}
    if tree:
        conf["speculative_token_tree"] = tree
    dec = SpecDecoder(TargetRunner(lm.model, 160), build_proposer(SpecConfig.from_dict(conf), 160, target=lm), 3)
    seqs, drafts, accepted = [], 0, 0
    for p, out in cases:
        got = dec.generate(p, SamplingParams(max_new_tokens=MEDUSA_NEW))
        assert got.token_ids == out
        drafts, accepted = drafts + got.stats.num_drafts, accepted + got.stats.num_accepted_tokens
        st = target_states(lm.model, torch.tensor([p + out]))
        seqs.append((p + out, len(p), st["hidden"][0], None))
    assert accepted > 0
    r = replay_acceptance(build_proposer(SpecConfig.from_dict(conf), 160, target=lm), seqs, 3, max_new_tokens=MEDUSA_NEW)
    assert (r["steps"], r["accepted_tokens"]) == (drafts, accepted)
