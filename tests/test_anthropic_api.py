"""Anthropic's Messages API through the real supervisor, with the official ``anthropic`` client: SmolLM2 answers
text, stop sequences and tool calls (the generic layout), streamed and not; count_tokens is exact; errors come
in Anthropic's shape with its statuses. The same internal request as OpenAI's chat, so the same greedy answer.
What Claude Code sends is served (its turn with Claude Code itself: tests/test_clients.py).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.helpers import CHAT_TOKEN

ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER}]


@pytest.fixture(scope="module")
def claude(chat_supervisor):
    return chat_supervisor.anthropic()


GREEDY = {
    "extra_body": {"temperature": 0}
}  # Anthropic's SDK no longer has the sampling fields; clients still send them


def create(claude, **fields):
    return claude.messages.create(**{"model": "smol", "max_tokens": 40, "messages": ASK, **GREEDY, **fields})


def test_an_answer_in_content_blocks_equal_to_the_openai_apis(claude, chat_client):
    message = create(claude, system="You are brief.")
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 10
    assert message.usage.output_tokens > 0
    same = chat_client.chat.completions.create(
        model="smol",
        max_tokens=40,
        temperature=0,
        messages=[{"role": "system", "content": "You are brief."}, *ASK],
    )
    assert message.content[0].text == same.choices[0].message.content


def test_a_stream_gives_the_same_message_event_by_event(claude):
    whole = create(claude, max_tokens=24)
    with claude.messages.stream(model="smol", max_tokens=24, messages=ASK, **GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "ping"] or kinds[0] == "message_start"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_is_named(claude):
    whole = create(claude)
    word = whole.content[0].text.split()[2]
    message = create(claude, stop_sequences=["zzz", word])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert word not in message.content[0].text


def test_a_tool_round_trip_whole_and_streamed(claude):
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = create(claude, messages=asked, tools=TOOLS, tool_choice={"type": "any"}, max_tokens=120)
    assert call.stop_reason == "tool_use"
    uses = [block for block in call.content if block.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER)
    with claude.messages.stream(
        model="smol", max_tokens=120, messages=asked, tools=TOOLS, tool_choice={"type": "any"}, **GREEDY
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]
    # The result goes back as a tool_result block; the model answers in text.
    history = [
        *asked,
        {"role": "assistant", "content": [block.model_dump() for block in call.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": '{"temperature": 21, "sky": "clear"}'}
                for u in uses
            ],
        },
    ]
    answer = create(claude, messages=history, tools=TOOLS, max_tokens=60)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text and not answer.content[0].text.startswith("{")


def test_structured_output_follows_the_schema(claude):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    message = create(claude, max_tokens=60, output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_count_tokens_is_exact(claude):
    for fields in ({}, {"system": "You are brief.", "tools": TOOLS}):
        counted = claude.messages.count_tokens(model="smol", messages=ASK, **fields).input_tokens
        message = create(claude, max_tokens=1, **fields)
        assert counted == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


@pytest.mark.parametrize(
    "fields, error, words",
    [
        ({"model": "nope"}, anthropic.NotFoundError, "nope"),
        ({"extra_body": {"temperature": 1.5}}, anthropic.BadRequestError, "temperature"),
        ({"output_config": {"format": {"type": "regex"}}}, anthropic.BadRequestError, "output_config.format"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, anthropic.BadRequestError, "thinking"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
                        ],
                    }
                ]
            },
            anthropic.BadRequestError,
            "does not take images",  # a model that reads text only (tests/test_vision.py: one that sees)
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, anthropic.BadRequestError, "server tools"),
        ({"tool_choice": {"type": "tool", "name": "launch"}, "tools": TOOLS}, anthropic.BadRequestError, "launch"),
    ],
)
def test_errors_come_in_anthropics_shape(claude, fields, error, words):
    with pytest.raises(error) as caught:
        claude.messages.create(**{"model": "smol", "max_tokens": 8, "messages": ASK, **fields})
    assert caught.value.body["type"] == "error" and words in caught.value.body["error"]["message"]


def test_the_token_goes_as_x_api_key_or_bearer(chat_supervisor):
    url = chat_supervisor.base_url + "/messages"
    body = {"model": "smol", "max_tokens": 2, "messages": ASK}
    missing = httpx.post(url, json=body, timeout=60)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    no_max = httpx.post(url, json={"model": "smol", "messages": ASK}, headers={"x-api-key": CHAT_TOKEN}, timeout=60)
    assert no_max.status_code == 400 and "max_tokens" in no_max.json()["error"]["message"]  # required, as Anthropic's
    assert httpx.post(url, json=body, headers={"authorization": f"Bearer {CHAT_TOKEN}"}, timeout=60).status_code == 200


def test_a_claude_code_like_session_reads_the_prompt_cache_from_its_second_turn(claude):
    """count_tokens each turn, a long system prompt, tools, streaming: the conversation so far comes from the
    prompt cache from the second turn on, and each count is the prompt the turn then reports."""
    system = "You are a coding assistant working in a repository. " * 40
    conversation = []
    for turn, question in enumerate(["Name a sorting algorithm.", "Why is it fast?", "Name another one."]):
        conversation.append({"role": "user", "content": question})
        fields = {"model": "smol", "system": system, "messages": conversation, "tools": TOOLS}
        counted = claude.messages.count_tokens(**fields).input_tokens
        with claude.messages.stream(max_tokens=24, **fields, **GREEDY) as stream:
            message = stream.get_final_message()
        usage = message.usage
        assert counted == usage.input_tokens + (usage.cache_read_input_tokens or 0)
        if turn > 0:
            assert usage.cache_read_input_tokens > counted // 2, usage
        conversation.append({"role": "assistant", "content": [b.model_dump() for b in message.content]})


def test_a_full_queue_is_anthropics_overloaded_error():
    from common.status import Code, ServiceError
    from supervisor.anthropic_api import anthropic_error

    status, body = anthropic_error(ServiceError(Code.RESOURCE_EXHAUSTED, "1 request already waiting"))
    assert status == 529 and body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "1 request already waiting"},
    }


def test_what_claude_code_sends_is_served(claude):
    """Adaptive thinking (the model decides: one that does not reason answers without thinking), a system
    message inside messages where it stands, context_management clearing earlier thinking, hints; the answer
    is SmolLM2's greedy one for the same conversation."""
    conversation = [*ASK, {"role": "system", "content": "Answer in one word."}]
    fields = {
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": '{"session_id": "x"}'},
    }
    message = create(claude, messages=conversation, extra_body={**GREEDY["extra_body"], **fields})
    assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].type == "text"
    assert create(claude, messages=conversation).content[0].text == message.content[0].text
    counted = claude.messages.count_tokens(model="smol", messages=conversation).input_tokens
    assert counted == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    with pytest.raises(anthropic.BadRequestError) as caught:  # clearing old tool results would change the prompt
        create(claude, extra_body={"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}})
    assert "context_management" in caught.value.body["error"]["message"]
