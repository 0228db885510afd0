"""MTP proposer: both checkpoint layouts load and draft; incremental drafts (per-depth caches rolled back
with the target) equal drafts recomputed from scratch; greedy output with MTP equals plain greedy over
>= 20 prompts in fp32, with drafts accepted (the tiny MTP is first overfit on the tiny model's own
outputs); recursion past the number of modules warns; sampled drafts carry q."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from specctl.config import SpecConfig
from specctl.drafts.mtp import mtp_logits, mtp_step
from specctl.drafts.mtp_files import MTP_FILE, export_mtp, load_mtp, mtp_state_dict
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.proposers import build_proposer
from specctl.runtime.proposers.mtp import MtpProposer
from specctl.runtime.loading import load_model
from specctl.runtime.runner import TargetRunner
from specctl.training.mtp import init_stack, mtp_loss, step_weights, target_states, unroll

K = 3


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32")


PROMPTS = [torch.randint(6, 128, (12,), generator=torch.Generator().manual_seed(100 + i)).tolist() for i in range(24)]


def _own_outputs(loaded, new: int) -> list[list[int]]:
    """PROMPTS continued greedily by the tiny model (prompt + output ids)."""
    dec = SpecDecoder(TargetRunner(loaded.model, 256))
    return [p + dec.generate(p, SamplingParams(max_new_tokens=new, ignore_eos=True)).token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def trained_stack(loaded):
    """A 1-module MTP overfit (depth 3) on the tiny model's own greedy continuations of PROMPTS."""
    torch.manual_seed(0)
    seqs = torch.tensor(_own_outputs(loaded, 52))  # [24, 64]
    h0, y = target_states(loaded.model, seqs)
    stack = init_stack(loaded.model, 1)
    opt = torch.optim.AdamW(stack.parameters(), lr=1e-2)
    w = step_weights(K)
    for _ in range(60):
        loss = mtp_loss(unroll(stack, loaded.model, seqs, h0, K), y, w)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return stack.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def layout_dirs(loaded, trained_stack, tiny_model_dir, tmp_path_factory):
    """The trained stack as a DeepSeek-V3 draft folder and as a Qwen3-Next (mtp.*) draft folder."""
    ds = export_mtp(trained_stack, tiny_model_dir, tmp_path_factory.mktemp("mtp-ds"), head_weight=loaded.model.head_weight)
    qn = tmp_path_factory.mktemp("mtp-qn")
    for f in ds.iterdir():
        shutil.copy2(f, qn / f.name)
    from safetensors.torch import save_file

    save_file(mtp_state_dict(trained_stack, 2, layout="qwen3_next"), str(qn / MTP_FILE))
    return {"deepseek_v3": ds, "qwen3_next": qn}


def _reference_drafts(stack, model, seq: list[int], k: int) -> list[int]:
    """Greedy drafts recomputed from scratch (no cache reuse) for context ``seq``."""
    a = model.args
    t = torch.tensor([seq])
    h, _ = target_states(model, t[:, :-1])  # h^0 of positions 0..n-2
    n, drafts = len(seq), []
    for d in range(1, k + 1):
        toks = torch.tensor([(seq + drafts)[d:d + n - 1]])
        kc = torch.zeros(1, a.num_kv_heads, n, a.head_dim)
        h, normed = mtp_step(stack, model, d, h, toks, 0, kc, torch.zeros_like(kc))
        drafts.append(int(mtp_logits(stack, model, d, normed[0, -1]).argmax()))
    return drafts


