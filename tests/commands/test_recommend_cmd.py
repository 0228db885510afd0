"""`specctl recommend`: the tree and ready configs on stdout, --json, --help with an example, --probe's
ranking with α, ρ, predicted and measured speedup (progress on stderr), one-line errors with exit 1.

--probe runs on real tiny models from the conftest's factory: a 4-layer llama target and a 1-layer
draft with the same tokenizer (fp32, a few prompts, a dozen tokens).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from specctl.cli import app
from specctl.config import implemented_methods

runner = CliRunner()


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path / "cache"))


def run_main(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    env.pop("SPECCTL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "specctl.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.fixture
def target_with_medusa(tmp_path, tiny_model_dir):
    """The conftest's tiny model copied into a folder, a Medusa draft (vLLM layout) beside it."""
    import shutil

    t = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_model_dir, t)
    d = tmp_path / "models" / "tiny-medusa"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 2, "num_hidden_layers": 1,
                                               "hidden_size": 64, "vocab_size": 128}))
    save_file({"blocks.0.layers.0.weight": torch.zeros(64, 64), "blocks.1.layers.0.weight": torch.zeros(64, 64),
               "lm_heads.0.weight": torch.zeros(128, 64), "lm_heads.1.weight": torch.zeros(128, 64)},
              str(d / "model.safetensors"))
    return t, d


