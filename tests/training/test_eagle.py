"""EAGLE training: the TTT mask on a hand-built case, loss masking of padded rows, data formats,
the hidden-state cache, and --resume reproducing an uninterrupted run exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import specctl.training.eagle as E
import specctl.training.eagle_states as S
import specctl.training.eagle_ttt as T
from specctl.drafts.eagle import EagleDraft, spec_from_target
from specctl.errors import UsageError
from specctl.training.checkpoints import checkpoint_dirs
from specctl.runtime.loading import load_model


def test_ttt_mask_hand_built():
    m = T.ttt_mask(3, 1).int().tolist()
    assert m == [[1, 0, 0, 1, 0, 0],
                 [1, 1, 0, 0, 1, 0],
                 [1, 1, 1, 0, 0, 1]]
    assert T.ttt_mask(4, 0).equal(torch.ones(4, 4, dtype=torch.bool).tril())
    assert T.ttt_mask(5, 3).shape == (5, 20)


def test_shift_and_step_valid():
    x = torch.arange(10).view(2, 5)
    assert T.shift(x, 2).tolist() == [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]]
    v = T.step_valid(torch.tensor([5, 3]), 5, 1)  # row t is scored at step 1 when t + 2 < length
    assert v.tolist() == [[True, True, True, False, False], [True, False, False, False, False]]


@pytest.mark.parametrize("version", [3, 1])
def test_losses_ignore_padding(tiny_model, version):
    torch.manual_seed(0)
    d = EagleDraft(spec_from_target(tiny_model.args, version, 128))
    if version == 3:
        d.d2t.zero_()
        d.t2d.fill_(True)
    ids = torch.randint(6, 128, (2, 10))
    lengths = torch.tensor([10, 6])
    st = S.target_states(tiny_model, ids, d.spec.aux_layers)
    st.update(ids=ids, lengths=lengths)
    outs = T.ttt_forward(d, tiny_model.embed.weight, ids, d.feature(st["hidden"], st.get("aux")), 3)
    loss, stats = T.eagle_losses(d, outs, st, tiny_model.head_weight)
    assert loss.ndim == 0 and torch.isfinite(loss) and len(stats["rows"]) == 3
    assert stats["rows"] == [9 + 5, 8 + 4, 7 + 3]  # rows t with t+1+i < length
    # garbage in the padded tail of row 1 changes nothing
    ids2 = ids.clone()
    ids2[1, 6:] = 7
    st2 = dict(st, ids=ids2)
    for k in ("hidden", "aux"):
        if k in st2:
            st2[k] = st[k].clone()
            st2[k][1, 6:] = 3.0
    st2["argmax"] = st["argmax"].clone()
    st2["argmax"][1, 6:] = 1
    outs2 = T.ttt_forward(d, tiny_model.embed.weight, ids2, d.feature(st2["hidden"], st2.get("aux")), 3)
    loss2, _ = T.eagle_losses(d, outs2, st2, tiny_model.head_weight)
    torch.testing.assert_close(loss, loss2)
    loss.backward()
    assert d.fc.weight.grad is not None and d.fc.weight.grad.abs().sum() > 0


def test_load_sequences_reads_data_and_self_distills(tiny_model_dir, tmp_path):
    """Through specctl.training.data: records of every kind, then the target's answers to prompts."""
    loaded = load_model(tiny_model_dir, dtype="float32")
    data, prompts = tmp_path / "d.jsonl", tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"text": "plain text here"},
        {"prompt": "hi", "response": "hello there"},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a!"}]},
    ]) + "\n")
    prompts.write_text(json.dumps({"prompt": "print x"}) + "\n")
    cfg = E.EagleTrainConfig(model=str(tiny_model_dir), output=str(tmp_path / "run"), data=str(data),
                             self_distill=str(prompts), max_new_tokens=6, seq_len=64)
    seqs = E.load_sequences(cfg, loaded, lambda m: None)
    tok = loaded.tokenizer
    assert len(seqs) == 4 and "plain text here" in tok.decode(seqs[0])
    assert "<|im_start|>assistant\nhello there<|im_end|>" in tok.decode(seqs[1])
    assert tok.decode(seqs[3]).startswith("<|im_start|>user\nprint x<|im_end|>") and len(seqs[3]) > 20
    assert (tmp_path / "run" / "data" / "self_distill.jsonl").exists()


