"""A draft folder of one kind passed for another method's draft is one line naming both kinds (it was a
KeyError, an "EAGLE-1 checkpoint does not fit" for an eagle3 request, or a state_dict traceback), and
MTP modules made for another target are one line naming the sizes."""

from __future__ import annotations

import pytest
import torch

from specctl.config import SpecConfig
from specctl.drafts.eagle import EagleDraft, spec_from_target
from specctl.drafts.eagle_files import export_eagle
from specctl.drafts.kinds import draft_method, folder_kind
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


def test_a_config_without_method_runs_the_method_of_its_draft_folder(folders, tiny_model_dir):
    """vLLM works the method out from the draft's config when "method" is left out; SpecConfig does too for a
    local folder (Medusa heads, EAGLE/EAGLE-3 drafts, MTP modules) when told how (``method_of``: what bench and
    serve pass), also in a hybrid. A plain model folder, and a name that is not a local folder, stay draft_model."""
    for kind, folder in folders.items():
        cfg = SpecConfig.from_dict({"model": str(folder), "num_speculative_tokens": 2}, method_of=draft_method)
        assert cfg.method == kind and cfg.to_dict()["method"] == kind
    assert SpecConfig.from_dict({"model": str(tiny_model_dir)}, method_of=draft_method).method == "draft_model"
    assert SpecConfig.from_dict({"model": "someorg/no-such-model"}, method_of=draft_method).method == "draft_model"
    hybrid = SpecConfig.from_dict({"method": "hybrid", "proposers": [{"method": "ngram"}, {"model": str(folders["medusa"])}]},
                                  method_of=draft_method)
    assert [p["method"] for p in hybrid.proposers] == ["ngram", "medusa"]


def test_a_method_less_medusa_or_eagle3_config_builds_its_proposer(folders, tiny_model_dir):
    """What ``bench --speculative-config '{"model": FOLDER}'`` does: before, a draft_model load that failed."""
    target = load_model(tiny_model_dir, dtype="float32")
    for kind, proposer in (("medusa", "MedusaProposer"), ("eagle3", "Eagle3Proposer")):
        built = build_proposer(SpecConfig.from_json(f'{{"model": "{folders[kind]}", "num_speculative_tokens": 2}}',
                                                    method_of=draft_method), 256, target=target)
        assert type(built).__name__ == proposer


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "mtp"])
def test_a_draft_folder_given_as_draft_model_is_one_line_naming_its_method(folders, kind):
    with pytest.raises(UsageError) as e:
        SpecConfig.from_dict({"method": "draft_model", "model": str(folders[kind])}, method_of=draft_method)
    assert f'"method": "{kind}"' in e.value.fix and "draft_model" in e.value.problem and "\n" not in str(e.value)


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
