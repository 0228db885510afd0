"""specctl.recommend.inspection: safetensors headers read without the tensors' data, one-line errors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from specctl.errors import ModelError
from specctl.recommend.inspection import tensor_index


def test_tensor_index_reads_every_file_header(tmp_path):
    save_file({"a.weight": torch.zeros(3, 4, dtype=torch.bfloat16)}, str(tmp_path / "model-1.safetensors"))
    save_file({"b.bias": torch.zeros(5), "d2t": torch.zeros(2, dtype=torch.int64)}, str(tmp_path / "model-2.safetensors"))
    assert tensor_index(tmp_path) == {"a.weight": ("BF16", [3, 4]), "b.bias": ("F32", [5]), "d2t": ("I64", [2])}


def test_damaged_header_is_one_line(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelError, match="cannot read the safetensors header") as e:
        tensor_index(tmp_path)
    assert "\n" not in str(e.value)
