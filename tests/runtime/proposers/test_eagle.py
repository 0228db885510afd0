"""EAGLE-1/-3 proposers: export -> load round trip in vLLM's layouts, the TTT forward equals chain
drafting row by row, and greedy decoding with a trained tiny draft equals plain greedy (drafts accepted)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specctl.chat import template_ids
from specctl.config import SpecConfig
from specctl.drafts.eagle import EagleDraft, FusedEagle3, spec_from_target
from specctl.drafts.eagle_files import export_eagle, load_eagle_draft
from specctl.errors import UsageError
from specctl.kernels import cpu
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.proposers import build_proposer
from specctl.runtime.loading import load_model
from specctl.runtime.runner import TargetRunner
from specctl.training.eagle import EagleTrainConfig, train
from specctl.training.eagle_ttt import ttt_forward
from specctl.testing import record_draft_sizes
from tests.conftest import word_prompts



def _draft(model, version: int, seed: int = 0) -> EagleDraft:
    torch.manual_seed(seed)
    d = EagleDraft(spec_from_target(model.args, version, 100 if version == 3 else None))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
        if version == 3:
            d.d2t.copy_(torch.arange(100) % 7)  # some non-trivial map: target id = i + d2t[i], all distinct
            d.t2d.zero_()
            d.t2d[d.target_ids] = True
    return d.eval()


@pytest.mark.parametrize("version", [3, 1])
def test_ttt_forward_equals_chain_drafting(tiny_model, version):
    d = _draft(tiny_model, version)
    emb = tiny_model.embed.weight
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    feat = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(2))
    outs = ttt_forward(d, emb, ids, feat, 3)
    assert [tuple(o.shape) for o in outs] == [(2, 12, 64)] * 3
    for t in (0, 4, 8):
        k = torch.zeros(1, 2, 32, 16)
        v = torch.zeros_like(k)
        o = d.forward_cached(emb[ids[1:, 1:t + 2]], feat[1:, :t + 1], 0, k, v)[:, -1:]
        torch.testing.assert_close(o[0, 0], outs[0][1, t], atol=1e-5, rtol=0)
        for j in (1, 2):  # chain step j: the draft's own out, token x[t+1+j], position t+j
            o = d.forward_cached(emb[ids[1:, t + 1 + j:t + 2 + j]], o, t + j, k, v)
            torch.testing.assert_close(o[0, 0], outs[j][1, t], atol=1e-5, rtol=0)


def test_ttt_forward_on_chosen_rows_equals_all_rows(tiny_model):
    """Unrolling only some rows (the answers) gives those rows' outputs of the full unroll."""
    d = _draft(tiny_model, 3)
    emb = tiny_model.embed.weight
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    feat = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(2))
    full = ttt_forward(d, emb, ids, feat, 3)
    rows = torch.tensor([[1, 5, 7], [0, 3, 9]])
    sub = ttt_forward(d, emb, ids, feat, 3, rows)
    for i in range(3):
        for b in range(2):
            torch.testing.assert_close(sub[i][b], full[i][b, rows[b]], atol=1e-5, rtol=0)


