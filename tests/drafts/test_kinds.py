"""A draft folder of one kind passed for another method's draft is one line naming both kinds (it was a
KeyError, an "EAGLE-1 checkpoint does not fit" for an eagle3 request, or a state_dict traceback), and
MTP modules made for another target are one line naming the sizes."""

from __future__ import annotations

import pytest
import torch

from specctl.config import SpecConfig
from specctl.drafts.eagle import EagleDraft, spec_from_target
from specctl.drafts.eagle_files import export_eagle
from specctl.drafts.kinds import folder_kind
from specctl.drafts.medusa import MedusaHeads, save_medusa
from specctl.drafts.mtp_files import export_mtp
from specctl.errors import ModelError, UsageError
from specctl.runtime.proposers import build_proposer
from specctl.runtime.loading import load_model
from specctl.training.mtp import init_stack


@pytest.fixture(scope="module")
def folders(tiny_model_dir, tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    a = tiny_model.args
    out = {"eagle": export_eagle(EagleDraft(spec_from_target(a, 1, None)), root / "e1"),
           "eagle3": export_eagle(EagleDraft(spec_from_target(a, 3, 100)), root / "e3"),
           "medusa": save_medusa(MedusaHeads(a.hidden_size, a.vocab_size, 2), root / "medusa")}
    torch.manual_seed(0)
    out["mtp"] = export_mtp(init_stack(tiny_model, 1), tiny_model_dir, root / "mtp", head_weight=tiny_model.head_weight)
    return out


def test_each_folder_is_told_apart(folders, tiny_model_dir):
    assert {kind: folder_kind(f) for kind, f in folders.items()} == {k: k for k in folders}
    assert folder_kind(tiny_model_dir) is None  # a whole model: a draft_model, not one of these


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa", "mtp"])
def test_a_draft_of_another_kind_is_one_line_naming_both(folders, tiny_model_dir, method):
    target = load_model(tiny_model_dir, dtype="float32")
    for kind, folder in folders.items():
        if kind == method:
            continue
        with pytest.raises(UsageError) as e:
            build_proposer(SpecConfig.from_dict({"method": method, "model": str(folder), "num_speculative_tokens": 2}),
                           256, target=target)
        assert f'not a draft for "method": "{method}"' in str(e.value) and f'"method": "{kind}"' in e.value.fix
        assert "\n" not in str(e.value)


def test_mtp_modules_for_another_target_name_the_sizes(folders, tiny_model_factory):
    other = load_model(tiny_model_factory(hidden_size=96, seed=1), dtype="float32")
    with pytest.raises(ModelError, match="hidden_size of 64, the target's is 96") as e:
        build_proposer(SpecConfig.from_dict({"method": "mtp", "model": str(folders["mtp"])}), 256, target=other)
    assert "train-mtp" in e.value.fix