def _cfg(tiny_model_dir, tmp_path, **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("\n".join(json.dumps({"text": f"def f{i}(x): return x + {i} * y"}) for i in range(12)) + "\n")
    base = dict(model=str(tiny_model_dir), output=str(tmp_path / "run"), data=str(data), steps=6, batch_size=4,
                seq_len=32, eval_split=0.2, eval_every=3, save_every=3, lr=1e-3, draft_vocab_size=64, ttt_steps=2)
    base.update(kw)
    return E.EagleTrainConfig(**base)


def test_resume_reproduces_uninterrupted_run(tiny_model_dir, tmp_path, monkeypatch):
    loaded = load_model(tiny_model_dir, dtype="float32")
    full = E.train(_cfg(tiny_model_dir, tmp_path / "a"), loaded=loaded, log=lambda m: None)
    a = load_file(f"{full['export']}/model.safetensors")

    calls = {"n": 0}
    real = T.eagle_losses

    def crash_at_step_5(*args, **kw):
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 5:
                raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(T, "eagle_losses", crash_at_step_5)
    cfg = _cfg(tiny_model_dir, tmp_path / "b")
    with pytest.raises(KeyboardInterrupt):
        E.train(cfg, loaded=loaded, log=lambda m: None)
    monkeypatch.setattr(T, "eagle_losses", real)
    ck = checkpoint_dirs(tmp_path / "b" / "run")[-1]
    assert json.loads((ck / "trainer_state.json").read_text())["step"] == 3
    assert json.loads((ck / "training_config.json").read_text())["steps"] == 6
    resumed = E.train(_cfg(tiny_model_dir, tmp_path / "b", resume=True), loaded=loaded, log=lambda m: None)
    b = load_file(f"{resumed['export']}/model.safetensors")
    assert resumed["steps"] == 6 and sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
    ev = resumed["final"]
    assert len(ev["acceptance_per_position"]) == 2
    assert ev["simulated_acceptance_length"] == pytest.approx(1 + sum(ev["acceptance_per_position"]))


def test_hidden_state_cache_written_then_reused(tiny_model_dir, tmp_path):
    loaded = load_model(tiny_model_dir, dtype="float32")
    cache = tmp_path / "states"
    logs: list[str] = []
    bars: list[tuple] = []
    E.train(_cfg(tiny_model_dir, tmp_path, steps=2, cache_hidden_states=str(cache)), loaded=loaded, log=logs.append,
            progress=lambda *a: bars.append(a))
    assert bars[-2:] == [("train", 1, 2), ("train", 2, 2)]  # the command's progress bar is fed every step
    shards = sorted(cache.glob("shard-*.safetensors"))
    assert shards and (cache / "index.json").exists()
    t = load_file(str(shards[0]))
    assert any(k.endswith(".aux") for k in t) and t[next(k for k in t if k.endswith(".aux"))].dtype == torch.bfloat16
    logs.clear()
    E.train(_cfg(tiny_model_dir, tmp_path, steps=2, cache_hidden_states=str(cache), output=str(tmp_path / "run2")),
            loaded=loaded, log=logs.append)
    assert any("reusing cached target states" in m for m in logs)


def test_feature_loss_adds_the_normed_state_regression(tiny_model, tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    d = EagleDraft(spec_from_target(tiny_model.args, 3, 128))
    d.t2d.fill_(True)
    ids = torch.randint(6, 128, (2, 9))
    st = S.target_states(tiny_model, ids, d.spec.aux_layers)
    st.update(ids=ids, lengths=torch.tensor([9, 7]))
    outs = T.ttt_forward(d, tiny_model.embed.weight, ids, d.feature(st["hidden"], st.get("aux")), 3)
    base, _ = T.eagle_losses(d, outs, st, tiny_model.head_weight)
    both, _ = T.eagle_losses(d, outs, st, tiny_model.head_weight, feature_w=0.5)
    by_hand = 0.0
    for i, o in enumerate(outs):  # step i, row t: the draft's normed out against the target's state at t+1+i
        m = T.step_masks(d, st, i)[1]
        target = T.shift(st["hidden"], 1 + i)
        reg = torch.nn.functional.smooth_l1_loss(d.norm(o), target, reduction="none").mean(-1)
        by_hand = by_hand + 0.8 ** i * 0.5 * reg[m].mean()
    torch.testing.assert_close(both - base, by_hand)
    with pytest.raises(UsageError):
        _cfg(tiny_model_dir, tmp_path, version=1, draft_vocab_size=None, feature_loss=0.1).validated()


def test_state_argmax_is_what_the_target_decodes(tiny_model_factory, bf16_path):
    """The labels (the target's argmax at every position) come from the target's own LM head path, so a
    bf16 target's labels are its serving argmax, ties included, not torch's bf16 matmul's."""
    from specctl.modeling import KVCache

    lm = load_model(tiny_model_factory(seed=3), dtype="bfloat16")
    torch.manual_seed(0)
    ids = torch.randint(6, 128, (4, 96))
    st = S.target_states(lm.model, ids)
    for b in range(4):
        cache = KVCache(lm.model.args, 1, 96, torch.bfloat16, "cpu")
        logits, _, _ = lm.model(ids[b:b + 1], 0, cache, torch.ones(96, 96, dtype=torch.bool).tril())
        assert torch.equal(st["argmax"][b], logits[0].argmax(-1))


def test_fc_init_last_passes_the_deepest_aux_state(tiny_model_dir, tmp_path):
    loaded = load_model(tiny_model_dir, dtype="float32")
    cfg = _cfg(tiny_model_dir, tmp_path, fc_init="last")
    d = E.build_draft(loaded.model, cfg, [[1, 2, 3, 4]], loaded.tokenizer)
    H = loaded.model.args.hidden_size
    aux = torch.randn(1, 3, len(d.spec.aux_layers) * H)
    torch.testing.assert_close(d.feature(None, aux), aux[..., -H:])
    with pytest.raises(UsageError):
        _cfg(tiny_model_dir, tmp_path, fc_init="zeros").validated()


def test_answer_rows_and_a_fraction_of_the_prompt_rows():
    src = S.StateSource.__new__(S.StateSource)
    src.masks = [[0, 0, 0, 1, 1, 1], [1, 1, 1, 1]]
    r = src._rows([0, 1], 6, 0.0, None)
    assert r["rows"].tolist() == [[2, 3, 4], [0, 1, 2]] and r["row_mask"].all()  # row t reads x[t+1]
    r = src._rows([0, 1], 6, 1.0, None)
    assert r["rows"].shape == (2, 6) and r["row_mask"].all()


def test_resume_reads_the_old_checkpoint_layout(tiny_model_dir, tmp_path):
    """A run folder of the layout before checkpoints/ (OUTPUT/checkpoint/state.pt, one torch.save'd dict) resumes."""
    loaded = load_model(tiny_model_dir, dtype="float32")
    full = E.train(_cfg(tiny_model_dir, tmp_path / "a"), loaded=loaded, log=lambda m: None)
    ck = tmp_path / "a" / "run" / "checkpoints" / "step-0000003"
    old = tmp_path / "b" / "run" / "checkpoint"
    old.mkdir(parents=True)
    torch.save({"draft": {k.removeprefix("draft."): v for k, v in load_file(str(ck / "model.safetensors")).items()},
                "opt": torch.load(ck / "optimizer.bin", weights_only=False),
                "sched": torch.load(ck / "custom_checkpoint_0.pkl", weights_only=False), "step": 3,
                "history": json.loads((ck / "trainer_state.json").read_text())["history"], "seqs": [], "masks": []},
               old / "state.pt")
    with pytest.raises(UsageError, match="already holds checkpoints"):
        E.train(_cfg(tiny_model_dir, tmp_path / "b"), loaded=loaded, log=lambda m: None)
    resumed = E.train(_cfg(tiny_model_dir, tmp_path / "b", resume=True), loaded=loaded, log=lambda m: None)
    assert resumed["steps"] == 6
    a, b = load_file(f"{full['export']}/model.safetensors"), load_file(f"{resumed['export']}/model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def test_eval_data_reports_the_acceptance_decoding_then_measures(tiny_model_factory, tmp_path):
    """--eval-data: training evaluates on the target's own greedy answers to the prompts decoding then
    runs (never trained on), and the mean acceptance length it prints at k = its TTT steps agrees with
    what greedy speculative decoding with the exported draft measures on those prompts, within 10%."""
    import numpy as np

    from specctl.config import SpecConfig
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.proposers import build_proposer
    from specctl.runtime.runner import TargetRunner
    from specctl.training import data as D
    from specctl.workloads import Request

    folder = tiny_model_factory(seed=1, initializer_range=0.05)  # greedy output falls into loops: drafts pay
    loaded = load_model(folder, dtype="float32")
    rng = np.random.default_rng(3)

    def prompts(n, tag):
        return [Request(id=f"{tag}{i}", workload="t", messages=[{"role": "user", "content": "".join(
            chr(c) for c in rng.integers(97, 123, int(rng.integers(6, 14))))}]) for i in range(n)]

    train_reqs, held_reqs = prompts(24, "t"), prompts(6, "h")
    D.self_distill(loaded, train_reqs, max_new_tokens=40, cache=tmp_path / "train.jsonl")
    D.self_distill(loaded, held_reqs, max_new_tokens=40, cache=tmp_path / "held.jsonl")
    cfg = E.EagleTrainConfig(model=str(folder), output=str(tmp_path / "run"), data=[str(tmp_path / "train.jsonl")],
                             eval_data=[str(tmp_path / "held.jsonl")], steps=60, batch_size=4, seq_len=96,
                             eval_every=0, save_every=0, lr=3e-3, draft_vocab_size=128, ttt_steps=2)
    summary = E.train(cfg, loaded=loaded, log=lambda m: None)
    assert summary["eval_sequences"] == 6 and summary["train_sequences"] == 24
    trained = summary["final"]["decoding_acceptance_length"]

    spec = SpecConfig.from_dict({"method": "eagle3", "model": summary["export"], "num_speculative_tokens": 2})
    drafted = accepted = 0
    for req in held_reqs:
        ids = D.chat.render(loaded.tokenizer, req.messages)
        dec = SpecDecoder(TargetRunner(loaded.model, 160), build_proposer(spec, 160, target=loaded), 2)
        res = dec.generate(ids, SamplingParams(max_new_tokens=40, stop_token_ids=loaded.stop_token_ids))
        drafted += res.stats.num_drafts
        accepted += res.stats.num_accepted_tokens
    measured = 1 + accepted / drafted
    assert trained > 1.3, trained  # it learnt something: the comparison means something
    assert abs(trained - measured) <= 0.1 * measured, (trained, measured)
    print(f"decoding walk {trained:.3f}, every-row average {summary['final']['simulated_acceptance_length']:.3f}, "
          f"measured {measured:.3f}")


def test_state_cache_resumes_and_serves_more_data(tiny_model, tmp_path, monkeypatch):
    """The states cache is written a shard at a time with its index: a run killed after the first shard
    computes only the rest, and a run on more data computes only the new sequences."""
    seqs = [[1 + (i * 7 + j) % 100 for j in range(12 + i % 5)] for i in range(80)]
    key = {"model": "tiny", "dtype": "float32"}
    computed = []
    real = S.target_states

    def counting(model, ids, aux):
        computed.append(ids.shape[0])
        if len(computed) == 9:  # the first shard (64 sequences) is written after 8 batches
            raise KeyboardInterrupt
        return real(model, ids, aux)

    monkeypatch.setattr(S, "target_states", counting)
    with pytest.raises(KeyboardInterrupt):
        S._cached_states(tiny_model, seqs, (0,), tmp_path, key, lambda m: None)
    computed.clear()
    monkeypatch.setattr(S, "target_states", lambda m, ids, a: (computed.append(ids.shape[0]), real(m, ids, a))[1])
    first = S._cached_states(tiny_model, seqs, (0,), tmp_path, key, lambda m: None)
    assert sum(computed) == 16  # the 64 in the shard were read back
    computed.clear()
    more = S._cached_states(tiny_model, seqs + [[5, 6, 7, 8, 9]], (0,), tmp_path, key, lambda m: None)
    assert sum(computed) == 1
    monkeypatch.setattr(S, "target_states", real)
    for i in (0, 63, 64, 79):
        torch.testing.assert_close(first[i]["hidden"], more[i]["hidden"])
    fresh = S.target_states(tiny_model, torch.tensor([seqs[70]]), (0,))
    torch.testing.assert_close(first[70]["hidden"].float(), fresh["hidden"][0].to(torch.bfloat16).float())
