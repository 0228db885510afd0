"""specctl.hub: model cards for trained drafts and pushing to the Hub (refused up front offline). No network:
every name lookup and connection fails, and the Hub's API is replaced where a test needs it to answer."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from specctl import hub
from specctl.errors import SpecctlError
from specctl.vllm_compat import VLLM_SPECULATIVE_CONFIG_FIELDS


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (network disabled in tests)")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def draft(tmp_path: Path, config: dict, name: str = "draft") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"x")
    return folder


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


def serve_config(text: str) -> dict:
    line = next(ln for ln in text.splitlines() if "--speculative-config" in ln)
    return json.loads(line.split("'")[1])


HELD_OUT = {"acceptance_rate": 0.6125, "mean_acceptance_length": 2.837, "prompts": 16, "num_speculative_tokens": 4}


# --------------------------------------------------------------------------- model cards

def test_model_card_front_matter_serve_command_training_and_acceptance(tmp_path):
    folder = draft(tmp_path, {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000})
    cmd = "specctl train-eagle --model Qwen/Qwen2.5-Coder-1.5B-Instruct --version 3 --out draft"
    path = hub.write_model_card(folder, base_model="Qwen/Qwen2.5-Coder-1.5B-Instruct", method="eagle3",
                                data={"source": "Python standard library", "sequences": 2000}, command=cmd,
                                held_out=HELD_OUT, repo="me/qwen-eagle3", num_speculative_tokens=4)
    assert path == folder / "README.md"
    text = path.read_text()
    meta = front_matter(text)
    assert meta["base_model"] == "Qwen/Qwen2.5-Coder-1.5B-Instruct" and meta["library_name"] == "vllm"
    assert {"speculative-decoding", "eagle3", "specctl"} <= set(meta["tags"])
    spec = serve_config(text)
    assert spec == {"method": "eagle3", "model": "me/qwen-eagle3", "num_speculative_tokens": 4}
    assert set(spec) <= VLLM_SPECULATIVE_CONFIG_FIELDS  # what vLLM accepts, nothing specctl-only
    assert "vllm serve Qwen/Qwen2.5-Coder-1.5B-Instruct" in text and "--hf-overrides" not in text
    assert cmd in text and "Python standard library" in text and "2000" in text
    assert "0.613" in text and "2.84" in text and "held-out" in text.lower()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_model_card_of_a_catalogue_target_names_the_upstream_id(tmp_path):
    folder = draft(tmp_path, {"model_type": "medusa", "num_heads": 3})
    text = hub.model_card_text(folder, base_model="qwen2.5-coder-0.5b", method="medusa", data="stdlib code",
                               command="specctl train-medusa", held_out=None)
    assert front_matter(text)["base_model"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert "vllm serve Qwen/Qwen2.5-Coder-0.5B-Instruct" in text and "catalogue copy" in text
    spec = serve_config(text)
    assert spec["num_speculative_tokens"] == 3 and spec["model"] == str(folder.resolve())  # k = the heads
    assert "Not measured" in text


def test_model_card_of_a_local_target_has_no_base_model_key(tmp_path):
    folder = draft(tmp_path, {"architectures": ["LlamaForCausalLM"]})
    text = hub.model_card_text(folder, base_model="/models/my-target", method="draft_model", data=["a", "b"],
                               command="x", held_out=HELD_OUT)
    assert "base_model" not in front_matter(text) and "vllm serve /models/my-target" in text


def test_model_card_of_a_mimo_mtp_draft_gives_the_hf_overrides(tmp_path):
    folder = draft(tmp_path, {"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1})
    text = hub.model_card_text(folder, base_model="Qwen/Qwen2.5-Coder-0.5B-Instruct", method="mtp", data="d",
                               command="specctl train-mtp", held_out=HELD_OUT)
    assert serve_config(text)["method"] == "mtp" and serve_config(text)["num_speculative_tokens"] == 1
    assert "--hf-overrides '{\"num_nextn_predict_layers\": 1}'" in text


def test_model_card_of_a_deepseek_layout_mtp_draft_for_another_target_offers_no_vllm_command(tmp_path):
    """vLLM loads DeepSeek-V3's MTP layout only for DeepSeek-V3 targets (the folder carries its target's config)."""
    folder = draft(tmp_path, {"architectures": ["LlamaForCausalLM"], "num_nextn_predict_layers": 1})
    text = hub.model_card_text(folder, base_model="HuggingFaceTB/SmolLM2-135M-Instruct", method="mtp", data="d",
                               command="specctl train-mtp --layout deepseek_v3", held_out=None)
    assert "vllm serve" not in text and "--layout mimo" in text
    assert "specctl serve --model HuggingFaceTB/SmolLM2-135M-Instruct --speculative-config" in text


def test_model_card_of_an_eagle1_draft_serves_it_in_sglang_too(tmp_path):
    folder = draft(tmp_path, {"architectures": ["LlamaForCausalLM"]})
    (folder / "sglang").mkdir()
    (folder / "sglang" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle"]}))
    text = hub.model_card_text(folder, base_model="Qwen/Qwen2.5-Coder-1.5B-Instruct", method="eagle", data="d",
                               command="specctl train-eagle --version 1", held_out=None, repo="me/e1")
    assert "vllm serve Qwen/Qwen2.5-Coder-1.5B-Instruct" in text
    assert "--speculative-draft-model-path DIR/sglang" in text and "hf download me/e1 --local-dir DIR" in text
    assert "## Serve it with vLLM or SGLang" in text


def test_model_card_write_is_atomic(tmp_path, monkeypatch):
    folder = draft(tmp_path, {"model_type": "medusa", "num_heads": 2})
    (folder / "README.md").write_text("old card")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(hub.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        hub.write_model_card(folder, base_model="me/t", method="medusa", data="d", command="c", held_out=None)
    assert (folder / "README.md").read_text() == "old card"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_model_card_needs_the_folder(tmp_path):
    with pytest.raises(SpecctlError, match="is not a folder"):
        hub.write_model_card(tmp_path / "nope", base_model="me/t", method="eagle", data="d", command="c", held_out=None)


# --------------------------------------------------------------------------- push

def fail_if_called(*a, **k):
    pytest.fail("the Hub must not be written to")


@pytest.fixture
def api(monkeypatch):
    """huggingface_hub.HfApi's write calls, recorded; whoami as the test sets it."""
    import huggingface_hub

    seen: dict = {"whoami": lambda: {"name": "me"}}
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda self, token=None, **k: seen["whoami"]())
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **k: seen.setdefault("create", (repo_id, k)) and f"https://hf.co/{repo_id}")
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", lambda self, **k: seen.setdefault("upload", k))
    return seen


