"""specctl.recommend.cost: the speedup formula, the ρ/α estimates, and sparse_attn judged by the roofline."""

from __future__ import annotations

import pytest

from specctl.config import SpecConfig
from specctl.recommend.cost import (K_MAX, WORKLOADS, best_k, estimate_alpha, estimate_rho, get_workload,
                                    ngram_prediction, predicted_speedup)
from specctl.recommend.flowchart import recommend
from specctl.recommend.probe import probe_plan
from tests.recommend.builders import q, qwen_like


def test_speedup_formula_best_k_and_alpha_estimate():
    assert predicted_speedup(0.8, 0.0, 1) == pytest.approx(1.8)
    assert predicted_speedup(0.8, 0.1, 2) == pytest.approx((1 - 0.8 ** 3) / (0.2 * 1.2))
    assert predicted_speedup(1.0, 0.5, 3) == pytest.approx(4 / 2.5)  # the α -> 1 limit
    k, s = best_k(0.8, 0.37)
    assert s == max(predicted_speedup(0.8, 0.37, j) for j in range(1, K_MAX + 1)) and 1 < k < 6
    assert best_k(0.9, 0.0)[0] == K_MAX  # a free draft: longer is always better by the formula
    assert predicted_speedup(0.5, 1.0, 1) < 1  # ρ -> 1: the gain is gone
    assert estimate_alpha([(4, 4), (4, 1)]) == pytest.approx(5 / 6)
    assert estimate_alpha([(3, 0), (0, 0)]) == 0.0 and estimate_alpha([]) is None
    # the per-layer overhead makes a thin deep model cost more than its parameters say
    assert estimate_rho(100e6, 30, 1.5e9, 28) > 100e6 / 1.5e9


def test_long_context_at_batch_gives_sparse_attn(tmp_path, tiny_model_dir):
    target = qwen_like(tmp_path / "t")
    rec = recommend(str(target), candidates=[], workload="long-context", context=32768, batch=8)
    assert q(rec, "Is the KV cache a large share") == "yes"
    assert rec.choice.method == "sparse_attn" and rec.choice.config["sparse_attn_algorithm"] == "vegas"
    assert [a.method for a in rec.alternatives][:1] == ["ngram"]  # what it replaced
    assert "--reuse-prefill" in rec.choice.commands["specctl_bench"]

    SpecConfig.from_dict(rec.choice.config)  # a valid config as it is
    run, _ = probe_plan(rec)
    assert "sparse_attn" in [label for label, _ in run]


def test_short_context_does_not_pay_for_sparse_attn(tmp_path):
    target = qwen_like(tmp_path / "t")
    rec = recommend(str(target), candidates=[], workload="long-context", context=512, batch=1)
    assert q(rec, "Is the KV cache a large share") == "no"
    assert rec.choice.method == "ngram" and "sparse_attn" not in [a.method for a in rec.alternatives]


def test_every_bench_workload_is_a_recommend_workload():
    """recommend takes every built-in workload name bench takes (specctl.workloads is shared), and each
    of its workloads probes on prompts bench has."""
    from specctl import workloads

    for name in workloads.WORKLOADS:
        assert get_workload(name).name == name
    for w in WORKLOADS.values():
        assert w.prompts is None or w.prompts.split("@")[0] in workloads.WORKLOADS, w
    assert get_workload("long-32k").context == 32768 and get_workload("long-4k").prompts == "long-4k"
    assert get_workload("summarize").copies_prompt and get_workload("mt-bench").prompts == "mt-bench"


def test_ngram_prior_fits_benchs_measured_speedups():
    """ngram's prediction (ρ = 0, the workload's prior α over every step) lands where bench measured it on
    Qwen2.5-Coder (README): code-edit 2.8-3.4x, humaneval 6.0-7.0x, chat about 1.05x; unknown: None."""
    assert 2.7 < ngram_prediction(get_workload("code-edit"), 10) < 3.4
    assert ngram_prediction(get_workload("code"), 10) == ngram_prediction(get_workload("code-edit"), 10)
    assert 6.0 < ngram_prediction(get_workload("humaneval"), 10) < 7.0
    assert 1.0 < ngram_prediction(get_workload("chat"), 10) < 1.1
    assert ngram_prediction(get_workload("translation"), 10) is None


def _kv_question(rec):
    def walk(n):
        yield n
        for c in n.children:
            yield from walk(c)
    return next(n for n in walk(rec.tree) if n.text.startswith("Is the KV cache a large share"))


def test_sparse_attn_weighs_a_gguf_target_at_the_bytes_it_stores(tmp_path):
    """Run as its GGUF, a target's step reads the file's blocks (here F32: 4 bytes a weight), not bf16's 2:
    the same context is half as large a share of the reads, and the reason says why."""
    import re

    from tests.recommend.builders import gguf_llama

    f = gguf_llama(tmp_path / "m.gguf")
    dense = _kv_question(recommend(str(f), candidates=[], workload="long-context", context=4096, batch=1))
    quant = _kv_question(recommend(str(f), candidates=[], workload="long-context", context=4096, batch=1,
                                   quantization="gguf"))
    share = [int(re.search(r"is (\d+)% of the weights read", n.reason).group(1)) for n in (dense, quant)]
    assert share[1] == pytest.approx(share[0] / 2, abs=1)
    assert "bits a weight" not in dense.reason and "at the GGUF's 32.0 bits a weight" in quant.reason