def test_export_load_round_trip_eagle3(tiny_model_dir, tiny_model, tmp_path):
    d = _draft(tiny_model, 3)
    out = export_eagle(d, tmp_path / "tiny-eagle3", load_model(tiny_model_dir, dtype="float32"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == 128 and cfg["target_hidden_size"] == 64
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(d.spec.aux_layers)
    sd = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight", "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= set(sd)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (128,)
    assert sd["fc.weight"].shape == (64, 64 * len(d.spec.aux_layers))
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # attention reads cat(emb, hidden): 2H
    d2, embed = load_eagle_draft(out, tiny_model.args)
    assert embed is None and d2.version == 3
    for k, t in d.state_dict().items():
        assert torch.equal(t, d2.state_dict()[k]), k


def test_export_load_round_trip_eagle1(tiny_model_dir, tiny_model, tmp_path):
    d = _draft(tiny_model, 1)
    out = export_eagle(d, tmp_path / "tiny-eagle", load_model(tiny_model_dir, dtype="float32"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "draft_vocab_size" not in cfg
    sd = load_file(str(out / "model.safetensors"))
    assert sd["fc.weight"].shape == (64, 128)
    assert "layers.0.self_attn.q_proj.weight" in sd and "layers.0.post_attention_layernorm.weight" in sd
    assert not any("input_layernorm" in k or k.startswith("midlayer.") or k == "lm_head.weight" for k in sd)
    d2, _ = load_eagle_draft(out, tiny_model.args)
    assert d2.version == 1
    for k, t in d.state_dict().items():
        assert torch.equal(t, d2.state_dict()[k]), k
    # SGLang's name for the same draft (vLLM has no class for it, SGLang none for vLLM's): out/sglang
    sg = json.loads((out / "sglang" / "config.json").read_text())
    assert sg == dict(cfg, architectures=["LlamaForCausalLMEagle"])
    assert (out / "sglang" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_load_other_namings(tiny_model, tmp_path):
    """What users have: 'model.'-prefixed 'layers.0.*' EAGLE-3 tensors, no t2d, plus an embedding."""
    d = _draft(tiny_model, 3)
    src = export_eagle(d, tmp_path / "a-eagle3")
    sd = load_file(str(src / "model.safetensors"))
    renamed = {("model.layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in sd.items() if k != "t2d"}
    renamed["embed_tokens.weight"] = torch.randn(128, 64)
    dst = tmp_path / "b-eagle3"
    dst.mkdir()
    save_file(renamed, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    d2, embed = load_eagle_draft(dst, tiny_model.args)
    assert embed is not None and embed.shape == (128, 64)
    assert torch.equal(d2.t2d, d.t2d) and torch.equal(d2.midlayer.self_attn.q_proj.weight, d.midlayer.self_attn.q_proj.weight)


def test_method_must_match_version(tiny_model_dir, tiny_model, tmp_path):
    out = export_eagle(_draft(tiny_model, 3), tmp_path / "x-eagle3")
    with pytest.raises(UsageError, match="eagle3"):
        build_proposer(SpecConfig.from_dict({"method": "eagle", "model": str(out)}), 256,
                       target=load_model(tiny_model_dir, dtype="float32"))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_whole_model_as_an_eagle_draft_is_named_as_such(tiny_model_dir, method):
    """A user passed a plain model as an EAGLE-3 draft and was told of an "EAGLE-1 checkpoint" that
    does not fit (missing fc.weight...): the error now says what the folder is and what to do."""
    from specctl.errors import ModelError

    with pytest.raises(ModelError, match="is a whole model .* not an EAGLE draft") as e:
        build_proposer(SpecConfig.from_dict({"method": method, "model": str(tiny_model_dir)}), 256,
                       target=load_model(tiny_model_dir, dtype="float32"))
    assert "draft_model" in e.value.fix and "EAGLE-1" not in str(e.value)


def test_a_damaged_draft_file_is_one_line_naming_it(tiny_model, tmp_path):
    from specctl.errors import ModelError

    out = export_eagle(_draft(tiny_model, 3), tmp_path / "d")
    f = out / "model.safetensors"
    f.write_bytes(f.read_bytes()[:200])  # truncated: the header promises more than the file holds
    with pytest.raises(ModelError, match="model.safetensors") as e:
        load_eagle_draft(out, tiny_model.args)
    assert "replace it" in e.value.fix


# --------------------------------------------------------------------------- trained tiny drafts

@pytest.fixture(scope="module")
def trained(trained_eagle):
    """EAGLE-3 and EAGLE-1 drafts overfit on the tiny model's own greedy answers to 24 prompts (conftest)."""
    return trained_eagle


@pytest.mark.parametrize("version", [3, 1])
def test_greedy_equality_with_accepted_drafts(trained, tiny_model_dir, version):
    s = trained[version]
    assert s["final"]["train_acc"][0] > 0  # the held-out answers of a random tiny model are another matter
    loaded = load_model(tiny_model_dir, dtype="float32")
    method = "eagle3" if version == 3 else "eagle"
    prop = build_proposer(SpecConfig.from_dict({"method": method, "model": s["export"], "num_speculative_tokens": 4}),
                          256, target=loaded)
    if version == 3:  # it asks for the layers it reads; building it leaves the shared target as it was
        assert prop.aux_layers == tuple(s["aux_layers"])
    spec = SpecDecoder(TargetRunner(loaded.model, 256), prop, 4)
    plain = SpecDecoder(TargetRunner(loaded.model, 256))
    accepted = 0
    for text in trained["prompts"]:
        ids = template_ids(loaded.tokenizer, [{"role": "user", "content": text}], True)  # as the draft was trained
        params = SamplingParams(max_new_tokens=24)
        a, b = spec.generate(ids, params), plain.generate(ids, params)
        assert a.token_ids == b.token_ids, text
        accepted += a.stats.num_accepted_tokens
    assert accepted > 0


def test_sampling_returns_draft_probs_on_target_ids(trained, tiny_model_dir):
    loaded = load_model(tiny_model_dir, dtype="float32")
    prop = build_proposer(SpecConfig.from_dict({"method": "eagle3", "model": trained[3]["export"],
                                                "num_speculative_tokens": 3}), 256, target=loaded)
    dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, 3)
    ids = loaded.tokenizer("print hello", add_special_tokens=False)["input_ids"]
    st = dec.start(ids, SamplingParams(max_new_tokens=8, temperature=0.8), torch.Generator().manual_seed(0))
    d = prop.propose([st.draft_request()], [3])
    n = int(d.num_tokens[0])
    assert n >= 1 and d.probs.shape == (1, 3, 128)
    q = d.probs[0, :n]
    torch.testing.assert_close(q.sum(-1), torch.ones(n))
    outside = ~prop.draft.t2d
    assert float(q[:, outside].sum()) == 0.0
    assert all(float(q[i, int(d.token_ids[0, i])]) > 0 for i in range(n))
    while st.finish is None:  # stochastic verification runs through with these q
        dec.step(st)


# --------------------------------------------------------------------------- EAGLE-2 dynamic trees


def _tree_proposer(trained, tiny_model_dir, topk: int, tokens: int, k: int = 4):
    loaded = load_model(tiny_model_dir, dtype="float32")
    cfg = SpecConfig.from_dict({"method": "eagle3", "model": trained[3]["export"], "num_speculative_tokens": k,
                                "speculative_eagle_topk": topk, "speculative_num_draft_tokens": tokens})
    return loaded, build_proposer(cfg, 256, target=loaded)


def test_tree_greedy_equality_and_accepts_at_least_as_much_as_the_chain(trained, tiny_model_dir):
    loaded, prop = _tree_proposer(trained, tiny_model_dir, topk=3, tokens=12)
    chain = build_proposer(SpecConfig.from_dict({"method": "eagle3", "model": trained[3]["export"],
                                                 "num_speculative_tokens": 4}), 256, target=loaded)
    tree_dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, 4)
    chain_dec = SpecDecoder(TargetRunner(loaded.model, 256), chain, 4)
    plain = SpecDecoder(TargetRunner(loaded.model, 256))
    steps = {"tree": 0, "chain": 0}
    for text in trained["prompts"]:
        ids = template_ids(loaded.tokenizer, [{"role": "user", "content": text}], True)
        params = SamplingParams(max_new_tokens=24)
        want = plain.generate(ids, params).token_ids
        t, c = tree_dec.generate(ids, params), chain_dec.generate(ids, params)
        assert t.token_ids == want and c.token_ids == want, text
        steps["tree"] += t.num_steps
        steps["chain"] += c.num_steps
    assert steps["tree"] <= steps["chain"]  # a tree holds more candidates per step than its best chain


def test_tree_with_topk_1_is_the_chain(trained, tiny_model_dir):
    loaded, tree = _tree_proposer(trained, tiny_model_dir, topk=1, tokens=4)
    chain = build_proposer(SpecConfig.from_dict({"method": "eagle3", "model": trained[3]["export"],
                                                 "num_speculative_tokens": 4}), 256, target=loaded)
    ids = template_ids(loaded.tokenizer, [{"role": "user", "content": trained["prompts"][0]}], True)
    outs = []
    for prop in (tree, chain):
        dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, 4)
        st = dec.start(ids, SamplingParams(max_new_tokens=8))
        outs.append(prop.propose([st.draft_request()], [4]))
    t, c = outs
    n = int(c.num_tokens[0])
    assert t.token_ids[0, :n].tolist() == c.token_ids[0, :n].tolist()
    assert t[0].parents == [-1] + list(range(n - 1))


def test_every_tree_node_is_a_top_k_child_of_its_path_run_as_a_chain(trained, tiny_model_dir):
    """The tree mask and positions are right: recomputing each node's parent causally along its path
    (the ancestors as a chain, from a copy of the prefix cache) ranks the node among its top-K."""
    K = 3
    loaded, prop = _tree_proposer(trained, tiny_model_dir, topk=K, tokens=14)
    dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, 4)
    ids = template_ids(loaded.tokenizer, [{"role": "user", "content": trained["prompts"][3]}], True)
    st = dec.start(ids, SamplingParams(max_new_tokens=8))
    s = prop._slot_for(st.draft_request())
    d = prop.propose([st.draft_request()], [4])
    toks, parents = d[0].ids, d[0].parents
    assert len(toks) == 14 and max(p for p in parents) >= 1  # branching, at least 3 levels
    assert len(set(p for p in parents if p >= 0)) < len([p for p in parents if p >= 0])  # some node has 2+ children
    P, draft = s.n_feat, prop.draft
    k_pre, v_pre = s.k.clone(), s.v.clone()  # slots [0, P) = the fed prefix; the tree wrote only beyond
    o_root = draft.forward_cached(prop.embed_weight[torch.tensor([[int(st.ctx[0, P])]])].float(), s.feat[P - 1:P][None],
                                  P - 1, k_pre.clone(), v_pre.clone())[0, -1]
    for i, t in enumerate(toks):
        path = []
        a = parents[i]
        while a >= 0:
            path.append(toks[a])
            a = parents[a]
        path.reverse()
        kc, vc = k_pre.clone(), v_pre.clone()
        o = o_root
        for j, tok in enumerate(path):  # chain rows at P, P+1, ...
            o = draft.forward_cached(prop.embed_weight[torch.tensor([[tok]])].float(), o[None, None], P + j, kc, vc)[0, -1]
        top = draft.logits(o).topk(K).indices
        assert t in prop.target_ids[top].tolist(), (i, path, t)


def test_tree_options_are_validated():
    from specctl.errors import ConfigError

    with pytest.raises(ConfigError, match="EAGLE tree options"):
        SpecConfig.from_dict({"method": "ngram", "speculative_eagle_topk": 4})
    with pytest.raises(ConfigError, match="speculative_eagle_topk must be >= 1"):
        SpecConfig.from_dict({"method": "eagle3", "model": "x", "speculative_eagle_topk": 0})
    c = SpecConfig.from_dict({"method": "eagle3", "model": "x", "speculative_eagle_topk": 2})
    assert c.speculative_num_draft_tokens == 16


# --------------------------------------------------------------------------- the fused bf16 EAGLE-3 draft

def _fused_ok() -> bool:
    """The fused EAGLE-3 block runs here: the target's fused build (AMX, or the skinny AVX-512/AVX2 one)."""
    from specctl.kernels.select import resolve

    ks = resolve()
    return ks.block is not None and (ks.amx if ks.path == "amx" else ks.linear) is not None


@pytest.fixture(scope="module")
def wide(tiny_model_factory, tmp_path_factory):
    """A target the bf16 kernels take (head dim 32) and an EAGLE-3 draft overfit on its own answers."""
    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    work = tmp_path_factory.mktemp("eagle-wide")
    prompts = work / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in word_prompts(24, 1)) + "\n")
    cfg = EagleTrainConfig(model=str(folder), output=str(work / "run"), self_distill=str(prompts), version=3, steps=60,
                           batch_size=8, seq_len=64, max_new_tokens=32, eval_split=0.1, lr=3e-3, eval_every=1000,
                           draft_vocab_size=96)
    s = train(cfg, loaded=load_model(folder, dtype="float32"), log=lambda m: None)
    return folder, s["export"], word_prompts(24, 1)[:16]


@pytest.mark.skipif(not _fused_ok(), reason="no fused decode block (AMX, AVX-512 or AVX2 build) runs here")
def test_fused_draft_matches_the_fp32_draft(wide):

    folder, export, _ = wide
    target = load_model(folder, dtype="bfloat16").model
    draft, _ = load_eagle_draft(export, target.args)
    with torch.no_grad():  # norms far from 1 and from each other, so that mixing them up shows
        for i, norm in enumerate((draft.midlayer.input_layernorm, draft.midlayer.hidden_norm,
                                  draft.midlayer.post_attention_layernorm, draft.norm)):
            norm.weight.mul_(1.0 + 0.5 * torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(i)))
    fused = FusedEagle3.build(draft, torch.bfloat16, "cpu", target.kernels)
    assert fused is not None and FusedEagle3.build(draft, torch.float32, "cpu", target.kernels) is None  # bf16 only
    a, g = draft.spec.args, torch.Generator().manual_seed(0)
    T = 70  # more rows than one kernel call takes: fed in causal chunks
    aux = torch.randn(1, T, draft.fc.weight.shape[1], generator=g).bfloat16()
    emb = target.embed.weight[torch.randint(0, 128, (1, T + 3), generator=g)]
    torch.testing.assert_close(fused.feature(None, aux).float(), draft.feature(None, aux), atol=0.05, rtol=0.02)
    h = draft.feature(None, aux)
    caches = [(torch.zeros(1, a.num_kv_heads, 96, a.head_dim, dtype=dt), torch.zeros(1, a.num_kv_heads, 96, a.head_dim, dtype=dt))
              for dt in (torch.float32, torch.bfloat16)]
    outs = []
    for net, (kc, vc), dt in ((draft, caches[0], torch.float32), (fused, caches[1], torch.bfloat16)):
        o = net.forward_cached(emb[:, :T].to(dt), h.to(dt), 0, kc, vc)
        rows = [o]
        for j in range(3):  # chain rows on the draft's own output
            o = net.forward_cached(emb[:, T + j:T + j + 1].to(dt), o[:, -1:], T + j, kc, vc)
            rows.append(o)
        outs.append((torch.cat(rows, 1).float(), net.logits(torch.cat(rows, 1), target.head_weight).float()))
    (o32, l32), (o16, l16) = outs
    scale = float(o32.abs().max())
    torch.testing.assert_close(o16, o32, atol=0.03 * scale, rtol=0.0)
    torch.testing.assert_close(caches[1][0].float(), caches[0][0], atol=0.05 * float(caches[0][0].abs().max()), rtol=0.0)
    assert float((l16.argmax(-1) == l32.argmax(-1)).float().mean()) > 0.9  # bf16 rounding flips only near-ties


@pytest.mark.skipif(not _fused_ok(), reason="no fused decode block (AMX, AVX-512 or AVX2 build) runs here")
def test_fused_greedy_equality_chain_and_tree(wide):
    from specctl.runtime.proposers.eagle import Eagle3Proposer

    folder, export, prompts = wide
    loaded = load_model(folder, dtype="bfloat16")
    runner = TargetRunner(loaded.model, 256)
    plain = SpecDecoder(runner)
    configs = {"chain": {"method": "eagle3", "model": export, "num_speculative_tokens": 4},
               "tree": {"method": "eagle3", "model": export, "num_speculative_tokens": 4,
                        "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 10}}
    accepted = {}
    for fused in (True, False):
        for name, c in configs.items():
            if fused:  # the default beside a target on the AMX kernels
                prop = build_proposer(SpecConfig.from_dict(c), 256, target=loaded)
            else:
                prop = Eagle3Proposer(SpecConfig.from_dict(c), target=loaded, max_model_len=256, fused=False)
            assert isinstance(prop.net, FusedEagle3) == fused
            dec = SpecDecoder(runner, prop, 4)
            n = 0
            for text in prompts:
                ids = template_ids(loaded.tokenizer, [{"role": "user", "content": text}], True)
                params = SamplingParams(max_new_tokens=24)
                got = dec.generate(ids, params)
                assert got.token_ids == plain.generate(ids, params).token_ids, (name, fused, text)
                n += got.stats.num_accepted_tokens
            accepted[name, fused] = n
    for name in configs:  # the bf16 draft accepts about as much as the fp32 one
        assert accepted[name, True] > 0
        assert accepted[name, True] >= 0.8 * accepted[name, False], accepted


@pytest.mark.parametrize("method,tree", [("eagle3", False), ("eagle", False), ("eagle3", True)])
def test_batched_greedy_equals_plain(trained, tiny_model_dir, run_batched, method, tree):
    """Requests decoding together (EAGLE chains, or dynamic trees, in one ragged forward; each its
    own draft features) give their plain output."""
    loaded = load_model(tiny_model_dir, dtype="float32")
    s = trained[3 if method == "eagle3" else 1]
    cfg = {"method": method, "model": s["export"], "num_speculative_tokens": 4}
    if tree:
        cfg.update(speculative_eagle_topk=3, speculative_num_draft_tokens=12)
    prop = build_proposer(SpecConfig.from_dict(cfg), 256, target=loaded)
    plain = SpecDecoder(TargetRunner(loaded.model, 256))
    prompts = [template_ids(loaded.tokenizer, [{"role": "user", "content": t}], True) for t in trained["prompts"][:10]]
    params = SamplingParams(max_new_tokens=24)
    got = run_batched(SpecDecoder(TargetRunner(loaded.model, 256), prop, 4), prompts, [params] * len(prompts))
    assert [r.token_ids for r in got] == [plain.generate(p, params).token_ids for p in prompts]
    assert sum(r.stats.num_accepted_tokens for r in got) > 0


def test_a_hybrid_of_eagle3_drafts_reading_different_layers(tiny_model_dir, tiny_model, tmp_path):
    """Each proposer declares the target layers it reads; a hybrid asks the target for their union
    and hands each part its own (two EAGLE-3 drafts: fc over 1 and over 2 layers). Building them
    leaves the shared target as it was; greedy output equals plain's, both parts draft every step."""
    loaded = load_model(tiny_model_dir, dtype="float32")
    dirs = []
    for i, aux in enumerate([(1,), (0, 1)]):
        torch.manual_seed(i)
        d = EagleDraft(spec_from_target(tiny_model.args, 3, 100, aux_layers=aux))
        with torch.no_grad():
            for p in d.parameters():
                p.add_(0.05 * torch.randn_like(p))
            d.d2t.copy_(torch.arange(100) % 7)
            d.t2d.zero_()
            d.t2d[d.target_ids] = True
        dirs.append(export_eagle(d.eval(), tmp_path / f"eagle3-{i}", loaded))
    cfg = SpecConfig.from_dict({"method": "hybrid", "policy": "tree", "proposers": [
        {"method": "eagle3", "model": str(dirs[0]), "num_speculative_tokens": 3},
        {"method": "eagle3", "model": str(dirs[1]), "num_speculative_tokens": 3}]})
    prop = build_proposer(cfg, 256, target=loaded)
    assert [p.aux_layers for p in prop.subs] == [(1,), (0, 1)] and prop.aux_layers == (0, 1)
    spec, plain = SpecDecoder(TargetRunner(loaded.model, 256), prop, 3), SpecDecoder(TargetRunner(loaded.model, 256))
    for p in ([5, 9, 9, 20, 31], [70, 71, 72, 70, 71, 72, 70]):
        params = SamplingParams(max_new_tokens=16, ignore_eos=True)
        got = spec.generate(p, params)
        assert got.token_ids == plain.generate(p, params).token_ids
        assert set(got.by_proposer) == {"eagle3", "eagle3#2"}
        assert all(got.num_steps - 1 <= s.num_drafts <= got.num_steps for s in got.by_proposer.values())


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_a_batch_steps_the_chains_together_and_each_drafts_as_alone(trained, tiny_model_dir, run_batched, method):
    """The batch's chains advance in one ragged draft pass per step; every request's sequence of
    drafts is the one it drafts decoding alone."""
    loaded = load_model(tiny_model_dir, dtype="float32")
    s = trained[3 if method == "eagle3" else 1]
    cfg = SpecConfig.from_dict({"method": method, "model": s["export"], "num_speculative_tokens": 4})
    prompts = [template_ids(loaded.tokenizer, [{"role": "user", "content": t}], True) for t in trained["prompts"][:6]]
    params = SamplingParams(max_new_tokens=24)

    def recorded(prop):
        seen, sizes = {}, []
        orig = prop._drafts

        def drafts(requests, ks):
            out = orig(requests, ks)
            sizes.append(len(requests))
            for r, (ids, _) in zip(requests, out):
                seen.setdefault(tuple(r.ctx[:len(prompts[0]) // 2].tolist()), []).append((r.n, ids))
            return out

        prop._drafts = drafts
        return seen, sizes

    prop = build_proposer(cfg, 256, target=loaded)
    together, sizes = recorded(prop)
    run_batched(SpecDecoder(TargetRunner(loaded.model, 256), prop, 4), prompts, [params] * len(prompts))
    assert max(sizes) > 1
    alone = {}
    for p in prompts:
        prop = build_proposer(cfg, 256, target=loaded)
        seen, _ = recorded(prop)
        SpecDecoder(TargetRunner(loaded.model, 256), prop, 4).generate(p, params)
        alone.update(seen)
    assert together == alone


def _paths(ids, parents):
    """Each node as the path of tokens from the root's children down to it."""
    out = []
    for i in range(len(ids)):
        path, a = [], i
        while a >= 0:
            path.append(ids[a])
            a = parents[a]
        out.append(tuple(reversed(path)))
    return out


def test_a_priced_tree_keeps_the_likeliest_nodes_worth_their_rows(trained, tiny_model_dir):
    """With a row's price the tree is the unpriced tree's likeliest nodes, as many as pay for their rows by
    their calibrated probabilities (tree_budget.worth); at a price no node beats, nothing is drafted."""
    from specctl.runtime.tree_budget import worth

    loaded, prop = _tree_proposer(trained, tiny_model_dir, topk=3, tokens=12)
    dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, 4)
    ids = template_ids(loaded.tokenizer, [{"role": "user", "content": trained["prompts"][3]}], True)
    st = dec.start(ids, SamplingParams(max_new_tokens=8))
    r = st.draft_request()
    full = prop.propose([r], [4])[0]
    probs = sorted(prop._slot_for(r).tree[2], reverse=True)
    sizes = {}
    for price in (0.02, 0.1, 0.3):
        r.row_price = price
        d = prop.propose([r], [4])[0]
        n = worth([prop.calibration(p) for p in probs], price)
        assert len(d) == n and set(_paths(d.ids, d.parents)) <= set(_paths(full.ids, full.parents))
        assert all(p < i for i, p in enumerate(d.parents if d.parents is not None else range(-1, len(d) - 1)))
        sizes[price] = n
    assert len(full) == 12 and 12 >= sizes[0.02] >= sizes[0.1] >= sizes[0.3] and sizes[0.3] < 12
    r.row_price = 2.0  # a row dearer than any node's chance: no draft at all
    assert len(prop.propose([r], [4])[0]) == 0


def test_verified_trees_calibrate_the_node_probabilities_and_priced_trees_stay_exact(trained, tiny_model_dir, monkeypatch):
    """Every verified tree's nodes are counted into the calibration, the accepted ones exactly the tokens
    the steps accepted; with the controller's price of a row (here fixed) the trees shrink and every
    output is still plain greedy's."""
    from specctl.runtime.controller import DraftLengthController

    loaded, prop = _tree_proposer(trained, tiny_model_dir, topk=3, tokens=12)
    sizes = record_draft_sizes(prop)
    plain = SpecDecoder(TargetRunner(loaded.model, 256))
    fixed = SpecDecoder(TargetRunner(loaded.model, 256), prop, 4)
    params = SamplingParams(max_new_tokens=24)
    accepted = 0
    for text in trained["prompts"]:
        ids = template_ids(loaded.tokenizer, [{"role": "user", "content": text}], True)
        got = fixed.generate(ids, params)
        assert got.token_ids == plain.generate(ids, params).token_ids
        accepted += got.stats.num_accepted_tokens
    assert sum(prop.calibration.accepted) == accepted > 0 and sum(prop.calibration.tried) == sum(sizes)
    assert max(sizes) == 12  # no price: whole trees

    monkeypatch.setattr(DraftLengthController, "row_price", lambda self, batch=1: 0.15)
    # and every step drafts: whether a draft pays is measured from this machine's timings (under a loaded
    # CI run it once judged no step worth a draft), and what is tested here is the tree a price leaves
    monkeypatch.setattr(DraftLengthController, "draft_len", lambda self, batch=1, clock=None, catch_up_s=0.0: self.k)
    sizes.clear()
    adaptive = SpecDecoder(TargetRunner(loaded.model, 256), prop, 4, adaptive=True)
    for text in trained["prompts"][:4]:
        ids = template_ids(loaded.tokenizer, [{"role": "user", "content": text}], True)
        assert adaptive.generate(ids, params).token_ids == plain.generate(ids, params).token_ids, text
    assert sizes and max(sizes) < 12


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_the_draft_reads_the_prompt_at_the_prefill_or_catches_up_priced_as_reading(trained, tiny_model_dir, method):
    """Where the decoder has it read the prompt (``on_prefill``), the draft reads it in the prefill and its first
    draft feeds one row. Where it did not (a batch not drafting when the request joined), the first draft catches
    up first, timed apart (``DraftBatch.read_seconds``, which the decoder leaves out of drafting's cost; before,
    the whole prompt's reading was timed as that one draft's), and then drafts what the read prompt gives."""
    from specctl.runtime.proposers.base import READ_TIMED

    loaded = load_model(tiny_model_dir, dtype="float32")
    s = trained[3 if method == "eagle3" else 1]
    cfg = SpecConfig.from_dict({"method": method, "model": s["export"], "num_speculative_tokens": 4})
    prompt = template_ids(loaded.tokenizer, [{"role": "user", "content": trained["prompts"][0]}], True)
    params = SamplingParams(max_new_tokens=12)
    assert len(prompt) - 1 >= READ_TIMED
    prop = build_proposer(cfg, 256, target=loaded)
    st = SpecDecoder(TargetRunner(loaded.model, 256), prop, 4).start(prompt, params)
    assert prop.backlog(st.slot) == 0 and prop.slots[st.slot].n_fed == len(prompt) - 1
    read = prop.propose([st.draft_request()], [4])
    assert read.read_seconds == 0.0 and len(read[0]) == 4

    prop = build_proposer(cfg, 256, target=loaded)
    dec = SpecDecoder(TargetRunner(loaded.model, 256), prop, 4)
    st = dec.begin(prompt, params)
    out = st.runner.run(dec.prefill_tokens(st, len(prompt)), logits="last", aux_layers=dec.aux_layers)
    dec.prefilled(st, len(prompt), out, read_prompt=False)
    assert prop.backlog(st.slot) == len(prompt) - 1 and prop.catch_up_seconds(st.slot) is None
    lazy = prop.propose([st.draft_request()], [4])
    assert lazy.read_seconds > 0 and prop.backlog(st.slot) == 0 and prop._read_s is not None
    assert lazy[0].ids == read[0].ids
    plain = SpecDecoder(TargetRunner(loaded.model, 256)).generate(prompt, params).token_ids
    while st.finish is None:
        dec.step(st)
    assert dec.finish(st).token_ids == plain
