"""The OpenAI-compatible server, live on a loopback port, driven by the official ``openai`` client.

A tiny fp32 llama whose greedy output loops (so ngram drafts get accepted) is served with ngram
speculation by uvicorn in a background thread. Invariants: every greedy response (completions and
chat, streaming and not, alone or among 16 concurrent streams) equals the runtime's own
``SpecDecoder.generate`` output token for token, with the same speculative statistics; /metrics
counters are the sums of the responses' statistics; bad requests get 4xx OpenAI-style JSON errors
and the server keeps serving; a client that disconnects mid-stream frees its slot.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from specctl import chat
from specctl.config import SpecConfig
from specctl.runtime.decoder import SamplingParams, SpecDecoder
from specctl.runtime.engine import Engine
from specctl.runtime.proposers import build_proposer
from specctl.runtime.loading import load_model
from specctl.runtime.runner import TargetRunner
from specctl.runtime.openai_api import TextStream
from specctl.runtime.server import create_app

MAX_LEN = 192
NEW = 24
NAME = "tiny-loopy"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [f"{w} {w} {w}" for w in ("abc", "hello", "x=1;y=2;", "the cat", "0123456", "ABAB", "foo(bar)",
                                    "qwerty", "zz top", "mn op", "if a:", "[1, 2]", "rust", "spec", "kv$", "ok!")]


class LiveServer:
    """uvicorn serving ``create_app(engine)`` in a background thread on a free loopback port."""

    def __init__(self, engine: Engine, api_key: str | None = None):
        self.engine = engine
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(engine, [NAME], api_key), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def client(self, api_key: str = "none", cls=openai.OpenAI):
        return cls(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, parsed JSON or text) of a plain HTTP request."""
        req = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                status, data = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, data = e.code, e.read()
        try:
            return status, json.loads(data)
        except json.JSONDecodeError:
            return status, data.decode()

    def metrics(self) -> dict[tuple[str, str], float]:
        status, text = self.raw("GET", "/metrics")
        assert status == 200
        out = {}
        for line in text.splitlines():
            m = re.fullmatch(r"(\S+?)\{([^}]*)\} (\S+)", line)
            if m:
                extra = ",".join(kv for kv in m.group(2).split(",") if not kv.startswith(("engine=", "model_name=")))
                out[(m.group(1), extra)] = float(m.group(3))
        return out


