"""Vocabulary maps on three tiny tokenizers built in-process (no downloads):

  chars : the conftest's character-level tokenizer (plain spelling),
  byte  : GPT-2 style byte-level BPE ('Ġ' = space, 'Ċ' = newline) with merges,
  spm   : sentencepiece style ('▁' = space, <0xNN> byte-fallback tokens) with merges.

Mapping correctness on hand-picked tokens, fingerprints, files (safetensors and JSON, atomic), the
one-line refusal of a map for another pair, and EAGLE-3's reduced vocabulary (d2t/t2d).
"""

from __future__ import annotations

import json

import pytest
import torch

from specctl.drafts.draft_vocab import build_draft_vocab, reduced_vocab_from_counts
from specctl.drafts.vocab_map import VocabMap, build_vocab_map, token_bytes, tokenizer_fingerprint, tokenizer_scheme
from specctl.errors import DataError

SPECIALS = ("<unk>", "<|im_start|>", "<|im_end|>")


def byte_tokenizer(extra_merges=()):
    """Byte-level BPE over \\t, \\n, printable ASCII and the bytes of 'é' (C3 A9), with merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    b2u = dict(zip(bs, map(chr, cs)))
    merges = [("Ġ", "t"), ("h", "e"), ("q", "u"), ("Ã", "©"), *extra_merges]
    tokens = list(SPECIALS) + [b2u[b] for b in [9, 10, *range(32, 127), 0xC3, 0xA9]] + ["".join(m) for m in merges]
    raw = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<|im_end|>")


def spm_tokenizer():
    """Sentencepiece style: '▁' for spaces, <0x00>..<0xFF> byte fallback, pieces '▁t', 'he', 'é'."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = list(SPECIALS) + [f"<0x{b:02X}>" for b in range(256)] + ["▁"] + [chr(c) for c in range(33, 127)]
    pieces += ["▁t", "he", "é"]
    merges = [("▁", "t"), ("h", "e")]
    raw = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(pieces)}, merges=merges, unk_token="<unk>",
                               byte_fallback=True))
    raw.normalizer = normalizers.Replace(" ", "▁")
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    raw.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def chars(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def tid(tok, token: str) -> int:
    i = tok.convert_tokens_to_ids(token)
    assert i is not None and i != tok.unk_token_id or token == "<unk>", token
    return i


# --------------------------------------------------------------------------- byte strings


def test_schemes_are_recognised(chars):
    assert tokenizer_scheme(byte_tokenizer()) == "byte_level"
    assert tokenizer_scheme(spm_tokenizer()) == "sentencepiece"
    assert tokenizer_scheme(chars) == "plain"


def test_token_bytes_undo_each_spelling(chars):
    b, s = byte_tokenizer(), spm_tokenizer()
    bb, sb, cb = token_bytes(b), token_bytes(s), token_bytes(chars)
    assert bb[tid(b, "Ġ")] == b" " and bb[tid(b, "Ċ")] == b"\n" and bb[tid(b, "ĉ")] == b"\t"
    assert bb[tid(b, "Ġt")] == b" t" and bb[tid(b, "Ã©")] == "é".encode() and bb[tid(b, "Ã")] == b"\xc3"
    assert sb[tid(s, "▁t")] == b" t" and sb[tid(s, "▁")] == b" " and sb[tid(s, "<0x0A>")] == b"\n"
    assert sb[tid(s, "<0xC3>")] == b"\xc3" and sb[tid(s, "é")] == "é".encode()
    assert cb[tid(chars, " ")] == b" " and cb[tid(chars, "\n")] == b"\n" and cb[tid(chars, "<extra_0>")] == b"<extra_0>"
    for tok, table in ((b, bb), (s, sb), (chars, cb)):
        assert table[tid(tok, "<|im_end|>")] == b"<|im_end|>"  # added tokens stand for their content
    # the byte strings are what the tokenizer decodes to
    for tok, table in ((b, bb), (s, sb)):
        ids = tok.encode("the quick é\n\tthe", add_special_tokens=False)
        assert b"".join(table[i] for i in ids).decode() == "the quick é\n\tthe"


# --------------------------------------------------------------------------- the map


def test_byte_level_to_sentencepiece_by_hand_picked_tokens():
    b, s = byte_tokenizer(), spm_tokenizer()
    m = build_vocab_map(b, s, "byte", "spm")
    d2t = m.draft_to_target
    expect = {"Ġt": "▁t", "Ġ": "▁", "Ċ": "<0x0A>", "ĉ": "<0x09>", "Ã": "<0xC3>", "©": "<0xA9>", "Ã©": "é",
              "he": "he", "a": "a", "<|im_end|>": "<|im_end|>"}
    for dtok, ttok in expect.items():
        assert int(d2t[tid(b, dtok)]) == tid(s, ttok), (dtok, ttok)
    assert int(d2t[tid(b, "qu")]) == -1  # no 'qu' piece in the target: outside the intersection
    assert m.draft_vocab_size == len(b) and m.num_shared == len(b) - 1
    # '▁' was preferred over its byte token <0x20> above (both spell b' '); the inverse map of the
    # other direction names the lowest of the draft ids that share a target id
    back = build_vocab_map(s, b).target_to_draft()
    assert int(back[tid(b, "Ġ")]) == tid(s, "<0x20>") and int(back[tid(b, "Ċ")]) == tid(s, "<0x0A>")
    assert int(back[tid(b, "Ġt")]) == tid(s, "▁t") and int(back[tid(b, "qu")]) == -1


def test_sentencepiece_to_characters(chars):
    s = spm_tokenizer()
    m = build_vocab_map(s, chars)
    d2t = m.draft_to_target
    assert int(d2t[tid(s, "▁")]) == tid(chars, " ") and int(d2t[tid(s, "<0x0A>")]) == tid(chars, "\n")
    assert int(d2t[tid(s, "<0x20>")]) == tid(chars, " ")  # several draft ids may share one target id
    for piece in ("▁t", "he", "é", "<0xC3>"):
        assert int(d2t[tid(s, piece)]) == -1, piece
    rep = m.overlap()
    assert rep["shared_tokens"] == m.num_shared and rep["draft_coverage"] == pytest.approx(m.num_shared / len(s))
    assert 0 < rep["target_coverage"] < 1 and rep["draft_scheme"] == "sentencepiece" and rep["target_scheme"] == "plain"


def test_fingerprints_follow_the_vocabulary(chars):
    assert tokenizer_fingerprint(byte_tokenizer()) == tokenizer_fingerprint(byte_tokenizer())
    assert tokenizer_fingerprint(byte_tokenizer()) != tokenizer_fingerprint(byte_tokenizer([("t", "h")]))
    fps = {tokenizer_fingerprint(t) for t in (byte_tokenizer(), spm_tokenizer(), chars)}
    assert len(fps) == 3 and all(len(f) == 64 for f in fps)


# --------------------------------------------------------------------------- files and the pair


@pytest.mark.parametrize("suffix", [".safetensors", ".json"])
def test_save_load_round_trip(tmp_path, suffix, chars):
    m = build_vocab_map(byte_tokenizer(), chars, "byte", "chars")
    m.draft_vocab = reduced_vocab_from_counts(torch.arange(len(chars)), 16)
    path = m.save(tmp_path / f"map{suffix}")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # atomic: no temporary file left behind
    got = VocabMap.load(path)
    assert torch.equal(got.draft_to_target, m.draft_to_target)
    assert torch.equal(got.draft_vocab.d2t, m.draft_vocab.d2t) and torch.equal(got.draft_vocab.t2d, m.draft_vocab.t2d)
    assert got.draft_vocab.t2d.dtype == torch.bool and got.draft_vocab.d2t.dtype == torch.int64
    assert (got.draft_fingerprint, got.target_fingerprint) == (m.draft_fingerprint, m.target_fingerprint)
    assert got.overlap() == m.overlap()


def test_unreadable_files_fail_in_one_line(tmp_path):
    with pytest.raises(DataError, match="no vocab map"):
        VocabMap.load(tmp_path / "missing.safetensors")
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    (tmp_path / "x.safetensors").write_bytes(b"not safetensors")
    for name in ("x.json", "x.safetensors"):
        with pytest.raises(DataError, match="not a specctl vocab map"):
            VocabMap.load(tmp_path / name)


def test_a_map_is_refused_for_another_pair(chars):
    b, s = byte_tokenizer(), spm_tokenizer()
    m = build_vocab_map(b, chars, "byte", "chars")
    m.check_tokenizers(b, chars)  # the pair it was built for
    cases = [((s, chars), "draft tokenizer differs"), ((b, s), "target tokenizer differs"),
             ((chars, b), "opposite direction")]
    for (d, t), msg in cases:
        with pytest.raises(DataError, match=msg) as e:
            m.check_tokenizers(d, t)
        text = str(e.value)
        assert "\n" not in text and "specctl build-vocab-map" in text and "byte -> target chars" in text


# --------------------------------------------------------------------------- EAGLE-3 reduced vocabulary


def test_reduced_vocab_by_hand():
    counts = torch.tensor([5, 0, 3, 3, 9, 0, 1])
    dv = reduced_vocab_from_counts(counts, 3)
    assert dv.target_ids.tolist() == [0, 2, 4]  # 9, 5, then the tie 3/3 goes to the lower id
    assert dv.d2t.tolist() == [0, 1, 2] and dv.d2t.dtype == torch.int64
    assert dv.t2d.tolist() == [True, False, True, False, True, False, False]
    assert dv.coverage == pytest.approx(17 / 21) and dv.num_tokens_counted == 21
    for i in range(3):  # EAGLE-3's convention: target = i + d2t[i]
        assert bool(dv.t2d[i + int(dv.d2t[i])])
    forced = reduced_vocab_from_counts(counts, 3, always=[5])
    assert forced.target_ids.tolist() == [0, 4, 5] and forced.d2t.tolist() == [0, 3, 3]
    filled = reduced_vocab_from_counts(torch.tensor([0, 0, 7, 0]), 3)  # fewer seen ids than asked
    assert filled.target_ids.tolist() == [0, 1, 2]
    for bad in (0, 8):
        with pytest.raises(DataError, match="draft vocabulary size"):
            reduced_vocab_from_counts(counts, bad)


def test_reduced_vocab_from_a_data_file(tmp_path, chars):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"id": "x", "prompt": "aaaa bbb cc d"}) for _ in range(3)) + "\n")
    dv = build_draft_vocab(chars, data, 8, always=[])
    top = {tid(chars, c) for c in "abcd "}
    assert top <= set(dv.target_ids.tolist()) and dv.coverage == 1.0 and dv.num_tokens_counted == 39
    assert dv.t2d.numel() == len(chars) and int(dv.t2d.sum()) == 8
    with_specials = build_draft_vocab(chars, [data.read_text()], 8)  # texts; the special ids are kept
    assert set(chars.all_special_ids) <= set(with_specials.target_ids.tolist())
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(DataError, match="bad.jsonl:1"):
        build_draft_vocab(chars, bad, 8)


