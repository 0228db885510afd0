"""The own Transformer against transformers' modelling code, and the runner's KV cache arithmetic.

Invariants: fp32 logits equal transformers' (llama, qwen2, mistral; tied and untied heads; llama3
and linear rope scaling); prefill in one go == chunked == token by token; rolling the cache back
and feeding different tokens gives the logits of a fresh forward of the resulting sequence.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specctl.errors import ModelError, UsageError
from specctl.modeling import load_transformer
from specctl.runtime.runner import TargetRunner

ATOL = 1e-5  # one prefill vs transformers' one forward: the same shapes, so fp32 agrees to 1e-5
# Different shapes (a [1, d] matmul vs a [T, d] one) round differently: transformers' own token-by-token
# logits differ from its one-go logits by ~1.5e-5 on these models (|logit| <= ~6). A real bug (a wrong
# position, a stale cache slot, a missing bias) moves logits by > 1e-2.
STEP_ATOL = 5e-5


def _hf_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(ids).logits  # [B, T, V]


def _ids(seed: int, B: int, T: int, vocab: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


@pytest.mark.parametrize(
    "arch,tied,overrides",
    [
        ("llama", False, {}),
        ("llama", True, {}),
        ("qwen2", False, {}),
        ("qwen2", True, {}),
        ("mistral", False, {}),
        ("llama", False, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 16}}),
        ("llama", False, {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    ],
    ids=["llama", "llama-tied", "qwen2", "qwen2-tied", "mistral", "llama-rope-llama3", "llama-rope-linear"],
)
def test_logits_match_transformers(tiny_model_factory, arch, tied, overrides):
    folder = tiny_model_factory(arch, tie_word_embeddings=tied, **overrides)
    ids = _ids(1, B=2, T=40)
    expected = _hf_logits(folder, ids)
    model = load_transformer(folder, torch.float32)
    assert model.args.arch == arch and model.args.tie_word_embeddings == tied
    assert (model.lm_head is None) == tied

    runner = TargetRunner(model, max_len=64, batch=2)
    got = runner.forward(ids)  # one prefill
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)

    runner.reset()  # token by token through the cache
    steps = torch.cat([runner.forward(ids[:, t:t + 1]) for t in range(ids.shape[1])], 1)
    torch.testing.assert_close(steps, expected, atol=STEP_ATOL, rtol=0)


def test_qwen2_biases_are_loaded(tiny_model_factory):
    """qwen2 has q/k/v biases (perturbed away from zero by the fixture); dropping them changes logits."""
    model = load_transformer(tiny_model_factory("qwen2"), torch.float32)
    assert model.layers[0].qkv.bias is not None and model.layers[0].qkv.bias.abs().sum() > 0
    ids = _ids(2, B=1, T=8)
    runner = TargetRunner(model, max_len=16)
    with_bias = runner.forward(ids)
    clone = load_transformer(tiny_model_factory("qwen2"), torch.float32)
    clone.layers[0].qkv.bias.zero_()
    without = TargetRunner(clone, max_len=16).forward(ids)
    assert (with_bias - without).abs().max() > 1e-3


def test_prefill_one_go_chunked_and_token_by_token_agree(make_runner):
    ids = _ids(3, B=1, T=48)
    runner = make_runner(max_len=64)
    full = runner.forward(ids)
    assert runner.length == 48

    runner.reset()
    chunks, t = [], 0
    for size in (1, 7, 3, 16, 2, 19):
        chunks.append(runner.forward(ids[:, t:t + size]))
        t += size
    assert t == 48 and runner.length == 48
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=STEP_ATOL, rtol=0)

    runner.reset()
    last = runner.forward(ids, logits="last")
    assert last.shape == (1, 1, 128)
    torch.testing.assert_close(last, full[:, -1:], atol=STEP_ATOL, rtol=0)


def test_rollback_then_different_tokens_equals_fresh_forward(make_runner):
    a = _ids(4, B=1, T=30)
    b = _ids(5, B=1, T=6)
    runner = make_runner(max_len=64)
    runner.forward(a[:, :20])
    runner.forward(a[:, 20:])  # 30 tokens in the cache
    runner.rollback(12)
    assert runner.length == 12
    got = runner.forward(b)  # overwrites slots 12..17; slots 18..29 still hold stale keys
    assert runner.length == 18

    fresh = make_runner(max_len=64).forward(torch.cat([a[:, :12], b], 1))
    torch.testing.assert_close(got, fresh[:, 12:], atol=STEP_ATOL, rtol=0)

    # and decoding one more token after the overwrite still ignores the stale slots beyond 18
    nxt = torch.tensor([[7]])
    fresh_next = make_runner(max_len=64).forward(torch.cat([a[:, :12], b, nxt], 1))[:, -1:]
    torch.testing.assert_close(runner.forward(nxt), fresh_next, atol=STEP_ATOL, rtol=0)


def test_rollback_is_repeatable_like_speculative_steps(make_runner):
    """Many [feed last+draft, keep a prefix] steps give the logits of the kept sequence."""
    g = torch.Generator().manual_seed(6)
    runner = make_runner(max_len=128)
    seq = _ids(7, B=1, T=10)
    runner.forward(seq)
    for _ in range(8):
        draft = torch.randint(0, 128, (1, 4), generator=g)
        runner.forward(draft)
        keep = int(torch.randint(0, 5, (1,), generator=g))
        runner.rollback(seq.shape[1] + keep)
        seq = torch.cat([seq, draft[:, :keep]], 1)
    probe = torch.tensor([[11, 12, 13]])
    got = runner.forward(probe)
    fresh = make_runner(max_len=128).forward(torch.cat([seq, probe], 1))[:, -3:]
    torch.testing.assert_close(got, fresh, atol=STEP_ATOL, rtol=0)


def test_batched_rows_equal_single_rows(make_runner):
    ids = _ids(8, B=3, T=12)
    batched = make_runner(max_len=32, batch=3).forward(ids)
    for b in range(3):
        single = make_runner(max_len=32).forward(ids[b:b + 1])
        torch.testing.assert_close(batched[b:b + 1], single, atol=STEP_ATOL, rtol=0)


def test_runner_bounds(make_runner):
    runner = make_runner(max_len=8)
    runner.forward(_ids(9, B=1, T=5))
    with pytest.raises(ValueError):
        runner.rollback(6)
    with pytest.raises(ValueError):
        runner.rollback(-1)
    with pytest.raises(UsageError):
        runner.forward(_ids(10, B=1, T=4))  # 5 + 4 > 8
    runner.rollback(0)
    assert runner.length == 0


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(ModelError, match="config.json"):
        load_transformer(tmp_path, torch.float32)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelError, match="gpt2"):
        load_transformer(tmp_path, torch.float32)


def test_a_damaged_safetensors_file_is_one_line_naming_it(tiny_model_dir, tmp_path):
    """A truncated model.safetensors: load_model (every command's loading) says what recommend says, through
    one shared reader (specctl.models.open_safetensors), not safetensors' own error."""
    import shutil

    from specctl.recommend.inspection import tensor_index
    from specctl.runtime.loading import load_model

    bad = shutil.copytree(tiny_model_dir, tmp_path / "corrupt")
    f = bad / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ModelError) as e:
        load_model(bad, dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"cannot read the safetensors header of {f} (") and "replace it" in msg
    with pytest.raises(ModelError) as r:
        tensor_index(bad)
    assert str(r.value) == msg


