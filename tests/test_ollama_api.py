"""Ollama's native API through the real supervisor, with the official ``ollama`` client: chat and generate,
streamed (NDJSON) and not, options, formats, tools, keep_alive loading and unloading, the model listings, and
errors in Ollama's shape; on the main HTTP port and on the address Ollama's clients look at (``ollama_listen``).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest

from tests.processes import wait_until

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 30}


@pytest.fixture(scope="module")
def client(chat_supervisor):
    return chat_supervisor.ollama()


def test_chat_answers_as_ollama_does_and_as_the_openai_api_does(client, chat_client):
    answer = client.chat(model="smol", messages=ASK, options=GREEDY)
    assert answer.done and answer.done_reason in ("stop", "length") and answer.message.role == "assistant"
    assert answer.eval_count > 0 and answer.prompt_eval_count >= 0 and answer.total_duration > 0
    assert answer.eval_duration > 0 and answer.created_at
    same = chat_client.chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=30)
    assert answer.message.content == same.choices[0].message.content


def test_a_streamed_chat_is_ndjson_with_the_same_text(client):
    whole = client.chat(model="smol", messages=ASK, options=GREEDY)
    parts = list(client.chat(model="smol", messages=ASK, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == whole.done_reason
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_generate_lays_the_prompt_out_unless_raw(client, chat_supervisor):
    templated = client.generate(model="smol", prompt=ASK[0]["content"], options=GREEDY)
    chatted = client.chat(model="smol", messages=ASK, options=GREEDY)
    assert templated.response == chatted.message.content
    raw = client.generate(
        model="pair", prompt="The for statement", raw=True, options={"temperature": 0, "num_predict": 12}
    )
    assert raw.response and raw.eval_count == 12 and raw.done_reason == "length"
    # The default pair has no chat template: its prompt goes as it is, raw or not.
    plain = client.generate(model="pair", prompt="The for statement", options={"temperature": 0, "num_predict": 12})
    assert plain.response == raw.response
    parts = list(
        client.generate(
            model="pair", prompt="The for statement", stream=True, options={"temperature": 0, "num_predict": 12}
        )
    )
    assert "".join(p.response for p in parts) == raw.response


def test_format_json_and_a_schema(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    answer = client.chat(model="smol", messages=ASK, format=schema, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(answer.message.content), schema)
    assert client.chat(
        model="smol", messages=ASK, format="json", options={"temperature": 0, "num_predict": 60}
    ).message.content.startswith("{")


def test_a_tool_round_trip(client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 40}},
                    "required": ["city"],
                },
            },
        }
    ]
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat(model="smol", messages=asked, tools=tools, options={"temperature": 0, "num_predict": 200})
    if not first.message.tool_calls:  # auto: the model may answer instead; SmolLM2 calls here
        pytest.fail(f"no tool call: {first.message.content!r}")
    assert first.done_reason == "stop"
    for call in first.message.tool_calls:  # SmolLM2 repeats its call (parallel calls are allowed): each whole
        assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)
    # The agent runs the first call and sends its result back.
    made = {"role": "assistant", "content": "", "tool_calls": [first.message.tool_calls[0].model_dump()]}
    history = [*asked, made, {"role": "tool", "content": '{"temperature": 21}', "tool_name": "get_weather"}]
    answer = client.chat(model="smol", messages=history, tools=tools, options={"temperature": 0, "num_predict": 60})
    assert answer.message.content and not answer.message.tool_calls


def test_a_body_sent_as_curl_sends_it_is_read_as_json(chat_supervisor):
    """Ollama's documented examples use ``curl -d``, which labels the JSON body form-encoded."""
    body = (
        '{"model": "pair", "prompt": "The for statement", "raw": true, "stream": false, "options": {"num_predict": 3}}'
    )
    headers = {"Authorization": f"Bearer {chat_supervisor.token}", "Content-Type": "application/x-www-form-urlencoded"}
    answer = httpx.post(
        f"http://127.0.0.1:{chat_supervisor.http_port}/api/generate", content=body, headers=headers, timeout=60
    )
    assert answer.status_code == 200 and answer.json()["eval_count"] == 3


