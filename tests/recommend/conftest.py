"""Fixtures of the recommend tests: an empty model cache (catalogue models count as not pulled, nothing
is fetched), a target folder with the conftest's tokenizer, and a word-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recommend.builders import V, llama


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def word_tok_dir(tmp_path_factory) -> Path:
    """A word-level tokenizer (128 multi-character words): almost nothing in common with the char one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>"] + [f"w{i:03d}" for i in range(V - 1)]
    raw = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path_factory.mktemp("word-tok")
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture
def target(tmp_path, tiny_model_dir) -> Path:
    return llama(tmp_path / "models" / "target", layers=4, tokenizer=tiny_model_dir)