# --------------------------------------------------------------------------- config variants
# Biases on o_proj / MLP and mistral's sliding window change the logits: they must be honoured.


def test_llama_attention_bias_matches_transformers(tiny_model_factory):
    _assert_matches(tiny_model_factory("llama", attention_bias=True))


def test_llama_mlp_bias_matches_transformers(tiny_model_factory):
    _assert_matches(tiny_model_factory("llama", mlp_bias=True))


def test_mistral_sliding_window_matches_transformers(tiny_model_factory):
    _assert_matches(tiny_model_factory("mistral", sliding_window=8))


def _assert_matches(folder):
    ids = _ids(11, B=1, T=24)
    model = load_transformer(folder, torch.float32)
    ref = _hf_logits(folder, ids)
    torch.testing.assert_close(TargetRunner(model, max_len=32).forward(ids), ref, atol=STEP_ATOL, rtol=0)
    runner = TargetRunner(model, max_len=32)  # one token at a time: the decode path past the window
    steps = torch.cat([runner.forward(ids[:, i:i + 1]) for i in range(ids.shape[1])], 1)
    torch.testing.assert_close(steps, ref, atol=STEP_ATOL, rtol=0)


# --------------------------------------------------------------------------- load_model (the fixture folder end to end)


def test_load_model_end_to_end(tiny_model_dir, tiny_model):
    from specctl.runtime.loading import load_model

    lm = load_model(tiny_model_dir, dtype="float32")
    assert lm.dtype == torch.float32 and lm.device == torch.device("cpu") and lm.name == tiny_model_dir.name
    assert lm.stop_token_ids == (5,)  # <|im_end|>, from generation_config.json and the tokenizer
    tok = lm.tokenizer
    assert tok.decode(tok.encode("def f(x):\n\treturn x")) == "def f(x):\n\treturn x"
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    x = _ids(12, B=1, T=10)
    torch.testing.assert_close(TargetRunner(lm.model, 16).forward(x), TargetRunner(tiny_model, 16).forward(x))