def test_a_data_folder_skips_binary_and_hidden_files_and_reads_text_in_chunks(tmp_path, chars, monkeypatch):
    """A folder with a model's weights in it: those are skipped (heard of), not read as text (a 260 MB
    safetensors file read as text ran a user's machine out of memory); big text is read in chunks."""
    import specctl.drafts.draft_vocab as DV

    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 64)  # NUL bytes
    (tmp_path / "blob.bin").write_bytes(bytes([0xff, 0xfe, 0x80]) * 4000)  # no NUL, not UTF-8
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("zzzz zzzz zzzz\n")
    (tmp_path / "notes.txt").write_text("aaaa bbb\ncc d\n" * 3)
    skipped = []
    dv = build_draft_vocab(chars, tmp_path, 8, always=[], on_skip=lambda f, why: skipped.append(f.name))
    assert sorted(skipped) == ["blob.bin", "model.safetensors"]
    assert dv.num_tokens_counted == len(chars("aaaa bbb\ncc d\n" * 3, add_special_tokens=False)["input_ids"])
    with pytest.raises(DataError, match="not a text file"):  # named on its own: an error, not a skip
        build_draft_vocab(chars, tmp_path / "model.safetensors", 8)
    monkeypatch.setattr(DV, "TEXT_CHUNK", 8)  # chunks cut at line ends: the same counts
    pieces = list(DV.read_texts(tmp_path / "notes.txt"))
    assert len(pieces) > 1 and "".join(pieces) == "aaaa bbb\ncc d\n" * 3
    assert all(p.endswith("\n") for p in pieces)