@pytest.mark.parametrize("layout", ["deepseek_v3", "qwen3_next"])
def test_layout_loads_and_drafts(loaded, trained_stack, layout_dirs, layout):
    stack = load_mtp(layout_dirs[layout], loaded.model)
    assert stack.layout == layout and stack.num_layers == 1
    ref = trained_stack.layers[0]
    got = stack.layers[0]
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "norm.weight"):
        assert torch.equal(got.state_dict()[name], ref.state_dict()[name]), name
    for name, v in ref.block.state_dict().items():
        assert torch.equal(got.block.state_dict()[name], v), name
    assert got.head is None  # shared_head.head equal to the target's head is the target's head
    cfg = SpecConfig.from_dict({"method": "deepseek_mtp" if layout == "deepseek_v3" else "mtp",
                                "model": str(layout_dirs[layout]), "num_speculative_tokens": K})
    prop = build_proposer(cfg, 256, target=loaded)
    dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, K)
    res = dec.generate([7, 8, 9, 10, 11, 12], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert res.stats.num_drafts > 0 and res.stats.num_draft_tokens > 0


def test_incremental_drafts_equal_scratch(loaded, trained_stack):
    """Drafts from the rolled-back per-depth caches equal drafts recomputed from the whole context."""
    prop = MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": K}), target=loaded,
                       max_model_len=256, stack=trained_stack)
    seen = []
    orig = prop._drafts

    def checked(requests, ks):
        out = orig(requests, ks)
        seen.extend((r.tokens.tolist(), ids, k) for r, k, (ids, _) in zip(requests, ks, out) if ids)
        return out

    prop._drafts = checked
    dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, K)
    for p in ([20, 30, 40, 50, 60], [99, 98, 97]):
        dec.generate(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert len(seen) > 10
    for seq, ids, k in seen:
        assert ids == _reference_drafts(trained_stack, loaded.model, seq, k)[:len(ids)]


def test_greedy_equals_plain_with_drafts_accepted(loaded, trained_stack):
    prompts = PROMPTS  # 24 prompts, the ones the MTP was overfit on (their continuations)
    plain = SpecDecoder(TargetRunner(loaded.model, 256))
    prop = MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": K}), target=loaded,
                       max_model_len=256, stack=trained_stack)
    spec = SpecDecoder(TargetRunner(loaded.model, 256), prop, K)
    accepted = drafted = drafts = 0
    for p in prompts:
        sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
        a, b = plain.generate(p, sp), spec.generate(p, sp)
        assert a.token_ids == b.token_ids
        accepted += b.stats.num_accepted_tokens
        drafted += b.stats.num_draft_tokens
        drafts += b.stats.num_drafts
    assert drafted > 0
    assert 1 + accepted / drafts > 1.5, (accepted, drafted, drafts)  # trained on the model's own outputs


def test_recursion_warns(loaded, trained_stack, caplog, monkeypatch):
    import specctl.runtime.proposers.mtp as mtp_mod

    monkeypatch.setattr(mtp_mod, "_WARNED", set())
    for _ in range(2):  # once a process: bench builds a proposer for each pass
        with caplog.at_level(logging.WARNING, logger="specctl"):
            MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": 4}), target=loaded,
                        max_model_len=64, stack=trained_stack)
    assert caplog.text.count("recursively") == 1
    caplog.clear()
    monkeypatch.setattr(mtp_mod, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="specctl"):
        MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": 4}), target=loaded,
                    max_model_len=64, stack=trained_stack)
    assert "recursively" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specctl"):
        MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": 1}), target=loaded,
                    max_model_len=64, stack=trained_stack)
    assert "recursively" not in caplog.text


def test_k_left_unset_drafts_one_token_a_module(loaded, trained_stack, caplog):
    """As vLLM (num_nextn_predict_layers): unset k is the module count, not specctl's default 5 (which ran
    the one module recursively and warned)."""
    c = SpecConfig.from_dict({"method": "mtp"}).validated()
    with caplog.at_level(logging.WARNING, logger="specctl"):
        prop = MtpProposer(c, target=loaded, max_model_len=64, stack=trained_stack)
    assert prop.k == trained_stack.num_layers == 1 and c.num_speculative_tokens == 1
    assert "recursively" not in caplog.text


