"""specctl.training.loop's run folders: a folder another trainer made is refused by that trainer's name."""

from __future__ import annotations

import json

import pytest

from specctl.errors import UsageError
from specctl.training import checkpoints as C
from specctl.training import loop as L
from specctl.training.eagle import EagleTrainConfig
from specctl.training.medusa import MedusaTrainConfig
from specctl.training.mtp import MtpTrainConfig


def _run_folder(tmp_path, settings: dict):
    """A run folder as a trainer leaves it: checkpoints/step-0000004/ with its state and its settings."""
    ck = tmp_path / "run" / C.CHECKPOINTS / "step-0000004"
    ck.mkdir(parents=True)
    (ck / C.TRAINER_STATE).write_text(json.dumps({"step": 4}))
    (ck / C.TRAINING_CONFIG).write_text(json.dumps(settings))
    return tmp_path / "run"


def test_the_settings_record_the_trainer():
    for cls, name in ((MedusaTrainConfig, "train-medusa"), (EagleTrainConfig, "train-eagle"), (MtpTrainConfig, "train-mtp")):
        d = cls(model="m", output="o").to_dict()
        assert d["trainer"] == name and "TRAINER" not in d


@pytest.mark.parametrize("resume", [False, True])
def test_another_trainers_run_folder_is_refused_by_name(tmp_path, resume):
    out = _run_folder(tmp_path, MedusaTrainConfig(model="m", output="o").to_dict())
    with pytest.raises(UsageError, match=r"holds a run that train-medusa made \(checkpoints/step-0000004\), "
                                         r"not train-eagle") as e:
        L.resume_point(EagleTrainConfig(model="m", output=str(out), resume=resume), log=lambda m: None)
    assert "new --output" in e.value.fix


def test_a_run_from_before_names_were_recorded_is_told_by_its_settings(tmp_path):
    old = MedusaTrainConfig(model="m", output="o").to_dict()
    del old["trainer"]
    out = _run_folder(tmp_path, old)
    with pytest.raises(UsageError, match=r"a run that another trainer \(settings .*fc_bias.*\) made"):
        L.resume_point(EagleTrainConfig(model="m", output=str(out), resume=True), log=lambda m: None)
    # the trainer's own run, named or not, is its own: resumed
    for own in (MedusaTrainConfig(model="m", output="o").to_dict(), old):
        out = _run_folder(tmp_path / own.get("trainer", "old"), own)
        cfg = MedusaTrainConfig(model="m", output=str(out), resume=True)
        assert L.resume_point(cfg, log=lambda m: None) == out / C.CHECKPOINTS / "step-0000004"


def test_a_resumed_run_may_go_on_over_more_data_where_its_held_out_set_stays_apart(tmp_path):
    """--resume with data sources appended to the checkpoint's: the run goes on over all of them (logged), where
    --eval-data (train-eagle) or --eval-split 0 keeps the held-out set apart; where the held-out set is a seeded
    split of the data, more data would reshuffle it into sequences trained on, so it is refused. Other changes
    to the data (a source dropped or replaced) are refused everywhere."""
    said = []
    was = EagleTrainConfig(model="m", output="o", data=["a.jsonl"], eval_data=["held.jsonl"]).to_dict()
    out = _run_folder(tmp_path / "eagle", was)
    grown = EagleTrainConfig(model="m", output=str(out), data=["a.jsonl", "b.jsonl"], eval_data=["held.jsonl"], resume=True)
    assert L.resume_point(grown, log=said.append) == out / C.CHECKPOINTS / "step-0000004"
    assert any("1 more --data source(s)" in m and "b.jsonl" in m for m in said)
    for data in (["b.jsonl", "a.jsonl"], ["b.jsonl"]):
        with pytest.raises(UsageError, match="--resume: data was"):
            L.resume_point(EagleTrainConfig(model="m", output=str(out), data=data, eval_data=["held.jsonl"], resume=True),
                           log=said.append)
    split = MedusaTrainConfig(model="m", output="o", data=["a.jsonl"]).to_dict()  # held out: 5 % of the data
    out = _run_folder(tmp_path / "medusa", split)
    with pytest.raises(UsageError, match="--resume: data was") as e:
        L.resume_point(MedusaTrainConfig(model="m", output=str(out), data=["a.jsonl", "b.jsonl"], resume=True),
                       log=said.append)
    assert "--eval-split 0" in e.value.fix
    out = _run_folder(tmp_path / "nosplit", dict(split, eval_split=0.0))
    assert L.resume_point(MedusaTrainConfig(model="m", output=str(out), data=["a.jsonl", "b.jsonl"], eval_split=0.0,
                                            resume=True), log=said.append)