def test_help_has_an_example():
    r = runner.invoke(app, ["recommend", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "specctl recommend qwen2.5-coder-1.5b --workload code" in r.stdout
    assert "--probe" in r.stdout and "--drafts" in r.stdout and "--own-training" in r.stdout


def test_tree_and_ready_configs(target_with_medusa):
    t, d = target_with_medusa
    r = runner.invoke(app, ["recommend", str(t), "--candidates", str(t)], env={"COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "Do you train this model yourself? → no" in out
    assert "Is there a Medusa head or EAGLE draft made for this model? → yes" in out
    assert "► medusa with" in out and "Recommended: medusa" in out
    assert "vllm serve" in out and '"method": "medusa"' in out and '"num_speculative_tokens": 2' in out
    assert "Alternative: ngram" in out


def test_json(target_with_medusa):
    t, d = target_with_medusa
    r = runner.invoke(app, ["recommend", str(t), "--candidates", str(t), "--workload", "agentic", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["recommendation"]["method"] == "medusa" and data["recommendation"]["layer"] == 2
    assert data["recommendation"]["vllm_config"] == {"method": "medusa", "model": str(d), "num_speculative_tokens": 2}
    assert data["alternatives"][0]["method"] == "suffix"  # agentic: requests repeat
    hyb = data["alternatives"][1]  # or both: suffix first, the Medusa heads where it has nothing
    assert hyb["method"] == "hybrid" and [p["method"] for p in hyb["config"]["proposers"]] == ["suffix", "medusa"]
    assert "policy" not in hyb["config"]  # the default, score: the parts weighed by what they measure
    assert hyb["vllm_config"] == data["recommendation"]["vllm_config"] and "one proposer at a time" in hyb["note"]
    text = runner.invoke(app, ["recommend", str(t), "--candidates", str(t), "--workload", "agentic"])
    assert text.exit_code == 0, text.output
    assert "hybrid: suffix first" in text.stdout and '"method": "hybrid"' in text.stdout
    assert data["drafts"][0]["accepted"] is True and data["workload"]["repeats"] is True
    assert data["tree"]["children"][0]["text"] == "Do you train this model yourself?"
    assert data["implemented_methods"] == list(implemented_methods()) and data["probe"] is None


def test_probe_ranks_methods_with_alpha_rho_and_speedups(tiny_model_factory, tmp_path):
    # a folder of its own: drafts beside the target are searched, and the session's temp root holds
    # other tests' drafts (an MTP export would join the probe)
    tgt = shutil.copytree(tiny_model_factory(num_hidden_layers=4), tmp_path / "models" / "target")
    small = tiny_model_factory(num_hidden_layers=1, seed=1)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in (
        "abc abc abc abc abc abc abc abc", "the cat sat on the mat. the cat sat on the mat. the")) + "\n")
    r = runner.invoke(app, ["recommend", str(tgt), "--candidates", str(small), "--probe", "--prompts", str(prompts),
                            "-n", "2", "--max-new-tokens", "12", "--dtype", "float32", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    p = data["probe"]
    assert "warm-up" in r.stderr and "prompt 2/2" in r.stderr  # progress on stderr only
    rows = p["methods"]
    assert {row["method"] for row in rows} == {"ngram", "suffix", "draft_model"}
    assert [row["rank"] for row in rows] == list(range(1, len(rows) + 1))
    speeds = [row["measured_speedup"] for row in rows]
    assert speeds == sorted(speeds, reverse=True) and all(s > 0 for s in speeds)
    for row in rows:
        assert row["identical_to_baseline"] == 2  # greedy, fp32: lossless
        assert row["rho"] is not None and row["rho"] >= 0
        if row["alpha"] is not None:
            assert 0 <= row["alpha"] <= 1 and row["predicted_k"] >= 1
            assert row["predicted_speedup"] == pytest.approx(
                max((1 - row["alpha"] ** (k + 1)) / (1 - row["alpha"]) / (1 + k * row["rho"]) if row["alpha"] < 1
                    else (k + 1) / (1 + k * row["rho"]) for k in range(1, 17)))
    dm = next(row for row in rows if row["method"] == "draft_model")
    assert dm["config"]["model"] == str(small) and dm["rho"] > 0.05  # a model forward is not free
    assert p["baseline_tokens_per_s"] > 0 and p["prompts"] == str(prompts)
    probe_node = data["tree"]["children"][-1]
    assert probe_node["text"].startswith("Measured (--probe)") and probe_node["answer"] == rows[0]["label"]


def test_bad_input_is_one_line_exit_1(tmp_path):
    r = run_main("recommend", str(tmp_path / "no-such-model"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("Error: no such file or folder")
    r = run_main("recommend", "no-such-catalogue-model")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "unknown model" in r.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    save_file({"w": torch.zeros(1)}, str(broken / "model.safetensors"))
    r = run_main("recommend", str(broken))
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "cannot read" in r.stderr and "config.json" in r.stderr


def test_usage_errors_exit_2(tiny_model_dir):
    r = run_main("recommend", str(tiny_model_dir), "--workload", "poetry")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unknown workload" in r.stderr
    r = run_main("recommend", str(tiny_model_dir), "--prompts", "x.jsonl")
    assert r.returncode == 2 and "--probe" in r.stderr


def test_probe_predicts_sparse_attn_at_the_asked_context_on_this_machine(tiny_model_factory, tmp_path):
    """Where sparse_attn is judged to pay (a long context at a large batch), --probe runs it and
    predicts its speedup at that context and batch from this machine's measured rates."""
    tgt = tiny_model_factory(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc abc abc abc abc abc abc abc"}) + "\n")
    r = runner.invoke(app, ["recommend", str(tgt), "--candidates", str(tgt), "-w", "long-context", "--context-len",
                            "2048", "--batch", "64", "--probe", "--prompts", str(prompts), "-n", "1",
                            "--max-new-tokens", "8", "--dtype", "float32", "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert (data["context"], data["batch"]) == (2048, 64)
    row = next(x for x in data["probe"]["methods"] if x["method"] == "sparse_attn")
    rf = row["roofline"]
    assert (rf["context"], rf["batch"]) == (2048, 64) and rf["predicted_speedup"] > 0
    assert rf["machine"]["bandwidth"] > 0 and rf["machine"]["attention_flops"] > 0


def test_takes_every_workload_name_bench_takes(tiny_model_dir):
    from specctl.recommend.cost import WORKLOADS
    from specctl.workloads import WORKLOADS as BENCH

    for name in ("summarize", "long-4k", "humaneval", "mt-bench"):
        assert name in BENCH
        r = runner.invoke(app, ["recommend", str(tiny_model_dir), "--workload", name, "--json"])
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["workload"]["name"] == name
    h = runner.invoke(app, ["recommend", "--help"], env={"COLUMNS": "400"}).stdout
    assert all(name in h for name in WORKLOADS)


def test_a_missing_prompts_file_names_only_workloads_recommend_takes(tiny_model_dir):
    from specctl.recommend.cost import get_workload

    r = run_main("recommend", str(tiny_model_dir), "--probe", "--prompts", "nosuch.jsonl")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "nosuch.jsonl does not exist" in r.stderr
    names = r.stderr.split("use a built-in workload: ", 1)[1].strip().split(", ")
    assert "summarize" in names and "long-4k" in names
    for name in names:
        get_workload(name)  # each one recommend --workload takes (a UsageError otherwise)


def test_empty_model_name_is_a_usage_error():
    r = run_main("recommend", " ")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "model name is empty" in r.stderr and "local HF folder" in r.stderr


def test_other_vocabulary_alternative_prints_no_vllm_command(tmp_path, tiny_model_dir):
    """A draft with another vocabulary: specctl's command, and instead of vLLM's, why vLLM cannot run it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.recommend.builders import llama

    words = ["<unk>"] + [f"w{i:03d}" for i in range(255)]  # a word-level tokenizer of 256 ids
    raw = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>").save_pretrained(tmp_path / "word-tok")
    target = llama(tmp_path / "models" / "target", layers=4, tokenizer=tiny_model_dir)
    other = llama(tmp_path / "cands" / "other", layers=1, vocab=256, tokenizer=tmp_path / "word-tok")
    r = runner.invoke(app, ["recommend", str(target), "--candidates", str(other), "--workload", "translation"],
                      env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    block = r.stdout.split("Alternative: draft_model with other", 1)[1].split("Alternative:")[0]
    assert "specctl serve --model" in block and '"model": "' + str(other) in block
    assert "vLLM:    none: vLLM's draft_model needs the target's vocabulary" in block
    assert "(256 vs 128 tokens)" in block and "vllm serve" not in block


def test_quantization_help_says_probe_only_and_takes_the_positional_model():
    r = runner.invoke(app, ["recommend", "--help"], env={"COLUMNS": "250"})
    assert r.exit_code == 0
    text = " ".join(r.stdout.replace("│", " ").split())
    i = text.index("--quantization [none|gguf]")
    assert "--probe only" in text[i:i + 60] and "--model FILE.gguf" not in text
    u = run_main("recommend", "smollm2-135m", "--quantization", "gguf")
    assert u.returncode == 2 and "--quantization only applies with --probe" in u.stderr


def test_probe_of_a_gguf_runs_it_quantized_and_says_so(tiny_quant_gguf, tmp_path):
    """--probe --quantization gguf: nothing converted; the commands carry --quantization gguf; the footer
    and the JSON name the GGUF and its kernel path (as bench's header does)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "abc abc abc abc abc abc"}) + "\n")
    args = ["recommend", str(tiny_quant_gguf), "--candidates", str(tiny_quant_gguf), "--probe", "--prompts",
            str(prompts), "-n", "1", "--max-new-tokens", "6", "--quantization", "gguf"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    assert "converting" not in r.stderr and not list((tmp_path / "cache").glob("models/gguf-*"))
    data = json.loads(r.stdout)
    p = data["probe"]
    assert p["quantization"] == "gguf" and p["kernels"].startswith("gguf-") and p["model_path"] == str(tiny_quant_gguf)
    for c in [data["recommendation"], *data["alternatives"]]:
        assert f"--model {tiny_quant_gguf} --quantization gguf " in c["commands"]["specctl_serve"]
        assert f"--model {tiny_quant_gguf} --quantization gguf " in c["commands"]["specctl_bench"]
    text = runner.invoke(app, args, env={"COLUMNS": "250"})
    assert text.exit_code == 0, text.output
    out = " ".join(text.stdout.split())
    assert f"specctl: specctl serve --model {tiny_quant_gguf} --quantization gguf --method" in out
    assert f"GGUF quantized ({tiny_quant_gguf.name}), kernels {p['kernels']}, bfloat16 activations on cpu" in out
    assert "vLLM: none:" in out and f"vllm serve {tiny_quant_gguf} --tokenizer HF_REPO" in out
