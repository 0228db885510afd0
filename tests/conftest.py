"""Shared fixtures: tiny HF models and a tiny tokenizer, built in-process (no network, no downloads).

Fixtures (all offline, seeded, CPU, fp32):

``tiny_model_factory`` (session)
    ``make(arch="llama", tie_word_embeddings=False, seed=0, **config_overrides) -> Path``: builds a
    2-layer transformers model (LlamaConfig / Qwen2Config / MistralConfig; vocab 128, hidden 64,
    4 heads, 2 kv heads), perturbs the weights that transformers initialises to constants (norm
    weights, q/k/v biases) so that loading them wrongly is visible, and ``save_pretrained``s it,
    together with the tiny tokenizer, into a fresh folder. Same arguments -> the same folder.

``tiny_model_dir`` (session)
    The default folder (llama, untied, seed 0): config.json, model.safetensors,
    generation_config.json (eos = ``<|im_end|>``), tokenizer.json, tokenizer_config.json and
    chat_template.jinja (a ChatML-style template; ``tokenizer.chat_template`` is set). ``specctl.runtime.loading.load_model(tiny_model_dir,
    dtype="float32")`` works end to end on it, so command tests (bench, ...) can use it as a model.

``tiny_model`` (session)
    ``load_transformer(tiny_model_dir, torch.float32)``: the own Transformer (read-only; share it).

``repetitive_prompts`` (session)
    ``make_repetitive_prompts(n, seed)``: prompts that repeat themselves, so copying drafts get accepted.

``trained_eagle`` (session)
    EAGLE-3 and EAGLE-1 drafts of ``tiny_model_dir`` overfit on its own greedy answers to 24 word prompts
    (``word_prompts(24, 0)``): ``{3: summary, 1: summary, "prompts": the first 20 prompts}``, each summary
    ``train``'s (its ``export`` loads as a draft).

``trained_medusa`` (session)
    ``(loaded, cases, heads_dir)``: a loopy tiny llama (seed 1), 20+ cases (prompt ids, its plain greedy output
    of ``MEDUSA_NEW`` tokens, no near-tie on the way) and 3 Medusa heads overfit on them.

``bf16_path`` (function, parametrized)
    Runs a test once per CPU bf16 path, as the CPU that selects it would: ``"amx"``, ``"avx512_bf16"``
    (AMX hidden), ``"avx512"`` (AMX and AVX512-BF16 hidden: AVX-512 alone, as on an Intel Ice Lake),
    ``"avx2"`` (AVX-512 hidden too: an AMD Zen 3) and ``"torch"`` (AVX2 hidden too: no kernel path), each
    skipped with the missing feature named where this CPU cannot run it. Load models inside the test.

``tiny_quant_gguf`` (session)
    A tiny llama (``TINY_QUANT_SHAPE``: hidden 256, so the Q4_K/Q8_0 blocks fit) written as a
    quantized GGUF with its tokenizer, by ``write_quant_gguf(folder, path)`` (projections Q4_K and
    Q8_0, the embedding and head Q8_0, llama's Q/K rows permuted as llama.cpp's convert script does;
    the tiny tokenizer as ``tokenizer.ggml.*``): ``load_gguf_model`` and ``specctl bench --model
    tiny.gguf --quantization gguf`` run it. Needs ``gguf`` (skipped without it).

``make_runner`` / ``target_runner`` (function)
    ``make_runner(max_len=256, batch=1, model=None)`` -> a fresh ``TargetRunner`` over ``tiny_model``
    (or the given model); ``target_runner`` is ``make_runner()``.

Import note: pytest runs with ``--import-mode=importlib`` (pyproject.toml), so ``tests/kernels/`` is never
mistaken for the repository's ``kernels`` package.

torch runs single-threaded in the test session (``torch.set_num_threads(1)``, see below).

The tokenizer is character level: every printable ASCII character, ``\\n`` and ``\\t`` is one token,
anything else is ``<unk>``; ids 0-5 are special tokens (see ``TINY_SPECIAL_TOKENS``) and the
vocabulary is padded to exactly ``TINY_VOCAB_SIZE`` = 128 (the model's vocab size), so every id the
model can emit decodes. The weights are initialised with ``initializer_range=0.2`` (instead of
0.02) so that the logits are well separated and fp32 near-ties between the top two tokens are rare.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

_TESTS = Path(__file__).resolve().parent

# The tiny models here are faster on one thread (a 64-wide matmul gains nothing from two), and one
# thread keeps the suite fast when other processes share the (two) cores: with torch's default of
# one thread per core, a busy neighbour makes every forward wait on the slowest thread (~40x slower).
torch.set_num_threads(1)

_prebuild: subprocess.Popen | None = None


def pytest_sessionstart(session):
    """Under pytest -n (pyproject's default), the controller compiles the C++ kernels in the background
    (specctl.kernels.prebuild, two builds at a time) while the workers start on the tests: a worker that needs a
    kernel not built yet waits on torch's build lock for that build, instead of each worker compiling them
    one after another as it meets them."""
    global _prebuild
    cfg = session.config
    if hasattr(cfg, "workerinput") or not cfg.getoption("numprocesses", None):
        return
    _prebuild = subprocess.Popen([sys.executable, "-m", "specctl.kernels.prebuild", "--jobs", "2"], cwd=_TESTS.parent,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_sessionfinish(session):
    # not killed: a build killed midway leaves torch's lock behind, which stalls the next run's load
    if _prebuild is not None:
        _prebuild.wait()


TINY_VOCAB_SIZE = 128
TINY_SPECIAL_TOKENS = ("<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
TINY_PAD_ID, TINY_UNK_ID, TINY_BOS_ID, TINY_EOS_ID = 0, 1, 2, 5  # eos is <|im_end|>
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vocab() -> dict[str, int]:
    """token -> id: the special tokens, \\n, \\t, printable ASCII, then <extra_i> up to 128 entries."""
    tokens = list(TINY_SPECIAL_TOKENS) + ["\n", "\t"] + [chr(c) for c in range(32, 127)]
    tokens += [f"<extra_{i}>" for i in range(TINY_VOCAB_SIZE - len(tokens))]
    assert len(tokens) == TINY_VOCAB_SIZE
    return {t: i for i, t in enumerate(tokens)}


def build_tiny_tokenizer():
    """A character-level PreTrainedTokenizerFast with eos <|im_end|> and a ChatML chat_template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(vocab=tiny_vocab(), merges=[], unk_token="<unk>"))
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def make_repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts for drafts that copy: a random prefix of 4-9 ids (6..127) repeated 3 times, one id changed
    in each repeat (benchmarks/cuda_check.py too; tests take it as the ``repetitive_prompts`` fixture)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(n):
        base = rng.integers(6, 128, int(rng.integers(4, 10))).tolist()
        prompt = list(base)
        for _ in range(2):
            rep = list(base)
            rep[int(rng.integers(len(rep)))] = int(rng.integers(6, 128))
            prompt += rep
        prompts.append(prompt)
    return prompts


