"""Structured output through the real supervisor, with the official clients: OpenAI's ``response_format``
(``json_object``, ``json_schema``, the SDK's ``parse()``), vLLM's ``guided_*`` extensions, the gRPC
``grammar`` field; SmolLM2 answers (runner.constraint does the constraining).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from supervisor.protocol import supervisor_pb2

ASK = [{"role": "user", "content": "Describe the city of Paris."}]


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int
    landmarks: list[str] = Field(max_length=3)  # SmolLM2 repeats a list's items for ever


def test_the_sdks_parse_returns_the_parsed_object(chat_client):
    answer = chat_client.chat.completions.parse(
        model="smol", messages=ASK, response_format=City, temperature=0, max_tokens=200
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed
    assert answer.model_extra["x_mlxserve"]["forced"] > 0  # the schema's keys, forced, counted apart


def test_a_streamed_json_schema_answer_parses_whole(chat_client):
    schema = City.model_json_schema()
    chunks = list(
        chat_client.chat.completions.create(
            model="smol",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
            temperature=0,
            max_tokens=200,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_json_object_answers_an_object(chat_client):
    answer = chat_client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Give the name and age of a person as JSON."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=120,
    )
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    else:  # an object may go on; what came is its start, without whitespace between tokens
        assert answer.choices[0].message.content.startswith("{")


def test_guided_regex_and_choice_on_both_apis(chat_client):
    text = chat_client.completions.create(
        model="pair",
        prompt="The for statement",
        max_tokens=40,
        temperature=0,
        extra_body={"guided_regex": r"(is|was) [a-z]{2,10}( [a-z]{2,10}){1,4}\."},
    )
    assert re.fullmatch(r"(is|was) [a-z]{2,10}( [a-z]{2,10}){1,4}\.", text.choices[0].text), text.choices[0].text
    choice = chat_client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Is Paris in France? Answer yes or no."}],
        max_tokens=10,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert choice.choices[0].message.content in ("yes", "no")


def test_the_grpc_api_takes_a_grammar(chat_supervisor):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    request = supervisor_pb2.GenerateRequest(model="pair", prompt="The for statement", max_tokens=30)
    request.grammar = json.dumps({"json_schema": schema})
    chunks = list(chat_supervisor.client.stub.Generate(request, timeout=120, metadata=chat_supervisor.client.metadata))
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), schema)
    request.grammar = json.dumps({"json_schema": {"type": "nonsense"}})
    with pytest.raises(grpc.RpcError) as caught:
        list(chat_supervisor.client.stub.Generate(request, timeout=120, metadata=chat_supervisor.client.metadata))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar" in caught.value.details()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
            "response_format",
        ),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
        ({"extra_body": {"guided_choice": []}}, "guided_choice"),
    ],
)
def test_a_bad_format_is_a_400_naming_it(chat_client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        chat_client.chat.completions.create(model="smol", messages=ASK, max_tokens=8, **fields)
    # A schema or pattern the runner cannot compile is named by the field that carried it, not the runner's
    # "grammar".
    assert caught.value.status_code == 400 and caught.value.body["param"] == param
    assert caught.value.body["message"].startswith(param.split(".")[0])


# -- fifty schemas, sampled ------------------------------------------------------------------------------


def _schemas() -> list[dict]:
    """Fifty schemas of varied features: nested objects, arrays with bounds, enums, anyOf, string patterns and
    formats, numbers with ranges, optional fields. Strings and arrays are bounded so an answer must end."""
    name = {"type": "string", "minLength": 1, "maxLength": 20}
    parts = {
        "name": name,
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "day": {"type": "string", "format": "date"},
        "id": {"type": "string", "format": "uuid"},
        "active": {"type": "boolean"},
        "nothing": {"type": "null"},
        "either": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 8}]},
        "point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99}, "y": {"type": "integer"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "matrix": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
            "maxItems": 2,
        },
        "const": {"const": "v1"},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": name, "role": {"enum": ["dev", "ops"]}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
    }
    keys = list(parts)
    schemas = []
    for i in range(50):
        chosen = [keys[(i * 7 + j * 3) % len(keys)] for j in range(1 + i % 4)]
        chosen = list(dict.fromkeys(chosen))
        required = chosen[: max(1, len(chosen) - i % 2)]  # some optional fields
        schema = {
            "type": "object",
            "properties": {k: parts[k] for k in chosen},
            "required": required,
            "additionalProperties": False,
        }
        if i % 10 == 9:  # nested one level deeper
            schema = {
                "type": "object",
                "properties": {"item": schema, "count": parts["age"]},
                "required": ["item"],
                "additionalProperties": False,
            }
        schemas.append(schema)
    return schemas


def test_fifty_schemas_sampled_at_temperature_one_all_validate_and_end(chat_client):
    """Each answer, sampled at temperature 1 (eight requests at a time, so they are batched), parses and
    validates against its schema and ends by itself: no run to max_tokens (in whitespace or anything else)."""
    schemas = _schemas()

    def ask(i: int):
        answer = chat_client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Fill in this form with plausible values."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"form{i}", "schema": schemas[i]}},
            temperature=1.0,
            seed=i,
            max_tokens=400,
        )
        return answer.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(len(schemas))))
    for i, choice in enumerate(choices):
        assert choice.finish_reason == "stop", (i, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schemas[i])


def test_a_hundred_sampled_numbers_all_end_within_what_a_float_holds(chat_client):
    """The issue's case: a number between 0 and 10, sampled at temperature 1 (seed 5 once ran to max_tokens
    inside its digits, "2.46288874348788888888..."). With room to finish, all 100 answers parse and validate, and
    no number has more digits than a float64 holds."""
    schema = {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
        "required": ["score"],
        "additionalProperties": False,
    }

    def ask(seed: int):
        return chat_client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Rate this movie from 0 to 10: 'The Matrix'."}],
            response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": schema}},
            temperature=1.0,
            seed=seed,
            max_tokens=64,
        ).choices[0]

    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(ask, range(100)))
    for seed, choice in enumerate(choices):
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        answer = json.loads(choice.message.content)
        jsonschema.validate(answer, schema)
        digits = re.search(r'"score":-?([0-9.]+)', choice.message.content).group(1).replace(".", "").lstrip("0")
        assert len(digits) <= 17, (seed, choice.message.content)
