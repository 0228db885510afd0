"""train-mtp's data: padded sequences learn as each sequence alone, the loss vocabulary, the rows learnt,
and a states cache (train-eagle's) that serves MTP training without running the target again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specctl.training import data as D
from specctl.training import mtp_data as MD
from specctl.training.mtp import FrozenTarget, MtpLoss, MtpTrainConfig, evaluate, init_stack, step_weights, train_mtp


@pytest.fixture(scope="module")
def loopy(tiny_model_factory, tmp_path_factory):
    """A tiny llama whose greedy output loops, 16 of its own answers as exact-id records in a file."""
    from specctl.runtime.loading import load_model
    from tests.conftest import loopy_answers

    path = tiny_model_factory(seed=1, initializer_range=0.05)
    lm = load_model(path, dtype="float32")
    pairs = loopy_answers(lm, 16, 10, 32)
    f = tmp_path_factory.mktemp("mtp-data") / "answers.jsonl"
    f.write_text("".join(json.dumps(_line(lm, p, r)) + "\n" for p, r in pairs))
    return path, lm, f, [D.Record(prompt_ids=p, response_ids=r) for p, r in pairs]


def _line(lm, p: list[int], r: list[int]) -> dict:
    """A self-distilled answer's record: the messages and their exact ids."""
    return {"messages": [{"role": "user", "content": lm.tokenizer.decode(p)},
                         {"role": "assistant", "content": lm.tokenizer.decode(r)}], "prompt_ids": p, "response_ids": r}


def _data(lm, recs, prompt_rows=1.0) -> MD.MtpData:
    exs = [e for r in recs for e in D.encode(None, r, 64)]
    states = []
    for e in exs:
        h, y = MD.target_states(lm.model, torch.tensor([e.input_ids]))
        states.append({"hidden": h[0], "argmax": y[0]})
    return MD.MtpData.from_examples(exs, states, prompt_rows, seed=3)


