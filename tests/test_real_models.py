"""Real-model checks (slow; run with `pytest -m slow`): they need the catalogue models pulled.

They assert ratios measured in one run on one machine (never absolute times), and exact outputs.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def _pulled(name: str):
    from specctl.models import is_pulled, model_dir

    if not is_pulled(name):
        pytest.skip(f"{name} is not pulled (specctl models pull {name})")
    return model_dir(name)


def test_qwen15b_ngram_code_edit_3x_and_identical():
    from specctl.bench.suite import run_bench
    from specctl.config import SpecConfig
    from specctl.runtime.decoder import SamplingParams
    from specctl.runtime.loading import load_model

    loaded = load_model(_pulled("qwen2.5-coder-1.5b"), "bfloat16")
    params = SamplingParams(max_new_tokens=128, stop_token_ids=loaded.stop_token_ids)
    report = run_bench(loaded, [SpecConfig(method="ngram").validated()], ["code-edit"], 4, params)
    rows = {r["method"]: r for r in report.rows()}
    assert rows["ngram"]["identical_to_baseline"] == rows["ngram"]["requests"]
    assert rows["ngram"]["speedup"] >= 3.0


def test_smollm2_plain_greedy_matches_transformers_in_fp32():
    import torch
    from transformers import AutoModelForCausalLM

    from specctl.runtime.decoder import SamplingParams, SpecDecoder
    from specctl.runtime.loading import load_model
    from specctl.runtime.runner import TargetRunner

    path = _pulled("smollm2-135m")
    own = load_model(path, "float32")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = own.tokenizer("def fibonacci(n):")["input_ids"]
    want = hf.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
    got = SpecDecoder(TargetRunner(own.model, 256)).generate(ids, SamplingParams(max_new_tokens=48, ignore_eos=True))
    assert got.token_ids == want[: len(got.token_ids)]
