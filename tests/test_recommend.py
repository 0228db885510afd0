"""specctl.recommend: every branch of the flowchart on tiny on-disk folders, draft checks, the cost model.

The folders are written here: config.json + a safetensors file with the right tensor names and
(tiny) shapes, + the conftest's character-level tokenizer (copied from ``tiny_model_dir``) or a
word-level one. Nothing is loaded but headers and tokenizers; no network (``SPECCTL_CACHE`` points at
an empty folder, so catalogue models count as not pulled).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specctl import recommend as r
from specctl.config import SpecConfig, implemented_methods
from specctl.errors import ModelError, UsageError

H, V = 64, 128  # the target's hidden size and vocabulary (the conftest tokenizer's 128 ids)


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path / "cache"))


# --------------------------------------------------------------------------- folder builders

def write_folder(folder: Path, config: dict, shapes: dict[str, list[int]], tokenizer: Path | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: torch.zeros(s, dtype=torch.float32) for k, s in shapes.items()}, str(folder / "model.safetensors"))
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, folder / f.name)
    return folder


def llama(folder: Path, layers: int = 4, hidden: int = H, vocab: int = V, tokenizer: Path | None = None,
          extra_config: dict | None = None, extra_shapes: dict | None = None, arch: str = "llama") -> Path:
    inter = 2 * hidden
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "lm_head.weight": [vocab, hidden],
              "model.norm.weight": [hidden]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": [hidden, hidden], p + "self_attn.k_proj.weight": [hidden // 2, hidden],
                   p + "self_attn.v_proj.weight": [hidden // 2, hidden], p + "self_attn.o_proj.weight": [hidden, hidden],
                   p + "mlp.gate_proj.weight": [inter, hidden], p + "mlp.up_proj.weight": [inter, hidden],
                   p + "mlp.down_proj.weight": [hidden, inter], p + "input_layernorm.weight": [hidden],
                   p + "post_attention_layernorm.weight": [hidden]}
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": arch, "hidden_size": hidden, "vocab_size": vocab,
           "num_hidden_layers": layers, "intermediate_size": inter, "num_attention_heads": 4,
           "num_key_value_heads": 2, "hidden_act": "silu"} | (extra_config or {})
    return write_folder(folder, cfg, shapes | (extra_shapes or {}), tokenizer)


def medusa(folder: Path, heads: int = 3, hidden: int = H, vocab: int = V, **cfg) -> Path:
    shapes = {f"blocks.{h}.layers.0.weight": [hidden, hidden] for h in range(heads)}
    shapes |= {f"lm_heads.{h}.weight": [vocab, hidden] for h in range(heads)}
    return write_folder(folder, {"model_type": "medusa", "num_heads": heads, "num_hidden_layers": 1,
                                 "hidden_size": hidden, "vocab_size": vocab} | cfg, shapes)


def eagle3(folder: Path, hidden: int = H, vocab: int = V, draft_vocab: int = 32, **cfg) -> Path:
    shapes = {"fc.weight": [hidden, 3 * hidden], "midlayer.self_attn.q_proj.weight": [hidden, 2 * hidden],
              "norm.weight": [hidden], "lm_head.weight": [draft_vocab, hidden], "d2t": [draft_vocab], "t2d": [vocab]}
    return write_folder(folder, {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                                 "hidden_size": hidden, "target_hidden_size": hidden, "vocab_size": vocab,
                                 "draft_vocab_size": draft_vocab, "num_hidden_layers": 1,
                                 "eagle_aux_hidden_state_layer_ids": [0, 1, 2]} | cfg, shapes)


def eagle1(folder: Path, hidden: int = H, vocab: int = V) -> Path:
    shapes = {"fc.weight": [hidden, 2 * hidden], "layers.0.self_attn.q_proj.weight": [hidden, hidden],
              "embed_tokens.weight": [vocab, hidden]}
    return write_folder(folder, {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
                                 "vocab_size": vocab, "num_hidden_layers": 1}, shapes)


@pytest.fixture(scope="module")
def word_tok_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer (128 multi-character words): almost nothing in common with the char one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>"] + [f"w{i:03d}" for i in range(V - 1)]
    raw = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path_factory.mktemp("word-tok")
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture
def target(tmp_path, tiny_model_dir) -> Path:
    return llama(tmp_path / "models" / "target", layers=4, tokenizer=tiny_model_dir)


def answers(node: r.Node) -> list[tuple[str, str]]:
    """(question, answer) along the tree, depth first."""
    out = [(node.text, node.answer)] if node.kind == "question" else []
    for c in node.children:
        out += answers(c)
    return out


def choices(node: r.Node) -> list[str]:
    out = [node.text] if node.kind == "choice" else []
    for c in node.children:
        out += choices(c)
    return out


def evidence(node: r.Node) -> list[r.Node]:
    out = [node] if node.kind == "evidence" else []
    for c in node.children:
        out += evidence(c)
    return out


def q(rec, start: str) -> str:
    return next(a for t, a in answers(rec.tree) if t.startswith(start))


# --------------------------------------------------------------------------- the cost model

def test_speedup_formula_best_k_and_alpha_estimate():
    assert r.predicted_speedup(0.8, 0.0, 1) == pytest.approx(1.8)
    assert r.predicted_speedup(0.8, 0.1, 2) == pytest.approx((1 - 0.8 ** 3) / (0.2 * 1.2))
    assert r.predicted_speedup(1.0, 0.5, 3) == pytest.approx(4 / 2.5)  # the α -> 1 limit
    k, s = r.best_k(0.8, 0.37)
    assert s == max(r.predicted_speedup(0.8, 0.37, j) for j in range(1, r.K_MAX + 1)) and 1 < k < 6
    assert r.best_k(0.9, 0.0)[0] == r.K_MAX  # a free draft: longer is always better by the formula
    assert r.predicted_speedup(0.5, 1.0, 1) < 1  # ρ -> 1: the gain is gone
    assert r.estimate_alpha([(4, 4), (4, 1)]) == pytest.approx(5 / 6)
    assert r.estimate_alpha([(3, 0), (0, 0)]) == 0.0 and r.estimate_alpha([]) is None
    # the per-layer overhead makes a thin deep model cost more than its parameters say
    assert r.estimate_rho(100e6, 30, 1.5e9, 28) > 100e6 / 1.5e9


def test_name_key_matches_spellings_of_one_model():
    assert r.name_key("Qwen/Qwen2.5-Coder-1.5B-Instruct") == r.name_key("qwen2.5-coder-1.5b-bfloat16") \
        == r.name_key("Qwen2.5 Coder 1.5B Instruct GGUF")
    assert r.name_key("lmsys/vicuna-7b-v1.3") != r.name_key("meta-llama/Llama-2-7b-chat-hf")


# --------------------------------------------------------------------------- the branches

def test_nothing_falls_through_to_ngram(target):
    rec = r.recommend(str(target), candidates=[], workload="chat")
    assert answers(rec.tree) == [
        ("Do you train this model yourself?", "no"),
        ("Does the model carry MTP layers (built in, or trained for it)?", "no"),
        ("Is there a Medusa head or EAGLE draft made for this model?", "no"),
        ("Is there a smaller model of the same family, with the same tokenizer?", "no"),
        ("Do requests repeat (agent loops, fixed-template batch jobs)?", "no"),
        ("Is the KV cache a large share of each step's reads (sparse-attention self-speculation)?", "no"),
    ]
    assert rec.choice.method == "ngram" and rec.choice.layer == 1 and rec.choice.runnable
    assert rec.choice.config == {"method": "ngram", "num_speculative_tokens": 10, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 5}
    assert "--method ngram -k 10" in rec.choice.commands["specctl_serve"]
    assert json.loads(rec.choice.commands["vllm"].split("--speculative-config ", 1)[1].strip("'")) == rec.choice.vllm_config
    assert [a.method for a in rec.alternatives] == ["suffix"]
    assert rec.target.params == sum(
        torch.Size(s).numel() for s in [[V, H]] * 2 + [[H]]) + 4 * (2 * H * H + 2 * (H // 2) * H + 3 * 2 * H * H + 2 * H)
    json.dumps(rec.to_dict())  # serialisable as it is


def test_repeating_requests_give_suffix(target):
    rec = r.recommend(str(target), candidates=[], workload="agentic")
    assert q(rec, "Do requests repeat") == "yes"
    assert rec.choice.method == "suffix" and rec.choice.commands["specctl_flags"] == "--method suffix -k 16"
    assert [a.method for a in rec.alternatives] == ["ngram"]


def test_own_training_gives_mtp_plan_and_a_choice_for_now(target):
    rec = r.recommend(str(target), candidates=[], own_training=True)
    assert q(rec, "Do you train") == "yes"
    assert rec.choice.method == "mtp" and rec.choice.layer == 4 and not rec.choice.runnable
    assert "plan" in rec.choice.note and "deepseek_mtp" in rec.choice.note
    assert rec.alternatives[0].method == "ngram"  # what to run until the MTP layers are trained
    assert any(n.text == "Until then:" for n in rec.tree.children[0].children)


@pytest.mark.parametrize("layout", ["deepseek", "mtp_prefix"])
def test_builtin_mtp_layers(tmp_path, tiny_model_dir, layout):
    if layout == "deepseek":  # DeepSeek-V3: the config key and the MTP block as layer num_hidden_layers
        extra_cfg = {"num_nextn_predict_layers": 1}
        shapes = {f"model.layers.4.{n}.weight": [H, 2 * H if n == "eh_proj" else H] for n in ("eh_proj", "enorm", "hnorm")}
        shapes["model.layers.4.shared_head.head.weight"] = [V, H]
    else:  # Qwen3-Next: mtp.{fc,norm,...} shared by mtp.layers.{i}.*, no nextn key
        extra_cfg = {}
        shapes = {"mtp.fc.weight": [H, 2 * H], "mtp.norm.weight": [H], "mtp.pre_fc_norm_hidden.weight": [H]}
        shapes |= {f"mtp.layers.{i}.self_attn.q_proj.weight": [H, H] for i in range(2)}
    t = llama(tmp_path / "m" / "target", tokenizer=tiny_model_dir, extra_config=extra_cfg, extra_shapes=shapes)
    rec = r.recommend(str(t), candidates=[])
    assert q(rec, "Does the model carry MTP") == "yes"
    assert rec.mtp.present and rec.mtp.layers == (1 if layout == "deepseek" else 2)
    assert rec.choice.method == "mtp" and rec.choice.config["num_speculative_tokens"] == rec.mtp.layers
    assert rec.choice.runnable == ("mtp" in implemented_methods())
    if "mtp" not in implemented_methods():
        assert "not runnable in this installation" in rec.choice.note
    assert any("MTP tensors" in e for e in rec.mtp.evidence)


def test_own_training_with_mtp_layers_uses_them(tmp_path, tiny_model_dir):
    shapes = {f"model.layers.4.{n}.weight": [H, 2 * H if n == "eh_proj" else H] for n in ("eh_proj", "enorm", "hnorm")}
    t = llama(tmp_path / "m" / "target", tokenizer=tiny_model_dir, extra_config={"num_nextn_predict_layers": 1},
              extra_shapes=shapes)
    rec = r.recommend(str(t), candidates=[], own_training=True)
    assert q(rec, "Do you train") == "yes" and q(rec, "Does the model carry MTP") == "yes"
    assert rec.choice.method == "mtp" and "model" not in rec.choice.config and "plan" not in rec.choice.note


def test_mtp_draft_folder_trained_for_the_target(target, tmp_path):
    """specctl train-mtp's draft folder: the target's config + num_nextn_predict_layers, only model.layers.{N+i}.*."""
    def mtp_draft(folder, n_main):
        shapes = {f"model.layers.{n_main}.{n}.weight": [H, 2 * H if n == "eh_proj" else H] for n in ("eh_proj", "enorm", "hnorm")}
        shapes[f"model.layers.{n_main}.self_attn.q_proj.weight"] = [H, H]
        return write_folder(folder, {"model_type": "llama", "hidden_size": H, "vocab_size": V, "num_hidden_layers": n_main,
                                     "num_nextn_predict_layers": 1}, shapes)

    good = mtp_draft(tmp_path / "d" / "mtp-ok", 4)
    mtp_draft(tmp_path / "d" / "mtp-other", 6)
    rec = r.recommend(str(target), drafts=[str(tmp_path / "d")], candidates=[])
    by = {Path(d.path).name: d for d in rec.drafts}
    assert by["mtp-ok"].kind == "mtp" and by["mtp-ok"].accepted
    assert not by["mtp-other"].accepted and "follow a 6-layer model, the target has 4" in by["mtp-other"].reasons[0]
    assert rec.candidates == []  # an MTP draft is not a plain model to draft with
    assert q(rec, "Does the model carry MTP") == "yes"
    assert rec.choice.method == "mtp" and rec.choice.config == {"method": "mtp", "model": str(good), "num_speculative_tokens": 1}


def test_mtp_in_gguf_metadata(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    w = GGUFWriter(str(path), "deepseek2")
    w.add_uint32("deepseek2.nextn_predict_layers", 1)
    w.add_tensor("blk.2.nextn.eh_proj.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = r._gguf_mtp(path)
    assert meta == {"deepseek2.nextn_predict_layers": 1, "nextn_tensors": 1}
    m = r.mtp_modules({}, {}, meta)
    assert m.present and m.layers == 1 and any("GGUF" in e for e in m.evidence)


def test_declared_mtp_without_tensors_is_refused(tmp_path, tiny_model_dir):
    t = llama(tmp_path / "m" / "target", tokenizer=tiny_model_dir, extra_config={"num_nextn_predict_layers": 1})
    rec = r.recommend(str(t), candidates=[])
    assert q(rec, "Does the model carry MTP") == "no"
    assert "no MTP tensors" in rec.mtp.refused and rec.choice.method == "ngram"


def test_medusa_draft_beside_the_model(target):
    d = medusa(target.parent / "target-medusa", heads=3)
    rec = r.recommend(str(target), candidates=[])  # no --drafts: found beside the model
    assert q(rec, "Is there a Medusa head") == "yes"
    assert rec.choice.method == "medusa" and rec.choice.layer == 2
    assert rec.choice.config == {"method": "medusa", "model": str(d), "num_speculative_tokens": 3}
    assert rec.choice.runnable == ("medusa" in implemented_methods())
    assert [e.ok for e in evidence(rec.tree)] == [True]


def test_eagle3_preferred_over_medusa_and_eagle1_detected(target, tmp_path):
    m = medusa(tmp_path / "drafts" / "med")
    e3 = eagle3(tmp_path / "drafts" / "e3")
    e1 = eagle1(tmp_path / "elsewhere" / "my-eagle")
    rec = r.recommend(str(target), drafts=[str(tmp_path / "drafts"), str(e1)], candidates=[])
    kinds = {Path(d.path).name: d.kind for d in rec.drafts}
    assert kinds == {"med": "medusa", "e3": "eagle3", "my-eagle": "eagle"}
    assert all(d.accepted for d in rec.drafts)
    assert rec.choice.method == "eagle3" and rec.choice.config["model"] == str(e3)
    assert [a.method for a in rec.alternatives][:2] == ["eagle", "medusa"]
    assert str(m) in rec.alternatives[1].config["model"]


def test_mismatched_drafts_are_refused_with_reasons(target, tmp_path):
    medusa(tmp_path / "d" / "wrong-hidden", hidden=32)
    eagle3(tmp_path / "d" / "wrong-vocab", vocab=256)
    medusa(tmp_path / "d" / "other-base", base_model_name_or_path="lmsys/vicuna-7b-v1.3")
    eagle3(tmp_path / "d" / "too-deep", eagle_aux_hidden_state_layer_ids=[1, 3, 9])
    rec = r.recommend(str(target), drafts=[str(tmp_path / "d")], candidates=[])
    why = {Path(d.path).name: "; ".join(d.reasons) for d in rec.drafts}
    assert not any(d.accepted for d in rec.drafts)
    assert "hidden size 32 != the target's 64" in why["wrong-hidden"]
    assert "vocabulary 256 != the target's 128" in why["wrong-vocab"]
    assert "trained for lmsys/vicuna-7b-v1.3" in why["other-base"]
    assert "target has 4 layers" in why["too-deep"]
    assert q(rec, "Is there a Medusa head") == "no" and rec.choice.method == "ngram"
    assert {e.reason for e in evidence(rec.tree)} == set(why.values())


@pytest.mark.parametrize("record", ["hub", "specctl"])
def test_recorded_base_that_names_the_target_is_accepted(target, tmp_path, record):
    cfg = ({"base_model_name_or_path": f"someorg/{target.name}-Instruct"} if record == "hub"  # FasterDecoding's key
           else {"specctl": {"base_model": str(target), "trained_with": "specctl train-medusa"}})
    medusa(tmp_path / "d" / "ok", **cfg)
    rec = r.recommend(str(target), drafts=[str(tmp_path / "d" / "ok")], candidates=[])
    assert rec.drafts[0].accepted and rec.choice.method == "medusa"
    assert rec.drafts[0].details["recorded_base"]


def test_same_family_small_model_gives_draft_model(target, tmp_path, tiny_model_dir):
    small = llama(tmp_path / "cands" / "small", layers=1, tokenizer=tiny_model_dir)
    rec = r.recommend(str(target), candidates=[str(small)], workload="code")
    c = rec.candidates[0]
    assert c.tokenizer == "same" and c.verdict == "draft" and c.rho_estimate < 0.5
    assert c.predicted_speedup == pytest.approx(r.best_k(0.8, c.rho_estimate)[1])
    assert q(rec, "Is there a smaller model") == "yes" and q(rec, "Is ρ in the sweet spot") == "yes"
    assert rec.choice.method == "draft_model" and rec.choice.layer == 3
    assert rec.choice.config == {"method": "draft_model", "model": str(small), "num_speculative_tokens": c.best_k}
    assert rec.alternatives[0].method == "ngram"  # code copies the prompt: ngram is the rival to compare
    assert "ρ≈" in evidence(rec.tree)[0].reason
    # ... or both: ngram first, the draft model where it has nothing, with each part's predicted gain
    hyb = rec.alternatives[1]
    assert hyb.method == "hybrid" and hyb.layer == 3 and hyb.runnable
    assert [p["method"] for p in hyb.config["proposers"]] == ["ngram", "draft_model"]
    assert hyb.config["proposers"][1] == rec.choice.config
    assert f"predicted x{c.predicted_speedup:.2f}" in hyb.reason and hyb.reason.count("predicted x") == 2
    SpecConfig.from_dict(hyb.config)  # a config specctl takes as it is
    assert "--speculative-config" in hyb.commands["specctl_bench"]
    run, _ = r.probe_plan(rec)
    assert any(label == "hybrid:ngram+draft_model" for label, _ in run)  # --probe measures it too


def test_same_family_but_rho_too_high_falls_through(target, tmp_path, tiny_model_dir):
    near = llama(tmp_path / "cands" / "near", layers=3, tokenizer=tiny_model_dir)
    rec = r.recommend(str(target), candidates=[str(near)], workload="chat")
    assert q(rec, "Is there a smaller model") == "yes" and q(rec, "Is ρ in the sweet spot") == "no"
    assert "ρ too close to 1" in rec.candidates[0].reason and rec.choice.method == "ngram"


def test_bigger_model_is_not_a_draft(target, tmp_path, tiny_model_dir):
    big = llama(tmp_path / "cands" / "big", layers=6, tokenizer=tiny_model_dir)
    rec = r.recommend(str(target), candidates=[str(big)])
    assert "not smaller than the target" in rec.candidates[0].reason
    assert q(rec, "Is there a smaller model") == "no" and rec.choice.method == "ngram"


def test_different_tokenizer_is_not_same_family_but_an_alternative(target, tmp_path, word_tok_dir):
    other = llama(tmp_path / "cands" / "other", layers=1, tokenizer=word_tok_dir, arch="qwen2")
    rec = r.recommend(str(target), candidates=[str(other)], workload="chat")
    c = rec.candidates[0]
    assert c.tokenizer == "different" and c.overlap["draft_coverage"] < 0.1 and c.overlap["mode"] == "text"
    assert c.verdict == "alternative" and c.alpha_prior == pytest.approx(0.6 - r.CROSS_TOKENIZER_PENALTY)
    assert "another architecture (qwen2)" in c.reason
    assert q(rec, "Is there a smaller model") == "no" and rec.choice.method == "ngram"
    assert rec.alternatives[0].method == "draft_model" and rec.alternatives[0].config["model"] == str(other)


def test_plain_model_given_as_draft_becomes_a_candidate(target, tmp_path, tiny_model_dir):
    small = llama(tmp_path / "d" / "small", layers=1, tokenizer=tiny_model_dir)
    rec = r.recommend(str(target), drafts=[str(small)], candidates=[])
    assert rec.drafts == [] and [c.path for c in rec.candidates] == [str(small)]
    assert rec.choice.method == "draft_model"


def test_catalogue_target_not_pulled_is_judged_from_metadata():
    rec = r.recommend("qwen2.5-coder-1.5b", workload="code")  # empty cache: nothing pulled, nothing fetched
    assert rec.target.path is None and rec.target.arch == "qwen2" and rec.target.vocab_size == 151936
    by_name = {c.name: c for c in rec.candidates}
    assert set(by_name) == {"smollm2-135m", "qwen2.5-coder-0.5b", "gemma-3-270m"}
    assert by_name["qwen2.5-coder-0.5b"].tokenizer == "same" and by_name["qwen2.5-coder-0.5b"].verdict == "draft"
    assert "not verified" in by_name["qwen2.5-coder-0.5b"].reason
    assert by_name["gemma-3-270m"].tokenizer == "different" and not by_name["gemma-3-270m"].runnable
    assert rec.choice.method == "draft_model" and rec.choice.config["model"] == "qwen2.5-coder-0.5b"
    assert any("not pulled" in n for n in rec.notes)


# --------------------------------------------------------------------------- bad input

def test_bad_input_raises_one_line_errors(tmp_path, target):
    with pytest.raises(ModelError, match="no such file or folder"):
        r.recommend(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    save_file({"w": torch.zeros(1)}, str(broken / "model.safetensors"))
    with pytest.raises(ModelError, match="cannot read .*config.json") as e:
        r.recommend(str(broken))
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="unknown workload"):
        r.recommend(str(target), workload="poetry")
    with pytest.raises(ModelError, match="--drafts"):
        r.recommend(str(target), drafts=[str(tmp_path / "missing")])


# --------------------------------------------------------------------------- probing a Layer-2 draft

def test_probe_uses_an_exported_eagle3_draft(tiny_model_factory, tmp_path):
    """specctl's own EAGLE-3 export is detected, accepted, and probed through the hidden-state hooks."""
    if "eagle3" not in implemented_methods():
        pytest.skip("eagle3 is not implemented in this installation")
    export = pytest.importorskip("specctl.training.eagle_export")
    from specctl.runtime.proposers.eagle import EagleDraft, spec_from_target
    from specctl.runtime.runner import load_model

    import shutil

    # a private copy: the session's shared model folders sit beside other tests' drafts
    tgt = tmp_path / "target" / "tiny"
    shutil.copytree(tiny_model_factory(num_hidden_layers=4), tgt)
    loaded = load_model(tgt, dtype="float32")
    torch.manual_seed(0)
    d = EagleDraft(spec_from_target(loaded.model.args, 3, 100)).eval()
    out = export.export_eagle(d, tmp_path / "drafts" / "tiny-eagle3", loaded)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc abc abc abc"}) + "\n")
    rec = r.recommend(str(tgt), drafts=[str(out)], candidates=[])
    assert [(x.kind, x.accepted) for x in rec.drafts] == [("eagle3", True)], rec.drafts[0].reasons
    assert rec.choice.method == "eagle3" and rec.choice.runnable
    res = r.probe(rec, prompts=str(prompts), num_prompts=1, max_new_tokens=10, dtype="float32")
    r.apply_probe(rec, res)
    rows = {x["method"]: x for x in res["methods"]}
    assert {"eagle3", "ngram", "suffix"} <= set(rows) and not res["skipped"]
    e = rows["eagle3"]
    assert e["identical_to_baseline"] == 1 and e["rho"] > 0 and e["config"]["model"] == str(out)
    assert rec.tree.children[-1].text.startswith("Measured")


