"""specctl.recommend.flowchart: the walk's branches on tiny on-disk folders, and one-line errors on bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specctl.errors import ModelError, UsageError
from specctl.recommend.flowchart import recommend
from tests.recommend.builders import H, V, answers, llama, q, refuse_dense


def test_nothing_falls_through_to_ngram(target):
    rec = recommend(str(target), candidates=[], workload="chat")
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
    rec = recommend(str(target), candidates=[], workload="agentic")
    assert q(rec, "Do requests repeat") == "yes"
    assert rec.choice.method == "suffix" and rec.choice.commands["specctl_flags"] == "--method suffix -k 16"
    assert [a.method for a in rec.alternatives] == ["ngram"]


def test_own_training_gives_mtp_plan_and_a_choice_for_now(target):
    rec = recommend(str(target), candidates=[], own_training=True)
    assert q(rec, "Do you train") == "yes"
    assert rec.choice.method == "mtp" and rec.choice.layer == 4 and not rec.choice.runnable
    assert "plan" in rec.choice.note and "deepseek_mtp" in rec.choice.note
    assert rec.alternatives[0].method == "ngram"  # what to run until the MTP layers are trained
    assert any(n.text == "Until then:" for n in rec.tree.children[0].children)


def test_own_training_with_mtp_layers_uses_them(tmp_path, tiny_model_dir):
    shapes = {f"model.layers.4.{n}.weight": [H, 2 * H if n == "eh_proj" else H] for n in ("eh_proj", "enorm", "hnorm")}
    t = llama(tmp_path / "m" / "target", tokenizer=tiny_model_dir, extra_config={"num_nextn_predict_layers": 1},
              extra_shapes=shapes)
    rec = recommend(str(t), candidates=[], own_training=True)
    assert q(rec, "Do you train") == "yes" and q(rec, "Does the model carry MTP") == "yes"
    assert rec.choice.method == "mtp" and "model" not in rec.choice.config and "plan" not in rec.choice.note


def test_bad_input_raises_one_line_errors(tmp_path, target):
    with pytest.raises(ModelError, match="no such file or folder"):
        recommend(str(tmp_path / "nope"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    save_file({"w": torch.zeros(1)}, str(broken / "model.safetensors"))
    with pytest.raises(ModelError, match="cannot read .*config.json") as e:
        recommend(str(broken))
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="unknown workload"):
        recommend(str(target), workload="poetry")
    with pytest.raises(ModelError, match="--drafts"):
        recommend(str(target), drafts=[str(tmp_path / "missing")])


def test_gguf_target_commands_carry_quantization_and_serve_the_file(tmp_path, monkeypatch):
    """What runs is what the commands say: --quantization gguf on specctl's, the .gguf itself for vLLM
    (with its source repo's tokenizer; where the file names none, the line to complete, in the reason)."""
    from tests.recommend.builders import gguf_llama

    refuse_dense(monkeypatch)
    f = gguf_llama(tmp_path / "m.gguf")
    rec = recommend(str(f), candidates=[], workload="code", quantization="gguf")
    for c in [rec.choice, *rec.alternatives]:
        assert c.commands["specctl_serve"].startswith(f"specctl serve --model {f} --quantization gguf --")
        assert c.commands["specctl_bench"].startswith(f"specctl bench --model {f} --quantization gguf --")
        assert c.commands["vllm"] is None and c.vllm_config is not None  # no repo named: nothing to paste as is
        assert "does not name the Hugging Face repo" in c.vllm_unsupported
        assert f"vllm serve {f} --tokenizer HF_REPO --speculative-config" in c.vllm_unsupported
    assert rec.to_dict()["target"]["quantization"] == "gguf"

    named = gguf_llama(tmp_path / "n.gguf", general_source_huggingface_repository="org/tiny")
    rec = recommend(str(named), candidates=[], workload="code", quantization="gguf")
    assert rec.choice.commands["vllm"].startswith(f"vllm serve {named} --tokenizer org/tiny --speculative-config ")
    dense = recommend(str(named), candidates=[], workload="code")  # dense: specctl converts when it serves
    assert "--quantization" not in dense.choice.commands["specctl_serve"]
    assert dense.choice.commands["vllm"].startswith(f"vllm serve {named} --tokenizer org/tiny ")  # no folder here


def test_catalogue_target_as_its_kept_gguf_pulls_no_dense_weights(monkeypatch):
    from specctl.models import gguf_path
    from tests.recommend.builders import gguf_llama

    refuse_dense(monkeypatch)
    kept = gguf_path("smollm2-135m")
    kept.parent.mkdir(parents=True)
    gguf_llama(kept)
    rec = recommend("smollm2-135m", candidates=[], workload="code", pull=True, quantization="gguf")
    assert rec.target.gguf_file == str(kept) and rec.target.path is None and rec.target.num_layers == 2
    assert rec.choice.commands["specctl_serve"].startswith("specctl serve --model smollm2-135m --quantization gguf ")
    assert rec.choice.commands["vllm"].startswith(
        f"vllm serve {kept} --tokenizer HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config ")
