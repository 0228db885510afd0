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
    chat_template.jinja (a ChatML-style template; ``tokenizer.chat_template`` is set). ``specctl.runtime.runner.load_model(tiny_model_dir,
    dtype="float32")`` works end to end on it, so command tests (bench, ...) can use it as a model.

``tiny_model`` (session)
    ``load_transformer(tiny_model_dir, torch.float32)``: the own Transformer (read-only; share it).

``repetitive_prompts`` (session)
    ``make_repetitive_prompts(n, seed)``: prompts that repeat themselves, so copying drafts get accepted.

``bf16_path`` (function, parametrized)
    Runs a test once per CPU bf16 path, as the CPU that selects it would: ``"amx"``, ``"avx512_bf16"``
    (AMX hidden) and ``"torch"`` (AMX and AVX512-BF16 hidden: an AVX2-only CPU), each skipped with
    the missing feature named where this CPU cannot run it. Load models inside the test.

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
from pathlib import Path

import pytest
import torch

_TESTS = Path(__file__).resolve().parent

# The tiny models here are faster on one thread (a 64-wide matmul gains nothing from two), and one
# thread keeps the suite fast when other processes share the (two) cores: with torch's default of
# one thread per core, a busy neighbour makes every forward wait on the slowest thread (~40x slower).
torch.set_num_threads(1)


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
    "torch": ((), ("amx_bf16", "amx_tile", "avx512_bf16")),
}


@pytest.fixture(params=list(BF16_PATHS))
def bf16_path(request):
    """The name of the bf16 path under test; the CPU looks, meanwhile, like one that selects it."""
    from kernels import cpu

    name = request.param
    needs, hide = BF16_PATHS[name]
    missing = [f for f in needs if not cpu.has(f)]
    if missing:
        pytest.skip(f"the {name} path needs {', '.join(missing)}, which this CPU lacks")
    with cpu.hidden(*hide):
        if cpu.bf16_path() != name:
            pytest.skip(f"the {name} kernels do not build here (no C++ compiler?)")
        yield name


@pytest.fixture
def run_batched():
    """run_batched(decoder, prompts, params, slots=4) -> [GenerationResult]: the prompts through the
    continuous-batching scheduler (``slots`` requests decode together, one target forward per step,
    requests joining as others leave), with ``decoder``'s proposer; each its own runner like the
    decoder's."""
    from specctl.runtime.runner import TargetRunner
    from specctl.runtime.scheduler import Request, Scheduler

    def run(decoder, prompts, params, slots: int = 4, **kw):
        r0 = decoder.runner
        sched = Scheduler(decoder, [TargetRunner(r0.model, r0.max_len) for _ in range(slots)], **kw)
        out = sched.run([Request(list(p), pr) for p, pr in zip(prompts, params)])
        assert max(sched.batch_sizes) > 1  # they did decode together
        return out

    return run
