"""Tool calls through the real supervisor, with the official ``openai`` client and the gRPC API: SmolLM2, whose
chat template has no tool support, answers in the generic layout (common.tool_calls), held by its grammar.

A round trip as an agent runs it: the model calls a function (its arguments valid against the function's
schema), the tool's result goes back in the history, the model answers in text; streamed and not, with the
same calls and text either way.
"""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from common.protocol import runner_pb2
from supervisor.protocol import supervisor_pb2

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now in a time zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 40}}},
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = '{"temperature": 21, "sky": "clear"}'


def ask(client, messages=ASK, **fields):
    fields = {"model": "smol", "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": 120, **fields}
    return client.chat.completions.create(**fields)


def streamed(client, **fields) -> tuple[str | None, list[dict], list[str], list]:
    """A streamed answer put together as a client does: its text, its calls, its finish reasons, the chunks."""
    chunks = list(ask(client, stream=True, **fields))
    text, calls = "", {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.id:  # a call's first piece: its id, type and name, as OpenAI streams them
                assert piece.index not in calls and piece.type == "function" and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text or None, [calls[i] for i in sorted(calls)], reasons, chunks


def test_a_required_call_names_an_offered_function_with_valid_arguments(chat_client):
    answer = ask(chat_client, tool_choice="required", parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "paris" in arguments["city"].lower()
    assert answer.model_extra["x_mlxserve"]["forced"] > 0  # the layout's keys and the function's name, forced


def test_a_named_function_is_the_one_called(chat_client):
    choice = ask(chat_client, tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert {c.function.name for c in choice.message.tool_calls} == {"get_time"}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])


def test_a_tool_round_trip_whole_and_streamed(chat_client):
    first = ask(chat_client, tool_choice="required", parallel_tool_calls=False).choices[0].message
    text, calls, reasons, _ = streamed(chat_client, tool_choice="required", parallel_tool_calls=False)
    assert text is None and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in first.tool_calls
    ]
    # The tool's result goes back, with the assistant's message as the SDK gives it; the model answers in text.
    history = [
        *ASK,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": RESULT},
    ]
    answer = ask(chat_client, messages=history).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content and not answer.message.content.startswith("{")  # the text, not its JSON
    text, calls, reasons, _ = streamed(chat_client, messages=history)
    assert (text, calls, reasons) == (answer.message.content, [], ["stop"])


def test_tool_choice_none_answers_in_plain_text(chat_client):
    choice = ask(chat_client, tool_choice="none", max_tokens=30).choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content and not choice.message.content.startswith('{"')