@pytest.mark.parametrize("soft", [False, True])
def test_a_padded_batch_learns_as_each_sequence_alone(loopy, soft):
    """Two sequences of different lengths in one right-padded batch: the loss and its gradient are the sum of
    each sequence's alone (padding is never read), over the global batch's label counts; with the target's
    argmax as the label and with its distribution (``soft``)."""
    _, lm, _, recs = loopy
    data = _data(lm, recs[:2])
    assert data.tokens[0].numel() != data.tokens[1].numel()
    stack = init_stack(lm.model, 1, "mimo")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in stack.parameters():
            p.add_(0.02 * torch.randn_like(p))  # off the identity start, so every depth's loss differs
    frozen = FrozenTarget(lm.model)
    loss = MtpLoss(stack, frozen, 3, step_weights(3), soft)
    counts = data.counts([0, 1], 3)
    assert counts.tolist() == [sum(max(0, int(t.numel()) - d) for t in data.tokens) for d in (1, 2, 3)]
    both = loss(*data.batch([0, 1]), counts)
    g_both = torch.autograd.grad(both, list(stack.parameters()))
    alone = [loss(*data.batch([i]), counts) for i in (0, 1)]
    g_alone = torch.autograd.grad(alone[0] + alone[1], list(stack.parameters()))
    torch.testing.assert_close(both, alone[0] + alone[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(g_both, g_alone):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    ev1, ev4 = (evaluate(stack, frozen, _data(lm, recs[:6]), 3, batch_size=bs) for bs in (1, 4))
    assert ev1 == ev4 and 0 <= ev1["top1_per_depth"][0] <= 1


def test_rows_learnt_are_the_answers_and_a_seeded_share_of_the_prompts(loopy):
    _, lm, _, recs = loopy
    exs = [e for r in recs[:4] for e in D.encode(None, r, 64)]
    none, some = _data(lm, recs[:4], 0.0), _data(lm, recs[:4], 0.5)
    for e, y, y2 in zip(exs, none.labels, some.labels):
        answer_next = torch.tensor(list(e.loss_mask[1:]) + [0], dtype=torch.bool)
        assert torch.equal(y != MD.IGNORE, answer_next)  # row t learnt iff token t+1 is an answer's
        assert bool((y2 != MD.IGNORE)[answer_next].all())
    extra = sum(int(((y2 != MD.IGNORE) & (y == MD.IGNORE)).sum()) for y, y2 in zip(none.labels, some.labels))
    assert extra > 0
    assert [torch.equal(a, b) for a, b in zip(some.labels, _data(lm, recs[:4], 0.5).labels)] == [True] * 4  # seeded


def test_the_loss_vocabulary_is_the_most_frequent_labels_and_its_loss_is_the_softmax_over_them(loopy):
    _, lm, _, recs = loopy
    data = _data(lm, recs[:6])
    V = lm.model.args.vocab_size
    ids, remap, covered = MD.loss_vocab(data, 4, V, always=[0])
    every = torch.cat(data.labels)
    freq = torch.bincount(every, minlength=V)
    assert set(ids.tolist()) == set(freq.topk(4).indices.tolist()) | {0}
    assert covered == pytest.approx(float(freq[ids].sum()) / every.numel())
    cut = data.remapped(remap)
    for y, yc in zip(data.labels, cut.labels):
        inside = remap[y] != MD.IGNORE
        assert torch.equal(ids[yc[inside]], y[inside]) and bool((yc[~inside] == MD.IGNORE).all())
    # the loss over the cut head = CE over those columns of the whole head's logits, at the rows kept
    stack, frozen = init_stack(lm.model, 1, "mimo"), FrozenTarget(lm.model)
    learner = FrozenTarget(lm.model)
    learner.head_weight = frozen.head_weight[ids]
    tok, h0, y = cut.batch([0, 1])
    got = MtpLoss(stack, learner, 1, torch.ones(1))(tok, h0, y, cut.counts([0, 1], 1))
    from specctl.training.mtp import unroll
    lg = unroll(stack, frozen, tok, h0, 1)[0][..., ids]  # [B, T-1, n]
    yy = y[:, 1:]
    want = torch.nn.functional.cross_entropy(lg[yy != MD.IGNORE], yy[yy != MD.IGNORE])
    torch.testing.assert_close(got, want)
    # soft labels: the cross-entropy against the target's own distribution over those columns, at the row whose
    # argmax is the label (depth 1's row t learns the target's choice at t + 1), renormalised there
    soft = MtpLoss(stack, learner, 1, torch.ones(1), soft=True)(tok, h0, y, cut.counts([0, 1], 1))
    p = torch.softmax(torch.nn.functional.linear(h0[:, 1:].float(), frozen.head_weight[ids]), -1)[yy != MD.IGNORE]
    want_soft = -(p * torch.log_softmax(lg[yy != MD.IGNORE], -1)).sum(-1).mean()
    torch.testing.assert_close(soft, want_soft)
    assert not torch.allclose(soft, got)


def test_a_states_cache_from_train_eagle_serves_mtp_without_running_the_target(loopy, tmp_path, monkeypatch):
    """train-mtp --cache-hidden-states reads train-eagle's cache of the same data (the target does not run
    again), trains on those sequences with a loss vocabulary, evaluates on --eval-data, and exports."""
    from specctl.drafts.mtp_files import load_mtp
    from specctl.training import eagle as E
    from specctl.training import eagle_states as S

    path, lm, f, _ = loopy
    held = tmp_path / "held.jsonl"
    held.write_text("".join(f.read_text().splitlines(True)[12:]))
    train_f = tmp_path / "train.jsonl"
    train_f.write_text("".join(f.read_text().splitlines(True)[:12]))
    cache = tmp_path / "states"
    E.train(E.EagleTrainConfig(model=str(path), output=str(tmp_path / "eagle"), data=[str(train_f)], eval_data=[str(held)],
                               steps=1, batch_size=4, seq_len=64, dtype="float32", cache_hidden_states=str(cache)),
            log=lambda m: None)
    index = json.loads((cache / "index.json").read_text())
    logs: list[str] = []
    with monkeypatch.context() as m:
        m.setattr(S, "target_states", lambda *a, **k: pytest.fail("the target ran again"))
        m.setattr(MD, "target_states", lambda *a, **k: pytest.fail("the target ran again"))
        cfg = MtpTrainConfig(model=str(path), output=str(tmp_path / "mtp"), data=[str(train_f)], eval_data=[str(held)],
                             cache_hidden_states=str(cache), seq_len=64, batch_size=4, lr=1e-2, depth=2, steps=30,
                             loss_vocab_size=16, prompt_rows=0.0, layout="mimo")
        s = train_mtp(cfg, progress=logs.append)
    assert any("reusing cached target states" in x and "16 of 16" in x for x in logs)
    assert any("loss vocabulary:" in x for x in logs)
    assert json.loads((cache / "index.json").read_text()) == index  # still train-eagle's, whole
    assert s["sequences"] == 16 and s["steps"] == 30
    assert s["final_loss"] < s["first_loss"]
    assert 1.0 <= s["eval"]["mean_acceptance_length"] <= 3.0
    assert json.loads((tmp_path / "mtp" / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
    stack = load_mtp(tmp_path / "mtp", lm.model)
    vocab = json.loads((tmp_path / "mtp" / "draft_vocab.json").read_text())  # the loss vocabulary, for the proposer
    assert stack.num_layers == 1 and stack.vocab_ids.tolist() == vocab["target_ids"] and len(vocab["target_ids"]) >= 16


def test_eval_data_without_a_states_cache_is_a_usage_error(tmp_path):
    from specctl.errors import UsageError

    with pytest.raises(UsageError, match="--eval-data needs --cache-hidden-states"):
        MtpTrainConfig(model="m", output=str(tmp_path / "o"), data=["d.jsonl"], eval_data=["x.jsonl"]).validated()