@pytest.fixture(scope="module")
def loaded(tiny_model_factory):
    """A tiny llama whose greedy output falls into loops (small init), so ngram drafts are accepted."""
    return load_model(tiny_model_factory(seed=1, initializer_range=0.05), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(Engine(loaded, SpecConfig.from_dict(dict(SPEC)), MAX_LEN, max_num_seqs=4, adaptive=False)) as s:
        yield s


@pytest.fixture(scope="module")
def reference(loaded):
    """reference(prompt_ids, max_new) -> GenerationResult of the runtime itself (same config, one request)."""
    cfg = SpecConfig.from_dict(dict(SPEC))
    runner = TargetRunner(loaded.model, MAX_LEN)
    dec = SpecDecoder(runner, build_proposer(cfg, MAX_LEN, target=loaded), cfg.num_speculative_tokens)
    cache = {}

    def ref(ids: list[int], max_new: int = NEW):
        key = (tuple(ids), max_new)
        if key not in cache:
            cache[key] = dec.generate(ids, SamplingParams(max_new_tokens=max_new, stop_token_ids=loaded.stop_token_ids))
        return cache[key]

    return ref


def completion_ids(loaded, prompt: str) -> list[int]:
    return [int(t) for t in loaded.tokenizer.encode(prompt)]


def chat_ids(loaded, content: str) -> list[int]:
    return chat.render(loaded.tokenizer, [{"role": "user", "content": content}])


def text_of(loaded, ids: list[int]) -> str:
    return loaded.tokenizer.decode(ids, skip_special_tokens=True)


def spec_counts(d) -> tuple:
    d = dict(d)
    return d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"], d["num_accepted_tokens_per_pos"]


def ref_counts(res) -> tuple:
    """The runtime's counts as the server reports them: the per-position list has one entry per draft
    position (k of them) whatever this request's drafts reached."""
    s, k = res.stats, SPEC["num_speculative_tokens"]
    per_pos = s.num_accepted_tokens_per_pos + [0] * (k - len(s.num_accepted_tokens_per_pos))
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, per_pos


# --------------------------------------------------------------------------- basics


def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert server.raw("GET", "/health")[0] == 200


def test_completions_greedy_equal_the_runtime(server, loaded, reference):
    client = server.client()
    accepted = 0
    for prompt in PROMPTS[:4]:
        ref = reference(completion_ids(loaded, prompt))
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)
        assert r.choices[0].text == text_of(loaded, ref.token_ids)
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert r.usage.prompt_tokens == len(completion_ids(loaded, prompt))
        spec = r.model_extra["spec_decode"]
        assert spec["method"] == "ngram" and spec_counts(spec) == ref_counts(ref)
        assert spec["mean_acceptance_length"] == pytest.approx(ref.stats.mean_acceptance_length)
        accepted += spec["num_accepted_tokens"]
        # the same, streamed
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
        assert chunks[-1].choices[0].finish_reason == ref.finish_reason
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
        assert spec_counts(chunks[-1].model_extra["spec_decode"]) == ref_counts(ref)
    assert accepted > 0  # speculation really happened


