"""The OpenAI API as this server speaks it: request bodies, errors, and the text of streamed tokens.

- ``parse_body``: a raw body -> a validated ``CompletionRequest`` / ``ChatRequest`` (pydantic), or an
  ``ApiError`` (400) naming the field; parameters the server does not support are refused by name,
  never silently ignored.
- ``ApiError``: OpenAI's error object ``{"error": {"message", "type", "param", "code"}}`` + a status.
- ``TextStream``: incremental detokenization with ``stop`` strings (cut before them, or after with
  vLLM's ``include_stop_str_in_output``) and ``skip_special_tokens``.

What it does not know: the engine, HTTP routing (``specctl.runtime.server``), torch.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class TextStream:
    """Incremental detokenization of one request's tokens, with OpenAI ``stop`` strings.

    Text is decoded over a short window of tokens (vLLM's prefix/read offsets) so that each token
    costs O(1) decode work, and held back while it ends in an incomplete UTF-8 character. With stop
    strings, the last ``len(longest stop) - 1`` characters are held back until they cannot start
    one; once a stop string appears the text is cut before it, and ``ids`` is cut after the token
    that completed it (found by bisection: whether the decoded prefix holds it is monotonic).
    """

    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False, skip_special: bool = True):
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self.include_stop, self.skip_special = include_stop, skip_special
        self.hidden = 0  # tokens generated but not in ids' text: a final stop token (counted in usage)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of text already handed out
        self.stopped = False
        self._po = self._ro = 0  # prefix offset, read offset (token indices)
        self._checked = 0  # tokens whose text is known not to hold a stop string

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, tokens: list[int]) -> None:
        if self.stopped or not tokens:
            return
        self.ids.extend(tokens)
        self._advance(final=False)

    def add_last(self, tokens: list[int], stop_ids) -> None:
        """The request's last tokens: one that ended it by being a stop token (EOS, ``stop_token_ids``)
        is counted but its text left out unless ``include_stop`` (as vLLM)."""
        if tokens and tokens[-1] in stop_ids and not self.include_stop and not self.stopped:
            tokens, self.hidden = tokens[:-1], 1
        self.add(tokens)

    @property
    def n_tokens(self) -> int:
        """Completion tokens as usage counts them: up to the one that completed a stop string, or all."""
        return len(self.ids) + self.hidden

    def _advance(self, final: bool) -> None:
        prefix = self._decode(self.ids[self._po:self._ro])
        full = self._decode(self.ids[self._po:])
        if not final and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return  # nothing printable yet, or a character still missing its other bytes
        before = len(self.text)
        self.text += full[len(prefix):]
        self._po, self._ro = self._ro, len(self.ids)
        if self.stop:
            self._find_stop(max(0, before - self.hold))

    def _find_stop(self, start: int) -> None:
        hits = [(i, len(s)) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            self._checked = len(self.ids)
            return
        at, n = min(hits)
        self.text, self.stopped = self.text[:at + n if self.include_stop else at], True
        lo, hi = self._checked, len(self.ids)  # decode(ids[:lo]) holds no stop; decode(ids[:hi]) does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            t = self._decode(self.ids[:mid])
            lo, hi = (lo, mid) if any(s in t for s in self.stop) else (mid, hi)
        del self.ids[hi:]

    def take(self, final: bool = False) -> str:
        """The text not handed out yet that is safe to send (everything when ``final``)."""
        if final and not self.stopped:
            self._advance(final=True)
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out


class ApiError(Exception):
    """An OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class StreamOptions(BaseModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # vLLM: usage in every chunk


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (unknown fields are ignored)."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = None  # vLLM extension; <= 0 disables it
    seed: Optional[int] = Field(None, ge=-(2**63), le=2**64 - 1)  # what a torch.Generator takes
    stop: Union[str, list[str], None] = None
    n: Optional[int] = Field(None, ge=1)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's extensions
    ignore_eos: Optional[bool] = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: Optional[bool] = False
    skip_special_tokens: Optional[bool] = True


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)


# field -> (is it asking for something unsupported?, what to say)
_UNSUPPORTED = {
    "logprobs": (lambda v: v is not None and v is not False, "logprobs are not supported"),  # 0 asks for them too
    "prompt_logprobs": (lambda v: v is not None, "prompt logprobs are not supported"),
    "top_logprobs": (lambda v: v not in (None, 0), "logprobs are not supported"),
    "echo": (lambda v: bool(v), "echo is not supported"),
    "suffix": (lambda v: bool(v), "suffix (insertion) is not supported"),
    "best_of": (lambda v: v not in (None, 1), "best_of > 1 is not supported"),
    "logit_bias": (lambda v: bool(v), "logit_bias is not supported"),
    "presence_penalty": (lambda v: v not in (None, 0, 0.0), "presence_penalty is not supported (use 0)"),
    "frequency_penalty": (lambda v: v not in (None, 0, 0.0), "frequency_penalty is not supported (use 0)"),
    "tools": (lambda v: bool(v), "tools are not supported"),
    "functions": (lambda v: bool(v), "functions are not supported"),
    "response_format": (lambda v: isinstance(v, dict) and v.get("type", "text") != "text",
                        "response_format other than text is not supported"),
    # vLLM's sampling extensions that change the output: refused rather than silently ignored
    "min_tokens": (lambda v: v not in (None, 0), "min_tokens is not supported (use 0)"),
    "repetition_penalty": (lambda v: v not in (None, 1, 1.0), "repetition_penalty is not supported (use 1)"),
    "min_p": (lambda v: v not in (None, 0, 0.0), "min_p is not supported (use 0)"),
    "bad_words": (lambda v: bool(v), "bad_words is not supported"),
    "allowed_token_ids": (lambda v: v is not None, "allowed_token_ids is not supported"),
    "guided_json": (lambda v: v is not None, "guided decoding is not supported"),
    "guided_regex": (lambda v: v is not None, "guided decoding is not supported"),
    "guided_choice": (lambda v: v is not None, "guided decoding is not supported"),
    "guided_grammar": (lambda v: v is not None, "guided decoding is not supported"),
    "structured_outputs": (lambda v: v is not None, "structured outputs are not supported"),
    "use_beam_search": (lambda v: bool(v), "beam search is not supported"),
    "truncate_prompt_tokens": (lambda v: v is not None, "truncate_prompt_tokens is not supported (send a shorter prompt)"),
    "logits_processors": (lambda v: bool(v), "logits_processors are not supported"),
    "prompt_embeds": (lambda v: v is not None, "prompt_embeds are not supported"),
    "detokenize": (lambda v: v is False, "detokenize=false is not supported"),
    # chat prompt construction: the model's own template, with the generation prompt, only
    "add_generation_prompt": (lambda v: v is False, "add_generation_prompt=false is not supported"),
    "continue_final_message": (lambda v: bool(v), "continue_final_message is not supported"),
    "chat_template": (lambda v: v is not None, "a request's own chat_template is not supported"),
    "chat_template_kwargs": (lambda v: bool(v), "chat_template_kwargs are not supported"),
}


def parse_body(raw: bytes, cls: type[SamplingFields]) -> SamplingFields:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        msg = f"malformed JSON body ({e.msg} at line {e.lineno} column {e.colno})" if isinstance(e, json.JSONDecodeError) \
            else "the body is not UTF-8 JSON"
        raise ApiError(400, f"{msg}; send a JSON object with Content-Type: application/json", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        body = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise ApiError(400, f"invalid '{where}': {err['msg']}", code="invalid_value",
                       param=str(err["loc"][0]) if err["loc"] else None) from None
    for key, (bad, why) in _UNSUPPORTED.items():
        if key in data and bad(data[key]):
            raise ApiError(400, f"'{key}': {why} by this server", code="unsupported_parameter", param=key)
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "'stream_options' is only allowed with \"stream\": true", param="stream_options")
    if (body.n or 1) > 1:
        raise ApiError(400, f"n={body.n} is not supported: this server returns one choice per request (n=1); "
                       "send several requests instead", code="unsupported_parameter", param="n")
    return body


def usage_of(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