def test_sampled_drafts_carry_q(loaded, trained_stack):
    torch.manual_seed(0)
    prop = MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": K}), target=loaded,
                       max_model_len=128, stack=trained_stack)
    dec = SpecDecoder(TargetRunner(loaded.model, 128), prop, K)
    st = dec.start([10, 11, 12, 13], SamplingParams(max_new_tokens=20, temperature=0.8, ignore_eos=True),
                   torch.Generator().manual_seed(0))
    d = prop.propose([st.draft_request()], [K])
    assert d.probs is not None and d.probs.shape == (1, K, 128)
    n = int(d.num_tokens[0])
    assert torch.allclose(d.probs[0, :n].sum(-1), torch.ones(n), atol=1e-5)
    assert all(float(d.probs[0, i, int(d.token_ids[0, i])]) > 0 for i in range(n))
    while st.finish is None:
        dec.step(st)
    assert len(st.out) == 20


def test_target_without_mtp_is_a_clear_error(loaded):
    from specctl.errors import ModelError

    with pytest.raises(ModelError, match="no MTP modules"):
        build_proposer(SpecConfig.from_dict({"method": "mtp"}), 64, target=loaded)


def test_config_records_modules(layout_dirs):
    assert json.loads((layout_dirs["deepseek_v3"] / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_batched_greedy_equals_plain(loaded, trained_stack, run_batched):
    prompts = PROMPTS[:8] + PROMPTS[:2]  # two pairs of identical requests in flight together: told apart by slot
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = SpecDecoder(TargetRunner(loaded.model, 256))
    want = [plain.generate(p, sp).token_ids for p in prompts]
    prop = MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": K}), target=loaded,
                       max_model_len=256, stack=trained_stack)
    got = run_batched(SpecDecoder(TargetRunner(loaded.model, 256), prop, K), prompts, [sp] * len(prompts))
    assert [r.token_ids for r in got] == want
    assert sum(r.stats.num_accepted_tokens for r in got) > 10


def test_a_batch_drafts_every_depth_in_one_pass_and_each_draft_is_the_scratch_one(loaded, trained_stack, run_batched):
    prop = MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": K}), target=loaded,
                       max_model_len=256, stack=trained_stack)
    calls, seen = [], []
    orig = prop._drafts

    def checked(requests, ks):
        out = orig(requests, ks)
        calls.append(len(requests))
        seen.extend((r.tokens.tolist(), ids, k) for r, k, (ids, _) in zip(requests, ks, out) if ids)
        return out

    prop._drafts = checked
    sp = SamplingParams(max_new_tokens=30, ignore_eos=True)
    run_batched(SpecDecoder(TargetRunner(loaded.model, 256), prop, K), PROMPTS[:6], [sp] * 6)
    assert max(calls) > 1  # several requests' drafts in one call (one ragged pass per depth)
    for seq, ids, k in seen:
        assert ids == _reference_drafts(trained_stack, loaded.model, seq, k)[:len(ids)]


def test_batched_bf16_greedy_equals_plain(tiny_model_factory, bf16_path, run_batched):
    """In bf16, on every CPU path: a batch drafting through the ragged MTP step keeps each request's
    output the plain one (exactly on the row-independent kernel paths), the module's block fused where the
    target's are."""
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    stack = init_stack(load_model(folder, dtype="float32").model, 1).to(torch.bfloat16).eval().requires_grad_(False)
    lm = load_model(folder, dtype="bfloat16")  # (its weights may be packed for the CPU's kernels)
    prop = MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": K}), target=lm,
                       max_model_len=256, stack=stack)
    # the module's block runs through the fused C++ block wherever the target's blocks do (one call a block)
    assert [layer.block.fused for layer in prop.stack.layers] == [lm.model.layers[0].fused]
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True, record_margins=True)
    plain = SpecDecoder(TargetRunner(lm.model, 256))
    want = [plain.generate(p, sp) for p in PROMPTS[:6]]
    got = run_batched(SpecDecoder(TargetRunner(lm.model, 256), prop, K), PROMPTS[:6], [sp] * 6)
    for g, w in zip(got, want):
        if bf16_path == "torch" and g.token_ids != w.token_ids:  # the documented weaker guarantee
            i = next(i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b)
            assert w.margins[i] <= 2 ** -5
        else:
            assert g.token_ids == w.token_ids
    assert sum(r.stats.num_draft_tokens for r in got) > 0