def test_chat_greedy_equals_the_runtime_streaming_and_not(server, loaded, reference):
    client = server.client()
    for content in PROMPTS[4:7]:
        ref = reference(chat_ids(loaded, content))
        expected = text_of(loaded, ref.token_ids)
        msgs = [{"role": "user", "content": content}]
        r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=NEW, temperature=0)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == expected
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.completion_tokens == len(ref.token_ids)
        assert spec_counts(r.model_extra["spec_decode"]) == ref_counts(ref)
        stream = client.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=NEW, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(final) == 1 and final[0].choices[0].finish_reason == ref.finish_reason
        assert spec_counts(final[0].model_extra["spec_decode"]) == ref_counts(ref)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_strings_cut_the_text(server, loaded, reference):
    client = server.client()
    ref_text = text_of(loaded, reference(completion_ids(loaded, PROMPTS[0])).token_ids)
    stop = ref_text[6:9]
    expected = ref_text[:ref_text.index(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stop=[stop, "\x00"])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    # the tokens counted are those up to the one completing the stop string
    assert text_of(loaded, reference(completion_ids(loaded, PROMPTS[0])).token_ids[:r.usage.completion_tokens]) \
        .startswith(expected + stop)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_vllm_stop_token_ids_and_include_stop_str_in_output(server, loaded, reference):
    """vLLM's stop_token_ids end a request at the first such token (counted, its text left out unless
    include_stop_str_in_output, which also keeps a stop string); completions default to 16 tokens."""
    client = server.client()
    ids = completion_ids(loaded, PROMPTS[0])
    ref = reference(ids).token_ids
    t = ref[5]
    first = ref.index(t)
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=NEW, temperature=0)
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [t]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    assert r.choices[0].text == text_of(loaded, ref[:first])
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [t], "include_stop_str_in_output": True})
    assert r.choices[0].text == text_of(loaded, ref[:first + 1])
    chunks = list(client.completions.create(**kw, stream=True, extra_body={"stop_token_ids": [t]}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_of(loaded, ref[:first])
    # ignore_eos ignores the model's EOS, not the request's own stop tokens
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [t], "ignore_eos": True})
    assert r.usage.completion_tokens == first + 1
    ref_text = text_of(loaded, ref)
    stop = ref_text[6:9]
    r = client.completions.create(**kw, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == ref_text[:ref_text.index(stop) + len(stop)]
    # no max_tokens on /v1/completions: 16, as OpenAI's legacy API and vLLM (it ran to the max model length)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], temperature=0)
    assert r.usage.completion_tokens == len(reference(ids, 16).token_ids) <= 16


def test_continuous_usage_stats_count_every_chunk(server):
    chunks = list(server.client().completions.create(
        model=NAME, prompt=PROMPTS[2], max_tokens=NEW, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens > 0
    assert all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)
    status, body = server.raw("POST", "/v1/completions", json.dumps(
        {"model": NAME, "prompt": "ab", "max_tokens": 2, "stream_options": {"include_usage": True}}).encode())
    assert status == 400 and body["error"]["param"] == "stream_options"  # as vLLM: only with stream


def test_an_unknown_chat_role_is_a_400_naming_the_parameter_and_the_roles(server):
    status, body = server.raw("POST", "/v1/chat/completions", json.dumps(
        {"model": NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"},
                                                      {"role": "wizard", "content": "abracadabra"}]}).encode())
    assert status == 400 and body["error"]["param"] == "messages[1].role"
    assert "wizard" in body["error"]["message"] and all(r in body["error"]["message"] for r in ("system", "user", "assistant"))
    status, body = server.raw("POST", "/v1/chat/completions", json.dumps(  # OpenAI's newer name for system
        {"model": NAME, "max_tokens": 2, "messages": [{"role": "developer", "content": "be brief"},
                                                      {"role": "user", "content": "hi"}]}).encode())
    assert status == 200, body


def test_a_message_without_content_is_a_400_naming_the_parameter(server):
    """It was answered 200 (the content read as ""); OpenAI's API answers 400. Only an assistant message that
    calls a tool may leave its content out."""
    def post(*messages):
        return server.raw("POST", "/v1/chat/completions", json.dumps(
            {"model": NAME, "max_tokens": 2, "messages": list(messages)}).encode())

    status, body = post({"role": "user"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert body["error"]["param"] == "messages[0].content" and "messages[0].content" in body["error"]["message"]
    for role in ("system", "developer", "tool", "assistant"):
        status, body = post({"role": "user", "content": "hi"}, {"role": role}, {"role": "user", "content": "and?"})
        assert status == 400 and body["error"]["param"] == "messages[1].content", (role, body)
    status, body = post({"role": "user", "content": "hi"}, {"role": "user", "content": None})
    assert status == 400 and body["error"]["param"] == "messages[1].content", body
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    status, body = post({"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "42"})
    assert status == 200, body
    status, body = post({"role": "user", "content": ""})  # present but empty: as before
    assert status == 200, body


def test_seeded_sampling_is_reproducible(server):
    client = server.client()
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=NEW, temperature=0.9, top_p=0.95, seed=1234)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    texts = {client.completions.create(**{**kw, "seed": s}).choices[0].text for s in range(4)}
    assert len(texts) > 1  # the seed matters


def test_text_stream_holds_back_incomplete_characters_and_stop_prefixes(loaded):
    class Bytes:  # a byte-level tokenizer: each id is one UTF-8 byte
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    s = TextStream(Bytes(), ["END"])
    out = []
    for b in "héllo wörld EN".encode():
        s.add([b])
        out.append(s.take())
    assert "".join(out) == "héllo wörld "  # "EN" could start "END": held back
    assert "\ufffd" not in "".join(out)
    s.add(list(b"D and more"))
    assert s.stopped and s.take() == "" and bytes(s.ids).decode() == "héllo wörld END"


def test_text_stream_special_tokens_and_a_final_stop_token(loaded):
    tok = loaded.tokenizer
    eos = loaded.stop_token_ids[0]
    word = [int(t) for t in tok.encode("hello")]
    for skip, include in ((True, False), (False, False), (False, True)):
        s = TextStream(tok, [], include_stop=include, skip_special=skip)
        s.add([eos] + word)
        s.add_last(word + [eos], {eos})  # the request ended on its stop token
        text = s.take(final=True)
        special = tok.decode([eos], skip_special_tokens=False)
        assert text.count(special) == (0 if skip else 1 + include), (skip, include, text)
        assert s.n_tokens == 2 + 2 * len(word)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_methods_serve_plain_greedy_output(loaded, method):
    """Concurrent greedy requests through each draft method that needs no draft model give the
    plain (no speculation) greedy output; prompts whose greedy path has a near tie are skipped."""
    plain = SpecDecoder(TargetRunner(loaded.model, MAX_LEN))
    cases = []
    for p in PROMPTS[:8]:
        ids = chat_ids(loaded, p)
        res = plain.generate(ids, SamplingParams(max_new_tokens=NEW, stop_token_ids=loaded.stop_token_ids,
                                                 record_margins=True))
        if min(res.margins) >= 1e-4:
            cases.append((p, text_of(loaded, res.token_ids)))
    assert len(cases) >= 4
    with LiveServer(Engine(loaded, SpecConfig.from_dict({"method": method, "num_speculative_tokens": 4}),
                           MAX_LEN, max_num_seqs=3)) as s:
        async def main():
            client = s.client(cls=openai.AsyncOpenAI)
            rs = await asyncio.gather(*(client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": p}], max_tokens=NEW, temperature=0)
                for p, _ in cases))
            await client.close()
            return rs

        responses = asyncio.run(main())
    for (_, expected), r in zip(cases, responses):
        assert r.choices[0].message.content == expected
        assert r.model_extra["spec_decode"]["method"] == method
    assert sum(r.model_extra["spec_decode"]["num_accepted_tokens"] for r in responses) > 0


# --------------------------------------------------------------------------- errors


def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(server):
    client = server.client()
    ok = dict(model=NAME, prompt="abc abc", max_tokens=4, temperature=0)

    status, body = server.raw("POST", "/v1/completions", b'{"model": "tiny-loopy", "prompt": "ab",')
    assert status == 400 and "malformed JSON" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error" and "code" in body["error"]
    status, body = server.raw("POST", "/v1/chat/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(**{**ok, "model": "gpt-17"})
    assert "gpt-17" in e.value.message and NAME in e.value.message
    assert e.value.body["code"] == "model_not_found"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**ok, "max_tokens": MAX_LEN})
    assert "maximum context length is 192" in e.value.message and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x" * MAX_LEN}])
    assert "maximum context length" in e.value.message

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**ok, "n": 2})
    assert "n=2 is not supported" in e.value.message and e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**ok, "temperature": 5})
    assert "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[])
    assert "messages" in e.value.message
    for extra in ({"logprobs": 2}, {"logprobs": 0}, {"prompt_logprobs": 1}):  # 0: the sampled token's, in vLLM
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**ok, extra_body=extra)
        assert "logprobs" in e.value.message
    for extra, needle in (({"min_tokens": 8}, "min_tokens"), ({"repetition_penalty": 1.3}, "repetition_penalty"),
                          ({"use_beam_search": True}, "beam search"), ({"add_generation_prompt": False}, "add_generation")):
        with pytest.raises(openai.BadRequestError) as e:  # vLLM's extensions: refused, not silently ignored
            client.completions.create(**ok, extra_body=extra)
        assert needle in e.value.message and e.value.body["code"] == "unsupported_parameter"
    for seed in (2**64, -(2**63) - 1):  # out of what a generator takes: once stopped the engine for good
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**ok, "temperature": 1.0, "seed": seed})
        assert "seed" in e.value.message

    status, body = server.raw("GET", "/v1/nothing-here")
    assert status == 404 and body["error"]["message"]

    # still serving, and correctly
    assert client.completions.create(**ok).choices[0].finish_reason in ("stop", "length")
    assert server.raw("GET", "/health")[0] == 200


