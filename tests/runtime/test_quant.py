"""GGUF models run quantized (specctl.runtime.quant) on tiny models written as GGUF files in-process.

A tiny transformers model (conftest) is quantized here (Q8_0 by gguf-py; Q4_K by ``quantize_q4_k``
below, which gguf-py lacks) and written with gguf.GGUFWriter as llama.cpp would (llama: Q and K rows
permuted). Invariants: the loaded model's logits equal those of the dense model built from the same
blocks dequantized (gguf-py) in HF order, up to fp32 summation order (so the config, the Q/K order,
the biases and the heads are read right); every projection stays quantized; greedy speculation
(ngram, draft_model with a quantized draft) equals plain greedy decoding of the quantized model
token for token, in fp32 and in bf16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specctl.config import SpecConfig
from specctl.errors import ModelError
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.modeling import ModelArgs, Transformer, fuse_hf_state_dict, read_config, rope_inv_freq
from specctl.runtime.proposers import build_proposer
from specctl.runtime.proposers.draft_model import DraftModelProposer
from specctl.runtime.quant import QuantLinear, load_gguf_transformer
from specctl.runtime.runner import LoadedModel, TargetRunner

gguf = pytest.importorskip("gguf")
from kernels import quant_linear as ql  # noqa: E402

if ql.best_path(torch.float32) is None:
    pytest.skip("the quant_linear kernel did not build here (no C++ compiler?)", allow_module_level=True)

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
MAX_LEN, NEW = 160, 32
GT = gguf.GGMLQuantizationType


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[N, K] fp32 -> [N, K / 256 * 144] Q4_K blocks (ggml's layout; min/max per 32, 6-bit scales)."""
    N, K = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-block, 32]
    lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 1e-12)
    scale, mins = (hi - lo) / 15, -lo  # [blocks, 8]
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (np.maximum(mins.max(-1), 1e-12) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / np.maximum(d.astype(np.float32), 1e-12)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dmin.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    s_eff, m_eff = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((x + m_eff[..., None]) / np.maximum(s_eff, 1e-12)[..., None]), 0, 15).astype(np.uint8)
    scales = np.zeros((x.shape[0], 12), np.uint8)  # the inverse of ggml's get_scale_min_k4
    for j in range(4):
        scales[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = m[:, j] | ((m[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-block 2c low nibbles, 2c+1 high
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], 1)
    return out.reshape(N, -1)


def quantize(w: torch.Tensor, qtype: str) -> np.ndarray:
    a = w.float().numpy()
    return quantize_q4_k(a) if qtype == "Q4_K" else gguf.quants.quantize(a, GT[qtype])


def permute(t: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert's Q/K row permutation (HF order -> GGUF order)."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


# HF projection -> (GGUF name, type): Q4_K where in_features allow (all here), Q8_0 for v/o and the head
TYPES = {"q_proj": ("attn_q", "Q4_K"), "k_proj": ("attn_k", "Q4_K"), "v_proj": ("attn_v", "Q8_0"),
         "o_proj": ("attn_output", "Q8_0"), "gate_proj": ("ffn_gate", "Q4_K"), "up_proj": ("ffn_up", "Q4_K"),
         "down_proj": ("ffn_down", "Q4_K")}


def write_gguf(folder, path) -> dict[str, torch.Tensor]:
    """The HF model in ``folder`` as a quantized GGUF at ``path``; returns the HF-order state dict of
    the weights the GGUF holds (quantized ones dequantized by gguf-py): the reference model's."""
    from safetensors.torch import load_file

    cfg = read_config(folder)
    arch, L = cfg["model_type"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    sd = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    ref: dict[str, torch.Tensor] = {}

    def put(gname: str, hname: str, qtype: str | None, n_head: int | None = None):
        t = sd[hname].float()
        if qtype is None:  # norms, biases: F32
            ref[hname] = t
            arr = t.numpy()
            if n_head is not None:
                arr = permute(arr, n_head)
            w.add_tensor(gname, np.ascontiguousarray(arr))
            return
        blocks = quantize(t, qtype)  # rows quantized in HF order, then moved as whole rows
        ref[hname] = torch.from_numpy(gguf.quants.dequantize(blocks, GT[qtype]))
        if n_head is not None:
            blocks = permute(blocks, n_head)
        w.add_tensor(gname, np.ascontiguousarray(blocks), raw_dtype=GT[qtype])

    put("token_embd.weight", "model.embed_tokens.weight", "Q8_0")
    put("output_norm.weight", "model.norm.weight", None)
    if not cfg.get("tie_word_embeddings"):
        put("output.weight", "lm_head.weight", "Q8_0")
    for i in range(L):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        for hn, (gn, qtype) in TYPES.items():
            part = "self_attn." if hn[0] in "qkvo" else "mlp."
            heads = {"q_proj": nh, "k_proj": nkv}.get(hn) if arch == "llama" else None
            put(p + gn + ".weight", h + part + hn + ".weight", qtype, heads)
            if h + part + hn + ".bias" in sd:
                put(p + gn + ".bias", h + part + hn + ".bias", None, heads)
        put(p + "attn_norm.weight", h + "input_layernorm.weight", None)
        put(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def reference_model(folder, ref: dict[str, torch.Tensor]) -> Transformer:
    """The dense fp32 Transformer over the GGUF's weights dequantized (HF order)."""
    args = ModelArgs.from_hf_config(read_config(folder))
    model = Transformer(args)
    model.load_state_dict(fuse_hf_state_dict(ref, args))
    model.inv_freq = rope_inv_freq(args)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def ggufs(tiny_model_factory, tmp_path_factory):
    """{name: (HF folder, GGUF path, reference state)}: llama (tied, loopy: its greedy output repeats
    itself, so drafts get accepted), qwen2 (q/k/v biases, untied head), and a second llama (another
    seed, as a draft)."""
    out = {}
    root = tmp_path_factory.mktemp("gguf")
    for name, kw in (("llama", dict(tie_word_embeddings=True, seed=1, initializer_range=0.05)),
                     ("qwen2", dict(arch="qwen2", seed=2)),
                     ("draft", dict(tie_word_embeddings=True, seed=1, initializer_range=0.05))):
        folder = tiny_model_factory(**kw, **SHAPE)
        if name == "draft":  # the llama with its weights perturbed: agrees with the target often, not always
            from safetensors.torch import load_file, save_file

            sd = load_file(str(folder / "model.safetensors"))
            g = torch.Generator().manual_seed(9)
            sd = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=g) for k, v in sd.items()}
            folder = tmp_path_factory.mktemp("draft-hf")
            save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
            import shutil

            src = tiny_model_factory(**kw, **SHAPE)
            for f in src.iterdir():
                if f.name != "model.safetensors":
                    shutil.copy(f, folder / f.name)
        path = root / f"{name}.gguf"
        out[name] = (folder, path, write_gguf(folder, path))
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_logits_equal_the_dequantized_models(ggufs, name):
    folder, path, ref = ggufs[name]
    model, dense = load_gguf_transformer(path, torch.float32), reference_model(folder, ref)
    assert isinstance(model.layers[0].qkv, QuantLinear) and model.layers[0].qkv.types == ["Q4_K", "Q4_K", "Q8_0"]
    assert all(isinstance(getattr(b, n), QuantLinear) for b in model.layers for n in ("qkv", "o", "gate_up", "down"))
    assert model.quant_head is not None and model.quant_head.types == ["Q8_0"]
    assert (model.lm_head is None) == (name == "llama")  # tied: the head reads token_embd's blocks
    tokens = torch.tensor([[3, 70, 71, 72, 9, 40, 41, 100, 7, 12, 13, 90]])
    from specctl.modeling import KVCache

    got, _ = model(tokens, 0, KVCache(model.args, 1, 32, torch.float32, "cpu"), None)
    want, _ = dense(tokens, 0, KVCache(dense.args, 1, 32, torch.float32, "cpu"), None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def loaded(path, dtype, tok) -> LoadedModel:
    return LoadedModel(path, load_gguf_transformer(path, dtype), tok, (5,), dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_speculation_equals_plain(ggufs, tiny_model_dir, repetitive_prompts, dtype):
    """ngram and draft_model (a quantized draft) accept drafts, and emit exactly plain greedy's tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    target, draft = loaded(ggufs["llama"][1], dtype, tok), loaded(ggufs["draft"][1], dtype, tok)
    plain = SpecDecoder(TargetRunner(target.model, MAX_LEN))
    ngram_cfg = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                      "prompt_lookup_max": 3})
    dm_cfg = SpecConfig.from_dict({"method": "draft_model", "model": "unused", "num_speculative_tokens": 4})
    decoders = {
        "ngram": SpecDecoder(TargetRunner(target.model, MAX_LEN), build_proposer(ngram_cfg, MAX_LEN), 4),
        "draft_model": SpecDecoder(TargetRunner(target.model, MAX_LEN),
                                   DraftModelProposer(dm_cfg, target=target, max_model_len=MAX_LEN, draft=draft), 4),
    }
    accepted = {name: 0 for name in decoders}
    for prompt in repetitive_prompts(12, seed=3):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=NEW)).token_ids
        for name, dec in decoders.items():
            res = dec.generate(prompt, SamplingParams(max_new_tokens=NEW))
            assert res.token_ids == want, (name, prompt)
            accepted[name] += res.stats.num_accepted_tokens
    assert all(n > 20 for n in accepted.values()), accepted  # the drafts were really verified, not skipped


def test_refuses_what_the_kernels_do_not_run(ggufs, tmp_path):
    folder, _, _ = ggufs["llama"]
    from safetensors.torch import load_file

    sd = load_file(str(folder / "model.safetensors"))
    w = gguf.GGUFWriter(str(tmp_path / "q5_1.gguf"), "llama")
    w.add_block_count(1)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(4)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(sd["model.embed_tokens.weight"].numpy(), GT.Q5_1),
                 raw_dtype=GT.Q5_1)
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    with pytest.raises(ModelError, match="Q5_1"):
        load_gguf_transformer(tmp_path / "q5_1.gguf", torch.float32)
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma3")
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    with pytest.raises(ModelError, match="gemma3"):
        load_gguf_transformer(tmp_path / "gemma.gguf", torch.float32)
