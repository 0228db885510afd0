"""Prompts and conversations as token ids: one renderer for bench, serve, recommend and the trainers.

``render(tokenizer, messages)`` applies the tokenizer's chat template with a generation prompt (what
the model sees when it is asked to answer). A tokenizer without a template (a base model) gets a
single turn as its plain text, the contents joined by blank lines, and a note on stderr once per
tokenizer: a completion model continues text. A conversation with assistant turns has no plain-text
form the model was trained on, so it is refused with a one-line error naming the fix.

``template_ids(tokenizer, messages, add_generation_prompt)`` is the template alone, as a flat list of
ints whatever transformers returns (a list, a tensor, a BatchEncoding); the trainers use it to find
where each assistant turn starts and ends.

What it does not know: models, torch, where messages come from (workloads, the OpenAI API, datasets).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from specctl.errors import UsageError

_warned: set[int] = set()


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` through the chat template."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "keys"):  # transformers 5: a BatchEncoding
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(t) for t in out]


def render(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt ids of ``messages`` (``role``/``content`` dicts), ready for the model to answer."""
    if has_template(tokenizer):
        return template_ids(tokenizer, messages, add_generation_prompt=True)
    if any(m.get("role") == "assistant" for m in messages):
        name = getattr(tokenizer, "name_or_path", "") or "this model"
        raise UsageError(f"{name} has no chat template, so a conversation with assistant turns cannot be rendered",
                         "use a chat (instruct) model, add a chat_template to its tokenizer_config.json, "
                         "or send single-turn prompts")
    if id(tokenizer) not in _warned:
        _warned.add(id(tokenizer))
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        print(f"specctl: {name} has no chat template; prompts are sent as plain text", file=sys.stderr)
    text = "\n\n".join(str(m.get("content", "")) for m in messages)
    return [int(t) for t in tokenizer.encode(text)]