class SlowEngine(Engine):
    """10 ms per step, so that a client can leave while its request is still running."""

    def _setup(self):
        super()._setup()
        step = self._sched.step
        self._sched.step = lambda: (time.sleep(0.01), step())[1]


def test_a_waiting_request_aborted_ends_through_the_scheduler(loaded):
    """One waiting queue (the scheduler's): a request aborted while it waits for the one slot ends with
    "abort" at the scheduler's next step, the running one is not disturbed, and nothing is left waiting."""
    import asyncio

    from specctl.runtime.decoder import SamplingParams
    from specctl.runtime.engine import EngineRequest

    engine = SlowEngine(loaded, None, MAX_LEN, max_num_seqs=1, adaptive=False)
    engine.start()

    async def run():
        loop = asyncio.get_running_loop()
        first = EngineRequest([5, 6, 7], SamplingParams(max_new_tokens=30, ignore_eos=True), None, loop)
        second = EngineRequest([5, 6, 8], SamplingParams(max_new_tokens=30, ignore_eos=True), None, loop)
        engine.submit(first)
        engine.submit(second)
        assert engine.num_waiting >= 1
        engine.abort(second)
        ev = await asyncio.wait_for(second.queue.get(), 10)
        assert ev.finish == "abort" and not ev.tokens
        n = 0
        while True:
            ev = await asyncio.wait_for(first.queue.get(), 10)
            n += len(ev.tokens)
            if ev.finish is not None:
                return ev.finish, n

    try:
        assert asyncio.run(run()) == ("length", 30)
        assert engine.num_waiting == 0
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def keyed_server(loaded):
    """A second server: API key required, one slot (so a leaked slot would block the next request)."""
    engine = SlowEngine(loaded, SpecConfig.from_dict(dict(SPEC)), MAX_LEN, max_num_seqs=1, adaptive=False)
    with LiveServer(engine, api_key="s3cret") as s:
        yield s