def test_push_without_a_token_is_refused_up_front(tmp_path, monkeypatch, api):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", fail_if_called)
    folder = draft(tmp_path, {})
    for call in (lambda: hub.check_push_access("me/draft"), lambda: hub.push_to_hub(folder, "me/draft")):
        with pytest.raises(hub.HubError) as e:
            call()
        msg = str(e.value)
        assert "no Hugging Face token is configured" in msg and "hf auth login" in msg and "\n" not in msg
    assert "create" not in api and "upload" not in api


def test_push_when_the_hub_is_unreachable_is_refused_up_front(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", fail_if_called)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", fail_if_called)
    with pytest.raises(hub.HubError) as e:  # the real whoami, against no network
        hub.push_to_hub(draft(tmp_path, {}), "me/draft")
    msg = str(e.value)
    assert "the Hugging Face Hub cannot be reached, so me/draft cannot be pushed" in msg and "\n" not in msg


def test_push_offline_mode_and_bad_repo_are_refused(tmp_path, monkeypatch, api):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake")
    with pytest.raises(hub.HubError, match="not a Hub repo id"):
        hub.check_push_access("not a repo")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE is set"):
        hub.push_to_hub(draft(tmp_path, {}), "me/draft")
    assert "create" not in api


def test_push_with_a_refused_token(tmp_path, monkeypatch, api):
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_bad")

    def unauthorized():
        req = httpx2.Request("GET", "https://huggingface.co/api/whoami-v2")
        raise HfHubHTTPError("401 Unauthorized\nInvalid credentials", response=httpx2.Response(401, request=req))

    api["whoami"] = unauthorized
    with pytest.raises(hub.HubError, match="refuses the configured token"):
        hub.push_to_hub(draft(tmp_path, {}), "me/draft")


def test_push_uploads_the_export_not_the_checkpoints(tmp_path, monkeypatch, api):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_fake")
    folder = draft(tmp_path, {})
    (folder / "checkpoints" / "step-0000004").mkdir(parents=True)
    url = hub.push_to_hub(folder, "me/draft", private=True)
    assert url == "https://hf.co/me/draft"
    assert api["create"] == ("me/draft", {"private": True, "exist_ok": True})
    up = api["upload"]
    assert up["repo_id"] == "me/draft" and up["folder_path"] == str(folder)
    assert "checkpoints/**" in up["ignore_patterns"]


def test_push_of_nothing_is_refused(tmp_path):
    with pytest.raises(hub.HubError, match="nothing to push"):
        hub.push_to_hub(tmp_path / "nope", "me/draft")


def test_model_card_of_a_truncated_vocabulary_medusa_turns_off_vllm_s_loader_check(tmp_path):
    """vLLM 0.32 refuses such a draft's token_map without --model-loader-extra-config (see vllm_compat)."""
    folder = draft(tmp_path, {"model_type": "medusa", "num_heads": 3, "vocab_size": 128, "truncated_vocab_size": 64})
    text = hub.model_card_text(folder, base_model="Qwen/Qwen2.5-Coder-0.5B-Instruct", method="medusa", data="d",
                               command="specctl train-medusa", held_out=HELD_OUT)
    assert "--model-loader-extra-config '{\"enable_weights_track\": false}'" in text
    assert serve_config(text)["method"] == "medusa"
