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

from specctl.commands.serve import vllm_serve_argv
from specctl.config import SpecConfig
from specctl.errors import UsageError


def run_cli(*args: str, env_extra: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    env.pop("SPECCTL_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "specctl.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


# --------------------------------------------------------------------------- vllm translation


def test_vllm_argv_translation():
    spec = SpecConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                '"disable_by_batch_size": 8}')
    argv = vllm_serve_argv("/models/m", spec=spec.to_dict(), served_model_name="m", host="0.0.0.0", port=9001,
                           api_key="k", max_model_len=2048, max_num_seqs=16, dtype="bf16")
    assert argv[:3] == ["vllm", "serve", "/models/m"]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags == {"--host": "0.0.0.0", "--port": "9001", "--served-model-name": "m", "--dtype": "bfloat16",
                     "--max-model-len": "2048", "--max-num-seqs": "16", "--api-key": "k",
                     "--speculative-config": flags["--speculative-config"]}
    sent = json.loads(flags["--speculative-config"])
    assert sent == spec.to_dict()  # vLLM's own keys, passthrough keys included
    assert sent["method"] == "ngram" and sent["num_speculative_tokens"] == 4 and sent["prompt_lookup_max"] == 4
    assert sent["disable_by_batch_size"] == 8


def test_vllm_argv_minimal_and_dtypes():
    assert vllm_serve_argv("org/model") == ["vllm", "serve", "org/model", "--host", "127.0.0.1", "--port", "8000"]
    assert vllm_serve_argv("m", dtype="float32")[-2:] == ["--dtype", "float32"]
    with pytest.raises(UsageError, match="unknown dtype"):
        vllm_serve_argv("m", dtype="int3")


def test_engine_vllm_without_vllm_is_a_clear_error(tiny_model_dir, tmp_path):
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--method", "ngram",
                env_extra={"PATH": str(tmp_path)})
    assert r.returncode == 1
    assert "vLLM" in r.stderr and "not installed" in r.stderr and "--engine vllm" in r.stderr
    assert "Traceback" not in r.stderr


def test_engine_vllm_execs_vllm_serve_with_the_translation(tiny_model_dir, tmp_path):
    record = tmp_path / "argv.json"
    fake = tmp_path / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv, open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    cfg = '{"method": "ngram", "num_speculative_tokens": 3}'
    r = run_cli("serve", "--engine", "vllm", "--model", str(tiny_model_dir), "--speculative-config", cfg,
                "--port", "8123", "--api-key", "hush", "--max-model-len", "256", "--dtype", "float32",
                env_extra={"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr
    argv = json.loads(record.read_text())
    assert argv[1:3] == ["serve", str(tiny_model_dir)]
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert flags["--port"] == "8123" and flags["--api-key"] == "hush" and flags["--max-model-len"] == "256"
    assert flags["--dtype"] == "float32" and flags["--served-model-name"] == str(tiny_model_dir)
    assert json.loads(flags["--speculative-config"]) == SpecConfig.from_json(cfg).to_dict()
    assert "hush" not in r.stderr  # the logged command masks the key


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