WORDS = ["def", "return", "print", "hello", "world", "x", "y", "=", "(", ")", "for", "in", "if", "else"]


def word_prompts(n: int, seed: int) -> list[str]:
    """n prompts of 3 to 8 code-like words, seeded."""
    import random

    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(3, 8))) for _ in range(n)]


@pytest.fixture(scope="session")
def trained_eagle(tiny_model_dir, tmp_path_factory):
    """EAGLE-3 and EAGLE-1 drafts overfit on the tiny model's own greedy answers to 24 prompts."""
    from specctl.runtime.loading import load_model
    from specctl.training.eagle import EagleTrainConfig, train

    folder = tmp_path_factory.mktemp("eagle-train")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in word_prompts(24, 0)) + "\n")
    loaded = load_model(tiny_model_dir, dtype="float32")
    out = {}
    for version, steps in ((3, 60), (1, 40)):
        cfg = EagleTrainConfig(model=str(tiny_model_dir), output=str(folder / f"run{version}"), self_distill=str(prompts),
                               version=version, steps=steps, batch_size=8, seq_len=64, max_new_tokens=32, eval_split=0.1,
                               lr=3e-3, eval_every=1000, draft_vocab_size=96 if version == 3 else None)
        out[version] = train(cfg, loaded=loaded, log=lambda m: None)
    out["prompts"] = word_prompts(24, 0)[:20]
    return out


