"""specctl.recommend.inspection: safetensors headers read without the tensors' data, one-line errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from specctl.errors import ModelError
from specctl.recommend.inspection import tensor_index
from tests.recommend.builders import refuse_dense


def test_tensor_index_reads_every_file_header(tmp_path):
    save_file({"a.weight": torch.zeros(3, 4, dtype=torch.bfloat16)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b.bias": torch.zeros(5), "d2t": torch.zeros(2, dtype=torch.int64)}, str(tmp_path / "model-2.safetensors"))
    assert tensor_index(tmp_path) == {"a.weight": ("BF16", [3, 4]), "b.bias": ("F32", [5]), "d2t": ("I64", [2])}


def test_damaged_header_is_one_line(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelError, match="cannot read the safetensors header") as e:
        tensor_index(tmp_path)
    assert "\n" not in str(e.value)


def test_gguf_file_is_read_from_its_header_not_converted(tmp_path, monkeypatch):
    from specctl.recommend.inspection import inspect_model
    from tests.recommend.builders import H, V, gguf_llama

    refuse_dense(monkeypatch)
    f = gguf_llama(tmp_path / "tiny.Q4.gguf", layers=3)
    info = inspect_model(str(f), pull=True)
    assert (info.source, info.path, info.gguf_file) == ("gguf", None, str(f.resolve()))
    assert (info.arch, info.num_layers, info.hidden_size, info.vocab_size) == ("llama", 3, H, V)
    per_layer = 2 * H * H + 2 * (H // 2) * H + 3 * H * 2 * H
    assert info.params == 2 * V * H + 3 * per_layer and info.cost_params == V * H + 3 * per_layer  # untied: embed is a lookup
    assert info.config["num_attention_heads"] == 4 and info.config["num_key_value_heads"] == 2
    assert "Tiny Llama GGUF" in info.names and info.hub_id is None
    assert not (tmp_path / "cache" / "models").exists()  # nothing converted into the cache


def test_gguf_names_its_source_repo(tmp_path):
    from specctl.recommend.inspection import inspect_model
    from tests.recommend.builders import gguf_llama

    f = gguf_llama(tmp_path / "m.gguf", untied=False,
                   general_source_huggingface_repository="HuggingFaceTB/SmolLM2-135M-Instruct")
    info = inspect_model(str(f))
    assert info.hub_id == "HuggingFaceTB/SmolLM2-135M-Instruct" and info.config["tie_word_embeddings"] is True
    assert info.cost_params == info.params


@pytest.mark.parametrize("content", [b"", b"not a gguf at all", b"GGUF\x03\x00\x00\x00\xff"])
def test_unreadable_gguf_is_one_line(tmp_path, monkeypatch, content):
    from specctl.recommend.inspection import inspect_model

    refuse_dense(monkeypatch)
    f = tmp_path / "bad.gguf"
    f.write_bytes(content)
    with pytest.raises(ModelError, match="cannot read the GGUF header of") as e:
        inspect_model(str(f))
    assert "\n" not in str(e.value)