def test_listings_and_version(client, chat_supervisor):
    names = [m.model for m in client.list().models]
    assert set(names) == {"smol", "pair", "busy", "claude"}
    shown = client.show("smol")
    assert shown.modelinfo["general.architecture"] == "llama" and "completion" in shown.capabilities
    assert {m.model for m in client.ps().models} >= {"smol", "pair"}
    version = httpx.get(f"http://127.0.0.1:{chat_supervisor.http_port}/api/version", timeout=30).json()
    assert version["version"] and version["mlxserve"]


def test_keep_alive_zero_unloads_and_an_empty_request_loads(client):
    unloaded = client.generate(model="busy", keep_alive=0)
    assert unloaded.done_reason == "unload" and "busy" not in {m.model for m in client.ps().models}
    loaded = client.generate(model="busy")
    assert loaded.done_reason == "load" and "busy" in {m.model for m in client.ps().models}


def test_a_model_only_loaded_goes_when_its_keep_alive_has_passed(client, chat_supervisor):
    """A request that only loads a model holds it for no call after it: a short keep_alive unloads it once that
    passes (it was held CLAIM_GRACE, 5 s, from when it began serving, for the call a request that loads it makes)."""

    def loaded() -> bool:
        return chat_supervisor.client.model("busy").pid != 0

    client.generate(model="busy", keep_alive=0)
    assert wait_until(lambda: not loaded(), 10)
    assert client.generate(model="busy", keep_alive="1s").done_reason == "load" and loaded()
    assert wait_until(lambda: not loaded(), 3.5)  # 1 s, and the keep-alive reaper's half-second look
    assert client.generate(model="busy").done_reason == "load" and loaded()  # as the other tests found it


@pytest.mark.parametrize(
    "call, status, words",
    [
        (lambda c: c.chat(model="nope", messages=ASK), 404, "nope"),
        (lambda c: c.chat(model="smol", messages=ASK, options={"mirostat": 2}), 400, "mirostat"),
        (lambda c: c.chat(model="smol", messages=ASK, options={"num_ctx": 8}), 400, "context size (8 tokens)"),
        (lambda c: c.chat(model="smol", messages=ASK, think=True), 400, "think"),
        (lambda c: c.pull("org/model"), 403, 'set pull = "any"'),  # pull = "cached", the default
        (lambda c: c.push("smol"), 501, "not supported here"),
        (lambda c: c.embed(model="smol", input="hi"), 400, "model smol generates text"),
    ],
)
def test_errors_come_in_ollamas_shape(client, call, status, words):
    with pytest.raises(ollama.ResponseError) as caught:
        call(client)
    assert caught.value.status_code == status and words in caught.value.error


def test_ollamas_own_address_serves_the_same(chat_supervisor):
    address = chat_supervisor.ollama_listen
    there = chat_supervisor.ollama(host=f"http://{address}")
    assert (
        there.chat(model="smol", messages=ASK, options=GREEDY).message.content
        == chat_supervisor.ollama().chat(model="smol", messages=ASK, options=GREEDY).message.content
    )


def test_keep_alive_durations_as_ollama_writes_them():
    from common.status import ServiceError
    from supervisor.ollama_api import keep_alive_seconds

    assert [keep_alive_seconds(v) for v in ("5m", "1h30m", "90s", "250ms", "0", 0, 12.5, None)] == [
        300,
        5400,
        90,
        0.25,
        0,
        0,
        12.5,
        None,
    ]
    assert keep_alive_seconds("-1") == keep_alive_seconds(-1) == float("inf")
    for wrong in ("soon", "5 minutes", True, float("nan")):
        with pytest.raises(ServiceError, match="keep_alive"):
            keep_alive_seconds(wrong)


def test_generate_gives_its_context_and_takes_it_back(client):
    """``context``: the prompt's and the answer's tokens, as Ollama gives them; sent back, the next prompt goes on
    from them: the new turn is laid out after the context, as Ollama's /api/generate does."""
    first = client.generate(model="smol", prompt="My name is Ada.", options=GREEDY)
    assert len(first.context) > first.eval_count + 5
    streamed = list(client.generate(model="smol", prompt="My name is Ada.", options=GREEDY, stream=True))
    assert streamed[-1].done and streamed[-1].context == first.context
    second = client.generate(model="smol", prompt="What is my name?", context=first.context, options=GREEDY)
    alone = client.generate(model="smol", prompt="What is my name?", options=GREEDY)
    assert second.context[: len(first.context)] == first.context
    prompt = len(second.context) - second.eval_count  # the context, then the new turn as it is laid out alone
    assert prompt == len(first.context) + len(alone.context) - alone.eval_count
