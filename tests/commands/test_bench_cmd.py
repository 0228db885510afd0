"""`specctl bench` end to end on a tiny model: JSON carries consistent numbers, outputs equal the baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def run_cli(*args: str, env_extra: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env.pop("SPECCTL_DEBUG", None)
    if "COLUMNS" not in (env_extra or {}):
        env.pop("COLUMNS", None)
    return subprocess.run([sys.executable, "-m", "specctl.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "prompts.jsonl"
    lines = [
        {"id": "rep", "prompt": "abc def abc def abc def abc def abc def abc"},
        {"prompt": "the cat sat on the mat. the cat sat on the mat. the cat"},
        {"messages": [{"role": "user", "content": "xyz xyz xyz xyz xyz xyz"}]},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return p


def test_bench_json_fp32_identical_and_consistent(tiny_model_dir, prompts_file, tmp_path):
    r = run_cli("bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--method", "ngram", "-k", "4",
                "-w", str(prompts_file), "-n", "3", "--max-new-tokens", "24", "--json",
                env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["header"]["dtype"] == "float32"
    rows = {row["method"]: row for row in data["results"]}
    assert set(rows) == {"baseline", "ngram"}
    base, ng = rows["baseline"], rows["ngram"]
    assert base["requests"] == ng["requests"] == 3
    assert ng["identical_to_baseline"] == 3 and ng["first_divergence"] == [None, None, None]
    assert ng["new_tokens"] == base["new_tokens"]
    assert ng["k"] == 4 and ng["config"]["method"] == "ngram"
    # the numbers are consistent with each other
    assert 0 < ng["num_draft_tokens"] and ng["num_accepted_tokens"] <= ng["num_draft_tokens"]
    assert ng["acceptance_rate"] == pytest.approx(ng["num_accepted_tokens"] / ng["num_draft_tokens"])
    assert ng["mean_acceptance_length"] == pytest.approx(1 + ng["num_accepted_tokens"] / ng["num_drafts"])
    assert sum(ng["num_accepted_tokens_per_pos"]) == ng["num_accepted_tokens"]
    assert ng["speedup"] == pytest.approx(ng["tokens_per_s"] / base["tokens_per_s"])
    # speculation needs fewer target forwards than plain decoding when anything is accepted
    if ng["num_accepted_tokens"] > 0:
        assert ng["target_forwards"] < base["target_forwards"]


def test_bench_runs_a_gguf_quantized(tiny_quant_gguf, prompts_file, tmp_path, monkeypatch):
    """--model tiny.gguf --quantization gguf: the file runs as stored (no dense conversion), the header records it,
    and ngram's outputs equal the (quantized) baseline's."""
    from typer.testing import CliRunner

    from specctl.cli import app

    monkeypatch.setenv("SPECCTL_CACHE", str(tmp_path / "cache"))
    r = CliRunner().invoke(app, ["bench", "--model", str(tiny_quant_gguf), "--quantization", "gguf", "--method",
                                 "ngram", "-k", "4", "-w", str(prompts_file), "-n", "3", "--max-new-tokens", "24",
                                 "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    h = data["header"]
    assert h["quantization"] == "gguf" and h["model"] == str(tiny_quant_gguf) and h["cpu_kernels"].startswith("gguf-")
    rows = {row["method"]: row for row in data["results"]}
    assert rows["ngram"]["identical_to_baseline"] == 3 and rows["ngram"]["new_tokens"] == rows["baseline"]["new_tokens"]
    assert rows["ngram"]["num_accepted_tokens"] > 0
    assert not (tmp_path / "cache" / "models").exists()  # nothing converted to dense


def test_bench_table_and_speculative_config(tiny_model_dir, prompts_file, tmp_path):
    cfg = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    r = run_cli("bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--speculative-config", cfg,
                "-w", str(prompts_file), "-n", "1", "--max-new-tokens", "8",
                env_extra={"SPECCTL_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "baseline" in r.stdout and "ngram" in r.stdout and "speedup" in r.stdout
    assert "float32" in r.stdout  # header names the dtype


@pytest.mark.parametrize("args, code, needle", [
    (["bench", "--model", "/no/such/model"], 1, "no such"),
    (["bench", "--speculative-config", "{not json"], 2, "not valid JSON"),
    (["bench", "--method", "ngramm"], 2, "did you mean 'ngram'"),
    (["bench", "--method", "ngram", "-k", "0"], 2, "num_speculative_tokens must be >= 1"),
    (["bench", "--model", "qwen-9000"], 1, "specctl models list"),
    (["bench", "--workload", "nope"], 2, "code-edit"),
    (["bench", "--speculative-config", '{"method": "ngram", "num_speculative_tokns": 3}'], 2, "num_speculative_tokens"),
    (["bench", "--model", ".", "--quantization", "gguf"], 2, "needs a .gguf file or a catalogue name"),
    (["bench", "--quantization", "awq"], 2, "unknown quantization 'awq'"),
    (["bench", "-n", "0"], 2, "pass e.g. -n 4 (the default)"),  # not "omit it for all": the default is 4
    (["bench", "--max-new-tokens", "1"], 2, "--max-new-tokens must be >= 2"),  # no decode time to measure
    (["bench", "--device", "tpu"], 2, "unknown device 'tpu'"),  # before the model loads (no "loading ..." line)
    (["bench", "--speculative-config", '{"method": "ngram", "bogus_key": 3}'], 2, "keys are vLLM's: method, model"),
])
def test_bad_input_one_line_error(args, code, needle, tmp_path):
    r = run_cli(*args, env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")}, timeout=120)
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr  # one line, no traceback
    assert "Traceback" not in r.stderr
    assert needle.lower() in lines[0].lower()


def _bad_outputs(tmp_path):
    folder, file = tmp_path / "a-folder", tmp_path / "a-file"
    folder.mkdir()
    file.write_text("x")
    cases = [(["--csv", str(folder)], "is a folder, not a file"), (["--plot", str(file)], "is a file, not a folder"),
             (["--plot", str(file / "plots")], "is a file, so"), (["--csv", str(file / "r.csv")], "is a file, so")]
    if os.path.isdir("/proc/self"):  # root passes the permission check there; only a probe file finds it out
        cases.append((["--csv", "/proc/x.csv"], "cannot create a file in /proc"))
    return cases


def test_unwritable_csv_and_plot_paths_are_refused_before_the_model_loads(tmp_path):
    """Found after the whole run, they lost its results (a traceback-ish FileNotFoundError, stdout empty):
    now one usage line before anything loads (the model named here does not exist: its error would come first
    were the paths checked after it)."""
    for args, needle in _bad_outputs(tmp_path):
        r = run_cli("bench", "--model", "/no/such/model", *args, env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")},
                    timeout=120)
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1, (args, r.stderr)
        assert args[0] in lines[0] and needle in lines[0] and "choose a" in lines[0], (args, lines[0])
    assert not list((tmp_path / "a-folder").iterdir())  # the probe file is gone


def test_a_prompt_over_the_models_context_is_a_one_line_usage_error(tiny_model_factory, tmp_path):
    short = tiny_model_factory(max_position_embeddings=64)
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps({"prompt": "w" * 90}) + "\n")
    r = run_cli("bench", "--model", str(short), "--dtype", "float32", "-w", str(p), "--max-new-tokens", "8",
                env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")})
    last = r.stderr.strip().splitlines()[-1]  # after the loading log, nothing run
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert f"{p} line 2: the prompt is" in last and "context of 64 positions" in last and "shorter" in last


def test_a_hybrids_part_that_never_drafted_gets_its_row(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """README: each part of a hybrid gets a row; one that made 0 % of the drafts had none (and no by_proposer entry)."""
    from specctl.bench.suite import run_bench
    from specctl.commands.bench import render
    from specctl.config import SpecConfig
    from specctl.runtime.decoder import SamplingParams
    from specctl.runtime.loading import load_model

    target = load_model(tiny_model_dir, dtype="float32")
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "abc abc abc abc abc"}) + "\n")
    never = {"method": "ngram", "prompt_lookup_min": 30, "prompt_lookup_max": 30}  # no 30-gram repeats in this
    cfg = SpecConfig.from_dict({"method": "hybrid", "proposers": [never, {"method": "suffix"}]})
    report = run_bench(target, [cfg], [str(p)], None, SamplingParams(max_new_tokens=12, stop_token_ids=target.stop_token_ids),
                       adaptive=False)
    row = report.rows()[1]
    assert list(row["by_proposer"]) == ["ngram", "suffix"]
    assert row["by_proposer"]["ngram"]["num_drafts"] == 0 and row["by_proposer"]["ngram"]["acceptance_rate"] == 0
    monkeypatch.setenv("COLUMNS", "240")  # the table as wide as it needs: a narrow terminal cuts the labels
    render(report)
    out = capsys.readouterr().out
    assert "↳ ngram" in out and "↳ suffix" in out and "0% of drafts" in out


def test_bench_csv_plot_runs_and_hf_peer(tiny_model_dir, prompts_file, tmp_path):
    import csv

    out_csv, plots = tmp_path / "r.csv", tmp_path / "plots"
    r = run_cli("bench", "--model", str(tiny_model_dir), "--dtype", "float32", "-w", str(prompts_file), "-n", "2",
                "--max-new-tokens", "12", "--runs", "2", "--peer", "hf", "--csv", str(out_csv), "--plot", str(plots),
                "--json", env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"]
    methods = [x["method"] for x in rows]
    assert methods == ["baseline", "ngram", "hf:plain", "hf:prompt-lookup"]
    assert all(x["runs"] == 2 and x["tokens_per_s_min"] <= x["tokens_per_s"] <= x["tokens_per_s_max"] for x in rows)
    # the CSV carries the same numbers as the JSON
    with open(out_csv) as fh:
        csv_rows = list(csv.DictReader(fh))
    assert [c["method"] for c in csv_rows] == methods
    for c, j in zip(csv_rows, rows):
        assert float(c["tokens_per_s"]) == pytest.approx(j["tokens_per_s"])
        assert float(c["acceptance_rate"]) == pytest.approx(j["acceptance_rate"])
        assert int(c["num_accepted_tokens"]) == j["num_accepted_tokens"]
    for name in ("speedup.png", "acceptance.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # transformers' greedy output on the same prompts equals specctl's plain output (fp32)
    assert next(x for x in rows if x["method"] == "hf:plain")["identical_to_baseline"] == 4


def test_speculative_config_is_repeatable_and_rows_are_labelled(tiny_model_dir, prompts_file, tmp_path):
    r = run_cli("bench", "--model", str(tiny_model_dir), "--dtype", "float32", "-w", str(prompts_file), "-n", "1",
                "--max-new-tokens", "8", "--json",
                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}',
                env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["results"]
    assert [(x["method"], x["k"]) for x in rows] == [("baseline", 0), ("ngram:k=3", 3), ("ngram:k=5", 5)]
    assert all(x["identical_to_baseline"] == 1 for x in rows)


def test_help_lists_every_workload_and_the_new_options(tmp_path):
    from specctl.workloads import WORKLOADS

    r = run_cli("bench", "--help", env_extra={"COLUMNS": "200"}, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in WORKLOADS:
        assert f"{name}:" in r.stdout
    assert r.stdout.count("--speculative-config '") >= 3  # the two-draft example repeats it


def test_sweep_k_json_best_k_table_and_plots(tiny_model_dir, prompts_file, tmp_path):
    args = ("bench", "--model", str(tiny_model_dir), "--dtype", "float32", "-w", str(prompts_file), "-n", "2",
            "--max-new-tokens", "12", "--method", "ngram", "--sweep-k", "2,4", "--fixed-k")
    env = {"SPECCTL_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    plots = tmp_path / "plots"
    r = run_cli(*args, "--json", "--plot", str(plots), env_extra=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = out["results"]
    assert [(x["method"], x["k"]) for x in rows] == [("baseline", 0), ("ngram", 2), ("ngram", 4)]
    cell = out["best_k"]["ngram"][str(prompts_file)]
    by_k = {str(x["k"]): x["tokens_per_s"] for x in rows[1:]}
    assert cell["by_k"] == pytest.approx(by_k)
    assert str(cell["k"]) == max(by_k, key=by_k.get)
    assert out["header"]["sweep_k"] == [2, 4]
    for name in ("speedup.png", "acceptance.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    r = run_cli(*args, env_extra={"SPECCTL_CACHE": env["SPECCTL_CACHE"]})  # piped, no COLUMNS: no column cut
    assert r.returncode == 0, r.stderr
    assert "best k (of 2, 4)" in r.stdout and "tok/s by k" in r.stdout
    assert "per-position" in r.stdout and "…" not in r.stdout.split("best k")[1]


@pytest.mark.parametrize("value", ["0,2", "a,b", ",", "2;4"])
def test_bad_sweep_k_is_a_one_line_usage_error(value, tmp_path):
    r = run_cli("bench", "--sweep-k", value, env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")}, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--sweep-k" in lines[0]


def test_bench_compile_refuses_the_fused_bf16_cpu_path_with_a_fix(tiny_model_dir, prompts_file, tmp_path):
    from specctl.modeling import load_transformer

    import torch

    if load_transformer(tiny_model_dir, torch.bfloat16).cpu_kernels is None:
        pytest.skip("needs the CPU feature avx512_bf16 (or amx_bf16) for a C++ bf16 path: "
                    "--compile is allowed in bf16 on this CPU")
    r = run_cli("bench", "--model", str(tiny_model_dir), "--dtype", "bfloat16", "--method", "ngram", "--compile",
                "-w", str(prompts_file), "-n", "1", "--max-new-tokens", "8",
                env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")})
    last = r.stderr.strip().splitlines()[-1]  # after the loading log: the one-line error with its fix
    assert r.returncode == 2 and "--compile" in last and "float32" in last


@pytest.mark.parametrize("args, needle", [
    (["--peer", "vllm"], "SPECCTL_VLLM_PYTHON"),
    (["--peer", "llama.cpp"], "--peer-gguf"),
    (["--peer", "llama.cpp", "--peer-gguf", "/no/such.gguf"], "does not exist"),
    (["--peer", "sglang"], "hf, vllm, llama.cpp"),
    (["--peer-gguf", "/no/such.gguf"], "add --peer llama.cpp, or drop --peer-gguf"),  # was ignored without --peer
])
def test_missing_peer_engines_fail_fast_with_the_fix(args, needle, tmp_path):
    env = {"SPECCTL_CACHE": str(tmp_path / "cache"), "SPECCTL_VLLM_PYTHON": "", "PYTHONPATH": ""}
    r = run_cli("bench", *args, env_extra=env, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0]


def test_a_peer_python_without_the_engine_fails_before_the_run(tmp_path):
    """SPECCTL_LLAMA_CPP_PYTHON naming a Python without llama_cpp: one line before anything loads (it once ran
    the whole bench, every llama.cpp row failing with ModuleNotFoundError)."""
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")  # a Python whose find_spec('llama_cpp') finds nothing
    python.chmod(0o755)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    env = {"SPECCTL_CACHE": str(tmp_path / "cache"), "SPECCTL_LLAMA_CPP_PYTHON": str(python), "PYTHONPATH": ""}
    r = run_cli("bench", "--peer", "llama.cpp", "--peer-gguf", str(gguf), env_extra=env, timeout=120)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"SPECCTL_LLAMA_CPP_PYTHON={python} does not import llama_cpp" in lines[0]


# A stand-in for llama-cpp-python with its API (Llama, generate, LlamaPromptLookupDecoding), greedy
# decoding through transformers on the tiny model: it drives the real peer worker process and the
# peer path of the suite (in step with specctl's rows) without building llama.cpp in the tests.
_LLAMA_STANDIN = '''
import os, torch
from transformers import AutoModelForCausalLM

class Llama:
    def __init__(self, model_path, n_ctx=512, n_threads=None, n_batch=512, verbose=False, seed=0, draft_model=None,
                 logits_all=False):
        assert open(model_path, "rb").read(4) == b"GGUF"
        with open(os.environ["STANDIN_LOG"], "a") as f:  # one line per engine built
            f.write(("ngram" if draft_model else "plain") + " ")
        assert logits_all or draft_model is None  # llama-cpp-python needs every row's logits to verify drafts
        self.model = AutoModelForCausalLM.from_pretrained(os.environ["STANDIN_HF_DIR"], dtype=torch.float32).eval()
        self.draft_model = draft_model

    def reset(self):
        pass

    @torch.inference_mode()
    def generate(self, tokens, top_k=40, top_p=0.95, min_p=0.05, temp=0.8, repeat_penalty=1.0, reset=True):
        assert top_k == 1 and temp == 0.0 and repeat_penalty == 1.0
        ids = list(tokens)
        while True:
            nxt = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            yield nxt

    def close(self):
        pass
'''


def _bench_with_llama_standin(tiny_model_dir, prompts_file, tmp_path, lookup_init: str):
    """specctl bench --peer llama.cpp against the stand-in module; ``lookup_init``: the body of
    LlamaPromptLookupDecoding.__init__(self, num_pred_tokens)."""
    pkg = tmp_path / "standin" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(_LLAMA_STANDIN)
    (pkg / "llama_speculative.py").write_text(
        f"class LlamaPromptLookupDecoding:\n    def __init__(self, num_pred_tokens=10):\n        {lookup_init}\n")
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    return run_cli("bench", "--model", str(tiny_model_dir), "--dtype", "float32", "-w", str(prompts_file), "-n", "2",
                   "--max-new-tokens", "10", "--peer", "llama.cpp", "--peer-gguf", str(gguf), "--json",
                   env_extra={"SPECCTL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path / "standin"),
                              "STANDIN_HF_DIR": str(tiny_model_dir), "STANDIN_LOG": str(tmp_path / "engines.log")})


def test_llama_cpp_peer_runs_in_its_worker_in_step_with_specctl_rows(tiny_model_dir, prompts_file, tmp_path):
    r = _bench_with_llama_standin(tiny_model_dir, prompts_file, tmp_path, "self.k = num_pred_tokens")
    assert r.returncode == 0, r.stderr
    # prompt by prompt, plain and prompt lookup alternate: each engine is built once and kept
    assert sorted((tmp_path / "engines.log").read_text().split()) == ["ngram", "plain"]
    rows = {x["method"]: x for x in json.loads(r.stdout)["results"]}
    assert list(rows) == ["baseline", "ngram", "llama.cpp:plain", "llama.cpp:prompt-lookup"]
    for name in ("llama.cpp:plain", "llama.cpp:prompt-lookup"):
        assert rows[name]["requests"] == 2 and rows[name]["identical_to_baseline"] == 2  # same greedy tokens
        assert rows[name]["new_tokens"] == rows["baseline"]["new_tokens"]
    # a peer's speedup is over its own plain row
    lp, pl = rows["llama.cpp:prompt-lookup"], rows["llama.cpp:plain"]
    assert lp["speedup"] == pytest.approx(lp["tokens_per_s"] / pl["tokens_per_s"]) and pl["speedup"] == pytest.approx(1.0)


def test_a_failing_peer_loses_its_rows_not_the_run(tiny_model_dir, prompts_file, tmp_path):
    r = _bench_with_llama_standin(tiny_model_dir, prompts_file, tmp_path, "raise RuntimeError('prompt lookup broke')")
    assert r.returncode == 0, r.stderr
    rows = {x["method"]: x for x in json.loads(r.stdout)["results"]}
    assert rows["llama.cpp:plain"]["error"] is None and rows["llama.cpp:plain"]["tokens_per_s"] > 0
    bad = rows["llama.cpp:prompt-lookup"]
    assert "prompt lookup broke" in bad["error"] and bad["tokens_per_s"] == 0 and bad["speedup"] is None
    assert "llama.cpp:prompt-lookup" in r.stderr and "prompt lookup broke" in r.stderr


def test_bench_concurrency_json_and_table(tiny_model_dir, prompts_file, tmp_path):
    args = ("bench", "--model", str(tiny_model_dir), "--dtype", "float32", "--method", "ngram", "-k", "4",
            "-w", str(prompts_file), "-n", "3", "--max-new-tokens", "16", "-c", "1", "-c", "3")
    env = {"SPECCTL_CACHE": str(tmp_path / "cache")}
    r = run_cli(*args, "--json", env_extra=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    rows = {(x["concurrency"], x["method"]): x for x in data["results"]}
    assert set(rows) == {(1, "baseline"), (1, "ngram"), (3, "baseline"), (3, "ngram")}
    assert data["header"]["concurrency"] == [1, 3]
    for (n, m), x in rows.items():
        assert x["requests"] == 3 and x["identical_to_baseline"] == 3  # greedy: every output equals plain's
        assert x["tokens"] > 0 and x["tokens_per_s"] == pytest.approx(x["tokens"] / x["wall_s"])
        assert 1 <= x["mean_batch"] <= n and x["ttft_p50_s"] > 0
    assert rows[(3, "baseline")]["mean_batch"] > 1.5  # the three requests decoded together
    assert rows[(1, "baseline")]["speedup"] == pytest.approx(1.0)
    assert rows[(1, "baseline")]["roof_vs_plain_1"] == 1.0 and rows[(3, "baseline")]["roof_vs_plain_1"] > 0
    r = run_cli(*args, env_extra={**env, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "x plain@1" in r.stdout and "roof" in r.stdout and "TTFT p50 ms" in r.stdout and "3/3" in r.stdout


def test_bench_concurrency_refuses_what_it_cannot_combine(tmp_path):
    r = run_cli("bench", "-c", "2", "--sweep-k", "2,4", env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2 and "--sweep-k cannot be combined with --concurrency" in r.stderr
    r = run_cli("bench", "-c", "0", env_extra={"SPECCTL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 2 and "--concurrency must be >= 1" in r.stderr


def test_kernels_option_picks_the_bf16_cpu_path_and_is_recorded(tiny_model_dir, prompts_file, tmp_path):
    env = {"SPECCTL_CACHE": str(tmp_path / "cache")}
    args = ("bench", "--model", str(tiny_model_dir), "--dtype", "bfloat16", "--method", "ngram", "-w", str(prompts_file),
            "-n", "1", "--max-new-tokens", "8", "--json")
    r = run_cli(*args, "--kernels", "torch", env_extra=env)
    assert r.returncode == 0, r.stderr
    h = json.loads(r.stdout)["header"]
    assert h["kernels"] == "torch" and h["cpu_kernels"] is None  # torch's own ops, as asked
    r = run_cli(*args, env_extra=env)
    h = json.loads(r.stdout)["header"]
    from specctl.kernels import cpu, select

    assert h["kernels"] == "auto" and h["cpu_kernels"] == (None if select.bf16_path() == "torch" else select.bf16_path())
    assert h["machine"] == cpu.name()  # the CPU named beside the figures: /proc/cpuinfo's model name
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            assert f"model name\t: {cpu.name()}" in f.read()
    r = run_cli(*args[:4], "float32", *args[5:], "--kernels", "fused", env_extra=env)
    assert r.returncode == 2 and "--kernels fused" in r.stderr and "bfloat16" in r.stderr
    r = run_cli(*args, "--kernels", "fast", env_extra=env)
    assert r.returncode == 2 and "unknown --kernels 'fast'" in r.stderr and "auto, fused, torch" in r.stderr
