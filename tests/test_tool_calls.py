"""common.tool_calls: each family's way of writing a call, parsed back; the family recognised from templates."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.defaults import SMOLLM2_DIR
from common.tool_calls import PARSERS, ToolCallError, detect, generic_schema

WEATHER = {"city": "Paris", "unit": "celsius"}
WEATHER_JSON = json.dumps(WEATHER)


def args(call) -> dict:
    return json.loads(call.arguments)


def test_hermes_blocks_one_per_call_with_text_before():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    )
    parsed = PARSERS["hermes"](text)
    assert parsed.content == "Let me check."
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert args(parsed.calls[0]) == WEATHER and parsed.calls[0].id != parsed.calls[1].id
    assert PARSERS["hermes"]("No call here.").calls == []
    with pytest.raises(ToolCallError):
        PARSERS["hermes"]('<tool_call>{"name": "x", "arguments": {')
    with pytest.raises(ToolCallError):
        PARSERS["hermes"]('<tool_call>{"arguments": {}}</tool_call>')


def test_llama3_json_and_python_tag():
    parsed = PARSERS["llama3"](
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    )
    assert parsed.content == "" and parsed.calls[0].name == "get_weather" and args(parsed.calls[0]) == WEATHER
    two = PARSERS["llama3"]('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c.name for c in two.calls] == ["a", "b"]
    assert PARSERS["llama3"]("{not json} is prose").calls == []


def test_mistral_list_after_its_marker():
    parsed = PARSERS["mistral"](
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
    )
    assert parsed.calls[0].name == "get_weather" and args(parsed.calls[0]) == WEATHER
    with pytest.raises(ToolCallError):
        PARSERS["mistral"]("[TOOL_CALLS] not json")


def test_pythonic_calls_read_as_literals_only():
    parsed = PARSERS["pythonic"]('[get_weather(city="Paris", unit="celsius"), get_time(tz="CET", exact=True)]')
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert args(parsed.calls[1]) == {"tz": "CET", "exact": True}
    with pytest.raises(ToolCallError):
        PARSERS["pythonic"]("[get_weather(city=open('/etc/passwd').read())]")  # never evaluated
    assert PARSERS["pythonic"]("[1, 2] is a list").calls == []


def test_generic_layout_calls_or_a_response_and_its_schema():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city"],
                },
            },
        }
    ]
    call = {"tool_calls": [{"name": "get_weather", "arguments": WEATHER}]}
    answer = {"response": "It is sunny."}
    auto, required = generic_schema(tools, required=False), generic_schema(tools, required=True)
    jsonschema.validate(call, auto)
    jsonschema.validate(answer, auto)
    jsonschema.validate(call, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(answer, required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tool_calls": [{"name": "launch", "arguments": {}}]}, auto)
    parsed = PARSERS["generic"](json.dumps(call))
    assert parsed.calls[0].name == "get_weather" and args(parsed.calls[0]) == WEATHER
    assert PARSERS["generic"](json.dumps(answer)).content == "It is sunny."


def test_families_are_recognised_from_templates():
    smollm2 = json.loads((SMOLLM2_DIR / "tokenizer_config.json").read_text())["chat_template"]
    assert detect(smollm2) is None  # no tool support: the generic layout
    assert detect("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}") == "hermes"
    assert detect("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect("{% if tools %}<|python_tag|>{% endif %}") == "llama3"
    assert detect(None) is None