def test_stop_token_ids_read_generation_config_lists(tmp_path):
    from types import SimpleNamespace

    from specctl.runtime.loading import stop_token_ids

    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 3]}')
    assert stop_token_ids(tmp_path, SimpleNamespace(eos_token_id=9)) == (3, 7, 9)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 4}')
    assert stop_token_ids(tmp_path, SimpleNamespace(eos_token_id=None)) == (4,)


def test_parse_dtype_and_device():
    from specctl.runtime.loading import parse_device, parse_dtype

    assert parse_dtype("fp32") == torch.float32 and parse_dtype("BF16") == torch.bfloat16
    with pytest.raises(UsageError):
        parse_dtype("float8")
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(UsageError):
        parse_device("tpu:0")


# --------------------------------------------------------------------------- generate_batch


def test_generate_batch_rows_of_different_lengths_equal_their_own_greedy_decoding(tiny_model, make_runner):
    """Left-padded rows with their own positions and key masks: each row decodes as it would alone."""
    from specctl.runtime.offline import generate_batch

    prompts = [_ids(s, 1, n)[0].tolist() for s, n in ((1, 5), (2, 17), (3, 1), (4, 9))]
    rooms = [12, 7, 12, 3]
    out = generate_batch(tiny_model, prompts, rooms, stop_token_ids=())
    for p, room, (ans, finish) in zip(prompts, rooms, out):
        r = make_runner()
        logits = r.forward(torch.tensor([p]), logits="last")
        want = []
        for _ in range(room):
            t = int(logits[0, -1].argmax())
            want.append(t)
            logits = r.forward(torch.tensor([[t]]), logits="last")
        assert ans == want and finish == "length"
    # a stop token ends its row only
    stop = out[1][0][2]
    again = generate_batch(tiny_model, prompts, rooms, stop_token_ids=(stop,))
    assert again[1] == (out[1][0][:out[1][0].index(stop) + 1], "stop")
    assert again[0][0][:len(out[0][0])] == out[0][0][:len(again[0][0])]


def test_generate_batch_sampling_is_seeded(tiny_model):
    from specctl.runtime.offline import generate_batch

    prompts = [[7, 8, 9], [10, 11, 12, 13, 14]]
    a = generate_batch(tiny_model, prompts, [10, 10], temperature=1.0, generator=torch.Generator().manual_seed(3))
    b = generate_batch(tiny_model, prompts, [10, 10], temperature=1.0, generator=torch.Generator().manual_seed(3))
    c = generate_batch(tiny_model, prompts, [10, 10], temperature=1.0, generator=torch.Generator().manual_seed(4))
    greedy = generate_batch(tiny_model, prompts, [10, 10])
    assert a == b and a != c and a != greedy


# --------------------------------------------------------------------------- compiled decode step


