"""GGUF models run quantized (specctl.runtime.quant) on tiny models written as GGUF files in-process.

A tiny transformers model (conftest) is quantized (Q8_0 by gguf-py; Q4_K by conftest's
``quantize_q4_k``, which gguf-py lacks) and written with gguf.GGUFWriter as llama.cpp would (llama: Q
and K rows permuted; conftest's ``write_quant_gguf``). Invariants: the loaded model's logits equal those of the dense model built from the same
blocks dequantized (gguf-py) in HF order, up to fp32 summation order (so the config, the Q/K order,
the biases and the heads are read right); every projection stays quantized; greedy speculation
(ngram, draft_model with a quantized draft) equals plain greedy decoding of the quantized model
token for token, in fp32 and in bf16.
"""

from __future__ import annotations

import pytest
import torch

from specctl.config import SpecConfig
from specctl.errors import ModelError
from specctl.modeling import ModelArgs, Transformer, fuse_hf_state_dict, read_config, rope_inv_freq
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.proposers import build_proposer
from specctl.runtime.proposers.draft_model import DraftModelProposer
from specctl.runtime.quant import QuantLinear, load_gguf_transformer
from specctl.runtime.loading import LoadedModel
from specctl.runtime.runner import TargetRunner
from tests.conftest import TINY_QUANT_SHAPE, write_quant_gguf

gguf = pytest.importorskip("gguf")
from specctl.kernels import quant_linear as ql

if ql.best_path(torch.float32) is None:
    pytest.skip("the quant_linear kernel did not build here (no C++ compiler?)", allow_module_level=True)

SHAPE = TINY_QUANT_SHAPE
MAX_LEN, NEW = 160, 32
GT = gguf.GGMLQuantizationType


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
        out[name] = (folder, path, write_quant_gguf(folder, path))
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

    got, _, _ = model(tokens, 0, KVCache(model.args, 1, 32, torch.float32, "cpu"), None)
    want, _, _ = dense(tokens, 0, KVCache(dense.args, 1, 32, torch.float32, "cpu"), None)
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


def test_load_model_runs_a_gguf_file_quantized(tiny_quant_gguf, tiny_model_dir):
    """runner.load_model on a .gguf: every projection a QuantLinear, the tokenizer and stop tokens from the file."""
    from transformers import AutoTokenizer

    from specctl.runtime.loading import load_model

    lm = load_model(tiny_quant_gguf, "float32")
    assert lm.path == tiny_quant_gguf and lm.model.quantization == "gguf"
    assert all(isinstance(getattr(b, n), QuantLinear) for b in lm.model.layers for n in ("qkv", "o", "gate_up", "down"))
    assert 5 in lm.stop_token_ids  # <|im_end|>, the tiny tokenizer's eos
    bf16 = load_model(tiny_quant_gguf, "bfloat16").model  # the exact-bf16 set-up leaves the blocks quantized:
    from specctl.kernels import decode_layer

    # fused only by the block's quantized build (where the CPU has VNNI), and no dense copy made to check
    assert all(b.fused == decode_layer.fits_quant(b) for b in bf16.layers)
    assert all(getattr(b, n)._dense is None for b in bf16.layers for n in ("qkv", "o", "gate_up", "down"))
    tiny = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert lm.tokenizer("ab c\n").input_ids == tiny("ab c\n").input_ids  # the same ids as the HF tokenizer


def test_draft_model_runs_a_quantized_draft_from_the_config_key(ggufs, repetitive_prompts):
    """{"method": "draft_model", "model": DRAFT.gguf, "quantization": "gguf"}: the proposer loads the draft as
    stored (no dense conversion), and speculation equals plain greedy decoding of the quantized target."""
    from specctl.errors import ConfigError
    from specctl.runtime.loading import load_model

    target = load_model(ggufs["llama"][1], "float32")
    cfg = SpecConfig.from_dict({"method": "draft_model", "model": str(ggufs["draft"][1]), "quantization": "gguf",
                                "num_speculative_tokens": 4})
    proposer = build_proposer(cfg, MAX_LEN, target=target)
    assert proposer.draft.path == ggufs["draft"][1] and proposer.mode == "same"
    assert all(isinstance(getattr(b, n), QuantLinear) for b in proposer.draft.model.layers for n in ("qkv", "down"))
    plain, spec = SpecDecoder(TargetRunner(target.model, MAX_LEN)), SpecDecoder(TargetRunner(target.model, MAX_LEN),
                                                                                proposer, 4)
    accepted = 0
    for prompt in repetitive_prompts(6, seed=4):
        want = plain.generate(prompt, SamplingParams(max_new_tokens=NEW)).token_ids
        res = spec.generate(prompt, SamplingParams(max_new_tokens=NEW))
        assert res.token_ids == want, prompt
        accepted += res.stats.num_accepted_tokens
    assert accepted > 10
    fp8 = SpecConfig.from_dict({"method": "draft_model", "model": str(ggufs["draft"][1]), "quantization": "fp8"})
    with pytest.raises(ConfigError, match="'fp8' is vLLM's"):
        build_proposer(fp8, MAX_LEN, target=target)