def test_the_grpc_api_takes_tools_and_gives_structured_calls(chat_supervisor):
    request = supervisor_pb2.GenerateRequest(
        model="smol", max_tokens=120, tools=json.dumps(TOOLS), tool_choice="function", tool_name="get_weather"
    )
    request.messages.add(role="user", content=ASK[0]["content"])
    chunks = list(chat_supervisor.client.stub.Generate(request, timeout=120, metadata=chat_supervisor.client.metadata))
    assert chunks[-1].finish_reason == runner_pb2.FINISH_REASON_TOOL_CALLS
    assert "".join(c.text for c in chunks) == ""
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].id and deltas[0].name == "get_weather"
    arguments = "".join(d.arguments for d in deltas if d.index == 0)
    jsonschema.validate(json.loads(arguments), WEATHER)
    # A history with the call and its result, in the gRPC API's own fields.
    request = supervisor_pb2.GenerateRequest(model="smol", max_tokens=60, tools=json.dumps(TOOLS))
    request.messages.add(role="user", content=ASK[0]["content"])
    message = request.messages.add(role="assistant")
    message.tool_calls.add(id=deltas[0].id, name="get_weather", arguments=arguments)
    request.messages.add(role="tool", content=RESULT, tool_call_id=deltas[0].id, name="get_weather")
    chunks = list(chat_supervisor.client.stub.Generate(request, timeout=120, metadata=chat_supervisor.client.metadata))
    assert chunks[-1].finish_reason == runner_pb2.FINISH_REASON_STOP and "".join(c.text for c in chunks)
    with pytest.raises(grpc.RpcError) as caught:
        request = supervisor_pb2.GenerateRequest(model="smol", max_tokens=8, tools="[1]")
        request.messages.add(role="user", content="hi")
        list(chat_supervisor.client.stub.Generate(request, timeout=60, metadata=chat_supervisor.client.metadata))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools[0]" in caught.value.details()


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice", "not one of the tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", "not one of"),
        ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ]
            },
            "tools",
            "cannot be enforced",
        ),
        ({"response_format": {"type": "json_object"}, "tool_choice": "required"}, "grammar", "set one of"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}, "messages", "only an assistant"),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_field(chat_client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(chat_client, max_tokens=4, **fields)
    assert caught.value.body["param"] == param and words in caught.value.body["message"], caught.value.body


def test_tools_on_completions_or_a_model_without_a_template_are_refused(chat_client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat_client.completions.create(model="pair", prompt="hi", max_tokens=4, extra_body={"tools": TOOLS})
    assert caught.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as caught:
        ask(chat_client, model="pair", max_tokens=4)
    assert "no chat template" in caught.value.body["message"]


def test_a_call_cut_by_max_tokens_goes_out_as_openai_sends_it_and_comes_back_in_the_history(chat_client):
    """Cut mid-arguments: finish_reason "length" and the arguments as far as they came, whole and streamed, one
    entry per call in each delta; the history holding the cut call (as an agent sends it back, with the error its
    tool run gave) is answered, not refused."""
    fields = {"tool_choice": "required", "max_tokens": 18}
    whole = ask(chat_client, **fields).choices[0]
    assert whole.finish_reason == "length" and len(whole.message.tool_calls) == 1
    cut = whole.message.tool_calls[0].function
    assert cut.name == "get_weather" and cut.arguments.startswith('{"city":') and not cut.arguments.endswith("}")
    text, calls, reasons, chunks = streamed(chat_client, **fields)
    assert reasons[-1] == "length" and calls[0]["arguments"] == cut.arguments
    for chunk in chunks:  # OpenAI never sends two entries of one call in one delta
        indices = [piece.index for piece in (chunk.choices[0].delta.tool_calls or ())] if chunk.choices else []
        assert len(indices) == len(set(indices)), chunk
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [whole.message.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": whole.message.tool_calls[0].id, "content": "Error: arguments not JSON"},
    ]
    again = ask(chat_client, messages=history, max_tokens=24)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_required_call_cut_at_its_first_token_leaks_no_layout_json(chat_client):
    answer = ask(chat_client, tool_choice="required", max_completion_tokens=1).choices[0]
    assert answer.finish_reason == "length" and not answer.message.content and not answer.message.tool_calls
    text, calls, reasons, _ = streamed(chat_client, tool_choice="required", max_completion_tokens=1)
    assert text is None and calls == [] and reasons[-1] == "length"


def test_parameters_with_keywords_the_engine_lacks_are_held_to_the_rest_unless_strict(chat_client):
    """Claude Code's TaskCreate holds ``propertyNames`` (which llguidance does not implement) in its parameters.
    The call is held to the rest of the schema; a function marked strict is refused instead."""
    task = {
        "type": "object",
        "properties": {"subject": {"type": "string", "maxLength": 40}},
        "required": ["subject"],
        "additionalProperties": False,
        "propertyNames": {"type": "string"},
    }
    tools = [{"type": "function", "function": {"name": "create_task", "parameters": task}}]
    answer = ask(chat_client, tools=tools, tool_choice="required", messages=[{"role": "user", "content": "Add a task"}])
    call = answer.choices[0].message.tool_calls[0].function
    assert call.name == "create_task" and "subject" in json.loads(call.arguments)
    strict = [{"type": "function", "function": {"name": "create_task", "parameters": task, "strict": True}}]
    with pytest.raises(openai.BadRequestError) as caught:
        ask(chat_client, tools=strict, tool_choice="required", max_tokens=4)
    assert caught.value.body["param"] == "tools" and "propertyNames" in caught.value.body["message"]
