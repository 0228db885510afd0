"""specctl.chat: the one renderer of prompts and conversations."""

from __future__ import annotations

import sys

import pytest

from specctl import chat
from specctl.errors import UsageError


@pytest.fixture
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "user", "assistant", "system", "hello", "world", "be", "brief", ":", "ok"]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="[UNK]")


TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
CONVERSATION = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "world"}]


def test_a_conversation_goes_through_the_template(tokenizer):
    tokenizer.chat_template = TEMPLATE
    ids = chat.render(tokenizer, CONVERSATION)
    assert ids == tokenizer.encode("user : hello assistant : ok user : world assistant :", add_special_tokens=False)
    assert chat.template_ids(tokenizer, CONVERSATION[:1], False) == tokenizer.encode("user : hello",
                                                                                   add_special_tokens=False)


def test_without_a_template_a_conversation_is_refused_in_one_line(tokenizer):
    with pytest.raises(UsageError) as e:
        chat.render(tokenizer, CONVERSATION)
    assert "no chat template" in str(e.value) and "\n" not in str(e.value)
    assert "chat_template" in e.value.fix


def test_without_a_template_a_single_turn_is_plain_text_and_says_so_once(tokenizer, capsys):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    assert chat.render(tokenizer, msgs) == tokenizer.encode("be brief\n\nhello world")
    chat.render(tokenizer, msgs)
    err = capsys.readouterr().err
    assert err.count("no chat template") == 1 and "plain text" in err


def test_chat_imports_no_torch():
    import subprocess

    code = "import specctl.chat, sys; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
