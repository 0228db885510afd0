"""An OpenAI-compatible HTTP server over the own speculative runtime (``specctl serve``).

Two threads, one owner each:

* **Engine** (``specctl.runtime.engine``, one background thread, the only one that touches torch):
  a pool of ``max_num_seqs`` KV caches allocated once, one SpecDecoder and its proposer, and the
  continuous-batching scheduler: each round admits waiting requests in FIFO order into free slots
  (prefill in chunks of ``max_num_batched_tokens``), then every running request drafts and one target
  forward verifies them all. A full pool queues requests or answers 429, as configured.
* **HTTP** (FastAPI on uvicorn's event loop): validation (``specctl.runtime.openai_api``), the chat
  template (``specctl.chat``), incremental detokenization, stop strings, server-sent events, errors,
  ``/metrics``. It never calls torch. Tokens reach a handler through its request's asyncio queue
  (``call_soon_threadsafe``); a handler stops a request (client gone, stop string) with
  ``engine.abort``, and the slot is free for the next request one round later.

Responses carry an extra ``spec_decode`` field: the request's SpecStats (acceptance rate, mean
acceptance length, per-position counts). ``/metrics`` serves the same counters summed over requests,
under vLLM's Prometheus names.

What it does not know: how a step drafts and verifies (SpecDecoder, proposers), how models load.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from specctl.chat import render as render_messages
from specctl.errors import UsageError
from specctl.runtime.decoder import SamplingParams
from specctl.runtime.engine import Engine, EngineRequest, QueueFull
from specctl.runtime.metrics import SpecStats
from specctl.runtime.openai_api import (ApiError, ChatMessage, ChatRequest, CompletionRequest, SamplingFields, TextStream,
                                        parse_body, usage_of)
from specctl.runtime.loading import LoadedModel

log = logging.getLogger("specctl.serve")

DEFAULT_MAX_MODEL_LEN = 4096  # cap on the default: every pool slot preallocates this many positions
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's legacy API, vLLM)
RETRY_AFTER_S = 1  # the 429's Retry-After
# the chat roles OpenAI's API takes -> the role the chat template gets ("developer" is OpenAI's newer "system")
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def resolve_max_model_len(loaded: LoadedModel, requested: int | None) -> int:
    """--max-model-len: the model's max_position_embeddings, capped at 4096 when not given."""
    model_max = int(loaded.model.args.max_position_embeddings)
    if requested is None:
        return min(model_max, DEFAULT_MAX_MODEL_LEN)
    if requested < 2:
        raise UsageError(f"--max-model-len must be >= 2, got {requested}", "pass e.g. --max-model-len 2048")
    if requested > model_max:
        raise UsageError(f"--max-model-len {requested} exceeds the model's max_position_embeddings ({model_max})",
                         f"pass --max-model-len {model_max} or less")
    return requested


class _Ctx:
    """What the handlers need: the engine, its tokenizer, names, limits."""

    def __init__(self, engine: Engine, names: list[str], api_key: str | None):
        self.engine, self.names, self.api_key = engine, names, api_key
        self.tok = engine.loaded.tokenizer
        self.vocab = engine.loaded.model.args.vocab_size
        self.created = int(time.time())

    def check_model(self, name: str | None) -> str:
        if name is None:
            return self.names[0]
        if name not in self.names:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves: "
                           + ", ".join(f"'{n}'" for n in self.names), code="model_not_found", param="model")
        return name

    def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise ApiError(400, f"a list of {len(prompt)} prompts was sent; this server takes one prompt per "
                               "request", code="unsupported_parameter", param="prompt")
            prompt = prompt[0]
        ids = [int(t) for t in self.tok.encode(prompt)] if isinstance(prompt, str) else list(prompt)
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})", param="prompt")
        return ids

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        msgs = []
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise ApiError(400, f"invalid 'messages[{i}].role': {m.role!r} is not a role this server knows; use one "
                               f"of {', '.join(CHAT_ROLES)}", code="invalid_value", param=f"messages[{i}].role")
            content = m.content
            extra = m.model_extra or {}
            calls = extra.get("tool_calls") or extra.get("function_call")
            if content is None and not (m.role == "assistant" and calls):  # as OpenAI: only a tool call goes without
                why = " (an assistant message may leave it out only with tool_calls)" if m.role == "assistant" else ""
                raise ApiError(400, f"missing required parameter 'messages[{i}].content'{why}",
                               code="missing_required_parameter", param=f"messages[{i}].content")
            if isinstance(content, list):
                parts = []
                for p in content:
                    if p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise ApiError(400, f"messages[{i}]: only text content parts are supported, got "
                                       f"type {p.get('type')!r}", param="messages")
                    parts.append(p["text"])
                content = "\n".join(parts)
            msgs.append({"role": CHAT_ROLES[m.role], "content": content or ""})
        try:
            return render_messages(self.tok, msgs)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages (role order, ...)
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None

    def sampling(self, body: SamplingFields, prompt_ids: list[int], max_tokens: int | None) -> SamplingParams:
        P, L = len(prompt_ids), self.engine.max_model_len
        if P == 0:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if max_tokens is None:
            max_tokens = L - P
        if P + max_tokens > L or max_tokens < 1:
            raise ApiError(400, f"this model's maximum context length is {L} tokens, but {P + max(max_tokens, 1)} "
                           f"were requested ({P} in the prompt, {max(max_tokens, 1)} for the completion); reduce the "
                           "prompt or max_tokens", code="context_length_exceeded", param="max_tokens")
        extra = list(body.stop_token_ids or [])
        bad = [t for t in extra if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {self.vocab})",
                           param="stop_token_ids")
        # ignore_eos ignores the model's own stop tokens (EOS), not the request's stop_token_ids (as vLLM)
        own = () if body.ignore_eos else tuple(self.engine.loaded.stop_token_ids)
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=body.top_k if body.top_k and body.top_k > 0 else None,
            top_p=body.top_p if body.top_p is not None and body.top_p < 1.0 else None,
            stop_token_ids=tuple(dict.fromkeys(own + tuple(extra))),
        )

    def spec_field(self, stats: SpecStats) -> dict:
        spec = self.engine.spec
        d = stats.to_dict()
        # one entry per draft position, always (a request whose drafts were short or absent has zeros there)
        for key, zero in (("num_accepted_tokens_per_pos", 0), ("acceptance_rate_per_pos", 0.0)):
            v = list(d.get(key) or [])
            d[key] = v + [zero] * (self.engine.k - len(v))
        return {"method": spec.method if spec else None, "num_speculative_tokens": self.engine.k, **d}