def test_compiled_decode_step_gives_the_uncompiled_greedy_tokens(tiny_model_factory):
    """TargetRunner(compile=True): one-token steps go through torch.compile(Transformer.decode_step)
    (static shapes over the whole cache); greedy output equals the uncompiled runner's, token for
    token, for plain decoding and for speculative decoding (ngram drafts verified uncompiled)."""
    from specctl.config import SpecConfig
    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.modeling import load_transformer
    from specctl.runtime.proposers import build_proposer
    from specctl.runtime.runner import TargetRunner

    model = load_transformer(tiny_model_factory("qwen2", tie_word_embeddings=True), torch.float32)
    plain = SpecDecoder(TargetRunner(model, 96))
    compiled_runner = TargetRunner(model, 96, compile=True)
    calls = []
    step = compiled_runner._step
    compiled_runner._step = lambda *a: calls.append(1) or step(*a)
    compiled = SpecDecoder(compiled_runner)
    ngram = SpecDecoder(compiled_runner, build_proposer(SpecConfig(method="ngram", num_speculative_tokens=3,
                                                                   prompt_lookup_min=1).validated(), 96), 3)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = (torch.randint(6, 128, (5,), generator=g).tolist() * 2)
        want = plain.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        assert compiled.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids == want
        assert ngram.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids == want
    assert len(calls) >= 3 * 23  # every plain step ran compiled
    r = TargetRunner(model, 96)  # aux hidden states (EAGLE-3's input) come out of the compiled step too
    r.run(torch.tensor([[7, 8, 9]]), aux_layers=(0, 1))
    want = r.run(torch.tensor([[10]]), aux_layers=(0, 1))
    compiled_runner.reset()
    compiled_runner.run(torch.tensor([[7, 8, 9]]), aux_layers=(0, 1))
    got = compiled_runner.run(torch.tensor([[10]]), aux_layers=(0, 1))
    assert got.aux is not None and torch.allclose(got.aux, want.aux, atol=1e-5)
    assert torch.allclose(got.hidden, want.hidden, atol=1e-5)


def _projections(model) -> list:
    return [layer for b in model.layers for layer in b.projections]


def test_dense_weights_move_into_one_arena_unchanged(tiny_model_factory):
    from specctl.modeling.load import weights_on_huge_pages

    model = load_transformer(tiny_model_factory("qwen2", tie_word_embeddings=False), torch.bfloat16, kernels="torch")
    layers = _projections(model) + [model.lm_head]
    before = [layer.weight.detach().clone() for layer in layers]
    weights_on_huge_pages(model)
    after = [layer.weight for layer in layers]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    # one storage for them all (not a mapping each), and no two weights overlap in it
    assert len({w.untyped_storage().data_ptr() for w in after}) == 1
    spans = sorted((w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()) for w in after)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def test_amx_packed_weights_share_one_arena(tiny_model_factory):
    from specctl.kernels import amx_linear
    from specctl.modeling.transformer import pack_for_amx

    if amx_linear.load() is None:
        pytest.skip("needs AMX (the packed layout is only built where it runs)")
    model = load_transformer(tiny_model_factory("llama", tie_word_embeddings=True), torch.bfloat16, kernels="torch")
    layers = _projections(model)
    before = [layer.weight.detach().clone() for layer in layers]
    pack_for_amx(model, amx_linear.load())
    layers = _projections(model)  # now AmxLinear modules
    packed = [layer.weight for layer in layers] + [model.head_packed]
    assert all(torch.equal(amx_linear.unpack(p), w) for p, w in zip(packed, before))
    assert torch.equal(amx_linear.unpack(model.head_packed), model.head_weight)
    assert len({p.untyped_storage().data_ptr() for p in packed}) == 1


def test_a_prompt_from_the_start_attends_causally_with_the_same_bits(tiny_model_factory, monkeypatch):
    """A prompt at position 0 takes SDPA's own causal form (blocks above the diagonal skipped) instead of
    its mask: the block's output and the cache are the same bits as through the mask, in bf16 and fp32."""
    from specctl.modeling import KVCache, SDPA_ROWS

    folder = tiny_model_factory("qwen2", initializer_range=0.05, hidden_size=128, intermediate_size=256)
    for dtype in (torch.bfloat16, torch.float32):
        model = load_transformer(folder, dtype, kernels="torch")
        blk, a, T = model.layers[0], model.args, SDPA_ROWS + 37
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, a.num_heads, T, a.head_dim, generator=g).to(dtype)
        k = torch.randn(1, a.num_kv_heads, T, a.head_dim, generator=g).to(dtype)
        v = torch.randn(1, a.num_kv_heads, T, a.head_dim, generator=g).to(dtype)
        mask = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
        c = KVCache(a, 1, T, dtype, "cpu")
        sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                            lambda *x, **kw: calls.append(kw.get("is_causal")) or sdpa(*x, **kw))
        got = blk._attend(q, k, v, c.k[0], c.v[0], 0, mask, False, None)
        monkeypatch.undo()
        assert calls == [True]  # the causal form, not the mask
        ref = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
        assert torch.equal(got, ref.transpose(1, 2).reshape(1, T, -1)), dtype