def test_a_draft_vocabulary_cuts_the_head_and_output_stays_the_target_s(loaded, layout_dirs, tmp_path):
    """draft_vocab.json (train-mtp's loss vocabulary) beside the modules: every draft is one of its ids, greedy
    output equals plain with drafts accepted, sampled q rows live on those ids only; a file that does not fit
    the target is one line naming it."""
    from specctl.drafts.mtp_files import DRAFT_VOCAB_FILE
    from specctl.errors import ModelError

    folder = tmp_path / "mtp-vocab"
    shutil.copytree(layout_dirs["deepseek_v3"], folder)
    freq = torch.bincount(torch.tensor(_own_outputs(loaded, 52)).flatten(), minlength=128)
    ids = sorted(freq.topk(48).indices.tolist())
    (folder / DRAFT_VOCAB_FILE).write_text(json.dumps({"target_ids": ids}))
    cfg = {"method": "mtp", "model": str(folder), "num_speculative_tokens": K}
    prop = build_proposer(SpecConfig.from_dict(cfg), 256, target=loaded)
    assert prop.vocab_ids.tolist() == ids
    drafted = []
    orig = prop._drafts

    def seen(requests, ks):
        out = orig(requests, ks)
        drafted.extend(t for d, _ in out for t in d)
        return out

    prop._drafts = seen
    plain, spec = SpecDecoder(TargetRunner(loaded.model, 256)), SpecDecoder(TargetRunner(loaded.model, 256), prop, K)
    accepted = 0
    for p in PROMPTS[:8]:
        sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
        a, b = plain.generate(p, sp), spec.generate(p, sp)
        assert a.token_ids == b.token_ids
        accepted += b.stats.num_accepted_tokens
    assert drafted and set(drafted) <= set(ids) and accepted > 10
    st = spec.start([10, 11, 12, 13], SamplingParams(max_new_tokens=8, temperature=0.8, ignore_eos=True),
                    torch.Generator().manual_seed(0))
    d = prop.propose([st.draft_request()], [K])
    n = int(d.num_tokens[0])
    outside = torch.ones(128, dtype=torch.bool)
    outside[ids] = False
    assert torch.allclose(d.probs[0, :n].sum(-1), torch.ones(n), atol=1e-5)
    assert float(d.probs[0, :n][:, outside].abs().sum()) == 0.0
    (folder / DRAFT_VOCAB_FILE).write_text(json.dumps({"target_ids": [5, 500]}))
    with pytest.raises(ModelError, match="is not a draft vocabulary of this target") as e:
        build_proposer(SpecConfig.from_dict(cfg), 256, target=loaded)
    assert "\n" not in str(e.value)


def test_every_depth_reads_the_prompt_at_the_prefill(loaded, trained_stack, monkeypatch):
    """The first draft ran k depths over the whole prompt, and the controller timed that as drafting (a draft
    token priced at a plain step, so it stopped drafting). Now the prefill has each depth read the prompt
    positions it can commit, and the first draft runs at most d rows at depth d; a prefill the decoder does
    not have the proposer read (a batch that is not drafting) is read by the first draft instead."""
    import specctl.runtime.proposers.mtp as M

    prop = MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": K}), target=loaded,
                       max_model_len=256, stack=trained_stack)
    dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, K)
    prompt = PROMPTS[0] * 3  # 36 tokens: more than a verify block
    st = dec.start(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), torch.Generator().manual_seed(0))
    s = prop.slots[st.slot]
    assert s.c[:K + 1] == [len(prompt)] + [len(prompt) - d for d in range(1, K + 1)]
    rows = []
    orig_one, orig_many = M.mtp_step, M.mtp_step_ragged
    monkeypatch.setattr(M, "mtp_step", lambda st_, t, d, h, tok, *a: rows.append((d, tok.shape[1])) or orig_one(st_, t, d, h, tok, *a))
    monkeypatch.setattr(M, "mtp_step_ragged", lambda st_, t, d, parts: rows.extend((d, p[1].shape[0]) for p in parts)
                        or orig_many(st_, t, d, parts))
    d = prop.propose([st.draft_request()], [K])
    assert int(d.num_tokens[0]) == K and rows == [(d_, d_) for d_ in range(1, K + 1)]
    plain = SpecDecoder(TargetRunner(loaded.model, 256)).generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert dec.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True)).token_ids == plain.token_ids
    monkeypatch.setattr(prop, "on_prefill", lambda *a, **k: None)  # as when the batch's guard keeps drafting off
    st = dec.start(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), torch.Generator().manual_seed(0))
    assert prop.slots[st.slot].c[1:K + 1] == [0] * K and prop.backlog(st.slot) == len(prompt) - 1
    rows.clear()
    got = prop.propose([st.draft_request()], [K])
    # the first draft reads the prompt at every depth first (timed as reading), then drafts d rows at depth d
    n = len(prompt)
    assert rows == [(1, n - 1), (2, n - 2), (3, n - 3)] + [(d_, d_) for d_ in range(1, K + 1)]
    assert got.read_seconds > 0 and prop.backlog(st.slot) == 0 and prop.catch_up_seconds(st.slot) == 0.0


