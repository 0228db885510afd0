"""specctl.recommend.detect: each draft format detected and checked against the target (hidden size,
vocabulary, recorded base model, MTP layers built in or trained for it), and model names compared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specctl.drafts.medusa import MedusaHeads, load_medusa, save_medusa
from specctl.drafts.mtp_files import mtp_modules
from specctl.errors import ModelError
from specctl.recommend.detect import name_key
from specctl.recommend.flowchart import recommend
from specctl.recommend.inspection import gguf_mtp
from tests.recommend.builders import H, V, eagle1, eagle3, evidence, llama, medusa, q, write_folder


def test_name_key_matches_spellings_of_one_model():
    assert name_key("Qwen/Qwen2.5-Coder-1.5B-Instruct") == name_key("qwen2.5-coder-1.5b-bfloat16") \
        == name_key("Qwen2.5 Coder 1.5B Instruct GGUF")
    assert name_key("lmsys/vicuna-7b-v1.3") != name_key("meta-llama/Llama-2-7b-chat-hf")


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
    rec = recommend(str(t), candidates=[])
    assert q(rec, "Does the model carry MTP") == "yes"
    assert rec.mtp.present and rec.mtp.layers == (1 if layout == "deepseek" else 2)
    assert rec.choice.method == "mtp" and rec.choice.config["num_speculative_tokens"] == rec.mtp.layers
    assert rec.choice.runnable
    assert any("MTP tensors" in e for e in rec.mtp.evidence)


def test_mtp_draft_folder_trained_for_the_target(target, tmp_path):
    """specctl train-mtp's draft folder: the target's config + num_nextn_predict_layers, only model.layers.{N+i}.*."""
    def mtp_draft(folder, n_main):
        shapes = {f"model.layers.{n_main}.{n}.weight": [H, 2 * H if n == "eh_proj" else H] for n in ("eh_proj", "enorm", "hnorm")}
        shapes[f"model.layers.{n_main}.self_attn.q_proj.weight"] = [H, H]
        return write_folder(folder, {"model_type": "llama", "hidden_size": H, "vocab_size": V, "num_hidden_layers": n_main,
                                     "num_nextn_predict_layers": 1}, shapes)

    good = mtp_draft(tmp_path / "d" / "mtp-ok", 4)
    mtp_draft(tmp_path / "d" / "mtp-other", 6)
    rec = recommend(str(target), drafts=[str(tmp_path / "d")], candidates=[])
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
    meta = gguf_mtp(path)
    assert meta == {"deepseek2.nextn_predict_layers": 1, "nextn_tensors": 1}
    m = mtp_modules({}, {}, meta)
    assert m.present and m.layers == 1 and any("GGUF" in e for e in m.evidence)


def test_declared_mtp_without_tensors_is_refused(tmp_path, tiny_model_dir):
    t = llama(tmp_path / "m" / "target", tokenizer=tiny_model_dir, extra_config={"num_nextn_predict_layers": 1})
    rec = recommend(str(t), candidates=[])
    assert q(rec, "Does the model carry MTP") == "no"
    assert "no MTP tensors" in rec.mtp.refused and rec.choice.method == "ngram"


def test_medusa_draft_beside_the_model(target):
    d = medusa(target.parent / "target-medusa", heads=3)
    rec = recommend(str(target), candidates=[])  # no --drafts: found beside the model
    assert q(rec, "Is there a Medusa head") == "yes"
    assert rec.choice.method == "medusa" and rec.choice.layer == 2
    assert rec.choice.config == {"method": "medusa", "model": str(d), "num_speculative_tokens": 3}
    assert rec.choice.runnable
    assert [e.ok for e in evidence(rec.tree)] == [True]


def test_medusa_heads_sharing_one_lm_head_are_accepted_as_the_loader_accepts_them(target, tmp_path):
    """train-medusa --shared-lm-head writes one lm_heads.0 for K heads (vLLM's original_lm_head, here with a
    truncated vocabulary): the folder the loader loads is accepted, and one it refuses (K LM heads beside
    original_lm_head) is refused naming the layout."""
    shared = save_medusa(MedusaHeads(H, V, 3, shared_lm_head=True, token_map=torch.arange(0, V, 4)),
                         tmp_path / "d" / "shared", torch.float32)
    assert load_medusa(shared).num_heads == 3
    rec = recommend(str(target), drafts=[str(shared)], candidates=[])
    assert rec.drafts[0].accepted, rec.drafts[0].reasons
    assert rec.choice.config == {"method": "medusa", "model": str(shared), "num_speculative_tokens": 3}

    wrong = medusa(tmp_path / "d" / "wrong", heads=3, original_lm_head=True)
    with pytest.raises(ModelError, match="unexpected tensor 'lm_heads.1.weight'"):
        load_medusa(wrong)
    rec = recommend(str(target), drafts=[str(wrong)], candidates=[])
    assert not rec.drafts[0].accepted
    assert "config says 3 heads sharing one LM head (original_lm_head) but the weights hold 3 lm_heads" in rec.drafts[0].reasons


def test_eagle3_preferred_over_medusa_and_eagle1_detected(target, tmp_path):
    m = medusa(tmp_path / "drafts" / "med")
    e3 = eagle3(tmp_path / "drafts" / "e3")
    e1 = eagle1(tmp_path / "elsewhere" / "my-eagle")
    rec = recommend(str(target), drafts=[str(tmp_path / "drafts"), str(e1)], candidates=[])
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
    rec = recommend(str(target), drafts=[str(tmp_path / "d")], candidates=[])
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
    rec = recommend(str(target), drafts=[str(tmp_path / "d" / "ok")], candidates=[])
    assert rec.drafts[0].accepted and rec.choice.method == "medusa"
    assert rec.drafts[0].details["recorded_base"]
