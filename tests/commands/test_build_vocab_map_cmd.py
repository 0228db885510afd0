"""`specctl build-vocab-map`: the overlap on stdout (table or --json), progress on stderr, a map file
that loads and knows its pair, EAGLE-3's d2t/t2d from a data file, and one-line usage errors. No network:
the draft is a tokenizer-only folder (byte-level BPE), the target the conftest's tiny model folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from specctl.cli import app
from specctl.errors import DataError, UsageError
from specctl.drafts.vocab_map import VocabMap

runner = CliRunner()


@pytest.fixture(scope="module")
def byte_tok_dir(tmp_path_factory):
    """A folder holding only a byte-level BPE tokenizer ('Ġ' spaces, two merges), like GPT-2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bs = list(range(ord("!"), ord("~") + 1))
    b2u = {b: chr(b) for b in bs} | {32: "Ġ", 10: "Ċ", 9: "ĉ"}
    tokens = ["<unk>", "<|im_end|>"] + [b2u[b] for b in [9, 10, 32, *bs]] + ["Ġt", "he"]
    raw = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[("Ġ", "t"), ("h", "e")],
                               unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(["<unk>", "<|im_end|>"])
    folder = tmp_path_factory.mktemp("byte-tok")
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<|im_end|>").save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path / "cache"))


def test_json_overlap_and_a_map_that_knows_its_pair(byte_tok_dir, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "map.safetensors"
    r = runner.invoke(app, ["build-vocab-map", "--draft", str(byte_tok_dir), "--target", str(tiny_model_dir),
                            "--output", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert "loading the tokenizer" in r.stderr and "wrote" in r.stderr  # progress on stderr only
    # 97 single-byte tokens and <unk>, <|im_end|> are shared; the merges 'Ġt' and 'he' are not
    assert rep["draft_vocab_size"] == 101 and rep["shared_tokens"] == 99
    assert rep["draft_coverage"] == pytest.approx(99 / 101) and rep["target_vocab_size"] == 128
    assert rep["draft_model_mode"] == "auto" and rep["output"] == str(out)
    assert 0.5 < rep["boundary_agreement"]["code"] < 1  # 'Ġt' and 'he' cut some code differently
    vmap = VocabMap.load(out)
    dt, tt = AutoTokenizer.from_pretrained(byte_tok_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    vmap.check_tokenizers(dt, tt)
    assert int(vmap.draft_to_target[dt.convert_tokens_to_ids("Ġ")]) == tt.convert_tokens_to_ids(" ")
    with pytest.raises(DataError, match="opposite direction"):
        vmap.check_tokenizers(tt, dt)


def test_table_and_eagle3_draft_vocab(byte_tok_dir, tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def f(x): return x", "hello there", "the end")))
    out = tmp_path / "map.json"
    r = runner.invoke(app, ["build-vocab-map", "--draft", str(byte_tok_dir), "--target", str(tiny_model_dir),
                            "--output", str(out), "--draft-vocab-size", "40", "--data", str(data)],
                      env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    assert "overlap" in r.stdout and "98.0% of the draft vocabulary" in r.stdout and "EAGLE-3" in r.stdout
    assert "cut alike (data)" in r.stdout
    dv = VocabMap.load(out).draft_vocab
    assert dv.draft_vocab_size == 40 and int(dv.t2d.sum()) == 40 and dv.t2d.numel() == 128
    assert torch.equal(dv.target_ids, torch.nonzero(dv.t2d).flatten()) and dv.coverage == 1.0


def test_eagle3_only_needs_no_draft(tiny_model_dir, tmp_path):
    data = tmp_path / "code.py"
    data.write_text("def add(a, b):\n    return a + b\n")
    out = tmp_path / "d2t.safetensors"
    r = runner.invoke(app, ["build-vocab-map", "--target", str(tiny_model_dir), "--output", str(out),
                            "--draft-vocab-size", "20", "--data", str(data), "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["eagle3_draft_vocab"]["draft_vocab_size"] == 20 and "draft_vocab_size" not in rep
    assert rep["draft"] is None and rep["draft_fingerprint"] is None  # "draft" was "" beside a null fingerprint
    vmap = VocabMap.load(out)
    assert vmap.draft_to_target is None and vmap.draft_vocab.d2t.numel() == 20
    assert vmap.draft_name is None and vmap.overlap()["draft"] is None  # the file's own name too, read back
    js = tmp_path / "d2t.json"
    vmap.save(js)
    assert VocabMap.load(js).draft_name is None


@pytest.mark.parametrize("args,msg", [
    ([], "nothing to build"),
    (["--draft-vocab-size", "10"], "go together"),
    (["--draft", "x", "--draft-vocab-size", "0", "--data", "y"], "must be positive"),
    (["--draft", "x", "--output", "map.txt"], "must end in .safetensors or .json"),
])
def test_usage_errors(tiny_model_dir, tmp_path, args, msg):
    argv = ["build-vocab-map", "--target", str(tiny_model_dir)]
    if "--output" not in args:
        argv += ["--output", str(tmp_path / "m.safetensors")]
    r = runner.invoke(app, argv + args)
    assert isinstance(r.exception, UsageError) and msg in str(r.exception)


def test_cli_errors_are_one_line_and_help_has_examples(tmp_path):
    env = {**os.environ, "SPECCTL_CACHE": str(tmp_path / "cache")}
    env.pop("SPECCTL_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "specctl.cli", "build-vocab-map", "--target", str(tmp_path / "nope"),
                        "--draft", str(tmp_path / "nope2"), "--output", str(tmp_path / "m.json")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and r.stderr.startswith("Error: ") and not r.stdout
    r = runner.invoke(app, ["build-vocab-map", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "specctl build-vocab-map --draft smollm2-135m --target qwen2.5-coder-1.5b" in r.stdout