# =========================================================================== app


def create_app(engine: Engine, served_model_names: list[str], api_key: str | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops ``engine``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="specctl serve", lifespan=lifespan)
    ctx = _Ctx(engine, list(served_model_names), api_key)
    app.state.ctx = ctx

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                        "invalid_request_error").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error")
        return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}", "internal_server_error").response()

    async def check_key(request: Request) -> None:
        if ctx.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer ") or not auth[7:].strip():
            raise ApiError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           "authentication_error", "invalid_api_key")
        if not secrets.compare_digest(auth[7:].strip().encode(), ctx.api_key.encode()):
            raise ApiError(401, "invalid API key", "authentication_error", "invalid_api_key")

    @app.get("/health")
    async def health():
        if not engine.alive:
            return ApiError(503, f"the engine is not running ({engine.failure or 'stopped'})", "server_error").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine, ctx.names[0]), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": ctx.created, "owned_by": "specctl", "root": str(engine.loaded.path),
             "max_model_len": engine.max_model_len} for n in ctx.names]}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(request: Request):
        body = parse_body(await request.body(), CompletionRequest)
        name = ctx.check_model(body.model)
        ids = ctx.completion_prompt(body.prompt)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        return await _serve(request, ctx, body, name, ids, ctx.sampling(body, ids, max_tokens), chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(request: Request):
        body = parse_body(await request.body(), ChatRequest)
        name = ctx.check_model(body.model)
        ids = ctx.chat_prompt(body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await _serve(request, ctx, body, name, ids, ctx.sampling(body, ids, max_tokens), chat=True)

    return app


async def _serve(request: Request, ctx: _Ctx, body: SamplingFields, model: str, ids: list[int],
                 params: SamplingParams, chat: bool):
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    req = EngineRequest(ids, params, body.seed, asyncio.get_running_loop(), rid)
    out = TextStream(ctx.tok, stop, include_stop=bool(body.include_stop_str_in_output),
                     skip_special=body.skip_special_tokens is not False)
    try:
        ctx.engine.submit(req)
    except QueueFull as e:
        raise ApiError(429, f"{e}; retry later", "rate_limit_error", "too_many_requests",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except RuntimeError as e:
        raise ApiError(503, str(e), "server_error") from None
    events = _events(request, ctx.engine, req, out)
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model}
    if body.stream:
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        every_chunk = include_usage and bool(opts.continuous_usage_stats)
        return _SSEResponse(_sse(ctx, events, head, chat, out, len(ids), include_usage, every_chunk),
                            lambda: ctx.engine.abort(req))
    text, finish, stats = [], None, SpecStats()
    async for delta, finish, stats in events:
        text.append(delta)
    usage = usage_of(len(ids), out.n_tokens)
    choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(text)}} if chat
              else {"index": 0, "text": "".join(text)})
    choice.update({"logprobs": None, "finish_reason": finish})
    return {**head, "choices": [choice], "usage": usage, "spec_decode": ctx.spec_field(stats)}


