"""A conversation laid out by the model's chat template (runner.request.chat_ids): a system message after the
first message (Anthropic's mid-conversation system messages, Claude Code's) stands where it is for a template
that takes it, and is folded into the nearest user message for one that refuses it (Mistral's instruction
templates raise on any system message but a first one)."""

from __future__ import annotations

import pytest

from common.defaults import SMOLLM2_DIR
from common.errors import InvalidRequest
from runner.request import GenerationRequest, chat_ids, fold_system_messages

# A template in the style of Mistral's instruction templates: a system message first or not at all.
FIRST_ONLY = (
    "{%- if messages[0]['role'] == 'system' -%}{%- set system = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set system = '' -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{{ bos_token }}{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'user' -%}{{ '[INST] ' + (system if loop.first else '') + message['content'] + "
    "' [/INST]' }}{%- elif message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}{%- else -%}"
    "{{ raise_exception('Only user and assistant roles are supported, with the exception of an initial "
    "optional system message!') }}{%- endif -%}{%- endfor -%}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    assert (SMOLLM2_DIR / "tokenizer.json").is_file(), f"{SMOLLM2_DIR} is missing: run `make real-model`"
    return load_tokenizer(SMOLLM2_DIR)


def text_of(tokenizer, messages) -> str:
    ids = chat_ids(GenerationRequest(messages=tuple(messages)), tokenizer, 8192)
    return tokenizer.decode(ids)


def test_a_late_system_message_stands_where_it_is_when_the_template_takes_it(tokenizer):
    text = text_of(tokenizer, [("user", "Say hi."), ("system", "Answer in French.")])
    assert text.index("Say hi.") < text.index("<|im_start|>system\nAnswer in French.")


def test_a_template_that_refuses_it_gets_it_folded_into_the_nearest_user_message(tokenizer):
    original, tokenizer._tokenizer.chat_template = tokenizer._tokenizer.chat_template, FIRST_ONLY
    try:
        text = text_of(tokenizer, [("system", "Be brief."), ("user", "Say hi."), ("system", "Answer in French.")])
        assert text.endswith("[INST] Be brief.\n\nSay hi.\n\nAnswer in French. [/INST]")
        with pytest.raises(InvalidRequest, match="Only user and assistant roles"):  # a real refusal stays one
            text_of(tokenizer, [("user", "a"), ("tool", "b")])
    finally:
        tokenizer._tokenizer.chat_template = original


def test_folding_keeps_the_order_of_the_conversation():
    def message(role, content):
        return {"role": role, "content": content}

    assert fold_system_messages([message("user", "q")]) is None
    folded = fold_system_messages(
        [message("system", "s1"), message("system", "s2"), message("user", "q"), message("system", "late")]
    )
    assert folded == [message("system", "s1\n\ns2"), message("user", "q\n\nlate")]
    assert fold_system_messages([message("system", "s"), message("assistant", "a"), message("system", "t")]) == [
        message("system", "s"),
        message("assistant", "a"),
        message("user", "t"),
    ]
    assert fold_system_messages([message("assistant", "a"), message("system", "t"), message("user", "q")]) == [
        message("assistant", "a"),
        message("user", "t\n\nq"),
    ]