def test_api_key(keyed_server):
    with pytest.raises(openai.AuthenticationError) as e:
        keyed_server.client("wrong").completions.create(model=NAME, prompt="ab", max_tokens=2)
    assert e.value.status_code == 401 and "invalid API key" in e.value.message
    status, body = keyed_server.raw("GET", "/v1/models")
    assert status == 401 and "missing API key" in body["error"]["message"]
    assert keyed_server.raw("GET", "/health")[0] == 200  # health and metrics stay open, as in vLLM
    r = keyed_server.client("s3cret").completions.create(model=NAME, prompt="ab ab", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def open_long_stream(server):
    """A streamed greedy completion that runs to near the context's end, its first chunk read."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"model": NAME, "prompt": "abc abc", "max_tokens": MAX_LEN - 20, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json", "Authorization": "Bearer s3cret"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    return conn, resp, body


def test_shutting_down_ends_open_streams_whole(keyed_server):
    """What `specctl serve` does on Ctrl-C (Engine.abort_all from its uvicorn handle_exit): a stream still
    running gets its last chunk (finish_reason "abort") and [DONE], rather than being cut by the cancel."""
    conn, resp, body = open_long_stream(keyed_server)
    assert keyed_server.engine.abort_all() == 1
    rest = resp.read().decode()
    conn.close()
    events = [ln[6:] for ln in rest.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert keyed_server.engine.abort_all() == 0  # nothing left open; the server still serves
    r = keyed_server.client("s3cret").completions.create(model=NAME, prompt="xy xy", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


def test_disconnect_mid_stream_frees_the_slot(keyed_server):
    before = keyed_server.metrics()
    conn, resp, body = open_long_stream(keyed_server)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 20
    while keyed_server.metrics()[("vllm:request_success_total", 'finished_reason="abort"')] \
            == before[("vllm:request_success_total", 'finished_reason="abort"')]:
        assert time.time() < deadline, "the aborted request was never freed"
        time.sleep(0.05)
    after = keyed_server.metrics()
    assert after[("vllm:num_requests_running", "")] == 0
    assert after[("vllm:generation_tokens_total", "")] - before[("vllm:generation_tokens_total", "")] < MAX_LEN - 20
    # the only slot is free again: a new request completes
    r = keyed_server.client("s3cret").completions.create(model=NAME, prompt="xy xy", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1

    # a non-streaming client that goes away is noticed too (no send fails: the server watches the socket)
    aborted = keyed_server.metrics()[("vllm:request_success_total", 'finished_reason="abort"')]
    conn = http.client.HTTPConnection("127.0.0.1", keyed_server.port, timeout=30)
    conn.request("POST", "/v1/completions", body.replace('"stream": true', '"stream": false'),
                 {"Content-Type": "application/json", "Authorization": "Bearer s3cret"})
    deadline = time.time() + 20
    while keyed_server.metrics()[("vllm:num_requests_running", "")] == 0:  # it is being decoded: go away
        assert time.time() < deadline, "the non-streaming request never started"
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.time() + 20
    while keyed_server.metrics()[("vllm:request_success_total", 'finished_reason="abort"')] == aborted:
        assert time.time() < deadline, "the abandoned non-streaming request was never freed"
        time.sleep(0.05)


# --------------------------------------------------------------------------- concurrency


def test_16_concurrent_streams_x3_rounds(server, loaded, reference):
    """16 streaming clients at once (4 slots, so 12 wait in the queue), 3 rounds: every response is
    complete and equals the single-request output; /metrics moved by exactly the responses' sums."""
    refs = [reference(chat_ids(loaded, p)) for p in PROMPTS]
    before = server.metrics()

    async def one(client, i: int):
        stream = await client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=NEW, temperature=0,
            stream=True, stream_options={"include_usage": True})
        text, finish, spec, usage = [], None, None, None
        async for c in stream:
            if c.choices:
                text.append(c.choices[0].delta.content or "")
                if c.choices[0].finish_reason:
                    finish, spec = c.choices[0].finish_reason, c.model_extra["spec_decode"]
            else:
                usage = c.usage
        return "".join(text), finish, spec, usage

    seen = {"running": 0.0, "waiting": 0.0}

    async def watch_gauges():
        while True:
            m = await asyncio.to_thread(server.metrics)
            seen["running"] = max(seen["running"], m[("vllm:num_requests_running", "")])
            seen["waiting"] = max(seen["waiting"], m[("vllm:num_requests_waiting", "")])
            await asyncio.sleep(0.01)

    async def main():
        client = server.client(cls=openai.AsyncOpenAI)
        watcher = asyncio.create_task(watch_gauges())
        results = []
        for _ in range(3):
            results.append(await asyncio.gather(*(one(client, i) for i in range(16))))
        watcher.cancel()
        await client.close()
        return results

    rounds = asyncio.run(main())
    assert seen["running"] == 4 and seen["waiting"] > 0  # the pool bound held, and requests queued behind it
    sums = dict(drafts=0, draft_tokens=0, accepted=0, prompt=0, completion=0)
    per_pos = [0] * SPEC["num_speculative_tokens"]
    for results in rounds:
        for (text, finish, spec, usage), ref in zip(results, refs):
            assert text == text_of(loaded, ref.token_ids)
            assert finish == ref.finish_reason and usage.completion_tokens == len(ref.token_ids)
            assert spec_counts(spec) == ref_counts(ref)
            sums["drafts"] += spec["num_drafts"]
            sums["draft_tokens"] += spec["num_draft_tokens"]
            sums["accepted"] += spec["num_accepted_tokens"]
            sums["prompt"] += usage.prompt_tokens
            sums["completion"] += usage.completion_tokens
            for i, c in enumerate(spec["num_accepted_tokens_per_pos"]):
                per_pos[i] += c

    after = server.metrics()

    def delta(name: str, extra: str = "") -> float:
        return after[(name, extra)] - before.get((name, extra), 0.0)

    assert delta("vllm:spec_decode_num_drafts_total") == sums["drafts"] > 0
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sums["draft_tokens"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sums["accepted"] > 0
    for i, c in enumerate(per_pos):
        assert delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", f'position="{i}"') == c
    assert delta("vllm:prompt_tokens_total") == sums["prompt"]
    assert delta("vllm:generation_tokens_total") == sums["completion"]
    finished = sum(delta("vllm:request_success_total", f'finished_reason="{r}"') for r in ("stop", "length"))
    assert finished == 48
    assert after[("vllm:num_requests_running", "")] == 0 and after[("vllm:num_requests_waiting", "")] == 0
    # latency histograms: one first token per request; an inter-token gap per later token-bearing step
    assert delta("vllm:time_to_first_token_seconds_count") == 48
    assert delta("vllm:time_to_first_token_seconds_bucket", 'le="+Inf"') == 48
    assert 0 < delta("vllm:inter_token_latency_seconds_count") <= sums["completion"] - 48
    les = [k[1] for k in after if k[0] == "vllm:inter_token_latency_seconds_bucket"]
    counts = [after[("vllm:inter_token_latency_seconds_bucket", le)] for le in les]
    assert counts == sorted(counts) and delta("vllm:inter_token_latency_seconds_sum") > 0


def test_a_full_server_answers_429_and_keeps_serving(loaded):
    """One slot, no waiting room: while a request decodes, the next one is refused with a 429 that
    says why; once the slot is free again, requests are served."""
    with LiveServer(Engine(loaded, None, MAX_LEN, max_num_seqs=1, max_waiting=0)) as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        body = json.dumps({"model": NAME, "prompt": "abc abc", "max_tokens": MAX_LEN - 20, "temperature": 0,
                           "ignore_eos": True, "stream": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        with pytest.raises(openai.RateLimitError) as e:
            s.client().completions.create(model=NAME, prompt="xy xy", max_tokens=3, temperature=0)
        assert e.value.status_code == 429 and "--max-waiting 0" in e.value.message
        assert e.value.body["code"] == "too_many_requests"
        assert e.value.response.headers["retry-after"] == "1"
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.time() + 20
        while True:  # the abandoned request frees the slot
            try:
                r = s.client().completions.create(model=NAME, prompt="xy xy", max_tokens=3, temperature=0)
                break
            except openai.RateLimitError:
                assert time.time() < deadline, "the slot was never freed"
                time.sleep(0.05)
        assert r.usage.completion_tokens >= 1


def test_hybrid_parts_are_counted_under_a_proposer_label(loaded):
    """/metrics carries a hybrid's parts under specctl's names (label ``proposer``), and they add up to
    vLLM's totals, which have no labelled series of their own (a dashboard's sum() stays right)."""
    spec = SpecConfig.from_dict({"method": "hybrid", "proposers": [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2},
        {"method": "suffix", "num_speculative_tokens": 4}]})
    with LiveServer(Engine(loaded, spec, MAX_LEN, max_num_seqs=2, adaptive=False)) as s:
        client = s.client()
        for p in PROMPTS[:4]:
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": p}], max_tokens=NEW,
                                           temperature=0)
        m = s.metrics()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        total = f"vllm:spec_decode_{key}_total"
        assert [k for k in m if k[0] == total] == [(total, "")]
        parts = {k[1]: v for k, v in m.items() if k[0] == f"specctl:spec_decode_{key}_by_proposer_total"}
        assert set(parts) <= {'proposer="ngram"', 'proposer="suffix"'} and parts
        assert sum(parts.values()) == m[(total, "")]
    assert m[("vllm:spec_decode_num_drafts_total", "")] > 0