async def _events(request: Request, engine: Engine, req: EngineRequest, out: TextStream):
    """Yields (text delta, finish_reason | None, stats) until the request ends; aborts it on exit."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, engine, req))
    try:
        while True:
            ev = await req.queue.get()
            if ev.error is not None:
                raise ApiError(500, f"generation failed: {ev.error}", "internal_server_error")
            if ev.finish is None:
                out.add(ev.tokens)
            else:  # the last tokens: a stop token that ended the request leaves its text out
                out.add_last(ev.tokens, req.params.stop_token_ids if ev.finish == "stop" else ())
            if out.stopped:
                engine.abort(req, "stop")
            finish = "stop" if out.stopped else ev.finish
            if finish is not None:
                yield out.take(final=True), finish, ev.stats
                return
            delta = out.take()
            if delta:
                yield delta, None, ev.stats
    finally:
        watcher.cancel()
        engine.abort(req)  # no-op when it already ended


async def _abort_on_disconnect(request: Request, engine: Engine, req: EngineRequest) -> None:
    """Wait for the client to go (the body is already read, so the next message is a disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            engine.abort(req)
            return


async def _sse(ctx: _Ctx, events, head: dict, chat: bool, out: TextStream, n_prompt: int, include_usage: bool,
               every_chunk: bool = False):
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(delta: str | None, finish: str | None, role: bool = False) -> dict:
        if chat:
            d = ({"role": "assistant", "content": ""} if role else {"content": delta} if delta else {})
            c = {**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}
        else:
            c = {**head, "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]}
        if every_chunk:  # stream_options.continuous_usage_stats: the counts so far
            c["usage"] = usage_of(n_prompt, out.n_tokens)
        return c

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    try:
        if chat:
            yield sse(chunk(None, None, role=True))
        async for delta, finish, stats in events:
            if finish is None:
                yield sse(chunk(delta, None))
                continue
            yield sse({**chunk(delta, finish), "spec_decode": ctx.spec_field(stats)})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_of(n_prompt, out.n_tokens)})
    except ApiError as e:
        yield sse(e.body())
    finally:
        await events.aclose()  # runs its cleanup now, not whenever it is garbage-collected
    yield "data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """Server-sent events; whatever ends the response (done, client gone, error) runs ``on_close``."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except OSError:  # the client went away mid-send
            pass
        finally:
            self._on_close()
            await self.body_iterator.aclose()


# =========================================================================== /metrics


def render_metrics(engine: Engine, model_name: str) -> str:
    """Prometheus text (format 0.0.4) with vLLM's metric names and labels.

    Counters are engine-side and advance every step. They equal the sums of the responses' usage and
    ``spec_decode`` fields, except after a stop string: the engine may have run one step past it
    (those tokens are dropped from the response but were generated, and are counted here).
    """
    esc = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    labels = f'engine="0",model_name="{esc}"'
    m = engine.metrics
    with m.lock:
        spec = m.spec.copy()
        prompt, gen, finished = m.prompt_tokens, m.generation_tokens, dict(m.finished)
        parts = {name: s.copy() for name, s in m.by_proposer.items()}
        hists = [(name, doc, h.cumulative(), h.sum) for name, doc, h in (
            ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", m.ttft),
            ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", m.itl))]
    lines: list[str] = []

    def family(name: str, kind: str, doc: str, samples: list[tuple[str, float]]) -> None:
        full = f"{name}_total" if kind == "counter" else name
        lines.extend([f"# HELP {full} {doc}", f"# TYPE {full} {kind}"])
        lines.extend(f"{full}{{{labels}{extra}}} {float(v)}" for extra, v in samples)

    family("vllm:num_requests_running", "gauge", "Number of requests in the engine's slots.",
           [("", engine.num_running)])
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting for a slot.", [("", engine.num_waiting)])
    family("vllm:kv_cache_usage_perc", "gauge", "Fraction of the KV-cache pool's slots in use (1 = 100%).",
           [("", engine.num_running / engine.max_num_seqs)])
    family("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", [("", prompt)])
    family("vllm:generation_tokens", "counter", "Number of generation tokens processed.", [("", gen)])
    family("vllm:request_success", "counter", "Count of finished requests, by finish reason.",
           [(f',finished_reason="{r}"', finished.get(r, 0)) for r in sorted({"stop", "length", "abort"} | set(finished))])
    for name, doc, buckets, total in hists:
        lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} histogram"])
        lines.extend(f'{name}_bucket{{{labels},le="{le}"}} {float(c)}' for le, c in buckets)
        lines.append(f"{name}_sum{{{labels}}} {float(total)}")
        lines.append(f"{name}_count{{{labels}}} {float(buckets[-1][1])}")
    if engine.spec is not None:
        counts = (("num_drafts", "Number of spec decoding drafts"), ("num_draft_tokens", "Number of draft tokens"),
                  ("num_accepted_tokens", "Number of accepted tokens"))
        for key, doc in counts:
            family(f"vllm:spec_decode_{key}", "counter", f"{doc}.", [("", getattr(spec, key))])
        per_pos = spec.num_accepted_tokens_per_pos + [0] * max(0, engine.k - len(spec.num_accepted_tokens_per_pos))
        family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted tokens per draft position.",
               [(f',position="{i}"', c) for i, c in enumerate(per_pos)])
        if parts:  # a hybrid's parts, by proposer, under specctl's own names (vLLM's add up to the totals as is)
            by = [(f',proposer="{n}"', s) for n, s in sorted(parts.items())]
            for key, doc in counts:
                family(f"specctl:spec_decode_{key}_by_proposer", "counter", f"{doc}, by a hybrid's proposer.",
                       [(lab, getattr(s, key)) for lab, s in by])
    return "\n".join(lines) + "\n"