MEDUSA_NEW = 40
NEAR_TIE = 1e-4  # prompts whose greedy path has a top-2 gap below this are skipped (fp32 rounding)


def min_gap(model, prompt, out) -> float:
    """The smallest top-1 minus top-2 logit gap along ``out``'s greedy path after ``prompt``."""
    from specctl.runtime.runner import TargetRunner

    logits = TargetRunner(model, len(prompt) + len(out)).forward(torch.tensor([prompt + out]))
    top = logits[0, len(prompt) - 1:-1].topk(2, -1).values
    return float((top[:, 0] - top[:, 1]).min())


def loopy_answers(lm, n: int, longest: int, new: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """n random prompts of 4 to ``longest`` - 1 ids and the model's plain greedy answers of ``new`` tokens (a
    loopy tiny llama's fall into loops that heads can learn)."""
    import numpy as np

    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.runner import TargetRunner

    rng = np.random.default_rng(seed)
    plain = SpecDecoder(TargetRunner(lm.model, 128))
    out = []
    for _ in range(n):
        p = rng.integers(6, 128, int(rng.integers(4, longest))).tolist()
        out.append((p, plain.generate(p, SamplingParams(max_new_tokens=new)).token_ids))
    return out


@pytest.fixture(scope="session")
def trained_medusa(tiny_model_factory, tmp_path_factory):
    """A loopy tiny llama, 24 prompts with its plain greedy outputs, and heads overfit on them."""
    from specctl.runtime.loading import load_model
    from specctl.training import data as D
    from specctl.training.medusa import MedusaTrainConfig, train

    path = tiny_model_factory(seed=1, initializer_range=0.05)
    lm = load_model(path, dtype="float32")
    cases = [(p, out) for p, out in loopy_answers(lm, 28, 12, MEDUSA_NEW) if min_gap(lm.model, p, out) > NEAR_TIE]
    assert len(cases) >= 20
    out_dir = tmp_path_factory.mktemp("medusa-heads")
    examples = [D.Example(p + o, [0] * len(p) + [1] * len(o)) for p, o in cases]
    orig = D.build_examples, D.read_records
    D.build_examples, D.read_records = (lambda *a, **k: examples), (lambda path: [])
    try:
        train(MedusaTrainConfig(model=str(path), output=str(out_dir), data=["(in memory)"], num_heads=3, steps=200,
                                lr=1e-2, batch_size=8, seq_len=128, dtype="float32", eval_split=0.0))
    finally:
        D.build_examples, D.read_records = orig
    return lm, cases, out_dir


def tiny_hf_config(arch: str = "llama", tie_word_embeddings: bool = False, **overrides):
    """A 2-layer transformers config of the given family (llama, qwen2, mistral)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    kwargs = dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, initializer_range=0.2, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=TINY_BOS_ID, eos_token_id=TINY_EOS_ID, pad_token_id=TINY_PAD_ID,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def build_tiny_hf_model(arch: str = "llama", tie_word_embeddings: bool = False, seed: int = 0, **overrides):
    """The transformers model (fp32, eval), seeded; constant-initialised weights are perturbed."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, tie_word_embeddings, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="session")
def repetitive_prompts():
    """``make_repetitive_prompts(n, seed)``: prompts whose continuation an n-gram/suffix draft can copy."""
    return make_repetitive_prompts


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """make(arch="llama", tie_word_embeddings=False, seed=0, **overrides) -> folder (cached)."""
    built: dict[str, Path] = {}

    def make(arch: str = "llama", tie_word_embeddings: bool = False, seed: int = 0, **overrides) -> Path:
        key = json.dumps([arch, tie_word_embeddings, seed, overrides], sort_keys=True, default=str)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{arch}-{'tied' if tie_word_embeddings else 'untied'}-s{seed}")
            model = build_tiny_hf_model(arch, tie_word_embeddings, seed, **overrides)
            model.save_pretrained(folder)
            build_tiny_tokenizer().save_pretrained(folder)
            built[key] = folder
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory) -> Path:
    """The default tiny model folder (llama, untied, seed 0), loadable by ``load_model(dir, "float32")``."""
    return tiny_model_factory()


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """The own Transformer over ``tiny_model_dir`` in fp32 (read-only, shared by the session)."""
    from specctl.modeling import load_transformer

    return load_transformer(tiny_model_dir, torch.float32)


