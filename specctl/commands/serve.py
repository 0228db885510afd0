"""`specctl serve`: an OpenAI-compatible server on the own speculative runtime, or `vllm serve`.

Thin: parse the flags, build the SpecConfig, then either load the model and run the server of
``specctl.runtime.server`` under uvicorn, or (``--engine vllm``) exec ``vllm serve`` with the same
settings, translated by the pure function ``vllm_serve_argv``.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from typing import Annotated, Optional

import typer

from specctl.commands._options import DeviceOpt, DtypeOpt, KernelsOpt, ModelOpt, use_kernels

HELP = """Serve a model through an OpenAI-compatible API with speculative decoding.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream with "stream": true), GET /v1/models, GET /health, GET /metrics (Prometheus text under vLLM's names: vllm:spec_decode_num_drafts, ..._num_draft_tokens, ..._num_accepted_tokens, ..._num_accepted_tokens_per_pos). Each response carries a "spec_decode" field with its acceptance rate and mean acceptance length.

Concurrency: continuous batching. Up to --max-num-seqs requests decode together, each in its own preallocated KV cache: every step, each drafts and one target forward verifies them all (a request's output is the same as alone). Prompts are prefilled in chunks of --max-num-batched-tokens tokens riding in those steps, so a long prompt delays the running requests by at most one chunk per step. Further requests wait in a FIFO queue (with --max-waiting N, the N+1st waiting request gets a 429); a client that disconnects frees its slot. With "disable_by_batch_size" in the speculative config, no drafting while that many requests run.

Examples:

  specctl serve --model smollm2-135m --method ngram -k 5

  specctl serve --model ./my-hf-folder --speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' --api-key secret --port 8000

  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'

  specctl serve --engine vllm --model ./my-hf-folder --method ngram   (runs `vllm serve` with the same settings)
"""

ENGINES = ("own", "vllm")
_VLLM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32",
                "fp16": "float16", "float16": "float16", "auto": "auto"}


def vllm_serve_argv(model: str, *, spec: dict | None = None, served_model_name: str | None = None,
                    host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                    max_model_len: int | None = None, max_num_seqs: int | None = None,
                    dtype: str | None = None) -> list[str]:
    """The ``vllm serve`` command line equivalent to a ``specctl serve`` one (pure; no vLLM needed).

    ``spec`` is ``SpecConfig.to_dict()`` (vLLM's own keys), passed as ``--speculative-config``.
    """
    argv = ["vllm", "serve", model, "--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if dtype:
        try:
            argv += ["--dtype", _VLLM_DTYPES[dtype.lower()]]
        except KeyError:
            from specctl.errors import UsageError

            raise UsageError(f"unknown dtype '{dtype}'", "use bfloat16, float16, float32 or auto") from None
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    if api_key:
        argv += ["--api-key", api_key]
    if spec:
        argv += ["--speculative-config", json.dumps(spec, sort_keys=True)]
    return argv


def _spec_config(method: str | None, k: int | None, speculative_config: str | None):
    """SpecConfig from --speculative-config or --method/-k; None for plain decoding."""
    from specctl.config import SpecConfig
    from specctl.errors import UsageError

    if speculative_config is not None and (method is not None or k is not None):
        raise UsageError("--speculative-config and --method/-k were both given",
                         "give the whole configuration in --speculative-config, or use --method and -k alone")
    if speculative_config is not None:
        return SpecConfig.from_json(speculative_config)
    if method is not None:
        return SpecConfig(method=method, num_speculative_tokens=k).validated()
    if k is not None:
        raise UsageError("-k was given without --method", "add e.g. --method ngram")
    return None


def _exec_vllm(model: str | None, spec, served_model_name, host, port, api_key, max_model_len, max_num_seqs,
               dtype: str, device: str, err) -> None:
    import os

    from specctl.errors import ModelError, SpecctlError

    exe = shutil.which("vllm")
    if exe is None:
        raise SpecctlError("--engine vllm needs vLLM, which is not installed here (no `vllm` command on PATH)",
                           "install it (pip install vllm, on Linux with a supported GPU), or drop --engine vllm to "
                           "serve with specctl's own runtime")
    from specctl.models import DEFAULT_MODEL, resolve_model

    name = served_model_name or model or DEFAULT_MODEL
    try:
        path = str(resolve_model(model, dtype=dtype))
    except ModelError:
        if model is None or os.path.exists(model):
            raise
        path = model  # not local and not in the catalogue: let vLLM fetch it (e.g. a Hub id)
        err.log(f"{model} is not a local model: passing it to vLLM as is")
    if device not in ("auto", "cuda"):
        err.log(f"--device {device} is ignored with --engine vllm (vLLM picks its platform itself)")
    argv = vllm_serve_argv(path, spec=spec.to_dict() if spec is not None else None, served_model_name=name,
                           host=host, port=port, api_key=api_key, max_model_len=max_model_len,
                           max_num_seqs=max_num_seqs, dtype=dtype)
    shown = ["***" if i > 0 and argv[i - 1] == "--api-key" else a for i, a in enumerate(argv)]
    err.log("exec: " + " ".join(shown))
    sys.stderr.flush()
    os.execv(exe, argv)


def serve(
    model: ModelOpt = None,
    speculative_config: Annotated[Optional[str], typer.Option("--speculative-config", help="vLLM's --speculative-config JSON (keys unchanged), e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5}'.")] = None,
    method: Annotated[Optional[str], typer.Option("--method", help="Draft method (e.g. ngram). Without it or --speculative-config: plain decoding.")] = None,
    num_speculative_tokens: Annotated[Optional[int], typer.Option("--num-speculative-tokens", "-k", help="Draft tokens per step (k) for --method; method default when unset.")] = None,
    fixed_k: Annotated[bool, typer.Option("--fixed-k", help="Always draft k tokens (default: adapt the draft length per request to what pays).")] = False,
    compile: Annotated[bool, typer.Option("--compile", help="Run one-token decode steps through torch.compile (float32, or a GPU with CUDA graphs; bf16 on CPU already runs a fused C++ step).")] = False,
    host: Annotated[str, typer.Option("--host", help="Address to listen on (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free port, printed at start).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="SPECCTL_API_KEY", help="Require 'Authorization: Bearer KEY' on every /v1 request (or set SPECCTL_API_KEY).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", help="Longest prompt + completion, in tokens. Default: the model's, capped at 4096.")] = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="Requests decoded at once (preallocated KV caches); more wait in a FIFO queue.")] = 8,
    max_num_batched_tokens: Annotated[int, typer.Option("--max-num-batched-tokens", help="Prompt tokens one engine step may carry (chunked prefill: a long prompt delays running requests by at most one chunk per step).")] = 256,
    max_waiting: Annotated[Optional[int], typer.Option("--max-waiting", help="Requests that may wait for a slot; beyond, new requests get HTTP 429. Default: no limit.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option("--served-model-name", help="Model name clients send. Default: the --model value.")] = None,
    dtype: DtypeOpt = "bfloat16",
    device: DeviceOpt = "auto",
    kernels: KernelsOpt = "auto",
    engine: Annotated[str, typer.Option("--engine", help="own (specctl's runtime) or vllm (exec `vllm serve` with the same settings).")] = "own",
) -> None:
    from rich.console import Console

    from specctl.errors import UsageError

    err = Console(stderr=True)
    if engine not in ENGINES:
        raise UsageError(f"unknown engine '{engine}'", f"use one of: {', '.join(ENGINES)}")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is out of range", "use a port in 0..65535")
    if max_num_batched_tokens < 1:
        raise UsageError(f"--max-num-batched-tokens must be >= 1, got {max_num_batched_tokens}",
                         "pass e.g. --max-num-batched-tokens 256")
    if max_waiting is not None and max_waiting < 0:
        raise UsageError(f"--max-waiting must be >= 0, got {max_waiting}", "pass e.g. --max-waiting 64")
    spec = _spec_config(method, num_speculative_tokens, speculative_config)
    if engine == "vllm" and spec is not None and spec.method == "hybrid":
        raise UsageError("'hybrid' is specctl's own method: vLLM runs one proposer at a time",
                         "pass vLLM one of its parts' configs, or serve the hybrid with --engine own")
    if engine == "vllm":
        _exec_vllm(model, spec, served_model_name, host, port, api_key, max_model_len, max_num_seqs, dtype, device, err)
        return

    import socket

    import uvicorn

    from specctl.models import DEFAULT_MODEL, resolve_model
    from specctl.runtime.runner import load_model
    from specctl.runtime.server import Engine, create_app, resolve_max_model_len

    use_kernels(kernels)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s", stream=sys.stderr)
    log = logging.getLogger("specctl.serve")
    name = served_model_name or model or DEFAULT_MODEL
    path = resolve_model(model, dtype=dtype)
    log.info("loading %s (%s, %s)", path, dtype, device)
    loaded = load_model(path, dtype=dtype, device=device)
    max_len = resolve_max_model_len(loaded, max_model_len)
    eng = Engine(loaded, spec, max_len, max_num_seqs, adaptive=not fixed_k, compile=compile,
                 max_num_batched_tokens=max_num_batched_tokens, max_waiting=max_waiting)
    log.info("speculation: %s; max model len %d; %d slots (KV cache pool %.0f MiB)",
             json.dumps(spec.to_dict()) if spec else "off (plain decoding; add --method ngram to speculate)",
             max_len, max_num_seqs, eng.kv_cache_bytes() / 2**20)
    try:
        sock = socket.create_server((host, port))
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port} ({e.strerror})",
                         "pick another --port (0 takes any free one) or stop what holds it") from None
    bound = sock.getsockname()[1]
    app = create_app(eng, [name], api_key)
    log.info("serving '%s' on http://%s:%d/v1%s", name, host, bound, " (API key required)" if api_key else "")
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=3, log_config=None)
    uvicorn.Server(config).run(sockets=[sock])


def register(app: typer.Typer) -> None:
    app.command("serve", help=HELP)(serve)
