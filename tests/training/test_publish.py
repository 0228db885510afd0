"""Every trainer writes a model card (README.md) beside its export and pushes with --push-to-hub; a push
that could not happen (no token, HF_HUB_OFFLINE) is refused before any training, nothing written.
No network: the Hub's side is replaced."""

from __future__ import annotations

import json

import pytest

from specctl import hub
from specctl.training import eagle, medusa, mtp


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("publish-data")
    chat = folder / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"add {i}"},
                                                     {"role": "assistant", "content": f"x + {i} == {i} + x"}]}) + "\n"
                            for i in range(10)))
    return chat


def runs(model, chat, out, **kw):
    """(trainer, config, export folder, method) for each trainer, two steps each."""
    common = dict(model=str(model), data=[str(chat)], steps=2, batch_size=4, seq_len=48, eval_split=0.2, dtype="float32", **kw)
    return [(medusa.train, medusa.MedusaTrainConfig(output=str(out / "medusa"), num_heads=2, **common), out / "medusa", "medusa"),
            (eagle.train, eagle.EagleTrainConfig(output=str(out / "eagle3"), draft_vocab_size=64, ttt_steps=2, **common),
             out / "eagle3", "eagle3"),
            (mtp.train_mtp, mtp.MtpTrainConfig(output=str(out / "mtp"), depth=2, layout="deepseek_v3", **common),
             out / "mtp", "mtp")]


def call(train, cfg):
    return train(cfg, log=lambda m: None) if train is not mtp.train_mtp else train(cfg)


def test_model_card_and_push(tiny_model_dir, data, tmp_path, monkeypatch):
    pushed = []
    monkeypatch.setattr(hub, "check_push_access", lambda repo: "token")

    def push(folder, repo):
        pushed.append((folder, repo, (folder / "README.md").read_text()))
        return f"https://huggingface.co/{repo}"

    monkeypatch.setattr(hub, "push_to_hub", push)
    for train, cfg, export, method in runs(tiny_model_dir, data, tmp_path, push_to_hub=f"me/tiny-{tmp_path.name}"):
        s = call(train, cfg)
        assert s["hub"] == f"https://huggingface.co/{cfg.push_to_hub}"
        folder, repo, card = pushed[-1]
        assert folder == export and repo == cfg.push_to_hub
        assert f"\"method\": \"{method}\"" in card and f"\"model\": \"{repo}\"" in card  # served from the repo
        assert str(data) in card and "Held-out acceptance" in card and "mean acceptance length" in card
        assert (export / "README.md").read_text() == card


@pytest.mark.parametrize("offline", [False, True])
def test_push_refused_before_training(tiny_model_dir, data, tmp_path, monkeypatch, offline):
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake" if offline else None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    for train, cfg, export, _ in runs(tiny_model_dir, data, tmp_path, push_to_hub="me/tiny-draft"):
        with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE is set" if offline else "no Hugging Face token"):
            call(train, cfg)
        assert not export.exists()  # nothing trained, nothing written
