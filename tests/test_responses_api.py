"""OpenAI's Responses API through the real supervisor, with the official ``openai`` client: text, streamed and
not; a conversation continued with ``previous_response_id`` (and its store: GET, DELETE, ``store: false``);
function tools in a round trip; ``text.format`` with a schema; errors in OpenAI's shape."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER}
]


def create(client, **fields):
    return client.responses.create(**{"model": "smol", "temperature": 0, "max_output_tokens": 30, **fields})


def test_a_response_and_its_stream_say_the_same(chat_client):
    whole = create(
        chat_client,
        input="What is the capital of France?",
        instructions="You are a helpful assistant.",
        max_output_tokens=120,
    )
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.status == "completed"
    assert whole.output_text and whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    same = chat_client.chat.completions.create(
        model="smol",
        temperature=0,
        max_tokens=30,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
    )
    assert whole.output_text == same.choices[0].message.content
    with chat_client.responses.stream(
        model="smol",
        temperature=0,
        max_output_tokens=120,
        input="What is the capital of France?",
        instructions="You are a helpful assistant.",
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    assert final.output_text == whole.output_text
    # Cut short by max_output_tokens: incomplete, saying why (and its stream ends with response.incomplete).
    short = create(chat_client, input="Tell me about Paris.", max_output_tokens=5)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_previous_response_id_continues_and_the_store_keeps_it(chat_client):
    first = create(chat_client, input="My name is Ada. Say hello.")
    second = create(chat_client, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # it saw the first turn
    assert second.usage.input_tokens_details.cached_tokens > 0  # and the prompt cache had it
    assert chat_client.responses.retrieve(first.id).output_text == first.output_text
    chat_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        chat_client.responses.retrieve(first.id)
    unstored = create(chat_client, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        create(chat_client, input="Again", previous_response_id=unstored.id)


def test_a_function_tool_round_trip_streamed_and_not(chat_client):
    asked = "What is the weather in Paris?"
    called = create(
        chat_client, input=asked, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_output_tokens=80
    )
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with chat_client.responses.stream(
        model="smol",
        temperature=0,
        max_output_tokens=80,
        input=asked,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
    ) as stream:
        streamed = stream.get_final_response()
    assert [(i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == [
        (call.name, call.arguments)
    ]
    # The result goes back as a function_call_output, continuing the stored response.
    answer = create(
        chat_client,
        previous_response_id=called.id,
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21, "sky": "clear"}'}
        ],
        tools=TOOLS,
        max_output_tokens=60,
    )
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]


def test_text_format_holds_the_output_to_a_schema(chat_client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    response = create(
        chat_client,
        input="Name the capital of France.",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"text": {"format": "json"}}, "text"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
        ({"previous_response_id": "resp_nope"}, None),
    ],
)
def test_bad_requests_are_refused_in_openais_shape(chat_client, fields, param):
    with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as caught:
        create(chat_client, **{"input": "Hi", **fields})
    assert caught.value.body["param"] == param


def test_logprobs_come_when_included(chat_client):
    whole = create(chat_client, input="Hi", include=["message.output_text.logprobs"], top_logprobs=2)
    part = whole.output[0].content[0]
    assert part.logprobs and "".join(entry.token for entry in part.logprobs) == part.text
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 for entry in part.logprobs)
    with chat_client.responses.stream(
        model="smol", input="Hi", temperature=0, max_output_tokens=30, include=["message.output_text.logprobs"]
    ) as stream:
        deltas = [event for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert [entry.token for event in deltas for entry in event.logprobs] == [e.token for e in part.logprobs]
    assert final.output[0].content[0].logprobs


def test_reasoning_effort_none_is_no_reasoning_and_cancel_says_why(chat_client):
    response = create(chat_client, input="Hi", reasoning={"effort": "none"})
    assert response.status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as caught:  # not run in the background: nothing to cancel
        chat_client.responses.cancel(response.id)
    assert "background" in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        chat_client.responses.cancel("resp_nope")


def test_a_call_cut_short_is_an_incomplete_item_and_continues(chat_client):
    fields = {"input": "What is the weather in Paris?", "tools": TOOLS, "tool_choice": "required"}
    cut = create(chat_client, max_output_tokens=17, **fields)
    assert cut.status == "incomplete" and cut.output[-1].type == "function_call"
    assert cut.output[-1].status == "incomplete" and not cut.output[-1].arguments.endswith("}")
    with chat_client.responses.stream(model="smol", temperature=0, max_output_tokens=17, **fields) as stream:
        done = [event.item for event in stream if event.type == "response.output_item.done"]
    assert done[-1].status == "incomplete" and done[-1].arguments == cut.output[-1].arguments
    result = {"type": "function_call_output", "call_id": cut.output[-1].call_id, "output": "Error: cut short"}
    again = create(chat_client, previous_response_id=cut.id, input=[result])  # the history holds the cut call
    assert again.status in ("completed", "incomplete")
