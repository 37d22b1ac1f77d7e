"""Hostile requests against every HTTP API of the real supervisor: whatever a field holds, the answer is never a
5xx, and an error comes in the API's own shape. Hypothesis puts arbitrary JSON (huge integers, NaN, lone
surrogates, nested values of every type) into one or two fields of a valid request, field by field of each
API's schema; the classes issue #36 found are pinned as cases of their own.

Answers are kept short (lengths are fuzzed only with values that end quickly), and a model that may unload
(``keep_alive``) is never fuzzed into doing so.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import CHAT_TOKEN

HEADERS = {"Authorization": f"Bearer {CHAT_TOKEN}", "content-type": "application/json"}
ASK = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# A valid request per endpoint, and the fields to fuzz (a dotted path into the request).
ENDPOINTS = {
    "/v1/chat/completions": (
        {"model": "smol", "messages": ASK, "max_tokens": 2, "temperature": 0},
        "model messages messages.0 messages.0.role messages.0.content temperature top_p top_k min_p seed stop n "
        "stream stream_options response_format response_format.json_schema tools tool_choice parallel_tool_calls "
        "logit_bias logprobs top_logprobs presence_penalty frequency_penalty repetition_penalty chat_template_kwargs "
        "guided_json guided_regex guided_choice guided_grammar store metadata prediction user prompt_cache_key "
        "safety_identifier verbosity service_tier reasoning_effort",
    ),
    "/v1/completions": (
        {"model": "pair", "prompt": "The", "max_tokens": 2, "temperature": 0},
        "model prompt echo logprobs suffix temperature top_p stop n stream seed logit_bias best_of",
    ),
    "/v1/responses": (
        {"model": "smol", "input": "Hi", "max_output_tokens": 2, "temperature": 0},
        "model input instructions tools tool_choice text text.format metadata include top_logprobs reasoning "
        "truncation previous_response_id store stream temperature top_p parallel_tool_calls user background",
    ),
    "/v1/messages": (
        {"model": "smol", "messages": ASK, "max_tokens": 2, "temperature": 0},
        "model messages messages.0 messages.0.content messages.0.role system stop_sequences temperature top_p "
        "top_k stream tools tool_choice thinking metadata output_config context_management service_tier",
    ),
    "/v1/messages/count_tokens": (
        {"model": "smol", "messages": ASK},
        "model messages messages.0.content system tools tool_choice thinking",
    ),
    "/api/chat": (
        {"model": "smol", "messages": ASK, "stream": False, "options": {"num_predict": 2, "temperature": 0}},
        "model messages messages.0 messages.0.content messages.0.images messages.0.tool_calls format options "
        "options.temperature options.top_p options.top_k options.seed options.stop options.num_ctx "
        "options.repeat_penalty options.mirostat stream think tools",
    ),
    "/api/generate": (
        {"model": "smol", "prompt": "Hi", "stream": False, "options": {"num_predict": 2, "temperature": 0}},
        "model prompt system context raw images suffix template format options options.temperature "
        "options.num_ctx stream",
    ),
}
LENGTHS = {"max_tokens", "max_output_tokens", "max_completion_tokens", "options.num_predict"}
# What a JSON body may hold: every type, with the edges that broke servers (a number no float holds, NaN, a
# lone surrogate, deep nesting).
EDGES = st.sampled_from([10**400, -(10**400), 2**63, -1, 0, float("nan"), float("inf"), "", "\ud800", [], {}, None])
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | EDGES
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# A length is fuzzed with every type but long answers: numbers that end an answer quickly, or not numbers.
LENGTH_VALUES = st.integers(-3, 3) | EDGES.filter(lambda v: not isinstance(v, int) or v <= 3) | st.text(max_size=4)


def put(body: dict, path: str, value) -> dict:
    """``body`` with the field at ``path`` (dotted; digits index lists) set to ``value``; unchanged where an
    earlier change left no such place (a list fuzzed empty, a parent fuzzed into a scalar)."""
    body = json.loads(json.dumps(body))
    parts = path.split(".")
    node = body
    for depth, part in enumerate(parts):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            key = int(part)
        elif isinstance(node, dict):
            key = part
        else:
            return body
        if depth == len(parts) - 1:
            node[key] = value
        else:
            node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    return body


def send(supervisor, path: str, body) -> httpx.Response:
    content = json.dumps(body, allow_nan=True, ensure_ascii=True).encode()  # "\ud800" as the escape JSON allows
    return httpx.post(f"http://127.0.0.1:{supervisor.http_port}{path}", content=content, headers=HEADERS, timeout=120)


def in_its_shape(path: str, answer: httpx.Response) -> None:
    assert answer.status_code < 500, (path, answer.status_code, answer.text[:400])
    if answer.status_code < 400:
        return
    body = answer.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
    elif path.startswith("/api/"):
        assert isinstance(body["error"], str), body
    else:
        assert isinstance(body["error"]["message"], str) and "type" in body["error"], body


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_no_field_of_any_api_gets_a_5xx(chat_supervisor, path):
    base, fields = ENDPOINTS[path]
    fuzzed = fields.split() + sorted(LENGTHS & {*base, *(f"options.{k}" for k in base.get("options", {}))})
    change = st.sampled_from(fuzzed).flatmap(
        lambda field: st.tuples(st.just(field), LENGTH_VALUES if field in LENGTHS else VALUES)
    )

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(st.lists(change, min_size=1, max_size=2))
    def check(changes):
        body = base
        for field, value in changes:
            body = put(body, field, value)
        in_its_shape(path, send(chat_supervisor, path, body))

    check()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"model": "smol", "messages": ASK, "temperature": 10**400}),
        ("/v1/chat/completions", {"model": "smol", "messages": ASK, "top_p": -(10**400)}),
        ("/v1/chat/completions", {"model": "smol", "messages": ASK, "n": 0}),
        ("/v1/chat/completions", {"model": "smol", "messages": ASK, "stop": [""]}),
        ("/v1/chat/completions", {"model": "smol", "messages": ASK, "max_tokens": 2, "metadata": {"a": float("nan")}}),
        ("/api/chat", {"model": "smol", "messages": ASK, "options": {"temperature": 10**400}}),
        ("/api/chat", {"model": "smol", "messages": ASK, "keep_alive": 10**400}),
        ("/api/chat", {"model": "smol", "messages": ASK, "keep_alive": "9" * 400}),
        ("/api/generate", {"model": "smol", "prompt": "Hi", "context": [10**12]}),
        (
            "/v1/responses",
            {"model": "smol", "input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        ),
        ("/v1/responses", {"model": "smol", "input": "Hi", "text": {"format": "json"}}),
        ("/v1/responses", {"model": "smol", "input": "Hi", "max_output_tokens": 2, "metadata": {"a": float("nan")}}),
        ("/v1/messages", {"model": "smol", "messages": ASK, "max_tokens": 2, "temperature": float("inf")}),
        ("/v1/chat/completions", [1, 2, 3]),
        ("/v1/chat/completions", "[" * 5000 + "]" * 5000),
    ],
)
def test_the_classes_issue_36_found_are_each_a_400(chat_supervisor, path, body):
    if isinstance(body, str):  # a body nested thousands deep, sent as it is
        answer = httpx.post(
            f"http://127.0.0.1:{chat_supervisor.http_port}{path}", content=body, headers=HEADERS, timeout=60
        )
    else:
        answer = send(chat_supervisor, path, body)
    in_its_shape(path, answer)
    assert answer.status_code == 400, answer.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_schema_that_admits_nothing_is_a_400_not_an_empty_answer(chat_supervisor, path):
    endless = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    request = {"model": "smol", "messages": ASK, "max_tokens": 16}
    if path == "/v1/chat/completions":
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": endless}}
    else:
        request.update(tool_choice={"type": "any"}, tools=[{"name": "f", "input_schema": endless}])
    answer = send(chat_supervisor, path, request)
    assert answer.status_code == 400 and "admits no answer" in answer.text, answer.text