def test_quant_linear_packs_once_on_the_amx_path():
    """On an AMX-INT8 CPU a QuantLinear keeps its weights as panels (packed at construction), gives the GGUF
    rows back (``parts``), computes what ``ql.linear`` computes on that path, and takes the unpacked int8
    path where a part's rows are not a multiple of 16."""
    if ql.load("amx_int8") is None:
        pytest.skip("needs AMX-INT8 (amx_tile, amx_int8) and a C++ compiler")
    from tests.kernels.test_quant_linear import random_blocks

    K = 512
    parts = [(random_blocks("Q4_K", 32, K, seed=1), "Q4_K"), (random_blocks("Q6_K", 16, K, seed=2), "Q6_K")]
    lin = QuantLinear(parts, K, torch.randn(48), path="amx_int8")
    assert lin.packed and lin.kernel_parts[1] == [12 + ql.PACKED, 14 + ql.PACKED]
    assert all(torch.equal(a, b) for a, (b, _) in zip(lin.parts, parts))
    x = torch.randn(3, K).bfloat16()
    assert torch.equal(lin(x), ql.linear(x, parts, K, lin.bias, path="amx_int8"))
    odd = QuantLinear([(random_blocks("Q8_0", 24, K, seed=3), "Q8_0")], K, path="amx_int8")
    assert not odd.packed and odd.path == ql.best_path(torch.bfloat16, packed=False)



def test_parts_share_one_arena_sized_to_their_data(ggufs):
    """A loaded model's quantized parts live in one buffer (specctl.kernels.amx_linear.Arena) whose bytes are
    within a few % of the parts' own: a huge-page mapping per part once cost a spare 2 MiB page each
    (SmolLM2-135M's 211 parts: 117 MiB of data in 539 MiB of storage)."""
    for dtype in (torch.bfloat16, torch.float32):
        model = load_gguf_transformer(ggufs["qwen2"][1], dtype)
        parts = [b for m in model.modules() if isinstance(m, QuantLinear) for b in m.kernel_parts[0]]
        data = sum(b.numel() * b.element_size() for b in parts)
        storages = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in parts}
        assert data <= sum(storages.values()) <= 1.05 * data + 64 * len(parts)
        assert len(parts) > 8 and len(storages) == 1
        assert all(b.data_ptr() % 64 == 0 for b in parts)


def test_refuses_dense_projections(ggufs, tmp_path, monkeypatch):
    """An F32/F16 projection would run dense while bench says "runs quantized": README promises a refusal."""
    import tests.conftest as conftest

    folder, _, _ = ggufs["llama"]
    monkeypatch.setitem(conftest.QUANT_TYPES, "down_proj", ("ffn_down", None))
    write_quant_gguf(folder, tmp_path / "f32.gguf")
    with pytest.raises(ModelError, match="blk.0.ffn_down is stored F32, not quantized") as e:
        load_gguf_transformer(tmp_path / "f32.gguf", torch.bfloat16)
    assert "without --quantization gguf" in e.value.fix


def test_an_architecture_the_runtime_cannot_run_is_not_sent_to_the_dense_path(tmp_path):
    """gemma3 runs neither quantized nor dequantized: the refusal must not suggest loading it dequantized."""
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), "gemma3")
    for f in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        f()
    with pytest.raises(ModelError, match="'gemma3' cannot run quantized in the own runtime yet \\(nor dequantized\\)") as e:
        load_gguf_transformer(tmp_path / "gemma.gguf", torch.float32)
    assert "dequantized" not in e.value.fix


def test_the_roofline_reads_a_quantized_model_at_its_blocks(ggufs):
    """Shapes.of a GGUF model: the weights a step reads are its blocks (Q4_K/Q8_0: well under bf16's 2 bytes a
    weight), while its KV cache stays at the model's dtype (the roofline's bandwidth and KV share use both)."""
    from specctl.roofline import Shapes

    model = load_gguf_transformer(ggufs["qwen2"][1], torch.bfloat16)
    s = Shapes.of(model)
    blocks = sum(m.nbytes for m in model.modules() if isinstance(m, QuantLinear))
    assert s.weight_bytes == pytest.approx(blocks)
    assert 0.5 < s.bytes_per_param < 1.2 and s.kv_bytes == 2
    assert s.kv_bytes_per_position == s.layers * 2 * s.kv_heads * s.head_dim * 2