@pytest.fixture
def make_runner(tiny_model):
    """make_runner(max_len=256, batch=1, model=None) -> a fresh TargetRunner (default: tiny_model)."""
    from specctl.runtime.runner import TargetRunner

    def make(max_len: int = 256, batch: int = 1, model=None) -> TargetRunner:
        return TargetRunner(tiny_model if model is None else model, max_len=max_len, batch=batch)

    return make


@pytest.fixture
def target_runner(make_runner):
    """A fresh TargetRunner over ``tiny_model`` (max_len 256, batch 1)."""
    return make_runner()


# bf16 path -> (CPU features it needs, features hidden to emulate the CPU that selects it)
BF16_PATHS = {
    "amx": (("amx_bf16", "amx_tile", "avx512_bf16"), ()),
    "avx512_bf16": (("avx512_bf16",), ("amx_bf16", "amx_tile")),
    "avx512": (("avx512f", "avx512bw", "avx512vl"), ("amx_bf16", "amx_tile", "avx512_bf16")),
    "avx2": (("avx2", "fma"), ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f")),
    "torch": ((), ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")),
}


@pytest.fixture(params=list(BF16_PATHS))
def bf16_path(request):
    """The name of the bf16 path under test; the CPU looks, meanwhile, like one that selects it."""
    from specctl.kernels import cpu, select

    name = request.param
    needs, hide = BF16_PATHS[name]
    missing = [f for f in needs if not cpu.has(f)]
    if missing:
        pytest.skip(f"the {name} path needs {', '.join(missing)}, which this CPU lacks")
    with select.hidden(*hide):
        if select.bf16_path() != name:
            pytest.skip(f"the {name} kernels do not build here (no C++ compiler?)")
        yield name


@pytest.fixture
def run_batched():
    """run_batched(decoder, prompts, params, slots=4) -> [GenerationResult]: the prompts through the
    continuous-batching scheduler (``slots`` requests decode together, one target forward per step,
    requests joining as others leave), with ``decoder``'s proposer; each its own runner like the
    decoder's. Stepped as a server steps them (not an offline job: no request is held from drafting in
    the last wave), so each request drafts as it would alone."""
    from specctl.runtime.runner import TargetRunner
    from specctl.runtime.scheduler import Request, Scheduler

    def run(decoder, prompts, params, slots: int = 4, **kw):
        r0 = decoder.runner
        sched = Scheduler(decoder, [TargetRunner(r0.model, r0.max_len) for _ in range(slots)], **kw)
        out = sched.run([Request(list(p), pr) for p, pr in zip(prompts, params)], closed=False)
        assert max(sched.batch_sizes) > 1  # they did decode together
        return out

    return run

# ----------------------------------------------------------------------------- tiny quantized GGUFs

TINY_QUANT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def add_tiny_tokenizer(w) -> None:
    """The tiny tokenizer as GGUF metadata (gguf.GGUFWriter ``w``): a byte-level BPE ("gpt2") of the same
    ids, without merges (one character a token), special tokens as control tokens, the chat template."""
    vocab = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(vocab))
    w.add_token_types([3 if t in TINY_SPECIAL_TOKENS else 1 for t in vocab])
    w.add_token_scores([0.0] * len(vocab))  # no merges: transformers derives them (none) from the scores
    w.add_bos_token_id(TINY_BOS_ID)
    w.add_eos_token_id(TINY_EOS_ID)
    w.add_pad_token_id(TINY_PAD_ID)
    w.add_unk_token_id(TINY_UNK_ID)
    w.add_chat_template(TINY_CHAT_TEMPLATE)


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
    import gguf

    a = w.float().numpy()
    return quantize_q4_k(a) if qtype == "Q4_K" else gguf.quants.quantize(a, gguf.GGMLQuantizationType[qtype])


def permute(t: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert's Q/K row permutation (HF order -> GGUF order)."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


# HF projection -> (GGUF name, type): Q4_K where in_features allow (all here), Q8_0 for v/o and the head
QUANT_TYPES = {"q_proj": ("attn_q", "Q4_K"), "k_proj": ("attn_k", "Q4_K"), "v_proj": ("attn_v", "Q8_0"),
         "o_proj": ("attn_output", "Q8_0"), "gate_proj": ("ffn_gate", "Q4_K"), "up_proj": ("ffn_up", "Q4_K"),
         "down_proj": ("ffn_down", "Q4_K")}


def write_quant_gguf(folder, path, tokenizer: bool = True) -> dict[str, torch.Tensor]:
    """The HF model in ``folder`` as a quantized GGUF at ``path`` (with the tiny tokenizer as
    ``tokenizer.ggml.*`` metadata unless ``tokenizer=False``); returns the HF-order state dict of the
    weights the GGUF holds (quantized ones dequantized by gguf-py): the reference model's."""
    import gguf
    from safetensors.torch import load_file

    from specctl.modeling import read_config

    GT = gguf.GGMLQuantizationType
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
    if tokenizer:
        add_tiny_tokenizer(w)
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
        for hn, (gn, qtype) in QUANT_TYPES.items():
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


@pytest.fixture(scope="session")
def tiny_quant_gguf(tiny_model_factory, tmp_path_factory) -> Path:
    """A tiny llama as a quantized GGUF file with its tokenizer (``write_quant_gguf``); skipped without gguf
    or without the quant_linear kernel."""
    pytest.importorskip("gguf")
    from specctl.kernels import quant_linear as ql

    if ql.best_path(torch.float32) is None:
        pytest.skip("the quant_linear kernel did not build here (no C++ compiler?)")
    folder = tiny_model_factory(tie_word_embeddings=True, seed=1, initializer_range=0.05, **TINY_QUANT_SHAPE)
    path = tmp_path_factory.mktemp("quant-gguf") / "tiny-q.gguf"
    write_quant_gguf(folder, path)
    return path


FMA_FORMS = {"avx512": ("amx_bf16", "amx_tile", "avx512_bf16"), "avx2": ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f")}


def fma_form(module, path: str = "avx512"):
    """``module``'s build as a CPU with AVX-512 but no AVX512-BF16 takes it (``path`` "avx512": vdpbf16ps's
    arithmetic in fp32 FMAs, csrc/bf16.h), or one with AVX2 alone ("avx2": that form on two ymm halves,
    csrc/vec16.h), beside the AVX512-BF16 build that ``module`` loads here; skips unless both run."""
    from specctl.kernels import select, skinny_linear

    if skinny_linear.path() != "avx512_bf16":
        pytest.skip("needs a CPU with AVX512-BF16, to compare the two forms")
    with select.hidden(*FMA_FORMS[path]):
        ext = module.load()
        assert skinny_linear.path() == path and ext is not None
    return ext