def test_catching_up_is_priced_as_reading_not_as_drafting(loaded, trained_stack, monkeypatch):
    """A request whose prompt the proposer did not read (a batch not drafting when it joined) catches up at its
    first draft: the decoder charges the request's drafting without that reading (``DraftBatch.read_seconds``),
    and the reading's measured rate prices the next catch-up (``catch_up_seconds``). On a clock that moves only
    while the depths read, the drafting costs nothing; before, it cost the whole reading."""
    import time as _time

    import specctl.runtime.proposers.mtp as M

    prop = MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": K}), target=loaded,
                       max_model_len=256, stack=trained_stack)
    dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, K)
    prompt = PROMPTS[1] * 3
    st = dec.begin(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    dec.prefilled(st, len(prompt), st.runner.run(dec.prefill_tokens(st, len(prompt)), logits="last"), read_prompt=False)
    assert prop.backlog(st.slot) == len(prompt) - 1 and prop.catch_up_seconds(st.slot) is None  # unmeasured
    clock = [100.0]
    monkeypatch.setattr(_time, "perf_counter", lambda: clock[0])
    one = M.mtp_step  # a depth's forward over many rows: the catching up (drafting runs its few rows ragged)
    monkeypatch.setattr(M, "mtp_step", lambda *a: (clock.__setitem__(0, clock[0] + 1.0), one(*a))[1])
    blocks = dec._draft([st], {0: K})
    assert len(blocks[0].draft) == K and blocks[0].t1 - blocks[0].t0 == 0.0  # the reading is not drafting
    assert prop._read_s == pytest.approx(K / (len(prompt) - 1)) and M.READ_TIMED <= len(prompt) - 1


def test_in_a_batch_mtp_reads_a_prompt_only_where_the_reading_is_weighed(loaded, trained_stack):
    """Eight requests joining at once, nothing measured: the depths do not read the prompts at the prefill (as a
    draft model's do not); they catch up at a first draft, if one comes. Alone, an unmeasured draft reads the
    prompt, to be measured. A step whose drafting the scheduler switched off (``disable_by_batch_size``) has
    its joiners read nothing either. Output equals plain throughout."""
    prop = MtpProposer(SpecConfig.from_dict({"method": "mtp", "num_speculative_tokens": K}), target=loaded,
                       max_model_len=256, stack=trained_stack)
    dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, K, adaptive=True)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = PROMPTS[2] * 2
    st = dec.begin(prompt, params)
    assert not dec._reads_prompt(8, st) and dec._reads_prompt(1, st)
    dec.step_batch([], prefills=[(st, len(prompt))], in_flight=8)
    assert prop.backlog(st.slot) == len(prompt) - 1 and not st.undrafted
    other = dec.begin(prompt, params, runner=TargetRunner(loaded.model, 256), slot=1)
    dec.step_batch([], max_draft=0, prefills=[(other, len(prompt))], in_flight=1)
    assert prop.backlog(1) == len(prompt) - 1
    plain = SpecDecoder(TargetRunner(loaded.model, 256)).generate(prompt, params).token_ids
    while st.finish is None:
        dec.step(st)
    assert dec.finish(st).token_ids == plain