# --------------------------------------------------------------------------- sparse_attn and the roofline

def qwen_like(folder: Path, layers: int = 4) -> Path:
    """A folder whose config has Qwen2.5-0.5B's attention shapes (14 heads, 2 KV heads of 64)."""
    return llama(folder, layers=layers, extra_config={"num_attention_heads": 14, "num_key_value_heads": 2,
                                                     "head_dim": 64})


def test_long_context_at_batch_gives_sparse_attn(tmp_path, tiny_model_dir):
    target = qwen_like(tmp_path / "t")
    rec = r.recommend(str(target), candidates=[], workload="long-context", context=32768, batch=8)
    assert q(rec, "Is the KV cache a large share") == "yes"
    assert rec.choice.method == "sparse_attn" and rec.choice.config["sparse_attn_algorithm"] == "vegas"
    assert [a.method for a in rec.alternatives][:1] == ["ngram"]  # what it replaced
    assert "--reuse-prefill" in rec.choice.commands["specctl_bench"]
    from specctl.config import SpecConfig

    SpecConfig.from_dict(rec.choice.config)  # a valid config as it is
    run, _ = r.probe_plan(rec)
    assert "sparse_attn" in [label for label, _ in run]


def test_short_context_does_not_pay_for_sparse_attn(tmp_path):
    target = qwen_like(tmp_path / "t")
    rec = r.recommend(str(target), candidates=[], workload="long-context", context=512, batch=1)
    assert q(rec, "Is the KV cache a large share") == "no"
    assert rec.choice.method == "ngram" and "sparse_attn" not in [a.method for a in rec.alternatives]
